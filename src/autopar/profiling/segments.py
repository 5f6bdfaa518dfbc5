"""Segment profiling (CFP): each distinct layer of a model, run under each layout by the runtime's own application
of a plan on the live process group, forward and backward timed.

For one layout (tensor-parallel size, sequence parallelism, recomputation level) and one micro-batch size, every
rank builds the model, keeps one layer of each kind (`autopar.runtime.thin`: the cost does not grow with depth),
applies the plan with `autopar.parallelize` exactly as `autopar run` does, and trains one micro-batch to capture
what each profiled layer is given. Then each profiled layer is run again on those inputs, alone: its forward
timed, then its backward from a gradient of ones, every rank starting each run together. Each time is the median
of ``repeats`` runs after a warm-up. The layer's collectives (tensor parallelism, sequence parallelism) and its
recomputation are inside what is timed; under ZeRO 3 (each repeated layer its own FSDP unit) so are its weights'
gathers and its gradients' reduce-scatter, with all of FSDP's work around them; under ZeRO 1 FSDP's work around a
micro-batch that synchronises no gradients (as all but the last of a step do), and apart from it the layer's
forward gathering its weights first (a step's first micro-batch) and its backward reduce-scattering its gradients
(the step's last). Other data-parallel
synchronisation is not (the cost model prices it from the calibrated links), and neither is the loss, which no
layer holds. Where a kind of layer has several copies, a copy between two others is timed: the first layer of a
model may also scatter the stream (sequence parallelism) and the last gather it.

All ``nproc`` ranks run at once, in ``nproc / tp`` tensor-parallel groups, so that on a CPU the figures are those
of a rank with as many busy peers as a plan of ``nproc`` ranks has.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.plan import Plan
from autopar.profiling.db import Entry, UnitEntry, fingerprint, unit_fingerprint


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int
    sp: bool
    recompute: str
    zero: int  # 0, or 1 or 3: each repeated layer an FSDP unit over the data-parallel ranks
    samples: int  # per device

    def __str__(self) -> str:
        return (f"tp {self.tp}{' + sp' if self.sp else ''}{f', ZeRO {self.zero}' if self.zero else ''}, recompute "
                f"{self.recompute}, {self.samples} sample{'s' if self.samples != 1 else ''} per device")


def row_fingerprints(model: Any) -> list[str | None]:
    """Per row of a `PipelineModel`, its layer's `fingerprint`, or None where its module cannot run alone as the
    row: the root row (the loss and the glue between modules), and a row whose module holds other rows (a Hugging
    Face model's inner ``model``: the row is its own glue, but running the module runs every layer in it)."""
    graph, batch = model.graph, model.traced_batch
    parents = {name.rpartition(".")[0] for layer in model.layers for name in _prefixes(layer.name)}
    out: list[str | None] = []
    for layer in model.layers:
        if not layer.name or layer.name in parents:
            out.append(None)
            continue
        params: dict[str, tuple[int, ...]] = {}
        for node in layer.nodes:
            for source in node.sources:
                info = graph.state.get(source.state) if source.state else None
                if info is not None:
                    params.setdefault(source.state, tuple(info.tensor.shape))
        out.append(fingerprint((node.op for node in layer.nodes), params.values(),
                               sum(node.flops_forward for node in layer.nodes) / batch))
    return out


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``: each name whose parent is an enclosing module."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), 1, -1)]


def profile_rank(rank: int, rendezvous: Any, jobs: Sequence[tuple[Plan, dict[str, list[str]]]], repeats: int,
                 on_cuda: bool) -> tuple[list[tuple], list[tuple[int, str]], list[tuple]]:
    """One rank of `autopar profile-segments`: for each (plan, {fingerprint: row names}) job, time one row of each
    fingerprint. Returns on rank 0 the times, as (job index, fingerprint, row name, forward seconds, backward
    seconds, under ZeRO 1 the (forward, backward) seconds at a step's edges or else None); the jobs the runtime
    refused to apply, as (job index, why): `parallelize` refuses a plan alike on every rank (it depends on the
    plan and the model only), so every rank skips that job together; and under ZeRO 1 and 3 without tensor
    parallelism the root unit's collectives (`time_unit`), as (job index, unit fingerprint, gather seconds,
    reduce-scatter seconds), once per launch."""
    import torch.distributed as dist

    from autopar.runtime.apply import parallelize
    from autopar.runtime.thin import renamed_plan, thinned
    from autopar.runtime.train import Workload, build_model, global_batch

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="nccl" if on_cuda else "gloo")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    results = []
    refused: list[tuple[int, str]] = []
    units: list[tuple[int, str, float, float]] = []
    try:
        pristine = None  # the thinned model before any plan was applied: each job parallelises a copy of it
        for index, (plan, rows) in enumerate(jobs):
            work = Workload.of(plan)
            if pristine is None:  # the whole model is built once per launch, however deep it is
                model = build_model(work)
                before = {id(module): name for name, module in model.named_modules()}
                plan, renamed = thinned(model, plan)
                now = {before[id(module)]: name for name, module in model.named_modules() if id(module) in before}
                pristine = copy.deepcopy(model)
            else:  # one launch's jobs share tp, sp and ZeRO and treat every layer alike: the same layers are kept
                model = copy.deepcopy(pristine)
                plan = renamed_plan(plan, renamed)
            chosen = {key: next((now[name] for name in names if name in now), None) for key, names in rows.items()}
            try:
                parallel = parallelize(model, plan)
            except (NotImplementedError, ValueError) as exc:
                refused.append((index, str(exc)))
                continue
            captured: dict[str, tuple[tuple, dict]] = {}
            for name in filter(None, chosen.values()):
                module = model.get_submodule(name)
                module.register_forward_pre_hook(_capture(captured, name), prepend=True, with_kwargs=True)
            parallel.forward_backward(global_batch(work, 0))
            if plan.zero in (1, 3) and plan.grid[1] == 1 and not units:  # one launch's jobs share their root unit
                shapes = root_unit_shapes(model)
                if shapes:
                    gather, reduce = time_unit(shapes, plan.devices, repeats=repeats, sync=sync, on_cuda=on_cuda)
                    units.append((index, unit_fingerprint(shapes), gather, reduce))
            for key, name in chosen.items():
                if name is None or name not in captured:
                    continue  # the layer ran in no forward of the step (or its module was not kept)
                module = model.get_submodule(name)
                steps = None
                if plan.zero == 1 and hasattr(module, "set_requires_gradient_sync"):
                    # a step's edges: its first forward gathers the unit's weights, its last backward
                    # reduce-scatters the gradients (and frees the gathered weights)
                    module.set_reshard_after_backward(True)
                    module.set_requires_gradient_sync(True)
                    steps = _time_layer(module, *captured[name], repeats=repeats, sync=sync, before=module.reshard)
                    # as in a micro-batch between: weights kept gathered (the warm-up run gathers them), gradients
                    # accumulated whole
                    module.set_reshard_after_backward(False)
                    module.set_requires_gradient_sync(False)
                forward, backward = _time_layer(module, *captured[name], repeats=repeats, sync=sync)
                results.append((index, key, name, forward, backward, steps))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return (results, refused, units) if rank == 0 else ([], [], [])


def root_unit_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """The shapes of the parameters FSDP2 shards in ``model``'s root unit: those no inner FSDP unit holds (the
    embeddings, final norm and head of a model whose repeated layers are units)."""
    from torch.distributed.fsdp import FSDPModule

    inner: set[int] = set()
    for module in model.modules():
        if module is not model and isinstance(module, FSDPModule):
            inner.update(id(p) for p in module.parameters())
    return [tuple(p.shape) for p in model.parameters() if id(p) not in inner]


class _Unit(nn.Module):
    """Parameters of given shapes and a forward that reads each once: an FSDP unit with next to no compute."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(shape, device=device)) for shape in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(w.view(-1)[:1].sum() for w in self.weights)


def time_unit(shapes: Sequence[tuple[int, ...]], world: int, *, repeats: int, sync: Callable[[], None],
              on_cuda: bool) -> tuple[float, float]:
    """Median seconds of one all-gather and one reduce-scatter of an FSDP2 unit holding parameters of ``shapes``
    sharded over all ``world`` ranks, with FSDP's copies around them, as the root unit of a model runs them (kept
    gathered from its forward to its backward): the unit's forward and backward, each less the same work on a
    copy that is not sharded (its forward reads one element of each weight; its backward writes each whole
    gradient)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    plain = _Unit(shapes, device)
    sharded = _Unit(shapes, device)
    fully_shard(sharded, mesh=init_device_mesh(device.type, (world,)), reshard_after_forward=False)
    times: dict[str, list[float]] = {"plain": [], "sharded": []}
    for _ in range(repeats + 1):
        for label, unit in (("plain", plain), ("sharded", sharded)):
            x = torch.zeros((), device=device, requires_grad=True)
            dist.barrier()
            start = time.perf_counter()
            out = unit(x)
            sync()
            middle = time.perf_counter()
            dist.barrier()
            begin = time.perf_counter()
            out.backward()
            sync()
            end = time.perf_counter()
            times[label].append((middle - start, end - begin))
            unit.zero_grad(set_to_none=True)
    (plain_f, plain_b), (sharded_f, sharded_b) = (
        tuple(statistics.median(t[i] for t in times[label][1:]) for i in (0, 1)) for label in ("plain", "sharded"))
    return max(0.0, sharded_f - plain_f), max(0.0, sharded_b - plain_b)


def _capture(captured: dict, name: str) -> Callable:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if name not in captured:
            captured[name] = (_detached(args), _detached(kwargs))
    return hook


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.detach(), value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _fresh(value: Any) -> Any:
    """The captured value as the layer was given it: tensors that required a gradient require one again (a leaf
    of their own, so that each run's backward stops at the layer)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.Tensor) \
            and isinstance(value[1], bool):
        tensor, grad = value
        return tensor.detach().requires_grad_(grad) if grad else tensor
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_tensor, value.values()) if t is not None), None)
    return getattr(value, "last_hidden_state", None)


def _settle(value: Any) -> None:
    """Wait for the collectives still in flight behind ``value``'s tensors (a functional collective's result is
    waited for where it is first read: in a model, by the next layer; timed alone, here), so that a layer's time
    holds its own collectives and no other's."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    for item in tree_flatten(value)[0]:
        local = getattr(item, "_local_tensor", item)
        if isinstance(local, AsyncCollectiveTensor):
            local.wait()


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value`` that are leaves requiring a gradient (the inputs a run's backward reaches)."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]


def _time_layer(module: nn.Module, args: tuple, kwargs: dict, *, repeats: int, sync: Callable[[], None],
                before: Callable[[], None] | None = None) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``module`` on the captured inputs, after one warm-up run;
    ``before`` runs ahead of each run, untimed."""
    import torch.distributed as dist

    forward: list[float] = []
    backward: list[float] = []
    for _ in range(repeats + 1):
        a, k = _fresh(args), _fresh(kwargs)
        if before is not None:
            before()
        dist.barrier()
        start = time.perf_counter()
        out = module(*a, **k)
        _settle(out)
        sync()
        middle = time.perf_counter()
        forward.append(middle - start)
        tensor = _first_tensor(out)
        dist.barrier()
        if tensor is None:  # no output needs a gradient (rotary tables, masks): the layer has no backward
            backward.append(0.0)
            continue
        grad = torch.ones_like(tensor)
        begin = time.perf_counter()
        tensor.backward(grad)
        _settle([t.grad for t in _leaves((a, k))])
        sync()
        backward.append(time.perf_counter() - begin)
    return statistics.median(forward[1:]), statistics.median(backward[1:])


def unit_entries(units: Sequence[tuple[int, str, float, float]], layouts: Sequence[Layout], *, ranks: int,
                 repeats: int, dtype: str = "fp32") -> list[UnitEntry]:
    """Database entries of rank 0's root-unit times (`time_unit`)."""
    return [UnitEntry(unit=key, name="root", dp=ranks // layouts[index].tp, ranks=ranks, dtype=dtype,
                      gather=gather, reduce_scatter=reduce, repeats=repeats)
            for index, key, gather, reduce in units]


def entries(results: Sequence[tuple[int, str, str, float, float, tuple | None]], layouts: Sequence[Layout], *,
            ranks: int, repeats: int, dtype: str = "fp32", recomputes: Sequence[bool]) -> list[Entry]:
    """Database entries of rank 0's results; ``recomputes[i]``: whether the layer of result i is one the plan
    recomputes and shards as its own FSDP unit (a repeated layer); another row is entered under recomputation
    ``none``, and under ZeRO 3 not at all (it belongs to the root unit, whose gathers no row's run holds)."""
    out = []
    for (index, key, name, forward, backward, steps), repeated in zip(results, recomputes):
        layout = layouts[index]
        if layout.zero and not repeated:
            continue
        step_forward, step_backward = steps if steps is not None and layout.zero == 1 else (None, None)
        out.append(Entry(layer=key, name=name, tp=layout.tp, sp=layout.sp,
                         recompute=layout.recompute if repeated else "none", zero=layout.zero,
                         samples=layout.samples, ranks=ranks,
                         dtype=dtype, forward=max(forward, 1e-9), backward=max(backward, 0.0), repeats=repeats,
                         step_forward=step_forward, step_backward=step_backward))
    return out
