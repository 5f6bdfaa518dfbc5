"""What would make a configuration that does not fit the devices fit: each lever priced by the same cost model.

The levers are ZeRO 3 (shards parameters, gradients and optimizer state over each stage's dp), full
recomputation (keeps one input per layer), the smallest micro-batch the stages' dp allows, all three together,
and more devices: the fewest whole nodes on which FSDP with full recomputation fits, searched upward from the
lower bound that the model states alone set (their ZeRO-3 bytes over the per-device memory).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from autopar.cli.render import binary_bytes
from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage, even_stages
from autopar.cost.types import MemoryBreakdown
from autopar.plan.records import MAX_DEVICES

MAX_DEVICE_PROBES = 8  # device counts priced when looking for one that fits


def _full(stage: Stage) -> Stage:
    return replace(stage, recompute=("full",) * (stage.end - stage.start), segments=())


def _smallest_micro_batch(config: PipelineConfig) -> int:
    return math.lcm(*(s.dp for s in config.stages))


def _levers(config: PipelineConfig) -> list[tuple[str, PipelineConfig | None]]:
    """(name, the configuration with that lever pulled, or None when it already is)."""
    zero = replace(config, zero=3) if config.zero != 3 else None
    full = None
    if any(s.recompute_of(r) != "full" for s in config.stages for r in range(s.start, s.end)):
        full = replace(config, stages=tuple(_full(s) for s in config.stages))
    smallest = _smallest_micro_batch(config)
    micro = replace(config, micro_batch=smallest) if config.micro_batch > smallest else None
    every = replace(config, zero=3, micro_batch=min(smallest, config.micro_batch),
                    stages=tuple(_full(s) for s in config.stages))
    levers = [("ZeRO 3", zero), ("full recomputation", full), ("micro-batch of 1 per dp rank", micro)]
    if sum(c is not None for _, c in levers) > 1:
        levers.append(("all of these together", every))
    return levers


def _options(model: PipelineModel, config: PipelineConfig, global_batch: int) -> list[dict[str, Any]]:
    options = []
    for change, variant in _levers(config):
        if variant is None:
            options.append({"change": change, "already": True, "total_bytes": None, "fits": None})
            continue
        memory = model.estimate(variant, global_batch=global_batch, simulate=False).estimate.memory  # memory only
        options.append({"change": change, "already": False, "total_bytes": round(memory.total), "fits": memory.fits})
    return options


def _fsdp(model: PipelineModel, devices: int, global_batch: int) -> Any:
    config = PipelineConfig(stages=even_stages(model, 1, tp=1, dp=devices, recompute="full"), micro_batch=devices,
                            zero=3)
    return model.estimate(config, global_batch=global_batch, simulate=False).estimate.memory  # memory only


def _device_counts(least: int, per_node: int, global_batch: int) -> list[int]:
    """Device counts from ``least`` up: whole nodes (or part of one), dividing the global batch."""
    counts, n = [], max(least, 1)
    if n > per_node:
        n = -(-n // per_node) * per_node
    while n <= min(MAX_DEVICES, global_batch) and len(counts) < MAX_DEVICE_PROBES:
        if global_batch % n == 0:
            counts.append(n)
        n = n + 1 if n < per_node else n + per_node
    return counts


def _devices(model: PipelineModel, global_batch: int) -> dict[str, Any]:
    """The fewest devices on which FSDP with full recomputation fits (within a few probes), and the lower bound."""
    cluster = model.cluster
    here = _fsdp(model, cluster.num_devices, global_batch) if global_batch % cluster.num_devices == 0 else None
    least = cluster.num_devices + 1
    if here is not None:
        states = (here.parameters + here.gradients + here.optimizer) * cluster.num_devices
        least = max(least, math.ceil(states / here.budget))
    for n in _device_counts(least, cluster.devices_per_node, global_batch):
        other = PipelineModel(model.graph, cluster.with_devices(n), traced_batch=model.traced_batch, dtype=model.dtype,
                              kernels=model.kernels)
        memory = _fsdp(other, n, global_batch)
        if memory.fits:
            return {"least": least, "count": n, "total_bytes": round(memory.total), "fits": True}
    return {"least": least, "count": None, "total_bytes": None, "fits": False}


def fit_advice(
    model: PipelineModel, config: PipelineConfig | None, *, global_batch: int, memory: MemoryBreakdown
) -> dict[str, Any]:
    """Why a configuration whose busiest device needs ``memory`` does not fit (the bytes missing) and which levers
    would make it fit: those of ``config`` (a pipeline configuration; None: an intra-op plan, whose search tried
    every ZeRO stage and micro-batch count already) and more devices."""
    return {
        "total_bytes": round(memory.total),
        "budget_bytes": round(memory.budget),
        "missing_bytes": round(max(memory.total - memory.budget, 0)),
        "options": _options(model, config, global_batch) if config is not None else [],
        "devices": _devices(model, global_batch),
    }


def advice_text(advice: dict[str, Any], *, cluster: str, what: str) -> list[str]:
    """Lines for the text output; ``what`` names the configuration ("the least-over plan")."""
    lines = [f"DOES NOT FIT: {what} needs {binary_bytes(advice['total_bytes'])} per device of "
             f"{binary_bytes(advice['budget_bytes'])}, {binary_bytes(advice['missing_bytes'])} missing on the busiest "
             "device", "what would make it fit (priced by the same cost model):"]
    for option in advice["options"]:
        if option["already"]:
            lines.append(f"  {option['change']}: already")
        elif abs(option["total_bytes"] - advice["total_bytes"]) <= 0.005 * advice["total_bytes"]:
            lines.append(f"  {option['change']}: no change")
        else:
            verdict = "fits" if option["fits"] else f"still {binary_bytes(option['total_bytes'] - advice['budget_bytes'])} over"
            lines.append(f"  {option['change']}: {binary_bytes(option['total_bytes'])} per device, {verdict}")
    devices = advice["devices"]
    if devices["fits"]:
        lines.append(f"  more devices: FSDP with full recomputation and micro-batch 1 per device fits on "
                     f"{devices['count']} x {cluster} "
                     f"({binary_bytes(devices['total_bytes'])} per device)")
    else:
        lines.append(f"  more devices: at least {devices['least']:,} x {cluster} (none of the counts tried from there "
                     "fits FSDP with full recomputation and divides the batch)")
    return lines


def summary(advice: dict[str, Any]) -> str:
    """The stderr line of exit status 3."""
    devices = advice["devices"]
    hint = f"; FSDP with full recomputation fits on {devices['count']} devices" if devices["fits"] else ""
    return (f"{binary_bytes(advice['total_bytes'])} per device of {binary_bytes(advice['budget_bytes'])}"
            f" ({binary_bytes(advice['missing_bytes'])} missing){hint}")
