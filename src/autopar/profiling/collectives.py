"""Each collective kind timed on the live process group, at the message sizes a model's plans send (Aceso §3.3
profiles collectives once into its database beside the ops).

The sizes come from the traced model: from its smallest activation split the most ways tensor parallelism is
profiled for, to the larger of its largest activation at the most samples and its parameters (what data
parallelism reduces and ZeRO gathers), capped at `MAX_BYTES`, at every power of two between (`sizes_for`). Each
kind (`autopar.profiling.db.COLLECTIVE_KINDS`) is timed on groups of every size that divides the ranks and is at
least 2, all groups at once, as the groups of a plan's mesh axis run side by side on one host; a size is the whole
buffer, as `autopar.cluster.collectives` counts it (the all-reduce input, the all-gather output, the
reduce-scatter input, the all-to-all input). Each time is the median of the runs after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.capture import Graph
from autopar.profiling.db import COLLECTIVE_KINDS

MIN_BYTES = 4 << 10
MAX_BYTES = 64 << 20  # DDP's buckets and one layer's gathered weights stay below this on the models profiled here


def sizes_for(graph: Graph, *, samples: Sequence[int], ways: Sequence[int]) -> list[int]:
    """Message sizes to time for ``graph`` (traced at one sample): powers of two from its smallest activation
    per sample cut ``max(ways)`` ways to its largest activation at ``max(samples)`` or its parameters' bytes,
    whichever is larger, within `MIN_BYTES` to `MAX_BYTES`."""
    activations = [out.nbytes for node in graph.nodes for out in node.outputs if out.nbytes > 0]
    params = sum(s.tensor.nbytes for s in graph.state.values() if not s.is_buffer)
    low = max(MIN_BYTES, min(activations, default=MIN_BYTES) // max(ways))
    high = min(MAX_BYTES, max(max(activations, default=MIN_BYTES) * max(samples), params))
    size = 1 << (max(low, 1).bit_length() - 1)  # the power of two at or below the smallest
    out = []
    while size < high:
        out.append(size)
        size *= 2
    out.append(size)
    return out


def time_collectives(sizes: Sequence[int], *, repeats: int, device: torch.device,
                     sync: Callable[[], None] | None = None) -> list[tuple[str, int, list[tuple[int, float]]]]:
    """In every rank of the default group: each kind at each size on groups of each size dividing the world
    (consecutive ranks), every group at once. Returns this rank's (kind, group size, [(bytes, seconds)])."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    sync = sync or (lambda: None)
    results = []
    for size in [g for g in range(2, world + 1) if world % g == 0]:
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
        group = groups[rank // size]
        for kind in COLLECTIVE_KINDS:
            points = []
            for nbytes in sizes:
                run = _collective(kind, nbytes - nbytes % (4 * size), size, group, device)
                run()  # warm-up (and the connection for this size)
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    sync()
                    begin = time.perf_counter()
                    run()
                    sync()
                    times.append(time.perf_counter() - begin)
                points.append((nbytes, statistics.median(times)))
            results.append((kind, size, points))
        for g in groups:
            dist.destroy_process_group(g)
    return results


def _collective(kind: str, nbytes: int, size: int, group: Any, device: torch.device) -> Callable[[], None]:
    """One collective of a ``nbytes`` buffer (fp32) on ``group`` of ``size`` ranks, ready to run."""
    import torch.distributed as dist

    whole = torch.randn(max(nbytes // 4, size), device=device)
    part = torch.empty(whole.numel() // size, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    # the names torch 2.13 gives them; the older ones, deprecated there, before
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    if kind == "all_gather":
        return lambda: gather(whole, part, group=group)
    if kind == "reduce_scatter":
        return lambda: scatter(part, whole, group=group)
    out = torch.empty_like(whole)
    return lambda: dist.all_to_all_single(out, whole, group=group)
