"""The pipeline planner as a library: search, simulate the best, and keep a plan the runtime can run.

`autopar plan MODEL` (a zoo model, which `autopar run` rebuilds from the plan's workload) and `autopar.plan(model,
...)` (a user's module, run in the user's own script) both call `search_pipeline`:

1. the search (`autopar.search.pipeline.pipeline_searches`) ranks configurations by the closed form, with the
   baselines (DP, FSDP, the Megatron grid) priced beside it; with ``runnable_only`` it keeps to shapes the runtime
   runs (`runtime_limit`);
2. the plan and its runners-up are re-priced by the simulator (`simulated`): what a user sees is simulated;
3. the chosen plan, when it fits, is checked against the model itself (``Subject.check``: the runtime's own checks,
   `refusal`); with ``runnable_only`` the runners-up are tried in order when it would be refused, and when none can
   run the answer is an error naming the reason, never a plan that fails on the ranks.

With ``runnable_only`` the whole space is searched first: when its best plan runs, that is the answer; when it does
not, the search is repeated within what the runtime runs, and the faster plan it could not offer is kept beside
the answer (`Searched.faster`), so that what the limit costs is shown, never hidden.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autopar.capture import Graph
from autopar.cluster.spec import Cluster
from autopar.cost.memory import OPTIMIZER_STATE_BYTES, Precision
from autopar.cost.pipeline import PipelineConfig, PipelineEstimate, PipelineModel
from autopar.plan import Plan, Workload
from autopar.plan.checks import FieldError, choice, finite, flag, integer, text
from autopar.plan.records import DTYPES, KERNELS, MAX_BATCH
from autopar.runtime.source import ModelSource
from autopar.search.heap import gc_paused
from autopar.search.pipeline import Found, pipeline_plan, pipeline_searches, runtime_limit, score, shape
from autopar.search.workers import Beside, beside, in_worker, share_out

log = logging.getLogger(__name__)

PIPELINE_SEARCHES = ("auto", "aceso", "mcmc", "exhaustive", "megatron", "dp", "fsdp")
BASELINE_SEARCHES = ("megatron", "dp", "fsdp")  # one point each: no wider space to search first
MAX_BUDGET_S = 86_400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """What to search: ``search`` (auto, aceso, mcmc, exhaustive, or one baseline: megatron, dp, fsdp) for a global
    batch of ``batch`` samples, within at most ``budget_s`` seconds (searches stop sooner when they converge);
    ``seed``: the MCMC chains' (auto, mcmc); ``runnable_only``: only plans the runtime can run;
    ``kernels``: eager or compiled; ``dtype`` the model's (fp32, bf16, fp16); ``optimizer`` whose state the memory
    estimate holds (sgd, momentum, adam; None: SGD for fp32, Adam with an fp32 master copy otherwise)."""

    search: str = "auto"
    batch: int
    budget_s: float = 60.0
    runnable_only: bool = True
    kernels: str = "eager"
    dtype: str = "bf16"
    optimizer: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        choice("search", self.search, PIPELINE_SEARCHES)
        integer("seed", self.seed, low=0, high=2**31 - 1)
        integer("batch", self.batch, high=MAX_BATCH)
        finite("budget_s", self.budget_s)
        if not 0 < self.budget_s <= MAX_BUDGET_S:
            raise FieldError("budget_s", f"must be a positive number of seconds up to {MAX_BUDGET_S:,.0f}, got "
                             f"{self.budget_s!r}")
        flag("runnable_only", self.runnable_only)
        choice("kernels", self.kernels, KERNELS)
        choice("dtype", self.dtype, DTYPES)
        if self.optimizer is not None:
            choice("optimizer", self.optimizer, tuple(OPTIMIZER_STATE_BYTES))


@dataclass(frozen=True, slots=True, kw_only=True)
class Subject:
    """What is planned: the model's trace at batch 1 (``graph``; costs scale with the batch), its display ``name``,
    its ``workload`` for `autopar run` (None for a user's module), whether the runtime can cut it into pipeline
    stages, ``no_tp``: why no plan with tp > 1 can run it, or None (`runtime.validate.tensor_parallel_refusal`), and
    ``check``: why the runtime would refuse a plan for it, or None (`refusal`)."""

    graph: Graph
    name: str
    check: Callable[[Plan], str | None]
    pipelines: bool = True
    no_tp: str | None = None
    workload: Workload | None = None
    # a model cut by its traced forward: the rows a stage may start at (`autopar.runtime.chain.cut_points`), or
    # None where stages may start at any row
    cuts: frozenset[int] | None = None

    @classmethod
    def of(cls, graph: Graph, module: nn.Module, *, name: str, check: Callable[[Plan], str | None],
           pipelines: bool = True, workload: Workload | None = None) -> Subject:
        """``module`` (its trace ``graph``), with what keeps its plans runnable worked out: the pipeline cut
        (`can_pipeline`, and ``pipelines``; for a model cut by its traced forward, the rows stages may start at)
        and the tp refusal."""
        from autopar.runtime.chain import cut_points
        from autopar.runtime.pipeline import chain_kind
        from autopar.runtime.validate import tensor_parallel_refusal

        seq = next((int(t.shape[1]) for t in graph.inputs if len(t.shape) == 2), 0)  # token inputs' length
        cuts = None
        if pipelines and chain_kind(module) == "fx":  # where its forward can be cut, once
            cuts = frozenset(cut_points(module, [layer.name for layer in graph.layers()]))
        return cls(graph=graph, name=name, check=check,
                   pipelines=pipelines and (bool(cuts) if cuts is not None else can_pipeline(module, seq=seq)),
                   no_tp=tensor_parallel_refusal(graph, module), workload=workload, cuts=cuts)

    def __post_init__(self) -> None:
        text("name", self.name, limit=1024)


@dataclass(slots=True)
class Searched:
    """What a pipeline search found: the cost model it priced with, the chosen configuration (simulated, with its
    runners-up, best first), it as a `Plan` (with the subject's workload), the baselines as plans (None where the
    batch does not divide), why the runtime would refuse the plan (None: it can run it), whether the search was
    stopped early, and the seconds it took."""

    model: PipelineModel
    chosen: Found
    plan: Plan
    baselines: dict[str, Plan | None]
    not_runnable: str | None
    interrupted: bool
    seconds: float
    # with ``runnable_only``: the whole space's best plan where the runtime cannot run it and it is faster than
    # ``plan`` (its ``not_runnable`` says why); None otherwise
    faster: Searched | None = None

    @property
    def fits(self) -> bool:
        return self.chosen.result.estimate.memory.fits


def search_pipeline(
    subject: Subject, cluster: Cluster, options: SearchOptions, *,
    progress: Callable[[str], None] | None = None, should_stop: Callable[[], bool] = lambda: False,
    started: float | None = None, profile=None,  # noqa: ANN001
) -> Searched:
    """Search ``subject``'s plans on ``cluster`` (sized to the devices used) as the module docstring says;
    ``should_stop`` ends the search early, keeping the best plan found so far. ``Searched.seconds`` count from
    ``started`` (a `time.perf_counter` reading; default: this call) to the end of the simulation. ``profile``
    (an `autopar.profiling.ProfileDB`): layers it measured are priced by its times."""
    start = time.perf_counter() if started is None else started
    with gc_paused():
        if not options.runnable_only or options.search in BASELINE_SEARCHES:
            return _search_pipeline(subject, cluster, options, progress=progress, should_stop=should_stop,
                                    start=start, profile=profile)
        free = _search_pipeline(subject, cluster, replace(options, runnable_only=False), progress=progress,
                                should_stop=should_stop, start=start, profile=profile)
        if (free.fits and free.not_runnable is None) or should_stop():
            return free  # the best plan runs (or the user stopped the search: the best so far, its note says why)
        if progress is not None:
            progress("the best plan cannot run: searching the plans autopar can run")
        left = max(options.budget_s - (time.perf_counter() - start), 1.0)
        limited = _search_pipeline(subject, cluster, replace(options, budget_s=left), progress=progress,
                                   should_stop=should_stop, start=start, profile=profile, model=free.model)
        if free.fits and limited.fits and (free.chosen.result.estimate.iteration_seconds
                                           < limited.chosen.result.estimate.iteration_seconds):
            limited.faster = free
        return limited


def _search_pipeline(subject: Subject, cluster: Cluster, options: SearchOptions, *,
                     progress: Callable[[str], None] | None, should_stop: Callable[[], bool], start: float,
                     profile, model: PipelineModel | None = None) -> Searched:  # noqa: ANN001
    """One search as the module docstring says; ``model``: the cost model of an earlier search of the same
    subject and options, whose prices (its caches of stages and layers) this one reuses."""
    if model is None:
        precision = Precision.of(options.dtype, optimizer=options.optimizer)
        model = PipelineModel(subject.graph, cluster, traced_batch=1, dtype=options.dtype, kernels=options.kernels,
                              screen=True, precision=precision, profile=profile)  # searches: the closed form
    limit = _limit(subject.pipelines, options.kernels, subject.no_tp, cuts=subject.cuts, rows=model.layers,
                   global_batch=options.batch)
    found = pipeline_searches(model, options.search, global_batch=options.batch, time_limit=options.budget_s,
                              progress=progress, should_stop=should_stop,
                              limit=limit if options.runnable_only else None, seed=options.seed)
    interrupted = should_stop()
    if progress is not None:
        progress("simulating the best plans")

    def typed(kind: str, f: Found) -> Plan:
        return pipeline_plan(model, f, name=subject.name, kind=kind, global_batch=options.batch)

    # the plan most likely to be chosen (the search's best on the closed form) is checked on the model while the
    # finalists are simulated, on the core the simulation leaves; it is used only if simulation chooses it too
    early = _check_beside(subject, options, found.get(options.search), typed, limit)
    try:
        found = simulated(model, found, global_batch=options.batch, own=options.search)
        seconds = time.perf_counter() - start
        chosen = found[options.search]
        if chosen is None:
            raise FieldError("batch", f"{options.batch} does not divide over the {cluster.num_devices} devices: no "
                             f"{options.search} plan exists for it")
        baselines = {k: (typed(k, f) if f is not None else None) for k, f in found.items() if k != options.search}
        chosen, refused = _runnable_choice(subject, options, chosen, typed, limit, early=early)
    finally:
        if early is not None:
            early[1].cancel()  # a no-op where its result was taken
    chosen = with_timeline(model, chosen, options.batch)  # a runner-up promoted: its timeline
    plan = typed(options.search, chosen)
    if subject.workload is not None:
        plan = plan.with_workload(subject.workload)
    log.info("%s plan for %s found in %.1f s (%d configurations priced)", options.search, subject.name, seconds,
             chosen.evaluated)
    return Searched(model=model, chosen=chosen, plan=plan, baselines=baselines, not_runnable=refused,
                    interrupted=interrupted, seconds=seconds)


def _limit(pipelines: bool, kernels: str, no_tp: str | None, *, cuts: frozenset[int] | None = None,
           rows: list[Any] = (), global_batch: int | None = None) -> Callable[[Any], str | None]:
    """Why `autopar run` cannot run a configuration (`runtime_limit`), tp > 1 included where the model cuts the
    output of a projection tp would split (``no_tp``), and a stage starting at a row of ``rows`` where the model's
    forward cannot be cut (one not in ``cuts``)."""
    def limit(config: Any) -> str | None:
        if no_tp is not None and any(s.tp > 1 for s in config.stages):
            return no_tp
        if cuts is not None:
            wrong = next((s.start for s in config.stages[1:] if s.start not in cuts), None)
            if wrong is not None:
                return (f"the model's forward cannot be cut before {rows[wrong].name!r}: the stages either side "
                        "would hand each other more than one value")
        return runtime_limit(config, pipelines=pipelines, kernels=kernels, global_batch=global_batch)

    return limit


def refusal(plan: Plan, *, source: ModelSource | None = None) -> str | None:
    """Why the runtime would refuse ``plan`` for its model, or None: the runtime's own checks
    (`runtime.check_runnable`), with a single-stage plan applied and stepped once on a fake process group of its
    full size, so that a plan fails when it is planned rather than after ranks start. ``source``: the model (default:
    the one the plan's workload names)."""
    from autopar.runtime.validate import check_runnable

    try:
        check_runnable(plan, source=source)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def can_pipeline(module: nn.Module, *, seq: int = 0, rows: list[str] | None = None) -> bool:
    """Whether the runtime can cut ``module`` into pipeline stages (`autopar.runtime.pipeline.chain_kind`) that
    compute what its forward does at sequence length ``seq`` (`check_stage_forward`); a model of one's own, whether
    its forward traced at its profile ``rows`` can be cut somewhere (`autopar.runtime.chain.cut_points`)."""
    from autopar.runtime.chain import can_cut
    from autopar.runtime.pipeline import chain_kind, check_stage_forward

    if chain_kind(module) == "fx":
        return rows is not None and can_cut(module, rows)
    try:
        check_stage_forward(module, seq=seq)
    except NotImplementedError:
        return False
    return True


def _check_beside(subject: Subject, options: SearchOptions, favourite: Found | None,
                  typed: Callable[[str, Found], Plan], limit: Callable[[Any], str | None]) -> tuple[Any, Beside] | None:
    """``subject.check`` of the ``favourite`` configuration's plan started beside this process (`beside`), as
    (its configuration, the job); None where `_runnable_choice` would not check it (it does not fit, or ``limit``
    refuses it)."""
    if favourite is None or not favourite.result.estimate.memory.fits or limit(favourite.config):
        return None
    plan = _with_workload(subject, typed(options.search, favourite))
    return favourite.config, beside(lambda: subject.check(plan))


def _with_workload(subject: Subject, plan: Plan) -> Plan:
    return plan.with_workload(subject.workload) if subject.workload is not None else plan


def _runnable_choice(subject: Subject, options: SearchOptions, chosen: Found, typed: Callable[[str, Found], Plan],
                     limit: Callable[[Any], str | None], *,
                     early: tuple[Any, Beside] | None = None) -> tuple[Found, str | None]:
    """The search's plan and why the runtime would refuse it (or None). A fitting plan is checked on the model
    itself (``subject.check``); with ``runnable_only`` the runners-up are tried in order when it would be refused,
    and when none can run the answer is an error naming the reason, never a plan that fails on the ranks.
    ``early``: a configuration whose check was started before (`_check_beside`); its result stands for the check
    of that configuration (the caller cancels it where no plan of it is checked)."""
    if not chosen.result.estimate.memory.fits:
        return chosen, limit(chosen.config)  # not offered to run: the coarse reason is enough
    reasons = []
    for found in [chosen, *chosen.runners_up] if options.runnable_only else [chosen]:
        if not found.result.estimate.memory.fits:
            continue
        reason = limit(found.config)
        if reason is None and early is not None and found.config == early[0]:
            reason = early[1].result()
        elif reason is None:
            reason = subject.check(_with_workload(subject, typed(options.search, found)))
        if reason is None:
            return (_promoted(found, chosen) if found is not chosen else chosen), None
        reasons.append(reason)
    if options.runnable_only:
        raise ValueError(f"none of the {len(reasons)} best fitting plans found can run on {subject.name}: "
                         f"{reasons[0]}")
    return chosen, reasons[0]


def _promoted(found: Found, chosen: Found) -> Found:
    """A runner-up taking the chosen plan's place: the search's figures carry over."""
    rest = [f for f in chosen.runners_up if f is not found]
    return replace(found, evaluated=chosen.evaluated, runners_up=rest, by=chosen.by, converged=chosen.converged)


def simulated(model: PipelineModel, found: dict[str, Found | None], *, global_batch: int,
              own: str) -> dict[str, Found | None]:
    """The searches rank configurations by the closed form (``model`` screens); what a user sees is simulated.
    Each search's plan and runners-up (the best of the other layouts it priced) are re-priced by the simulator;
    the best simulated of them becomes the plan, the others its runners-up, one per layout, best first. For auto,
    whose space holds the baselines (the Megatron grid is its first step, DP and FSDP are single-stage points), they
    are candidates too: its plan is never slower than a baseline it beat on the screen.
    A configuration the simulator refuses (an interleaved micro-batch count torch's schedule refuses) drops out;
    a baseline left with none is n/a, the search's own an error."""
    priced = _repriced(model, found, global_batch)
    result: dict[str, Found | None] = {}
    for kind, f in found.items():
        ranked, reasons = priced[kind]
        others = [c for k, (cs, _) in priced.items() if k != own for c in cs[:1]] if kind == own == "auto" else []
        candidates = ranked + others
        if not candidates:
            if reasons and kind == own:
                raise ValueError(f"the {kind} plan cannot be simulated: {reasons[0]}")
            result[kind] = None
            continue
        best = min(candidates, key=lambda c: score(c.result))  # ties keep the search's order
        # the search that found it: the search's own (a runner-up that is one of auto's searches' own best names
        # it), or the baseline that won on simulation (auto)
        by = (best.by or f.by) if best in ranked else next(k for k, (cs, _) in priced.items() if cs and cs[0] is best)
        seen, rest = {shape(best.config)}, []
        for c in ranked:
            if c is not best and shape(c.config) not in seen:
                seen.add(shape(c.config))
                rest.append(c)
        result[kind] = replace(with_timeline(model, best, global_batch), evaluated=f.evaluated, runners_up=rest,
                               by={"megatron": "grid"}.get(by, by), converged=f.converged)
    return result


def with_timeline(model: PipelineModel, found: Found, global_batch: int) -> Found:
    """``found`` with its simulated timeline, simulated again where a worker priced it (`_repriced`)."""
    if found.result.simulation is not None:
        return found
    return replace(found, result=model.estimate(found.config, global_batch=global_batch, simulate=True))


def _repriced(model: PipelineModel, found: dict[str, Found | None],
              global_batch: int) -> dict[str, tuple[list[Found], list[str]]]:
    """Per search, its plan and runners-up simulated, best first, and why any could not be. Each configuration is
    simulated once, side by side in worker processes where there are cores for it (`share_out`), the longest
    first; a worker sends back the estimate without its timeline (a timeline of a 1,000-layer FSDP plan is
    200,000 tasks, as slow to send as to simulate), which `with_timeline` simulates again for the plans kept."""
    configs: dict[PipelineConfig, int] = {}
    for f in found.values():
        for c in (f, *f.runners_up) if f is not None else ():
            configs.setdefault(c.config, len(configs))
    listed = list(configs)

    def work(config: PipelineConfig, _stop: Callable[[], bool], _left: int) -> PipelineEstimate | str:
        try:
            priced = model.estimate(config, global_batch=global_batch, simulate=True)
        except ValueError as exc:
            return str(exc)
        if not in_worker():
            return priced
        return replace(priced, stages=[replace(s, parts=None) for s in priced.stages], simulation=None)

    def tasks(config: PipelineConfig) -> int:  # about how many the simulator makes: per unit where ZeRO cuts them
        rows = sum(s.end - s.start for s in config.stages) if config.zero else len(config.stages)
        return global_batch // config.micro_batch * rows

    estimates, _ = share_out(listed, work, order=sorted(range(len(listed)), key=lambda i: -tasks(listed[i])))
    result = {}
    for kind, f in found.items():
        priced, reasons = [], []
        for c in (f, *f.runners_up) if f is not None else ():
            estimate = estimates[configs[c.config]]
            if isinstance(estimate, str):
                reasons.append(estimate)
            else:
                priced.append(replace(c, result=estimate, runners_up=[]))
        result[kind] = (sorted(priced, key=lambda c: score(c.result)), reasons)
    return result

