"""Everything the runtime checks about a plan before any rank starts: `autopar run` and `autopar dryrun` call the
same `check_runnable`, so they accept and refuse the same plans.

A `Plan` is already consistent in itself (`autopar.plan`). What needs the model is checked here, on the model
built on the meta device (no memory) and traced once (the model its workload names, or for a plan made from Python
the model it was made for: `autopar.runtime.source`):

- the runtime can apply the plan's kind (`check_supported`) and the plan carries its workload or is given its model;
- a plan with compiled kernels finds ``torch.compile`` working on this machine (`check_compiler`);
- every module and parameter the plan names exists, with the planned shape (`check_matches`);
- the stages cover the model's chain of layers in order, each layer once (`autopar.search.pipeline.config_on`);
- every split dimension divides by the devices that split it, and attention heads (and key/value heads) divide by
  tp, since the runtime gives each tp rank whole heads;
- no projection that tp splits by output features has its output cut along those features by the model's own code
  (a fused QKV ``Linear(h, 3h)`` followed by ``.split(h, dim=-1)``, ``.chunk(3, -1)`` or a slice) before the heads are
  formed: each rank's shard would be cut in the wrong places, a different model (`_check_split_outputs`), nor a
  replicated parameter applied to the activations tp splits (q and k norms per head), directly or through ops on
  the parameter alone (Gemma's ``1 + weight``), whose gradient the runtime does not sum over tp
  (`_check_replicated_inside`);
- where a block normalises its own input before its column linears, those columns read that norm's output, which
  the runtime hands them as their one replicated input (`_check_shared_inputs`);
- no BatchNorm under data parallelism or micro-batching: its statistics would be taken over a rank's slice of a
  micro-batch instead of the whole batch, which is not what one process trains;
- recomputation and checkpointed runs apply, and pipeline stages cut where the runtime can cut the model;
- a single-stage plan applies and trains a step on a fake process group of its full size (`rehearsal`), running
  one layer of each kind (`autopar.runtime.thin`), so that the check of a 1,000-layer model takes seconds; under
  tp each rank's attention must run on its share of the traced model's heads, over the whole sequence (a model
  that forms heads from its full head count, as OPT's ``view(bsz, -1, num_heads, head_dim)`` does, would fold a
  rank's features into the sequence), and the collectives that step issues must be those the cost model predicts
  for the same shortened model (`_check_stage`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.capture import CaptureError, Graph
from autopar.capture.tracer import fake_errors_quiet, quiet_log
from autopar.capture.graph import multi_query_attentions
from autopar.cost.layers import computed_from_state
from autopar.plan import Plan
from autopar.plan.batch import split_batch
from autopar.runtime.apply import (
    check_matches, check_supported, checkpoint_segments, column_groups, fused_pieces, norms_before_columns,
    out_features_dim, parallelize, recompute, split_norms, tensor_parallel_placements, tp_partial_names, tp_role,
    whole_attentions,
)
from autopar.runtime.intra import laid_out_layers, megatron_part
from autopar.runtime.source import ModelSource
from autopar.runtime.thin import thin
from autopar.runtime.train import LEARNING_RATE, Workload


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions. They are keyed by device meshes, which compare equal whatever
    the rank they were made on (the same layout of all ranks), and they hold those meshes: after a rehearsal as
    one rank, a rehearsal as another would find the first rank's meshes there, and issue its collectives on the
    first rank's process groups. (`autopar run` makes one mesh per process; the caches serve it as they are.)"""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    sharding = getattr(getattr(propagator, "propagate_op_sharding", None), "cache", None)
    if hasattr(sharding, "cache_clear"):
        sharding.cache_clear()
    meta = getattr(type(propagator), "_propagate_tensor_meta_cached", None)  # cached per class
    if hasattr(meta, "cache_clear"):
        meta.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own cache
    if native is not None:
        native()


def _pipeline_example(plan: Plan, source: ModelSource, model: nn.Module) -> dict[str, torch.Tensor]:
    """One micro-batch of a rank's input to the first stage (token ids, images, or what a model of one's own takes
    first) on the meta device: the shapes a pipeline's stages are built for."""
    from autopar.runtime.apply import PIPELINE_FIRST
    from autopar.runtime.pipeline import chain_kind, make_stage, stage_layers

    batch = source.batch(plan.micro_batch_size)
    if chain_kind(model) == "fx":
        name = make_stage(model, stage_layers(model, plan), 0).inputs
    else:
        name = next(k for k in PIPELINE_FIRST if k in batch)
    rows = plan.micro_batch_size // plan.grid[0]
    return {name: torch.empty((rows, *batch[name].shape[1:]), dtype=batch[name].dtype, device="meta")}


def check_runnable(plan: Plan, *, rehearse: bool = True, source: ModelSource | None = None) -> None:
    """Raise ValueError (or NotImplementedError for what the runtime cannot apply yet) naming the module and the
    reason if ``plan`` cannot train exactly what one process trains. With ``rehearse``, a single-stage plan is
    also applied and stepped once on a fake process group of its full size (`rehearsal`), so that what would fail
    on the ranks fails here, before any starts. ``source``: the model the plan is for (default: the one its
    workload names, as `autopar run` builds it)."""
    from autopar.runtime.pipeline import check_stage_forward, stage_layers

    check_supported(plan)
    source = source or ModelSource.of_workload(Workload.of(plan))
    if plan.kernels == "compiled":
        check_compiler()
    # the model as the runtime trains it, and (its chain of layers) as the planner traced it
    model = source.meta()
    check_matches(model, plan)
    if not plan.is_pipeline:  # an intra-op plan: DTensor carries its layouts (`runtime.intra`); rehearsed whole
        _check_batch_norm(model, plan)
        _check_sequence(model, source)
        if rehearse:
            _check_intra(plan, source, model)
        return
    placements = {}
    megatron = megatron_part(plan)  # what Megatron's layouts apply to: not the layers laid out block by block
    if any(stage.tp > 1 for stage in plan.stages):  # every stage's, before any rank builds its own
        placements = tensor_parallel_placements(model, megatron)
    graph = source.chain()
    _check_chain(plan, graph)
    _check_experts(graph, plan, model)
    _check_divisible(model, megatron)
    _check_split_outputs(graph, megatron, model)
    _check_shared_inputs(graph, megatron, model, placements)
    _check_batch_norm(model, plan)
    _check_sequence(model, source)
    if plan.pp == 1 and rehearse:  # the rehearsal applies recomputation as the runtime does, on this model first
        _check_stage(plan, source, model, traced_shapes(graph))
        return
    if rehearse and plan.stages[0].tp > 1:  # a pipeline's stages apply tp as one stage does: rehearsed as such
        proxy = tensor_parallel_proxy(plan)
        try:
            _check_stage(proxy, source, source.meta(), traced_shapes(graph))
        except ValueError as exc:
            raise ValueError(f"{exc} (the plan's tensor parallelism, rehearsed as one stage of its tp "
                             f"{proxy.stages[0].tp})") from None
    for stage in plan.stages:  # on the meta model, which is thrown away: the runtime's own checks
        recompute(model, dict(stage.recompute))
    checkpoint_segments(model, [list(segment) for stage in plan.stages for segment in stage.segments])
    if plan.pp > 1:
        stage_layers(model, plan)
        check_stage_forward(model, seq=_seq(source))
        if rehearse:
            _check_pipeline(plan, source)


def _check_intra(plan: Plan, source: ModelSource, model: nn.Module) -> None:
    """Rehearse an intra-op plan whole on a fake process group, as rank 0, for one micro-batch and the gradient
    synchronisation, and compare the collectives it issues with the plan's prediction for the same: DTensor
    converts a value wherever the plan's layouts do not carry through an op, and a plan whose run would then
    communicate other than it was priced is refused, with the difference."""
    from autopar.runtime.comm import compare, intra_prediction

    # one micro-batch: every micro-batch issues the same collectives, and the gradients synchronise once a step
    plan, source = _fewer_micro_batches(plan, source, 1)
    # in fp32 only: DTensor works out each op's output on fake tensors on the ranks too, so an op whose fake kernel
    # takes bf16 only (MoE's grouped matmul on CPU) fails there as here, where a plain tensor's step would run
    with fake_errors_quiet():
        counted = rehearsal(plan, source=source, model=model, count=True)
    result = compare(counted, intra_prediction(plan, source.traced_at(plan.micro_batch_size)))
    if not result["ok"]:
        raise ValueError(f"the plan's layouts do not carry through the model as its estimate assumes: applied with "
                         f"DTensor on a fake process group, rank 0 issues other collectives than priced "
                         f"({result['message']})")


def _check_experts(graph: Graph, plan: Plan, model: nn.Module) -> None:
    """Under expert parallelism, every mixture the estimate splits by expert (the experts the trace finds) is one
    the runtime can split so (`check_experts`), refused naming the module otherwise: under ZeRO 3 the plan's
    placements cannot say which modules are experts (every weight is ``S(0)`` on dp), and the runtime splits the
    modules that are Hugging Face experts, so a mixture of other experts would otherwise be refused only by the
    rehearsal's count of collectives."""
    from autopar.cost.layers import experts_in
    from autopar.runtime.experts import check_experts

    if plan.ep == 1:
        return
    modules = dict(model.named_modules())
    for group in experts_in(graph, graph.nodes):
        if group.module in modules:
            check_experts(modules[group.module], group.module, plan.ep)


def _check_stage(plan: Plan, source: ModelSource, model: nn.Module, traced: TracedShapes) -> None:
    """Rehearse a single-stage plan (`rehearsal`) on one layer of each kind (`thin`) for its first and last
    micro-batches, and compare the collectives rank 0 issues with what the cost model predicts for the same thinned
    model and micro-batches: a plan the ranks would run correctly but communicating other than priced (a value
    DTensor converts where the estimate assumed none) is refused here, with the difference, as `autopar dryrun`
    would find it. ``model``: the source's meta model (thinned in place). A plan the thinned rehearsal refuses is
    rehearsed again whole, so that a refusal is never an artefact of the layers left out, and names the module the
    whole step fails in."""
    from autopar.runtime.comm import compare, predictions_on

    # the first and last micro-batches: every other issues the first's collectives, the last synchronises
    short, shorter = _fewer_micro_batches(plan, source, 2)
    applied = thin(model, short)
    try:
        counted, graph, dtype = _counted(applied, shorter, model, traced)
    except ValueError:
        if applied is short:  # nothing was left out
            raise
        applied = short
        counted, graph, dtype = _counted(short, shorter, source.meta(), traced)
    result = compare(counted, predictions_on(applied, graph, dtype)[0])
    if not result["ok"]:
        kept = "one layer of each kind" if applied is not short else "the whole model"
        raise ValueError(f"the plan's layouts do not carry through the model as its estimate assumes: applied on a "
                         f"fake process group, rank 0 issues other collectives than priced ({result['message']}; "
                         f"{kept}, {applied.micro_batches} micro-batch{'es' if applied.micro_batches > 1 else ''})")


def _check_pipeline(plan: Plan, source: ModelSource) -> None:
    """Rehearse a pipeline as `autopar dryrun` does, once per pipeline device (its first rank, holding its own stage
    or chunks and running the plan's schedule), on each stage's kinds of layers only (`thin`, stage by stage:
    every stage keeps its first and last layers), and compare the collectives each issues with what the cost model
    predicts for the same thinned pipeline. What a stage does apart from a whole model (the first scatters the
    sequence, the last gathers it and runs the final norm and head, the weights tied across them) is stepped here,
    not only the tensor parallelism every stage applies alike. A plan the thinned rehearsal refuses is rehearsed
    again whole, so that a refusal is never an artefact of the layers left out."""
    if plan.schedule != "interleaved":  # as many micro-batches as stages: each issues what every other does
        plan, source = _fewer_micro_batches(plan, source, plan.pp)
    model = source.meta()
    applied = thin(model, plan)
    try:
        mismatch = _rehearse_devices(applied, source, model)
    except ValueError:
        if applied is plan:  # nothing was left out
            raise
        applied = plan
        mismatch = _rehearse_devices(plan, source, source.meta())
    if mismatch:
        kept = "each stage with one layer of each kind" if applied is not plan else "the whole model"
        raise ValueError(f"the plan's layouts do not carry through the model as its estimate assumes: its pipeline, "
                         f"applied on a fake process group, has {mismatch}; {kept}, {plan.micro_batches} "
                         "micro-batches)")


def _rehearse_devices(plan: Plan, source: ModelSource, model: nn.Module) -> str | None:
    """`_check_pipeline` on ``model`` (the source's meta model, thinned as ``plan`` names its layers): the first
    pipeline device whose collectives differ from the prediction, and how, or None. Rehearsed and predicted in
    one dtype (`fp32_else_bf16`)."""
    from autopar.runtime.comm import compare, predictions_on, rank_prediction

    per_device = plan.grid[0] * plan.grid[1]

    def attempt(dtype: torch.dtype) -> str | None:
        expected = predictions_on(plan, _traced_meta(model, source, dtype), dtype)
        for device in range(plan.pp):
            rank = device * per_device
            counted = rehearsal(plan, source=source, dtype=dtype, model=copy.deepcopy(model), count=True, rank=rank)
            result = compare(counted or [], rank_prediction(plan, expected, rank))
            if not result["ok"]:
                return f"rank {rank} (stage {device}) issue other collectives than priced ({result['message']}"
        return None

    return fp32_else_bf16(attempt)


def _counted(plan: Plan, source: ModelSource, model: nn.Module,
             traced: TracedShapes) -> tuple[list[dict[str, Any]], Graph, torch.dtype]:
    """The collectives rank 0 issues in `rehearsal` of ``plan`` on a copy of ``model`` (the source's meta model),
    with ``model`` traced in the dtype the rehearsal ran in (`fp32_else_bf16`), which sets the bytes predicted."""

    def attempt(dtype: torch.dtype) -> tuple[list[dict[str, Any]], Graph, torch.dtype]:
        counted = rehearsal(plan, source=source, dtype=dtype, model=copy.deepcopy(model), traced=traced, count=True)
        return counted or [], _traced_meta(model, source, dtype), dtype

    return fp32_else_bf16(attempt)


def fp32_else_bf16(attempt: Callable[[torch.dtype], Any]) -> Any:
    """``attempt(dtype)`` in fp32, as the runtime trains; where that fails and bf16 passes, the fp32 failure is a
    fake-tensor kernel's dtype limit (MoE's grouped matmul takes bf16 only on fake CPU tensors, while a real fp32
    CPU step of plain tensors runs: the layouts and the step are the same in either dtype), and bf16's result is
    returned. Raises the fp32 failure. (An intra-op plan is rehearsed in fp32 only, `_check_intra`.)"""
    failed: ValueError | None = None
    for dtype in (torch.float32, torch.bfloat16):
        try:
            with fake_errors_quiet():
                return attempt(dtype)
        except NotImplementedError:
            if dtype == torch.float32:
                raise
        except (ValueError, CaptureError) as exc:
            if dtype == torch.float32:
                failed = exc if isinstance(exc, ValueError) else ValueError(f"the model cannot be traced: {exc}")
    assert failed is not None
    raise failed


def _fewer_micro_batches(plan: Plan, source: ModelSource, count: int) -> tuple[Plan, ModelSource]:
    """``plan`` with at most ``count`` micro-batches, and ``source`` giving the batch of that plan."""
    if plan.micro_batches <= count:
        return plan, source
    rows = plan.micro_batch_size * count
    work = plan.workload and dataclasses.replace(plan.workload, batch=rows)
    whole = source.batch
    return (dataclasses.replace(plan, micro_batches=count, workload=work),
            dataclasses.replace(source, batch=lambda _: {k: v[:rows] for k, v in whole(rows).items()}))


def _traced_meta(model: nn.Module, source: ModelSource, dtype: torch.dtype) -> Graph:
    """``model`` (on the meta device, left as it is) traced in ``dtype`` at one row of ``source``'s batch."""
    from autopar.capture import trace

    inputs = _cast({k: v[:1].to("meta") for k, v in source.batch(1).items()}, dtype)
    return trace(copy.deepcopy(model).to(dtype), example_kwargs=inputs)


def tensor_parallel_proxy(plan: Plan) -> Plan:
    """A pipeline plan's tensor parallelism alone: one stage of its tp devices holding every layer, with each
    stage's recomputation, checkpointed runs and intra-op layer layouts and the plan's module layouts. Every stage
    applies tp to its own layers with the same code (`runtime.apply`), so tp that would fail on a stage, or form
    heads other than the traced model's, fails the rehearsal of this plan, which (unlike a pipeline) can be stepped
    on a fake process group; the pipeline's own cut is checked apart (`pipeline.check_stage_forward`)."""
    from autopar.plan import Mesh, Stage

    first = plan.stages[0]
    stage = Stage(layers=tuple(name for s in plan.stages for name in s.layers), dp=1, tp=first.tp,
                  recompute=tuple(r for s in plan.stages for r in s.recompute),
                  segments=tuple(r for s in plan.stages for r in s.segments),
                  intra=any(s.intra for s in plan.stages), layouts=tuple(x for s in plan.stages for x in s.layouts))
    return dataclasses.replace(plan, mesh=Mesh(shape=(1, first.tp), axes=plan.mesh.axes), stages=(stage,),
                               schedule="1f1b", chunks=1, estimate=None, report=None)


def _check_sequence(model: nn.Module, source: ModelSource) -> None:
    """A Hugging Face causal LM computes its loss on position t predicting token t + 1: at sequence 1 there is
    nothing to predict, and the loss is NaN in one process as on the ranks."""
    if type(model).__name__.endswith("ForCausalLM") and _seq(source) == 1:
        raise ValueError(f"{type(model).__name__} at sequence 1 has no next token to predict: its loss is NaN, "
                         "one process's too; use a sequence of 2 or more")


def _seq(source: ModelSource) -> int:
    """The sequence length the model trains at (its token inputs' second dim; 0 where it takes none)."""
    ids = source.batch(1).get("input_ids")
    return int(ids.shape[1]) if ids is not None and ids.dim() == 2 else 0


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


def rehearsal(plan: Plan, *, count: bool = False, source: ModelSource | None = None,
              dtype: torch.dtype = torch.float32, whole: bool = True, model: nn.Module | None = None,
              traced: TracedShapes | None = None, rank: int = 0) -> list[dict[str, Any]] | None:
    """Apply ``plan`` as ``rank`` of a fake process group of the plan's world size, on fake tensors
    (no memory, no arithmetic), and run one training step with the model in ``dtype`` (the runtime's fp32 by
    default); with ``count``, the collectives ``rank`` issued. ``source``: the model the plan is for (default: its
    workload's). Without ``whole``, the step runs each kind of layer once (`autopar.runtime.thin`) and the first
    and last micro-batches only, so that a 1,000-layer model costs about what a 10-layer one does; ``count``
    needs the whole step. A pipeline's rank holds its own stage (or chunks) and runs the plan's schedule, its
    sends and receives moving no data; its stages' shapes are worked out on the meta device (`pipeline.build`).

    The model is built on the meta device and parallelised exactly as `autopar run` does, except that DDP, whose
    constructor reads weight values, is replaced by the by-hand all-reduce in the same buckets, and that a plan's
    compiled layers run eager (`check_compiler` checks the compiler; recomputation then replays whole layers, as
    compiled ones do). Any error is raised as a
    ValueError that says the plan could not be applied. ``model``: the source's meta model, already built (it is
    changed in place); by default one is built.

    ``traced``: the shapes of the traced model's attention calls and batched products (`traced_shapes`). Under tp
    each rank must call attention on its share of the heads, over the whole sequence at the same head size, and
    multiply matrices the traced model multiplies; a model whose code forms heads from its full head count
    (``view(bsz, -1, num_heads, head_dim)``, as OPT's attention does, or DeBERTa's ``transpose_for_scores``) would
    fold each rank's half of the features into the sequence or the head size instead and train a different model
    without an error, so this is refused, naming the module."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from autopar.runtime.comm import CollectiveCounter

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs its own fake process group; a process group is already initialised")
    source = source or ModelSource.of_workload(Workload.of(plan))
    if plan.pp > 1 and not (whole or count):
        raise ValueError("a pipeline is rehearsed whole: each of its ranks runs the plan's schedule")
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.devices)
    phase = None  # where an error outside every module's forward came from, once the step is under way
    try:
        model = source.meta() if model is None else model
        applied = plan if whole or count else thin(model, plan)
        model = model.to(dtype)  # thinned first: a 1,000-layer model's cast alone took a second
        example = _pipeline_example(applied, source, model) if plan.pp > 1 else None
        # kernels: the preflight in `check_runnable`
        parallel = parallelize(model, applied, ddp=False, compile=False, example=example)
        where = _track_modules(parallel.module)
        with FakeTensorMode(allow_non_fake_inputs=True):
            # FSDP and DTensor shard meta weights; their shards become fakes here
            parallel.replace_parameters(_materialise(parallel.module))
            optimizer = parallel.make_optimizer(torch.optim.SGD, lr=LEARNING_RATE)
            counter = CollectiveCounter(parallel.axes)
            # layers stay eager here; a compiled layer's recomputation replays its whole forward (one compiled
            # function), which checkpointing without early stop does too, collectives alike
            compiled = plan.kernels == "compiled"
            tp = plan.grid[1] if plan.is_pipeline else 1  # an intra-op plan's heads: DTensor's own propagation
            # multi-query attentions the plan keeps whole run all their heads on every rank
            kept = whole_attentions(model, _split_over_tp(applied)) if tp > 1 else []
            # layers laid out block by block run on DTensors, whose own propagation keeps their heads right
            shapes = _AttentionShapes(where, traced, tp, whole=kept, skip=laid_out_layers(applied)) \
                if traced and tp > 1 else contextlib.nullcontext()
            # a pipeline schedule logs its whole timetable on any error, which the error below names in a line
            schedule = quiet_log("torch.distributed.pipelining.schedules")
            # on a CPU process group DTensor gathers where an all-to-all would go, and says so once; the
            # prediction the rehearsal is compared with counts it so (`comm.intra_prediction`)
            fallback = quiet_log("torch.distributed.tensor._collective_utils")
            # and that a pending mean over two axes is reduced axis by axis (a loss), which the prediction counts
            sequential = quiet_log("torch.distributed.tensor._redistribute")
            with counter if count else contextlib.nullcontext(), set_checkpoint_early_stop(not compiled), shapes, \
                    schedule, fallback, sequential, _strided_shards_on_real_indices():
                batch = _cast(source.batch(plan.micro_batch_size * plan.micro_batches), dtype)
                local = plan.local_batch(batch, rank) if plan.is_pipeline else split_batch(
                    batch, micro_batch_size=plan.micro_batch_size, micro_batches=plan.micro_batches, dp=1, dp_rank=0)
                if not (whole or count):  # the first micro-batch, and the last, which synchronises gradients
                    ends = local.micro_batches[:1] + local.micro_batches[1:][-1:]
                    local = dataclasses.replace(local, micro_batches=ends)
                phase = "the backward or the gradient synchronisation"  # (`where` names a forward's module)
                parallel.forward_backward(local)
                phase = "the optimizer step"
                optimizer.step()  # as rank 0
    except (ValueError, NotImplementedError) as exc:
        if _raised_by_autopar(exc):  # a refusal that says why already
            raise
        failed = exc  # the model's own code or PyTorch's (a ValueError unpacking a split): as below
    except Exception as exc:  # noqa: BLE001 - whatever PyTorch raised: the plan does not apply to this model
        failed = exc
    else:
        failed = None
    finally:
        dist.destroy_process_group()
    if failed is not None:
        text = str(failed).strip().splitlines()
        if "where" in locals() and where:
            inside = f" in module {where[-1]!r}"
        else:  # before the plan was applied, or after every forward had returned
            inside = f" in {phase}" if phase else ""
        raise ValueError(f"the plan fails{inside} when applied on a fake process group of {plan.devices} ranks: "
                         f"{type(failed).__name__}: {text[0] if text else ''}{_reshape_hint(failed, plan)}") from None
    return counter.summary() if count else None


@contextlib.contextmanager
def _strided_shards_on_real_indices() -> Iterator[None]:
    """Inside, DTensor works out a strided split's shard sizes on real index tensors. It does so with ``arange``
    and ``tolist`` while choosing how to convert a value; under the rehearsal's fake-tensor mode those indices
    would be fake, their values unknown, and a plan the ranks run would fail here."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.__dict__["local_shard_size_and_offset"]

    def on_real_indices(self: Any, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(self, *args, **kwargs)

    _StridedShard.local_shard_size_and_offset = on_real_indices
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def _reshape_hint(exc: BaseException, plan: Plan) -> str:
    """Why the model's code fails under tp, where that is known: it reshapes a tensor tp splits by the model's
    whole width or head count (``view(b, s, num_heads, 3, head_dim)``), which a rank's share does not have; or it
    meets the replicated input its block's projections share (a DTensor) with a plain tensor of its own (a residual
    add, or a norm written by hand, inside the block that holds the projections)."""
    if not plan.is_pipeline or plan.grid[1] == 1 or not isinstance(exc, RuntimeError):
        return ""
    tp = plan.grid[1]
    if "is invalid for input of size" in str(exc):
        return (f"; under tp {tp} a rank holds 1/{tp} of the features a split projection makes, and code that "
                "reshapes them by the model's whole head count or width fails so: plan with tp 1 (`autopar plan` "
                "finds one)")
    if "got mixed torch.Tensor and DTensor" in str(exc):
        return (f"; under tp {tp} the input that a block's projections share is handed to them as one replicated "
                "DTensor, and code of the block's own that reads it beside a plain tensor (a residual add, or a norm "
                "written by hand, inside the module holding the projections) fails so: keep the residual add and "
                "the norm in the module around it, as Hugging Face's and Megatron's layers do, or plan with tp 1")
    return ""


def _raised_by_autopar(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in autopar's own code (a refusal naming its reason), not in the model's or
    PyTorch's code that autopar called."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(os.path.dirname(os.path.dirname(__file__)) + os.sep)




@dataclasses.dataclass(frozen=True)
class TracedShapes:
    """Shapes the traced model computes with, which each tp rank's must be a share of (`_AttentionShapes`)."""

    attention: frozenset[tuple[int, int, int]]  # (heads, sequence, head size) of each attention call's query
    # (rows, contracted, columns) of each batched matrix product (bmm, baddbmm) reading no parameter: attention
    # written out by hand (scores, and its relative-position terms), whose heads tp splits by the batch dim
    products: frozenset[tuple[int, int, int]]

    def __bool__(self) -> bool:
        return bool(self.attention or self.products)


_PRODUCTS = ("aten.bmm.default", "aten.baddbmm.default")


def traced_shapes(graph: Graph) -> TracedShapes:
    """The attention calls' (``scaled_dot_product`` ops) and parameter-free batched products' shapes the traced
    model makes (`TracedShapes`)."""
    nodes = _first_instances(graph)
    attention = frozenset(tuple(node.inputs[0].shape[1:]) for node in nodes
                          if "scaled_dot_product" in node.op and node.inputs and len(node.inputs[0].shape) == 4)
    products = frozenset(_product(*node.inputs[-2:]) for node in nodes
                         if node.op in _PRODUCTS and not node.reads_params and len(node.inputs) >= 2)
    return TracedShapes(attention, products)


def _product(a, b) -> tuple[int, int, int]:  # noqa: ANN001 - two batched matrices (shapes or tensors)
    """(rows, contracted, columns) of the batched product ``a @ b``."""
    return tuple(a.shape[-2:]) + (b.shape[-1],)


class _AttentionShapes(TorchDispatchMode):
    """Raises ValueError at the first attention call whose query is not a tp rank's share of one the traced model
    makes (its heads / tp, the whole sequence, the same head size), or the first batched product of two activations
    whose matrices (not counting the batch of heads) the traced model never multiplies (see `rehearsal`). The
    backward is not checked: grad mode is off there, and its products are the forward's transposed."""

    def __init__(self, where: list[str], traced: TracedShapes, tp: int, *, whole: list[str] = (),
                 skip: Iterable[str] = ()) -> None:
        super().__init__()
        self.where, self.tp, self.whole, self.skip = where, tp, whole, tuple(skip)
        self.expected = {(heads // tp, seq, size) for heads, seq, size in traced.attention if heads % tp == 0}
        self.traced = traced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.name()
        module = self.where[-1] if self.where else "<root>"
        if any(module == layer or module.startswith(f"{layer}.") for layer in self.skip):
            return func(*args, **(kwargs or {}))
        if self.traced.attention and "scaled_dot_product" in name and not name.endswith("backward") and args:
            query = getattr(args[0], "_local_tensor", args[0])  # a DTensor's own shard
            whole = any(module == name or module.startswith(f"{name}.") for name in self.whole)
            expected = self.traced.attention if whole else self.expected
            if isinstance(query, torch.Tensor) and query.dim() == 4 and tuple(query.shape[1:]) not in expected:
                heads, seq, size = query.shape[1:]
                whole = ", ".join(f"{h} heads x {s} positions x {d}" for h, s, d in sorted(self.traced.attention))
                share = ", ".join(f"{h} heads x {s} positions x {d}" for h, s, d in sorted(self.expected))
                raise ValueError(
                    f"under tp {self.tp} the attention in module {module!r} runs on {heads} heads x {seq} positions "
                    f"x {size} per rank, where a rank's share of the model's ({whole}) is {share or 'whole heads'}: "
                    "its code forms heads from the model's full head count (as view(bsz, -1, num_heads, head_dim) "
                    "does), so each rank would attend over the wrong features and train a different model; plan "
                    "with tp 1 (`autopar plan` finds one)")
        elif self.traced.products and str(func) in _PRODUCTS and torch.is_grad_enabled():
            operands = args[1:3] if str(func) == "aten.baddbmm.default" else args[:2]
            a, b = (getattr(x, "_local_tensor", x) for x in operands)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 3 \
                    and not isinstance(a, nn.Parameter) and not isinstance(b, nn.Parameter) \
                    and _product(a, b) not in self.traced.products:
                rows, inner, cols = _product(a, b)
                known = ", ".join(f"{r} x {k} by {k} x {c}" for r, k, c in sorted(self.traced.products))
                raise ValueError(
                    f"under tp {self.tp} module {module!r} multiplies {rows} x {inner} by {inner} x {cols} matrices "
                    f"per rank, a product the model never forms in one process ({known}): its code forms heads from "
                    "the model's full head count (as view(..., num_heads, -1) does), so each rank would attend over "
                    "a different head size and train a different model; plan with tp 1 (`autopar plan` finds one)")
        return func(*args, **(kwargs or {}))


def _cast(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {key: value.to(dtype) if value.is_floating_point() else value for key, value in batch.items()}


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


def _materialise(module: nn.Module) -> dict[int, nn.Parameter]:
    """Meta weights to fake ones, keeping weights that several modules share shared; returns each old parameter's
    replacement by the old one's id."""
    owners = [(m, key, p) for m in module.modules() for key, p in m._parameters.items() if p is not None]
    module.to_empty(device="cpu")
    first: dict[int, nn.Parameter] = {}
    for m, key, old in owners:
        if id(old) in first:
            m._parameters[key] = first[id(old)]
        else:
            first[id(old)] = m._parameters[key]
    return first


def _check_chain(plan: Plan, graph: Graph) -> None:
    from autopar.search.pipeline import config_on

    config_on([row.name for row in graph.layers()], plan)


def _check_split_outputs(graph, plan: Plan, model: nn.Module) -> None:  # noqa: ANN001 - a traced Graph
    """Refuse tp over a projection whose output the model cuts along its output features before any reshape
    changes that dim (`cut_projections`); only column-parallel linears whose outputs stay sharded (a row-parallel
    partner in their block, as the runtime pairs them) can be affected."""
    tp = plan.grid[1] if plan.is_pipeline else 1
    if tp == 1:
        return
    norms = set(split_norms(model, plan))  # run split: their means are taken over all ranks' features
    split = {entry.fqn: p.on(1).dim for entry in plan.modules for p in entry.params
             if p.name.rpartition(".")[2] == "weight" and isinstance(p.on(1), Shard) and entry.fqn not in norms}
    modules = dict(model.named_modules())
    split = {fqn: tp_role(modules[fqn], dim) for fqn, dim in split.items() if fqn in modules}  # by role
    columns = [fqn for group in column_groups({fqn: f"S({dim})" for fqn, dim in split.items()}).values()
               for fqn in group]
    found = cut_projections(graph, model, columns)
    if found:
        raise ValueError(_cut_message(*found[0], tp=f"tp {tp}"))
    _check_replicated_inside(graph, split, columns, tp=tp, model=model, plan=plan, norms=norms)


def _check_shared_inputs(graph, plan: Plan, model: nn.Module,  # noqa: ANN001 - a traced Graph
                         placements: dict[str, str]) -> None:
    """Where a block normalises its own input before its column linears read it, the runtime hands them that norm's
    output as the one replicated input they share (`norms_before_columns`, read from the module tree;
    ``placements`` from `tensor_parallel_placements`). Each of those columns must read what the norm computes in
    the traced model (through views and the block's own ops, `_activation_sources`); a column fed from elsewhere
    would have its input's gradient reduced apart, which is not what the plan prices, so the plan is refused,
    naming the column and what it reads."""
    tp = plan.grid[1] if plan.is_pipeline else 1
    if tp == 1:
        return
    columns = column_groups(placements)
    norms = norms_before_columns(model, columns, sp=plan.sp, summed=tp_partial_names(model, plan),
                                 split=split_norms(model, plan))
    owner = {column: block for block in norms for column in columns[block]}
    if not owner:
        return
    for node in _first_instances(graph):
        block = owner.get(node.module)
        if block is None or node.is_view or f"{node.module}.weight" not in node.params:
            continue
        norm = norms[block]
        outside = [n for n in _activation_sources(graph, node, block)
                   if n is None or not (n.module == norm or n.module.startswith(f"{norm}."))]
        if outside:
            read = "a model input" if outside[0] is None else f"{outside[0].op} in {outside[0].module or '<root>'!r}"
            raise ValueError(
                f"under tp {tp} the runtime takes {norm!r}, the only norm in block {block!r} over its projections' "
                f"input features, for a norm of the block's input and hands its output to module {node.module!r} "
                f"as the replicated input the block's projections share, but the model feeds {node.module!r} from "
                f"{read}; plan with tp 1 (`autopar plan` finds one), or move that norm out of the block")


def _activation_sources(graph, node, block: str) -> list:  # noqa: ANN001 - a traced Graph and its Nodes
    """What the activations ``node`` (a projection's op) reads are computed from, looking through views and the
    ops of ``block`` and of the projection itself (a dropout or a scale between a norm and the projections runs on
    the shared input as well): the first nodes outside them, and None for a model input."""
    inside = (block, node.module)
    found, seen, frontier = [], set(), [node]
    while frontier:
        current = frontier.pop()
        for ref in current.sources:
            if ref.state is not None or ref.node in seen:
                continue
            seen.add(ref.node)
            if ref.node < 0:
                found.append(None)
                continue
            source = graph.node(ref.node)
            if source.is_view or source.module in inside:
                frontier.append(source)
            else:
                found.append(source)
    return found


def _check_replicated_inside(graph, split: dict[str, int], columns: list[str], *, tp: int,  # noqa: ANN001
                             model: nn.Module, plan: Plan, norms: set[str]) -> None:
    """What runs between a column-parallel linear and its row-parallel partner sees each rank's share of the heads.
    Refused: a reduction there over more than one head's features (a norm over all heads at once, where each rank
    would normalise over its own part), and a replicated parameter applied there that the plan does not mark
    ``summed`` (q and k norms per head, as Qwen3 and Gemma 3 have: each rank computes their gradient from its own
    heads, and the runtime sums the marked ones over tp, `tp_partial_names`), or one it marks that is not applied
    there. The means over the split features that the modules of ``norms`` take are exempt, and so are their
    weights: the runtime takes those means over all ranks' features and splits the weights with them
    (`split_norms`: OLMo 2's q and k norms, over all heads at once)."""
    rows = {fqn for fqn, dim in split.items() if dim == 1}
    nodes = _first_instances(graph)
    consumers = _consumers(nodes)
    frontier = [node for node in nodes if node.module in columns]
    inside: dict[int, Any] = {}
    while frontier:
        for user in consumers.get(frontier.pop().id, ()):
            if user.id not in inside and user.module not in rows and user.module not in columns:
                inside[user.id] = user
                frontier.append(user)
    heads = {size for _, _, size in traced_shapes(graph).attention}
    widths = {norm: {info.tensor.shape[0] for name, info in graph.state.items()
                     if name.rpartition(".")[0] == norm and len(info.tensor.shape) == 1} for norm in norms}

    def summed_in_norm(node) -> bool:  # noqa: ANN001 - a graph Node
        """A reduction a split norm takes over every rank's features (`_split_norm`): a mean over the last dim
        alone (``rms_norm`` runs as one), that dim as wide as the norm's weight (the features tp splits, not a
        head's)."""
        norm = next((n for n in norms if node.module == n or node.module.startswith(f"{n}.")), None)
        if norm is None or not node.inputs or node.inputs[0].shape[-1:] != (max(widths[norm], default=0),):
            return False
        last = len(node.inputs[0].shape) - 1
        dims = node.args[1] if node.op == "aten.mean.dim" and len(node.args) > 1 else None
        return isinstance(dims, (tuple, list)) and len(dims) == 1 and dims[0] % (last + 1) == last

    for node in sorted(inside.values(), key=lambda n: n.id):
        reduced = _reduced_sizes(node)
        if reduced is not None and not set(reduced) <= heads and not summed_in_norm(node):
            raise ValueError(
                f"module {node.module or '<root>'!r} reduces over {' x '.join(map(str, reduced))} features of the "
                f"activations tp {tp} splits ({node.op}), where a head has {_sizes(heads)}: each rank would reduce "
                "over its own part of them (a norm over all heads at once) and train a different model; plan with "
                "tp 1 (dp, FSDP or a pipeline)")
    trained = computed_from_state(nodes)
    applied: dict[str, str] = {}  # parameter -> the first module applying it to split activations
    for node in sorted(inside.values(), key=lambda n: n.id):
        for ref in node.sources:
            for name in ([ref.state] if ref.state else sorted(trained.get(ref.node, ()))):
                info = graph.state.get(name)
                if (info is None or info.is_buffer or not info.requires_grad or name.rpartition(".")[0] in split
                        or name.rpartition(".")[0] in norms):
                    continue
                if name in applied:  # one norm module for q and k, say: the block model prices each use apart
                    raise ValueError(
                        f"parameter {name!r} is applied to the activations tp {tp} splits in more than one place "
                        f"({_places(applied[name], node.module)}): its gradient is summed "
                        "over tp, but the cost model cannot yet price a weight used twice there; plan with tp 1, or "
                        "give each use its own module")
                applied[name] = node.module
    first = _first_of_each(graph)
    summed = [p.name for entry in plan.modules for p in entry.params if p.summed and first(p.name)]
    for name, module in applied.items():
        if name not in summed:
            raise ValueError(
                f"parameter {name!r} is applied whole to the activations tp {tp} splits (in {module or '<root>'!r}, "
                "between a column-parallel and a row-parallel linear), and the plan does not have its gradient "
                "summed over tp: each rank would compute it from its own part only and the copies would drift "
                "apart; plan again with this version of autopar, or with tp 1")
    for name in summed:
        if name not in applied:
            raise ValueError(
                f"the plan has the gradient of parameter {name!r} summed over tp {tp}, but the model does not apply "
                "it to the activations tp splits as the runtime splits them: every rank computes it whole, and the "
                "sum would be tp times too large (the plan and the runtime disagree on where tp splits this layer: "
                "a plan edited by hand, or a layer the planner does not model as the runtime runs it, such as a "
                "head whose projection is tied to the embedding); plan with tp 1")


def _places(first: str, second: str) -> str:
    return f"twice in {first or '<root>'!r}" if first == second else f"in {first or '<root>'!r} and {second or '<root>'!r}"


_REDUCTIONS = ("aten.mean.", "aten.sum.", "aten.var.", "aten.var_mean.", "aten.std.", "aten.std_mean.", "aten.amax.",
               "aten.amin.", "aten.linalg_vector_norm.", "aten.norm.", "aten.logsumexp.", "aten.native_layer_norm.")


def _reduced_sizes(node) -> tuple[int, ...] | None:  # noqa: ANN001 - a graph Node
    """The sizes of the dims ``node`` reduces its first input over, or None where it is not a reduction. A
    reduction whose dims cannot be read reduces over them all."""
    if not node.op.startswith(_REDUCTIONS) or not node.inputs:
        return None
    shape = node.inputs[0].shape
    args = node.args
    if node.op.startswith("aten.native_layer_norm."):
        dims = tuple(range(len(shape) - len(args[1]), len(shape))) if len(args) > 1 else tuple(range(len(shape)))
    else:
        at = 2 if node.op.startswith("aten.linalg_vector_norm.") else 1
        dims = args[at] if len(args) > at else None
        if isinstance(dims, int):
            dims = (dims,)
        if not isinstance(dims, (tuple, list)) or not dims:
            dims = tuple(range(len(shape)))
    try:
        return tuple(shape[d] for d in dims)
    except (IndexError, TypeError):
        return tuple(shape)


def _sizes(sizes: set[int]) -> str:
    return " or ".join(map(str, sorted(sizes))) if sizes else "no size known (the model's attention calls no SDPA)"


def _first_of_each(graph):  # noqa: ANN001, ANN202 - a traced Graph; a predicate on parameter names
    """Whether a parameter belongs to the first instance of its repeated layer, or to no repeated layer (the
    checks above walk those nodes only, `_first_instances`)."""
    later = {fqn for group in graph.repeats for fqn in group.instances[1:]}

    def first(name: str) -> bool:
        while name:
            name = name.rpartition(".")[0]
            if name in later:
                return False
        return True

    return first


def _consumers(nodes: list) -> dict[int, list]:
    """Node id -> the nodes (of ``nodes``) that read one of its outputs."""
    consumers: dict[int, list] = {}
    for node in nodes:
        for ref in node.sources:
            if ref.node >= 0:
                consumers.setdefault(ref.node, []).append(node)
    return consumers


def tensor_parallel_refusal(graph, model: nn.Module) -> str | None:  # noqa: ANN001 - a traced Graph
    """Why no plan with tp > 1 can run ``model`` exactly (any of its projections may be split by output features,
    and one has its output cut along them: `cut_projections`), or None. The planner keeps its search to tp 1
    then (unless ``--allow-unrunnable``)."""
    found = cut_projections(graph, model, [name for name, info in graph.state.items()
                                           if name.endswith(".weight") and len(info.tensor.shape) == 2])
    return _cut_message(*found[0], tp="tp") if found else None


def _cut_message(module: str, cut, *, tp: str) -> str:  # noqa: ANN001 - the graph Node that cuts
    return (f"module {module!r} would be split by output features over {tp}, but the model cuts its output along "
            f"those features ({cut.op} in {cut.module or '<root>'!r}) before forming heads, as a fused q/k/v "
            "projection split by .split()/.chunk() does: each rank would cut its shard in the wrong places and train "
            "a different model; plan with tp 1 (`autopar plan` finds one), or project q, k and v with separate Linear "
            "layers")


def cut_projections(graph, model: nn.Module, names) -> list[tuple[str, Any]]:  # noqa: ANN001
    """For each module of ``names`` (module or weight FQNs) that owns a 2-D weight: the first op that cuts its
    output along its output features (split, chunk, slice, narrow) before any reshape changes that dim, as
    ``[(module, op node)]``. Column-parallel, each rank holds a contiguous block of those features, so a fused
    ``[q; k; v]`` projection cut in three would hand each rank parts of q as k and v. The zoo's own attention is
    exempt, as GPT-2's ``c_attn`` and Phi-3's fused projections are: the runtime lays their fused outputs out
    piece by piece per rank (`fused_pieces`)."""
    modules = dict(model.named_modules())
    wanted = {name.removesuffix(".weight") for name in names}
    wanted = {m for m in wanted if fused_pieces(modules.get(m.rpartition(".")[0]), m.rpartition(".")[2]) is None}
    if not wanted:
        return []
    nodes = _first_instances(graph)
    consumers = _consumers(nodes)
    found: dict[str, Any] = {}
    for node in nodes:
        weight = graph.state.get(f"{node.module}.weight") if node.module in wanted else None
        if weight is None or node.module in found or not node.outputs or len(node.outputs[0].shape) < 2:
            continue
        cut = _cut_along_last(node, consumers, weight.tensor.shape[out_features_dim(modules.get(node.module))])
        if cut is not None:
            found[node.module] = cut
    return list(found.items())


def _first_instances(graph) -> list:  # noqa: ANN001 - a traced Graph; returns its Nodes
    """The graph's nodes outside repeated layers and those of the first of each repeated layer (the others are
    copies of it): a 1,000-layer model costs what a 10-layer one does."""
    copies = sorted(span for group in graph.repeats for span in group.spans[1:])
    nodes, at = [], 0
    for start, stop in [*copies, (graph.num_nodes, graph.num_nodes)]:
        nodes += [graph.node(i) for i in range(at, max(at, start))]
        at = max(at, stop)
    return nodes


_CUTS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.slice.Tensor", "aten.narrow.default",
         "aten.chunk.default")


def _cut_along_last(start, consumers: dict[int, list], features: int):  # noqa: ANN001, ANN202
    """The first op that cuts ``start``'s output (``features`` wide in its last dim) along that dim, following
    ops that keep the last dim whole (views, bias adds, casts, element-wise ops), or None."""
    if start.outputs[0].shape[-1] != features:
        return None
    frontier, seen = [start], {start.id}
    while frontier:
        node = frontier.pop()
        for user in consumers.get(node.id, ()):
            if user.id in seen or not user.outputs:
                continue
            seen.add(user.id)
            shape, out = node.outputs[0].shape, user.outputs[0].shape
            if user.op in _CUTS and len(out) == len(shape) and out[-1] < shape[-1] and out[:-1] == shape[:-1]:
                return user
            if len(out) >= 2 and out[-1] == features and (user.is_view or out == shape):
                frontier.append(user)
    return None


def _split_over_tp(plan: Plan) -> set[str]:
    """The modules of pipeline ``plan`` with a parameter split over tp (its grid's second axis)."""
    return {entry.fqn for entry in plan.modules if any(isinstance(p.on(1), Shard) for p in entry.params)}


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
    # a multi-query attention the plan keeps whole (`cost.layers.kept_whole`) runs all its heads on every rank
    whole = set(whole_attentions(model, _split_over_tp(plan)))
    for name, module in model.named_modules():
        if name in whole:
            continue
        for attribute in ("heads", "kv_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
            count = getattr(module, attribute, None)
            if isinstance(count, int) and count % tp:
                raise ValueError(f"module {name or '<root>'!r} has {count} {attribute.replace('num_', '')}, which tp "
                                 f"{tp} does not divide: each tp rank takes whole heads")
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, attribute, None)
        if count == 1 and whole and whole == multi_query_attentions(model):
            continue  # one key/value head for every attention, each kept whole
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
