"""Run a plan on N local ranks (gloo on CPU, NCCL where CUDA is present) and collect what each step did."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from autopar.runtime.apply import check_supported, parallelize
from autopar.runtime.train import LEARNING_RATE, StepLog, Workload, build_model, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, nproc: int, port: int, plan: dict[str, Any], steps: int, check: bool, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=nproc)
    try:
        work = Workload.of(plan)
        model = build_model(work)
        parallel = parallelize(model, plan)
        optimizer = parallel.make_optimizer(torch.optim.SGD, lr=LEARNING_RATE)

        def average(value: float) -> float:
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t) / nproc

        dp, tp = plan["stages"][0]["dp"], plan["stages"][0]["tp"]
        log = train(
            parallel.module, optimizer, work, steps=steps, rank=rank // tp, dp=dp,
            gradients=parallel.full_gradients if check else None, reduce_loss=average,
        )
        if rank == 0:
            torch.save(log.__dict__, out)
    finally:
        dist.destroy_process_group()


def run_plan(plan: dict[str, Any], *, nproc: int, steps: int, check: bool = False) -> StepLog:
    """Train ``steps`` steps of ``plan`` on ``nproc`` spawned ranks; rank 0's log (gradients with ``check``)."""
    check_supported(plan)
    devices = plan["mesh"]["shape"][0] * plan["mesh"]["shape"][-1] if "stages" in plan else 0
    if devices != nproc:
        raise ValueError(f"the plan is for {devices} devices; run it with --nproc {devices}")
    with tempfile.TemporaryDirectory(prefix="autopar-run-") as tmp:
        out = str(Path(tmp) / "rank0.pt")
        try:
            mp.spawn(_rank_main, args=(nproc, _free_port(), plan, steps, check, out), nprocs=nproc, join=True)
        except mp.ProcessRaisedException as exc:  # a rank failed: report its own error in one line
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            raise RuntimeError(f"a rank failed: {lines[-1] if lines else exc}") from None
        data = torch.load(out)
    return StepLog(**data)
