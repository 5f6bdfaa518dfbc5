"""The planner's report: the JSON object `autopar plan --json` prints for a pipeline plan, and its text.

`autopar plan` prints it; `autopar.plan` keeps the text in the plan it returns (`Plan.explain`). A plan read from a
file has no search beside it: `plan_text` explains its stages and estimate alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.api.search import Searched
from autopar.cli.render import binary_bytes, estimate_text, profile_line, table
from autopar.cluster.spec import Cluster
from autopar.plan import Plan
from autopar.search.pipeline import Found

# who runs a plan, and how to ask the planner for plans it cannot run: the command line's words, and Python's
COMMAND_LINE = ("`autopar run`", "--allow-unrunnable")
PYTHON = ("autopar.parallelize", "runnable_only=False")


def pipeline_report(searched: Searched, *, model: str, config: dict[str, Any], cluster: Cluster,
                    params: int) -> dict[str, Any]:
    """The fields every pipeline search reports (docs/cli.md); ``config``: the model's sizes with ``batch`` and
    (for sequence models) ``seq``."""
    chosen = searched.chosen
    return {
        "model": model,
        "config": config,
        "cluster": cluster.name,
        "gpus": cluster.num_devices,
        "search": searched.plan.kind,
        "params": params,
        **entry(searched.plan),
        "baselines": {kind: (entry(p) if p is not None else None) for kind, p in searched.baselines.items()},
        "search_seconds": searched.seconds,
        "fits": searched.fits,
        "configurations_priced": chosen.evaluated,
        "found_by": chosen.by or searched.plan.kind,  # auto: grid, aceso or mcmc (or a baseline on simulation)
        "converged": chosen.converged,  # stopped because it stopped improving, not on --budget-s
        "interrupted": searched.interrupted,
        "runners_up": [_layout(f, chosen) for f in chosen.runners_up],
        "not_runnable": searched.not_runnable,  # why the runtime refuses it, or null
        "faster_unrunnable": _faster(searched),
    }


def _faster(searched: Searched) -> dict[str, Any] | None:
    """The fastest plan the search found where the runtime cannot run it and the plan given is the best it can
    (`Searched.faster`): its plan and estimate, why it cannot run, and its time over the plan's; or None."""
    faster = searched.faster
    if faster is None:
        return None
    ratio = (faster.chosen.result.estimate.iteration_seconds
             / searched.chosen.result.estimate.iteration_seconds)
    return {**entry(faster.plan), "not_runnable": faster.not_runnable, "vs_plan": ratio}


def entry(plan: Plan) -> dict[str, Any]:
    """A plan and its estimate as the CLI prints them (``--json``: ``plan`` and ``estimate``)."""
    return {"plan": plan.to_dict(), "estimate": plan.estimate.to_dict()}


def title(data: dict[str, Any]) -> str:
    """The report in a line (the timeline picture's title)."""
    plan = data["plan"]
    grids = ", ".join(dict.fromkeys(f"{s['dp']} x {s['tp']}" for s in plan["stages"]))
    return (f"{data['model']} on {data['gpus']} x {data['cluster']}: {data['search']} plan, "
            f"{count(len(plan['stages']), 'stage')} (dp x tp {grids}), micro-batch {plan['micro_batch_size']} x "
            f"{plan['micro_batches']}, ZeRO {plan['zero']}, {plan['schedule']}{experts_text(plan.get('ep', 1))}")


def _layout(found: Found, chosen: Found) -> dict[str, Any]:
    """A runner-up in a line: its layout and how it compares with the chosen plan."""
    c, e = found.config, found.result.estimate
    return {
        "pp": c.pp, "dp_x_tp": [[s.dp, s.tp] for s in c.stages],  # per stage
        "intra": [s.intra for s in c.stages],  # per stage: layers laid out by the intra-op planner
        "micro_batch_size": c.micro_batch, "zero": c.zero,
        "ep": c.ep,  # expert parallelism: each stage's experts split over its dp ranks (1: none)
        "sp": c.sp, "schedule": c.schedule, "recomputed_layers": sum(len(s.recomputed_rows()) for s in c.stages),
        "iteration_seconds": e.iteration_seconds, "fits": e.memory.fits,
        "vs_plan": e.iteration_seconds / chosen.result.estimate.iteration_seconds,
    }


def render_pipeline(data: dict[str, Any], *, out: str | None = None, timeline: str | None = None,
                    runner: tuple[str, str] = COMMAND_LINE) -> str:
    """The report as text; ``out``/``timeline``: files written, named at the end; ``runner``: who runs the plan and
    how to ask for one it can run (`COMMAND_LINE` or `PYTHON`)."""
    plan = data["plan"]
    config = data["config"]
    lines = [
        f"{data['model']} on {data['gpus']} x {data['cluster']}, global batch {config['batch']}"
        + (f" x seq {config['seq']}" if config.get("seq") is not None else ""),
        f"plan ({_searched_by(data)}): {_shape(plan)}; " + _convergence(data),
        "",
        *_stages(plan),
    ]
    if data.get("not_runnable"):
        advice = ("the search was stopped before it looked for one it can run" if data.get("interrupted")
                  else f"planned with {runner[1]}; without it the plan is the best it can run")
        lines += [f"note: {runner[0]} cannot run this plan yet: {data['not_runnable']} ({advice})", ""]
    faster = data.get("faster_unrunnable")
    if faster:
        lines += [f"note: the fastest plan found, {_shape(faster['plan'])} on "
                  f"{stage_grids(_grids(faster['plan']))}, takes {faster['estimate']['iteration_seconds']:.3f} s "
                  f"({faster['vs_plan']:.2f}x this plan's time), but {runner[0]} cannot run it yet: "
                  f"{faster['not_runnable']} ({runner[1]} offers it)", ""]
    lines += [*profile_line(data), estimate_text(data["estimate"]), ""]
    written = [f"timeline written to {timeline}", ""] if timeline else []
    return "\n".join(lines + _runners_up(data) + written + comparison(data, out))


def _grids(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's stages as `stage_grids` reads a runner-up's."""
    return {"dp_x_tp": [[s["dp"], s["tp"]] for s in plan["stages"]], "intra": [s.get("intra") for s in plan["stages"]]}


def _searched_by(data: dict[str, Any]) -> str:
    """The search, and the one that found the plan where they differ (auto: grid, aceso or mcmc)."""
    by = data.get("found_by")
    return data["search"] + (f", found by {by}" if by and by != data["search"] else "")


def _convergence(data: dict[str, Any]) -> str:
    """How the search ended: converged after N configurations, stopped on its budget, or interrupted."""
    priced = count(data["configurations_priced"], "configuration")
    if data["interrupted"]:
        return f"{priced} priced in {data['search_seconds']:.1f} s (interrupted: best so far)"
    if data.get("converged"):
        return f"converged after {priced} in {data['search_seconds']:.1f} s"
    return f"{priced} priced in {data['search_seconds']:.1f} s"


def plan_text(plan: Plan) -> str:
    """A plan without its search (read from a file): what it is for, its stages and its estimate."""
    data = plan.to_dict()
    batch = plan.micro_batch_size * plan.micro_batches
    lines = [f"{plan.model}: {plan.kind} plan for {plan.devices} devices, global batch {batch}"
             + (f" x seq {plan.workload.seq}" if plan.workload is not None else ""),
             f"plan ({plan.kind}): {_shape(data)}" if plan.stages else
             f"intra-op plan ({plan.kind}) on mesh {' x '.join(map(str, plan.mesh.shape))}: micro-batch "
             f"{plan.micro_batch_size} x {plan.micro_batches}, ZeRO {plan.zero}{recomputed_text(plan.recompute)}", ""]
    if plan.stages:
        lines += _stages(data)
    lines += [estimate_text(plan.estimate.to_dict()) if plan.estimate is not None else "(no estimate)"]
    return "\n".join(lines)


def _shape(plan: dict[str, Any]) -> str:
    return (f"{count(len(plan['stages']), 'pipeline stage')}, micro-batch {plan['micro_batch_size']} x "
            f"{plan['micro_batches']}, ZeRO {plan['zero']}, {plan['schedule']}"
            f"{', compiled kernels' if plan.get('kernels') == 'compiled' else ''}"
            f"{experts_text(plan.get('ep', 1))}")


def experts_text(ep: int) -> str:
    """What a plan's expert parallelism is, for the line that sums a plan up; empty without it."""
    return f", experts split over {ep} ranks (all-to-all sizes assume tokens spread evenly over the experts)" \
        if ep > 1 else ""


def _stages(plan: dict[str, Any]) -> list[str]:
    """A row per stage (its layers, dp x tp, time per micro-batch, memory, recomputation), and a line per distinct
    intra-op layer layout."""
    rows = []
    for k, stage in enumerate(plan["stages"]):
        layers = [name or "<root>" for name in stage["layers"]]  # the root's own ops: the loss
        span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)} rows)"
        recompute = ", ".join(f"{n}:{v[0]}" for n, v in list(stage["recompute"].items())[:3])
        if len(stage["recompute"]) > 3:
            recompute += f" (+{len(stage['recompute']) - 3} more)"
        segments = stage.get("segments", [])
        if segments:  # runs checkpointed together: the outermost spans
            recompute = ", ".join(filter(None, [recompute, count(len(segments), "checkpointed run")]))
        grid = f"{stage['dp']} x {stage['tp']}" + (" intra" if stage.get("layouts") else "")
        seconds = stage.get("seconds_per_micro_batch")
        memory = stage.get("memory")
        rows.append([str(k), span, grid, f"{seconds * 1e3:.1f} ms" if seconds is not None else "-",
                     binary_bytes(memory["total"]) if memory is not None else "-", recompute or "-"])
    lines = [table(["stage", "layers", "dp x tp", "per micro-batch", "memory", "recomputed (s: selective, f: full)"],
                   rows, align="rlrrrl"), ""]
    laid_out = {}  # one line per distinct intra-op layer layout
    for k, stage in enumerate(plan["stages"]):
        for name, splits in stage.get("layouts", {}).items():
            laid_out.setdefault(tuple(splits.items()), []).append((k, name))
    for splits, where in laid_out.items():
        stages = sorted({k for k, _ in where})
        lines += [f"intra-op layout of {count(len(where), 'layer')} (stage {', '.join(map(str, stages))}): "
                  + ", ".join(f"{module} {split}" for module, split in splits)]
    if laid_out:
        lines += ["  (the dim each op's tp axis splits: m rows, n output features, k the contracted dim, "
                  "b experts or batch)", ""]
    return lines


def stage_grids(layout: dict[str, Any]) -> str:
    """A runner-up's stages in a few words: its distinct dp x tp grids, and which stages the intra-op planner laid
    out (``8 x 2 intra`` when all are, ``8 x 2, intra-op stages 0, 1`` when some), so that two layouts that differ
    only there read differently."""
    grids = ", ".join(dict.fromkeys(f"{d} x {t}" for d, t in layout["dp_x_tp"]))
    intra = [k for k, on in enumerate(layout.get("intra") or []) if on]
    if not intra:
        return grids
    if len(intra) == len(layout["dp_x_tp"]):
        return grids + " intra"
    return f"{grids}, intra-op stage{'s' if len(intra) > 1 else ''} {', '.join(map(str, intra))}"


def _runners_up(data: dict[str, Any]) -> list[str]:
    """The best of the other layouts the search priced, a line each, with how much slower each is."""
    if not data.get("runners_up"):
        return []
    rows = [[str(r["pp"]), stage_grids(r) + (f", ep {r['ep']}" if r.get("ep", 1) > 1 else ""),
             str(r["micro_batch_size"]),
             str(r["zero"]), r["schedule"] + (" + SP" if r["sp"] else ""), str(r["recomputed_layers"]),
             f"{r['iteration_seconds']:.3f} s" + ("" if r["fits"] else " (does not fit)"), f"{r['vs_plan']:.2f}x"]
            for r in data["runners_up"]]
    return ["the best of other layouts the search priced",
            table(["pp", "dp x tp", "micro-batch", "ZeRO", "schedule", "recomputed", "iteration", "vs plan"], rows,
                  align="rlrrlrrr"), ""]


def recomputed_text(layers: Sequence[str]) -> str:
    """An intra-op plan's recomputed layers in a few words (``, layers.0-5 recomputed``), or nothing."""
    if not layers:
        return ""
    heads = {name.rpartition(".")[0] for name in layers}
    tails = [name.rpartition(".")[2] for name in layers]
    if len(heads) == 1 and all(t.isdigit() for t in tails):
        numbers = sorted(int(t) for t in tails)
        head = heads.pop()
        if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
            return f", {head}.{numbers[0]}-{numbers[-1]} recomputed"
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return f", {count(len(layers), 'layer')} recomputed ({shown})"


def count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def comparison(data: dict[str, Any], out: str | None) -> list[str]:
    """The plan beside its baselines, priced by the same cost model."""
    e = data["estimate"]
    # an intra-op search may offer a baseline's plan (the fastest that runs): the row says which
    label = data["plan"].get("kind", data["search"]) if data["search"] == "ilp" else data["search"]
    if label in data["baselines"] and data["plan"].get("zero"):  # a baseline's layout, its states sharded
        label += f" + ZeRO {data['plan']['zero']}"
    if data["plan"].get("recompute"):
        label += f" + {len(data['plan']['recompute'])} recomputed"
    rows = [[label, *_summary(e, e)]]
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
