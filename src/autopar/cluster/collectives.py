"""Time of one collective on one mesh axis, from the cluster's link model.

Ring algorithms on n ranks moving a buffer of M bytes (M is the full buffer: the all-reduce input, the all-gather
output, the reduce-scatter input, the all-to-all input), each step paying the link latency a:

    all_reduce      2(n-1)/n * M / B + 2(n-1) a      (tree: 2 log2(n) a + 2 M / B; the cheaper is taken)
    all_gather      (n-1)/n * M / B + (n-1) a
    reduce_scatter  (n-1)/n * M / B + (n-1) a
    all_to_all      (n-1)/n * M / B + (n-1) a
    broadcast       M / B + ceil(log2 n) a
    send_recv       M / B + a

B is the bus bandwidth of the tier. An axis spanning nodes runs hierarchically: reduce-scatter inside the node, the
collective across nodes on 1/intra of the data, all-gather inside the node (all-reduce); all-gather and
reduce-scatter run their inter-node step on M/intra. Where a tier carries a measured table (`autopar calibrate`),
the bus bandwidth is interpolated from it by message size instead, since a single line misfits gloo by 20-45% in
mid sizes (PYTORCH-FACTS). Where it carries a table of the collective's own kind on groups of its size (`autopar
profile-ops --nproc N` times each kind; `--profile-db` adds them), the time is read from that table: gloo's
all-gather and reduce-scatter of 16 MiB on 2 ranks take 1.3-1.9 times an all-reduce of the same buffer, where the
ring model says half.
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np

from autopar.cluster.mesh import AxisPlacement
from autopar.cluster.spec import Cluster, Link, Measured


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


def bus_factor(kind: Collective, n: int) -> float:
    """Bytes each rank moves per byte of buffer, in a ring (NCCL-tests' bus-bandwidth factor)."""
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


def _steps(kind: Collective, n: int) -> float:
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1)
    if kind is Collective.BROADCAST:
        return math.ceil(math.log2(n))
    if kind is Collective.SEND_RECV:
        return 1
    return n - 1


def _measured_bus_bandwidth(link: Link, nbytes: float) -> float:
    m = link.measured
    assert m is not None
    sizes = np.asarray(m.bytes, dtype=float)
    bus = bus_factor(Collective.ALL_REDUCE, m.ranks) * sizes / np.asarray(m.seconds)
    return float(np.exp(np.interp(np.log(max(nbytes, 1.0)), np.log(sizes), np.log(bus))))


def _from_table(table: Measured, nbytes: float) -> float:
    """Seconds of one collective of ``nbytes`` from a table of its kind: interpolated log-log between the sizes
    measured; below the smallest, the smallest's time (latency bound); above the largest, the largest's time
    scaled by size (bandwidth bound)."""
    sizes, seconds = table.bytes, table.seconds
    if nbytes <= sizes[0]:
        return seconds[0]
    if nbytes >= sizes[-1]:
        return seconds[-1] * nbytes / sizes[-1]
    return float(np.exp(np.interp(np.log(nbytes), np.log(np.asarray(sizes, dtype=float)), np.log(seconds))))


def flat_seconds(kind: Collective, nbytes: float, n: int, link: Link) -> float:
    """One collective on n ranks all on one link tier."""
    if nbytes < 0:
        raise ValueError(f"collective size must not be negative, got {nbytes}")
    if n < 1:
        raise ValueError(f"collective group size must be at least 1, got {n}")
    if n == 1 and kind is not Collective.SEND_RECV:
        return 0.0
    table = link.table(kind.value, n)
    if table is not None:  # this kind measured on groups of n (a profile database's collectives)
        return _from_table(table, nbytes) if nbytes else 0.0
    factor = bus_factor(kind, n)
    if link.measured is not None:  # latency is inside the measured bandwidth
        return factor * nbytes / _measured_bus_bandwidth(link, nbytes) if nbytes else 0.0
    ring = factor * nbytes / link.bandwidth + _steps(kind, n) * link.latency
    if kind is Collective.ALL_REDUCE and n > 2:
        tree = 2 * nbytes / link.bandwidth + 2 * math.ceil(math.log2(n)) * link.latency
        return min(ring, tree)
    return ring


def collective_seconds(kind: Collective, nbytes: float, axis: AxisPlacement, cluster: Cluster) -> float:
    """One collective of ``nbytes`` on mesh axis ``axis``."""
    if kind is Collective.SEND_RECV:  # point to point between neighbours on the axis
        link = cluster.inter if axis.inter > 1 else cluster.intra
        return flat_seconds(kind, nbytes, 2, link)
    if axis.inter == 1:
        return flat_seconds(kind, nbytes, axis.intra, cluster.intra)
    if axis.intra == 1:
        return flat_seconds(kind, nbytes, axis.inter, cluster.inter)
    intra, inter = axis.intra, axis.inter
    if kind is Collective.ALL_REDUCE:
        return (
            flat_seconds(Collective.REDUCE_SCATTER, nbytes, intra, cluster.intra)
            + flat_seconds(Collective.ALL_REDUCE, nbytes / intra, inter, cluster.inter)
            + flat_seconds(Collective.ALL_GATHER, nbytes, intra, cluster.intra)
        )
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return flat_seconds(kind, nbytes / intra, inter, cluster.inter) + flat_seconds(
            kind, nbytes, intra, cluster.intra
        )
    if kind is Collective.ALL_TO_ALL:  # the share that leaves the node crosses the slower tier
        leaving = nbytes * (inter - 1) / inter
        return flat_seconds(kind, leaving, inter, cluster.inter) + flat_seconds(
            kind, nbytes / inter, intra, cluster.intra
        )
    return flat_seconds(kind, nbytes, axis.inter, cluster.inter) + flat_seconds(kind, nbytes, intra, cluster.intra)
