"""MCMC over the joint pipeline configuration, convergence of the searches, and the stage cache that makes a
one-stage change cheap."""

import dataclasses
import random
import time

import pytest

from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.cluster.spec import GIB
from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage
from autopar.search.mcmc import Schedule, _chain, cost, mcmc, propose
from autopar.search.pipeline import (
    Evaluator, Window, aceso, auto, data_parallel, even_stages, exhaustive, pipeline_searches, score,
)
from autopar.zoo import load


def _model(name: str, *, gpus: int, memory_gib: float | None = None, **overrides) -> PipelineModel:
    zoo = load(name, batch=1, **overrides)
    cluster = load_cluster("a100-80g-sxm").with_devices(gpus)
    if memory_gib is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory_gib * GIB))
    return PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), cluster, traced_batch=1, screen=True)


SMALL = [
    ("gpt3-125m", 4, None, {"layers": 2}),
    ("gpt3-125m", 4, 3.0, {"layers": 2}),
    ("gpt3-125m", 2, 3.0, {"layers": 3}),
    ("llama-7b", 4, 2.8, {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn": 2816, "vocab": 8000}),
]


@pytest.mark.parametrize(("name", "gpus", "memory_gib", "overrides"), SMALL)
def test_mcmc_and_auto_are_within_one_percent_of_exhaustive(name, gpus, memory_gib, overrides) -> None:
    model = _model(name, gpus=gpus, memory_gib=memory_gib, **overrides)
    best = exhaustive(model, global_batch=8)
    for kind in ("mcmc", "auto"):
        found = pipeline_searches(model, kind, global_batch=8, time_limit=30)[kind]
        assert found.result.estimate.memory.fits == best.result.estimate.memory.fits, kind
        # exhaustive keeps one recomputation level per stage: per-row choices can beat it, never lose by 1%
        assert found.score[1] <= best.score[1] * 1.01, kind
        assert found.converged, kind


def test_a_seed_gives_the_same_plan() -> None:
    model = _model("gpt3-125m", gpus=8, layers=4)
    runs = [pipeline_searches(model, "mcmc", global_batch=16, time_limit=30, seed=3)["mcmc"] for _ in range(2)]
    assert runs[0].converged and runs[1].converged
    assert runs[0].config == runs[1].config and runs[0].evaluated == runs[1].evaluated
    assert runs[0].by == "mcmc"


def test_a_chain_from_a_plan_that_does_not_fit_ends_on_one_that_does() -> None:
    model = _model("gpt3-125m", gpus=4, memory_gib=3.0, layers=2)
    evaluate = Evaluator(model, global_batch=8)
    start = data_parallel(model, global_batch=8, zero=0, evaluate=evaluate)
    assert not start.result.estimate.memory.fits  # pure DP is over the 3 GiB devices
    found, proposals, converged = _chain(model, start.config, evaluate, 8, random.Random(0), Schedule(),
                                         time.perf_counter() + 30, lambda: False)
    assert converged and proposals >= Schedule().window
    assert found.result.estimate.memory.fits


def test_the_memory_penalty_grows_and_the_temperature_falls_over_the_ramp() -> None:
    schedule = Schedule(ramp=100)
    (beta0, penalty0), (beta1, penalty1) = schedule.at(0), schedule.at(100)
    assert beta0 == schedule.beta0 and beta1 == schedule.beta1 > beta0
    assert penalty0 == schedule.penalty0 and penalty1 == schedule.penalty1 > penalty0
    assert schedule.at(1000) == schedule.at(100)  # held after the ramp
    model = _model("gpt3-125m", gpus=4, memory_gib=3.0, layers=2)
    over = model.estimate(data_parallel(model, global_batch=8, zero=0).config, global_batch=8)
    assert cost(over, penalty1) - cost(over, penalty0) > 0  # over its budget: dearer as the chain goes on


def test_proposals_change_one_thing() -> None:
    model = _model("gpt3-125m", gpus=8, layers=4)
    config = PipelineConfig(stages=even_stages(model, 2, tp=2, dp=2), micro_batch=4)
    result = model.estimate(config, global_batch=16)
    rng = random.Random(0)
    for _ in range(200):
        proposed = propose(model, config, result, 16, rng)
        if proposed is None or proposed.pp != config.pp or proposed.chunks != config.chunks:
            continue  # a global move (depth, interleaving) re-cuts every stage
        changed = [a != b for a, b in zip(config.stages, proposed.stages)]
        globals_changed = (proposed.micro_batch != config.micro_batch) + (proposed.zero != config.zero) + \
            (proposed.schedule != config.schedule)
        # one stage (a row moving changes both stages of its boundary) or one global setting
        assert (sum(changed) in (1, 2) and not globals_changed) or (sum(changed) == 0 and globals_changed == 1)


def test_window_converges_after_a_window_without_a_real_gain() -> None:
    window = Window(window=10, tolerance=0.01)
    assert not window.converged(0, (False, 1.0))
    assert not window.converged(9, (False, 0.995))  # under the tolerance: not a gain
    assert window.converged(10, (False, 0.995))
    window = Window(window=10, tolerance=0.01)
    window.converged(0, (True, 2.0))
    assert not window.converged(10, (False, 5.0))  # coming to fit is a gain, however slow
    assert not window.converged(15, (False, 4.0))
    assert window.converged(25, (False, 4.0))


def test_searches_stop_when_they_converge_not_on_their_budget() -> None:
    model = _model("gpt3-125m", gpus=8, layers=4)
    start = time.perf_counter()
    found = auto(model, global_batch=16, time_limit=120)["auto"]
    assert time.perf_counter() - start < 30
    assert found.converged and found.by in ("grid", "aceso", "mcmc")
    climbed = aceso(model, global_batch=16, time_limit=120)
    assert climbed.converged
    stopped = mcmc(model, global_batch=16, seeds=[found.config], time_limit=120, should_stop=lambda: True)
    assert not stopped.converged  # stopped from outside: not converged


def test_a_one_stage_change_reprices_the_same_as_a_fresh_model() -> None:
    model = _model("gpt3-125m", gpus=4, layers=4)
    fresh = _model("gpt3-125m", gpus=4, layers=4)
    n = len(model.layers)
    config = PipelineConfig(stages=(Stage(start=0, end=3, tp=2, dp=1), Stage(start=3, end=n, tp=2, dp=1)),
                            micro_batch=2)
    model.estimate(config, global_batch=8)
    # the first stage changes; the last is taken from the cache
    moved = dataclasses.replace(config, stages=(Stage(start=0, end=3, tp=1, dp=2), config.stages[1]))
    cached, priced = model.estimate(moved, global_batch=8), fresh.estimate(moved, global_batch=8)
    assert cached.stages[1] is model.estimate(config, global_batch=8).stages[1]
    assert cached.estimate == priced.estimate
    assert score(cached) == score(priced)


@pytest.mark.parametrize(("name", "overrides"), [
    ("gpt3-125m", {"layers": 8}),  # a head tied to the embedding: rows a stage knows by their place
    ("llama-7b", {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1024, "vocab": 4000}),
])
def test_stages_priced_at_one_place_stand_for_like_stages_at_another(name, overrides) -> None:
    """A search's model prices a stage once by its rows' content and re-uses it wherever like rows stand (shifted
    cuts, an even pipeline's middle stages); a random walk over the space must price every configuration as a
    model that never saw another one does, memory included."""
    model = _model(name, gpus=8, **overrides)
    assert model._runs is not None  # like rows are recognised: the cache is keyed by content here
    rng = random.Random(3)
    config = PipelineConfig(stages=even_stages(model, 4, tp=2, dp=1), micro_batch=4)
    result, walked = model.estimate(config, global_batch=16), 0
    for _ in range(60):
        proposed = propose(model, config, result, 16, rng)
        try:
            cached = model.estimate(proposed, global_batch=16) if proposed is not None else None
        except ValueError:  # not a configuration (a micro-batch dp does not divide, say)
            cached = None
        if cached is None:
            continue
        config, result = proposed, cached
        fresh = _model(name, gpus=8, **overrides).estimate(config, global_batch=16)
        assert cached.estimate == fresh.estimate, config
        assert [s.memory for s in cached.stages] == [s.memory for s in fresh.stages], config
        walked += 1
    assert walked >= 20


def test_primitives_on_a_deep_stage_also_move_and_recompute_an_eighth_of_its_rows() -> None:
    """One row per hop would take a climb on a 1,000-layer model a thousand hops to cross it."""
    from autopar.search.pipeline import primitives

    model = _model("gpt3-125m", gpus=2, layers=40, hidden=64, heads=2)
    n = len(model.layers)
    config = PipelineConfig(stages=(Stage(start=0, end=n - 8, dp=1), Stage(start=n - 8, end=n, dp=1)),
                            micro_batch=2)
    moved = {c.stages[0].end for c in primitives(model, config, 0, 8) if c.stages[0].end != n - 8}
    assert moved == {n - 9, n - 8 - (n - 8) // 8}  # one row, or an eighth of the deep stage's rows
    recomputed = sorted(sum(level != "none" for level in c.stages[0].recompute)
                        for c in primitives(model, config, 0, 8)
                        if c.stages[0].end == n - 8 and any(level != "none" for level in c.stages[0].recompute))
    assert recomputed == [1, (n - 8) // 8]
    short = {c.stages[1].start for c in primitives(model, config, 1, 8) if c.stages[1].start != n - 8}
    assert short == {n - 7}  # a stage of 8 rows moves one at a time
