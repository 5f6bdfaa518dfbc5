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

import torch

from autopar.plan import Plan
from autopar.runtime.apply import parallelize
from autopar.runtime.comm import CollectiveCounter, compare, stage_predictions
from autopar.runtime.train import LEARNING_RATE, Workload, global_batch, loss_of
from autopar.runtime.validate import check_runnable


def dryrun(plan: Plan, *, checked: bool = False) -> dict[str, Any]:
    """Counted against predicted collectives of rank 0 for one step of ``plan`` (``checked``: `check_runnable`
    has passed already)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.zoo import load

    if not checked:
        check_runnable(plan)
    work = Workload.of(plan)
    if len(plan.stages) > 1:
        raise NotImplementedError("dryrun of pipeline plans is not supported yet (the schedule exchanges shapes "
                                  "with real peers); check them with autopar run --check-comm")
    world = plan.devices
    if dist.is_initialized():
        raise RuntimeError("dryrun needs its own fake process group; a process group is already initialised")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, device="meta", dropout=0.0,
                     **work.overrides).module.train()
        # DDP's constructor reads its weights' values, which neither meta nor fake tensors have: the gradients go
        # through the by-hand all-reduce instead, in the same buckets (``autopar run --check-comm`` checks DDP)
        parallel = parallelize(model, plan, ddp=False)
        with FakeTensorMode(allow_non_fake_inputs=True):
            _materialise(parallel.module)  # FSDP and DTensor shard meta weights; their shards become fakes here
            optimizer = parallel.make_optimizer(torch.optim.SGD, lr=LEARNING_RATE)
            counter = CollectiveCounter(parallel.axes)
            batch = global_batch(work, 0)
            with counter:
                _step(parallel, optimizer, work, batch, dp=plan.grid[0])
        counted = counter.summary()
    finally:
        dist.destroy_process_group()
    result = compare(counted, stage_predictions(plan)[0])
    return {"world_size": world, "seconds": time.perf_counter() - start, **result}


def _materialise(module: torch.nn.Module) -> None:
    """Meta weights to fake ones, keeping weights that several modules share shared."""
    owners = [(m, key, p) for m in module.modules() for key, p in m._parameters.items() if p is not None]
    module.to_empty(device="cpu")
    first: dict[int, torch.nn.Parameter] = {}
    for m, key, old in owners:
        if id(old) in first:
            m._parameters[key] = first[id(old)]
        else:
            first[id(old)] = m._parameters[key]


def _step(parallel, optimizer, work: Workload, batch: dict[str, torch.Tensor], *, dp: int) -> None:  # noqa: ANN001
    """One training step of rank 0 (data-parallel coordinate 0) of a single-stage plan, losses left unread (they
    are fake)."""
    share = work.micro_batch // dp
    m = work.micro_batches
    for k in range(m):
        inputs = {key: value[k * work.micro_batch : k * work.micro_batch + share] for key, value in batch.items()}
        with parallel.micro_batch(k, m):
            (loss_of(parallel.module(**inputs)) / m).backward()
    parallel.finish_backward()
    optimizer.step()
