"""Train a tiny Hugging Face Llama under an autopar plan, in your own training loop.

    torchrun --standalone --nproc-per-node 2 examples/train_llama.py [--steps 3] [--out result.pt]

Every rank builds the same model (one seed), rank 0 plans it (`autopar.plan_once`) and every rank receives that
plan; `autopar.parallelize` applies it, and each step `parallel.step(batch)` runs the forward and backward over this
rank's rows of the global batch (its micro-batches, or the pipeline schedule) and returns the loss one process
would see. The optimizer is yours, and so are gradient clipping (`parallel.clip_grad_norm_`: the whole model's
norm, whatever each rank holds) and the learning-rate schedule. With --out, rank 0 writes the losses and the final weights, gathered from every
rank, to a file (tests/test_api.py checks them against one process).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

import autopar

VOCAB, SEQ, BATCH = 128, 32, 8  # BATCH: the global batch of one optimizer step


def build_model() -> transformers.LlamaForCausalLM:
    """The same weights on every rank: one seed."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s whole batch, the same on every rank (a real loader could read only its rows:
    ``plan.local_batch(batch, rank).rows``)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="rank 0 writes the losses and final weights here (torch.save)")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = build_model()
    # cluster: the preset of your GPUs (a100-80g-sxm, h100-80g-sxm, ...) or a file from `autopar calibrate`
    plan = autopar.plan_once(model, global_batch(0), cluster="cpu", gpus=world, batch=BATCH, budget_s=10)
    if rank == 0:
        print(plan.explain(), flush=True)
    parallel = autopar.parallelize(model.to(device), plan)
    optimizer = parallel.make_optimizer(torch.optim.AdamW, lr=1e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 2))

    losses = []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = parallel.step({key: value.to(device) for key, value in global_batch(step).items()})
        norm = parallel.clip_grad_norm_(0.5)  # every rank: the norm one process would clip by
        optimizer.step()
        warmup.step()
        losses.append(loss)
        if rank == 0:
            print(f"step {step}: loss {loss:.6f}, gradient norm {norm:.4f}", flush=True)

    weights = parallel.full_parameters()  # this rank's (a pipeline stage holds some), whole
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({name: w.cpu() for name, w in weights.items()}, gathered, dst=0)
    if rank == 0 and args.out:
        merged = {name: w for part in gathered for name, w in part.items()}
        torch.save({"losses": losses, "weights": merged, "plan": plan.to_dict()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
