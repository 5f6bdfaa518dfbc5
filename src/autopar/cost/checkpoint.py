"""Checkpointed segments: runs of layers that keep only their input and replay their forward in the backward.

A stage's recomputation is a tree. Its leaves are rows (layers): kept ("none", "selective") or checkpointed alone
("full"). Its inner nodes are segments of two or more rows, which may nest. Per micro-batch a segment keeps its
first row's input; in the backward it replays its children's forwards, then runs their backwards last to first.
While it does, it holds what its earlier children keep plus what the current child needs:

    peak(segment) = max_j ( sum_{i < j} keep_i + need_j )

Here keep and need are a row's activations when kept. A "full" row keeps its input and needs its activations. A
nested segment keeps its input and needs its own peak.

What a replay runs is what PyTorch's non-reentrant checkpoint runs, measured on torch 2.13. It stops once every
tensor the segment saved has been recomputed. So a trailing plain row replays without its last collective: the
row-parallel reduction only the residual add reads (`LayerPrice.tail`; a post-norm saves that reduction's output,
and there the row replays it too). A trailing nested checkpoint (a segment or a "full" row) does
not replay at all, because it recomputes itself from the input it holds. Other children replay in full.

This is also the model of the rotor dynamic programme, MAP §5.2 (`autopar.search.rotor`). Rotor charges every
nested forward. Its value is therefore an upper bound on the time priced here, equal when no segment ends in a
nested one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.cluster.calls import CommCall, Phase, merge_calls, subtract_calls


@dataclass(frozen=True, slots=True)
class Segment:
    start: int
    end: int
    children: tuple[int | Segment, ...]


@dataclass(slots=True)
class SegmentCosts:
    """What a stage's segments add to its per-micro-batch figures, on top of the per-row prices."""

    backward: float = 0.0  # replayed forward compute
    comm: float = 0.0  # replayed forward collectives
    kept: float = 0.0  # change in bytes kept per micro-batch (negative: saved)
    transient: float = 0.0  # the largest segment peak while its backward runs
    # per outermost segment: (first row, end row, bytes it keeps, its peak while its backward runs)
    runs: list[tuple[int, int, float, float]] = field(default_factory=list)
    collectives: tuple[CommCall, ...] = ()  # replayed calls per micro-batch (in the backward), merged


def check_segments(segments, start: int, end: int, level_of: Callable[[int], str]) -> None:  # noqa: ANN001
    """Refuse segments outside [start, end), shorter than two rows, overlapping without nesting, or holding
    a row with selective recomputation."""
    ordered = sorted(segments, key=lambda s: (s[0], -s[1]))
    open_: list[tuple[int, int]] = []
    for a, b in ordered:
        if not start <= a < b <= end or b - a < 2:
            raise ValueError(f"a checkpointed segment must span 2 or more rows of the stage [{start}, {end}), "
                             f"got [{a}, {b})")
        while open_ and open_[-1][1] <= a:
            open_.pop()
        if open_ and (b > open_[-1][1] or (a, b) == open_[-1]):
            raise ValueError(f"checkpointed segments [{open_[-1][0]}, {open_[-1][1]}) and [{a}, {b}) overlap "
                             "without one holding the other")
        open_.append((a, b))
        for row in range(a, b):
            if level_of(row) == "selective":
                raise ValueError(f"row {row} is in checkpointed segment [{a}, {b}): it can be recomputed in full "
                                 "or not at all, not selectively")


def nest(start: int, end: int, segments) -> tuple[int | Segment, ...]:  # noqa: ANN001
    """The children of rows [start, end): rows, and the outermost segments with their own children."""
    inner = sorted(segments, key=lambda s: (s[0], -s[1]))
    children: list[int | Segment] = []
    row, k = start, 0
    while row < end:
        if k < len(inner) and inner[k][0] == row:
            a, b = inner[k]
            held = [s for s in inner[k + 1:] if s[0] < b]
            children.append(Segment(a, b, nest(a, b, held)))
            k += 1 + len(held)
            row = b
        else:
            children.append(row)
            row += 1
    return tuple(children)


def rows_of(child: int | Segment) -> range:
    return range(child, child + 1) if isinstance(child, int) else range(child.start, child.end)


def segment_costs(stage, price) -> SegmentCosts:  # noqa: ANN001
    """Price the segments of ``stage`` (a `cost.pipeline.Stage`). ``price(row, level)`` returns the row's
    `LayerPrice` at that recomputation level."""
    costs = SegmentCosts()
    level = stage.recompute_of
    replayed: list[CommCall] = []
    stopped: list[CommCall] = []  # the last collectives of segments' last rows, which do not replay

    def keep(child: int | Segment) -> float:
        first = child if isinstance(child, int) else child.start
        return price(first, level(first) if isinstance(child, int) else "full").activations

    def need(child: int | Segment) -> float:
        if isinstance(child, int):
            return price(child, "none").activations
        return peak(child)

    def peak(segment: Segment) -> float:
        held = worst = 0.0
        for child in segment.children:
            worst = max(worst, held + need(child))
            held += keep(child)
        return worst

    def replay(segment: Segment) -> None:
        last = len(segment.children) - 1
        for j, child in enumerate(segment.children):
            nested = isinstance(child, Segment) or level(child) == "full"
            if j == last and nested:
                break  # recomputes itself from the input it holds
            for row in rows_of(child):
                p = price(row, level(row))
                costs.backward += p.forward
                costs.comm += p.comm_forward
                replayed.extend(c.during(Phase.BACKWARD) for c in p.forward_collectives)
            if j == last and p.tail:  # the last saved tensor comes before the layer's last collectives
                costs.comm -= p.tail_seconds
                stopped.extend(c.during(Phase.BACKWARD) for c in p.tail)
        for child in segment.children:
            if isinstance(child, Segment):
                replay(child)

    for child in nest(stage.start, stage.end, stage.segments):
        if isinstance(child, Segment):
            replay(child)
            costs.kept += keep(child) - sum(price(r, level(r)).activations for r in rows_of(child))
            costs.transient = max(costs.transient, peak(child))
            costs.runs.append((child.start, child.end, keep(child), peak(child)))
    costs.collectives = subtract_calls(merge_calls(replayed), stopped)
    return costs
