"""Full against delta simulation (`autopar.cost.simulator`) on a 64-stage, 256-micro-batch pipeline.

Run: python bench/simulator.py [--changes N] [--schedule 1f1b|gpipe|interleaved] [--zero 0-3]. A random
pipeline (each stage: forward, backward, tp collectives, a send, four DDP buckets or FSDP units) is simulated in
full; then N times a random stage gets new figures of the same shape, and the new iteration is simulated both in
full (build the task graph, simulate every task) and by delta (re-time only what the changed stage's tasks reach,
from the previous timeline). Every delta timeline is checked equal to the full one, float for float.
Target: delta at least 5x faster than full.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from autopar.cost.simulator import PipelineSimulation, PipelineSpec, StageTimes, Unit


def stage(rng: random.Random, zero: int) -> StageTimes:
    """Milliseconds-scale figures of one stage, in seconds."""
    forward = rng.uniform(0.8e-3, 1.2e-3)
    units = tuple(Unit(forward=0.25, backward=0.25, gather=rng.uniform(5e-6, 2e-5) if zero else 0.0,
                       reduce=rng.uniform(1e-5, 4e-5), root=(k == 3 and zero > 0)) for k in range(4))
    return StageTimes(forward=forward, backward=2 * forward, forward_tp=0.1 * forward, backward_tp=0.1 * forward,
                      send=rng.uniform(2e-5, 4e-5), units=units)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved"), default="1f1b")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    chunks = 2 if args.schedule == "interleaved" else 1
    spec = PipelineSpec(stages=tuple(stage(rng, args.zero) for _ in range(64)), micro_batches=256,
                        schedule=args.schedule, chunks=chunks, zero=args.zero)
    start = time.perf_counter()
    sim = PipelineSimulation.full(spec)
    print(f"{args.schedule}, ZeRO {args.zero}: 64 stages ({64 // chunks} devices), 256 micro-batches, "
          f"{len(sim.timeline.tasks):,} tasks; first full simulation {time.perf_counter() - start:.2f} s, "
          f"iteration {sim.timeline.iteration * 1e3:.1f} ms")
    fulls, deltas, moved = [], [], []
    for _ in range(args.changes):
        index = rng.randrange(len(spec.stages))
        new = stage(rng, args.zero)
        start = time.perf_counter()
        changed = sim.change(index, new)
        deltas.append(time.perf_counter() - start)
        start = time.perf_counter()
        full = PipelineSimulation.full(changed.spec)
        fulls.append(time.perf_counter() - start)
        if (changed.timeline.start, changed.timeline.end) != (full.timeline.start, full.timeline.end):
            raise SystemExit(f"delta and full simulation differ after changing stage {index}")
        moved.append(sum(a != b for a, b in zip(sim.timeline.end, changed.timeline.end)) / len(full.timeline.end))
        sim = changed
    full_s, delta_s = statistics.median(fulls), statistics.median(deltas)
    print(f"{args.changes} random single-stage changes, delta equal to full every time")
    print(f"  full  simulation: median {full_s * 1e3:8.1f} ms (min {min(fulls) * 1e3:.1f}, max {max(fulls) * 1e3:.1f})")
    print(f"  delta simulation: median {delta_s * 1e3:8.1f} ms (min {min(deltas) * 1e3:.1f}, max {max(deltas) * 1e3:.1f})")
    print(f"  delta is {full_s / delta_s:.1f}x faster (target 5x); it re-timed {statistics.median(moved):.0%} of the "
          f"tasks (median)")


if __name__ == "__main__":
    main()
