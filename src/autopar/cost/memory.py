"""Model-state memory per device: weights, gradients and optimizer states under ZeRO stages 0-3.

Mixed precision with Adam (dtype bf16 or fp16) keeps, per parameter, 2 bytes of weights and 2 of gradients in the
compute dtype and 12 of optimizer state (an fp32 master copy, Adam's m and v): 16 bytes (Rajbhandari et al. 2020).
Full fp32 training keeps 4 + 4 and 8 (m, v). ZeRO shards over the dp axis: stage 1 the optimizer states, stage 2
also the gradients, stage 3 (FSDP) also the weights.
"""

from __future__ import annotations

from autopar.cluster import Collective


def model_states(params: float, *, dtype: str, zero: int, dp: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes on one device holding ``params`` parameters before ZeRO."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    if dtype == "fp32":
        weight, grad, optimizer = 4.0, 4.0, 8.0
    else:
        weight, grad, optimizer = 2.0, 2.0, 12.0
    return (
        params * weight / (dp if zero >= 3 else 1),
        params * grad / (dp if zero >= 2 else 1),
        params * optimizer / (dp if zero >= 1 else 1),
    )


def gradient_itemsize(dtype: str) -> int:
    """Bytes per weight and per gradient element: 4 in fp32 training, 2 in mixed precision (bf16, fp16)."""
    return 4 if dtype == "fp32" else 2


DDP_BUCKET_BYTES = 25 * 2**20  # gradients all-reduce in buckets of this size (DDP's default bucket_cap_mb)


def gradient_sync(zero: int, micro_batches: int, *, root: bool = False) -> list[tuple[Collective, int]]:
    """Collectives per iteration that keep data-parallel replicas' parameters in step, with their call counts, on a
    buffer the size of one FSDP unit's gradients (the whole model's, where it is one unit):

    - ZeRO 0: one all-reduce (per DDP bucket, see `ddp_buckets`);
    - ZeRO 1: the weights all-gathered once before the first micro-batch, the accumulated gradients
      reduce-scattered once after the last;
    - ZeRO 2: the same gather, and a reduce-scatter after every micro-batch (gradients stay sharded);
    - ZeRO 3 (FSDP): per micro-batch an all-gather before the forward, another before the backward (not for the
      ``root`` unit, which keeps its weights between the two) and a reduce-scatter of the gradients.
    """
    m = micro_batches
    if zero == 0:
        return [(Collective.ALL_REDUCE, 1)]
    if zero == 1:
        return [(Collective.ALL_GATHER, 1), (Collective.REDUCE_SCATTER, 1)]
    if zero == 2:
        return [(Collective.ALL_GATHER, 1), (Collective.REDUCE_SCATTER, m)]
    return [(Collective.ALL_GATHER, m if root else 2 * m), (Collective.REDUCE_SCATTER, m)]


def ddp_buckets(nbytes: float) -> list[float]:
    """Bucket sizes DDP all-reduces ``nbytes`` of gradients in."""
    full, rest = divmod(nbytes, DDP_BUCKET_BYTES)
    return [float(DDP_BUCKET_BYTES)] * int(full) + ([rest] if rest or not full else [])
