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
        "attention core and one op's fixed cost (fp32, one thread per rank on CPU, as `autopar run` trains; on a "
        "GPU bf16 and fp16 too), and compare the GEMMs with what the preset assumed; write a cluster file usable "
        "as --cluster. With --nproc 1 no link is measured and the preset's are kept.",
    )
    parser.add_argument("--nproc", type=int, required=True,
                        help="ranks to start: 2 or more to measure links; 1 for one device's compute alone")
    parser.add_argument("--base", metavar="PRESET",
                        help="the preset whose figures the measurements replace (default: the preset of this "
                        "machine's GPU, else cpu)")
    parser.add_argument("--out", help="write the fitted cluster here (YAML); checked before measuring")
    parser.add_argument("--links-only", action="store_true",
                        help="measure the links only; the device keeps the cpu preset's guessed compute")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    out = args.out
    if out is not None:
        check_writable(out, flag="--out")
    from autopar.cluster.detect import base_preset

    if args.nproc == 1 and args.links_only:
        raise ValueError("--nproc 1 measures no link (an all-reduce needs 2 ranks) and --links-only no compute: "
                         "nothing to measure; use --nproc 2 or more, or leave --links-only out")
    base = base_preset(args.base, args.nproc)
    result = calibrate(args.nproc, base=base, progress=None if args.json else lambda m: print(m, file=sys.stderr),
                       compute=not args.links_only)
    data = cluster_to_dict(result.cluster)
    if out is not None:
        write_atomic(out, yaml.safe_dump(data, sort_keys=False))
    report = {
        "cluster": data,
        "ranks": result.ranks,
        "measurements": [{"bytes": b, "seconds": s} for b, s in zip(result.sizes, result.seconds)],
        # null on one rank: no link was measured, the preset's are in the cluster
        "fit": {
            "bandwidth_gbps": result.bandwidth / 1e9,
            "latency_us": result.latency * 1e6,
            "max_relative_error_from_4mib": result.fit_error,
        } if result.links_measured else None,
        "base": base.name,
        "compute": result.compute.to_dict() if result.compute is not None else None,
        # each GEMM measured beside the base preset's assumption for it (`ComputeProfile.against`)
        "against_base": result.compute.against(base.device) if result.compute is not None else None,
        "out": args.out,
        "wall_seconds": result.wall_seconds,
    }
    if args.json:
        return report
    if result.links_measured:
        rows = [
            [binary_bytes(b), f"{s * 1e3:.2f} ms", f"{b / s / 1e9:.3f} GB/s", "fit" if b >= FIT_FROM else ""]
            for b, s in zip(result.sizes, result.seconds)
        ]
        lines = [
            table(["message", "all-reduce", "algbw", ""], rows, align="rrrl"),
            "",
            f"fitted bus bandwidth {result.bandwidth / 1e9:.3f} GB/s, latency {result.latency * 1e6:.0f} us per "
            f"step; line within {result.fit_error:.0%} of measurements >= 4 MiB",
        ]
    else:
        lines = [f"links not measured (one rank): {base.name}'s are kept, {base.intra.bandwidth / 1e9:.0f} GB/s "
                 f"within a node and {base.inter.bandwidth / 1e9:.0f} GB/s between nodes"]
    if result.compute is not None:
        c, d = result.compute, result.cluster.device
        curve = ", ".join(f"{binary_flops(flops)} {e:.2f}" for flops, e in d.gemm_efficiency)
        peaks = ", ".join(f"{dtype} {rate / 1e9:,.1f}" for dtype, rate in c.peaks.items())
        # FLOPs are counted as the cost model counts them, the whole score matrix: a causal kernel (as a GPU is
        # timed) computes about half of them, and can read above peak; the efficiency is capped at 1
        capped = (f", capped: {c.attention / c.peaks[c.curve_dtype]:.2f} measured on a causal kernel, which "
                  "computes about half the FLOPs counted") if c.attention > c.peaks[c.curve_dtype] else ""
        lines += [
            f"compute per rank (all {result.ranks} rank{'s' if result.ranks > 1 else ''} at once): GEMM peak "
            f"{peaks} GFLOP/s; {c.curve_dtype} efficiency by GEMM size: {curve}",
            f"memory bandwidth {c.bandwidth / 1e9:.2f} GB/s; attention core ({c.curve_dtype}) "
            f"{c.attention / 1e9:,.1f} GFLOP/s ({d.efficiency['attention']:.2f} of peak{capped}); one op "
            f"{c.op_forward * 1e6:.1f} us forward, {c.op_backward * 1e6:.1f} us backward",
            "",
            f"measured against the {base.name} preset (share of its peak, and the efficiency it assumes):",
            against_table(report["against_base"]),
        ]
    else:
        lines.append("compute not measured (--links-only): the device keeps the cpu preset's figures")
    wrote = f"; wrote {args.out}" if out is not None else ""
    lines.append(f"{result.ranks} rank{'s' if result.ranks > 1 else ''}, {result.wall_seconds:.1f} s{wrote}")
    return "\n".join(lines)


def binary_flops(flops: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def against_table(rows: list[dict]) -> str:
    """One line per GEMM: its dtype and shape, the measured rate, its share of the preset's peak, the preset's
    efficiency there, and their ratio (above 1: the preset prices that GEMM too slow)."""
    return table(["dtype", "m x k x n", "FLOPs", "measured", "of peak", "preset", "ratio"], [
        [r["dtype"], f"{r['m']} x {r['k']} x {r['n']}", binary_flops(2.0 * r["m"] * r["k"] * r["n"]),
         f"{r['tflops']:.3g} TFLOP/s", f"{r['of_preset_peak']:.3f}", f"{r['preset_efficiency']:.3f}",
         f"{r['of_preset_peak'] / r['preset_efficiency']:.2f}"] for r in rows], align="llrrrrr")
