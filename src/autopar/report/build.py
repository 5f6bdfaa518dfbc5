"""Reports from what the CLI computed: ``autopar plan``'s result (the plan, its runners-up and the baselines) and
``autopar estimate``'s (one configuration), in their documented JSON form (docs/cli.md), with the simulation."""

from __future__ import annotations

from typing import Any

from autopar.api.report import stage_grids
from autopar.plan import Plan
from autopar.report.records import Comparison, Report, Role


def plan_report(data: dict[str, Any], *, simulation: Any) -> Report:
    """The report of a pipeline search's result: the plan, then its runners-up, then the baselines."""
    plan = Plan.from_dict(data["plan"], estimate=data["estimate"])
    e = data["estimate"]
    rows = [Comparison(label=f"plan ({data['search']})", role=Role.PLAN, iteration_seconds=e["iteration_seconds"],
                       memory_bytes=e["memory"]["total"], fits=e["memory"]["fits"])]
    faster = data.get("faster_unrunnable")
    if faster:  # the fastest plan found, which the runtime cannot run: beside the plan, so its cost is seen
        f = faster["estimate"]
        rows.append(Comparison(label="fastest found (autopar run cannot run it yet)", role=Role.RUNNER_UP,
                               iteration_seconds=f["iteration_seconds"], memory_bytes=f["memory"]["total"],
                               fits=f["memory"]["fits"]))
    for k, r in enumerate(data.get("runners_up") or [], start=1):
        rows.append(Comparison(label=f"runner-up {k}: {_layout(r)}", role=Role.RUNNER_UP,
                               iteration_seconds=r["iteration_seconds"], fits=r["fits"]))
    for kind, other in data.get("baselines", {}).items():
        if other is None:
            rows.append(Comparison(label=kind, role=Role.BASELINE, iteration_seconds=None))
            continue
        b = other["estimate"]
        rows.append(Comparison(label=kind, role=Role.BASELINE, iteration_seconds=b["iteration_seconds"],
                               memory_bytes=b["memory"]["total"], fits=b["memory"]["fits"]))
    notes = [f"autopar run cannot run this plan yet: {data['not_runnable']}"] if data.get("not_runnable") else []
    if faster:
        notes.append(f"The fastest plan found takes {faster['vs_plan']:.2f}x this plan's time, but autopar run cannot "
                     f"run it yet: {faster['not_runnable']} (autopar plan --allow-unrunnable offers it).")
    if data.get("interrupted"):
        notes.append("The search was interrupted: this is the best plan found so far.")
    return Report(title=_title(data, plan), subtitle=_subtitle(data), plan=plan, comparisons=tuple(rows),
                  simulation=simulation, notes=tuple(notes))


def estimate_report(data: dict[str, Any], *, plan: Plan, simulation: Any) -> Report:
    """The report of one priced configuration (``plan``: it as a plan, with its stages' memory)."""
    p = data["parallel"]
    title = (f"{data['model']} on {data['gpus']} x {data['cluster']}: tp {p['tp']} x pp {p['pp']} x dp {p['dp']}, "
             f"recompute {p['recompute']}")
    return Report(title=title, subtitle=_subtitle(data) + "; one configuration priced (autopar estimate)",
                  plan=plan, comparisons=(), simulation=simulation)


def _layout(r: dict[str, Any]) -> str:
    return (f"pp {r['pp']}, {stage_grids(r)}, micro-batch {r['micro_batch_size']}, ZeRO {r['zero']}, {r['schedule']}"
            + (" + SP" if r["sp"] else "") + f", {r['recomputed_layers']} recomputed")


def _title(data: dict[str, Any], plan: Plan) -> str:
    grids = ", ".join(dict.fromkeys(f"{s.dp} x {s.tp}" for s in plan.stages))
    return (f"{data['model']} on {data['gpus']} x {data['cluster']}: {data['search']} plan, {len(plan.stages)} "
            f"stage{'s' if len(plan.stages) != 1 else ''} (dp x tp {grids})")


def _subtitle(data: dict[str, Any]) -> str:
    config = data["config"]
    return (f"global batch {config['batch']} x seq {config['seq']}; {data['params']:,} parameters; "
            f"{data['gpus']} devices of {data['cluster']}")
