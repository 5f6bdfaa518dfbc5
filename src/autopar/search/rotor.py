"""Checkpointing by the rotor dynamic programme with communication terms (MAP §5.2, Theorem 5.1).

For one pipeline stage with its dp x tp and micro-batch fixed, this chooses which runs of layers to checkpoint,
nested or not. Each checkpointed run keeps only its input and replays its forward in the backward
(`autopar.cost.checkpoint`). The rest of the stage's layers keep their activations, whole or without the attention
core.

The chain is a stage's consecutive repeated layers in one container. Long chains are cut into at most ``groups``
elements of consecutive layers; rotor's stages may be groups of layers too. Element ``i`` has:
- ``u_i``: forward time, its collectives included;
- ``v_i``: backward time;
- ``a_i``: activations kept;
- ``x_i``: input kept by a checkpoint that starts at it.

Memory counts in slots of 1/``slots`` of the stage's budget, rounded up. ``C(i, j, m)`` is the least time to
process elements i..j, forward then backward, with at most ``m`` slots held. The chain's input is held by its
parent. The options for element ``i``:

    keep i:                 u_i + v_i + C(i+1, j, m - a_i)                               (a_i <= m)
    checkpoint i..k (k<j):  sum_{i..k} u + C(i, k, m) + C(k+1, j, m - x_i)

The first option is rotor's F_all. The second is F_ck followed by the recomputation of i..k; there ``C(i, k, m)``
is the checkpoint's peak bounded by ``m``. Communication enters through ``u`` and ``v`` (MAP's ``u_fcomm``,
``u_bcomm``).

In a pipeline a stage holds the kept bytes of every micro-batch in flight, and one of them recomputes at a time:

    in_flight * kept + max(largest temporary, largest checkpoint peak) <= budget

So the top level is a knapsack over the stage's layers. Each layer is kept, kept without its attention core, or
checkpointed alone; each run over whole elements ``i..k`` costs its forwards plus ``C(i, k, X)`` and keeps
``x_i``. The knapsack is solved for a few peak bounds ``X``: a grid, and each layer's activations. The fastest plan
that fits wins. Per layer these are the options of `search.recompute`'s knapsack, so rotor is never slower than it
but for rounding. The planner prices both with the cost model and keeps the faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage
from autopar.search.recompute import slots as _slots
from autopar.search.recompute import stage_memory

_INF = math.inf


@dataclass(frozen=True, slots=True)
class Element:
    """Consecutive rows [start, end) treated as one element of the chain."""

    start: int
    end: int
    forward: float  # u: compute and collectives
    backward: float  # v
    backward_selective: float  # v with the attention core recomputed
    kept: float  # a: bytes kept per micro-batch
    kept_selective: float
    input: float  # x: bytes a checkpoint starting here keeps


def _shift(values: np.ndarray, by: int) -> np.ndarray:
    """values[m - by] at m (infinite where m < by)."""
    out = np.full_like(values, _INF)
    if by <= 0:
        return values.copy()
    if by < len(values):
        out[by:] = values[: len(values) - by]
    return out


class Chain:
    """The rotor table ``C(i, j, m)`` of one chain of elements, for every m in 0..slots."""

    def __init__(self, elements: list[Element], unit: float, slots: int) -> None:
        self.elements = elements
        self.unit = unit
        n = len(elements)
        self.kept = [_slots(e.kept, unit) for e in elements]
        self.input = [_slots(e.input, unit) for e in elements]
        forward = np.cumsum([0.0] + [e.forward for e in elements])
        self.forwards = lambda i, k: forward[k + 1] - forward[i]  # sum of u over i..k
        empty = np.zeros(slots + 1)
        self.best: dict[tuple[int, int], np.ndarray] = {}
        self.choice: dict[tuple[int, int], np.ndarray] = {}  # -1: keep element i; k: checkpoint i..k first
        for length in range(1, n + 1):
            for i in range(n - length + 1):
                j = i + length - 1
                e = elements[i]
                rest = self.best[(i + 1, j)] if j > i else empty
                best = _shift(rest, self.kept[i]) + (e.forward + e.backward)
                choice = np.full(slots + 1, -1, dtype=np.int32)
                for k in range(i, j):
                    node = self.best[(i, k)] + self.forwards(i, k)
                    option = node + _shift(self.best[(k + 1, j)], self.input[i])
                    better = option < best
                    best[better], choice[better] = option[better], k
                self.best[(i, j)], self.choice[(i, j)] = best, choice

    def node(self, i: int, k: int, peak: int) -> float:
        """Time of checkpointing elements i..k: their forward, then their recomputation within ``peak`` slots."""
        return self.best[(i, k)][peak] + self.forwards(i, k)

    def children(self, i: int, j: int, m: int) -> list:
        """The chosen tree over elements i..j within m slots: element indices kept, and (i, k, children) nodes."""
        out: list = []
        while i <= j:
            k = int(self.choice[(i, j)][m])
            if k < 0:
                out.append(i)
                m -= self.kept[i]
                i += 1
            else:
                out.append((i, k, self.children(i, k, m)))
                m -= self.input[i]
                i = k + 1
        return out


def rotor_recompute(
    model: PipelineModel, config: PipelineConfig, index: int, *, global_batch: int, groups: int = 32,
    slots: int = 200, key_slots: int = 2048, peaks: int = 12,
) -> Stage | None:
    """Stage ``index`` with rotor's checkpointing, or None when nothing fits."""
    stage = config.stages[index]
    memory = stage_memory(model, config, index, global_batch=global_batch)
    price, in_flight, budget = memory.price, memory.in_flight, memory.budget
    rows = range(stage.start, stage.end)
    layers = [r for r in rows if model.layers[r].repeated] or list(rows)  # the rest's: `StageMemory.transient`
    temporary = max(memory.transient, max(price(r, "none").temporary for r in layers))
    fixed = sum(price(r, "none").activations for r in rows if not model.layers[r].repeated)
    if budget <= temporary:
        return None
    chains = [_elements(model, run, price, groups) for run in _runs(model, stage)]
    if not chains:
        return stage
    unit = budget / slots
    tables = [Chain(grouped, unit, slots) for _, grouped in chains]
    best_time, best_plan = _INF, None
    # peak bounds: a grid, and each layer's activations exactly (what checkpointing it alone needs)
    alone = {_slots(e.kept, unit) for layers, _ in chains for e in layers}
    for peak in sorted({0, *np.linspace(0, slots, peaks).astype(int)[1:], *(p for p in alone if p <= slots)}):
        transient = max(temporary, peak * unit)
        capacity = (budget - transient) / in_flight - fixed
        if capacity < 0:
            continue
        found = _top_level([(layers, table) for (layers, _), table in zip(chains, tables)], peak, unit, capacity,
                           key_slots)
        if found is not None and found[0] < best_time:
            best_time, best_plan = found[0], (peak, found[1])
    if best_plan is None:
        return None
    return _stage_of(stage, tables, *best_plan)


def _runs(model: PipelineModel, stage: Stage) -> list[list[int]]:
    """Maximal runs of repeated rows of the stage that share a container (a segment cannot leave its list)."""
    runs: list[list[int]] = []
    for row in range(stage.start, stage.end):
        layer = model.layers[row]
        if not layer.repeated:
            continue
        parent = layer.name.rpartition(".")[0]
        if runs and runs[-1][-1] == row - 1 and model.layers[runs[-1][-1]].name.rpartition(".")[0] == parent:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _elements(model: PipelineModel, run: list[int], price, groups: int) -> tuple[list[Element], list[Element]]:  # noqa: ANN001
    """The run's layers one by one, and grouped into at most ``groups`` elements for the rotor table."""
    layers = []
    for row in run:
        none, selective = price(row, "none"), price(row, "selective")
        layers.append(Element(
            start=row, end=row + 1, forward=none.forward + none.comm_forward,
            backward=none.backward + none.comm_backward,
            backward_selective=selective.backward + selective.comm_backward,
            kept=none.activations, kept_selective=selective.activations, input=price(row, "full").activations,
        ))
    size = math.ceil(len(run) / groups)
    grouped = []
    for a in range(0, len(layers), size):
        chunk = layers[a:a + size]
        grouped.append(Element(
            start=chunk[0].start, end=chunk[-1].end, forward=sum(e.forward for e in chunk),
            backward=sum(e.backward for e in chunk), backward_selective=sum(e.backward_selective for e in chunk),
            kept=sum(e.kept for e in chunk), kept_selective=sum(e.kept_selective for e in chunk),
            input=chunk[0].input,
        ))
    return layers, grouped


def _top_level(chains: list[tuple[list[Element], Chain]], peak: int, unit: float, capacity: float,
               key_slots: int):  # noqa: ANN202
    """The stage's fastest choice keeping at most ``capacity`` bytes per micro-batch, with every recomputation
    peaking within ``peak`` slots of ``unit`` bytes: (time, per chain the list of top-level items) or None.

    Items, per layer: keep it, keep it without the attention core, or checkpoint it alone; and checkpointed runs
    over whole elements of the rotor table."""
    key = capacity / key_slots if capacity > 0 else 1.0

    def weight(nbytes: float) -> int:
        return _slots(nbytes, key) if capacity > 0 else (0 if nbytes <= 0 else key_slots + 1)

    best = np.zeros(key_slots + 1)
    traces = []
    for layers, table in chains:
        ends = {e.end: j for j, e in enumerate(table.elements)}
        first = layers[0].start
        at = [best]  # at[p]: best over the run's first p layers
        back: list[list] = []
        for p, e in enumerate(layers):
            options = [(weight(e.kept), e.forward + e.backward, ("keep", e.start), p),
                       (weight(e.kept_selective), e.forward + e.backward_selective, ("selective", e.start), p)]
            if _slots(e.kept, unit) <= peak:  # alone: keeps its input, its activations live again
                options.append((weight(e.input), 2 * e.forward + e.backward, ("full", e.start), p))
            j = ends.get(e.end)
            if j is not None:
                for i in range(j + 1):
                    cost = table.node(i, j, peak)
                    if math.isfinite(cost) and e.end - table.elements[i].start > 1:  # one layer: "full" above
                        options.append((weight(table.elements[i].input), cost, ("checkpoint", i, j),
                                        table.elements[i].start - first))
            new = np.full(key_slots + 1, _INF)
            pick = np.full(key_slots + 1, -1, dtype=np.int32)
            for k, (w, cost, _, origin) in enumerate(options):
                if w > key_slots:
                    continue
                # new[m] vs at[origin][m - w] + cost for m >= w, in place on the slices (the hot loop)
                option = at[origin][: key_slots + 1 - w] + cost
                target = new[w:]
                better = option < target
                np.copyto(target, option, where=better)
                pick[w:][better] = k
            at.append(new)
            back.append((options, pick))
        traces.append((at, back))
        best = at[-1]
    if not math.isfinite(best[key_slots]):
        return None
    plan: list[list] = [[] for _ in chains]
    w = key_slots
    for t in range(len(chains) - 1, -1, -1):  # walk the choices back, chain by chain
        at, back = traces[t]
        p = len(back)
        items = []
        while p > 0:
            options, pick = back[p - 1]
            weight_, _, item, origin = options[int(pick[w])]
            items.append(item)
            w -= weight_
            p = origin
        plan[t] = items[::-1]
    return float(best[key_slots]), plan


def _stage_of(stage: Stage, tables: list[Chain], peak: int, plan: list[list]) -> Stage:
    levels = {r: "none" for r in range(stage.start, stage.end)}
    segments: list[tuple[int, int]] = []

    def place(table: Chain, i: int, k: int, children: list) -> None:
        a, b = table.elements[i].start, table.elements[k].end
        if b - a == 1:
            levels[a] = "full"
        else:
            segments.append((a, b))
        for child in children:
            if isinstance(child, tuple):
                place(table, *child)

    for table, items in zip(tables, plan):
        for item in items:
            if item[0] in ("selective", "full"):
                levels[item[1]] = item[0]
            elif item[0] == "checkpoint":
                _, i, k = item
                place(table, i, k, table.children(i, k, peak))
    recompute = tuple(levels[r] for r in range(stage.start, stage.end))
    return replace(stage, recompute=recompute, segments=tuple(sorted(segments)))
