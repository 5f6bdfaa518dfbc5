"""``autopar profile-segments MODEL --nproc N --db FILE``: time each distinct layer under each layout on live ranks
and keep the times in a profile database that ``estimate``/``plan``/``analyze --profile-db`` read."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autopar.cli.common import add_model_arguments, load_and_trace, model_overrides
from autopar.cli.render import table
from autopar.files import check_writable
from autopar.profiling.db import ProfileDB, this_device
from autopar.profiling.segments import Layout, entries, profile_rank, row_fingerprints, unit_entries

RECOMPUTE = ("none", "selective", "full")
SHALLOW = 3  # layers of the copy a deeper model is profiled on: a copy between two others, as in the model


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile-segments",
        help="time each distinct layer under each layout on live ranks into a profile database",
        description="Start N ranks (gloo on CPU, NCCL on GPUs). For each layout (tensor-parallel size, sequence "
        "parallelism, recomputation, samples per device) apply the plan with the runtime as `autopar run` does, "
        "to a model keeping one layer of each kind, and time each distinct layer's forward and backward there, "
        "its collectives and recomputation included; each layer keeps its median of --rounds rounds over all "
        "layouts. Times are added to --db (created if absent; entries measured "
        "again are replaced) for estimate/plan/analyze --profile-db. Measured in fp32, as autopar run trains.",
    )
    add_model_arguments(parser)
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start (the plans' device count)")
    parser.add_argument("--db", required=True, metavar="FILE", help="profile database to create or extend (JSON)")
    parser.add_argument("--tp", type=int, nargs="+", help="tensor-parallel sizes (default: every divisor of --nproc "
                        "the model's heads and widths allow)")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 2],
                        help="samples of a micro-batch per device (default 1 2)")
    parser.add_argument("--recompute", nargs="+", choices=RECOMPUTE, default=list(RECOMPUTE))
    parser.add_argument("--no-sp", action="store_true", help="skip sequence parallelism")
    parser.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 3), default=[0, 1, 3],
                        help="ZeRO stages: 0, and 1 and 3 (each repeated layer an FSDP unit over the data-parallel "
                        "ranks, where tp leaves more than one; default 0 1 3)")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per layer and layout, after a warm-up; "
                        "each time is their median (default 9)")
    parser.add_argument("--rounds", type=int, default=3, help="times every layout is profiled, one round after "
                        "another; each layer keeps its median round, so that neither a slow spell of a shared "
                        "machine nor a lucky one during one round counts (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run, dtype="fp32")


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    from autopar.cluster import load_cluster
    from autopar.cluster.ranks import prestart, run_ranks, sigterm_raises
    from autopar.cost import ParallelConfig
    from autopar.cost.megatron import pipeline_config
    from autopar.cost.pipeline import PipelineModel
    from autopar.plan.records import Workload
    from autopar.runtime.apply import check_supported
    from autopar.search.pipeline import Found, pipeline_plan

    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if any(s < 1 for s in args.samples):
        raise ValueError(f"--samples must be at least 1, got {min(args.samples)}")
    check_writable(args.db, flag="--db")
    on_cuda = torch.cuda.is_available()
    device = this_device(torch.device("cuda", 0) if on_cuda else None, threads=1)
    db = ProfileDB.load(args.db, device=device) if Path(args.db).exists() else ProfileDB(device=device)
    say = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    if args.dtype != "fp32":  # the runtime trains in fp32: times of another dtype would be of no run
        raise ValueError(f"--dtype {args.dtype}: layers are profiled in fp32, as autopar run trains them; leave "
                         "--dtype out")
    cluster = load_cluster("cpu").with_devices(args.nproc)
    prestart()  # what the ranks import, imported while the model is traced
    traced = load_and_trace(args, batch=1)
    zoo = traced.zoo
    model = PipelineModel(traced.graph, cluster, traced_batch=1, dtype="fp32")
    keys = row_fingerprints(model)
    whole = len(model.layers)
    shallow = _shallower(args, zoo, keys, cluster)
    if shallow is not None:  # the ranks build a copy of SHALLOW layers: the same kinds, found at any depth
        zoo, model, keys = shallow
        say(f"profiling a copy of {zoo.config.layers} layers: it has the same kinds of layers as the "
            f"{traced.zoo.config.layers} of {zoo.config.name}")
    rows: dict[str, list[str]] = {}
    repeated: dict[str, bool] = {}
    for layer, key in zip(model.layers, keys):
        if key is not None:
            rows.setdefault(key, []).append(layer.name)
            repeated[key] = layer.repeated
    # a copy between two others first: the first layer may scatter the stream into sequence shards, the last
    # gather it, which the copies between do not
    rows = {key: names[1:-1] + names[:1] + names[-1:] if len(names) > 2 else names for key, names in rows.items()}
    sizes = args.tp or [t for t in range(1, args.nproc + 1) if args.nproc % t == 0]
    bad = [t for t in sizes if args.nproc % t or any(w % t for w in model.split_widths)]
    if args.tp and bad:
        raise ValueError(f"--tp {bad[0]} does not divide --nproc {args.nproc} and the model's heads and "
                         f"column-parallel widths {sorted(model.split_widths)}")
    sizes = [t for t in sizes if t not in bad]
    overrides = tuple(sorted(model_overrides(args).items()))
    if shallow is not None:
        overrides = tuple(sorted({**dict(overrides), "layers": zoo.config.layers}.items()))
    groups: list[list[tuple[Layout, Any]]] = []
    skipped: list[str] = []
    shapes = [(tp, sp, zero) for tp in sizes for sp in ((False, True) if tp > 1 and not args.no_sp else (False,))
               for zero in sorted(set(args.zero)) if not (zero and args.nproc == tp)]
    for tp, sp, zero in shapes:
        group = []
        for recompute in args.recompute:
            for samples in args.samples:
                layout = Layout(tp=tp, sp=sp, recompute=recompute, zero=zero, samples=samples)
                dp = args.nproc // tp
                config = ParallelConfig(tp=tp, pp=1, dp=dp, mbs=samples, recompute=recompute, zero=zero, sp=sp,
                                        schedule="1f1b", chunks=1)
                pipeline = pipeline_config(model, config)
                priced = model.estimate(pipeline, global_batch=samples * dp, simulate=False)
                work = Workload(model=zoo.config.name, overrides=overrides, seq=zoo.seq, batch=samples * dp,
                                dtype="fp32")
                plan = pipeline_plan(model, Found(pipeline, priced, 1), name=zoo.config.name, kind="estimate",
                                     global_batch=samples * dp, workload=work)
                try:
                    check_supported(plan)
                except NotImplementedError as exc:
                    skipped.append(f"{layout}: {exc}")
                    continue
                group.append((layout, plan))
        if group:
            groups.append(group)
    started = time.perf_counter()
    measured: dict = {}  # each layer's median round so far, by key
    roots: dict = {}  # the root unit's collectives, by key (launches of one sharding measure it alike)
    rounds: dict = {}  # every round's measurement of each layer and unit, by key
    with sigterm_raises():
        for round_ in range(args.rounds):
            for group in groups:
                layouts = [layout for layout, _ in group]
                say((f"round {round_ + 1} of {args.rounds}: " if args.rounds > 1 else "")
                    + f"profiling {len(rows)} distinct layers of {zoo.config.name} on {args.nproc} ranks: "
                    + "; ".join(map(str, layouts)))
                begin = time.perf_counter()
                # under ZeRO 3 the rows outside the repeated layers belong to the root unit, gathered by the
                # root's forward only: they cannot run alone, and are priced as under ZeRO 0
                jobs = [(plan, {key: names for key, names in rows.items() if repeated[key] or not layout.zero})
                        for layout, plan in group]
                results, refused, units = run_ranks(profile_rank, args.nproc,
                                                    args=(jobs, args.repeats, on_cuda))[0]
                if round_ == 0:  # a layout is refused alike in every round
                    skipped += [f"{layouts[index]}: {why}" for index, why in refused]
                new = entries(results, layouts, ranks=args.nproc, repeats=args.repeats,
                              recomputes=[repeated[key] for _, key, *_ in results])
                for entry in new:
                    measured[entry.key] = _median(rounds, ("layer", entry.key), entry, entry.forward + entry.backward)
                    db.add(measured[entry.key])
                for unit in unit_entries(units, layouts, ranks=args.nproc, repeats=args.repeats):
                    roots[unit.key] = _median(rounds, ("unit", unit.key), unit, unit.gather + unit.reduce_scatter)
                    db.add_unit(roots[unit.key])
                db.save(args.db)  # after each launch: an interrupt keeps what was measured
                say(f"  {len(new)} time{'s' if len(new) != 1 else ''} in {time.perf_counter() - begin:.1f} s, "
                    f"saved to {args.db}")
    data = {
        "model": zoo.config.name,
        "db": args.db,
        "device": device,
        "ranks": args.nproc,
        "distinct_layers": len(rows),
        "layers": whole,
        "profiled_layers": zoo.config.layers,  # of the copy the ranks built (fewer where the kinds allow)
        "entries": [{"name": e.name, "tp": e.tp, "sp": e.sp, "recompute": e.recompute, "zero": e.zero,
                     "samples": e.samples,
                     "forward_ms": e.forward * 1e3, "backward_ms": e.backward * 1e3,
                     # ZeRO 1: a step's first forward (weights gathered) and last backward (gradients
                     # reduce-scattered); null elsewhere
                     "step_forward_ms": None if e.step_forward is None else e.step_forward * 1e3,
                     "step_backward_ms": None if e.step_backward is None else e.step_backward * 1e3}
                    for e in measured.values()],
        # under ZeRO 1 and 3 without tp: one all-gather and one reduce-scatter of the root unit (embeddings, final
        # norm, head), with FSDP's copies around them
        "units": [{"name": u.name, "dp": u.dp, "gather_ms": u.gather * 1e3, "reduce_scatter_ms": u.reduce_scatter * 1e3}
                  for u in roots.values()],
        "skipped": skipped,
        "seconds": time.perf_counter() - started,
    }
    return data if args.json else render(data)


def _median(rounds: dict, key: tuple, measurement: Any, seconds: float) -> Any:  # noqa: ANN401
    """The median of the rounds measured so far for ``key``, ``measurement`` (of ``seconds``) added: with an even
    count, the faster of the middle two. One slow or one fast round of three does not count."""
    found = rounds.setdefault(key, [])
    found.append((seconds, len(found), measurement))
    found.sort(key=lambda item: item[:2])
    return found[(len(found) - 1) // 2][2]


def _shallower(args: argparse.Namespace, zoo: Any, keys: list[str | None], cluster: Any) -> tuple | None:
    """(zoo model, cost model, fingerprints) of a copy of the model with `SHALLOW` layers, where it has exactly the
    same kinds of layer (fingerprints) as the model: the ranks then build that copy, so that profiling a deep
    model costs what a shallow one does. None where the model has no layer count to change, is no deeper, or a
    kind of layer occurs only deeper (a pattern of layer types)."""
    from autopar.cost.pipeline import PipelineModel

    layers = zoo.config.layers
    if zoo.config.family == "user" or not layers or layers <= SHALLOW:
        return None
    copy = argparse.Namespace(**{**vars(args), "layers": SHALLOW})
    try:
        traced = load_and_trace(copy, batch=1)
    except (ValueError, TypeError):  # a configuration that cannot have so few layers
        return None
    if traced.zoo.config.layers != SHALLOW:
        return None
    model = PipelineModel(traced.graph, cluster, traced_batch=1, dtype="fp32")
    shallow = row_fingerprints(model)
    return (traced.zoo, model, shallow) if set(shallow) == set(keys) else None


def render(data: dict[str, Any]) -> str:
    lines = [f"{data['model']}: {data['distinct_layers']} distinct layers of {data['layers']} rows, timed on "
             f"{data['ranks']} ranks of {data['device']} in {data['seconds']:.1f} s; written to {data['db']}", ""]
    lines.append(table(["layer", "tp", "sp", "recompute", "zero", "samples", "forward", "backward", "step edges"],
                       [[e["name"], str(e["tp"]), "yes" if e["sp"] else "no", e["recompute"], str(e["zero"]),
                         f"{e['samples']:g}", f"{e['forward_ms']:.2f} ms", f"{e['backward_ms']:.2f} ms",
                         "" if e["step_forward_ms"] is None
                         else f"{e['step_forward_ms']:.2f} + {e['step_backward_ms']:.2f} ms"]
                        for e in data["entries"]]))
    for unit in data["units"]:
        lines.append(f"{unit['name']} unit sharded over {unit['dp']} ranks: all-gather {unit['gather_ms']:.2f} ms, "
                     f"reduce-scatter {unit['reduce_scatter_ms']:.2f} ms")
    for reason in data["skipped"]:
        lines.append(f"skipped {reason}")
    return "\n".join(lines)
