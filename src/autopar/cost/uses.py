"""The plan file's `CollectiveUse` records, built from the cost model's `CommCall` records (`autopar.cluster.calls`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from autopar.cluster.calls import CommCall
from autopar.plan.estimate import CollectiveUse

__all__ = ["collective_uses"]


def collective_uses(calls: Iterable[CommCall], *, labels: Mapping[str, str] | None = None) -> tuple[CollectiveUse, ...]:
    """What one device issues in an iteration: the calls of each (kind, axis, bytes) summed over phases, sorted by
    (kind, axis, bytes). ``labels`` renames mesh axes (an intra-op plan names an axis by what it does on it). A
    record without an axis, or calls summing to a fraction, has no place in the file: refused."""
    merged: dict[tuple, list] = {}
    for c in calls:
        key = (c.kind, c.axis, c.bytes)
        found = merged.get(key)
        if found is None:
            merged[key] = [c.bytes, c.calls]
        else:
            found[1] += c.calls
    totals: dict[tuple, list] = {}  # by the names the file gives them
    for (kind, axis, _), (nbytes, count) in merged.items():
        if axis is None:
            raise ValueError(f"{kind.value} of {nbytes} bytes has no mesh axis to report it on")
        key = (kind.value, axis if labels is None else labels[axis], nbytes)
        found = totals.get(key)
        if found is None:
            totals[key] = [nbytes, count]
        else:
            found[1] += count
    uses = []
    for (kind, axis, _), (nbytes, count) in sorted(totals.items()):
        if count != int(count):
            raise ValueError(f"{kind} on {axis} ({nbytes} bytes) counts {count} calls an iteration, not a whole number")
        uses.append(CollectiveUse(kind=kind, axis=axis, bytes=nbytes, count=int(count)))
    return tuple(uses)
