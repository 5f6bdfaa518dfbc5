"""Compute time on one device: a roofline per kernel with per-op-class efficiency plus a per-kernel overhead.

One kernel moving ``bytes`` and doing ``flops`` takes

    t = max(flops / (peak(dtype) * eff), bytes / (hbm_bandwidth * eff_memory)) + kernel_overhead

with ``eff`` the device's efficiency for the op's class: a contraction's from the device's GEMM curve at the
kernel's FLOPs where the device has one (`Device.gemm_efficiency`: small and skinny GEMMs run further from peak),
else the constant ``efficiency["matmul"]``; the attention core's ``efficiency["attention"]`` (one flash kernel:
its FLOPs, and its bytes q, k, v and o only); memory-bound ops' ``efficiency["memory"]``.

Memory-bound ops (bias, activation, dropout, residual add, norm, softmax outside the attention core) between two
contractions are priced as the passes the runtime issues, the plan's ``kernels`` setting (`sequence_seconds`):

- ``eager``: one kernel per aten op, each reading its inputs and writing its outputs (`node_seconds`);
- ``compiled``: each maximal run of them between two contractions (views do not break a run) is one fused kernel,
  as Megatron-LM's fused kernels and ``torch.compile`` run it (`chain_seconds`): it reads its external inputs once
  and writes its external outputs once, plus one kernel overhead.

Contractions and the attention core are their own kernels in both settings: they are never fused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.capture import Node, Ref
from autopar.cluster import Device
from autopar.plan.records import KERNELS

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def op_class(node: Node) -> str:
    if "attention" in node.op:
        return "attention"
    return "matmul" if node.flops_forward else "memory"


def node_seconds(node: Node, device: Device, *, backward: bool, shard: float = 1.0) -> float:
    """Seconds for the node's forward (or backward) on one device when its work is split ``shard`` ways.

    Backward moves about twice the forward bytes (read the saved input and the output gradient, write the input
    gradient). Views cost nothing. A contraction's efficiency is the device's at the FLOPs of one of its forward
    kernels, ``flops_forward / shard`` (a backward runs two products of that size).
    """
    if node.is_view:
        return 0.0
    flops = (node.flops_backward if backward else node.flops_forward) / shard
    moved = (node.bytes_read + node.bytes_written) * (2.0 if backward else 1.0) / shard
    if backward and not node.flops_forward and not node.saved_bytes:
        moved = 0.0 if node.bytes_written == 0 else moved  # a pure forward op (e.g. a mask) has little backward
    dtype = _DTYPES.get(node.outputs[0].dtype if node.outputs else "float32", "fp32")
    kind = op_class(node)
    if kind == "matmul":
        efficiency = device.matmul_efficiency(node.flops_forward / shard)
    else:
        efficiency = device.efficiency[kind]
    compute = flops / (device.peak(dtype) * efficiency) if flops else 0.0
    memory = moved / (device.hbm_bandwidth * device.efficiency["memory"])
    return max(compute, memory) + device.kernel_overhead


def fusible(node: Node) -> bool:
    """Memory-bound ops fuse into a chain; contractions and the attention core never do (views are free)."""
    return not node.is_view and op_class(node) == "memory"


def sequence_seconds(
    priced: Sequence[tuple[Node, float]], device: Device, *, kernels: str = "eager", ops: Any = None,
    traced_batch: int = 1, tally: list[float] | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of ``priced``, nodes in execution order each with its shard factor (its work
    is split that many ways on the device), run as ``kernels`` says: ``eager`` sums `node_seconds`; ``compiled``
    prices every contraction and attention core by `node_seconds` and every maximal run of memory-bound ops
    between them (views skipped, the ends of the sequence closing a run) by `chain_seconds`.

    ``ops`` (an `autopar.profiling.ops.OpTimes`, eager kernels only: ops were timed one kernel each): an op it
    measured (the nodes traced at ``traced_batch`` samples) is priced by its measured times instead of
    `node_seconds`. ``tally``: a two-element list the measured seconds are added to (forward, backward)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    forward = backward = 0.0
    if kernels == "eager":
        for node, shard in priced:
            found = ops.seconds(node, traced_batch=traced_batch, shard=shard) if ops else None
            if found is not None:
                forward, backward = forward + found[0], backward + found[1]
                if tally is not None:
                    tally[0], tally[1] = tally[0] + found[0], tally[1] + found[1]
                continue
            forward += node_seconds(node, device, backward=False, shard=shard)
            backward += node_seconds(node, device, backward=True, shard=shard)
        return forward, backward
    flow = DataFlow.of(node for node, _ in priced)
    chain: list[tuple[Node, float]] = []
    for node, shard in [*priced, (None, 0.0)]:  # a sentinel closes the last chain
        if node is not None and (node.is_view or fusible(node)):
            if not node.is_view:
                chain.append((node, shard))
            continue
        if chain:
            f, b = chain_seconds(chain, device, flow=flow)
            forward, backward = forward + f, backward + b
            chain = []
        if node is not None:
            forward += node_seconds(node, device, backward=False, shard=shard)
            backward += node_seconds(node, device, backward=True, shard=shard)
    return forward, backward


Value = tuple[int, int]  # (node id, output index)


@dataclass(frozen=True, slots=True)
class DataFlow:
    """Which nodes of a sequence read each value, views seen through: a view's reads are reads of the value it
    views (its first input, followed through views)."""

    readers: dict[Value, frozenset[int]]
    base: dict[Value, Value]

    @classmethod
    def of(cls, nodes: Iterable[Node]) -> DataFlow:
        base: dict[Value, Value] = {}
        readers: dict[Value, set[int]] = {}
        for node in nodes:
            if node.is_view:
                if node.sources and node.sources[0].state is None:
                    origin = _origin(base, node.sources[0])
                    base.update(((node.id, k), origin) for k in range(len(node.outputs)))
                continue
            for source in node.sources:
                if source.state is None and source.node >= 0:
                    readers.setdefault(_origin(base, source), set()).add(node.id)
        return cls({value: frozenset(ids) for value, ids in readers.items()}, base)

    def origin(self, source: Ref) -> Value:
        return _origin(self.base, source)


def _origin(base: dict[Value, Value], source: Ref) -> Value:
    key = (source.node, source.index)
    return base.get(key, key)


def chain_bytes(chain: Sequence[tuple[Node, float]], *, flow: DataFlow) -> float:
    """Bytes one fused kernel of ``chain`` (memory-bound nodes, each with its shard factor) moves forward:

        sum over external inputs (values, parameters and model inputs it reads that no chain node produced, each
            once) of bytes / shard
      + sum over external outputs (chain outputs a node outside the chain reads, or no node of the sequence reads:
            they leave it) of bytes / shard
      + saved bytes of chain nodes whose outputs all stay inside the chain (a dropout mask kept for backward)

    with the shard factor of the chain node that reads or writes the value."""
    inside = {node.id for node, _ in chain}
    seen: set[Value | str] = set()
    moved = 0.0
    for node, shard in chain:
        for source, info in zip(node.sources, node.inputs):
            key = source.state if source.state is not None else flow.origin(source)
            if key in seen or (isinstance(key, tuple) and key[0] in inside):
                continue
            seen.add(key)
            moved += info.nbytes / shard
        escaping = 0.0
        for k, info in enumerate(node.outputs):
            read_by = flow.readers.get((node.id, k), frozenset())
            if not read_by or read_by - inside:
                escaping += info.nbytes / shard
        moved += escaping if escaping else node.saved_bytes / shard
    return moved


def chain_seconds(chain: Sequence[tuple[Node, float]], device: Device, *, flow: DataFlow) -> tuple[float, float]:
    """(forward, backward) seconds of ``chain`` run as one fused kernel each way:

        forward  = chain_bytes / (hbm_bandwidth * eff_memory) + kernel_overhead
        backward = 2 * chain_bytes / (hbm_bandwidth * eff_memory) + kernel_overhead

    (the backward reads the output gradients and what the forward saved, and writes the input gradients: about
    twice the forward's bytes, the convention of `node_seconds`)."""
    moved = chain_bytes(chain, flow=flow)
    if not moved:
        return 0.0, 0.0
    rate = device.hbm_bandwidth * device.efficiency["memory"]
    return moved / rate + device.kernel_overhead, 2 * moved / rate + device.kernel_overhead
