"""Predicted against measured peak memory: the cost model's estimate, less the device reserve, against PyTorch's
`MemTracker` on one training step of the same plan as the runtime applies it (the cases of
tests/test_memory_tracker.py: two small zoo models, DP, ZeRO 1/2/3, TP and PP on 2 ranks, at two sizes).

Run: python bench/memory.py [--quick]. Single-stage plans are measured on a fake process group with fake tensors
(seconds each), pipelines on real gloo ranks (about 15 s each). Target: every case within 5%.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memory_tracking import CASES, measured_peaks, plan_for  # noqa: E402

MIB = 2**20


def main() -> None:
    cases = [c for c in CASES if c.kind != "PP"] if "--quick" in sys.argv else CASES
    print(f"{'case':24s} {'stage':>5s} {'predicted':>10s} {'measured':>10s} {'error':>7s} {'seconds':>7s}")
    worst = 0.0
    for case in cases:
        start = time.perf_counter()
        plan, predicted = plan_for(case)
        measured = measured_peaks(plan)
        seconds = time.perf_counter() - start
        for stage, (memory, peak) in enumerate(zip(predicted, measured)):
            error = (memory.allocated - peak) / peak
            worst = max(worst, abs(error))
            print(f"{case.name:24s} {stage:5d} {memory.allocated / MIB:8.2f} MiB {peak / MIB:6.2f} MiB "
                  f"{error:+7.2%} {seconds:7.1f}")
    print(f"largest error {worst:.2%} (target 5%)")


if __name__ == "__main__":
    main()
