"""Which rows of a global batch one rank trains, micro-batch by micro-batch.

A plan's global batch is ``micro_batches`` micro-batches of ``micro_batch_size`` rows, one after another along dim 0.
Each micro-batch is split evenly over the data-parallel ranks: data-parallel rank ``d`` of ``dp`` trains rows

    k * micro_batch_size + d * share  ...  k * micro_batch_size + (d + 1) * share - 1,   share = micro_batch_size / dp

of micro-batch ``k``. Tensor-parallel ranks of one data-parallel rank read the same rows, and so do the pipeline
stages (the first reads the inputs, the last the labels). On a (pp, dp, tp) mesh, tp innermost, rank ``r`` is
data-parallel rank ``(r // tp) % dp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autopar.plan.checks import FieldError, integer, quote


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalBatch:
    """The part of a global batch one rank trains.

    ``rows`` are its rows of the global batch, micro-batch after micro-batch; ``micro_batches`` the same rows as
    one input dict per micro-batch (views of the global batch's tensors, no copy)."""

    rows: torch.Tensor
    micro_batches: tuple[dict[str, torch.Tensor], ...]

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """Every micro-batch's rows back to back, one tensor per input (a pipeline schedule splits them again)."""
        return {key: torch.cat([mb[key] for mb in self.micro_batches]) for key in self.micro_batches[0]}


def dp_rank(rank: int, *, dp: int, tp: int) -> int:
    """The data-parallel coordinate of ``rank`` on a (pp, dp, tp) mesh, tp innermost."""
    return (rank // tp) % dp


def split_batch(
    batch: Mapping[str, torch.Tensor], *, micro_batch_size: int, micro_batches: int, dp: int, dp_rank: int
) -> LocalBatch:
    """Data-parallel rank ``dp_rank``'s rows of ``batch`` (every tensor holds the whole global batch along dim 0:
    ``micro_batch_size x micro_batches`` rows). Errors name the input that does not fit."""
    integer("micro_batch_size", micro_batch_size)
    integer("micro_batches", micro_batches)
    integer("dp", dp)
    integer("dp_rank", dp_rank, low=0, high=dp - 1)
    if micro_batch_size % dp:
        raise FieldError("micro_batch_size", f"{micro_batch_size} does not split over dp {dp}")
    if not isinstance(batch, Mapping) or not batch:
        raise FieldError("batch", f"must be a non-empty dict of input name -> tensor, got {quote(batch)}")
    rows = micro_batch_size * micro_batches
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise FieldError(f"batch[{key!r}]", f"must be a tensor with the batch along dim 0, got {quote(value)}")
        if value.shape[0] != rows:
            raise FieldError(f"batch[{key!r}]", f"has {value.shape[0]} rows; the plan's global batch is "
                             f"{micro_batches} micro-batches x {micro_batch_size} = {rows} rows")
    share = micro_batch_size // dp
    firsts = [k * micro_batch_size + dp_rank * share for k in range(micro_batches)]
    return LocalBatch(
        rows=torch.cat([torch.arange(first, first + share) for first in firsts]),
        micro_batches=tuple({key: value[first : first + share] for key, value in batch.items()} for first in firsts),
    )
