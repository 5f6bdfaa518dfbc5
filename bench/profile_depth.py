"""Does profiling a model's segments cost the same whatever its depth? (CFP's depth independence.)

Run: python bench/profile_depth.py [--layers 10 1000] [--nproc 2] [--hidden 256].
Times `autopar profile-segments` of one GPT at each depth on NPROC ranks over the same layouts (tp 1 and NPROC,
ZeRO 0, no recomputation, one sample per device), each into a fresh database, and prints the wall time, the
distinct layers timed, and the ratio of each depth's time to the shallowest's. Repeated layers are copies of one
another: the profiler keeps one of each kind, so the ratio should stay near 1 (the target is under 1.5); what
grows with depth is building and tracing the model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    print(f"{'layers':>7} {'wall':>8} {'distinct layers':>16} {'entries':>8} {'ratio':>6}", flush=True)
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            db = Path(tmp) / f"db{layers}.json"
            argv = [sys.executable, "-m", "autopar.cli.main", "profile-segments", "gpt3-125m", "--layers",
                    str(layers), "--hidden", str(args.hidden), "--heads", "8", "--vocab", "2048", "--seq", "128",
                    "--nproc", str(args.nproc), "--tp", "1", str(args.nproc), "--samples", "1", "--recompute",
                    "none", "--zero", "0", "--no-sp", "--db", str(db), "--json"]
            start = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode != 0:
                raise SystemExit(f"profile-segments at {layers} layers failed: {done.stderr.strip()}")
            data = json.loads(done.stdout)
            first = first or wall
            print(f"{layers:>7} {wall:7.1f}s {data['distinct_layers']:>16} {len(data['entries']):>8} "
                  f"{wall / first:6.2f}", flush=True)


if __name__ == "__main__":
    main()
