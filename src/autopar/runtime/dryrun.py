"""``autopar dryrun``: apply a plan at its full world size in one process, on a fake process group with fake tensors,
and compare rank 0's collectives with the cost model's prediction.

The model is built on the meta device, parallelised exactly as `autopar run` does, then materialised as fake
tensors (no memory, no arithmetic); one training step runs through the same forward, backward and optimizer code.
The fake process group completes every collective at once without moving data, so a 64-way plan of a billion-
parameter model checks in seconds. Rank 0 holds the first stage, so its prediction is stage 0's. A pipeline is
rehearsed once per pipeline device, as the first rank of each (its stage, or its chunks when interleaved), each
running the plan's schedule with sends and receives that move nothing, and each compared with its own stages'
prediction. An intra-op plan is one stage of every rank: rank 0 is rehearsed, every micro-batch of its step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from autopar.plan import Plan
from autopar.runtime.comm import compare, rank_prediction, stage_predictions
from autopar.runtime.validate import check_runnable, fp32_else_bf16, rehearsal


def dryrun(plan: Plan, *, checked: bool = False) -> dict[str, Any]:
    """Counted against predicted collectives of rank 0 for one step of ``plan`` (``checked``: `check_runnable`
    has passed already, without its rehearsal, which this is)."""
    if not checked:
        check_runnable(plan, rehearse=False)
    start = time.perf_counter()
    per_device = plan.grid[0] * plan.grid[1] if plan.is_pipeline else plan.devices

    def attempt(dtype: torch.dtype) -> tuple[dict[str, Any], list[dict[str, Any]], torch.dtype]:
        expected = stage_predictions(plan, dtype=dtype)
        ranks = []
        for device in range(plan.pp if plan.is_pipeline else 1):
            rank = device * per_device
            result = compare(rehearsal(plan, count=True, rank=rank, dtype=dtype), rank_prediction(plan, expected, rank))
            ranks.append({"rank": rank, **result})
            if not result["ok"]:
                result = {**result, "message": f"rank {rank}: {result['message']}"}
                break
        return result, ranks, dtype

    # a pipeline plan's model rehearsed in bf16 where a fake kernel takes bf16 only (MoE's grouped matmul), with
    # the prediction in bf16 too; an intra-op plan in fp32 only, as it is checked when planned
    result, ranks, dtype = fp32_else_bf16(attempt) if plan.is_pipeline else attempt(torch.float32)
    first = ranks[0]
    return {"world_size": plan.devices, "seconds": time.perf_counter() - start, "ok": result["ok"],
            "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
            "rows": first["rows"], "message": result["message"] if not result["ok"] else first["message"],
            "ranks": ranks}
