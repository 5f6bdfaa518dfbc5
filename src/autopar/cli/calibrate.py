"""``autopar calibrate --nproc N``: measure this machine's process group and write a cluster file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from autopar.cli.render import binary_bytes, table
from autopar.cluster.detect import FIT_FROM, calibrate
from autopar.cluster.spec import cluster_to_dict
from autopar.files import check_writable, write_atomic


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the live process group and fit the link model",
        description="Start N ranks (gloo on CPU, NCCL on GPUs), time all-reduce from 1 KiB to 64 MiB and fit latency "
        "and bus bandwidth; then, on every rank at once, time GEMMs over a grid of shapes, memory bandwidth, the "
        "attention core and one op's fixed cost (fp32, one thread per rank on CPU, as `autopar run` trains); write "
        "a cluster file usable as --cluster.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start (2 or more)")
    parser.add_argument("--out", help="write the fitted cluster here (YAML); checked before measuring")
    parser.add_argument("--links-only", action="store_true",
                        help="measure the links only; the device keeps the cpu preset's guessed compute")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    out = args.out
    if out is not None:
        check_writable(out, flag="--out")
    result = calibrate(args.nproc, progress=None if args.json else lambda m: print(m, file=sys.stderr),
                       compute=not args.links_only)
    data = cluster_to_dict(result.cluster)
    if out is not None:
        write_atomic(out, yaml.safe_dump(data, sort_keys=False))
    report = {
        "cluster": data,
        "ranks": result.ranks,
        "measurements": [{"bytes": b, "seconds": s} for b, s in zip(result.sizes, result.seconds)],
        "fit": {
            "bandwidth_gbps": result.bandwidth / 1e9,
            "latency_us": result.latency * 1e6,
            "max_relative_error_from_4mib": result.fit_error,
        },
        "compute": result.compute.to_dict() if result.compute is not None else None,
        "out": args.out,
        "wall_seconds": result.wall_seconds,
    }
    if args.json:
        return report
    rows = [
        [binary_bytes(b), f"{s * 1e3:.2f} ms", f"{b / s / 1e9:.3f} GB/s", "fit" if b >= FIT_FROM else ""]
        for b, s in zip(result.sizes, result.seconds)
    ]
    lines = [
        table(["message", "all-reduce", "algbw", ""], rows, align="rrrl"),
        "",
        f"fitted bus bandwidth {result.bandwidth / 1e9:.3f} GB/s, latency {result.latency * 1e6:.0f} us per step; "
        f"line within {result.fit_error:.0%} of measurements >= 4 MiB",
    ]
    if result.compute is not None:
        c, d = result.compute, result.cluster.device
        curve = ", ".join(f"{flops / 1e6:.3g} MFLOP {e:.2f}" for flops, e in d.gemm_efficiency)
        lines += [
            f"compute per rank (fp32, all {result.ranks} ranks at once): GEMM peak {c.peak / 1e9:.1f} GFLOP/s; "
            f"efficiency by GEMM size: {curve}",
            f"memory bandwidth {c.bandwidth / 1e9:.2f} GB/s; attention core {c.attention / 1e9:.1f} GFLOP/s "
            f"({d.efficiency['attention']:.2f} of peak); one op {c.op_forward * 1e6:.1f} us forward, "
            f"{c.op_backward * 1e6:.1f} us backward",
        ]
    else:
        lines.append("compute not measured (--links-only): the device keeps the cpu preset's figures")
    wrote = f"; wrote {args.out}" if out is not None else ""
    lines.append(f"{result.ranks} ranks, {result.wall_seconds:.1f} s{wrote}")
    return "\n".join(lines)
