"""A pipeline plan as torchtitan 0.3's trainer takes it: command-line overrides of its ``Trainer.Config``.

torchtitan 0.3 builds its configuration in Python (``--module llama3 --config llama3_70b`` names a config function)
and reads overrides from the command line (tyro); it reads no TOML or JSON file. So the export is those overrides,
token by token (``Export.arguments``), and the values they set by their dotted names (``Export.settings``, the JSON
form). The mapping, for a plan of ``pp`` stages on one grid of ``dp x tp`` devices, batch ``B`` in ``m`` micro-batches
of ``b`` samples across dp:

- ``parallelism.pipeline_parallel_degree = pp``, ``tensor_parallel_degree = tp``, ``enable_sequence_parallel = sp``
  (torchtitan's default is on: always written);
- ZeRO 0: ``data_parallel_replicate_degree = dp``, ``data_parallel_shard_degree = 1`` (weights, gradients and
  optimizer state replicated); ZeRO 1-2: ``data_parallel_shard_degree = dp`` with ``fsdp_reshard_after_forward
  = never`` (weights gathered from forward to backward); ZeRO 3: the same with ``always``. Under a pipeline,
  torch's schedule accumulates whole gradients and reduce-scatters them after the last micro-batch, which is ZeRO
  1; without one, torchtitan's accumulation loop reduce-scatters after each micro-batch, which is ZeRO 2: the
  other case of each is an `Approximation`;
- ``training.local_batch_size = b / dp x (m if pp > 1 else 1)`` (a pipeline's micro-batches are one local batch),
  ``parallelism.pipeline_parallel_microbatch_size = b / dp``, ``training.global_batch_size = B`` (torchtitan
  accumulates ``B / (local x dp)`` steps: m without a pipeline, 1 with one);
- ``parallelism.pipeline_parallel_schedule``: 1F1B, GPipe or Interleaved1F1B; ``module_fqns_per_model_part``: each
  stage's modules by torchtitan's names (its llama3 model), in stage order (stage s runs on rank s mod pp, as
  autopar's interleaved schedule places it), uneven stages included;
- ``activation-checkpoint:none|full|selective`` (one policy for every block), ``compile.enable`` for compiled
  kernels, ``training.mixed_precision_param`` for the dtype, ``training.disable_cuda_graphs`` under a pipeline
  (torchtitan requires it there);
- expert parallelism over ZeRO 0's replicated ranks is not written: torchtitan's ``expert_parallel_degree`` takes
  its ranks from FSDP's shard degree, which ZeRO 0 leaves at 1 (an `Approximation`: experts on every rank).
"""

from __future__ import annotations

from autopar.export.chain import (
    StageView, choose_grid, intra_warnings, is_layer, rank_micro_batch, recompute_text, require_pipeline,
    runs_warning, stage_views,
)
from autopar.export.models import TITAN_MODULE, is_llama, titan_config, titan_name
from autopar.export.result import Approximation, Export, Target, Value
from autopar.plan import Plan
from autopar.zoo import ModelConfig

SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
_NAME = "torchtitan"


def to_torchtitan(plan: Plan, *, model: ModelConfig | None = None) -> Export:
    """The overrides of torchtitan's ``Trainer.Config`` that run ``plan`` (``model``: the plan's model, from its
    workload, to name torchtitan's config and modules; without it no ``--module/--config`` is written)."""
    require_pipeline(plan, _NAME)
    views = stage_views(plan)
    dp, tp, warnings = choose_grid(views, target=_NAME)
    warnings += intra_warnings(plan, views, target=_NAME)
    config, found = titan_config(model, plan.model)
    warnings += found
    replicate, shard, reshard, found = _data_parallel(plan, dp)
    warnings += found
    if plan.ep > 1 and shard < plan.ep:
        warnings.append(Approximation(
            feature="ep", plan=f"each mixture's experts split over {plan.ep} data-parallel ranks, under ZeRO 0",
            closest="not written: torchtitan's parallelism.expert_parallel_degree takes its ranks from FSDP's "
            "data_parallel_shard_degree, 1 here; every rank holds every expert (more memory, no all-to-alls)"))
    settings: list[tuple[str, Value]] = [
        ("parallelism.data_parallel_replicate_degree", replicate), ("parallelism.data_parallel_shard_degree", shard)]
    if plan.ep > 1 and shard >= plan.ep:  # under ZeRO 1-3 FSDP's ranks are the plan's dp, which ep is
        settings.append(("parallelism.expert_parallel_degree", plan.ep))
    if reshard:
        settings.append(("parallelism.fsdp_reshard_after_forward", reshard))
    settings += [("parallelism.tensor_parallel_degree", tp), ("parallelism.enable_sequence_parallel", plan.sp),
                 ("parallelism.pipeline_parallel_degree", plan.pp)]
    settings += _pipeline(plan, views, dp, known=is_llama(model), warnings=warnings)
    settings += _training(plan, dp, warnings)
    mode, found = _checkpointing(views)
    warnings += found
    arguments = ["--module", TITAN_MODULE, "--config", config.name] if config else []
    arguments += [token for name, value in settings for token in _tokens(name, value)]
    arguments.append(f"activation-checkpoint:{mode}")  # a subcommand: last, after every option
    notes = ["torchtitan 0.3 reads its configuration from Python config functions and these command-line "
             "overrides (no TOML): pass them to torchtitan.train (torchrun ... -m torchtitan.train ARGUMENTS)"]
    return Export(target=Target.TORCHTITAN, arguments=tuple(arguments),
                  settings=(*settings, ("activation_checkpoint", mode)),
                  degrees=(("pp", plan.pp), ("dp_replicate", replicate), ("dp_shard", shard), ("tp", tp)),
                  warnings=tuple(warnings), notes=tuple(notes))


def _tokens(name: str, value: Value) -> list[str]:
    if isinstance(value, bool):  # tyro's flag pair: --x.flag / --x.no_flag
        section, _, field = name.rpartition(".")
        return [f"--{section}.{field}" if value else f"--{section}.no_{field}"]
    if isinstance(value, tuple):  # list[list[str]]: one comma-joined token per inner list
        return [f"--{name}", *(",".join(part) for part in value)]
    return [f"--{name}", str(value)]


def _data_parallel(plan: Plan, dp: int) -> tuple[int, int, str | None, list[Approximation]]:
    """(replicate degree, shard degree, reshard-after-forward policy, approximations) for the plan's ZeRO stage."""
    if dp == 1 or plan.zero == 0:
        return dp, 1, None, []
    reshard = "always" if plan.zero == 3 else "never"
    accumulating = plan.micro_batches > 1
    piped = plan.pp > 1
    text = None
    if plan.zero == 1 and accumulating and not piped:
        text = ("torchtitan's accumulation loop reduce-scatters gradients after each of the "
                f"{plan.micro_batches} micro-batches (ZeRO 2): less gradient memory, {plan.micro_batches}x the "
                "reduce-scatters")
    elif plan.zero == 2 and accumulating and piped:
        text = ("torch's pipeline schedule keeps whole gradients until the last micro-batch and reduce-scatters "
                "once (ZeRO 1): more gradient memory than the plan's, fewer reduce-scatters")
    elif plan.zero == 3 and accumulating and piped:
        text = ("torch's pipeline schedule leaves a stage's weights gathered from each backward to the next forward "
                "(it resets reshard-after-backward for every micro-batch but the last): more weight memory at times")
    found = [] if text is None else [Approximation(
        feature="zero", plan=f"ZeRO {plan.zero} over dp {dp}, {plan.micro_batches} micro-batches"
        f"{' in a pipeline' if piped else ''}",
        closest=f"data_parallel_shard_degree {dp}, fsdp_reshard_after_forward {reshard}: {text}")]
    return 1, dp, reshard, found


def _pipeline(plan: Plan, views: tuple[StageView, ...], dp: int, *, known: bool,
              warnings: list[Approximation]) -> list[tuple[str, Value]]:
    if plan.pp == 1:
        return []
    settings: list[tuple[str, Value]] = [
        ("parallelism.pipeline_parallel_schedule", SCHEDULES[plan.schedule]),
        ("parallelism.pipeline_parallel_microbatch_size", rank_micro_batch(plan, dp))]
    if known:
        parts, found = _model_parts(views)
        warnings += found
        settings.append(("parallelism.module_fqns_per_model_part", parts))
    return settings


def _model_parts(views: tuple[StageView, ...]) -> tuple[tuple[tuple[str, ...], ...], list[Approximation]]:
    """Each stage's torchtitan modules. torchtitan computes the loss on the last stage from ``lm_head``'s output,
    so a head the plan puts on an earlier stage moves there (with the norm after it), which is listed."""
    parts, unknown = [], []
    for v in views:
        names = []
        for row in v.rows:
            known, name = titan_name(row)
            if name is not None:
                names.append(name)
            unknown += [] if known else [row]
        parts.append(names)
    if unknown:
        raise ValueError(f"rows {unknown[:3]} have no torchtitan llama3 module: is this a LLaMA model?")
    found = []
    head = next((k for k, names in enumerate(parts) if "lm_head" in names), len(parts) - 1)
    if head != len(parts) - 1:
        cut = parts[head].index("norm") if "norm" in parts[head] else parts[head].index("lm_head")
        moved = parts[head][cut:]
        parts[head], parts[-1] = parts[head][:cut], moved + parts[-1]
        found.append(Approximation(
            feature="stages", plan=f"{', '.join(moved)} on stage {head}, the loss on stage {len(parts) - 1}",
            closest=f"{', '.join(moved)} on the last stage, where torchtitan computes the loss"))
    return tuple(tuple(p) for p in parts), found


def _training(plan: Plan, dp: int, warnings: list[Approximation]) -> list[tuple[str, Value]]:
    per_rank = rank_micro_batch(plan, dp)
    local = per_rank * plan.micro_batches if plan.pp > 1 else per_rank
    dtype = _DTYPES.get(plan.workload.dtype if plan.workload else "bf16")
    if dtype is None:
        warnings.append(Approximation(feature="dtype", plan="fp16 mixed precision",
                                      closest="training.mixed_precision_param bfloat16 (torchtitan has no fp16)"))
        dtype = "bfloat16"
    settings: list[tuple[str, Value]] = [("training.local_batch_size", local)]
    if plan.workload is not None:
        settings += [("training.global_batch_size", plan.workload.batch), ("training.seq_len", plan.workload.seq)]
    else:
        settings.append(("training.global_batch_size", plan.micro_batch_size * plan.micro_batches))
    settings.append(("training.mixed_precision_param", dtype))
    if plan.pp > 1:
        settings.append(("training.disable_cuda_graphs", True))
    settings.append(("compile.enable", plan.kernels == "compiled"))
    return settings


def _checkpointing(views: tuple[StageView, ...]) -> tuple[str, list[Approximation]]:
    """torchtitan's one policy for every transformer block: none, full, or selective (op-level: saves matmul and
    attention outputs, recomputes the rest) from the plan's per-layer choice."""
    layers = sum(len(v.layers) for v in views)
    full = sum(is_layer(r) for v in views for r in v.full)
    selective = sum(is_layer(r) for v in views for r in v.selective)
    runs = any(v.runs for v in views)
    others = [r for v in views for r in (*v.full, *v.selective) if not is_layer(r)]
    if not (full or selective or runs or others):
        return "none", []
    mode = "selective" if selective and not (full or runs or any(v.full for v in views)) else "full"
    found = runs_warning(views, closest="activation-checkpoint:full: every block checkpointed on its own, which "
                         "keeps one input per block rather than one per run (more memory than the plan)")
    asked = f"full: {recompute_text(views, 'full')}; selective: {recompute_text(views, 'selective')}"
    if mode == "selective":
        found.append(Approximation(
            feature="recompute", plan=f"the attention core recomputed in {selective} of {layers} layers "
            f"({recompute_text(views, 'selective')})",
            closest="activation-checkpoint:selective on every block: torchtitan's op-level policy keeps matmul and "
            "attention outputs and recomputes the rest; its memory and time differ from the estimate "
            "(activation-checkpoint:full holds less)"))
    elif full != layers or selective or others:
        found.append(Approximation(
            feature="recompute", plan=f"per-layer recomputation ({asked})",
            closest=f"activation-checkpoint:full on all {layers} blocks: more recomputation than the plan priced "
            "(slower), no more memory"))
    return mode, found
