"""Checkpointed segments in the cost model, and the rotor dynamic programme that chooses them."""

import dataclasses
import math

import numpy as np
import pytest

from autopar.cost.checkpoint import Segment, check_segments, nest
from autopar.cost.pipeline import PipelineConfig, Stage
from autopar.search.pipeline import even_stages
from autopar.search.recompute import optimal_recompute, with_optimal_recompute
from autopar.search.rotor import Chain, Element, rotor_recompute
from test_pipeline import _model


def _trees(i: int, j: int):
    """Every sequence over elements i..j: keep element i, or checkpoint a strict prefix i..k, then the rest."""
    if i > j:
        yield ()
        return
    for rest in _trees(i + 1, j):
        yield (i, *rest)
    for k in range(i, j):
        for inner in _trees(i, k):
            for rest in _trees(k + 1, j):
                yield ((i, k, inner), *rest)


def _time_and_peak(sequence, elements) -> tuple[float, int]:
    """Rotor's accounting, written out: a checkpoint replays its elements' forwards; peak = max over children of
    what earlier children keep plus what this one needs."""
    time, held, peak = 0.0, 0, 0
    for child in sequence:
        if isinstance(child, int):
            e = elements[child]
            time += e.forward + e.backward
            need, keep = e.kept, e.kept
        else:
            i, k, inner = child
            inner_time, need = _time_and_peak(inner, elements)
            time += inner_time + sum(elements[x].forward for x in range(i, k + 1))
            keep = elements[i].input
        peak = max(peak, held + need)
        held += keep
    return time, peak


def test_the_rotor_table_is_the_best_over_every_checkpointing_tree() -> None:
    rng = np.random.default_rng(0)
    elements = [
        Element(start=i, end=i + 1, forward=float(f), backward=float(2 * f), backward_selective=float(2 * f),
                kept=int(k), kept_selective=int(k), input=int(x))
        for i, (f, k, x) in enumerate(zip(rng.integers(1, 9, 5), rng.integers(4, 12, 5), rng.integers(1, 4, 5)))
    ]
    slots = 40
    chain = Chain(elements, unit=1.0, slots=slots)
    trees = list(_trees(0, len(elements) - 1))
    assert len(trees) > 50
    priced = [_time_and_peak(t, elements) for t in trees]
    for m in range(slots + 1):
        fitting = [time for time, peak in priced if peak <= m]
        expected = min(fitting, default=math.inf)
        assert chain.best[(0, len(elements) - 1)][m] == pytest.approx(expected)
        if fitting:  # the tree it reports is one of the best
            chosen = tuple(_as_tree(chain.children(0, len(elements) - 1, m)))
            time, peak = _time_and_peak(chosen, elements)
            assert peak <= m and time == pytest.approx(expected)


def _as_tree(children):
    for child in children:
        yield child if isinstance(child, int) else (child[0], child[1], tuple(_as_tree(child[2])))


def test_segments_nest_and_are_checked() -> None:
    assert nest(0, 6, [(1, 5), (1, 3)]) == (0, Segment(1, 5, (Segment(1, 3, (1, 2)), 3, 4)), 5)
    none = lambda row: "none"  # noqa: E731
    check_segments([(1, 5), (1, 3), (5, 7)], 0, 8, none)
    for bad, message in [
        ([(1, 2)], "2 or more rows"), ([(0, 9)], "2 or more rows"), ([(1, 4), (3, 6)], "overlap"),
        ([(1, 4), (1, 4)], "overlap"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_segments(bad, 0, 8, none)
    with pytest.raises(ValueError, match="not selectively"):
        check_segments([(1, 4)], 0, 8, lambda row: "selective" if row == 2 else "none")


def test_a_segment_keeps_its_input_and_replays_its_forward() -> None:
    model = _model("gpt3-350m", gpus=2, layers=4)
    base = PipelineConfig(stages=even_stages(model, 1, tp=2, dp=1), micro_batch=1)
    stage = base.stages[0]
    layers = [r for r in range(stage.start, stage.end) if model.layers[r].repeated]
    a, b = layers[0], layers[2] + 1  # three layers
    plain = model.estimate(base, global_batch=8).stages[0]
    checkpointed = model.estimate(
        dataclasses.replace(base, stages=(dataclasses.replace(stage, segments=((a, b),)),)), global_batch=8
    ).stages[0]
    mesh = model._mesh(1, 1, 2)
    prices = [model.price(r, tp=2, samples=1, recompute="none", sp=False, mesh=mesh) for r in range(a, b)]
    kept = model.price(a, tp=2, samples=1, recompute="full", sp=False, mesh=mesh).activations
    assert checkpointed.compute - plain.compute == pytest.approx(sum(p.forward for p in prices))
    # every forward collective replays but the last layer's closing all-reduce
    assert checkpointed.comm - plain.comm == pytest.approx(
        sum(p.comm_forward for p in prices) - prices[-1].tail_seconds)
    assert plain.memory.activations - checkpointed.memory.activations == pytest.approx(
        sum(p.activations for p in prices) - kept)


def test_rotor_fits_where_per_layer_recomputation_cannot_and_is_never_slower() -> None:
    model = _model("gpt3-350m", gpus=2, memory_gib=7.05, layers=8)
    base = PipelineConfig(stages=even_stages(model, 1, tp=1, dp=2), micro_batch=8)
    assert optimal_recompute(model, base, 0, global_batch=32) is None
    stage = rotor_recompute(model, base, 0, global_batch=32)
    assert stage is not None and stage.segments
    result = model.estimate(dataclasses.replace(base, stages=(stage,)), global_batch=32)
    assert result.estimate.memory.fits
    tuned = with_optimal_recompute(model, base, global_batch=32)
    assert tuned.stages[0].segments  # the planner keeps the plan that fits
    for gib in (7.05, 7.5, 8, 10):  # per layer, rotor can choose what the knapsack does: it is never slower
        roomy = _model("gpt3-350m", gpus=2, memory_gib=gib, layers=8)
        knapsack = optimal_recompute(roomy, base, 0, global_batch=32)
        rotor = rotor_recompute(roomy, base, 0, global_batch=32)
        assert rotor is not None
        results = [roomy.estimate(dataclasses.replace(base, stages=(s,)), global_batch=32).stages[0]
                   for s in (knapsack, rotor) if s is not None]
        assert results[-1].memory.fits
        assert results[-1].seconds <= results[0].seconds * 1.001


def test_plans_carry_segments_to_the_runtime_and_back() -> None:
    from autopar.plan import FieldError
    from autopar.search.pipeline import Found, config_of, pipeline_plan

    model = _model("gpt3-350m", gpus=2, layers=4)
    stage = even_stages(model, 1, tp=1, dp=2)[0]
    layers = [r for r in range(stage.start, stage.end) if model.layers[r].repeated]
    stage = dataclasses.replace(stage, segments=((layers[0], layers[3] + 1), (layers[0], layers[1] + 1)))
    config = PipelineConfig(stages=(stage,), micro_batch=2)
    plan = pipeline_plan(model, Found(config, model.estimate(config, global_batch=8), 1), name="x", kind="t",
                         global_batch=8)
    assert plan.stages[0].segments == (("layers.0", "layers.3"), ("layers.0", "layers.1"))
    assert plan.to_dict()["stages"][0]["segments"] == [["layers.0", "layers.3"], ["layers.0", "layers.1"]]
    assert config_of(model, plan) == config
    with pytest.raises(FieldError, match="layers.9"):
        dataclasses.replace(plan.stages[0], segments=(("layers.0", "layers.9"),))


def test_stage_rejects_bad_segments() -> None:
    with pytest.raises(ValueError, match="overlap"):
        Stage(start=0, end=6, segments=((0, 3), (2, 5)))
