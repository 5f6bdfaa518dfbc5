"""The pipeline cost model and its searches: Aceso against exhaustive enumeration and the Megatron grid."""

import dataclasses

import pytest

from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.cluster.spec import GIB
from autopar.cost import ParallelConfig, estimate
from autopar.cost.pipeline import PipelineConfig, PipelineModel, RangeMax, Stage
from autopar.search.pipeline import Evaluator, aceso, auto, even_stages, exhaustive, megatron_grid, score
from autopar.zoo import load


def _model(name: str, *, gpus: int, memory_gib: float | None = None, batch: int = 1, screen: bool = False,
           **overrides) -> PipelineModel:
    """``screen``: price by the closed form, as `autopar plan` runs its searches (the plans it shows are then
    re-priced by the simulator)."""
    zoo = load(name, batch=batch, **overrides)
    cluster = load_cluster("a100-80g-sxm").with_devices(gpus)
    if memory_gib is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory_gib * GIB))
    return PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), cluster, traced_batch=batch, screen=screen)


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "mbs", "recompute"),
    [(1, 1, 16, 2, "none"), (2, 2, 4, 2, "none"), (4, 4, 1, 1, "full"), (2, 1, 8, 4, "selective")],
)
def test_one_trace_at_batch_one_prices_every_micro_batch(tp, pp, dp, mbs, recompute) -> None:
    """`estimate` traces at the per-device micro-batch; the planner traces once at batch 1 and scales."""
    zoo = load("gpt3-1.3b", batch=mbs, layers=8)
    cluster = load_cluster("a100-80g-sxm").with_devices(16)
    reference = estimate(trace(zoo.module, example_kwargs=zoo.inputs), cluster,
                         ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=mbs, recompute=recompute), global_batch=64)
    model = _model("gpt3-1.3b", gpus=16, layers=8)
    config = PipelineConfig(stages=even_stages(model, pp, tp=tp, dp=dp, recompute=recompute), micro_batch=mbs * dp)
    ours = model.estimate(config, global_batch=64).estimate
    assert ours.memory.total == pytest.approx(reference.memory.total, rel=1e-6)
    assert ours.iteration_seconds == pytest.approx(reference.iteration_seconds, rel=0.03)
    assert ours.mfu == pytest.approx(reference.mfu, rel=0.03)


def test_costs_scale_with_the_batch() -> None:
    one = _model("gpt3-350m", gpus=8, layers=4)
    four = _model("gpt3-350m", gpus=8, layers=4, batch=4)
    config = PipelineConfig(stages=even_stages(one, 2, tp=2, dp=2), micro_batch=8)
    a = one.estimate(config, global_batch=32).estimate
    b = four.estimate(config, global_batch=32).estimate
    assert a.iteration_seconds == pytest.approx(b.iteration_seconds, rel=0.01)
    assert a.memory.activations == pytest.approx(b.memory.activations, rel=1e-6)


def test_uneven_stages_and_bubble() -> None:
    model = _model("gpt3-350m", gpus=4, layers=8)
    rows = len(model.layers)
    even = PipelineConfig(stages=even_stages(model, 2, tp=1, dp=2), micro_batch=2)
    cut = even.stages[0].end
    uneven = PipelineConfig(
        stages=(Stage(start=0, end=cut + 2, dp=2), Stage(start=cut + 2, end=rows, dp=2)), micro_batch=2
    )
    e, u = model.estimate(even, global_batch=16), model.estimate(uneven, global_batch=16)
    assert u.stages[0].compute > e.stages[0].compute and u.stages[1].compute < e.stages[1].compute
    times = [s.seconds for s in u.stages]
    screened = model.estimate(uneven, global_batch=16, simulate=False).estimate  # the closed form
    assert screened.bubble_seconds == pytest.approx(sum(times) - max(times))
    # the simulated 1F1B timeline: with the slower stage first, the second stage's forwards and backwards run while
    # the first computes (its warm-up covers the round trip), so only the sends stay in the bubble
    simulated = u.estimate
    assert simulated.bubble_seconds < screened.bubble_seconds / 2
    assert simulated.compute_seconds == pytest.approx(8 * u.stages[0].compute)
    assert simulated.compute_seconds + simulated.exposed_comm_seconds + simulated.bubble_seconds == pytest.approx(
        simulated.iteration_seconds)
    with pytest.raises(ValueError, match="contiguous"):
        PipelineConfig(stages=(Stage(start=0, end=3), Stage(start=4, end=rows)), micro_batch=2)


def test_the_grid_prices_each_depths_best_point_interleaved() -> None:
    model = _model("gpt3-350m", gpus=4, layers=8)
    evaluate = Evaluator(model, global_batch=16)
    best = megatron_grid(model, global_batch=16, evaluate=evaluate)
    woven = [c for c in evaluate.cache if c.chunks == 2]
    assert {c.pp for c in woven} == {2, 4}  # one per pipeline depth whose layers split into 2 x pp chunks
    assert all(c.schedule == "interleaved" and len(c.stages) == 2 * c.pp for c in woven)
    assert all(best.score <= score(evaluate(c)) for c in woven)  # the grid keeps the best of all it priced


def test_interleaving_cuts_the_bubble_by_the_chunk_count_and_sends_more() -> None:
    model = _model("gpt3-350m", gpus=4, layers=8)
    plain = PipelineConfig(stages=even_stages(model, 4, tp=1, dp=1), micro_batch=2)
    woven = PipelineConfig(stages=even_stages(model, 8, tp=1, dp=1), micro_batch=2, schedule="interleaved", chunks=2)
    assert woven.pp == 4 and woven.devices == 4
    # the closed form (the searches' screen) divides the fill and drain by the chunk count; the simulated timeline
    # does not credit it here, where the chunks are unequal (the embedding's and the head's are 2-3x the others):
    # torch's interleaved order drains four backwards of the first chunk after the last device's work
    p, w = (model.estimate(c, global_batch=16, simulate=False) for c in (plain, woven))
    device_times = [w.stages[d].seconds + w.stages[d + 4].seconds for d in range(4)]
    assert w.estimate.bubble_seconds == pytest.approx((sum(device_times) - max(device_times)) / 2)
    assert w.estimate.bubble_seconds < p.estimate.bubble_seconds
    w = model.estimate(woven, global_batch=16)

    def sends(result) -> int:  # noqa: ANN001
        return sum(c.count for c in result.estimate.collectives if c.kind == "send_recv")

    assert sends(w) == 2 * (8 - 1) * 8 and sends(p) == 2 * (4 - 1) * 8  # 8 micro-batches, both ways per boundary
    with pytest.raises(ValueError, match="interleaved schedule needs 2 or more chunks"):
        PipelineConfig(stages=woven.stages, micro_batch=2, chunks=2)
    with pytest.raises(ValueError, match="--chunks 2 applies to --schedule interleaved only"):
        ParallelConfig(pp=2, chunks=2)


@pytest.mark.parametrize(
    ("name", "gpus", "memory_gib", "overrides"),
    [
        ("gpt3-125m", 4, None, {"layers": 2}),
        ("gpt3-125m", 4, 3.0, {"layers": 2}),
        ("gpt3-125m", 2, 3.0, {"layers": 3}),
        ("llama-7b", 4, 2.8, {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn": 2816, "vocab": 8000}),
    ],
)
def test_auto_is_within_one_percent_of_exhaustive(name, gpus, memory_gib, overrides) -> None:
    model = _model(name, gpus=gpus, memory_gib=memory_gib, **overrides, screen=True)
    best = exhaustive(model, global_batch=8)
    found = auto(model, global_batch=8, time_limit=20)["auto"]
    assert found.result.estimate.memory.fits == best.result.estimate.memory.fits
    if best.result.estimate.memory.fits:
        assert found.result.estimate.iteration_seconds <= best.result.estimate.iteration_seconds * 1.01


def test_auto_never_loses_to_the_megatron_grid() -> None:
    model = _model("llama-7b", gpus=16, layers=8, screen=True)
    found = auto(model, global_batch=64, time_limit=20)
    grid = megatron_grid(model, global_batch=64)
    assert found["auto"].score <= grid.score
    assert found["megatron"].score == grid.score


def test_search_stops_when_asked_and_keeps_the_best_so_far() -> None:
    model = _model("gpt3-350m", gpus=8, layers=8)
    stopped = aceso(model, global_batch=32, time_limit=20, should_stop=lambda: True)
    assert stopped is not None and stopped.config.devices == 8


def test_recompute_choice_is_the_fastest_that_fits() -> None:
    """The knapsack's choice against every assignment of none / selective / full to a stage's layers."""
    import itertools

    from autopar.cost.types import RECOMPUTE
    from autopar.search.recompute import optimal_recompute

    model = _model("gpt3-350m", gpus=2, memory_gib=6.6, layers=4)
    base = PipelineConfig(stages=even_stages(model, 1, tp=1, dp=2), micro_batch=8)
    stage = base.stages[0]
    repeated = [r for r in range(stage.start, stage.end) if model.layers[r].repeated]
    best = None
    for levels in itertools.product(RECOMPUTE, repeat=len(repeated)):
        chosen = dict(zip(repeated, levels))
        recompute = tuple(chosen.get(r, "none") for r in range(stage.start, stage.end))
        config = dataclasses.replace(base, stages=(dataclasses.replace(stage, recompute=recompute),))
        result = model.estimate(config, global_batch=32)
        if result.estimate.memory.fits and (best is None or result.stages[0].seconds < best):
            best = result.stages[0].seconds
    assert best is not None
    picked = optimal_recompute(model, base, 0, global_batch=32)
    result = model.estimate(dataclasses.replace(base, stages=(picked,)), global_batch=32)
    assert result.estimate.memory.fits
    assert result.stages[0].seconds == pytest.approx(best, rel=0.01)
    assert any(level != "none" for level in picked.recompute)  # the budget is tight enough to need some


def test_exhaustive_refuses_a_large_space() -> None:
    model = _model("gpt3-350m", gpus=8, layers=12)
    with pytest.raises(ValueError, match="more than 1,000 configurations"):  # counted lazily, not enumerated whole
        exhaustive(model, global_batch=64, limit=1000)


def test_runtime_limit_names_what_autopar_run_refuses() -> None:
    from autopar.search.pipeline import runtime_limit

    model = _model("gpt3-350m", gpus=8, layers=8)
    ok = PipelineConfig(stages=even_stages(model, 2, tp=2, dp=2), micro_batch=4, zero=1)
    assert runtime_limit(ok) is None
    assert runtime_limit(dataclasses.replace(ok, zero=3)) is None  # FSDP2 stages reduce-scatter per micro-batch
    assert runtime_limit(dataclasses.replace(ok, sp=True)) is None  # FSDP sums SP's norm gradients over tp itself
    assert "cut this model" in runtime_limit(ok, pipelines=False)
    a, b = ok.stages
    mixed = dataclasses.replace(ok, stages=(a, dataclasses.replace(b, tp=1, dp=4)))
    assert "different dp x tp" in runtime_limit(mixed)


def test_a_limited_search_keeps_to_what_the_runtime_runs() -> None:
    import functools

    from autopar.search.pipeline import runtime_limit

    model = _model("gpt3-1.3b", gpus=8, memory_gib=5, layers=8, screen=True)
    free = auto(model, global_batch=64, time_limit=6)["auto"]
    # stages laid out by the intra-op planner come up, which the runtime cannot run with compiled kernels
    limit = functools.partial(runtime_limit, pipelines=True, kernels="compiled")
    assert any(limit(f.config) for f in (free, *free.runners_up))
    chosen = auto(model, global_batch=64, time_limit=6, limit=limit)["auto"]
    assert chosen is not None and chosen.result.estimate.memory.fits
    assert chosen.runners_up and all(limit(f.config) is None for f in (chosen, *chosen.runners_up))
    alone = auto(model, global_batch=64, time_limit=6, limit=functools.partial(runtime_limit, pipelines=False))
    assert alone["auto"].config.pp == 1 and all(f.config.pp == 1 for f in alone["auto"].runners_up)


def test_range_max_is_the_largest_of_every_range():
    import random

    rng = random.Random(3)
    for n in (1, 2, 3, 7, 16, 33):
        values = [rng.randint(-1, 40) for _ in range(n)]
        largest = RangeMax(values)
        for a in range(n):
            for b in range(a + 1, n + 1):
                assert largest(a, b) == max(values[a:b])
    with pytest.raises(ValueError, match="not a non-empty range"):
        RangeMax([1, 2])(1, 1)


def test_a_stage_names_a_recomputation_level_it_does_not_know():
    with pytest.raises(ValueError, match="recompute must be one of .* got 'most'"):
        Stage(start=0, end=3, tp=1, dp=1, recompute=("none", "most", "full"))


def test_a_deep_chain_climbs_coarse_then_fine_and_finds_as_good_a_plan_for_less() -> None:
    from autopar.search import pipeline as search

    model = _model("gpt3-350m", gpus=8, memory_gib=16, layers=200, screen=True)
    assert search.coarse_unit(model, 1) == len(model.layers) // 8 and search.coarse_unit(model, 8) == 1
    assert search._coarse_steps(100, unit=25) == (25,) and search._coarse_steps(400, unit=25) == (25, 50)
    assert search._fine_steps(100, unit=25) == (1, 2, 4, 8, 16)
    coarse = aceso(model, global_batch=64, time_limit=120)
    plain_unit, search.coarse_unit = search.coarse_unit, lambda model, pp: 1
    try:
        plain = aceso(model, global_batch=64, time_limit=120)
    finally:
        search.coarse_unit = plain_unit
    assert coarse.converged and plain.converged
    assert coarse.score <= plain.score
    assert coarse.evaluated < 0.8 * plain.evaluated
