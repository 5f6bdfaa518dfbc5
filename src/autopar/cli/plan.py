"""``autopar plan MODEL``: search a parallel plan, compare it with the usual choices, and save it."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from autopar.api.report import comparison, entry, pipeline_report, recomputed_text, render_pipeline, title
from autopar.api.search import (  # noqa: F401 - simulated: bench/pipeline.py reads it here
    PIPELINE_SEARCHES, SearchOptions, Subject, refusal, search_pipeline, simulated,
)
from autopar.capture import trace
from autopar.cli.common import (
    MAX_BUDGET_S, MAX_DEVICES, add_kernels_argument, add_model_arguments, add_profile_argument,
    bounded_int, bounded_seconds, check_out, load_and_trace, load_profile, mesh_shape, model_overrides, profile_data,
)
from autopar.cli.fit import advice_text, fit_advice, summary
from autopar.cli.render import Outcome, estimate_text, profile_line, table
from autopar.cli.timeline import check_timeline, timeline_data, write_timeline
from autopar.report import check_report, plan_report, write_report
from autopar.cluster import load_cluster
from autopar.plan import FieldError, Plan, Workload, save_plan
from autopar.cost.pipeline import PipelineModel
from autopar.search import BASELINES, plan_intra
from autopar.search.intra import ZERO_STAGES, IntraPlan, fit_by_recomputing, measured_share

SEARCHES = (*PIPELINE_SEARCHES, "ilp")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search a parallel plan and compare it with pure DP, FSDP and the best Megatron configuration",
        description="Trace MODEL once and search pipeline stages (uneven allowed), each stage's dp x tp, per-layer "
        "recomputation, the micro-batch and the ZeRO stage with the pipeline cost model (Megatron grid, then "
        "Aceso's bottleneck search, then MCMC), each search stopping once it converges; or, with --search ilp, the "
        "intra-op space on one mesh. Prints the plan, its "
        "estimate and the baselines priced by the same cost model. Ctrl-C keeps the best plan found so far.",
    )
    add_model_arguments(parser)
    parser.add_argument("--cluster", default="a100-80g-sxm", help="preset name or cluster file (default a100-80g-sxm)")
    parser.add_argument("--gpus", type=bounded_int(MAX_DEVICES), help="devices used (default: the product of --mesh)")
    parser.add_argument("--mesh", help="with --search ilp: mesh shape, e.g. 8 or 2x4 (default: one axis, or nodes x "
                        "devices per node when --gpus spans nodes)")
    parser.add_argument(
        "--search", choices=SEARCHES, default="auto",
        help="auto (default): Megatron grid, then Aceso's bottleneck search over pipeline depths, then MCMC chains "
        "from the best of both and pure DP, keeping the best; aceso; mcmc (FlexFlow's Metropolis-Hastings search, "
        "seeded from the grid and pure DP); exhaustive (small models); megatron, dp, fsdp: one baseline; ilp: the "
        "intra-op programme on one --mesh, no pipeline",
    )
    parser.add_argument("--budget-s", type=bounded_seconds(MAX_BUDGET_S), default=60.0,
                        help="upper bound on the search time in seconds (default 60, at most a day): pipeline "
                        "searches stop sooner once they converge")
    parser.add_argument("--seed", type=bounded_int(2**31 - 1, least=0), default=0,
                        help="seed of the MCMC chains (auto, mcmc; default 0): a seed gives the same plan whenever "
                        "the search converges within its budget")
    add_kernels_argument(parser)
    add_profile_argument(parser)
    runnable = parser.add_mutually_exclusive_group()
    runnable.add_argument("--runnable", action="store_true",
                          help="the default for pipeline searches: offer only plans `autopar run` can run on this "
                          "model (one dp x tp grid for every stage, Megatron's layouts), checked on the model; a "
                          "faster plan it cannot run is named beside it")
    runnable.add_argument("--allow-unrunnable", action="store_true",
                          help="offer the fastest plan whatever `autopar run` can run (intra-op stages, say); such a "
                          "plan says why it cannot run (`not_runnable`)")
    parser.add_argument("--out", help="write the plan and its estimate to this JSON file")
    parser.add_argument("--timeline", metavar="FILE",
                        help="pipeline searches: draw the plan's simulated iteration per device to FILE (.svg or "
                        ".png; needs matplotlib)")
    parser.add_argument("--report", metavar="FILE.html",
                        help="pipeline searches: write one self-contained HTML page with the stages, the simulated "
                        "timeline, memory per stage and the runners-up and baselines (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def _default_mesh(args: argparse.Namespace, per_node: int) -> tuple[int, ...]:
    if args.mesh or args.gpus is None or args.gpus <= per_node or args.gpus % per_node:
        return mesh_shape(args.mesh, args.gpus)
    return (args.gpus // per_node, per_node)


def run(args: argparse.Namespace) -> dict[str, Any] | str | Outcome:
    check_out(args)  # before any trace or search: a path that cannot be written fails now, not after the search
    check_timeline(args.timeline)
    check_report(args.report)
    if args.search == "ilp" and args.report:
        raise ValueError("--report shows a pipeline plan's stages and simulated iteration; --search ilp plans one mesh "
                         "without a pipeline: leave --report out or choose a pipeline search")
    if args.search == "ilp" and args.timeline:
        raise ValueError("--timeline draws a pipeline plan's simulated iteration; --search ilp plans one mesh without "
                         "a pipeline: leave --timeline out or choose a pipeline search")
    if args.search != "ilp":
        if args.mesh:
            raise ValueError("--mesh applies to --search ilp; pipeline searches choose each stage's dp x tp")
        return run_pipeline(args)
    base = load_cluster(args.cluster)
    shape = _default_mesh(args, base.devices_per_node)
    cluster = base.with_devices(math.prod(shape))
    # intra-op layouts are priced op by op: a profile database's op times (autopar profile-ops) apply, its layer
    # times (profile-segments, Megatron's layouts as the runtime applies them) do not
    profile, cluster = load_profile(args, cluster)
    ops = profile.op_times(ranks=cluster.ranks_per_host, dtype=args.dtype) or None if profile is not None else None
    zoo = _load(args).zoo
    start = time.perf_counter()
    show = sys.stderr.isatty() and not args.json
    found, interrupted = _anytime_intra(args, zoo, cluster, shape, _progress(show, start), ops=ops)
    seconds = time.perf_counter() - start
    if show:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    chosen = found.get(args.search)
    if chosen is None and interrupted:  # stopped before the programme's first plan: the best baseline so far
        chosen = min((p for p in found.values() if p is not None), key=_rank_intra, default=None)
        if chosen is None:
            raise KeyboardInterrupt
    if chosen is None:
        mesh = "x".join(map(str, shape))
        if any(p is not None for p in found.values()):  # the baselines divide the batch: the solver ran out of time
            raise ValueError(f"no {args.search} plan found for --batch {args.batch} on mesh {mesh} within "
                             f"--budget-s {args.budget_s:g}: the solver had no solution yet; raise --budget-s")
        raise ValueError(
            f"no {args.search} plan exists for --batch {args.batch} on mesh {mesh}: "
            "the batch does not divide over the devices"
        )
    name = zoo.config.name
    fits = chosen.estimate.memory.fits
    work = workload(args, zoo)
    plan = chosen.to_plan(name).with_workload(work)  # built once: reported, written and checked
    progress = _progress(show, start)
    if fits:  # seconds on a 3-D mesh, after Ctrl-C too: a second one stops it (exit 130)
        progress(f"checking that the plan runs: applying it on a fake process group of {plan.devices} ranks")
    reason = refusal(plan) if fits else None
    faster = None
    if reason and not args.allow_unrunnable:  # the fastest plan that runs, and this one named
        options = [p for p in found.values() if p is not None and p is not chosen]
        # the programme again, within what the runtime runs (not after Ctrl-C: the plans found so far)
        if chosen.zero > 2 and args.search == "ilp" and not interrupted:
            again, _ = _anytime_intra(args, zoo, cluster, shape, progress, kinds=("ilp",),
                                      zero_stages=(0, 1, 2), ops=ops)
            options += [p for p in again.values() if p is not None]
        dp = found.get("dp")
        if dp is not None and args.search == "ilp":
            # data parallelism with its model states sharded, and as many layers recomputed as it needs to fit
            for zero in (1, 2, 3):  # (only plans that fit are offered)
                again, priced = fit_by_recomputing(dp.space, dp.choice, zero, dp.micro_batches, args.batch,
                                                   args.dtype)
                if priced.memory.fits:
                    options.append(IntraPlan("dp", dp.space, dp.choice, zero, dp.micro_batches, dp.micro_batch_size,
                                             priced, recompute=again))
        tried = 1
        for other in sorted((p for p in options if p.estimate.memory.fits), key=_rank_intra):
            offered = other.to_plan(name).with_workload(work)
            progress(f"the plan cannot run: checking the next fastest ({other.kind}, ZeRO {other.zero})")
            tried += 1
            if refusal(offered) is None:
                faster = {**entry(plan), "not_runnable": reason,
                          "vs_plan": chosen.estimate.iteration_seconds / other.estimate.iteration_seconds}
                chosen, plan, reason = other, offered, None
                break
        if reason:  # no plan that fails on the ranks is offered: the fastest one's reason, and how to see it anyway
            if show:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
            raise ValueError(f"none of the {tried} fitting plans found on mesh {'x'.join(map(str, shape))} can run "
                             f"on {name}; the fastest ({chosen.kind}): {reason} (--allow-unrunnable writes it "
                             "with that reason)")
    if show:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    baselines = {kind: (entry(p.to_plan(name)) if p is not None else None)
                 for kind, p in found.items() if p is not chosen}
    data = _result(args, zoo, cluster, params=chosen.space.graph.num_params, plan=plan,
                   baselines=baselines, seconds=seconds, fits=fits)
    data["interrupted"] = interrupted
    data["not_runnable"] = reason
    data["faster_unrunnable"] = faster
    if profile is not None:
        data["profile"] = {"db": profile.path, "device": profile.device, "measured_share": measured_share(chosen),
                           "root_units_measured": 0}
    if chosen.solution is not None:
        data["solver"] = {"optimal": chosen.solution.optimal, "seconds": chosen.solution.seconds,
                          "status": chosen.solution.status}
    if fits:
        return data if args.json else render(data, out=args.out)
    model = PipelineModel(chosen.space.graph, cluster, traced_batch=chosen.micro_batch_size, dtype=args.dtype,
                          kernels=args.kernels)
    data["fit"] = fit_advice(model, None, global_batch=args.batch, memory=chosen.estimate.memory)
    return _no_fit(args, data, render(data, out=None))


def _anytime_intra(args: argparse.Namespace, zoo: Any, cluster: Any, shape: tuple[int, ...], progress: Any, *,
                   kinds: tuple[str, ...] = (*BASELINES, "ilp"),
                   zero_stages: tuple[int, ...] = ZERO_STAGES, ops: Any = None) -> tuple[dict[str, Any], bool]:
    """The intra-op search, the quick baselines first; Ctrl-C ends it at the next step, keeping the best plan of
    each kind found so far (a solve under way finishes first, within its share of the budget; a second Ctrl-C
    interrupts at once). The solver stays in this thread: HiGHS cannot be stopped mid-solve, and one left running
    in a worker thread aborted the process at exit. (plans, whether interrupted)"""
    with _stop_on_interrupt() as stop:
        found = plan_intra(
            lambda size: trace(zoo.module, example_kwargs=zoo.inputs_at(size)),
            cluster, shape, global_batch=args.batch, dtype=args.dtype, kinds=kinds,
            time_limit=args.budget_s, progress=progress, should_stop=stop.is_set, kernels=args.kernels,
            zero_stages=zero_stages, ops=ops,
        )
    return found, stop.is_set()


@contextlib.contextmanager
def _stop_on_interrupt() -> Iterator[threading.Event]:
    """An event Ctrl-C sets (the search then stops at its next step with its best plan); a second Ctrl-C raises
    KeyboardInterrupt as usual. Outside the main thread signals cannot be handled: the event is never set."""
    stop = threading.Event()

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handle) if threading.current_thread() is threading.main_thread() else None
    try:
        yield stop
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _rank_intra(plan: Any) -> tuple:
    e = plan.estimate
    return (not e.memory.fits, e.iteration_seconds if e.memory.fits else e.memory.total)


def _no_fit(args: argparse.Namespace, data: dict[str, Any], text: str) -> Outcome:
    """Exit status 3: the least-over plan, printed with what is missing and what would make it fit; not written."""
    lines = [text, "", *advice_text(data["fit"], cluster=data["cluster"], what="the least-over plan")]
    if args.out:
        lines += ["", f"plan not written to {args.out}: it does not fit"]
    message = f"no plan fits {data['gpus']} x {data['cluster']}: the least-over needs {summary(data['fit'])}"
    return Outcome(data if args.json else "\n".join(lines), 3, message)



def _result(
    args: argparse.Namespace, zoo: Any, cluster: Any, *, params: int, plan: Plan, baselines: dict[str, Any],
    seconds: float, fits: bool,
) -> dict[str, Any]:
    """The fields every search reports (CLI.md), with the plan's workload; writes ``--out`` when the plan fits."""
    plan = plan.with_workload(workload(args, zoo))
    if args.out and fits:
        save_plan(args.out, plan)
    return {
        "model": zoo.config.name,
        "config": {**zoo.config.summary(), "seq": zoo.seq, "batch": args.batch},
        "cluster": cluster.name,
        "gpus": cluster.num_devices,
        "search": args.search,
        "params": params,
        **entry(plan),
        "baselines": baselines,
        "search_seconds": seconds,
        "fits": fits,
    }


def _progress(show: bool, start: float):  # noqa: ANN202
    """One status line on stderr, rewritten in place (only on a terminal, never with --json)."""

    def progress(message: str) -> None:
        if show:
            print(f"\r\033[K{message} ({time.perf_counter() - start:.1f} s)", end="", file=sys.stderr, flush=True)

    return progress


def workload(args: argparse.Namespace, zoo: Any) -> Workload:
    """What `autopar run` needs to rebuild the model and its batches (the model as the zoo names it: a file's path
    made absolute)."""
    overrides = model_overrides(args)
    return Workload(model=zoo.config.name, overrides=tuple(sorted(overrides.items())), seq=zoo.seq, batch=args.batch,
                    dtype=args.dtype)


def _checked_on(graph: Any) -> Any:
    """`refusal` of a plan for the model its workload names, whose chain of layers is ``graph`` (the search's own
    trace, not traced again: a 1,000-layer model takes seconds to trace)."""
    from dataclasses import replace

    from autopar.runtime.source import ModelSource
    from autopar.runtime.train import Workload as Rebuilt

    return lambda plan: refusal(plan, source=replace(ModelSource.of_workload(Rebuilt.of(plan)), chain=lambda: graph))


def _load(args: argparse.Namespace):  # noqa: ANN202 - the model and its trace at batch 1 (`load_and_trace`)
    return load_and_trace(args, batch=1)


def run_pipeline(args: argparse.Namespace) -> dict[str, Any] | str | Outcome:
    """The pipeline searches (`autopar.api.search`): trace once at batch 1 (costs scale with the batch), search,
    simulate the best, price the baselines; keep to plans `autopar run` can run unless --allow-unrunnable."""
    if args.gpus is None:
        raise ValueError("give --gpus N")
    traced = _load(args)
    zoo = traced.zoo
    cluster = load_cluster(args.cluster).with_devices(args.gpus)
    profile, cluster = load_profile(args, cluster)
    start = time.perf_counter()
    show = sys.stderr.isatty() and not args.json
    graph = traced.graph
    work = workload(args, zoo)
    subject = Subject.of(graph, zoo.module, name=zoo.config.name, check=_checked_on(graph), workload=work)
    options = SearchOptions(search=args.search, batch=args.batch, budget_s=args.budget_s,
                            runnable_only=not args.allow_unrunnable, kernels=args.kernels, dtype=args.dtype,
                            seed=args.seed)
    with _stop_on_interrupt() as stop:  # Ctrl-C ends the search, keeping the best plan
        try:
            searched = search_pipeline(subject, cluster, options, progress=_progress(show, start),
                                       should_stop=stop.is_set, started=start, profile=profile)
        except FieldError as exc:
            if exc.field != "batch":
                raise
            raise ValueError(f"no {args.search} plan exists for --batch {args.batch} on {args.gpus} devices: the "
                             "batch does not divide over the devices") from None
    if show:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.out and searched.fits:
        save_plan(args.out, searched.plan)
    data = pipeline_report(searched, model=zoo.config.name, cluster=cluster, params=graph.num_params,
                           config={**zoo.config.summary(), "seq": zoo.seq, "batch": args.batch})
    data["timeline"] = timeline_data(searched.chosen.result.simulation)
    if profile is not None:
        data["profile"] = profile_data(profile, searched.model, searched.chosen.config, global_batch=args.batch)
    if args.timeline:
        write_timeline(searched.chosen.result.simulation, args.timeline, title=title(data))
    if args.report:
        write_report(args.report, plan_report(data, simulation=searched.chosen.result.simulation))
    written = f"\nreport written to {args.report}" if args.report else ""
    if searched.fits:
        return data if args.json else render_pipeline(data, out=args.out, timeline=args.timeline) + written
    data["fit"] = fit_advice(searched.model, searched.chosen.config, global_batch=args.batch,
                             memory=searched.chosen.result.estimate.memory)
    return _no_fit(args, data, render_pipeline(data, out=None) + written)


def _module_rows(plan: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """One row per leading module; a repeated layer whose rows match the layer before it is folded into a note."""
    layers: dict[str, list[list[str]]] = {}
    for block in plan["blocks"]:
        module = block["module"]
        entry = plan["modules"].get(module, {})
        params = " ".join([*(f"{k.rpartition('.')[2]}:{v}" for k, v in entry.get("params", {}).items()),
                           *(f"reads {k}:{v}" for k, v in entry.get("reads", {}).items())])
        layers.setdefault(block["layer"], []).append(
            [module, block["split"], entry.get("input", ""), entry.get("output", ""), params]
        )
    rows: list[list[str]] = []
    folded: dict[str, int] = {}
    previous: tuple[str, list] | None = None
    for layer, layer_rows in layers.items():
        stem = layer.rpartition(".")[0]
        local = [[r[0].removeprefix(layer + "."), *r[1:]] for r in layer_rows]
        if stem and previous is not None and previous == (stem, local):
            folded[stem] = folded.get(stem, 0) + 1
            continue
        previous = (stem, local)
        rows.extend(layer_rows)
    notes = [f"({n} more {stem}.N layers, each the same as the one before)" for stem, n in folded.items()]
    return rows, notes


def _kind(data: dict[str, Any]) -> str:
    kind, search = data["plan"]["kind"], data["search"]
    return kind if kind == search else f"{kind}, the fastest that runs of --search {search}"


def render(data: dict[str, Any], *, out: str | None = None) -> str:
    plan, e = data["plan"], data["estimate"]
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan["mesh"]["axes"], plan["mesh"]["shape"]))
    rows, notes = _module_rows(plan)
    lines = [
        f"{data['model']} on {data['gpus']} x {data['cluster']}, global batch {data['config']['batch']} x seq "
        f"{data['config']['seq']}: mesh {mesh}",
        f"plan ({_kind(data)}): micro-batch {plan['micro_batch_size']} x {plan['micro_batches']} steps, "
        f"ZeRO {plan['zero']}{recomputed_text(plan.get('recompute', []))}"
        f"{', compiled kernels' if plan.get('kernels') == 'compiled' else ''}; searched in "
        f"{data['search_seconds']:.1f} s"
        + (" (interrupted: best so far)" if data.get("interrupted") else ""),
        *profile_line(data),
        "",
        "modules: split of each leading op per mesh axis, layouts of its input, output and parameters",
        table(["module", "split", "input", "output", "params"], rows, align="lllll"),
        *notes,
        "",
    ]
    if data.get("not_runnable"):
        lines += [f"note: `autopar run` cannot run this plan yet: {data['not_runnable']}", ""]
    faster = data.get("faster_unrunnable")
    if faster:
        lines += [f"note: the fastest plan found, the {faster['plan']['kind']} plan, takes "
                  f"{faster['estimate']['iteration_seconds']:.3f} s ({faster['vs_plan']:.2f}x this plan's time), but "
                  f"`autopar run` cannot run it yet: {faster['not_runnable']} (--allow-unrunnable offers it)", ""]
    lines += [estimate_text(e), ""]
    return "\n".join(lines + comparison(data, out))
