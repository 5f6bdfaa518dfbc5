"""A pipeline plan as Megatron-LM's training arguments (``pretrain_gpt.py``; names as in Megatron-LM's
``megatron/training/arguments.py``).

For ``pp`` stages (``x chunks`` under the interleaved schedule) of one ``dp x tp`` grid, batch ``B`` in ``m``
micro-batches of ``b`` samples across dp, ``N`` repeated layers:

- ``--tensor-model-parallel-size tp --pipeline-model-parallel-size pp``; Megatron-LM derives dp = world / (tp x pp);
- ``--micro-batch-size b / dp --global-batch-size B`` (it runs B / (b/dp x dp) = m micro-batches);
- stages: even (N / (pp x chunks) layers each, the embedding on the first, the head and loss on the last) is
  Megatron-LM's default split, with ``--num-layers-per-virtual-pipeline-stage N / (pp x chunks)`` when interleaved;
  uneven stages are ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a layer, ``L`` head and loss, ``|``
  between stages, in stage order: stage s on rank s mod pp), which needs Megatron-LM core 0.13 or later;
- recomputation: every layer whole is ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1``; the attention core of every layer is ``--recompute-granularity selective``; c whole
  layers per stage is ``--recompute-method block --recompute-num-layers c`` (the first c of each stage);
- ZeRO 1 is ``--use-distributed-optimizer`` (sharded optimizer state, whole gradients reduce-scattered once);
  ZeRO 2 and 3 are Megatron-FSDP (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` or
  ``optim_grads_params``, with the ``fsdp_dtensor`` checkpoint format it requires); data-parallel collectives
  overlap the backward as the estimate simulates them (``--overlap-grad-reduce``, and ``--overlap-param-gather``
  with sharded weights);
- ``--sequence-parallel``; ``--expert-model-parallel-size ep`` (experts split over ep data-parallel ranks);
  ``--bf16`` or ``--fp16``; the model's shape (`megatron_model_arguments`).
"""

from __future__ import annotations

from autopar.export.chain import (
    StageView, choose_grid, intra_warnings, is_layer, rank_micro_batch, recompute_text, require_pipeline,
    runs_warning, stage_views,
)
from autopar.export.models import megatron_model_arguments
from autopar.export.result import Approximation, Export, Target, Value
from autopar.plan import Plan
from autopar.zoo import ModelConfig

_NAME = "Megatron-LM"
_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}


def to_megatron(plan: Plan, *, model: ModelConfig | None = None) -> Export:
    """Megatron-LM's arguments that run ``plan`` (``model``: the plan's model, for its shape flags)."""
    require_pipeline(plan, _NAME)
    views = stage_views(plan)
    dp, tp, warnings = choose_grid(views, target=_NAME)
    warnings += intra_warnings(plan, views, target=_NAME)
    layers = sum(len(v.layers) for v in views)
    seq = plan.workload.seq if plan.workload else (model.seq if model else 0)
    batch = plan.workload.batch if plan.workload else plan.micro_batch_size * plan.micro_batches
    args, found = megatron_model_arguments(model, layers, seq, plan.model)
    warnings += found
    args += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(plan.pp)]
    stage_args, found, notes = _stages(plan, views, layers)
    args += stage_args
    warnings += found
    args += ["--micro-batch-size", str(rank_micro_batch(plan, dp)), "--global-batch-size", str(batch)]
    recompute, found, more = _recompute(views)
    args += recompute
    warnings += found
    notes += more
    args += _data_parallel(plan.zero, dp)
    args += ["--sequence-parallel"] if plan.sp else []
    args += ["--expert-model-parallel-size", str(plan.ep)] if plan.ep > 1 else []
    dtype = plan.workload.dtype if plan.workload else "bf16"
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(dtype, [])
    if plan.schedule == "gpipe" and plan.pp > 1:
        warnings.append(Approximation(feature="schedule", plan="GPipe (all forwards, then all backwards)",
                                      closest="Megatron-LM's 1F1B: the same bubble, fewer micro-batches' "
                                      "activations held (less memory)"))
    notes.append(f"kernels: the plan was priced with {plan.kernels} kernels; Megatron-LM runs its own fused kernels "
                 "(bias-activation, bias-dropout-add, softmax), so expect its step to differ from the estimate")
    if tp > 1 or plan.zero > 1:
        notes.append("environment: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM requires it with tp > 1 before "
                     "Blackwell)" if plan.zero < 2 or dp == 1 else "environment: leave CUDA_DEVICE_MAX_CONNECTIONS "
                     "unset (Megatron-FSDP refuses 1)")
    if model is not None:
        notes.append(f"the vocabulary ({model.vocab} in the plan) comes from your tokenizer; Megatron-LM pads it to "
                     "a multiple of 128 x tp")
    notes.append("data, tokenizer, optimizer and checkpoint arguments are yours to add")
    return Export(target=Target.MEGATRON, arguments=tuple(args), settings=_settings(args),
                  degrees=(("pp", plan.pp), ("dp", dp), ("tp", tp)), warnings=tuple(warnings), notes=tuple(notes))


def _settings(args: list[str]) -> tuple[tuple[str, Value], ...]:
    """Flags and their values (a flag without one: true)."""
    out: list[tuple[str, Value]] = []
    for k, token in enumerate(args):
        if token.startswith("--"):
            value = args[k + 1] if k + 1 < len(args) and not args[k + 1].startswith("--") else True
            out.append((token, int(value) if isinstance(value, str) and value.isdigit() else value))
    return tuple(out)


def _stages(plan: Plan, views: tuple[StageView, ...], layers: int) -> tuple[list[str], list[Approximation],
                                                                               list[str]]:
    """Megatron-LM's stage split: its default (even), layers per virtual stage, or a custom layout."""
    if plan.pp == 1:
        return [], [], []
    found = _tail(views)
    counts = [len(v.layers) for v in views]
    if len(set(counts)) == 1:
        per = counts[0]
        return (["--num-layers-per-virtual-pipeline-stage", str(per)] if plan.chunks > 1 else []), found, []
    last = len(views) - 1
    layout = "|".join(("E" if k == 0 else "") + (f"t*{c}" if c > 1 else "t" * c) + ("L" if k == last else "")
                      for k, c in enumerate(counts))
    return (["--pipeline-model-parallel-layout", layout], found,
            [f"uneven stages ({', '.join(map(str, counts))} layers) are written as --pipeline-model-parallel-layout, "
             "which needs Megatron-LM core 0.13 or later"])


def _tail(views: tuple[StageView, ...]) -> list[Approximation]:
    """Megatron-LM runs the final norm, the head and the loss on the last stage: rows after the last layer that the
    plan puts on an earlier stage move there."""
    rows = [(v.index, r) for v in views for r in v.rows]
    last = max((i for i, (_, r) in enumerate(rows) if is_layer(r)), default=-1)
    early = [(k, r) for k, r in rows[last + 1:] if k != views[-1].index]
    if not early:
        return []
    text = ", ".join(f"{r or '<root>'} (stage {k})" for k, r in early)
    return [Approximation(feature="stages", plan=f"{text} before the last stage",
                          closest="Megatron-LM computes the final norm, the head and the loss on the last stage")]


def _recompute(views: tuple[StageView, ...]) -> tuple[list[str], list[Approximation], list[str]]:
    layers = sum(len(v.layers) for v in views)
    full = [[r for r in v.full if is_layer(r)] for v in views]
    selective = [[r for r in v.selective if is_layer(r)] for v in views]
    others = [r for v in views for r in (*v.full, *v.selective) if not is_layer(r)]
    found = runs_warning(views, closest="each layer of a run recomputed on its own, "
                         "which keeps one input per layer rather than one per run (more memory than the plan)")
    asked = f"full: {recompute_text(views, 'full')}; selective: {recompute_text(views, 'selective')}"
    if others:
        found.append(Approximation(feature="recompute", plan=f"rows outside the layers recomputed: "
                                   f"{', '.join(others[:3])}", closest="kept: Megatron-LM recomputes inside "
                                   "transformer layers only (more memory than the plan)"))
    if not any(full) and not any(v.runs for v in views):
        if not any(selective):
            return [], found, []
        if sum(map(len, selective)) != layers:
            found.append(Approximation(feature="recompute", plan=f"the attention core recomputed in "
                                       f"{sum(map(len, selective))} of {layers} layers ({asked})",
                                       closest="--recompute-granularity selective, in every layer: more "
                                       "recomputation than the plan priced (slower), less memory"))
        return ["--recompute-granularity", "selective"], found, []
    if sum(map(len, full)) == layers:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], \
            found, []
    whole = [len(set(f) | set(s) | _in_runs(v)) for f, s, v in zip(full, selective, views)]
    count, notes = max(whole), []
    if len(set(whole)) > 1 or any(selective) or any(v.runs for v in views):
        found.append(Approximation(feature="recompute", plan=f"per-layer recomputation ({asked})",
                                   closest=f"--recompute-method block --recompute-num-layers {count}: the first "
                                   f"{count} layers of every stage recomputed whole, more than the plan in some "
                                   "stages (slower), no more memory"))
    elif any(tuple(f) != v.layers[:len(f)] for f, v in zip(full, views)):
        notes.append(f"Megatron-LM's block method recomputes the first {count} layers of each stage where the plan "
                     "names others of the stage: the same count, the same time and memory")
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(count)], \
        found, notes


def _in_runs(view: StageView) -> set[str]:
    inside: set[str] = set()
    for first, last in view.runs:
        a, b = view.rows.index(first), view.rows.index(last)
        inside |= {r for r in view.rows[a:b + 1] if is_layer(r)}
    return inside


def _data_parallel(zero: int, dp: int) -> list[str]:
    if dp == 1:
        return []
    if zero == 0:
        return ["--overlap-grad-reduce"]
    if zero == 1:
        return ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", _SHARDING[zero], "--ckpt-format",
            "fsdp_dtensor", "--overlap-grad-reduce", "--overlap-param-gather"]
