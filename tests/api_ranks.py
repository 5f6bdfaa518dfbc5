"""What each rank runs in tests/test_api.py's multi-process tests (ranks import it by name), and the
model and batches they share with examples/train_llama.py."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"


def example() -> Any:
    """examples/train_llama.py as a module: its `build_model` and `global_batch`."""
    if "train_llama" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_llama", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_llama"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_llama"]


def one_process(steps: int, *, lr: float = 1e-3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The example's training in one process, without autopar: the whole global batch each step, AdamW, its
    gradients clipped by PyTorch's own function and its rate warmed up as the example does."""
    ex = example()
    model = ex.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 2))
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**ex.global_batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        warmup.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def train(rank: int, rendezvous: Any, plan: Any, steps: int) -> dict[str, Any]:
    """The example's loop on one rank of ``plan``: losses and the parameters this rank holds, whole (`weights`)."""
    import torch.distributed as dist

    import autopar

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="gloo")
    try:
        ex = example()
        parallel = autopar.parallelize(ex.build_model(), plan)
        optimizer = parallel.make_optimizer(torch.optim.AdamW, lr=1e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 2))
        losses = []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            losses.append(parallel.step(ex.global_batch(step)))
            parallel.clip_grad_norm_(0.5)
            optimizer.step()
            warmup.step()
        weights = io.BytesIO()  # tensors through the launcher's pipe would be shared memory its rank no longer holds
        torch.save(parallel.full_parameters(), weights)
        dist.barrier()
        return {"losses": losses, "weights": weights.getvalue()}
    finally:
        dist.destroy_process_group()


def plan_once(rank: int, rendezvous: Any, batch: int, search: str) -> dict[str, Any]:
    """`autopar.plan_once` on every rank: rank 0's plan as each rank received it, or the error each rank raised."""
    import torch.distributed as dist

    import autopar

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="gloo")
    try:
        ex = example()
        try:
            plan = autopar.plan_once(ex.build_model(), ex.global_batch(0), cluster="cpu", gpus=2, batch=batch,
                                     search=search, budget_s=5)
        except ValueError as exc:
            return {"error": str(exc)}
        return {"plan": plan.to_dict(), "report": plan.explain()}
    finally:
        dist.barrier()  # no rank tears gloo down while its peer still finishes the error's broadcast (SIGABRT)
        dist.destroy_process_group()


def weights(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(result["weights"]))
