"""Compute time of one node on one device: roofline with per-op-class efficiency plus a per-kernel overhead."""

from __future__ import annotations

from autopar.capture import Node
from autopar.cluster import Device

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def op_class(node: Node) -> str:
    if "attention" in node.op:
        return "attention"
    return "matmul" if node.flops_forward else "memory"


def node_seconds(node: Node, device: Device, *, backward: bool, shard: float = 1.0) -> float:
    """Seconds for the node's forward (or backward) on one device when its work is split ``shard`` ways.

    Backward moves about twice the forward bytes (read the saved input and the output gradient, write the input
    gradient). Views cost nothing.
    """
    if node.is_view:
        return 0.0
    flops = (node.flops_backward if backward else node.flops_forward) / shard
    moved = (node.bytes_read + node.bytes_written) * (2.0 if backward else 1.0) / shard
    if backward and not node.flops_forward and not node.saved_bytes:
        moved = 0.0 if node.bytes_written == 0 else moved  # a pure forward op (e.g. a mask) has little backward
    dtype = _DTYPES.get(node.outputs[0].dtype if node.outputs else "float32", "fp32")
    kind = op_class(node)
    compute = flops / (device.peak(dtype) * device.efficiency[kind]) if flops else 0.0
    memory = moved / (device.hbm_bandwidth * device.efficiency["memory"])
    return max(compute, memory) + device.kernel_overhead
