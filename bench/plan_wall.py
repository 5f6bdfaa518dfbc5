"""Wall time of `autopar plan` as a user runs it: a fresh process each time, start-up, model build, trace,
search, simulation of the finalists and the plan-time check, with the CLI's defaults.

Run: python bench/plan_wall.py [--runs N] [--quick]. Prints, per case, the wall time of each run and their median,
the search's own seconds, the plan's iteration time, who found it and whether the search converged (a converged
search finds the same plan every run), and how long a fixed loop of pure Python took just before each case: on a
shared machine whose speed varies from minute to minute, compare runs by it. Targets: gpt3-175b on 1,024 GPUs and the 1,000-layer GPT each under 10 s,
llama-70b on 16,384 GPUs under 30 s. `AUTOPAR_WORKERS=1` in the environment measures one search process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CASES = [
    ("gpt3-175b, 1,024 GPUs", ["gpt3-175b", "--gpus", "1024", "--batch", "1536"], 10.0),
    ("GPT d=1024, 1,000 layers, 8 GPUs", ["gpt3-1.3b", "--layers", "1000", "--hidden", "1024", "--cluster",
                                          "v100-32g-nvlink", "--gpus", "8", "--batch", "64"], 10.0),
    ("llama-70b, 16,384 GPUs", ["llama-70b", "--gpus", "16384", "--batch", "8192"], 30.0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per case (default 3)")
    parser.add_argument("--quick", action="store_true", help="gpt3-175b only")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    print(f"{'case':34} {'runs, wall s':>24} {'median':>7} {'target':>7} {'search s':>9} {'s/iteration':>12}"
          f" {'loop s':>7}  found by")
    for name, command, target in cases:
        loop = _loop_seconds()
        walls, searches, plans = [], [], set()
        for _ in range(args.runs):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "autopar.cli.main", "plan", *command, "--json"],
                                  capture_output=True, text=True)
            walls.append(time.perf_counter() - start)
            if done.returncode not in (0, 3):
                sys.exit(f"{name}: autopar plan failed ({done.returncode}): {done.stderr.strip()}")
            data = json.loads(done.stdout)
            searches.append(data["search_seconds"])
            plans.add((round(data["estimate"]["iteration_seconds"], 6), data["found_by"], data["converged"]))
        runs = " ".join(f"{w:.1f}" for w in walls)
        median = statistics.median(walls)
        for seconds, by, converged in sorted(plans):
            print(f"{name:34} {runs:>24} {median:7.1f} {'<' + format(target, '.0f'):>7} "
                  f"{statistics.median(searches):9.1f} {seconds:12.3f} {loop:7.2f}  "
                  f"{by}{'' if converged else ' (not converged)'}")
        if len(plans) > 1:
            print(f"  {name}: the runs found {len(plans)} different plans")


def _loop_seconds() -> float:
    """Seconds of 20 million additions in a Python loop: this machine's speed right now."""
    start = time.perf_counter()
    total = 0
    for i in range(20_000_000):
        total += i
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
