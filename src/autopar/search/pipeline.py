"""Pipeline search: Aceso's iterative bottleneck alleviation, the Megatron-LM grid, and exhaustive enumeration.

A configuration (`cost.pipeline.PipelineConfig`) is: stages over the chain of profile rows (uneven allowed), a
dp x tp split per stage, recomputation per row (none, selective, full), the pipeline micro-batch and the ZeRO stage.
Plans are ranked by (does not fit, iteration time), with memory overflow as the measure while nothing fits.

Aceso (§3, Algorithms 1-2 of its appendix), as done here, for each pipeline depth:

1. start balanced: stages of about equal compute, no recomputation, the smallest micro-batch that splits over dp,
   once for each tensor-parallel size (a primitive changes one stage, so it cannot move every stage's tp at once);
2. find the bottleneck stage: the one most over its memory if any is, else the slowest;
3. apply every reconfiguration primitive that can relieve it (Aceso Table 1): move a row to the neighbouring
   stage (op#), double or halve its tp (dp follows), recompute one more or one fewer row (the one that keeps the
   most activations), double or halve the micro-batch, raise or lower ZeRO;
4. keep the best few results and go on from them, up to ``max_hops`` primitives deep (a move that is worse alone
   can open a better one); the first configuration better than the current one becomes current, and the search
   repeats from step 2; visited configurations are never priced twice;
5. stop when no configuration within ``max_hops`` improves, when the climb has converged (`Window`: its best
   gained less than 0.1% over the last 300 configurations priced), or the time budget ends (the best so far is
   kept); then climb again from the depth's best, and where relieving the bottleneck does not pay, try
   the next worst stages in turn (Aceso's secondary bottlenecks, up to ``secondary`` of them): this only ever
   improves on the plain climb, which keeps its whole share of the time;
6. after each start's climb, try its configuration under each lower ZeRO stage with every stage's recomputation
   chosen exactly (a climb that fits by raising ZeRO can miss fitting by recomputation, which may be faster);
7. choose every stage's recomputation exactly for the configuration found and keep it if it is faster: per stage
   the faster of a knapsack over none / selective / full per layer (`search.recompute`) and the rotor programme
   with communication terms, which also checkpoints runs of layers together (`search.rotor`, MAP §5.2).

Depths are independent, so they are searched side by side, one process per core (`search.workers`), each
process taking the next depth, deepest first, with an equal share of the budget left to it (a depth that
converges early leaves its time to the next); the best over depths wins, ties to the shallower, as in one process.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from autopar.cluster import build_mesh
from autopar.cost.layers import expert_weight_dim, weight_out_dim
from autopar.cost.pipeline import PipelineConfig, PipelineEstimate, PipelineModel, Stage, even_stages
from autopar.cost.types import RECOMPUTE
from autopar.plan import Mesh, ModuleLayout, ParamLayout, Plan, Workload
from autopar.plan import Stage as PlanStage
from autopar.sharding import parse
from autopar.search.recompute import with_optimal_recompute
from autopar.search.workers import default_workers, in_worker, share_out

log = logging.getLogger(__name__)

Score = tuple[bool, float]
Limit = Callable[[PipelineConfig], "str | None"]  # why a configuration is out of bounds, or None


@dataclass(slots=True)
class Found:
    config: PipelineConfig
    result: PipelineEstimate
    evaluated: int  # configurations priced by the search that found it
    runners_up: list[Found] = field(default_factory=list)  # the best of other shapes the search priced
    by: str = ""  # the search that found it (auto: grid, aceso or mcmc)
    converged: bool = False  # the search stopped because it stopped improving, not on its budget

    @property
    def score(self) -> Score:
        return score(self.result)


class Window:
    """Convergence: a search has converged once ``window`` configurations have been priced since its best last
    improved by more than ``tolerance`` (relative; coming to fit counts as an improvement). The budget is then an
    upper bound only."""

    __slots__ = ("window", "tolerance", "anchor")

    def __init__(self, window: int = 300, tolerance: float = 1e-3) -> None:
        self.window, self.tolerance = window, tolerance
        self.anchor: tuple[int, Score] | None = None  # (configurations priced, best) at the last real improvement

    def converged(self, priced: int, best: Score) -> bool:
        """Note the best after ``priced`` configurations; whether the search has converged."""
        if self.anchor is None or gain(self.anchor[1], best) > self.tolerance:
            self.anchor = (priced, best)
            return False
        return priced - self.anchor[0] >= self.window


def gain(before: Score, after: Score) -> float:
    """Relative improvement from ``before`` to ``after``: infinite where ``after`` fits and ``before`` did not."""
    if before[0] != after[0]:
        return math.inf if before[0] else -math.inf
    return (before[1] - after[1]) / before[1] if before[1] > 0 else 0.0


def score(result: PipelineEstimate) -> Score:
    """(does not fit, how far over the busiest stage is, or else the iteration time): lower is better. Figures
    are kept to 12 significant digits: configurations that price alike but for rounding (ZeRO 0 and 3 of one stage
    whose collectives all overlap compute) tie, and ties keep the search's order in every process."""
    if result.ranking is None:
        memory = result.estimate.memory
        if not memory.fits:
            result.ranking = (True, _digits(max(r.memory.total / r.memory.budget for r in result.stages)))
        else:
            result.ranking = (False, _digits(result.estimate.iteration_seconds))
    return result.ranking


def _digits(value: float) -> float:
    return float(f"{value:.12g}")


class Evaluator:
    """Prices configurations once each (cache by configuration)."""

    def __init__(self, model: PipelineModel, *, global_batch: int, limit: Limit | None = None) -> None:
        self.model = model
        self.global_batch = global_batch
        self.limit = limit  # configurations it names a reason for are refused (`runtime_limit`)
        self.cache: dict[PipelineConfig, PipelineEstimate] = {}
        self.elsewhere: set[int] = set()  # hashes of configurations workers priced (`adopt`)

    @property
    def priced(self) -> int:
        """Configurations priced for this evaluator, here or in workers, each counted once: what one process
        would have priced."""
        return len(self.cache) + len(self.elsewhere.difference(map(hash, self.cache)))

    def since(self, before: int, *, where: Limit | None = None) -> list[int]:
        """Hashes of the configurations priced after the first ``before``, less those ``where`` refuses (a
        worker's, for `adopt`: a fork has the hash seed of the process it came from)."""
        return [hash(config) for config in itertools.islice(self.cache, before, None)
                if where is None or not where(config)]

    def handed_back(self, before: int, *, where: Limit | None = None) -> tuple[list[PipelineConfig], list[int]]:
        """What a worker hands back once it is done (`search.workers`), for the caller's `adopt`: the configurations
        of its four best shapes (runners-up), and the hashes of what it priced after the first ``before`` (`since`);
        both less those ``where`` refuses."""
        return [f.config for f in self.top(4, where=where)], self.since(before, where=where)

    def adopt(self, configs: Iterable[PipelineConfig], *, priced: Iterable[int]) -> None:
        """A worker's results: ``configs`` are priced again here, and ``priced`` (`since`) counted in `priced`."""
        for config in dict.fromkeys(configs):
            self(config)
        self.elsewhere.update(priced)

    def __call__(self, config: PipelineConfig) -> PipelineEstimate:
        found = self.cache.get(config)
        if found is None:
            reason = self.limit(config) if self.limit is not None else None
            if reason:
                raise ValueError(reason)
            found = self.cache[config] = self.model.estimate(config, global_batch=self.global_batch)
        return found

    def top(self, k: int, *, besides: PipelineConfig | None = None, where: Limit | None = None) -> list[Found]:
        """The ``k`` best configurations priced so far, one per shape (depth, dp x tp per stage, ZeRO, sequence
        parallelism), the shape of ``besides`` left out, and those ``where`` refuses: what the chosen plan beat,
        by how much."""
        seen = {shape(besides)} if besides is not None else set()
        best: list[Found] = []
        for config, result in sorted(self.cache.items(), key=lambda item: score(item[1])):
            key = shape(config)
            if key in seen or (where is not None and where(config)):
                continue
            seen.add(key)
            best.append(Found(config, result, self.priced))
            if len(best) == k:
                break
        return best


def runtime_limit(config: PipelineConfig, *, pipelines: bool = True, kernels: str = "eager",
                  global_batch: int | None = None) -> str | None:
    """Why ``autopar run`` cannot run ``config`` yet, or None (`autopar.runtime.apply.unsupported`);
    ``pipelines``: whether the runtime can cut this model into stages (`runtime.pipeline.chain_kind`); ``kernels``:
    the plan's kernels setting; ``global_batch``: the samples of a step, where known (PyTorch's 1F1B schedule needs
    as many micro-batches as stages)."""
    from autopar.runtime.apply import intra_layouts_runnable, schedule_limit, unsupported

    if len(config.stages) > 1 and not pipelines:
        return "the runtime cannot cut this model into pipeline stages: its forward does not trace into a chain of " \
               "layers each handing the next one value, or its stages would not compute what the forward does"
    compiled_selective = kernels == "compiled" and any(s.tp > 1 and "selective" in s.recompute for s in config.stages)
    reason = schedule_limit(config.schedule, global_batch // config.micro_batch, config.micro_batch, config.pp) \
        if global_batch is not None else None
    return reason or unsupported(stages=len(config.stages), grids={(s.dp, s.tp) for s in config.stages},
                       intra=any(s.intra for s in config.stages) and not intra_layouts_runnable(
                           config.ep, kernels, config.sp),
                       compiled_selective=compiled_selective, compiled_experts=kernels == "compiled" and config.ep > 1)


def shape(config: PipelineConfig) -> tuple:
    """A configuration without its cut points, micro-batch, schedule and recomputation: its layout."""
    return (config.pp, tuple((s.dp, s.tp, s.intra) for s in config.stages), config.zero, config.sp)


# ---- the space ------------------------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_sizes(model: PipelineModel, devices_per_stage: int) -> list[int]:
    """tp sizes the model's shapes allow (`PipelineModel.split_widths`), within a node (Megatron keeps tp inside
    one). The vocabulary may split unevenly (Megatron pads it)."""
    per_node = model.cluster.devices_per_node
    widths = model.split_widths
    return [t for t in divisors(devices_per_stage) if t <= per_node and all(w % t == 0 for w in widths)]


def pipeline_depths(model: PipelineModel, devices: int) -> list[int]:
    repeated = sum(1 for layer in model.layers if layer.repeated)
    return [p for p in divisors(devices) if p <= max(repeated, 1)]


def micro_batches(global_batch: int, dp_values: list[int]) -> list[int]:
    """Pipeline micro-batch sizes: divisors of the batch that every dp size divides."""
    return [b for b in divisors(global_batch) if all(b % d == 0 for d in dp_values)]


# ---- Megatron grid -------------------------------------------------------------------------------------------


def megatron_grid(
    model: PipelineModel, *, global_batch: int, deadline: float = math.inf, evaluate: Evaluator | None = None,
    limit: Limit | None = None,
) -> Found | None:
    """The best Megatron-LM configuration: global tp x pp x dp, micro-batch per dp rank, uniform recomputation,
    ZeRO 0 or 1 (the distributed optimizer), 1F1B, even stages; then each depth's best point interleaved (two
    chunks per device), where the layers divide. Depths are priced side by side in forked processes where there are
    cores for them (`search.workers`); of a worker's points ``evaluate`` then holds each depth's best, its best that
    ``limit`` accepts, and the best of the four best shapes it accepts: all the searches after the grid read from
    it."""
    evaluate = evaluate or Evaluator(model, global_batch=global_batch)
    depths = pipeline_depths(model, model.cluster.num_devices)
    before = len(evaluate.cache)
    mine: list[int] = []  # the depths this process priced

    def work(pp: int, stop: Callable[[], bool], left: int) -> tuple[PipelineConfig | None, int, bool]:
        mine.append(pp)
        return _grid_depth(model, pp, evaluate, global_batch=global_batch, deadline=deadline)

    def finish() -> tuple[list[PipelineConfig], list[int]]:  # in a worker: what the caller prices again
        kept: list[PipelineConfig] = []
        if limit is not None:  # each depth's best the limit accepts: the searches after the grid start there
            ranked = sorted(evaluate.cache.items(), key=lambda item: score(item[1]))
            for pp in mine:
                kept += [c for c, _ in ranked if c.pp == pp and c.chunks == 1 and not limit(c)][:1]
        # counted for the searches after the grid, which keep to the limit (`auto`)
        top, priced = evaluate.handed_back(before, where=limit)
        return kept + top, priced

    parts, finished = share_out(depths, work, finish=finish, order=_deepest_first(depths))
    worked = [part for part in parts if part is not None]
    for kept, priced in finished:
        evaluate.adopt([config for config, _, _ in worked if config is not None] + kept, priced=priced)
    by_depth = {pp: part[0] for pp, part in zip(depths, parts) if part is not None and part[0] is not None}
    count = sum(part[1] for part in worked)
    best: Found | None = None
    for pp in depths:  # in order, as one process would: a tie goes to the shallower depth
        if pp in by_depth:
            result = evaluate(by_depth[pp])
            if best is None or score(result) < best.score:
                best = Found(by_depth[pp], result, count)
    timed_out = any(part[2] for part in worked) or len(worked) < len(depths)
    repeated = sum(1 for layer in model.layers if layer.repeated)
    for pp in depths:
        config = by_depth.get(pp)
        if config is None or timed_out or pp == 1 or repeated % (2 * pp) or time.perf_counter() > deadline:
            continue
        first = config.stages[0]
        woven = PipelineConfig(
            stages=even_stages(model, 2 * pp, tp=first.tp, dp=first.dp, recompute=_level(first)),
            micro_batch=config.micro_batch, zero=config.zero, schedule="interleaved", chunks=2,
        )
        result = evaluate(woven)
        count += 1
        if best is None or score(result) < best.score:
            best = Found(woven, result, count)
    if best is not None:
        best.evaluated, best.by = count, "grid"
        best.converged = not timed_out and time.perf_counter() <= deadline
    return best


def _deepest_first(depths: list[int]) -> list[int]:
    """The order processes take depths in: deeper pipelines have more stages to price, and taking the longest
    first keeps the last process from finishing long after the others."""
    return sorted(range(len(depths)), key=lambda k: -depths[k])


def _grid_depth(model: PipelineModel, pp: int, evaluate: Evaluator, *, global_batch: int,
                deadline: float) -> tuple[PipelineConfig | None, int, bool]:
    """The Megatron grid at depth ``pp``: its best point (the first of equals), the points priced, and whether the
    deadline cut it short."""
    devices = model.cluster.num_devices
    best: tuple[PipelineConfig, Score] | None = None
    count = 0
    for tp in tensor_parallel_sizes(model, devices // pp):
        dp = devices // pp // tp
        for per_rank in (1, 2, 4, 8, 16, 32):
            micro = per_rank * dp
            if global_batch % micro:
                continue
            for recompute, zero in itertools.product(RECOMPUTE, (0, 1)):
                if time.perf_counter() > deadline:
                    return (best[0] if best else None), count, True
                config = PipelineConfig(
                    stages=even_stages(model, pp, tp=tp, dp=dp, recompute=recompute), micro_batch=micro, zero=zero
                )
                result = evaluate(config)
                count += 1
                if best is None or score(result) < best[1]:
                    best = (config, score(result))
    return (best[0] if best else None), count, False


def _level(stage: Stage) -> str:
    """The uniform recomputation of a Megatron stage (its layers')."""
    return next((level for level in stage.recompute if level != "none"), "none")


# ---- Aceso -----------------------------------------------------------------------------------------------------


def balanced(model: PipelineModel, pp: int, *, global_batch: int) -> list[PipelineConfig]:
    """Aceso's starting points for depth ``pp``: for each tp the shapes allow (the same in every stage, since one
    stage at a time cannot move the micro-batch every stage must divide), stages of about equal compute, no
    recomputation, the smallest micro-batch that splits over dp."""
    per_stage = model.cluster.num_devices // pp
    starts = []
    for tp in tensor_parallel_sizes(model, per_stage):
        dp = per_stage // tp
        sizes = micro_batches(global_batch, [dp])
        if sizes:
            stages = even_stages(model, pp, tp=tp, dp=dp)
            starts.append(PipelineConfig(stages=_balance(model, stages, sizes[0]), micro_batch=sizes[0]))
    return starts


def _balance(model: PipelineModel, stages: tuple[Stage, ...], micro: int) -> tuple[Stage, ...]:
    """Re-cut stage boundaries so each stage's compute is close to the mean (greedy over the row chain)."""
    pp = len(stages)
    if pp == 1:
        return stages
    tp, dp = stages[0].tp, stages[0].dp
    weights = []
    mesh = build_mesh(model.cluster, {"pp": pp, "dp": dp, "tp": tp})
    for row in range(len(model.layers)):
        price = model.price(row, tp=tp, samples=micro / dp, recompute="none", sp=False, mesh=mesh)
        weights.append(price.forward + price.backward)
    target = sum(weights) / pp
    cuts, acc = [0], 0.0
    for row, w in enumerate(weights):
        remaining_rows = len(weights) - row
        remaining_stages = pp - len(cuts)
        if len(cuts) < pp and acc + w / 2 > target * len(cuts) and row > cuts[-1] and remaining_rows >= remaining_stages:
            cuts.append(row)
        acc += w
    while len(cuts) < pp:  # too few cuts (a heavy head): split the largest stage
        cuts.append(cuts[-1] + 1)
    cuts.append(len(weights))
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        return stages
    return tuple(Stage(start=a, end=b, tp=tp, dp=dp, recompute=("none",) * (b - a)) for a, b in zip(cuts, cuts[1:]))


def _bottlenecks(result: PipelineEstimate) -> list[int]:
    """Stages worst first: those over their memory (most over first), then the rest slowest first. The first is
    the bottleneck; the others are the secondary bottlenecks tried when relieving it does not pay."""
    reports = result.stages
    over = [r.memory.total / r.memory.budget for r in reports]
    return sorted(range(len(reports)), key=lambda i: (over[i] <= 1, -over[i] if over[i] > 1 else -reports[i].seconds))


def primitives(model: PipelineModel, config: PipelineConfig, stage: int, global_batch: int, *,
               steps: Callable[[int], tuple[int, ...]] | None = None) -> Iterator[PipelineConfig]:
    """Every single reconfiguration of ``stage`` (and the global micro-batch and ZeRO stage) that is valid;
    ``steps(rows)``: how many rows one move or recomputation change takes on a stage of ``rows`` rows (default
    `_steps`). Checkpointed runs are dropped: the rotor programme chooses them again for the configuration found."""
    if any(s.segments for s in config.stages):
        config = replace(config, stages=tuple(replace(s, segments=()) for s in config.stages))
    stages = list(config.stages)
    s = stages[stage]
    steps = (steps or _steps)(s.end - s.start)
    # op#: hand rows to a neighbour
    for step in steps:
        if stage > 0 and s.end - s.start > step:
            yield _with(config, _move(stages, stage - 1, stage, left=True, rows=step))
        if stage < len(stages) - 1 and s.end - s.start > step:
            yield _with(config, _move(stages, stage, stage + 1, left=False, rows=step))
    # tp up / down (dp follows)
    per_stage = s.tp * s.dp
    allowed = tensor_parallel_sizes(model, per_stage)
    for tp in (s.tp * 2, s.tp // 2):
        if tp in allowed and config.micro_batch % (per_stage // tp) == 0:
            stages_new = list(stages)
            stages_new[stage] = replace(s, tp=tp, dp=per_stage // tp, intra=s.intra and tp > 1)
            yield _with(config, stages_new)
    # the stage's layers laid out by the intra-op planner, or Megatron's column/row pairs again
    if s.tp > 1:
        stages_new = list(stages)
        stages_new[stage] = replace(s, intra=not s.intra)
        yield _with(config, stages_new)
    # recompute one level more / less on the rows keeping the most activations (one row, or a share of them)
    levels = {"none": 0, "selective": 1, "full": 2}
    heavy = model.heaviest_first(s.start, s.end)
    for direction in (1, -1):
        movable = list(itertools.islice((row for row in heavy if model.layers[row].repeated
                                         and 0 <= levels[s.recompute_of(row)] + direction <= 2), max(steps)))
        for step in steps:
            if step > len(movable):
                continue
            recompute = list(s.recompute or ("none",) * (s.end - s.start))
            for row in movable[:step]:
                recompute[row - s.start] = RECOMPUTE[levels[s.recompute_of(row)] + direction]
            stages_new = list(stages)
            stages_new[stage] = replace(s, recompute=tuple(recompute))
            yield _with(config, stages_new)
    # micro-batch and ZeRO (global)
    dps = [x.dp for x in stages]
    for micro in (config.micro_batch * 2, config.micro_batch // 2):
        if micro >= 1 and global_batch % micro == 0 and all(micro % d == 0 for d in dps):
            yield replace(config, micro_batch=micro)
    for zero in (config.zero + 1, config.zero - 1):
        if 0 <= zero <= 3:
            yield replace(config, zero=zero)


def _steps(rows: int) -> tuple[int, ...]:
    """How many rows one primitive moves or recomputes: one, and on stages of many rows an eighth of them too, so
    a climb on a deep model crosses its layers in a few hops rather than one hop per layer."""
    return (1,) if rows < 16 else (1, rows // 8)


def coarse_unit(model: PipelineModel, pp: int) -> int:
    """Rows per step of the coarse climb at depth ``pp``: an eighth of a stage's share of the chain where that
    is at least 4 rows (stages of 32 rows or more), else 1 (no coarse climb)."""
    unit = len(model.layers) // (8 * pp)
    return unit if unit >= 4 else 1


def _coarse_steps(rows: int, *, unit: int) -> tuple[int, ...]:
    """A coarse climb's steps: ``unit`` rows, and an eighth of the stage in whole units."""
    return tuple(sorted({unit, max(unit, rows // 8 // unit * unit)}))


def _fine_steps(rows: int, *, unit: int) -> tuple[int, ...]:
    """The steps of the climb after a coarse one of ``unit`` rows: the powers of two below ``unit``, so each
    boundary and each recomputation count settles within the coarse step in a few hops."""
    return tuple(1 << k for k in range((unit - 1).bit_length()))


def _with(config: PipelineConfig, stages: list[Stage]) -> PipelineConfig:
    return replace(config, stages=tuple(stages))


def _move(stages: list[Stage], left_index: int, right_index: int, *, left: bool, rows: int = 1) -> list[Stage]:
    """Move ``rows`` rows across the boundary between two neighbouring stages: into the left one (``left``) or
    out of it into the right one."""
    a, b = stages[left_index], stages[right_index]
    ra = list(a.recompute or ("none",) * (a.end - a.start))
    rb = list(b.recompute or ("none",) * (b.end - b.start))
    if left:  # b's first rows join a
        ra, rb = ra + rb[:rows], rb[rows:]
        a, b = replace(a, end=a.end + rows, recompute=tuple(ra)), replace(b, start=b.start + rows, recompute=tuple(rb))
    else:  # a's last rows join b
        ra, rb = ra[:-rows], ra[-rows:] + rb
        a, b = replace(a, end=a.end - rows, recompute=tuple(ra)), replace(b, start=b.start - rows, recompute=tuple(rb))
    out = list(stages)
    out[left_index], out[right_index] = a, b
    return out


def aceso(
    model: PipelineModel,
    *,
    global_batch: int,
    time_limit: float = 30.0,
    max_hops: int = 3,
    beam: int = 4,
    secondary: int = 3,
    depths: list[int] | None = None,
    seeds: list[PipelineConfig] | None = None,
    evaluate: Evaluator | None = None,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    window: int = 300,
    tolerance: float = 1e-3,
) -> Found | None:
    """Aceso's search over every pipeline depth (or ``depths``); ``seeds`` are extra starting points (the best
    Megatron configuration, say), climbed at their own depth. Each climb stops when it converges (`Window`:
    ``window`` configurations without a gain of ``tolerance``); the result is ``converged`` when every climb did
    within its share of ``time_limit``. On a deep chain (stages of 32 rows or more) each climb moves and recomputes
    rows in steps of an eighth of a stage first (`coarse_unit`), then in powers of two below that step, which
    prices far fewer configurations than single rows from the start. Depths are independent: where there are
    cores for it they are climbed side by side in forked processes (`search.workers`), and the result is the one
    a single process finds whenever the climbs converge."""
    evaluate = evaluate or Evaluator(model, global_batch=global_batch)
    depths = depths or pipeline_depths(model, model.cluster.num_devices)
    processes = min(default_workers(), len(depths))
    start_time = time.perf_counter()
    before = len(evaluate.cache)
    best_here: list[Found] = []  # this process's best so far, for progress

    def work(pp: int, stop: Callable[[], bool], left: int) -> tuple[PipelineConfig | None, int, bool]:
        # an equal share of the time left for each depth still to climb in this process (one that converges
        # early leaves its time to the next)
        share = (time_limit - (time.perf_counter() - start_time)) / max(1, math.ceil(left / processes))
        found, evaluated, converged = _climb_depth(
            model, pp, evaluate, global_batch=global_batch, deadline=time.perf_counter() + share, max_hops=max_hops,
            beam=beam, secondary=secondary, seeds=seeds, should_stop=stop, window=window, tolerance=tolerance)
        if found is not None and progress is not None and not in_worker():
            if not best_here or found.score < best_here[0].score:
                best_here[:] = [found]
            e, b = found.result.estimate, best_here[0].result.estimate
            progress(f"pp {pp}: {e.iteration_seconds:.3f} s per iteration" + ("" if e.memory.fits else " (no fit)")
                     + f"; best so far {b.iteration_seconds:.3f} s" + ("" if b.memory.fits else " (no fit)"))
        return (found.config if found is not None else None), evaluated, converged

    parts, finished = share_out(depths, work, should_stop=should_stop, finish=lambda: evaluate.handed_back(before),
                                order=_deepest_first(depths))
    climbed = [part[0] for part in parts if part is not None and part[0] is not None]
    for top, priced in finished:
        evaluate.adopt(climbed + top, priced=priced)
    best: Found | None = None
    evaluated = 0
    all_converged = not should_stop() and all(part is not None for part in parts)
    for part in parts:  # in the depths' order, as one process would: a tie goes to the shallower depth
        if part is None:
            continue
        config, count, converged = part
        evaluated += count
        if config is None:
            continue
        found = Found(config, evaluate(config), count, by="aceso", converged=converged)
        all_converged = all_converged and converged
        if best is None or found.score < best.score:
            best = found
    if best is not None:
        best.evaluated, best.by, best.converged = evaluated, "aceso", all_converged
    return best


FURTHER = 2  # climbs of a depth taken on to their secondary bottlenecks (`_climb_depth`)


def _climb_depth(
    model: PipelineModel, pp: int, evaluate: Evaluator, *, global_batch: int, deadline: float, max_hops: int,
    beam: int, secondary: int, seeds: list[PipelineConfig] | None, should_stop: Callable[[], bool], window: int,
    tolerance: float,
) -> tuple[Found | None, int, bool]:
    """Aceso at depth ``pp`` until ``deadline``: its best configuration (None where no start is allowed), the
    configurations priced, and whether every climb converged."""
    starts = [c for c in (*balanced(model, pp, global_batch=global_batch), *(c for c in seeds or () if c.pp == pp))
              if evaluate.limit is None or not evaluate.limit(c)]
    if not starts:
        return None, 0, True
    climbs: list[Found] = []
    converged = True
    evaluated = 0
    # on a deep chain each start climbs in steps of many rows first, then in finer steps from where that ends:
    # single-row steps from the start would take hundreds of hops, each pricing every primitive
    unit = coarse_unit(model, pp)
    for start in starts:  # each start climbs until it converges, within the depth's time
        count, steps = 0, None
        if unit > 1:
            coarse, count = _climb(model, start, evaluate, global_batch, deadline, max_hops, beam, should_stop,
                                   window=Window(window, tolerance), steps=functools.partial(_coarse_steps, unit=unit))
            start, steps = coarse.config, functools.partial(_fine_steps, unit=unit)
        climbed, fine = _climb(model, start, evaluate, global_batch, deadline, max_hops, beam, should_stop,
                               window=Window(window, tolerance), steps=steps)
        count += fine
        converged = converged and climbed.converged
        # a climb that fits by raising ZeRO can miss fitting by recomputation instead, which may be faster
        climbed, tried = _retune(model, climbed, evaluate, global_batch, zeros=range(climbed.config.zero))
        evaluated += count + tried
        climbs.append(climbed)
    # the depth's time left: secondary bottlenecks, from the best two climbs (the best first climb can end where
    # its secondary bottlenecks lead nowhere, while the runner-up's lead further: LLaMA-70B on 64 GPUs from the
    # Megatron grid's point ends 3.6% behind the climb from an even start)
    climbs.sort(key=lambda f: f.score)
    found = climbs[0]
    for climbed in [f for k, f in enumerate(climbs) if all(f.config != g.config for g in climbs[:k])][:FURTHER]:
        if time.perf_counter() >= deadline or should_stop():
            converged = False
            break
        further, count = _climb(model, climbed.config, evaluate, global_batch, deadline, max_hops, beam,
                                should_stop, secondary=secondary, window=Window(window, tolerance))
        evaluated += count
        converged = converged and further.converged
        if further.score < found.score:
            found = further
    # the exact per-stage recomputation on the depth's best configuration
    found, count = _retune(model, found, evaluate, global_batch, zeros=(found.config.zero,), rotor=True)
    return found, evaluated + count, converged


def _retune(
    model: PipelineModel, found: Found, evaluate: Evaluator, global_batch: int, *, zeros: Iterable[int],
    rotor: bool = False,
) -> tuple[Found, int]:
    """``found`` under each ZeRO stage of ``zeros`` with each stage's recomputation chosen exactly (the per-layer
    knapsack, and rotor too with ``rotor``); the best of those and ``found``."""
    count = 0
    for zero in zeros:
        tuned = with_optimal_recompute(model, replace(found.config, zero=zero), global_batch=global_batch,
                                       rotor=rotor)
        if tuned == found.config:
            continue
        try:
            result = evaluate(tuned)
        except ValueError:  # outside the search's limit
            continue
        count += 1
        if score(result) < found.score:
            found = Found(tuned, result, found.evaluated)
    return found, count


def _climb(
    model: PipelineModel, start: PipelineConfig, evaluate: Evaluator, global_batch: int, deadline: float,
    max_hops: int, beam: int, should_stop: Callable[[], bool], *, secondary: int = 0, window: Window | None = None,
    steps: Callable[[int], tuple[int, ...]] | None = None,
) -> tuple[Found, int]:
    """Relieve the bottleneck until no sequence of up to ``max_hops`` primitives improves, or ``window`` says
    the gains have become too small to go on for; with ``secondary`` > 0, the next ``secondary`` bottlenecks are
    tried in turn before giving up (Aceso's secondary bottlenecks). The result is ``converged`` unless the deadline
    or ``should_stop`` ended it."""
    current, current_score = start, score(evaluate(start))
    visited = {start}
    count = 1
    window = window or Window()
    converged = False
    while time.perf_counter() < deadline and not should_stop():
        for rank in range(secondary + 1):
            improved, current, current_score, tried = _hops(
                model, current, current_score, rank, evaluate, global_batch, deadline, max_hops, beam, visited,
                steps=steps)
            count += tried
            if improved or time.perf_counter() > deadline:
                break
        if not improved and time.perf_counter() > deadline:
            break
        if not improved or window.converged(count, current_score):
            converged = True
            break
    return Found(current, evaluate(current), count, by="aceso", converged=converged), count


def _hops(
    model: PipelineModel, current: PipelineConfig, current_score: Score, rank: int, evaluate: Evaluator,
    global_batch: int, deadline: float, max_hops: int, beam: int, visited: set, *,
    steps: Callable[[int], tuple[int, ...]] | None = None,
) -> tuple[bool, PipelineConfig, Score, int]:
    """One multi-hop search from ``current`` on each configuration's ``rank``-th bottleneck: the first
    configuration better than ``current`` within ``max_hops`` primitives, keeping the ``beam`` best per hop."""
    frontier = [current]
    count = 0
    for _ in range(max_hops):
        scored: list[tuple[Score, PipelineConfig]] = []
        for config in frontier:
            ranked = _bottlenecks(evaluate(config))
            if rank >= len(ranked):
                continue
            for candidate in primitives(model, config, ranked[rank], global_batch, steps=steps):
                if candidate in visited:
                    continue
                visited.add(candidate)
                try:
                    candidate_result = evaluate(candidate)
                except ValueError:  # e.g. a micro-batch that no longer splits: not a configuration
                    continue
                count += 1
                scored.append((score(candidate_result), candidate))
        if not scored:
            break
        scored.sort(key=lambda x: x[0])
        if scored[0][0] < current_score:
            return True, scored[0][1], scored[0][0], count
        frontier = [c for _, c in scored[:beam]]
        if time.perf_counter() > deadline:
            break
    return False, current, current_score, count


# ---- exhaustive ------------------------------------------------------------------------------------------------


def exhaustive(
    model: PipelineModel, *, global_batch: int, limit: int = 200_000, deadline: float = math.inf,
    within: Limit | None = None,
) -> Found:
    """Every configuration with uniform recomputation per stage that ``within`` accepts (raises if the space
    exceeds ``limit``)."""
    evaluate = Evaluator(model, global_batch=global_batch, limit=within)
    spaces = list(itertools.islice(_exhaustive_space(model, global_batch), limit + 1))  # stop counting past limit
    if len(spaces) > limit:
        raise ValueError(f"the exhaustive space has more than {limit:,} configurations: use --search auto")
    best: Found | None = None
    for count, config in enumerate(spaces, 1):
        if time.perf_counter() > deadline:
            break
        try:
            result = evaluate(config)
        except ValueError:
            continue
        if best is None or score(result) < best.score:
            best = Found(config, result, count)
    if best is None:
        raise ValueError("no pipeline configuration exists for this batch and device count")
    best.evaluated = len(spaces)
    return best


def _exhaustive_space(model: PipelineModel, global_batch: int) -> Iterator[PipelineConfig]:
    devices = model.cluster.num_devices
    rows = len(model.layers)
    for pp in pipeline_depths(model, devices):
        per_stage = devices // pp
        tps = tensor_parallel_sizes(model, per_stage)
        for cuts in itertools.combinations(range(1, rows), pp - 1):
            bounds = (0, *cuts, rows)
            for stage_tps in itertools.product(tps, repeat=pp):
                dps = [per_stage // t for t in stage_tps]
                for recs in itertools.product(RECOMPUTE, repeat=pp):
                    stages = tuple(
                        Stage(start=a, end=b, tp=t, dp=per_stage // t, recompute=(r,) * (b - a))
                        for a, b, t, r in zip(bounds, bounds[1:], stage_tps, recs)
                    )
                    for micro in micro_batches(global_batch, dps):
                        for zero in (0, 1, 2, 3):
                            yield PipelineConfig(stages=stages, micro_batch=micro, zero=zero)


# ---- auto and the baselines ----------------------------------------------------------------------------------


def auto(
    model: PipelineModel,
    *,
    global_batch: int,
    time_limit: float = 30.0,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    limit: Limit | None = None,
    seed: int = 0,
) -> dict[str, Found | None]:
    """The default search: the Megatron grid first (cheap, and a floor: Aceso climbs from its best point too),
    then Aceso over every depth, then MCMC chains (`search.mcmc`, on its shorter ``POLISH`` schedule) from Aceso's
    result, the grid's best and pure DP with the time Aceso left; each stops when it converges, ``time_limit``
    bounding the whole. For a mixture of experts, data parallelism with the experts split over every device
    (`expert_parallel`) is one more point. Returns ``auto`` (the best, ``by`` naming the search that found it,
    ``ep`` for that point; a tie goes to the earlier search) with the ``megatron``, ``dp`` and ``fsdp`` baselines.
    With ``limit`` (`runtime_limit`, say) only configurations it accepts are searched; the baselines are priced
    whatever it says. ``seed`` seeds the chains: a given seed gives the same plan whenever the searches converge."""
    from autopar.search.mcmc import POLISH, mcmc

    start = time.perf_counter()
    evaluate = Evaluator(model, global_batch=global_batch, limit=limit)
    baselines = Evaluator(model, global_batch=global_batch)
    grid = megatron_grid(model, global_batch=global_batch, evaluate=baselines, deadline=start + time_limit / 3,
                         limit=limit)
    if limit is not None:  # the grid's points the limit accepts seed the search
        evaluate.cache.update((c, r) for c, r in baselines.cache.items() if not limit(c))
        evaluate.elsewhere |= baselines.elsewhere
    else:
        evaluate = baselines
    if progress and grid is not None:
        progress(f"Megatron grid: {grid.result.estimate.iteration_seconds:.3f} s per iteration")
    remaining = max(time_limit - (time.perf_counter() - start), 0.1)
    # Aceso's primitives change one stage at a time: it climbs from the grid's best non-interleaved point
    plain = [config for config in evaluate.cache if config.chunks == 1]
    seed_config = min(plain, key=lambda config: score(evaluate.cache[config]), default=None)
    found = aceso(
        model, global_batch=global_batch, time_limit=remaining,
        seeds=[seed_config] if seed_config is not None else None, evaluate=evaluate, progress=progress,
        should_stop=should_stop,
    )
    allowed_grid = grid if grid is not None and (limit is None or not limit(grid.config)) else None
    dp = data_parallel(model, global_batch=global_batch, zero=0, evaluate=baselines)
    chains = None
    if not should_stop():
        chains = mcmc(model, global_batch=global_batch, seeds=[f.config for f in (found, allowed_grid, dp) if f],
                      evaluate=evaluate, time_limit=max(time_limit - (time.perf_counter() - start), 0.1), seed=seed,
                      schedule=POLISH, progress=progress, should_stop=should_stop)
    # a mixture's experts split over the devices: a point no other search reaches (they keep ep 1)
    experts = expert_parallel(model, global_batch=global_batch, evaluate=evaluate)
    searches = [f for f in (allowed_grid, found, chains, experts) if f is not None]
    best = min(searches, key=lambda f: f.score, default=None)
    if best is not None:
        complete = grid is not None and grid.converged
        # runners-up: the best of other shapes, and each search's own best, which the simulation may rank
        # otherwise than the closed form does (the finalists are simulated, `api.search.simulated`)
        runners = evaluate.top(3, besides=best.config)
        for other in (found, chains):  # the grid's best is a baseline, simulated as one
            if other is not None and other.config != best.config and all(other.config != r.config for r in runners):
                runners.append(replace(other, runners_up=[]))
        best = replace(best, by="grid" if best is allowed_grid else best.by, evaluated=evaluate.priced,
                       runners_up=runners,
                       converged=complete and all(f.converged for f in (found, chains) if f is not None)
                       and chains is not None)
    return {
        "auto": best,
        "megatron": grid,
        "dp": dp,
        "fsdp": data_parallel(model, global_batch=global_batch, zero=3, evaluate=baselines),
    }


EXPERT_TWINS = 8  # configurations `expert_parallel` prices again with their experts split


def data_parallel(
    model: PipelineModel, *, global_batch: int, zero: int, evaluate: Evaluator | None = None, ep: int = 1
) -> Found | None:
    """Pure data parallelism (ZeRO ``zero``; 3 is FSDP; ``ep``: each mixture's experts split over that many of
    the ranks) at its best micro-batch size."""
    evaluate = evaluate or Evaluator(model, global_batch=global_batch)
    devices = model.cluster.num_devices
    best: Found | None = None
    for micro in micro_batches(global_batch, [devices]):
        config = PipelineConfig(stages=even_stages(model, 1, tp=1, dp=devices), micro_batch=micro, zero=zero, ep=ep)
        result = evaluate(config)
        if best is None or score(result) < best.score:
            best = Found(config, result, 1)
    return best


def expert_parallel(model: PipelineModel, *, global_batch: int, evaluate: Evaluator,
                    twins: int = EXPERT_TWINS) -> Found | None:
    """The best plan with each mixture's experts split over each stage's dp ranks (`PipelineConfig.ep`): data
    parallelism with the experts split over all the devices under each ZeRO stage, each at its best micro-batch
    size, and the twins of the ``twins`` best configurations ``evaluate`` has priced that can have one (tp 1, every
    stage of one dp that divides every mixture's experts: the same stages, schedule, micro-batch and ZeRO stage, the
    experts split). None for a model without experts, or where no such configuration exists or ``evaluate``'s limit
    refuses them all."""
    devices = model.cluster.num_devices
    groups = [group for row in model.expert_groups for group in row]
    if devices < 2 or not groups:
        return None

    def splits(dp: int) -> bool:
        return dp > 1 and all(group.experts % dp == 0 for group in groups)

    found = None
    if splits(devices):
        probe = PipelineConfig(stages=even_stages(model, 1, tp=1, dp=devices), micro_batch=devices, ep=devices)
        if evaluate.limit is None or not evaluate.limit(probe):
            for zero in (0, 1, 2, 3):
                best = data_parallel(model, global_batch=global_batch, zero=zero, evaluate=evaluate, ep=devices)
                if best is not None and (found is None or best.score < found.score):
                    found = best

    def has_twin(config: PipelineConfig) -> bool:
        dp = config.stages[0].dp
        return config.ep == 1 and splits(dp) and all((s.tp, s.dp, s.intra) == (1, dp, False) for s in config.stages)

    plain = [(score(result), config) for config, result in evaluate.cache.items() if has_twin(config)]
    for _, config in sorted(plain, key=lambda pair: pair[0])[:twins]:
        twin = replace(config, ep=config.stages[0].dp)
        if evaluate.limit is not None and evaluate.limit(twin):
            continue
        result = evaluate(twin)
        if found is None or score(result) < found.score:
            found = Found(twin, result, 1)
    if found is not None:
        found.by = "ep"
    return found


# ---- output ----------------------------------------------------------------------------------------------------


def pipeline_plan(
    model: PipelineModel, found: Found, *, name: str, kind: str, global_batch: int, workload: Workload | None = None
) -> Plan:
    """A pipeline plan: stages with their layers, dp x tp and recomputed layers, and per module the layouts of its
    parameters over its stage's (dp, tp) mesh: column-parallel weights split by output features on tp (S(0) for a
    Linear's (out, in) weight, S(1) for a weight the model stores as (in, out), GPT-2's Conv1D), row-parallel ones
    by input features; under ZeRO-3 every parameter S(0) on dp, and under expert parallelism the experts' (split by
    expert, dim 0, `PipelineConfig.ep`). A weight tp keeps whole but applies to the
    activations it splits (a q or k norm per head) is marked ``summed``: the runtime sums its gradient over tp, as
    the cost model prices."""
    config = found.config
    stages = []
    modules: dict[str, dict[str, tuple]] = {}  # module -> parameter -> (tp placement, summed, shape)
    dp_placement = parse("S(0)" if config.zero == 3 else "R")
    placements = {text: (dp_placement, parse(text)) for text in ("R", "S(0)", "S(1)")}
    edges: dict[str, tuple] = {}  # an intra-laid-out leading op's module -> its input's and output's layouts
    for index, (stage, report) in enumerate(zip(config.stages, found.result.stages)):
        rows = [model.layers[r] for r in range(stage.start, stage.end)]
        view = model.stage_view(config, index, global_batch=global_batch)
        layouts = view.layouts
        batch = parse("S(0)" if stage.dp > 1 else "R")  # activations: each dp rank's own samples
        for r, layout in layouts.items():
            for fqn, (read, handed) in model.intra_layers.edges(r, view.mesh.axis("tp"), layout, sp=config.sp).items():
                edges[fqn] = ((batch, *read), (batch, *handed))
        stages.append(PlanStage(
            layers=tuple(row.name for row in rows), dp=stage.dp, tp=stage.tp,
            recompute=tuple((row.name, stage.recompute_of(r)) for r, row in zip(range(stage.start, stage.end), rows)
                            if stage.recompute_of(r) != "none"),
            segments=tuple((model.layers[a].name, model.layers[b - 1].name) for a, b in stage.segments),
            # layers laid out by the intra-op planner: per leading op (module inside the layer), the dim its tp axis
            # splits (m: rows, n: output features, k: the contracted dim, b: experts or batch)
            intra=stage.intra,
            layouts=tuple((model.layers[r].name, tuple(dict(layout.splits).items())) for r, layout in layouts.items()),
            seconds_per_micro_batch=report.seconds, memory=report.memory,
        ))
        for r, row in zip(range(stage.start, stage.end), rows):
            laid_out = dict(layouts[r].params) if r in layouts else None
            for node in row.nodes:
                for source in node.sources:
                    fqn = source.state
                    info = model.graph.state.get(fqn) if fqn else None
                    if info is None or info.is_buffer:
                        continue
                    tp_placement = "R"
                    if laid_out is not None:
                        tp_placement = laid_out.get(fqn[len(row.name) + 1:], "R")
                    elif stage.tp > 1 and node.id in row.sharded:
                        out_dim = weight_out_dim(model.graph, node, source) if len(info.tensor.shape) == 2 else 0
                        if len(info.tensor.shape) == 3:  # a mixture's experts, one matrix each
                            dim = expert_weight_dim(model.graph, node, source, column=node.id in row.columns)
                            tp_placement = "R" if dim is None else f"S({dim})"
                        elif node.id in row.columns:  # weight and bias: split the output features
                            tp_placement = f"S({out_dim})"
                        elif len(info.tensor.shape) == 2:  # a row-parallel weight: split the input features
                            tp_placement = f"S({1 - out_dim})"
                        elif fqn in row.column_biases:  # a column's bias added on its own: split with it
                            tp_placement = "S(0)"
                    # the last node reading a weight decides (its transpose or view comes before the matmul)
                    summed = stage.tp > 1 and laid_out is None and fqn in row.tp_partial
                    modules.setdefault(fqn.rpartition(".")[0], {})[fqn] = (tp_placement, summed, info.tensor.shape)
    experts = {group.module for groups in model.expert_groups for group in groups} if config.ep > 1 else set()
    by_expert = parse("S(0)")
    entries = {
        fqn: tuple(ParamLayout(name=name, placements=(by_expert, parse(tp)) if fqn in experts else
                               placements.get(tp) or (dp_placement, parse(tp)),
                               shape=tuple(shape), summed=summed) for name, (tp, summed, shape) in params.items())
        for fqn, params in modules.items()
    }
    entries.update({fqn: () for fqn in edges if fqn not in entries})
    return Plan(
        model=name, kind=kind, mesh=Mesh(shape=(config.pp, model.cluster.num_devices // config.pp),
                                         axes=("pp", "dp_tp")),
        schedule=config.schedule, chunks=config.chunks, micro_batch_size=config.micro_batch,
        micro_batches=global_batch // config.micro_batch, zero=config.zero, sp=config.sp, ep=config.ep,
        kernels=model.kernels,
        stages=tuple(stages),
        modules=tuple(ModuleLayout(fqn=fqn, params=params, input=edges.get(fqn, (None, None))[0],
                                   output=edges.get(fqn, (None, None))[1]) for fqn, params in entries.items()),
        workload=workload, estimate=found.result.estimate,
    )


def config_of(model: PipelineModel, plan: Plan) -> PipelineConfig:
    """The configuration a pipeline plan describes, on ``model``'s layer chain (`config_on`)."""
    return config_on([layer.name for layer in model.layers], plan)


def config_on(chain: Sequence[str], plan: Plan) -> PipelineConfig:
    """The configuration a pipeline plan describes, on the chain of layers named ``chain`` (a traced graph's
    `Graph.layers`, in order): its stages must cover the chain in order, each a contiguous run of layers (a
    ValueError names the first layer out of place)."""
    index = {name: i for i, name in enumerate(chain)}
    stages = []
    expected = 0
    for number, entry in enumerate(plan.stages):
        rows = []
        for name in entry.layers:
            if name not in index:
                raise ValueError(f"stage {number} of the plan holds {name!r}, which the model does not have")
            if index[name] != expected:
                raise ValueError(f"stage {number} of the plan holds {name!r} where the model's chain has "
                                 f"{chain[expected]!r}: stages must cover the model's layers in order")
            rows.append(index[name])
            expected += 1
        start, end = rows[0], rows[-1] + 1
        levels = tuple(entry.recompute_of(chain[r]) for r in range(start, end))
        segments = tuple((index[first], index[last] + 1) for first, last in entry.segments)
        for layer, _ in entry.layouts:
            if not start <= index.get(layer, -1) < end:
                raise ValueError(f"stage {number} of the plan lays out {layer!r}, which is not one of its layers")
        laid = tuple(sorted((index[layer], splits) for layer, splits in entry.layouts)) if entry.intra else None
        stages.append(Stage(start=start, end=end, tp=entry.tp, dp=entry.dp, recompute=levels, segments=segments,
                            intra=entry.intra, layouts=laid))
    if expected != len(chain):
        raise ValueError(f"the plan's stages end at {chain[expected - 1]!r}; the model's chain goes on to "
                         f"{chain[expected]!r} ({len(chain) - expected} more)")
    return PipelineConfig(stages=tuple(stages), micro_batch=plan.micro_batch_size, zero=plan.zero, sp=plan.sp,
                          schedule=plan.schedule, chunks=plan.chunks, ep=plan.ep)


def pipeline_searches(
    model: PipelineModel,
    kind: str,
    *,
    global_batch: int,
    time_limit: float = 30.0,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    limit: Limit | None = None,
    seed: int = 0,
) -> dict[str, Found | None]:
    """Run search ``kind`` (auto, aceso, mcmc, exhaustive, megatron, dp, fsdp) and price the baselines beside it;
    with ``limit``, the auto, aceso, mcmc and exhaustive searches keep to the configurations it accepts. ``seed``
    seeds the MCMC chains (auto, mcmc)."""
    if kind == "auto":
        return auto(model, global_batch=global_batch, time_limit=time_limit, progress=progress, should_stop=should_stop,
                    limit=limit, seed=seed)
    evaluate = Evaluator(model, global_batch=global_batch, limit=limit)
    baselines = Evaluator(model, global_batch=global_batch)
    found: dict[str, Found | None] = {}
    deadline = time.perf_counter() + time_limit
    if kind == "aceso":
        found["aceso"] = aceso(model, global_batch=global_batch, time_limit=time_limit, evaluate=evaluate,
                               progress=progress, should_stop=should_stop)
        if found["aceso"] is not None:
            found["aceso"].runners_up = evaluate.top(3, besides=found["aceso"].config)
    elif kind == "exhaustive":
        found["exhaustive"] = exhaustive(model, global_batch=global_batch, deadline=deadline, within=limit)
    found["megatron"] = megatron_grid(model, global_batch=global_batch, evaluate=baselines, limit=limit)
    found["dp"] = data_parallel(model, global_batch=global_batch, zero=0, evaluate=baselines)
    if kind == "mcmc":
        found["mcmc"] = _chains(model, global_batch=global_batch, deadline=deadline, evaluate=evaluate,
                                baselines=baselines, dp=found["dp"], progress=progress, should_stop=should_stop,
                                seed=seed)
    found["fsdp"] = data_parallel(model, global_batch=global_batch, zero=3, evaluate=baselines)
    return found


def _chains(
    model: PipelineModel, *, global_batch: int, deadline: float, evaluate: Evaluator, baselines: Evaluator,
    dp: Found | None, progress: Callable[[str], None] | None, should_stop: Callable[[], bool], seed: int = 0,
) -> Found | None:
    """MCMC alone (`search.mcmc`), seeded from pure DP and the Megatron grid's best point at each of its three
    best depths (the grid has run: its points are in ``baselines``); the runners-up are the best other shapes it
    priced."""
    from autopar.search.mcmc import mcmc

    per_depth: dict[int, PipelineConfig] = {}
    for config, result in sorted(baselines.cache.items(), key=lambda item: score(item[1])):
        if config.chunks == 1 and (evaluate.limit is None or not evaluate.limit(config)):
            per_depth.setdefault(config.pp, config)
    seeds = [*list(per_depth.values())[:3], *([dp.config] if dp is not None else [])]
    found = mcmc(model, global_batch=global_batch, seeds=seeds, evaluate=evaluate,
                 time_limit=max(deadline - time.perf_counter(), 0.1), seed=seed, progress=progress,
                 should_stop=should_stop)
    if found is not None:
        found.runners_up, found.evaluated = evaluate.top(3, besides=found.config), evaluate.priced
    return found
