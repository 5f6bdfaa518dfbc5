"""``autopar dryrun``: apply a plan at its full world size in one process, on a fake process group with fake tensors,
and compare rank 0's collectives with the cost model's prediction.

The model is built on the meta device, parallelised exactly as `autopar run` does, then materialised as fake
tensors (no memory, no arithmetic); one training step runs through the same forward, backward and optimizer code.
The fake process group completes every collective at once without moving data, so a 64-way plan of a billion-
parameter model checks in seconds. Rank 0 holds the first stage, so its prediction is stage 0's.
"""

from __future__ import annotations

import time
from typing import Any

from autopar.plan import Plan
from autopar.runtime.comm import compare, stage_predictions
from autopar.runtime.validate import check_runnable, rehearsal


def dryrun(plan: Plan, *, checked: bool = False) -> dict[str, Any]:
    """Counted against predicted collectives of rank 0 for one step of ``plan`` (``checked``: `check_runnable`
    has passed already, without its rehearsal, which this is)."""
    if not checked:
        check_runnable(plan, rehearse=False)
    if len(plan.stages) > 1:
        raise NotImplementedError("dryrun of pipeline plans is not supported yet (the schedule exchanges shapes "
                                  "with real peers); check them with autopar run --check-comm")
    start = time.perf_counter()
    counted = rehearsal(plan, count=True)
    result = compare(counted, stage_predictions(plan)[0])
    return {"world_size": plan.devices, "seconds": time.perf_counter() - start, **result}
