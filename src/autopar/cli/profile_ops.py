"""``autopar profile-ops MODEL --db FILE``: time each distinct aten op of a model, forward and backward, at the
amounts of work the search prices, and keep the times in the profile database ``estimate``/``plan``/``analyze
--profile-db`` read (Aceso's op database)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autopar.cli.common import add_model_arguments, load_and_trace
from autopar.cli.render import binary_bytes, table
from autopar.files import check_writable
from autopar.profiling.collectives import sizes_for
from autopar.profiling.db import CollectiveEntry, DispatchEntry, OpEntry, ProfileDB, this_device


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile-ops",
        help="time each distinct op of a model on this device into a profile database",
        description="Trace the model on fake tensors and time each distinct aten op it runs (by op, input shapes "
        "and dtype), forward and backward, on random inputs on this device: at each number of samples per device "
        "(--samples) and each tensor-parallel split of the op (--tp), with --nproc ranks timing at once as a "
        "plan's ranks share the host, one thread each. Times are added to --db (created if absent; points measured "
        "again are replaced): estimate/plan/analyze --profile-db then price those ops by them, the rest by the "
        "roofline. With 2 ranks or more, each collective kind is timed too, at the message sizes the model's plans "
        "send, on groups of each size dividing N: the cost model then prices those collectives by their times. "
        "Measured in fp32 on a CPU, as autopar run trains; on a CUDA device in --dtype (default fp32).",
    )
    add_model_arguments(parser)
    parser.add_argument("--db", required=True, metavar="FILE", help="profile database to create or extend (JSON)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks timing ops at once on this host: the device count of the plans to price "
                        "(default 1)")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 2, 4],
                        help="samples of a micro-batch per device (default 1 2 4)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4],
                        help="ways tensor parallelism splits an op (default 1 2 4; unsplit ops are always timed)")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per op and size, after a warm-up; each "
                        "time is their median (default 9)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run, dtype="fp32")  # --dtype bf16 or fp16 on a CUDA device


def points_of(samples: list[int], ways: list[int]) -> list[tuple[int, int]]:
    """(samples, ways) pairs to time, one per amount of work ``samples / ways``: an unsplit op where one gives that
    work (what data parallelism runs; always timed), a split one below the fewest samples."""
    found: dict[float, tuple[int, int]] = {}
    for s in sorted(set(samples)):
        for t in sorted(set(ways) | {1}):
            work = s / t
            if work not in found or (found[work][1] != 1 and t == 1):
                found[work] = (s, t)
    return [found[w] for w in sorted(found)]


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    from autopar.cluster.ranks import prestart, run_ranks, sigterm_raises
    from autopar.profiling.ops import distinct_ops, profile_ops_rank

    for flag, values in (("--samples", args.samples), ("--tp", args.tp)):
        if any(v < 1 for v in values):
            raise ValueError(f"{flag} must be at least 1, got {min(values)}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    on_cuda = torch.cuda.is_available()
    if args.dtype != "fp32" and not on_cuda:  # a CPU run trains in fp32: other times would be of no run
        raise ValueError(f"--dtype {args.dtype}: on a CPU ops are profiled in fp32, as autopar run trains them; "
                         "leave --dtype out (bf16 and fp16 are profiled on a CUDA device)")
    if on_cuda and args.nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} CUDA device(s), one "
                         f"per rank; use --nproc {torch.cuda.device_count()} or fewer")
    check_writable(args.db, flag="--db")
    device = this_device(torch.device("cuda", 0) if on_cuda else None, threads=1)
    db = ProfileDB.load(args.db, device=device) if Path(args.db).exists() else ProfileDB(device=device)
    say = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    prestart()
    traced = load_and_trace(args, batch=1)
    graph = traced.graph
    jobs = distinct_ops(graph.nodes)
    points = points_of(args.samples, args.tp)
    say(f"timing {len(jobs)} distinct ops of {traced.zoo.config.name} at {len(points)} sizes on {args.nproc} "
        f"rank{'s' if args.nproc != 1 else ''} of {device}")
    started = time.perf_counter()
    sizes = sizes_for(graph, samples=args.samples, ways=args.tp) if args.nproc > 1 else []
    if sizes:
        groups = ", ".join(str(g) for g in range(2, args.nproc + 1) if args.nproc % g == 0)
        say(f"then each collective kind at {len(sizes)} sizes ({binary_bytes(sizes[0])} to "
            f"{binary_bytes(sizes[-1])}) on groups of {groups}")
    with sigterm_raises():
        times, skipped, dispatch, collectives = run_ranks(profile_ops_rank, args.nproc,
                                                          args=(jobs, points, args.repeats, on_cuda, sizes))[0]
    by_key: dict[tuple, list] = {}
    names: dict[tuple, str] = {}
    for key, name, work, forward, backward in times:
        by_key.setdefault(key, []).append((work, forward, backward))
        names[key] = name
    for key, entries in by_key.items():
        op, inputs, dtype = key
        db.add_op(OpEntry(op=op, inputs=tuple(tuple(s) for s in json.loads(inputs)), dtype=dtype, ranks=args.nproc,
                          name=names[key], points=tuple(sorted(entries)), repeats=args.repeats))
    if dispatch is not None:
        entry = DispatchEntry(ranks=args.nproc, dtype=args.dtype, forward=dispatch[0], backward=dispatch[1],
                              repeats=args.repeats)
        db.dispatch[entry.key] = entry
    for kind, group, measured in collectives:
        db.add_collective(CollectiveEntry(kind, group, args.nproc, tuple(measured), args.repeats))
    db.save(args.db)
    data = {
        "model": traced.zoo.config.name,
        "db": args.db,
        "device": device,
        "ranks": args.nproc,
        "distinct_ops": len(jobs),
        "timed_ops": len(by_key),
        "sizes": [{"samples": s, "tp": t} for s, t in points],
        # what DTensor's dispatch adds to one op (intra-op plans run every op through it); null if not measured
        "dispatch": None if dispatch is None else {"forward_ms": dispatch[0] * 1e3, "backward_ms": dispatch[1] * 1e3},
        "ops": [{"op": key[0], "inputs": json.loads(key[1]), "name": names[key],
                 "points": [{"work": w, "forward_ms": f * 1e3, "backward_ms": b * 1e3} for w, f, b in sorted(pts)]}
                for key, pts in by_key.items()],
        # each collective kind on groups of `group` of the ranks, all groups at once: seconds by whole buffer size
        "collectives": [{"kind": kind, "group": group, "points": [{"bytes": b, "ms": t * 1e3} for b, t in measured]}
                        for kind, group, measured in collectives],
        "skipped": [{"op": key[0], "inputs": json.loads(key[1]), "name": name, "why": why}
                    for key, name, why in skipped],
        "seconds": time.perf_counter() - started,
    }
    return data if args.json else render(data)


def render(data: dict[str, Any]) -> str:
    lines = [f"{data['model']}: {data['timed_ops']} of {data['distinct_ops']} distinct ops timed at "
             f"{len(data['sizes'])} sizes on {data['ranks']} rank{'s' if data['ranks'] != 1 else ''} of "
             f"{data['device']} in {data['seconds']:.1f} s; written to {data['db']}", ""]
    rows = []
    for op in data["ops"]:
        one = next((p for p in op["points"] if p["work"] == 1), op["points"][0])
        rows.append([op["op"].removeprefix("aten."), " ".join("x".join(map(str, s)) for s in op["inputs"]),
                     op["name"] or "(model)", f"{one['work']:g}", f"{one['forward_ms']:.3f} ms",
                     f"{one['backward_ms']:.3f} ms", str(len(op["points"]))])
    lines.append(table(["op", "inputs (one sample)", "seen in", "work", "forward", "backward", "sizes"], rows))
    if data["dispatch"] is not None:
        lines.append(f"DTensor's dispatch adds {data['dispatch']['forward_ms']:.3f} ms forward and "
                     f"{data['dispatch']['backward_ms']:.3f} ms backward to an op (intra-op plans pay it on every op)")
    if data["collectives"]:
        sizes = [p["bytes"] for p in data["collectives"][0]["points"]]
        shown = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
        lines += ["", "collectives (all groups at once; median ms per call, by the whole buffer):",
                  table(["kind", "group", *(binary_bytes(b) for b in shown)],
                        [[c["kind"], str(c["group"]),
                          *(f"{next(p['ms'] for p in c['points'] if p['bytes'] == b):.2f}" for b in shown)]
                         for c in data["collectives"]], align="lr" + "r" * len(shown))]
    for skip in data["skipped"]:
        lines.append(f"skipped {skip['op']} in {skip['name'] or '(model)'}: {skip['why']} (priced by the roofline)")
    return "\n".join(lines)
