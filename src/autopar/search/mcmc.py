"""FlexFlow's search (§6 of its paper): Metropolis-Hastings over the joint pipeline configuration.

A chain walks `cost.pipeline.PipelineConfig`s: stage cuts, each stage's dp x tp and intra-op layout, per-row
recomputation, the micro-batch, ZeRO, the depth and the schedule. Each proposal changes one thing: one of Aceso's
primitives on a stage drawn at random (`search.pipeline.primitives`: move a row to a neighbour, double or halve
tp, toggle the stage's intra-op layouts, recompute one row more or less, double or halve the micro-batch, raise or
lower ZeRO), or a global move: double or halve the depth (even stages, the same tp where it fits), switch 1F1B and
GPipe, interleave two chunks per device or undo it. A proposal is priced by the closed form with every stage it
left alone taken from the stage cache (`PipelineModel._reports`): only the changed stage is priced again, the
delta pricing that makes a proposal cost about as much as one stage. The plans a user sees are simulated after
the search (`api.search.simulated`), as for every search.

Acceptance is Metropolis-Hastings on

    cost_k(c) = ln T(c) + lambda_k * max(0, over(c) - 1)

(``T`` the iteration time, ``over`` the worst stage's peak over its memory budget): a proposal ``c'`` is taken
with probability ``min(1, exp(-beta_k * (cost_k(c') - cost_k(c))))``. Over the first ``ramp`` proposals of a
chain the temperature falls (``beta_k`` rises linearly from ``beta0`` to ``beta1``) and the memory penalty grows
(``lambda_k`` from ``penalty0`` to ``penalty1``), so a chain crosses infeasible regions early and ends among
configurations that fit; it keeps the best configuration it priced by (does not fit, time). A chain stops when it
has converged (`search.pipeline.Window`: ``window`` proposals without its best gaining ``tolerance``) or its share
of the budget ends. The proposal distribution is not symmetric (a stage's move set depends on its neighbours), so
the chain is Metropolis' rule on an annealing schedule rather than an exact sampler: FlexFlow's use of it too.

Chains run one after another from their seeds (pure DP, the Megatron grid's best point and its best at other
depths, and in `auto` Aceso's result), each with an equal share of the time left and its own seeded RNG, so a
search with a given ``seed`` is deterministic as long as it converges within its budget.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from autopar.cost.pipeline import PipelineConfig, PipelineEstimate, PipelineModel, even_stages
from autopar.search.pipeline import (
    Evaluator, Found, Window, _bottlenecks, micro_batches, pipeline_depths, primitives, score, tensor_parallel_sizes,
)
from autopar.search.workers import default_workers, in_worker, share_out

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A chain's temperature and memory penalty over its first ``ramp`` proposals (the module docstring), and its
    convergence: ``window`` proposals without a gain of ``tolerance``."""

    beta0: float = 30.0  # at the start a 3% slower proposal is taken with probability exp(-0.9)
    beta1: float = 1000.0  # at the end a 0.1% slower one with exp(-1)
    penalty0: float = 0.5
    penalty1: float = 50.0  # 1% over the memory budget costs as much as 65% slower
    ramp: int = 300
    window: int = 1000  # proposals: those already priced cost a cache look-up
    tolerance: float = 1e-3

    def at(self, k: int) -> tuple[float, float]:
        """(beta_k, lambda_k) after ``k`` proposals."""
        f = min(k / self.ramp, 1.0)
        return self.beta0 + f * (self.beta1 - self.beta0), self.penalty0 + f * (self.penalty1 - self.penalty0)


# auto's chains, which start from Aceso's result and the grid's best: a shorter ramp and window
POLISH = Schedule(ramp=300, window=300)


def cost(result: PipelineEstimate, penalty: float) -> float:
    """``ln T + penalty * max(0, over - 1)``: the energy a chain minimises."""
    over = max(r.memory.total / r.memory.budget for r in result.stages)
    return math.log(result.estimate.iteration_seconds) + penalty * max(0.0, over - 1.0)


def mcmc(
    model: PipelineModel,
    *,
    global_batch: int,
    seeds: Sequence[PipelineConfig],
    evaluate: Evaluator | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> Found | None:
    """One chain per configuration of ``seeds`` (duplicates and configurations ``evaluate`` refuses dropped),
    each with an equal share of the time left, side by side in forked processes where there are cores
    (`search.workers`); the best configuration any chain priced, ``converged`` when every chain converged."""
    evaluate = evaluate or Evaluator(model, global_batch=global_batch)
    starts = _usable(seeds, evaluate)
    start_time = time.perf_counter()
    processes = min(default_workers(), len(starts))
    before = len(evaluate.cache)

    def work(n: int, stop: Callable[[], bool], left: int) -> tuple[PipelineConfig, int, bool]:
        # each chain its own random stream: the same chains whichever process runs them
        share = (time_limit - (time.perf_counter() - start_time)) / max(1, math.ceil(left / processes))
        rng = random.Random(seed * 7919 + n)
        found, tried, done = _chain(model, starts[n], evaluate, global_batch, rng, schedule,
                                    time.perf_counter() + share, stop)
        if progress and not in_worker():
            e = found.result.estimate
            progress(f"MCMC chain {n + 1}/{len(starts)}: {e.iteration_seconds:.3f} s per iteration"
                     + ("" if e.memory.fits else " (no fit)"))
        return found.config, tried, done

    chains, finished = share_out(range(len(starts)), work, should_stop=should_stop,
                                 finish=lambda: evaluate.handed_back(before))
    for top, priced in finished:
        evaluate.adopt([chain[0] for chain in chains if chain is not None] + top, priced=priced)
    best: Found | None = None
    proposals, converged = 0, not should_stop() and all(chain is not None for chain in chains)
    for chain in chains:  # in order, as one process would: a tie goes to the earlier chain
        if chain is None:
            continue
        config, tried, done = chain
        proposals += tried
        converged = converged and done
        found = Found(config, evaluate(config), tried, by="mcmc")
        if best is None or found.score < best.score:
            best = found
    if best is not None:
        best.evaluated, best.by, best.converged = proposals, "mcmc", converged
    return best


def _usable(seeds: Sequence[PipelineConfig], evaluate: Evaluator) -> list[PipelineConfig]:
    starts: list[PipelineConfig] = []
    for config in seeds:
        if config in starts:
            continue
        try:
            evaluate(config)
        except ValueError:  # outside the search's limit
            continue
        starts.append(config)
    return starts


def _chain(
    model: PipelineModel, start: PipelineConfig, evaluate: Evaluator, global_batch: int, rng: random.Random,
    schedule: Schedule, deadline: float, should_stop: Callable[[], bool],
) -> tuple[Found, int, bool]:
    """One chain from ``start``: its best configuration, the proposals it priced, and whether it converged."""
    current, current_result = start, evaluate(start)
    best = Found(start, current_result, 1, by="mcmc")
    window = Window(schedule.window, schedule.tolerance)
    window.converged(0, best.score)
    k = 0
    while time.perf_counter() < deadline and not should_stop():
        k += 1
        beta, penalty = schedule.at(k)
        candidate = propose(model, current, current_result, global_batch, rng)
        if candidate is not None:
            try:
                result = evaluate(candidate)
            except ValueError:  # outside the search's limit, or not a configuration of this batch
                result = None
            if result is not None:
                delta = cost(result, penalty) - cost(current_result, penalty)
                if delta <= 0 or rng.random() < math.exp(-beta * delta):
                    current, current_result = candidate, result
                if score(result) < best.score:
                    best = Found(candidate, result, k, by="mcmc")
        if window.converged(k, best.score):
            return best, k, True
    return best, k, False


def propose(model: PipelineModel, config: PipelineConfig, result: PipelineEstimate, global_batch: int,
            rng: random.Random) -> PipelineConfig | None:
    """One random single change of ``config`` (priced as ``result``; the module docstring's moves), or None where
    the move drawn has no valid result. Global moves (depth, schedule) are drawn one time in eight; otherwise a
    stage's move, the stage being the bottleneck (`search.pipeline._bottlenecks`: the one most over its memory,
    else the slowest) half the time and any stage the other half."""
    if rng.random() < 0.125 or config.chunks > 1:
        return _global_move(model, config, global_batch, rng)
    stage = _bottlenecks(result)[0] if rng.random() < 0.5 else rng.randrange(len(config.stages))
    moves = list(primitives(model, config, stage, global_batch))
    return rng.choice(moves) if moves else None


def _global_move(model: PipelineModel, config: PipelineConfig, global_batch: int,
                 rng: random.Random) -> PipelineConfig | None:
    """Double or halve the depth, switch 1F1B and GPipe, interleave or undo it; for an interleaved configuration
    the micro-batch and ZeRO moves too (its stages share one grid, which a one-stage move would break)."""
    moves: list[Callable[[], PipelineConfig | None]] = [
        lambda: _redepth(model, config, config.pp * 2, global_batch),
        lambda: _redepth(model, config, config.pp // 2, global_batch),
    ]
    if config.chunks == 1:
        other = "gpipe" if config.schedule == "1f1b" else "1f1b"
        moves += [lambda: replace(config, schedule=other), lambda: _interleaved(model, config)]
    else:
        dps = [config.stages[0].dp]
        moves += [lambda: _redepth(model, config, config.pp, global_batch)]
        moves += [lambda b=b: replace(config, micro_batch=b) for b in (config.micro_batch * 2, config.micro_batch // 2)
                  if b in micro_batches(global_batch, dps)]
        moves += [lambda z=z: replace(config, zero=z) for z in (config.zero - 1, config.zero + 1) if 0 <= z <= 3]
    return rng.choice(moves)()


def _redepth(model: PipelineModel, config: PipelineConfig, pp: int, global_batch: int) -> PipelineConfig | None:
    """``config`` at depth ``pp`` (1F1B, even stages, no recomputation): the first stage's tp where the new
    stage size allows it (else the largest allowed below it), the micro-batch kept where it splits over the new dp
    (else the nearest that does), ZeRO kept."""
    devices = model.cluster.num_devices
    if pp < 1 or pp not in pipeline_depths(model, devices):
        return None
    per_stage = devices // pp
    allowed = [t for t in tensor_parallel_sizes(model, per_stage) if t <= config.stages[0].tp] or \
        tensor_parallel_sizes(model, per_stage)
    if not allowed:
        return None
    tp = max(allowed)
    dp = per_stage // tp
    sizes = micro_batches(global_batch, [dp])
    if not sizes:
        return None
    micro = min(sizes, key=lambda b: abs(math.log(b / config.micro_batch)))
    return PipelineConfig(stages=even_stages(model, pp, tp=tp, dp=dp), micro_batch=micro, zero=config.zero,
                          sp=config.sp)


def _interleaved(model: PipelineModel, config: PipelineConfig) -> PipelineConfig | None:
    """``config``'s grid as interleaved 1F1B, two chunks per device over even stages, where it has one grid and
    its repeated layers divide over ``2 * pp`` stages."""
    first = config.stages[0]
    repeated = sum(1 for layer in model.layers if layer.repeated)
    if config.pp < 2 or repeated % (2 * config.pp) or len({(s.dp, s.tp) for s in config.stages}) > 1:
        return None
    return PipelineConfig(stages=even_stages(model, 2 * config.pp, tp=first.tp, dp=first.dp),
                          micro_batch=config.micro_batch, zero=config.zero, sp=config.sp, schedule="interleaved",
                          chunks=2)
