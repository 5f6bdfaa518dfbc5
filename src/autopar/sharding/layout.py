"""Layouts (a DTensor placement per mesh axis) and the cheapest conversion between two of them (MAP §4.3).

A layout is a tuple with one `Shard(d)`, `Replicate()` or `Partial()` per mesh axis. Converting one layout into
another is a sequence of single-axis moves, each a collective on that axis over the tensor's *current* local
buffer (so the order of moves matters: gathering on a small axis after a large one moves more bytes):

    S(d) -> R     all_gather       output = local x n
    P    -> R     all_reduce
    P    -> S(d)  reduce_scatter
    R    -> S(d)  local slice      free
    S(d) -> S(e)  all_to_all
    R|S  -> P     illegal          (inf: nothing makes a whole value a pending sum without changing its meaning)

`LayoutCosts.convert` runs Dijkstra over layouts (at most 5^axes states for a 3-D tensor) with these moves and
caches the result by (shape, itemsize, source, target, gradient). Backward is priced the same way: the gradient
arrives in the consumer's gradient layout (Partial on an axis where the consumer split work the value was whole
for) and must reach the producer's output layout with Partial read as Replicate.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from functools import lru_cache

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["Layout", "LayoutCosts", "Partial", "Replicate", "Shard", "StridedShard", "Transfer", "is_shard", "shard_of"]

from autopar.cluster import Cluster, Collective, collective_seconds
from autopar.cluster.calls import CommCall, Phase
from autopar.cluster.mesh import Mesh

Layout = tuple[Placement, ...]
REPLICATE = Replicate()
PARTIAL = Partial()

INF = math.inf


# A split of a dim that merges others, taken along one of the inner ones (a sequence split of a (batch, sequence)
# dim flattened into tokens): DTensor's own placement for it. It moves as a Shard does (gathers, scatters, slices).
StridedShard = _StridedShard


def is_shard(p: Placement) -> bool:
    return isinstance(p, (Shard, StridedShard))


def shard_of(dim: int, stride: int = 1) -> Placement:
    """``Shard(dim)``, or ``StridedShard(dim, split_factor=stride)`` for a strided split (`analysis.Dim`)."""
    return Shard(dim) if stride == 1 else StridedShard(dim, split_factor=stride)


def short(p: Placement) -> str:
    """`Shard(0)` -> ``S(0)``, `StridedShard(0, split_factor=4)` -> ``S(0)/4``, `Replicate()` -> ``R``,
    `Partial()` -> ``P`` (DTensor's own short forms)."""
    if isinstance(p, StridedShard):
        return f"S({p.dim})/{p.split_factor}"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "P" if isinstance(p, Partial) else "R"


def short_layout(layout: Layout) -> str:
    return "".join(short(p) for p in layout) if len(layout) == 1 else "[" + ", ".join(short(p) for p in layout) + "]"


def parse(text: str) -> Placement:
    """``S(<dim>)``, ``S(<dim>)/<stride>``, ``R`` or ``P`` (`short`'s forms) as a placement; a dim of a tensor
    PyTorch can make (below 64), a stride above 1 that a 64-bit integer holds. Anything else: a ValueError."""
    text = text.strip()
    if text == "R":
        return REPLICATE
    if text == "P":
        return PARTIAL
    found = _SHARD.fullmatch(text)
    if found and int(found[1]) < MAX_TENSOR_DIMS:
        if found[2] is None:
            return Shard(int(found[1]))
        if 1 < int(found[2]) < 2**63:
            return StridedShard(int(found[1]), split_factor=int(found[2]))
    raise ValueError(f"placement {text!r} is not one of S(<dim>), S(<dim>)/<stride>, R, P (dims 0-"
                     f"{MAX_TENSOR_DIMS - 1}, strides 2 or more)")


MAX_TENSOR_DIMS = 64  # PyTorch's limit
_SHARD = re.compile(r"S\(([0-9]{1,20})\)(?:/([0-9]{1,20}))?")


def local_shape(shape: tuple[int, ...], layout: Layout, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The per-device shape under ``layout``; None when a sharded dim does not divide evenly."""
    local = list(shape)
    for p, n in zip(layout, sizes):
        if is_shard(p):
            if p.dim >= len(local) or local[p.dim] % n:
                return None
            local[p.dim] //= n
    return tuple(local)


def as_gradient(layout: Layout) -> Layout:
    """The layout a producer expects its output's gradient in: Partial outputs take replicated gradients."""
    return tuple(REPLICATE if isinstance(p, Partial) else p for p in layout)


@dataclass(frozen=True, slots=True)
class Transfer:
    forward: float
    backward: float
    collectives: tuple[CommCall, ...] = ()  # one call each on its mesh axis (by name), forward then backward

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


FREE = Transfer(0.0, 0.0)


def _whole_on(layout: Layout, axes: list[int]) -> Layout:
    return tuple(REPLICATE if a in axes else p for a, p in enumerate(layout))


class LayoutCosts:
    """Conversion costs on one mesh laid over one cluster (cached)."""

    def __init__(self, mesh: Mesh, cluster: Cluster) -> None:
        self.mesh = mesh
        self.cluster = cluster
        self.sizes = mesh.sizes
        self.convert = lru_cache(maxsize=1 << 16)(self._convert)

    def _convert(
        self, shape: tuple[int, ...], itemsize: int, source: Layout, target: Layout, gradient: Layout | None = None
    ) -> Transfer:
        single = [a for a, n in enumerate(self.sizes) if n == 1]
        if single:  # an axis of one device holds every layout whole: nothing moves on it
            source, target = _whole_on(source, single), _whole_on(target, single)
            gradient = None if gradient is None else _whole_on(gradient, single)
        fwd, fwd_moves = self._path(shape, itemsize, source, target, Phase.FORWARD)
        if gradient is None or fwd == INF:
            return Transfer(fwd, 0.0, fwd_moves)
        bwd, bwd_moves = self._path(shape, itemsize, gradient, as_gradient(source), Phase.BACKWARD)
        return Transfer(fwd, bwd, fwd_moves + bwd_moves)

    def _move(self, kind: Collective, nbytes: float, axis: int) -> float:
        return collective_seconds(kind, nbytes, self.mesh.placements[axis], self.cluster)

    def _path(
        self, shape: tuple[int, ...], itemsize: int, source: Layout, target: Layout, phase: Phase
    ) -> tuple[float, tuple[CommCall, ...]]:
        if source == target:
            return 0.0, ()
        if local_shape(shape, target, self.sizes) is None:
            return INF, ()
        if len(self.sizes) > 1:
            found = self._greedy(shape, itemsize, source, target, phase)
            if found is None:
                found = self._as_dtensor(shape, itemsize, source, target, phase)
            if found is not None:
                return found
        best = {source: 0.0}
        heap: list[tuple[float, int, Layout, tuple]] = [(0.0, 0, source, ())]
        tie = 1
        while heap:
            cost, _, layout, moves = heapq.heappop(heap)
            if layout == target:
                return cost, moves
            if cost > best.get(layout, INF):
                continue
            local = local_shape(shape, layout, self.sizes)
            if local is None:
                continue
            nbytes = itemsize * math.prod(local)
            for axis, (have, want) in enumerate(zip(layout, target)):
                # a pending sum goes straight to where it is wanted, as DTensor's redistribute takes it (a
                # reduce-scatter, never an all-reduce and a slice, even where the cluster prices that lower)
                for goal in ({want} if isinstance(have, Partial) else {want, REPLICATE}):
                    if goal == have:
                        continue
                    step = self._step(have, goal, nbytes, axis)
                    if step is None:
                        continue
                    seconds, kind, size = step
                    nxt = layout[:axis] + (goal,) + layout[axis + 1 :]
                    if local_shape(shape, nxt, self.sizes) is None:
                        continue
                    total = cost + seconds
                    if total < best.get(nxt, INF):
                        best[nxt] = total
                        extra = (CommCall(kind=kind, axis=self.mesh.names[axis], bytes=size, phase=phase),) \
                            if kind is not None else ()
                        heapq.heappush(heap, (total, tie, nxt, moves + extra))
                        tie += 1
        return INF, ()

    def _greedy(self, shape: tuple[int, ...], itemsize: int, source: Layout, target: Layout,
                phase: Phase) -> tuple[float, tuple[CommCall, ...]] | None:
        """The conversion on a mesh of several axes in the steps DTensor's redistribute takes them (its greedy
        plan, used where no layout is strided): from a layout with a split, first every axis from the innermost
        out, straight to the target (to whole where the tensor dim it splits to is split differently on an outer
        axis), then what remains from the outermost in. Each axis's collective moves what is local at that step,
        so the order decides which axis carries how many bytes. None where a layout is strided or a step is not
        one `_step` prices (the cheapest path is searched instead)."""
        if any(isinstance(p, _StridedShard) for p in (*source, *target)):
            return None
        walk = _Walk(self, shape, itemsize, source, phase)
        current, move = walk.current, walk.move
        if any(is_shard(p) for p in source):
            for axis in reversed(range(len(current))):
                goal = target[axis]
                if is_shard(goal):
                    before = [i for i in range(axis) if is_shard(current[i]) and current[i].dim == goal.dim]
                    wanted = [i for i in range(axis) if is_shard(target[i]) and target[i].dim == goal.dim]
                    if before != wanted:
                        goal = REPLICATE
                if current[axis] != goal and not move(axis, goal):
                    return None
        for axis in range(len(current)):
            if current[axis] != target[axis] and not move(axis, target[axis]):
                return None
        return walk.total, tuple(walk.moves)

    def _as_dtensor(self, shape: tuple[int, ...], itemsize: int, source: Layout, target: Layout,
                    phase: Phase) -> tuple[float, tuple[CommCall, ...]] | None:
        """The conversion in the steps DTensor's own redistribute planner takes (`_dtensor.redistribute_steps`),
        where `_greedy` declines (a strided split, which DTensor moves in other steps than its greedy ones: a sequence
        split of tokens made a batch split gathers the axes inside it first); None where the planner gives no
        answer or a step `_step` does not price."""
        from autopar.sharding._dtensor import redistribute_steps

        steps = redistribute_steps(self.sizes, shape, source, target)
        if steps is None:
            return None
        walk = _Walk(self, shape, itemsize, source, phase)
        if not all(walk.current[axis] == have and walk.move(axis, goal) for axis, have, goal in steps):
            return None
        return (walk.total, tuple(walk.moves)) if tuple(walk.current) == tuple(target) else None

    def _step(self, have: Placement, goal: Placement, nbytes: float,
              axis: int) -> tuple[float, Collective | None, float] | None:
        """(seconds, collective or None where the move is free, bytes of its buffer) of one move on ``axis``; None
        where the move is illegal."""
        n = self.sizes[axis]
        if isinstance(goal, Partial):
            return None
        if is_shard(have) and goal == REPLICATE:
            return self._move(Collective.ALL_GATHER, nbytes * n, axis), Collective.ALL_GATHER, nbytes * n
        if isinstance(have, Partial) and goal == REPLICATE:
            return self._move(Collective.ALL_REDUCE, nbytes, axis), Collective.ALL_REDUCE, nbytes
        if isinstance(have, Partial):
            return self._move(Collective.REDUCE_SCATTER, nbytes, axis), Collective.REDUCE_SCATTER, nbytes
        if have == REPLICATE:
            return 0.0, None, 0.0
        return self._move(Collective.ALL_TO_ALL, nbytes, axis), Collective.ALL_TO_ALL, nbytes


class _Walk:
    """A conversion made one single-axis move at a time from ``source``: the layout reached, the seconds and the
    collectives so far, each move priced on what is local at that step (`LayoutCosts._step`)."""

    def __init__(self, costs: LayoutCosts, shape: tuple[int, ...], itemsize: int, source: Layout,
                 phase: Phase) -> None:
        self.costs, self.shape, self.itemsize, self.phase = costs, shape, itemsize, phase
        self.current = list(source)
        self.total = 0.0
        self.moves: list[CommCall] = []

    def move(self, axis: int, goal: Placement) -> bool:
        """Move ``axis`` to ``goal``; False where that move is illegal or the layout has no local shape."""
        costs = self.costs
        local = local_shape(self.shape, tuple(self.current), costs.sizes)
        if local is None:
            return False
        step = costs._step(self.current[axis], goal, self.itemsize * math.prod(local), axis)
        if step is None:
            return False
        seconds, kind, size = step
        self.total += seconds
        if kind is not None:
            self.moves.append(CommCall(kind=kind, axis=costs.mesh.names[axis], bytes=size, phase=self.phase))
        self.current[axis] = goal
        return True

