"""Intra-op assignments for the multi-process tests of tests/test_intra_runtime.py (ranks import this by name):
random legal per-block layouts of a tiny model, applied by `autopar.runtime.intra` and trained with AdamW beside
one process training the same model on the same batches."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

MODELS = {
    "gpt": ("gpt3-125m", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}),
    "llama": ("llama-7b", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "ffn": 128}),
    "hf-llama": ("hf:llama-tiny", {}),  # Hugging Face's LlamaForCausalLM: q, k and v apart, its own rotary
    # Hugging Face models from config whose forms the tiny zoo models lack: a position table looked up with
    # positions `arange` makes (GPT-2), or a buffer (BERT, with token types), or passed by keyword (OPT); norms
    # that scale by ``1 + weight`` (Gemma); a parallel attention and MLP (Phi); q and k norms (Qwen3)
    # (ffn 128: their configs' own MLP widths, up to Gemma's 24,576, would hold nearly all the weights and time)
    **{f"hf-{kind}": (f"hf:{kind}", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "ffn": 128})
       for kind in ("gpt2", "bert", "opt", "gemma", "phi", "qwen3")},
}
SEQ = 32


def _space(family: str, mesh: tuple[int, ...], *, batch: int, traced: int) -> tuple[str, Any, Any]:
    """(model name, workload of ``batch`` samples, intra-op space of the tiny ``family`` model traced at ``traced``
    samples on ``mesh`` of an A100 cluster)."""
    from autopar.capture import trace
    from autopar.cluster import build_mesh, load_cluster
    from autopar.plan import Workload
    from autopar.search.intra import build_space
    from autopar.zoo import load

    name, overrides = MODELS[family]
    cluster = load_cluster("a100-80g-sxm").with_devices(math.prod(mesh))
    axes = build_mesh(cluster, {f"x{i}": n for i, n in enumerate(mesh)})
    work = Workload(model=name, overrides=tuple(sorted(overrides.items())), seq=SEQ, batch=batch, dtype="fp32")
    zoo = load(name, batch=traced, seq=SEQ, dtype=torch.float32, **overrides)
    return name, work, build_space(trace(zoo.module, example_kwargs=zoo.inputs), axes, cluster)


def assignments(family: str, count: int, *, seed: int, mesh: tuple[int, ...] = (2, 2), batch: int = 8,
                micro_batches: tuple[int, ...] = (1, 2), zero: tuple[int, ...] = (0,),
                recompute: bool = False) -> list[dict[str, Any]]:
    """``count`` plans (as dicts) of the tiny ``family`` model on ``mesh``: each block's split drawn at random
    among its legal candidates, the micro-batch count at random among ``micro_batches`` and the ZeRO stage among
    ``zero`` (the first plan keeps the programme's Megatron layout, the second pure data parallelism); with
    ``recompute``, each repeated layer also recomputed in full or not at random."""
    from autopar.search.intra import baseline_choice, plan_of_choice, repeated_layers

    rng = random.Random(seed)
    spaces = {}
    plans = []
    for k in range(count):
        m = rng.choice(micro_batches)
        if m not in spaces:
            spaces[m] = _space(family, mesh, batch=batch, traced=batch // m)
        name, work, space = spaces[m]
        choice = baseline_choice(space, "megatron") if k == 0 else baseline_choice(space, "dp") if k == 1 else None
        if choice is None:
            choice = tuple(rng.randrange(len(c)) for c in space.candidates)
        stage = rng.choice(zero) if len(zero) > 1 else zero[0]  # one stage: the draws as they were
        again = [layer for layer in repeated_layers(space) if rng.random() < 0.5] if recompute else []
        intra = plan_of_choice(space, choice, global_batch=batch, micro_batches=m, zero=stage, dtype="fp32",
                               recompute=again)
        plans.append(intra.to_plan(name, work).to_dict())
    return plans


def variant(family: str, splits: dict[str, str], *, base: str = "dp", zero: int = 0, batch: int = 8,
            mesh: tuple[int, ...] = (2, 2)) -> dict[str, Any]:
    """The plan (as a dict) of the tiny ``family`` model laid out as the ``base`` baseline, except the blocks led by
    the modules in ``splits``, split as named there (`Block.split`: ``"vocab,vocab"``)."""
    from autopar.search.intra import baseline_choice, plan_of_choice

    name, work, space = _space(family, mesh, batch=batch, traced=batch)
    choice = list(baseline_choice(space, base))
    for block in space.blocks.blocks:
        wanted = splits.get(space.graph.node(block.leader).module)
        if wanted is not None:
            v = space.var_of[block.id]
            choice[v] = next(k for k, c in enumerate(space.candidates[v]) if space.cost.describe(block, c) == wanted)
    intra = plan_of_choice(space, tuple(choice), global_batch=batch, zero=zero, dtype="fp32")
    return intra.to_plan(name, work).to_dict()


def contracted(family: str) -> dict[str, str]:
    """The splits of the layout `autopar plan gpt3-1.3b --search ilp --mesh 8x8` chooses, for the tiny ``family``
    model (module -> split, for `variant`): the embedding split by features on the second axis; q, k and v, the
    attention's output projection and the MLP's last projection split by the features they contract (pending sums
    the attention and the stream reduce-scatter); the MLP's first projections (GPT's one, LLaMA's gate and up) by
    the features they make; the batch split on the first axis throughout."""
    mlp = ("fc1",) if family == "gpt" else ("gate", "up")
    last = "fc2" if family == "gpt" else "down"
    splits = {"embed": "batch,n"}
    for layer in range(MODELS[family][1]["layers"]):
        splits |= {f"layers.{layer}.attn.qkv": "m,k", f"layers.{layer}.attn.proj": "m,k",
                   f"layers.{layer}.mlp.{last}": "m,k", **{f"layers.{layer}.mlp.{m}": "m,n" for m in mlp}}
    return splits


def mixed(family: str, *, batch: int = 8) -> dict[str, dict[str, Any]]:
    """Plans (as dicts) of the tiny ``family`` model on a 2 x 2 mesh that split weights: Megatron's layout (with
    its pending sums reduce-scattered over the sequence), and two that are not Megatron's: the attention blocks in
    Megatron's layout and the MLP's split by batch on both axes, and the other way round (the stream converted
    between the sequence split and the batch split by all-to-alls)."""
    from autopar.search.intra import baseline_choice, plan_of_choice

    name, work, space = _space(family, (2, 2), batch=batch, traced=batch)
    megatron, dp = baseline_choice(space, "megatron"), baseline_choice(space, "dp")
    modules = [space.graph.node(b.leader).module for b in space.representative]

    def attention(module: str) -> bool:
        return ".attn" in module or ".self_attn" in module

    def mlp(module: str) -> bool:
        return ".mlp" in module

    choices = {"megatron": megatron}
    for label, split in (("attention megatron, mlp by batch", attention), ("mlp megatron, attention by batch", mlp)):
        choices[label] = tuple(megatron[v] if split(m) else dp[v] for v, m in enumerate(modules))
    return {label: plan_of_choice(space, choice, global_batch=batch, dtype="fp32").to_plan(name, work).to_dict()
            for label, choice in choices.items()}


def train_each(rank: int, rendezvous: Any, plans: list[dict[str, Any]], steps: int, *,
               catch: bool = False, extras: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """On each rank, every plan in turn: ``steps`` AdamW steps of the plan's model and, in this process alone, of
    the same model on the same batches. Per plan: ``loss``, the largest difference between the losses;
    ``grads``, the largest difference between the first step's whole gradients; ``drift``, the largest
    difference after the last step between copies of a parameter's shard that ranks hold replicated (0 unless
    replicas drifted apart). With ``catch``, a plan that raises gives ``error`` instead (every rank raises at
    the same op: the layouts are the same on all). ``extras`` (per plan) may ask for ``clip`` (max norm, norm
    type): both clip their gradients before each step, the ranks with `ParallelModel.clip_grad_norm_`, the process
    with PyTorch's own; ``norm`` is then the largest relative difference between the norms they clipped by,
    ``norms`` the process's. And for ``decay``: both optimizers' learning rates multiplied by it at the start and
    after each step by a `LambdaLR` scheduler attached as soon as the optimizer is made; ``lrs`` is then the ranks'
    rate at each step."""
    import torch.distributed as dist

    from autopar.plan import Plan

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="gloo")
    results = []
    try:
        for k, data in enumerate(plans):
            try:
                results.append(_compare(Plan.from_dict(data), steps, **(extras[k] if extras else {})))
            except Exception as exc:
                if not catch:
                    raise
                import traceback

                results.append({"error": f"{type(exc).__name__}: {exc}"[:300], "where": traceback.format_exc()[-1500:]})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return results


def _compare(plan: Any, steps: int, clip: tuple[float, float] | None = None,
             decay: float | None = None) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from autopar.plan.batch import split_batch
    from autopar.runtime import parallelize
    from autopar.runtime.apply import loss_of
    from autopar.runtime.train import Workload, build_model, global_batch

    work = Workload.of(plan)
    reference = build_model(work)
    parallel = parallelize(build_model(work), plan)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ours = parallel.make_optimizer(torch.optim.AdamW, lr=1e-3)
    schedules = ([torch.optim.lr_scheduler.LambdaLR(o, lambda k: decay ** (k + 1)) for o in (ours, theirs)]
                 if decay else [])
    lrs = []
    loss_gap = grad_gap = norm_gap = 0.0
    norms = []
    for step in range(steps):
        batch = global_batch(work, step)
        ours.zero_grad(set_to_none=True)
        loss = parallel.step(batch)
        theirs.zero_grad(set_to_none=True)
        total = 0.0
        for inputs in split_batch(batch, micro_batch_size=plan.micro_batch_size, micro_batches=plan.micro_batches,
                                  dp=1, dp_rank=0).micro_batches:
            one = loss_of(reference(**inputs)) / plan.micro_batches
            one.backward()
            total += float(one.detach())
        if step == 0:
            whole = parallel.full_gradients()
            grad_gap = max(float((whole[name] - p.grad).abs().max()) for name, p in reference.named_parameters())
        if clip is not None:
            mine = parallel.clip_grad_norm_(clip[0], norm_type=clip[1])
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip[0], norm_type=clip[1])))
            norm_gap = max(norm_gap, abs(mine - norms[-1]) / norms[-1])
        lrs.append(ours.param_groups[0]["lr"])
        ours.step()
        theirs.step()
        for schedule in schedules:
            schedule.step()
        loss_gap = max(loss_gap, abs(loss - total))
    drift = 0.0
    shards = getattr(parallel, "shards", None)
    # under ZeRO 3 a weight is whole only while a module reads it: its replicas are compared gathered
    held = shards.weights().values() if shards is not None and shards.zero == 3 else parallel.module.parameters()
    for p in held:
        if not isinstance(p, DTensor):
            continue
        for axis, placement in enumerate(p.placements):
            if isinstance(placement, Replicate) and p.device_mesh.size(axis) > 1:
                local = p.to_local().detach()
                high, low = local.clone(), local.clone()
                group = p.device_mesh.get_group(axis)
                dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
                drift = max(drift, float((high - low).abs().max()))
    return {"loss": loss_gap, "grads": grad_gap, "drift": drift, "norm": norm_gap, "norms": norms, "lrs": lrs}


def with_extras(rank: int, rendezvous: Any, plans: list[dict[str, Any]], steps: int,
                extras: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`train_each` with ``extras`` (for run_ranks, which passes positional arguments only)."""
    return train_each(rank, rendezvous, plans, steps, extras=extras)


def _catching(rank: int, rendezvous: Any, plans: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """`train_each` with ``catch`` (for run_ranks, which passes positional arguments only)."""
    return train_each(rank, rendezvous, plans, steps, catch=True)
