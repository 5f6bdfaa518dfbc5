"""Everything the runtime checks about a plan before any rank starts: `autopar run` and `autopar dryrun` call the
same `check_runnable`, so they accept and refuse the same plans.

A `Plan` is already consistent in itself (`autopar.plan`). What needs the model is checked here, on the model
built on the meta device (no memory) and traced once (the model its workload names, or for a plan made from Python
the model it was made for: `autopar.runtime.source`):

- the runtime can apply the plan's kind (`check_supported`) and the plan carries its workload or is given its model;
- a plan with compiled kernels finds ``torch.compile`` working on this machine (`check_compiler`);
- every module and parameter the plan names exists, with the planned shape (`check_matches`);
- the stages cover the model's chain of layers in order, each layer once (`autopar.search.pipeline.config_of`);
- every split dimension divides by the devices that split it, and attention heads (and key/value heads) divide by
  tp, since the runtime gives each tp rank whole heads;
- no BatchNorm under data parallelism or micro-batching: its statistics would be taken over a rank's slice of a
  micro-batch instead of the whole batch, which is not what one process trains;
- recomputation and checkpointed runs apply, and pipeline stages cut where the runtime can cut the model;
- a single-stage plan applies and trains a step on a fake process group of its full size (`rehearsal`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from autopar.capture import Graph
from autopar.plan import Plan
from autopar.runtime.apply import check_matches, check_supported, checkpoint_segments, parallelize, recompute
from autopar.runtime.source import ModelSource
from autopar.runtime.train import LEARNING_RATE, Workload


def check_runnable(plan: Plan, *, rehearse: bool = True, source: ModelSource | None = None) -> None:
    """Raise ValueError (or NotImplementedError for what the runtime cannot apply yet) naming the module and the
    reason if ``plan`` cannot train exactly what one process trains. With ``rehearse``, a single-stage plan is
    also applied and stepped once on a fake process group of its full size (`rehearsal`), so that what would fail
    on the ranks fails here, before any starts. ``source``: the model the plan is for (default: the one its
    workload names, as `autopar run` builds it)."""
    from autopar.runtime.pipeline import stage_layers

    check_supported(plan)
    source = source or ModelSource.of_workload(Workload.of(plan))
    if plan.kernels == "compiled":
        check_compiler()
    # the model as the runtime trains it, and (its chain of layers) as the planner traced it
    model = source.meta()
    check_matches(model, plan)
    _check_chain(plan, source.chain())
    _check_divisible(model, plan)
    _check_batch_norm(model, plan)
    for stage in plan.stages:  # on the meta model, which is thrown away: the runtime's own checks
        recompute(model, dict(stage.recompute))
    checkpoint_segments(model, [list(segment) for stage in plan.stages for segment in stage.segments])
    if plan.pp > 1:
        stage_layers(model, plan)
    elif rehearse:
        rehearsal(plan, source=source)


def check_compiler() -> None:
    """Raise NotImplementedError if ``torch.compile`` does not work here (inductor needs a C++ compiler on CPU,
    Triton on GPU): a small function is compiled and run on the device the ranks use, so that a plan with compiled
    kernels is refused before any rank starts rather than failing on every rank."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.compile(_probe, fullgraph=True)(torch.ones(8, device=device))
    except Exception as exc:  # noqa: BLE001 - whatever the compiler stack raised: it does not work here
        text = str(exc).strip().splitlines()
        raise NotImplementedError(f"the plan runs compiled kernels, but torch.compile does not work on this machine "
                                  f"({type(exc).__name__}: {text[0] if text else ''}); plan with --kernels "
                                  "eager") from None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x * 2 + 1)


def rehearsal(plan: Plan, *, count: bool = False, source: ModelSource | None = None) -> list[dict[str, Any]] | None:
    """Apply a single-stage ``plan`` as rank 0 of a fake process group of the plan's world size, on fake tensors
    (no memory, no arithmetic), and run one training step; with ``count``, the collectives rank 0 issued.
    ``source``: the model the plan is for (default: its workload's).

    The model is built on the meta device and parallelised exactly as `autopar run` does, except that DDP, whose
    constructor reads weight values, is replaced by the by-hand all-reduce in the same buckets, and that a plan's
    compiled layers run eager (`check_compiler` checks the compiler; recomputation then replays whole layers, as
    compiled ones do). Any error is raised as a
    ValueError that says the plan could not be applied."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from autopar.runtime.comm import CollectiveCounter

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs its own fake process group; a process group is already initialised")
    source = source or ModelSource.of_workload(Workload.of(plan))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.devices)
    try:
        model = source.meta()
        parallel = parallelize(model, plan, ddp=False, compile=False)  # kernels: the preflight in `check_runnable`
        where = _track_modules(parallel.module)
        with FakeTensorMode(allow_non_fake_inputs=True):
            _materialise(parallel.module)  # FSDP and DTensor shard meta weights; their shards become fakes here
            optimizer = parallel.make_optimizer(torch.optim.SGD, lr=LEARNING_RATE)
            counter = CollectiveCounter(parallel.axes)
            # layers stay eager here; a compiled layer's recomputation replays its whole forward (one compiled
            # function), which checkpointing without early stop does too, collectives alike
            whole = plan.kernels == "compiled"
            with counter if count else contextlib.nullcontext(), set_checkpoint_early_stop(not whole):
                parallel.forward_backward(source.batch(plan.micro_batch_size * plan.micro_batches))  # as rank 0
                optimizer.step()
    except (ValueError, NotImplementedError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever PyTorch raised: the plan does not apply to this model
        text = str(exc).strip().splitlines()
        inside = f" in module {where[-1]!r}" if "where" in locals() and where else ""
        raise ValueError(f"the plan fails{inside} when applied on a fake process group of {plan.devices} ranks: "
                         f"{type(exc).__name__}: {text[0] if text else ''}") from None
    finally:
        dist.destroy_process_group()
    return counter.summary() if count else None


def _track_modules(root: nn.Module) -> list[str]:
    """The names of the modules whose forward is running, innermost last (hooks on every module), so that an
    error raised by PyTorch inside a forward can name the module it came from."""
    stack: list[str] = []

    def leave(*_: Any) -> None:  # returns None: a forward hook's return value would replace the output
        if stack:
            stack.pop()

    for name, module in root.named_modules():
        module.register_forward_pre_hook(lambda *_, n=name or "<root>": stack.append(n))
        module.register_forward_hook(leave)
    return stack


def _materialise(module: nn.Module) -> None:
    """Meta weights to fake ones, keeping weights that several modules share shared."""
    owners = [(m, key, p) for m in module.modules() for key, p in m._parameters.items() if p is not None]
    module.to_empty(device="cpu")
    first: dict[int, nn.Parameter] = {}
    for m, key, old in owners:
        if id(old) in first:
            m._parameters[key] = first[id(old)]
        else:
            first[id(old)] = m._parameters[key]


def _check_chain(plan: Plan, graph: Graph) -> None:
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineModel
    from autopar.search.pipeline import config_of

    model = PipelineModel(graph, load_cluster("cpu").with_devices(plan.devices), traced_batch=1, dtype="fp32")
    config_of(model, plan)


def _check_divisible(model: nn.Module, plan: Plan) -> None:
    """Tensor-parallel splits must be even (each tp rank computes its part of the layer); FSDP's dp shards may be
    uneven, since FSDP2 pads them."""
    tp = plan.grid[1] if plan.is_pipeline else 1
    if tp == 1:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    for entry in plan.modules:
        for layout in entry.params:
            shape, placement = params[layout.name].shape, layout.on(1)
            if isinstance(placement, Shard) and shape[placement.dim] % tp:
                raise ValueError(f"parameter {layout.name!r} is split on dim {placement.dim} ({shape[placement.dim]}) "
                                 f"over tp {tp}, which does not divide it")
    for name, module in model.named_modules():
        for attribute in ("heads", "kv_heads", "num_attention_heads", "num_key_value_heads"):
            count = getattr(module, attribute, None)
            if isinstance(count, int) and count % tp:
                raise ValueError(f"module {name or '<root>'!r} has {count} {attribute.replace('num_', '')}, which tp "
                                 f"{tp} does not divide: each tp rank takes whole heads")
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, attribute, None)
        if isinstance(count, int) and count % tp:
            raise ValueError(f"the model's config has {attribute} {count}, which tp {tp} does not divide: each tp "
                             "rank takes whole heads")


def _check_batch_norm(model: nn.Module, plan: Plan) -> None:
    dp = plan.grid[0] if plan.is_pipeline else plan.devices
    if dp == 1 and plan.micro_batches == 1:
        return
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            why = f"data parallelism over {dp} ranks" if dp > 1 else f"{plan.micro_batches} micro-batches"
            raise ValueError(f"module {name!r} is a {type(module).__name__}: under {why} it would normalise over a "
                             "slice of the batch, not the whole batch one process sees; plan with dp 1 and one "
                             "micro-batch, or replace it (SyncBatchNorm, LayerNorm, GroupNorm)")
