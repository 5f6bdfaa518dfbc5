"""Segments (CFP §4.1): cover the block sequence with as few unique runs of blocks as possible.

Blocks are compared by fingerprint (`ParallelBlock.fingerprint`: contraction ops and relative dependencies). From
each position a greedy scan takes the period that repeats back to back over the most blocks (ties: the shorter
period); blocks that start no repetition gather into a one-off segment until one does. A transformer becomes
[embedding] [layer] x L [head]: three unique segments whatever the depth. Instances of a segment share a
fingerprint, so the planner analyses, prices and solves each unique segment once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from autopar.analysis.blocks import ParallelBlock

MAX_PERIOD = 64  # longest repeated unit looked for, in blocks (a transformer layer is 4-6)


@dataclass(frozen=True, slots=True)
class Segment:
    fingerprint: str
    start: int  # first block id
    length: int  # blocks per instance
    count: int  # back-to-back instances

    @property
    def blocks(self) -> range:
        return range(self.start, self.start + self.length * self.count)

    def instance(self, k: int) -> range:
        first = self.start + k * self.length
        return range(first, first + self.length)


def find_segments(blocks: tuple[ParallelBlock, ...] | list[ParallelBlock]) -> list[Segment]:
    prints = [b.fingerprint for b in blocks]
    n = len(prints)
    segments: list[Segment] = []
    loose: list[int] = []  # blocks waiting to form a one-off segment

    def flush() -> None:
        if loose:
            segments.append(Segment(_combine(prints[loose[0] : loose[-1] + 1]), loose[0], len(loose), 1))
            loose.clear()

    i = 0
    while i < n:
        period, reps = _best_period(prints, i)
        if reps < 2:
            loose.append(i)
            i += 1
            continue
        flush()
        segments.append(Segment(_combine(prints[i : i + period]), i, period, reps))
        i += period * reps
    flush()
    return segments


def _best_period(prints: list[str], start: int) -> tuple[int, int]:
    n = len(prints)
    best_period, best_reps, best_cover = 1, 1, 1
    for period in range(1, min(MAX_PERIOD, (n - start) // 2) + 1):
        unit = prints[start : start + period]
        reps = 1
        while prints[start + reps * period : start + (reps + 1) * period] == unit:
            reps += 1
        if reps >= 2 and reps * period > best_cover:
            best_period, best_reps, best_cover = period, reps, reps * period
    return best_period, best_reps


def _combine(prints: list[str]) -> str:
    return hashlib.blake2b("/".join(prints).encode(), digest_size=8).hexdigest()
