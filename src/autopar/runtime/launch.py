"""Run a plan on N local ranks (gloo on CPU, NCCL where CUDA is present) and collect what each step did."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from autopar.cluster.ranks import Rendezvous, prestart, run_ranks, sigterm_raises
from autopar.plan import Plan
from autopar.runtime.apply import parallelize
from autopar.runtime.comm import CollectiveCounter
from autopar.runtime.train import LEARNING_RATE, StepLog, Workload, build_model, train
from autopar.runtime.validate import check_runnable


def _rank_main(
    rank: int, rendezvous: Rendezvous, plan: Plan, steps: int, check: bool, check_comm: bool, out: str,
    clip: float | None = None,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        work = Workload.of(plan)
        model = build_model(work)
        parallel = parallelize(model, plan)
        optimizer = parallel.make_optimizer(torch.optim.SGD, lr=LEARNING_RATE)

        counter = CollectiveCounter(parallel.axes) if check_comm else None
        log = train(parallel, optimizer, work, steps=steps, gradients=parallel.full_gradients if check else None,
                    counter=counter, clip=clip, weights=parallel.full_parameters if check else None)
        if counter is not None:
            torch.save(counter.summary(), f"{out}.comm{rank}")
        # another stage's first rank: its stage's gradients (an intra-op plan's rank 0 holds them all)
        if check and plan.is_pipeline and rank % math.prod(plan.grid) == 0 and rank > 0:
            torch.save({"grads": log.grads, "weights": log.weights}, f"{out}.grads{rank}")
        if rank == 0:
            torch.save(log.__dict__, out)
        dist.barrier()  # no rank may tear gloo down while a peer still finishes its last collective (SIGABRT)
    finally:
        dist.destroy_process_group()


def _apart(name: str, step: int, first: torch.Tensor, other: torch.Tensor, rank: int, plan: Plan) -> str:
    when = "before the first step" if step == 0 else f"after step {step - 1}"
    if first.shape != other.shape:
        return (f"{when}, pipeline ranks hold {name} in different shapes ({list(first.shape)} and "
                f"{list(other.shape)}, pipeline rank {rank // math.prod(plan.grid)}'s second)")
    return (f"{when}, pipeline ranks hold different copies of {name} (pipeline rank {rank // math.prod(plan.grid)}'s"
            f" is up to {float((first - other).abs().max()):.3g} from an earlier one's): a tied weight's copies must "
            "start alike and get the same gradient and step")


def prestart_for(plan: Plan) -> None:
    """Start the fork server ``plan``'s ranks start from (`prestart`), importing transformers too where the plan's
    model is a Hugging Face one (``hf:...``)."""
    prestart(hugging_face=plan.workload is not None and plan.workload.model.startswith("hf:"))


def run_plan(
    plan: Plan, *, nproc: int, steps: int, check: bool = False, check_comm: bool = False, checked: bool = False,
    clip: float | None = None,
) -> StepLog:
    """Train ``steps`` steps of ``plan`` on ``nproc`` new ranks; rank 0's log (gradients with ``check``, every
    rank's collectives in the last step with ``check_comm``; ``checked``: `check_runnable` has passed already;
    ``clip``: the gradients' norm clipped to it before each optimizer step).

    A rank that dies or raises stops every rank and raises `RankError` naming it; an interrupt (or SIGTERM) stops
    them too, and the temporary folder of the ranks' results is removed in every case."""
    prestart_for(plan)  # the ranks' imports, beside the checks
    if not checked:
        check_runnable(plan)
    devices = plan.devices
    if devices != nproc:
        raise ValueError(f"the plan is for {devices} devices; run it with --nproc {devices}")
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="autopar-run-") as tmp:
        out = str(Path(tmp) / "rank0.pt")
        run_ranks(_rank_main, nproc, args=(plan, steps, check, check_comm, out, clip))
        data = torch.load(out)
        for r in range(1, nproc):  # merge the other stages' gradients and weights into rank 0's
            path = Path(f"{out}.grads{r}")
            if path.exists():
                stage = torch.load(path)
                for mine, theirs in zip(data["grads"], stage["grads"]):
                    for name, grad in theirs.items():
                        mine.setdefault(name, grad)
                for step, (mine, theirs) in enumerate(zip(data["weights"], stage["weights"])):
                    for name, weight in theirs.items():
                        held = mine.setdefault(name, weight)
                        if held is not weight and not torch.equal(held, weight):  # a tied weight, on two stages
                            data["apart"].append(_apart(name, step, held, weight, r, plan))
        if check_comm:
            data["collectives"] = [torch.load(f"{out}.comm{r}") for r in range(nproc)]
    return StepLog(**data)
