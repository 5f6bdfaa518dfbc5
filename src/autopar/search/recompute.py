"""Which layers of a stage to recompute: an exact choice by dynamic programming.

For one stage with its dp x tp and micro-batch fixed, each repeated layer ``i`` picks a level ``l`` in (none,
selective, full) with backward time ``t[i][l]`` and bytes kept per micro-batch ``a[i][l]``:

    minimise    sum_i t[i][l_i]
    subject to  in_flight * sum_i a[i][l_i]  <=  budget - held - transient - reserve

(held: what the stage holds besides activations and transients as its backward starts, `PipelineModel.held_bytes`:
model states as the runtime keeps them, wrapper and schedule buffers; transient: the largest of the loss's backward
and the layers' temporaries and, for a recomputed layer, its activations live again during its recompute). This is
a multiple-choice knapsack; with bytes rounded up to ``1 / buckets`` of the capacity it is solved exactly over the
rounded sizes in O(layers x buckets) with numpy. MAP (§5.2) runs the rotor dynamic programme over the linearised graph; at the
granularity of this cost model (a layer keeps its activations or its input) the knapsack is the same decision. The
stage's time is then as small as its memory allows, which also minimises the pipeline's slowest stage and sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from autopar.cost.pipeline import LayerPrice, PipelineConfig, PipelineModel, Stage
from autopar.cost.types import RECOMPUTE


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What one stage's recomputation choice works with: its layers' prices on one device, the micro-batches it
    holds at its peak, and the bytes left once the stage's model states and the device reserve are taken."""

    price: Callable[[int, str], LayerPrice]  # (row, recompute level) -> price
    in_flight: float
    budget: float
    transient: float = 0.0  # the largest of what the backward meets before the layers (the loss's)


def stage_memory(model: PipelineModel, config: PipelineConfig, index: int, *, global_batch: int) -> StageMemory:
    view = model.stage_view(config, index, global_batch=global_batch)
    device = model.cluster.device
    held, transient = model.held_bytes(config, index, global_batch=global_batch)
    return StageMemory(view.price, view.in_flight, device.memory - device.reserved - held, transient)


def slots(nbytes: float, unit: float) -> int:
    """``nbytes`` in slots of ``unit`` bytes, rounded up (a rounding error's worth of slack forgiven)."""
    return math.ceil(nbytes / unit - 1e-9)


def optimal_recompute(
    model: PipelineModel, config: PipelineConfig, index: int, *, global_batch: int, buckets: int = 2048
) -> Stage | None:
    """Stage ``index`` with the fastest recomputation that fits, or None when even full recomputation of every
    layer does not fit."""
    stage = config.stages[index]
    memory = stage_memory(model, config, index, global_batch=global_batch)
    rows = range(stage.start, stage.end)
    prices = {
        (row, level): memory.price(row, level)
        for row in rows
        for level in (RECOMPUTE if model.layers[row].repeated else ("none",))
    }
    layers = [r for r in rows if model.layers[r].repeated] or list(rows)  # the rest's: `StageMemory.transient`
    transient = max(memory.transient,
                    max(prices[(r, level)].temporary for r in layers for level in RECOMPUTE if (r, level) in prices),
                    max(prices[(r, "none")].activations for r in layers))
    capacity = (memory.budget - transient) / memory.in_flight
    fixed = sum(prices[(r, "none")].activations for r in rows if not model.layers[r].repeated)
    capacity -= fixed
    choosable = [r for r in rows if model.layers[r].repeated]
    if capacity < 0:
        return None
    if not choosable:
        return stage
    unit = capacity / buckets if capacity > 0 else 1.0
    best = np.zeros(buckets + 1)  # best[b]: least extra time with rounded bytes <= b units so far
    picks: list[np.ndarray] = []
    for row in choosable:
        options = [(level, prices[(row, level)]) for level in RECOMPUTE]
        base = prices[(row, "none")]
        new = np.full(buckets + 1, math.inf)
        choice = np.zeros(buckets + 1, dtype=np.int8)
        for k, (_, price) in enumerate(options):
            weight = slots(price.activations, unit) if unit > 0 else 0
            if weight > buckets:
                continue
            extra = (price.backward + price.comm_backward) - (base.backward + base.comm_backward)
            shifted = np.full(buckets + 1, math.inf)
            shifted[weight:] = best[: buckets + 1 - weight] + extra
            better = shifted < new
            new[better], choice[better] = shifted[better], k
        best = new
        picks.append(choice)
    if not math.isfinite(best[buckets]):
        return None
    levels: dict[int, str] = {}
    b = buckets
    for row, choice in zip(reversed(choosable), reversed(picks)):  # walk the choices back
        k = int(choice[b])
        level = RECOMPUTE[k]
        levels[row] = level
        b -= slots(prices[(row, level)].activations, unit) if unit > 0 else 0
    recompute = tuple(levels.get(row, "none") for row in rows)
    return replace(stage, recompute=recompute, segments=())


def with_optimal_recompute(
    model: PipelineModel, config: PipelineConfig, *, global_batch: int, rotor: bool = True
) -> PipelineConfig:
    """Every stage's recomputation chosen by `optimal_recompute` and by the rotor programme
    (`search.rotor`), whichever the cost model prices faster for the stage (stages where nothing fits are left as
    they are). Rotor runs only where the knapsack recomputes something: with nothing recomputed a stage is as fast
    as it can be. ``rotor=False``: the knapsack alone (cheaper, for trying many configurations)."""
    from autopar.search.rotor import rotor_recompute

    stages = list(config.stages)
    for index in range(len(stages)):
        current = replace(config, stages=tuple(stages))
        chosen = optimal_recompute(model, current, index, global_batch=global_batch)
        if rotor and (chosen is None or any(level != "none" for level in chosen.recompute)):
            candidates = [s for s in (chosen, rotor_recompute(model, current, index, global_batch=global_batch))
                          if s is not None]
            chosen = min(candidates, key=lambda s: _stage_score(model, current, index, s, global_batch), default=None)
        if chosen is not None:
            stages[index] = chosen
    return replace(config, stages=tuple(stages))


def _stage_score(model: PipelineModel, config: PipelineConfig, index: int, stage: Stage, global_batch: int):  # noqa: ANN202
    stages = list(config.stages)
    stages[index] = stage
    report = model.estimate(replace(config, stages=tuple(stages)), global_batch=global_batch).stages[index]
    return (not report.memory.fits, report.seconds if report.memory.fits else report.memory.total)
