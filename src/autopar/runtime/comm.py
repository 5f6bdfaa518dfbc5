"""Count the collectives a rank really issues, and compare them with what the cost model predicted for its stage.

The counter is a ``TorchDispatchMode`` that sees every call into the ``c10d`` and ``_c10d_functional`` operator
namespaces: DDP's bucket all-reduces, FSDP2's gathers and reduce-scatters, DTensor's tensor-parallel collectives
and the pipeline schedules' sends. (``CommDebugMode`` counts the same calls, but reports neither their bytes nor
their process group, and its module tracker raises under DDP.) Each call is recorded as (kind, mesh axis, bytes),
bytes being the whole buffer: the gathered output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce or a send, what a rank sends in an all-to-all, as the cost model prices them. A receive is not counted:
its send is, on the other rank.

DTensor converts an op's inputs inside its own dispatch, where no dispatch mode sees the collectives; those are
counted where DTensor calls the functional collectives (`CollectiveCounter._count_functional`). Calls of one
scalar (`SCALAR_BYTES`) are counted apart and not compared.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.plan import Plan

_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_": "all_reduce",  # in place: what compiled code (inductor) calls
    "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send_recv",
}

# where an all-to-all op takes the tensor this rank sends (its bytes are the call's: what arrives varies by rank
# where routing decides it, expert parallelism's, while the sum over ranks is what was sent)
_ALL_TO_ALL_INPUT = {"alltoall_base_": 1, "all_to_all_single": 0}

# the functional collectives DTensor converts values with (`CollectiveCounter._count_functional`)
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
}


def _mesh_group(bound: dict[str, Any]) -> Any:
    return (bound["mesh"], bound["mesh_dim"])


def _on_cpu(*args: Any, **kwargs: Any) -> bool:
    mesh = args[3] if len(args) > 3 else kwargs.get("mesh")
    return getattr(mesh, "device_type", None) == "cpu"


BYTES_TOLERANCE = 0.05  # FSDP pads shards to equal sizes; layer inputs a stage boundary does not send (rotary)
# A call moving at most this many bytes carries a scalar: the element count a mean over a split batch divides by,
# which DTensor sums for a loss's backward. The cost model prices tensors, not these; they are counted apart
# (`CollectiveCounter.scalars`) and left out of the comparison.
SCALAR_BYTES = 8


class CollectiveCounter(TorchDispatchMode):
    """Records (kind, axis, bytes) of every collective issued while active.

    ``axes`` maps a process group's name to the mesh axis it spans (``pp``, ``dp`` or ``tp``)."""

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__()
        self.axes = axes
        self.calls: list[tuple[str, str, int]] = []
        self.scalars: list[tuple[str, str, int]] = []  # calls of one scalar (`SCALAR_BYTES`), not compared
        self.enabled = True
        self._inside = 0  # > 0 within a functional collective counted by its wrapper (`_functional_counted`)
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CollectiveCounter:
        self._count_functional()
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()

    def _count_functional(self) -> None:
        """Count DTensor's own conversions too. DTensor converts an op's inputs (a split value gathered for a norm,
        a pending sum reduced for a non-linear op) inside its dispatch, where no dispatch mode sees the collectives
        it issues; it issues them through the functional collectives, which are counted here, where they are
        called. A functional collective called where the mode sees its op is counted once, by its wrapper."""
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.tensor.placement_types as placements

        for name, kind in _FUNCTIONAL.items():
            original = getattr(funcol, name, None)
            if original is not None:
                self._saved.append((funcol, name, original))
                setattr(funcol, name, self._functional_counted(original, kind))
        original = getattr(placements, "shard_dim_alltoall", None)
        if original is not None:  # CUDA's all-to-all (on CPU it gathers, through `all_gather_single`: counted so)
            self._saved.append((placements, "shard_dim_alltoall", original))
            placements.shard_dim_alltoall = self._functional_counted(original, "all_to_all", group=_mesh_group,
                                                                     unless=_on_cpu)

    def _restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _functional_counted(self, original: Any, kind: str, *, group: Any = None, unless: Any = None) -> Any:
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside or (unless is not None and unless(*args, **kwargs)):
                return original(*args, **kwargs)
            self._inside += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self._inside -= 1
            if self.enabled:
                bound = signature.bind(*args, **kwargs).arguments
                tensors = [t for t in (*bound.values(), out) if isinstance(t, torch.Tensor)]
                if kind == "all_to_all" and tensors:  # what this rank sends: its input
                    tensors = tensors[:1]
                nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
                where = group(bound) if group is not None else bound.get("group")
                self._record(kind, self._group_axis(where), nbytes)
            return out

        return counted

    def _record(self, kind: str, axis: str, nbytes: int) -> None:
        (self.scalars if nbytes <= SCALAR_BYTES else self.calls).append((kind, axis, nbytes))

    def _group_axis(self, group: Any) -> str:
        import torch.distributed._functional_collectives as funcol

        try:
            name = funcol._resolve_group_name(group)
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return "?"
        return self.axes.get(name, f"group {name}")

    supports_higher_order_operators = True  # a compiled checkpoint's HOPs pass through (none is a collective)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Layers compiled by ``torch.compile`` (plans with compiled kernels) run compiled while counted: the mode
        is off while dynamo traces and on while the compiled code runs, so the collectives it issues (DTensor's,
        FSDP's) are seen and the fused elementwise ops are not (without this, dynamo would skip compiling under
        the mode and the counted step would run eager)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        kind = _KINDS.get(func._opname) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind is not None and self.enabled and not self._inside:
            flat, _ = tree_flatten((args, kwargs, out))
            sent = _ALL_TO_ALL_INPUT.get(func._opname)
            tensors = [args[sent]] if sent is not None and isinstance(args[sent], torch.Tensor) else flat
            nbytes = max((t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)), default=0)
            self._record(kind, self._axis(flat), nbytes)
        return out

    def _axis(self, flat: Iterable[Any]) -> str:
        for value in flat:
            name = None
            if isinstance(value, str) and value in self.axes:
                name = value
            elif isinstance(value, torch.ScriptObject):
                try:
                    name = torch.distributed.ProcessGroup.unbox(value).group_name
                except RuntimeError:  # a reduce op, not a group
                    continue
            if name is not None:
                return self.axes.get(name, f"group {name}")
        return "?"

    def summary(self) -> list[dict[str, Any]]:
        """Calls and bytes per (kind, axis)."""
        return _summary((kind, axis, 1, nbytes) for kind, axis, nbytes in self.calls)


def _summary(rows: Iterable[tuple[str, str, int, float]]) -> list[dict[str, Any]]:
    """(kind, axis, calls, bytes of those calls) rows added up per (kind, axis)."""
    count: Counter[tuple[str, str]] = Counter()
    total: Counter[tuple[str, str]] = Counter()
    for kind, axis, calls, nbytes in rows:
        count[(kind, axis)] += calls
        total[(kind, axis)] += nbytes
    return [{"kind": k, "axis": a, "count": count[(k, a)], "bytes": total[(k, a)]} for k, a in sorted(count)]


def predicted(collectives: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cost model's per-device list (``CollectiveUse`` dicts, bytes per call) in the counter's form."""
    return _summary((c["kind"], c["axis"], c["count"], c["bytes"] * c["count"]) for c in collectives)


def compare(counted: list[dict[str, Any]], expected: list[dict[str, Any]], *,
            routed: frozenset[tuple[str, str]] = frozenset()) -> dict[str, Any]:
    """Every (kind, axis) must have the same number of calls and total bytes within `BYTES_TOLERANCE`; those in
    ``routed`` the same number of calls only (what routing sends each rank varies: `check_ranks` compares their
    bytes over all ranks)."""
    ours = {(c["kind"], c["axis"]): c for c in counted}
    theirs = {(c["kind"], c["axis"]): c for c in expected}
    rows, problems = [], []
    for key in sorted(set(ours) | set(theirs)):
        got = ours.get(key, {"count": 0, "bytes": 0})
        want = theirs.get(key, {"count": 0, "bytes": 0})
        ok = got["count"] == want["count"] and (key in routed or abs(got["bytes"] - want["bytes"]) <= BYTES_TOLERANCE
                                                * max(want["bytes"], 1))
        rows.append({"kind": key[0], "axis": key[1], "counted": got["count"], "predicted": want["count"],
                     "counted_bytes": got["bytes"], "predicted_bytes": want["bytes"], "ok": ok})
        if not ok:
            problems.append(
                f"{key[0]} on {key[1]}: {got['count']} calls of {got['bytes']:.0f} bytes counted, "
                f"{want['count']} of {want['bytes']:.0f} predicted"
            )
    message = "; ".join(problems) if problems else "collectives match the plan's prediction"
    return {"ok": not problems, "rows": rows, "message": message}


def stage_predictions(plan: Plan, *, dtype: torch.dtype = torch.float32) -> list[list[dict[str, Any]]]:
    """Per pipeline stage, the collectives one of its devices issues in an iteration, as the cost model predicts
    them for the plan's own workload (its model traced in ``dtype``: fp32, as the runtime trains it, unless a
    rehearsal runs in bf16; an intra-op plan's in fp32)."""
    from autopar.capture import trace
    from autopar.runtime.source import ModelSource
    from autopar.runtime.train import Workload
    from autopar.zoo import load

    work = Workload.of(plan)
    if not plan.is_pipeline:
        return [intra_prediction(plan, ModelSource.of_workload(work).traced_at(plan.micro_batch_size))]
    zoo = load(work.model, batch=1, seq=work.seq, dtype=dtype, **work.overrides)
    return predictions_on(plan, trace(zoo.module, example_kwargs=zoo.inputs), dtype)


def predictions_on(plan: Plan, graph: Any, dtype: torch.dtype, *,
                   gloo: bool | None = None) -> list[list[dict[str, Any]]]:
    """Per stage of the pipeline ``plan``, the collectives one of its devices issues in a step, as the cost model
    predicts them on ``graph`` (the model the plan names, traced in ``dtype`` at batch 1; compiled layers priced
    replaying whole, as they recompute)."""
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineModel
    from autopar.search.pipeline import config_of

    model = PipelineModel(graph, load_cluster("cpu").with_devices(plan.devices), traced_batch=1,
                          dtype="fp32" if dtype == torch.float32 else "bf16", kernels=plan.kernels)
    # a layer that computes nothing as the runtime builds the model (dropout at 0) is not in its trace
    chain = {layer.name for layer in model.layers}
    stages = tuple(dataclasses.replace(stage, layers=tuple(n for n in stage.layers if n in chain))
                   for stage in plan.stages)
    result = model.estimate(config_of(model, dataclasses.replace(plan, stages=stages)),
                            global_batch=plan.micro_batch_size * plan.micro_batches)
    return [predicted(_on_gloo({"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "count": c.count}, {"tp": stage.tp},
                               gloo=gloo) for c in report.collectives)
            for stage, report in zip(plan.stages, result.stages)]


def _on_gloo(call: dict[str, Any], sizes: dict[str, int], *, gloo: bool | None) -> dict[str, Any]:
    """``call`` as a rank issues it: on gloo (``gloo``, default: no CUDA here), which has no all-to-all, DTensor
    gathers the whole value instead and keeps its own part, so an all-to-all by which DTensor converts a value on
    an axis of ``sizes`` is counted as that all-gather (expert parallelism's own all-to-alls, on dp, are issued as
    such)."""
    if gloo is None:
        gloo = not torch.cuda.is_available()
    if gloo and call["kind"] == "all_to_all" and call["axis"] in sizes:
        return {**call, "kind": "all_gather", "bytes": call["bytes"] * sizes[call["axis"]]}
    return call


def intra_prediction(plan: Plan, graph: Any, *, gloo: bool | None = None) -> list[dict[str, Any]]:
    """The collectives every device of an intra-op plan issues in an iteration, as the cost model predicts them for
    ``graph`` (the plan's model traced in fp32 at the plan's micro-batch size), its blocks split as the plan says.
    On gloo (``gloo``, default: no CUDA here), which has no all-to-all, DTensor gathers the whole value instead and
    keeps its own part: each predicted all-to-all is counted as that all-gather."""
    from autopar.cluster import load_cluster
    from autopar.search.intra import repriced

    estimate = repriced(plan, graph, load_cluster("cpu").with_devices(plan.devices)).estimate
    sizes = dict(zip(plan.mesh.axes, plan.mesh.shape))
    return predicted(_on_gloo({"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "count": c.count}, sizes, gloo=gloo)
                     for c in estimate.collectives)


def stages_of_rank(plan: Plan, rank: int) -> list[int]:
    """Ranks fill device 0's dp x tp grid first, then device 1's, and so on; device ``d`` of ``pp`` runs stage ``d``
    (and, interleaved, stages ``d + pp``, ``d + 2 pp``, ...). An intra-op plan is one stage of every rank."""
    if not plan.is_pipeline:
        return [0]
    per_stage = plan.grid[0] * plan.grid[1]
    return list(range(rank // per_stage, len(plan.stages), plan.pp))


def rank_prediction(plan: Plan, expected: list[list[dict[str, Any]]], rank: int) -> list[dict[str, Any]]:
    """What ``rank`` should issue, from the per-stage predictions ``expected`` (`stage_predictions`): its stage's,
    or its chunks' added up when interleaved."""
    mine = (row for stage in stages_of_rank(plan, rank) for row in expected[stage])
    return _summary((r["kind"], r["axis"], r["count"], r["bytes"]) for r in mine)


def check_ranks(plan: Plan, counted: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Compare every rank's counted collectives with its stage's prediction; the first mismatch is named. Under
    expert parallelism the all-to-alls on dp send each rank what routing sent it, which the prediction (tokens
    spread evenly over the experts) does not know: their calls are compared rank by rank, their bytes summed over
    all ranks, where routing only moves them between ranks."""
    expected = stage_predictions(plan)
    routed = frozenset({("all_to_all", "dp")}) if plan.ep > 1 else frozenset()
    results = []
    for rank, summary in enumerate(counted):
        result = compare(summary, rank_prediction(plan, expected, rank), routed=routed)
        results.append({"rank": rank, **result})
        if not result["ok"]:
            return {"ok": False, "message": f"rank {rank}: {result['message']}", "ranks": results}
    for kind, axis in routed:
        got = sum(r["counted_bytes"] for result in results for r in result["rows"]
                  if (r["kind"], r["axis"]) == (kind, axis))
        want = sum(r["predicted_bytes"] for result in results for r in result["rows"]
                   if (r["kind"], r["axis"]) == (kind, axis))
        if abs(got - want) > BYTES_TOLERANCE * max(want, 1):
            return {"ok": False, "message": f"{kind} on {axis}: {got:.0f} bytes sent by all ranks together, "
                    f"{want:.0f} predicted", "ranks": results}
    return {"ok": True, "message": "every rank's collectives match the plan's prediction", "ranks": results}
