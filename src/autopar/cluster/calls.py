"""One record for every collective the cost model counts: `CommCall`, and the helpers that merge and count them.

A record is ``calls`` calls of one collective ``kind`` moving ``bytes`` each (the full buffer, as
`collectives.collective_seconds` takes it) on mesh axis ``axis``, issued in ``phase``:

    forward    a layer's or a conversion's forward (tensor parallelism, layout conversions)
    backward   their backward, a recomputed forward's replays included
    sync       once-per-iteration gradient sums (data parallelism, weights kept whole over tp or tied over pp)
    send       point-to-point sends between pipeline stages, and what their receiver gathers

Records of one (kind, axis, bytes, phase) are one collective: `merge_calls` sums their calls, so

    merge_calls(a + b) == merge_calls(merge_calls(a) + merge_calls(b))

and counting what a device issues in an iteration is merging its records scaled by how often each runs
(`CommCall.times`). The plan file's `CollectiveUse` is built from them in one place (`autopar.cost.uses`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from autopar.cluster.collectives import Collective

__all__ = ["CommCall", "Phase", "merge_calls", "subtract_calls"]


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SYNC = "sync"
    SEND = "send"


@dataclass(frozen=True, slots=True, kw_only=True)
class CommCall:
    """``calls`` calls of ``kind`` on mesh axis ``axis`` (None where the axis is not known), ``bytes`` each, issued
    in ``phase``. ``calls`` may be fractional where a figure is a per-micro-batch share of a per-iteration call."""

    kind: Collective
    axis: str | None
    bytes: float
    phase: Phase
    calls: float = 1

    def __post_init__(self) -> None:
        if type(self.kind) is Collective and type(self.phase) is Phase and 0 <= self.bytes < math.inf \
                and 0 <= self.calls < math.inf:
            return  # one test on the way every estimate takes; the refusals below say which field is wrong
        if not isinstance(self.kind, Collective):
            raise ValueError(f"kind must be a Collective, got {self.kind!r}")
        if not isinstance(self.phase, Phase):
            raise ValueError(f"phase must be a Phase, got {self.phase!r}")
        if not (0 <= self.bytes < math.inf):
            raise ValueError(f"bytes must be finite and not negative, got {self.bytes!r}")
        if not (0 <= self.calls < math.inf):
            raise ValueError(f"calls must be finite and not negative, got {self.calls!r}")

    @property
    def key(self) -> tuple[Collective, str | None, float, Phase]:
        """What makes two records one collective (`merge_calls` sums the calls of records with one key)."""
        return (self.kind, self.axis, self.bytes, self.phase)

    def times(self, count: float) -> CommCall:
        """This record issued ``count`` times as often: calls x count."""
        return CommCall(kind=self.kind, axis=self.axis, bytes=self.bytes, phase=self.phase, calls=self.calls * count)

    def scaled(self, factor: float) -> CommCall:
        """The same calls on a buffer ``factor`` times as large (a trace at one batch priced at another)."""
        return CommCall(kind=self.kind, axis=self.axis, bytes=self.bytes * factor, phase=self.phase, calls=self.calls)

    def during(self, phase: Phase) -> CommCall:
        """The same calls issued in ``phase`` (a forward's collectives replayed by recomputation in the backward)."""
        return CommCall(kind=self.kind, axis=self.axis, bytes=self.bytes, phase=phase, calls=self.calls)


def merge_calls(calls: Iterable[CommCall]) -> tuple[CommCall, ...]:
    """One record per (kind, axis, bytes, phase), its calls the sum of theirs, in order of first appearance;
    records whose calls sum to 0 are left out."""
    totals: dict[tuple, list] = {}
    for c in calls:
        key = (c.kind, c.axis, c.bytes, c.phase)  # `CommCall.key`, spelt out: this loop prices every estimate
        found = totals.get(key)
        if found is None:
            totals[key] = [c, c.calls]
        else:
            found[1] += c.calls
    return tuple(c if total == c.calls else _with_calls(c, total) for c, total in totals.values() if total)


def subtract_calls(calls: Iterable[CommCall], removed: Iterable[CommCall]) -> tuple[CommCall, ...]:
    """`merge_calls` of ``calls`` less the calls of ``removed`` (a replay that stops before its last collective);
    a removed record that ``calls`` does not hold as often is an error, not a negative count."""
    totals = {c.key: c for c in merge_calls(calls)}
    for r in merge_calls(removed):
        held = totals.get(r.key)
        if held is None or held.calls < r.calls:
            raise ValueError(f"cannot remove {r.calls} call(s) of {r.kind.value} ({r.bytes} bytes, {r.phase.value}) "
                             f"from {0 if held is None else held.calls}")
        totals[r.key] = _with_calls(held, held.calls - r.calls)
    return tuple(c for c in totals.values() if c.calls)


def _with_calls(call: CommCall, calls: float) -> CommCall:
    return CommCall(kind=call.kind, axis=call.axis, bytes=call.bytes, phase=call.phase, calls=calls)
