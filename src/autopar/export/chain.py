"""A pipeline plan as both exports read it: which rows of each stage are repeated layers, the one dp x tp grid a
target takes, what each stage recomputes, and the features no target here expresses (per-stage grids, intra-op
layouts), each as an `Approximation`.

A repeated layer is a row named as the child of a module list (``layers.3``, ``model.layers.3``,
``transformer.h.3``); the other rows (embedding, rotary tables, final norm, head, the root's loss) are what
torchtitan and Megatron-LM place on the first and last stage themselves.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from autopar.export.result import Approximation
from autopar.plan import Plan

_LAYER = re.compile(r"(?:^|\.)\d+$")


def is_layer(row: str) -> bool:
    return bool(_LAYER.search(row))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageView:
    """One stage: its rows, the repeated layers among them, and what it recomputes."""

    index: int
    rows: tuple[str, ...]
    layers: tuple[str, ...]
    full: tuple[str, ...]  # rows recomputed whole
    selective: tuple[str, ...]  # rows whose attention core is recomputed
    runs: tuple[tuple[str, str], ...]  # (first, last) rows checkpointed together
    dp: int
    tp: int
    intra: bool


def stage_views(plan: Plan) -> tuple[StageView, ...]:
    views = []
    for k, stage in enumerate(plan.stages):
        modes = dict(stage.recompute)
        views.append(StageView(
            index=k, rows=stage.layers, layers=tuple(r for r in stage.layers if is_layer(r)),
            full=tuple(r for r in stage.layers if modes.get(r) == "full"),
            selective=tuple(r for r in stage.layers if modes.get(r) == "selective"),
            runs=stage.segments, dp=stage.dp, tp=stage.tp, intra=stage.intra))
    return tuple(views)


def require_pipeline(plan: Plan, target: str) -> None:
    """An intra-op plan lays every op out over an N-D mesh; neither target takes per-op layouts, and no single
    dp x tp grid stands for them: refused, with what to export instead."""
    if plan.is_pipeline:
        return
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.mesh.axes, plan.mesh.shape))
    raise ValueError(f"{target} takes one dp x tp grid (with pipeline stages); this is an intra-op plan (--search "
                     f"ilp) laying each op out over mesh {mesh}, which it cannot express: export a plan from autopar "
                     "plan's pipeline searches (auto, aceso, megatron, dp, fsdp) or autopar estimate --out")


def choose_grid(views: tuple[StageView, ...], *, target: str) -> tuple[int, int, list[Approximation]]:
    """The (dp, tp) of the stages holding the most repeated layers (ties: the earlier stage's); a target with one
    grid for all stages runs the others on it, which is listed."""
    weight: Counter[tuple[int, int]] = Counter()
    for v in views:
        weight[(v.dp, v.tp)] += len(v.layers) or 1
    dp, tp = max(weight, key=lambda g: (weight[g], -_first(views, g)))
    others = [v for v in views if (v.dp, v.tp) != (dp, tp)]
    if not others:
        return dp, tp, []
    plan = ", ".join(f"stage {v.index} {v.dp} x {v.tp}" for v in views)
    return dp, tp, [Approximation(
        feature="grid", plan=f"per-stage dp x tp: {plan}",
        closest=f"{target} runs every stage on one grid: dp {dp} x tp {tp}, that of most layers; stages "
        f"{', '.join(str(v.index) for v in others)} run on it instead of their own (their time and memory differ "
        "from the estimate)")]


def _first(views: tuple[StageView, ...], grid: tuple[int, int]) -> int:
    return next(v.index for v in views if (v.dp, v.tp) == grid)


def intra_warnings(plan: Plan, views: tuple[StageView, ...], *, target: str) -> list[Approximation]:
    """Stages whose layers the intra-op planner lays out: the target applies its own Megatron-style tp plan."""
    laid = [v for v in views if v.intra or plan.stages[v.index].layouts]
    if not laid:
        return []
    splits = dict(plan.stages[laid[0].index].layouts)
    example = ", ".join(f"{m} {s}" for m, s in next(iter(splits.values()), ()))
    layers = sum(len(plan.stages[v.index].layouts) for v in laid)
    return [Approximation(
        feature="intra", plan=f"{layers} layers of stage {', '.join(str(v.index) for v in laid)} laid out by the "
        f"intra-op planner ({example or 'per-op splits'})",
        closest=f"the column/row (Megatron) tensor-parallel layout {target} applies to every layer: those stages "
        "run it, which the search priced slower for them")]


def recompute_text(views: tuple[StageView, ...], mode: str) -> str:
    """``"16 of 20 layers in stage 0, ..."``: how many of each stage's layers (or rows) are recomputed so."""
    parts = []
    for v in views:
        chosen = v.full if mode == "full" else v.selective
        if chosen:
            parts.append(f"{len(chosen)} of {len(v.layers) or len(v.rows)} in stage {v.index}")
    return ", ".join(parts) or "none"


def runs_warning(views: tuple[StageView, ...], *, closest: str) -> list[Approximation]:
    runs = [(v.index, first, last) for v in views for first, last in v.runs]
    if not runs:
        return []
    text = ", ".join(f"{first}..{last} (stage {k})" for k, first, last in runs[:4])
    more = f" and {len(runs) - 4} more" if len(runs) > 4 else ""
    return [Approximation(feature="recompute", plan=f"runs of layers checkpointed together: {text}{more}",
                          closest=closest)]


def rank_micro_batch(plan: Plan, dp: int) -> int:
    """Samples each data-parallel rank trains per micro-batch (the plan's micro-batch is across its dp ranks)."""
    return plan.micro_batch_size // dp
