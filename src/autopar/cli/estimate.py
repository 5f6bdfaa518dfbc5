"""``autopar estimate MODEL``: the cost model's verdict on one Megatron-style configuration."""

from __future__ import annotations

import argparse
from typing import Any

from autopar.api.report import experts_text
from autopar.cli.common import (
    MAX_BATCH, MAX_DEVICES, add_kernels_argument, add_model_arguments, add_profile_argument,
    bounded_int, check_out, load_and_trace, load_profile, profile_data,
)
from autopar.cli.fit import advice_text, fit_advice, summary
from autopar.cli.render import Outcome, estimate_text, profile_line
from autopar.cli.timeline import check_timeline, timeline_data, write_timeline
from autopar.report import check_report, estimate_report, write_report
from autopar.cluster import load_cluster
from autopar.cost import ParallelConfig
from autopar.cost.megatron import pipeline_config
from autopar.cost.pipeline import PipelineModel
from autopar.cost.types import RECOMPUTE, SCHEDULES
from autopar.plan.records import MAX_CHUNKS
from autopar.search.pipeline import Found, pipeline_plan


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="iteration time, MFU, memory and collectives of one tp x pp x dp configuration",
        description="Trace MODEL at one micro-batch and price a Megatron-style configuration on a cluster.",
    )
    add_model_arguments(parser)
    parser.add_argument("--cluster", default="a100-80g-sxm", help="preset name or cluster file (default a100-80g-sxm)")
    devices = bounded_int(MAX_DEVICES)
    parser.add_argument("--gpus", type=devices, help="devices used (default tp x pp x dp)")
    parser.add_argument("--tp", type=devices, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=devices, default=1, help="pipeline stages")
    parser.add_argument("--dp", type=devices, help="data-parallel size (default gpus / (tp x pp))")
    parser.add_argument("--mbs", type=bounded_int(MAX_BATCH), default=1, help="micro-batch size")
    parser.add_argument("--recompute", choices=RECOMPUTE, default="none")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (3 = FSDP)")
    parser.add_argument("--sp", action="store_true", help="Megatron sequence parallelism")
    parser.add_argument("--ep", type=devices, default=1,
                        help="expert parallelism: split each mixture's experts over this many data-parallel ranks, "
                        "tokens moved by all-to-alls (so far the whole --dp of every stage, with --tp 1)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--chunks", type=bounded_int(MAX_CHUNKS), default=1,
                        help="model chunks per device under --schedule interleaved (default 1)")
    add_kernels_argument(parser)
    add_profile_argument(parser)
    parser.add_argument("--out", metavar="PLAN.json",
                        help="also write this configuration as a plan, runnable with autopar run and dryrun")
    parser.add_argument("--timeline", metavar="FILE",
                        help="draw the simulated iteration per device to FILE (.svg or .png; needs matplotlib)")
    parser.add_argument("--report", metavar="FILE.html",
                        help="write one self-contained HTML page with the stages, the simulated timeline and memory "
                        "per stage (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def _config(args: argparse.Namespace) -> tuple[ParallelConfig, int]:
    gpus = args.gpus or args.tp * args.pp * (args.dp or 1)
    if gpus > MAX_DEVICES:
        raise ValueError(f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp or 1} = {gpus:,} devices; at most "
                         f"{MAX_DEVICES:,} are supported")
    dp = args.dp or gpus // (args.tp * args.pp)
    if args.tp * args.pp * dp != gpus:
        raise ValueError(f"--tp {args.tp} x --pp {args.pp} x --dp {dp} = {args.tp * args.pp * dp} != --gpus {gpus}")
    config = ParallelConfig(
        tp=args.tp, pp=args.pp, dp=dp, mbs=args.mbs, recompute=args.recompute, zero=args.zero, sp=args.sp,
        schedule=args.schedule, chunks=args.chunks, ep=args.ep,
    )
    return config, gpus


def run(args: argparse.Namespace) -> dict[str, Any] | str | Outcome:
    check_out(args)
    check_timeline(args.timeline)
    check_report(args.report)
    config, gpus = _config(args)
    cluster = load_cluster(args.cluster).with_devices(gpus)
    global_batch = args.batch
    traced = load_and_trace(args, batch=config.mbs)
    zoo, graph = traced.zoo, traced.graph
    profile, cluster = load_profile(args, cluster)
    model = PipelineModel(graph, cluster, traced_batch=config.mbs, dtype=args.dtype, kernels=args.kernels,
                          profile=profile)
    uneven = sorted(w for w in model.split_widths if w % config.tp)
    if uneven:  # Megatron splits heads and column outputs evenly; pricing a ragged split would be silently wrong
        raise ValueError(f"--tp {config.tp} does not divide the model's attention heads and column-parallel widths "
                         f"{sorted(model.split_widths)} (here {uneven[0]}, of {model.split_width_where(uneven[0])}): "
                         "choose a --tp that divides them all")
    if global_batch % (config.dp * config.mbs):
        raise ValueError(f"--batch {global_batch} is not a multiple of dp x mbs = {config.dp} x {config.mbs}")
    pipeline = pipeline_config(model, config)
    priced = model.estimate(pipeline, global_batch=global_batch)  # simulated
    result = priced.estimate
    fits = result.memory.fits
    if args.out and fits:  # a configuration that does not fit is no plan to run
        _write_plan(args, zoo, model, pipeline, priced, global_batch)
    data = {
        "model": zoo.config.name,
        "config": {**zoo.config.summary(), "seq": zoo.seq, "batch": global_batch},
        "cluster": cluster.name,
        "gpus": gpus,
        "parallel": {
            "tp": config.tp, "pp": config.pp, "dp": config.dp, "mbs": config.mbs, "recompute": config.recompute,
            "zero": config.zero, "sp": config.sp, "ep": config.ep, "schedule": config.schedule,
            "chunks": config.chunks, "kernels": args.kernels,
        },
        "params": graph.num_params,
        "estimate": result.to_dict(),
        "timeline": timeline_data(priced.simulation),
        "fits": fits,
    }
    if profile is not None:
        data["profile"] = profile_data(profile, model, pipeline, global_batch=global_batch)
    if args.timeline:
        write_timeline(priced.simulation, args.timeline, title=_head(data))
    if args.report:
        plan = pipeline_plan(model, Found(pipeline, priced, 1), name=zoo.config.name, kind="estimate",
                             global_batch=global_batch)
        write_report(args.report, estimate_report(data, plan=plan, simulation=priced.simulation))
    if fits:
        return data if args.json else render(data, timeline=args.timeline, report=args.report)
    data["fit"] = fit_advice(model, pipeline, global_batch=global_batch, memory=result.memory)
    text = render(data, timeline=args.timeline, report=args.report) + "\n\n" + "\n".join(advice_text(data["fit"], cluster=cluster.name, what="this configuration"))
    if args.out:
        text += f"\n\nplan not written to {args.out}: it does not fit"
    return Outcome(data if args.json else text, 3, f"does not fit {gpus} x {cluster.name}: {summary(data['fit'])}")


def _write_plan(args: argparse.Namespace, zoo: Any, model: PipelineModel, pipeline: Any, result: Any,
                global_batch: int) -> None:
    """The configuration as a plan file, in the form the planner writes (even stages, its layouts)."""
    from autopar.cli.plan import refusal, workload
    from autopar.plan import save_plan

    plan = pipeline_plan(model, Found(pipeline, result, 1), name=zoo.config.name, kind="estimate",
                         global_batch=global_batch, workload=workload(args, zoo))
    reason = refusal(plan)
    if reason is not None:  # a plan file is for `autopar run`: one it would refuse is not written
        raise ValueError(f"plan not written to {args.out}: `autopar run` cannot run it: {reason}")
    save_plan(args.out, plan)


def _head(data: dict[str, Any]) -> str:
    e, p = data["estimate"], data["parallel"]
    return (
        f"{data['model']} on {data['gpus']} x {data['cluster']}: tp {p['tp']} x pp {p['pp']} x dp {p['dp']}, "
        f"micro-batch {p['mbs']} x {e['micro_batches']}, recompute {p['recompute']}, ZeRO {p['zero']}"
        + (f", interleaved x{p['chunks']}" if p.get("chunks", 1) > 1 else "")
        + (", SP" if p["sp"] else "")
        + experts_text(p.get("ep", 1))
        + (", compiled kernels" if p.get("kernels") == "compiled" else "")
        + f"; global batch {data['config']['batch']} x seq {data['config']['seq']}"
    )


def render(data: dict[str, Any], *, timeline: str | None = None, report: str | None = None) -> str:
    text = "\n".join([_head(data), *profile_line(data), "", estimate_text(data["estimate"])])
    return (text + (f"\n\ntimeline written to {timeline}" if timeline else "")
            + (f"\nreport written to {report}" if report else ""))
