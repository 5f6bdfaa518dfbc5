"""``autopar plan MODEL``: search a parallel plan, compare it with the usual choices, and save it."""

from __future__ import annotations

import argparse
import contextlib
import functools
from dataclasses import replace
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from autopar.capture import trace
from autopar.cli.common import (
    MAX_BUDGET_S, MAX_DEVICES, MODEL_OVERRIDES, add_kernels_argument, add_model_arguments, bounded_int,
    bounded_seconds, check_out, load_and_trace, mesh_shape,
)
from autopar.cli.fit import advice_text, fit_advice, summary
from autopar.cli.render import Outcome, binary_bytes, estimate_text, table
from autopar.cli.timeline import check_timeline, timeline_data, write_timeline
from autopar.report import check_report, plan_report, write_report
from autopar.cluster import load_cluster
from autopar.plan import Plan, Workload, save_plan
from autopar.cost.pipeline import PipelineModel
from autopar.search import BASELINES, plan_intra
from autopar.search.pipeline import Found, pipeline_plan, pipeline_searches, runtime_limit, score, shape

PIPELINE_SEARCHES = ("auto", "aceso", "exhaustive", "megatron", "dp", "fsdp")
SEARCHES = (*PIPELINE_SEARCHES, "ilp")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search a parallel plan and compare it with pure DP, FSDP and the best Megatron configuration",
        description="Trace MODEL once and search pipeline stages (uneven allowed), each stage's dp x tp, per-layer "
        "recomputation, the micro-batch and the ZeRO stage with the pipeline cost model (Megatron grid, then "
        "Aceso's bottleneck search); or, with --search ilp, the intra-op space on one mesh. Prints the plan, its "
        "estimate and the baselines priced by the same cost model. Ctrl-C keeps the best plan found so far.",
    )
    add_model_arguments(parser)
    parser.add_argument("--cluster", default="a100-80g-sxm", help="preset name or cluster file (default a100-80g-sxm)")
    parser.add_argument("--gpus", type=bounded_int(MAX_DEVICES), help="devices used (default: the product of --mesh)")
    parser.add_argument("--mesh", help="with --search ilp: mesh shape, e.g. 8 or 2x4 (default: one axis, or nodes x "
                        "devices per node when --gpus spans nodes)")
    parser.add_argument(
        "--search", choices=SEARCHES, default="auto",
        help="auto (default): Megatron grid, then Aceso's bottleneck search over pipeline depths; aceso; exhaustive "
        "(small models); megatron, dp, fsdp: one baseline; ilp: the intra-op programme on one --mesh, no pipeline",
    )
    parser.add_argument("--budget-s", type=bounded_seconds(MAX_BUDGET_S), default=60.0,
                        help="search time budget in seconds (default 60, at most a day)")
    add_kernels_argument(parser)
    parser.add_argument("--runnable", action="store_true",
                        help="search only plans `autopar run` can run (one dp x tp grid for every stage; pipelines "
                        "under ZeRO 0-1)")
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
    zoo = _load(args).zoo
    start = time.perf_counter()
    show = sys.stderr.isatty() and not args.json
    found, interrupted = _anytime_intra(args, zoo, cluster, shape, _progress(show, start))
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
    baselines = {kind: (_entry(p.to_plan(name)) if p is not None else None)
                 for kind, p in found.items() if kind != args.search}
    fits = chosen.estimate.memory.fits
    plan = chosen.to_plan(name).with_workload(workload(args, zoo))  # built once: reported, written and checked
    data = _result(args, zoo, cluster, params=chosen.space.graph.num_params, plan=plan,
                   baselines=baselines, seconds=seconds, fits=fits)
    data["interrupted"] = interrupted
    data["not_runnable"] = refusal(plan) if fits else None
    if chosen.solution is not None:
        data["solver"] = {"optimal": chosen.solution.optimal, "seconds": chosen.solution.seconds,
                          "status": chosen.solution.status}
    if fits:
        return data if args.json else render(data, out=args.out)
    model = PipelineModel(chosen.space.graph, cluster, traced_batch=chosen.micro_batch_size, dtype=args.dtype,
                          kernels=args.kernels)
    data["fit"] = fit_advice(model, None, global_batch=args.batch, memory=chosen.estimate.memory)
    return _no_fit(args, data, render(data, out=None))


def _anytime_intra(args: argparse.Namespace, zoo: Any, cluster: Any, shape: tuple[int, ...],
                   progress: Any) -> tuple[dict[str, Any], bool]:
    """The intra-op search, the quick baselines first; Ctrl-C ends it at the next step, keeping the best plan of
    each kind found so far (a solve under way finishes first, within its share of the budget; a second Ctrl-C
    interrupts at once). The solver stays in this thread: HiGHS cannot be stopped mid-solve, and one left running
    in a worker thread aborted the process at exit. (plans, whether interrupted)"""
    with _stop_on_interrupt() as stop:
        found = plan_intra(
            lambda size: trace(zoo.module, example_kwargs=zoo.inputs_at(size)),
            cluster, shape, global_batch=args.batch, dtype=args.dtype, kinds=(*BASELINES, "ilp"),
            time_limit=args.budget_s, progress=progress, should_stop=stop.is_set, kernels=args.kernels,
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


def _entry(plan: Plan) -> dict[str, Any]:
    """A plan and its estimate as the CLI prints them (``--json``: ``plan`` and ``estimate``)."""
    return {"plan": plan.to_dict(), "estimate": plan.estimate.to_dict()}


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
        **_entry(plan),
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
    overrides = {field: getattr(args, flag) for flag, field in MODEL_OVERRIDES.items() if getattr(args, flag) is not None}
    return Workload(model=zoo.config.name, overrides=tuple(sorted(overrides.items())), seq=zoo.seq, batch=args.batch,
                    dtype=args.dtype)


def _load(args: argparse.Namespace):  # noqa: ANN202 - the model and its trace at batch 1 (`load_and_trace`)
    return load_and_trace(args, batch=1)


def run_pipeline(args: argparse.Namespace) -> dict[str, Any] | str | Outcome:
    """The pipeline searches: trace once at batch 1 (costs scale with the batch), search, price the baselines."""
    if args.gpus is None:
        raise ValueError("give --gpus N")
    traced = _load(args)
    zoo = traced.zoo
    cluster = load_cluster(args.cluster).with_devices(args.gpus)
    start = time.perf_counter()
    show = sys.stderr.isatty() and not args.json
    progress = _progress(show, start)

    graph = traced.graph
    model = PipelineModel(graph, cluster, traced_batch=1, dtype=args.dtype, kernels=args.kernels,
                          screen=True)  # searches: the closed form
    limit = _runtime_limit(graph, zoo.module, kernels=args.kernels)
    with _stop_on_interrupt() as stop:  # Ctrl-C ends the search, keeping the best plan
        found = pipeline_searches(model, args.search, global_batch=args.batch, time_limit=args.budget_s,
                                  progress=progress, should_stop=stop.is_set, limit=limit if args.runnable else None)
    progress("simulating the best plans")
    found = simulated(model, found, global_batch=args.batch, own=args.search)
    seconds = time.perf_counter() - start
    if show:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    chosen = found[args.search]
    if chosen is None:
        raise ValueError(f"no {args.search} plan exists for --batch {args.batch} on {args.gpus} devices: the batch "
                         "does not divide over the devices")
    name = zoo.config.name

    def typed(kind: str, f: Any) -> Plan:
        return pipeline_plan(model, f, name=name, kind=kind, global_batch=args.batch)

    baselines = {k: (_entry(typed(k, f)) if f is not None else None) for k, f in found.items() if k != args.search}
    chosen, refused = _runnable_choice(args, zoo, chosen, typed, limit)
    fits = chosen.result.estimate.memory.fits
    data = _result(args, zoo, cluster, params=graph.num_params, plan=typed(args.search, chosen),
                   baselines=baselines, seconds=seconds, fits=fits)
    data.update(configurations_priced=chosen.evaluated, interrupted=stop.is_set(),
                runners_up=[_layout(f, chosen) for f in chosen.runners_up],
                not_runnable=refused,  # why `autopar run` refuses it, or null
                timeline=timeline_data(chosen.result.simulation))
    if args.timeline:
        write_timeline(chosen.result.simulation, args.timeline, title=_title(data))
    if args.report:
        write_report(args.report, plan_report(data, simulation=chosen.result.simulation))
    written = f"\nreport written to {args.report}" if args.report else ""
    if fits:
        return data if args.json else render_pipeline(data, out=args.out, timeline=args.timeline) + written
    data["fit"] = fit_advice(model, chosen.config, global_batch=args.batch, memory=chosen.result.estimate.memory)
    return _no_fit(args, data, render_pipeline(data, out=None) + written)


def refusal(plan: Plan) -> str | None:
    """Why `autopar run` would refuse ``plan`` for its model, or None: the runtime's own checks
    (`runtime.check_runnable`), with a single-stage plan applied and stepped once on a fake process group of its
    full size, so that a plan fails when it is planned rather than after ranks start."""
    from autopar.runtime.validate import check_runnable

    try:
        check_runnable(plan)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def _runnable_choice(args: argparse.Namespace, zoo: Any, chosen: Any, typed: Any, limit: Any) -> tuple[Any, str | None]:
    """The search's plan and why `autopar run` would refuse it (or None). A fitting plan is checked on the model
    itself (`refusal`); with ``--runnable`` the runners-up are tried in order when it would be refused, and when
    none can run the answer is an error naming the reason, never a plan that fails on the ranks."""
    if not chosen.result.estimate.memory.fits:
        return chosen, limit(chosen.config)  # not offered to run: the coarse reason is enough
    work = workload(args, zoo)
    reasons = []
    for found in [chosen, *chosen.runners_up] if args.runnable else [chosen]:
        if not found.result.estimate.memory.fits:
            continue
        reason = limit(found.config) or refusal(typed(args.search, found).with_workload(work))
        if reason is None:
            return (_promoted(found, chosen) if found is not chosen else chosen), None
        reasons.append(reason)
    if args.runnable:
        raise ValueError(f"none of the {len(reasons)} best fitting plans found can run on {args.model}: "
                         f"{reasons[0]}")
    return chosen, reasons[0]


def _promoted(found: Any, chosen: Any) -> Any:
    """A runner-up taking the chosen plan's place: the search's figures carry over."""
    from dataclasses import replace

    rest = [f for f in chosen.runners_up if f is not found]
    return replace(found, evaluated=chosen.evaluated, runners_up=rest)


def simulated(model: PipelineModel, found: dict[str, Found | None], *, global_batch: int,
              own: str) -> dict[str, Found | None]:
    """The searches rank configurations by the closed form (``model`` screens); what a user sees is simulated.
    Each search's plan and runners-up (the best of the other layouts it priced) are re-priced by the simulator;
    the best simulated of them becomes the plan, the others its runners-up, one per layout, best first. For auto,
    whose space holds the baselines (the Megatron grid is its first step, DP and FSDP are single-stage points), they
    are candidates too: its plan is never slower than a baseline it beat on the screen.
    A configuration the simulator refuses (an interleaved micro-batch count torch's schedule refuses) drops out;
    a baseline left with none is n/a, the search's own an error."""
    priced = {kind: _repriced(model, f, global_batch) for kind, f in found.items()}
    result: dict[str, Found | None] = {}
    for kind, f in found.items():
        ranked, reasons = priced[kind]
        candidates = ranked + ([c for k, (cs, _) in priced.items() if k != own for c in cs[:1]]
                               if kind == own == "auto" else [])
        if not candidates:
            if reasons and kind == own:
                raise ValueError(f"the {kind} plan cannot be simulated: {reasons[0]}")
            result[kind] = None
            continue
        best = min(candidates, key=lambda c: score(c.result))  # ties keep the search's order
        seen, rest = {shape(best.config)}, []
        for c in ranked:
            if c is not best and shape(c.config) not in seen:
                seen.add(shape(c.config))
                rest.append(c)
        result[kind] = replace(best, evaluated=f.evaluated, runners_up=rest)
    return result


def _repriced(model: PipelineModel, found: Found | None, global_batch: int) -> tuple[list[Found], list[str]]:
    """``found`` and its runners-up simulated, best first, and why any could not be."""
    priced, reasons = [], []
    for c in (found, *found.runners_up) if found is not None else ():
        try:
            priced.append(replace(c, result=model.estimate(c.config, global_batch=global_batch, simulate=True),
                                  runners_up=[]))
        except ValueError as exc:
            reasons.append(str(exc))
    return sorted(priced, key=lambda c: score(c.result)), reasons


def _title(data: dict[str, Any]) -> str:
    plan = data["plan"]
    grids = ", ".join(dict.fromkeys(f"{s['dp']} x {s['tp']}" for s in plan["stages"]))
    return (f"{data['model']} on {data['gpus']} x {data['cluster']}: {data['search']} plan, "
            f"{_count(len(plan['stages']), 'stage')} (dp x tp {grids}), micro-batch {plan['micro_batch_size']} x {plan['micro_batches']}, ZeRO "
            f"{plan['zero']}, {plan['schedule']}")


def _runtime_limit(graph: Any, module: Any, *, kernels: str) -> Any:
    """Why `autopar run` cannot run a configuration of this model (`runtime_limit`), tp > 1 included where the
    model cuts the output of a projection tp would split (`runtime.validate.tensor_parallel_refusal`)."""
    from autopar.runtime.validate import tensor_parallel_refusal

    shaped = functools.partial(runtime_limit, pipelines=_can_pipeline(module), kernels=kernels)
    no_tp = tensor_parallel_refusal(graph, module)
    if no_tp is None:
        return shaped
    return lambda config: no_tp if any(s.tp > 1 for s in config.stages) else shaped(config)


def _can_pipeline(module: Any) -> bool:
    from autopar.runtime.pipeline import chain_kind

    try:
        chain_kind(module)
    except NotImplementedError:
        return False
    return True


def _layout(found: Any, chosen: Any) -> dict[str, Any]:
    """A runner-up in a line: its layout and how it compares with the chosen plan."""
    c, e = found.config, found.result.estimate
    return {
        "pp": c.pp, "dp_x_tp": [[s.dp, s.tp] for s in c.stages],  # per stage
        "intra": [s.intra for s in c.stages],  # per stage: layers laid out by the intra-op planner
        "micro_batch_size": c.micro_batch, "zero": c.zero,
        "sp": c.sp, "schedule": c.schedule, "recomputed_layers": sum(len(s.recomputed_rows()) for s in c.stages),
        "iteration_seconds": e.iteration_seconds, "fits": e.memory.fits,
        "vs_plan": e.iteration_seconds / chosen.result.estimate.iteration_seconds,
    }


def render_pipeline(data: dict[str, Any], *, out: str | None = None, timeline: str | None = None) -> str:
    plan, e = data["plan"], data["estimate"]
    rows = []
    for k, stage in enumerate(plan["stages"]):
        layers = [name or "<root>" for name in stage["layers"]]  # the root's own ops: the loss
        span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)} rows)"
        recompute = ", ".join(f"{n}:{v[0]}" for n, v in list(stage["recompute"].items())[:3])
        if len(stage["recompute"]) > 3:
            recompute += f" (+{len(stage['recompute']) - 3} more)"
        segments = stage.get("segments", [])
        if segments:  # runs checkpointed together: the outermost spans
            recompute = ", ".join(filter(None, [recompute, _count(len(segments), "checkpointed run")]))
        grid = f"{stage['dp']} x {stage['tp']}" + (" intra" if stage.get("layouts") else "")
        rows.append([str(k), span, grid, f"{stage['seconds_per_micro_batch'] * 1e3:.1f} ms",
                     binary_bytes(stage["memory"]["total"]), recompute or "-"])
    lines = [
        f"{data['model']} on {data['gpus']} x {data['cluster']}, global batch {data['config']['batch']} x seq "
        f"{data['config']['seq']}",
        f"plan ({data['search']}): {_count(len(plan['stages']), 'pipeline stage')}, micro-batch "
        f"{plan['micro_batch_size']} x {plan['micro_batches']}, ZeRO {plan['zero']}, {plan['schedule']}"
        f"{', compiled kernels' if plan.get('kernels') == 'compiled' else ''}; "
        f"{_count(data['configurations_priced'], 'configuration')} priced in {data['search_seconds']:.1f} s"
        + (" (interrupted: best so far)" if data["interrupted"] else ""),
        "",
        table(["stage", "layers", "dp x tp", "per micro-batch", "memory", "recomputed (s: selective, f: full)"], rows,
              align="rlrrrl"),
        "",
    ]
    laid_out = {}  # one line per distinct intra-op layer layout
    for k, stage in enumerate(plan["stages"]):
        for name, splits in stage.get("layouts", {}).items():
            laid_out.setdefault(tuple(splits.items()), []).append((k, name))
    for splits, where in laid_out.items():
        stages = sorted({k for k, _ in where})
        lines += [f"intra-op layout of {_count(len(where), 'layer')} (stage {', '.join(map(str, stages))}): "
                  + ", ".join(f"{module} {split}" for module, split in splits)]
    if laid_out:
        lines += ["  (the dim each op's tp axis splits: m rows, n output features, k the contracted dim, "
                  "b experts or batch)", ""]
    if data.get("not_runnable"):
        lines += [f"note: `autopar run` cannot run this plan yet: {data['not_runnable']} (--runnable returns the "
                  "best plan it can run)", ""]
    lines += [estimate_text(e), ""]
    written = [f"timeline written to {timeline}", ""] if timeline else []
    return "\n".join(lines + _runners_up(data) + written + _comparison(data, out))


def _runners_up(data: dict[str, Any]) -> list[str]:
    """The best of the other layouts the search priced, a line each, with how much slower each is."""
    if not data.get("runners_up"):
        return []
    rows = [[str(r["pp"]), ", ".join(dict.fromkeys(f"{d} x {t}" + (" intra" if on else "") for (d, t), on in
                                                    zip(r["dp_x_tp"], r.get("intra") or [False] * len(r["dp_x_tp"])))),
             str(r["micro_batch_size"]),
             str(r["zero"]), r["schedule"] + (" + SP" if r["sp"] else ""), str(r["recomputed_layers"]),
             f"{r['iteration_seconds']:.3f} s" + ("" if r["fits"] else " (does not fit)"), f"{r['vs_plan']:.2f}x"]
            for r in data["runners_up"]]
    return ["the best of other layouts the search priced",
            table(["pp", "dp x tp", "micro-batch", "ZeRO", "schedule", "recomputed", "iteration", "vs plan"], rows,
                  align="rlrrlrrr"), ""]


def _module_rows(plan: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """One row per leading module; a repeated layer whose rows match the layer before it is folded into a note."""
    layers: dict[str, list[list[str]]] = {}
    for block in plan["blocks"]:
        module = block["module"]
        entry = plan["modules"].get(module, {})
        params = " ".join(f"{k.rpartition('.')[2]}:{v}" for k, v in entry.get("params", {}).items())
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


def render(data: dict[str, Any], *, out: str | None = None) -> str:
    plan, e = data["plan"], data["estimate"]
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan["mesh"]["axes"], plan["mesh"]["shape"]))
    rows, notes = _module_rows(plan)
    lines = [
        f"{data['model']} on {data['gpus']} x {data['cluster']}, global batch {data['config']['batch']} x seq "
        f"{data['config']['seq']}: mesh {mesh}",
        f"plan ({data['search']}): micro-batch {plan['micro_batch_size']} x {plan['micro_batches']} steps, "
        f"ZeRO {plan['zero']}{', compiled kernels' if plan.get('kernels') == 'compiled' else ''}; searched in "
        f"{data['search_seconds']:.1f} s"
        + (" (interrupted: best so far)" if data.get("interrupted") else ""),
        "",
        "modules: split of each leading op per mesh axis, layouts of its input, output and parameters",
        table(["module", "split", "input", "output", "params"], rows, align="lllll"),
        *notes,
        "",
    ]
    if data.get("not_runnable"):
        lines += [f"note: `autopar run` cannot run this plan yet: {data['not_runnable']}", ""]
    lines += [estimate_text(e), ""]
    return "\n".join(lines + _comparison(data, out))


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _comparison(data: dict[str, Any], out: str | None) -> list[str]:
    """The plan beside its baselines, priced by the same cost model."""
    e = data["estimate"]
    rows = [[data["search"], *_summary(e, e)]]
    for kind, other in data["baselines"].items():
        rows.append([kind, *(_summary(other["estimate"], e) if other else ["n/a"] * 5)])
    lines = ["against the baselines (same cost model)",
             table(["plan", "iteration", "samples/s", "MFU", "memory", "vs plan"], rows)]
    return lines + (["", f"plan written to {out}"] if out else [])


def _summary(e: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    mem = e["memory"]
    return [
        f"{e['iteration_seconds']:.3f} s",
        f"{e['throughput_samples_per_second']:.1f}",
        f"{e['mfu']:.1%}",
        binary_bytes(mem["total"]) + ("" if mem["fits"] else " (no fit)"),
        f"{e['iteration_seconds'] / reference['iteration_seconds']:.2f}x",
    ]
