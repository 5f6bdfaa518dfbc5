"""Count the collectives a rank really issues, and compare them with what the cost model predicted for its stage.

The counter is a ``TorchDispatchMode`` that sees every call into the ``c10d`` and ``_c10d_functional`` operator
namespaces: DDP's bucket all-reduces, FSDP2's gathers and reduce-scatters, DTensor's tensor-parallel collectives
and the pipeline schedules' sends. (``CommDebugMode`` counts the same calls, but reports neither their bytes nor
their process group, and its module tracker raises under DDP.) Each call is recorded as (kind, mesh axis, bytes),
bytes being the whole buffer: the gathered output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce or a send, as the cost model prices them. A receive is not counted: its send is, on the other rank.
"""

from __future__ import annotations

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

BYTES_TOLERANCE = 0.05  # FSDP pads shards to equal sizes; layer inputs a stage boundary does not send (rotary)


class CollectiveCounter(TorchDispatchMode):
    """Records (kind, axis, bytes) of every collective issued while active.

    ``axes`` maps a process group's name to the mesh axis it spans (``pp``, ``dp`` or ``tp``)."""

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__()
        self.axes = axes
        self.calls: list[tuple[str, str, int]] = []
        self.enabled = True

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
        if kind is not None and self.enabled:
            flat, _ = tree_flatten((args, kwargs, out))
            nbytes = max((t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor)), default=0)
            self.calls.append((kind, self._axis(flat), nbytes))
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


def compare(counted: list[dict[str, Any]], expected: list[dict[str, Any]]) -> dict[str, Any]:
    """Every (kind, axis) must have the same number of calls and total bytes within `BYTES_TOLERANCE`."""
    ours = {(c["kind"], c["axis"]): c for c in counted}
    theirs = {(c["kind"], c["axis"]): c for c in expected}
    rows, problems = [], []
    for key in sorted(set(ours) | set(theirs)):
        got = ours.get(key, {"count": 0, "bytes": 0})
        want = theirs.get(key, {"count": 0, "bytes": 0})
        ok = got["count"] == want["count"] and abs(got["bytes"] - want["bytes"]) <= BYTES_TOLERANCE * max(
            want["bytes"], 1
        )
        rows.append({"kind": key[0], "axis": key[1], "counted": got["count"], "predicted": want["count"],
                     "counted_bytes": got["bytes"], "predicted_bytes": want["bytes"], "ok": ok})
        if not ok:
            problems.append(
                f"{key[0]} on {key[1]}: {got['count']} calls of {got['bytes']:.0f} bytes counted, "
                f"{want['count']} of {want['bytes']:.0f} predicted"
            )
    message = "; ".join(problems) if problems else "collectives match the plan's prediction"
    return {"ok": not problems, "rows": rows, "message": message}


def stage_predictions(plan: Plan) -> list[list[dict[str, Any]]]:
    """Per pipeline stage, the collectives one of its devices issues in an iteration, as the cost model predicts
    them for the plan's own workload (its model traced in fp32, as the runtime trains it)."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineModel
    from autopar.runtime.train import Workload
    from autopar.search.pipeline import config_of
    from autopar.zoo import load

    work = Workload.of(plan)
    zoo = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, **work.overrides)
    devices = plan.devices
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(devices),
                          traced_batch=1, dtype="fp32", kernels=plan.kernels)  # compiled layers replay whole
    result = model.estimate(config_of(model, plan), global_batch=work.batch)
    return [predicted({"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "count": c.count} for c in report.collectives)
            for report in result.stages]


def stages_of_rank(plan: Plan, rank: int) -> list[int]:
    """Ranks fill device 0's dp x tp grid first, then device 1's, and so on; device ``d`` of ``pp`` runs stage ``d``
    (and, interleaved, stages ``d + pp``, ``d + 2 pp``, ...)."""
    per_stage = plan.grid[0] * plan.grid[1]
    return list(range(rank // per_stage, len(plan.stages), plan.pp))


def rank_prediction(plan: Plan, expected: list[list[dict[str, Any]]], rank: int) -> list[dict[str, Any]]:
    """What ``rank`` should issue, from the per-stage predictions ``expected`` (`stage_predictions`): its stage's,
    or its chunks' added up when interleaved."""
    mine = (row for stage in stages_of_rank(plan, rank) for row in expected[stage])
    return _summary((r["kind"], r["axis"], r["count"], r["bytes"]) for r in mine)


def check_ranks(plan: Plan, counted: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Compare every rank's counted collectives with its stage's prediction; the first mismatch is named."""
    expected = stage_predictions(plan)
    results = []
    for rank, summary in enumerate(counted):
        result = compare(summary, rank_prediction(plan, expected, rank))
        results.append({"rank": rank, **result})
        if not result["ok"]:
            return {"ok": False, "message": f"rank {rank}: {result['message']}", "ranks": results}
    return {"ok": True, "message": "every rank's collectives match the plan's prediction", "ranks": results}
