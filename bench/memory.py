"""Predicted against measured peak memory: the cost model's estimate, less the device reserve, against PyTorch's
`MemTracker` on one training step of the same plan as the runtime applies it (the cases of
tests/test_memory_tracker.py: two small zoo models, DP, ZeRO 1/2/3, TP and PP on 2 ranks, at two sizes).

Run: python bench/memory.py [--quick] [--intra]. Single-stage plans are measured on a fake process group with fake
tensors (seconds each), pipelines on real gloo ranks (about 15 s each). Target: every case within 5%.

``--laid-out`` measures pipeline stages whose layers the intra-op planner lays out (tests/intra_stages.py: GPT
and LLaMA of 4 layers, hidden 1024, sequence 512, on tp 2, dp 2 x tp 2 under ZeRO 0-3, recomputed or not).

``--intra`` measures intra-op plans instead (`autopar plan --search ilp`'s estimate): both models in data
parallelism on 2 ranks and in Megatron's layout on a 2 x 2 mesh, at both sizes, one and two micro-batches, ZeRO
0-2, with none, half and all of their layers recomputed in full.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memory_tracking import (  # noqa: E402
    CASES,
    INTRA_KINDS,
    MODELS,
    intra_plan_for,
    measured_peaks,
    plan_for,
    single_stage_peak,
)

MIB = 2**20


INTRA_RUNS = [  # (size, micro-batches, ZeRO, layers recomputed of 4)
    ("long", 1, 0, 0), ("long", 1, 0, 2), ("long", 1, 0, 4), ("long", 2, 1, 0), ("long", 2, 2, 2),
    ("short", 1, 0, 0), ("short", 1, 1, 0), ("short", 1, 2, 0),
    ("long", 1, 3, 0), ("long", 2, 3, 2), ("long", 1, 3, 4), ("short", 1, 3, 0),
]


def intra() -> None:
    print(f"{'case':44s} {'predicted':>10s} {'measured':>10s} {'error':>7s} {'seconds':>7s}")
    worst = 0.0
    for model in MODELS:
        for kind in INTRA_KINDS:
            for size, micro_batches, zero, recomputed in INTRA_RUNS:
                start = time.perf_counter()
                plan, memory = intra_plan_for(model, kind, recomputed=recomputed, size=size, zero=zero,
                                              micro_batches=micro_batches)
                name = f"{model} {kind} {size} x{micro_batches} ZeRO {zero}, {recomputed}/4 recomputed"
                worst = max(worst, _measured(name, plan, memory.total - memory.reserve, start, width=44))
    print(f"largest error {worst:.1%} (target 5%)")


def _measured(name: str, plan: Any, predicted: float, start: float, *, width: int) -> float:
    """Print ``plan``'s predicted and measured peak (one stage) and return the relative error's size."""
    single_stage_peak(plan)  # the first time a layout runs, fake tensors' caches hold more: let them fill
    peak = single_stage_peak(plan)
    error = (predicted - peak) / peak
    print(f"{name:{width}s} {predicted / MIB:6.1f} MiB {peak / MIB:6.1f} MiB {error:+7.1%} "
          f"{time.perf_counter() - start:7.1f}")
    return abs(error)


LAID_OUT = [  # (model, layout of each layer, plan options)
    ("gpt", {"attn.qkv": "n", "attn.proj": "n", "mlp.fc1": "n", "mlp.fc2": "k"}, {}),
    ("gpt", {"attn.qkv": "n", "attn.proj": "n", "mlp.fc1": "n", "mlp.fc2": "k"}, {"recompute": "full"}),
    ("gpt", {"attn.qkv": "n", "attn.proj": "n", "mlp.fc1": "n", "mlp.fc2": "k"}, {"micro_batch": 4, "batch": 8}),
    ("gpt", {"attn.qkv": "R", "attn.proj": "R", "mlp.fc1": "m", "mlp.fc2": "R"},
     {"dp": 2, "batch": 8, "micro_batch": 4}),
    ("gpt", {"attn.qkv": "R", "attn.proj": "R", "mlp.fc1": "m", "mlp.fc2": "R"},
     {"dp": 2, "batch": 8, "micro_batch": 4, "zero": 1}),
    ("gpt", {"attn.qkv": "n", "attn.proj": "n", "mlp.fc1": "n", "mlp.fc2": "k"},
     {"dp": 2, "batch": 8, "micro_batch": 4, "zero": 3}),
    ("llama", {"attn.qkv": "n", "attn.proj": "n", "mlp.gate": "n", "mlp.up": "n", "mlp.down": "k"}, {}),
    ("llama", {"attn.qkv": "n", "attn.proj": "n", "mlp.gate": "n", "mlp.up": "n", "mlp.down": "k"},
     {"recompute": "full"}),
    ("llama", {"attn.qkv": "n", "attn.proj": "n", "mlp.gate": "n", "mlp.up": "n", "mlp.down": "k"},
     {"dp": 2, "batch": 8, "micro_batch": 4, "zero": 2}),
]


def laid_out() -> None:
    import intra_stages

    from autopar.plan import Plan

    print(f"{'case':60s} {'predicted':>10s} {'measured':>10s} {'error':>7s} {'seconds':>7s}")
    worst = 0.0
    for family, splits, options in LAID_OUT:
        start = time.perf_counter()
        plan = Plan.from_dict(intra_stages.plan(family, splits, large=True, **options))
        name = f"{family} {' '.join(splits.values())} {' '.join(f'{k} {v}' for k, v in options.items())}"
        worst = max(worst, _measured(name, plan, plan.stages[0].memory.allocated, start, width=60))
    print(f"largest error {worst:.1%} (target 5%)")


def main() -> None:
    if "--intra" in sys.argv:
        intra()
        return
    if "--laid-out" in sys.argv:
        laid_out()
        return
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
