"""Intra-op layer layouts inside pipeline stages: the intra-op planner's choice per layer on a stage's tp axis."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.cost.intra_layers import Conditions
from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage
from autopar.runtime.apply import check_supported
from autopar.search.ilp import evaluate, memory_of
from autopar.search.pipeline import (
    Evaluator, Found, auto, config_of, even_stages, pipeline_plan, primitives, runtime_limit,
)
from autopar.zoo import load


def _model(name: str = "gpt3-1.3b", *, gpus: int = 4, batch: int = 1, **overrides) -> PipelineModel:
    zoo = load(name, batch=batch, **overrides)
    return PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs),
                         load_cluster("a100-80g-sxm").with_devices(gpus), traced_batch=batch)


def _intra(config: PipelineConfig, on: bool = True) -> PipelineConfig:
    return dataclasses.replace(config, stages=tuple(dataclasses.replace(s, intra=on) for s in config.stages))


@pytest.fixture(scope="module")
def gpt() -> PipelineModel:
    return _model(layers=4)


def test_a_stage_with_layer_layouts_is_faster_and_no_larger(gpt) -> None:
    """Each layer takes its layout only where it beats Megatron's by the cost model under Megatron's memory, so
    the stage is faster and fits where Megatron's fits."""
    plain = PipelineConfig(stages=even_stages(gpt, 2, tp=2, dp=1), micro_batch=8)
    laid = _intra(plain)
    # two micro-batches: with many, the last stage peaks at the end of the step (every micro-batch's logits kept by
    # the schedule), where the states of weights a layout keeps whole count and the activations it saves do not
    a, b = gpt.estimate(plain, global_batch=16), gpt.estimate(laid, global_batch=16)
    layouts = [gpt.stage_view(laid, i, global_batch=16).layouts for i in range(2)]
    assert any(layouts), "no layer found a layout faster than Megatron's in this setting"
    assert b.estimate.iteration_seconds < a.estimate.iteration_seconds
    for before, after in zip(a.stages, b.stages):
        assert after.memory.total <= before.memory.total * (1 + 1e-6)
    # a layer laid out differently issues different collectives, and they are counted
    assert b.estimate.collectives != a.estimate.collectives
    for i, found in enumerate(layouts):
        for row, layout in found.items():
            assert gpt.layers[row].repeated
            assert {split for _, split in layout.splits} <= {"m", "n", "k", "b", "R"}
            assert layout.prices["full"].activations < layout.prices["none"].activations
            assert layout.prices["full"].backward > layout.prices["none"].backward


def test_the_layout_is_the_best_assignment_of_its_blocks(gpt) -> None:
    """The ILP's choice equals the best of every assignment of the layer's blocks under the same terms."""
    config = _intra(PipelineConfig(stages=even_stages(gpt, 1, tp=4, dp=1), micro_batch=4))
    view = gpt.stage_view(config, 0, global_batch=32)
    row = next(r for r, layer in enumerate(gpt.layers) if layer.repeated)
    when = Conditions(samples=view.samples, dp=1, dp_axis=view.mesh.axis("dp"), zero=0, micro_batches=8,
                      in_flight=1)
    megatron = gpt.price(row, tp=4, samples=view.samples, recompute="none", sp=False, mesh=view.mesh)
    layers = gpt.intra_layers
    terms = layers.terms(row, view.mesh.axis("tp"), when)
    limit = layers.memory_limit(when, megatron)
    best, best_choice = math.inf, None
    for choice in itertools.product(*(range(len(c)) for c in terms.costs)):
        value = evaluate(terms.costs, terms.edges, choice)
        if memory_of(terms.memory, choice) <= limit and value < best:
            best, best_choice = value, choice
    assert best_choice is not None
    found = layers.layout(row, view.mesh.axis("tp"), when, megatron)
    chosen = tuple(terms.candidates[v].index(c) for v, c in enumerate(found.choice)) if found else None
    if found is None:  # Megatron's layout is as fast: the best assignment must not beat it
        assert best >= layers.seconds_of(megatron, 0.0, view.mesh.axis("tp"), when) - 1e-12
    else:
        assert evaluate(terms.costs, terms.edges, chosen) == pytest.approx(best, rel=1e-9)
    assert np.isfinite(best)


def test_layouts_scale_with_the_batch() -> None:
    """Traced at 2 or 4 samples (both split over tp 2: the same candidates), a stage prices alike."""
    one, four = _model(layers=4, batch=2), _model(layers=4, batch=4)
    config = _intra(PipelineConfig(stages=even_stages(one, 2, tp=2, dp=1), micro_batch=8))
    a = one.estimate(config, global_batch=32).estimate
    b = four.estimate(config, global_batch=32).estimate
    layouts = [[v.splits for v in m.stage_view(config, 0, global_batch=32).layouts.values()] for m in (one, four)]
    assert layouts[0] and layouts[0] == layouts[1]
    assert a.iteration_seconds == pytest.approx(b.iteration_seconds, rel=0.01)
    assert a.memory.activations == pytest.approx(b.memory.activations, rel=0.01)


def test_sequence_parallel_stages_take_layouts_too(gpt) -> None:
    config = _intra(PipelineConfig(stages=even_stages(gpt, 1, tp=4, dp=1), micro_batch=8, sp=True))
    plain = dataclasses.replace(_intra(config, False))
    a, b = gpt.estimate(plain, global_batch=32), gpt.estimate(config, global_batch=32)
    assert b.estimate.iteration_seconds <= a.estimate.iteration_seconds * (1 + 1e-9)


def test_intra_needs_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="tp > 1"):
        Stage(start=0, end=2, tp=1, dp=2, intra=True)


def test_the_search_toggles_layouts_and_plans_round_trip(gpt) -> None:
    config = PipelineConfig(stages=even_stages(gpt, 2, tp=2, dp=1), micro_batch=8)
    toggled = [c for c in primitives(gpt, config, 0, 64) if c.stages[0].intra]
    assert len(toggled) == 1 and not toggled[0].stages[1].intra
    laid = _intra(config)
    result = gpt.estimate(laid, global_batch=64)
    typed = pipeline_plan(gpt, Found(laid, result, 1), name="gpt3-1.3b", kind="auto", global_batch=64)
    read = config_of(gpt, typed)
    # the stages as the search made them, with the layer layouts the plan records: priced as written, the same
    assert dataclasses.replace(read, stages=tuple(dataclasses.replace(s, layouts=None) for s in read.stages)) == laid
    assert any(s.layouts for s in read.stages)
    again = gpt.estimate(read, global_batch=64)
    assert again.estimate.iteration_seconds == pytest.approx(result.estimate.iteration_seconds, rel=1e-12)
    assert again.estimate.collectives == result.estimate.collectives
    plan = typed.to_dict()
    assert any(stage["layouts"] for stage in plan["stages"])
    layer, splits = next((n, s) for stage in plan["stages"] for n, s in stage["layouts"].items())
    assert all(not module.startswith(layer) for module in splits)  # named inside the layer
    # parameters carry the layout's placements on tp
    row = gpt.layers[[layer_.name for layer_ in gpt.layers].index(layer)]
    placed = {fqn: p for entry in plan["modules"].values() for fqn, p in entry["params"].items()
              if fqn.startswith(row.name + ".")}
    assert placed and all(p.startswith("[R, ") for p in placed.values())
    # the runtime lays such layers out with DTensor (`runtime.intra.lay_out_layers`), eager, without expert or
    # sequence parallelism so far
    assert runtime_limit(laid) is None
    check_supported(typed)
    assert runtime_limit(dataclasses.replace(laid, zero=3)) is None
    assert "intra-op planner" in runtime_limit(dataclasses.replace(laid, sp=True))
    assert "intra-op planner" in runtime_limit(laid, kernels="compiled")
    with pytest.raises(NotImplementedError, match="intra-op planner"):
        check_supported(dataclasses.replace(typed, sp=True))


def test_the_runtime_limit_knows_the_1f1b_schedule_needs_a_micro_batch_per_stage(gpt) -> None:
    """PyTorch's 1F1B schedule refuses fewer micro-batches than stages: a search told the step's samples keeps
    to configurations with enough of them (GPipe runs the same with fewer)."""
    config = PipelineConfig(stages=even_stages(gpt, 2, tp=2, dp=1), micro_batch=8)
    assert "1F1B schedule needs" in runtime_limit(config, global_batch=8)
    assert runtime_limit(config, global_batch=16) is None
    assert runtime_limit(dataclasses.replace(config, schedule="gpipe"), global_batch=8) is None


def test_runnable_searches_lay_layers_out_only_where_the_runtime_can() -> None:
    model = _model(layers=4, gpus=8)
    found = auto(model, global_batch=64, time_limit=8, limit=runtime_limit)
    assert found["auto"] is not None
    config = found["auto"].config
    if any(s.intra for s in config.stages):
        assert not config.sp and config.ep == 1
    assert runtime_limit(config) is None
    free = Evaluator(model, global_batch=64)
    assert free.limit is None


def test_dense_optimum_equals_brute_force() -> None:
    from autopar.search.ilp import Edge, dense_optimum, enumerate_optimum

    rng = np.random.default_rng(7)
    for trial in range(40):
        sizes = rng.integers(1, 4, size=rng.integers(1, 5))
        costs = [rng.random(k) for k in sizes]
        memory = [rng.random(k) for k in sizes]
        edges = []
        for _ in range(rng.integers(0, 5)):
            u, v = (int(x) for x in rng.integers(0, len(sizes), size=2))
            matrix = rng.random((sizes[u], sizes[v]))
            matrix[matrix > 0.9] = math.inf  # an illegal conversion
            edges.append(Edge(u, v, matrix))
        budget = float(rng.uniform(0.5, 2.0)) * len(sizes) / 2
        choice, value = enumerate_optimum(costs, edges, memory, budget)
        found = dense_optimum(costs, edges, memory, budget)
        if not math.isfinite(value):
            assert found is None, trial
        else:
            assert found is not None and found[1] == pytest.approx(value), trial
            assert evaluate(costs, edges, found[0]) == pytest.approx(value)
