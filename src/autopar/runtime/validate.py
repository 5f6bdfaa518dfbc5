"""Everything the runtime checks about a plan before any rank starts: `autopar run` and `autopar dryrun` call the
same `check_runnable`, so they accept and refuse the same plans.

A `Plan` is already consistent in itself (`autopar.plan`). What needs the model is checked here, on the model
built on the meta device (no memory) and traced once:

- the runtime can apply the plan's kind (`check_supported`) and the plan carries its workload;
- every module and parameter the plan names exists, with the planned shape (`check_matches`);
- the stages cover the model's chain of layers in order, each layer once (`autopar.search.pipeline.config_of`);
- every split dimension divides by the devices that split it, and attention heads (and key/value heads) divide by
  tp, since the runtime gives each tp rank whole heads;
- no BatchNorm under data parallelism or micro-batching: its statistics would be taken over a rank's slice of a
  micro-batch instead of the whole batch, which is not what one process trains.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

from autopar.plan import Plan
from autopar.runtime.apply import check_matches, check_supported
from autopar.runtime.train import Workload


def check_runnable(plan: Plan) -> None:
    """Raise ValueError (or NotImplementedError for what the runtime cannot apply yet) naming the module and the
    reason if ``plan`` cannot train exactly what one process trains."""
    from autopar.zoo import load

    check_supported(plan)
    work = Workload.of(plan)
    # the model as the runtime trains it (dropout off), and as the planner traced it (its chain of layers)
    model = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, device="meta", dropout=0.0,
                 **work.overrides).module
    check_matches(model, plan)
    _check_chain(plan, load(work.model, batch=1, seq=work.seq, dtype=torch.float32, **work.overrides))
    _check_divisible(model, plan)
    _check_batch_norm(model, plan)


def _check_chain(plan: Plan, planned) -> None:  # noqa: ANN001
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineModel
    from autopar.search.pipeline import config_of

    graph = trace(planned.module, example_kwargs=planned.inputs)
    model = PipelineModel(graph, load_cluster("cpu").with_devices(plan.devices), traced_batch=1, dtype="fp32")
    config_of(model, plan)


def _check_divisible(model: nn.Module, plan: Plan) -> None:
    """Tensor-parallel splits must be even (each tp rank computes its part of the layer); FSDP's dp shards may be
    uneven, since FSDP2 pads them."""
    tp = plan.grid[1] if plan.is_pipeline else 1
    if tp == 1:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    for entry in plan.modules:
        for layout in entry.params:
            shape, placement = params[layout.name].shape, layout.on(1)
            if isinstance(placement, Shard) and shape[placement.dim] % tp:
                raise ValueError(f"parameter {layout.name!r} is split on dim {placement.dim} ({shape[placement.dim]}) "
                                 f"over tp {tp}, which does not divide it")
    for name, module in model.named_modules():
        for attribute in ("heads", "kv_heads", "num_attention_heads", "num_key_value_heads"):
            count = getattr(module, attribute, None)
            if isinstance(count, int) and count % tp:
                raise ValueError(f"module {name or '<root>'!r} has {count} {attribute.replace('num_', '')}, which tp "
                                 f"{tp} does not divide: each tp rank takes whole heads")
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, attribute, None)
        if isinstance(count, int) and count % tp:
            raise ValueError(f"the model's config has {attribute} {count}, which tp {tp} does not divide: each tp "
                             "rank takes whole heads")


def _check_batch_norm(model: nn.Module, plan: Plan) -> None:
    dp = plan.grid[0] if plan.is_pipeline else plan.devices
    if dp == 1 and plan.micro_batches == 1:
        return
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            why = f"data parallelism over {dp} ranks" if dp > 1 else f"{plan.micro_batches} micro-batches"
            raise ValueError(f"module {name!r} is a {type(module).__name__}: under {why} it would normalise over a "
                             "slice of the batch, not the whole batch one process sees; plan with dp 1 and one "
                             "micro-batch, or replace it (SyncBatchNorm, LayerNorm, GroupNorm)")
