"""Training steps on synthetic data, on a rank of a plan or in one process as the reference.

Every rank builds the model from the plan's workload with one seed (so all start from the same weights), draws the
same global batch for each step from a seeded generator, and takes its data-parallel slice of each micro-batch.
Losses are scaled by 1/micro-batches and gradients accumulate, so a rank's averaged gradient equals the
single-process gradient of the whole global batch. Dropout is off: ranks and the reference must see the same
numbers. The optimizer is SGD (Adam's eps turns 1e-9 gradient noise into visible parameter differences).
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.plan import Plan
from autopar.runtime.apply import ParallelModel
from autopar.runtime.comm import CollectiveCounter
from autopar.zoo import config_for, load, synthetic_batch

LEARNING_RATE = 0.05


@dataclass(frozen=True, slots=True)
class Workload:
    model: str
    overrides: dict[str, int]
    seq: int
    batch: int  # global batch per step
    micro_batch: int  # samples per micro-batch across the data-parallel ranks
    micro_batches: int

    @classmethod
    def of(cls, plan: Plan) -> Workload:
        work = plan.workload
        if work is None:
            raise ValueError("the plan has no workload (model, overrides, seq, batch) to rebuild its model from: it "
                             "was written by an older autopar; plan again with autopar plan --out")
        return cls(model=work.model, overrides=work.override_map, seq=work.seq, batch=work.batch,
                   micro_batch=plan.micro_batch_size, micro_batches=plan.micro_batches)


@dataclass
class StepLog:
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    collectives: list[list[dict]] = field(default_factory=list)  # per rank: calls and bytes per (kind, axis)


def build_model(work: Workload, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    zoo = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, device="cpu", dropout=0.0, **work.overrides)
    return zoo.module.train()


def global_batch(work: Workload, step: int) -> dict[str, torch.Tensor]:
    """The step's whole batch: token ids below the vocabulary, floats from a normal, from a seeded generator (a
    user's function: its inputs under the step's seed; `autopar.zoo.synthetic_batch`)."""
    config = config_for(work.model, seq=work.seq, **work.overrides)
    return synthetic_batch(config, batch=work.batch, seq=work.seq, seed=10_000 + step)


def train(
    parallel: ParallelModel, optimizer: torch.optim.Optimizer, work: Workload, *, steps: int, rank: int = 0,
    dp: int = 1,
    gradients=None,  # noqa: ANN001 - callable returning the whole gradients after backward
    reduce_loss=None,  # noqa: ANN001 - callable averaging a float over ranks
    counter: CollectiveCounter | None = None,  # counts the collectives of the last step
) -> StepLog:
    log = StepLog()
    share = work.micro_batch // dp
    m = work.micro_batches
    for step in range(steps):
        batch = global_batch(work, step)
        optimizer.zero_grad(set_to_none=True)
        counting = counter if counter is not None and step == steps - 1 else contextlib.nullcontext()
        start = time.perf_counter()
        total = 0.0
        with counting:
            if parallel.pipeline is not None:
                total = _pipeline_step(parallel.pipeline, batch, work, rank=rank, dp=dp)
            else:
                for k in range(m):
                    first = k * work.micro_batch + rank * share
                    inputs = {key: value[first : first + share] for key, value in batch.items()}
                    with parallel.micro_batch(k, m):
                        loss = loss_of(parallel.module(**inputs)) / m
                        loss.backward()
                    total += float(loss.detach())
            parallel.finish_backward()
            if gradients is not None:
                _paused(counter, lambda: log.grads.append(gradients()))
            optimizer.step()
        log.seconds.append(time.perf_counter() - start)
        log.losses.append(reduce_loss(total) if reduce_loss is not None else total)
        log.peak_bytes.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return log


def loss_of(output) -> torch.Tensor:  # noqa: ANN001
    """The training loss a forward returned: the zoo's models return it, Hugging Face ones carry it as ``.loss``."""
    return output if isinstance(output, torch.Tensor) else output.loss


def _pipeline_step(pipeline, batch: dict[str, torch.Tensor], work: Workload, *, rank: int, dp: int) -> float:  # noqa: ANN001
    """One step through the schedule: this data-parallel rank's slice of every micro-batch, back to back (the
    schedule splits them again). Returns the mean micro-batch loss on the last stage, 0 elsewhere."""
    share = work.micro_batch // dp
    rows = torch.cat([torch.arange(share) + k * work.micro_batch + rank * share for k in range(work.micro_batches)])
    mine = {key: value[rows] for key, value in batch.items()}
    losses: list[torch.Tensor] = []
    if pipeline.first:
        pipeline.schedule.step(mine["input_ids"])
    elif pipeline.last:
        pipeline.schedule.step(target=mine["labels"], losses=losses)
    else:
        pipeline.schedule.step()
    pipeline.sync_tied()
    return float(sum(loss.detach() for loss in losses)) / work.micro_batches if losses else 0.0


def _paused(counter: CollectiveCounter | None, work) -> None:  # noqa: ANN001
    """Run ``work`` (the check's own gathers) without counting its collectives."""
    if counter is None:
        work()
        return
    counter.enabled = False
    try:
        work()
    finally:
        counter.enabled = True


def reference(work: Workload, *, steps: int, seed: int = 0) -> StepLog:
    """The same steps in one process with no parallelism."""
    module = build_model(work, seed=seed)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)

    def grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}

    plain = ParallelModel(module, 0, lambda cls, **kw: cls(module.parameters(), **kw))
    return train(plain, optimizer, work, steps=steps, gradients=grads)
