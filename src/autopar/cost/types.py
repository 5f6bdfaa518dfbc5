"""Parallel configurations; what the cost model says about them (`Estimate`) lives with the plan that carries it."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.plan.estimate import CollectiveUse, Estimate, MemoryBreakdown
from autopar.plan.records import KERNELS, RECOMPUTE, SCHEDULES, expert_parallel_limits

__all__ = ["KERNELS", "RECOMPUTE", "SCHEDULES", "CollectiveUse", "Estimate", "MemoryBreakdown", "ParallelConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """One Megatron-style configuration: global tp x pp x dp, micro-batch, recomputation, ZeRO stage, SP.

    The last three fields price a system that runs some parts otherwise than autopar's runtime (Megatron-LM, whose
    published runs `bench/fidelity.py` prices); their defaults are what autopar's runtime does, and its plans
    keep them (formulas in `autopar.cost.vocab` and `PipelineModel`):

    - ``vocab_parallel``: the embedding, a tied LM head and the loss split over tp by vocabulary (Megatron-LM's
      VocabParallelEmbedding and vocab-parallel cross entropy) instead of kept whole on every tp rank;
    - ``scatter_gather_sends``: each tp rank sends 1/tp of a pipeline activation or gradient, all-gathered over tp
      at the receiver (Megatron-LM's scatter/gather), instead of every tp rank sending all of it;
    - ``overlap_dp``: data-parallel collectives overlapped with the backward (DDP buckets, FSDP2 units), or all run
      after the last backward (Megatron-LM's local DDP, until its ``--overlap-grad-reduce`` of 2023).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    mbs: int = 1
    recompute: str = "none"
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per device under the interleaved schedule
    ep: int = 1  # expert parallelism: a mixture's experts split over this many of the dp ranks (`PipelineConfig.ep`)
    vocab_parallel: bool = False
    scatter_gather_sends: bool = False
    overlap_dp: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "mbs", "chunks", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.sp and self.tp == 1:
            raise ValueError("--sp (sequence parallelism) needs --tp > 1")
        reason = expert_parallel_limits(self.ep, [(self.dp, self.tp)])
        if reason:
            raise ValueError(f"--ep {self.ep}: {reason}")
        if self.schedule == "interleaved" and (self.chunks < 2 or self.pp < 2):
            raise ValueError(f"--schedule interleaved needs --chunks 2 or more and --pp 2 or more, got --chunks "
                             f"{self.chunks} and --pp {self.pp}")
        if self.schedule != "interleaved" and self.chunks != 1:
            raise ValueError(f"--chunks {self.chunks} applies to --schedule interleaved only")
        for name in ("vocab_parallel", "scatter_gather_sends", "overlap_dp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.vocab_parallel and self.sp:
            raise ValueError("vocab_parallel prices Megatron-LM's vocabulary split without sequence parallelism; "
                             "with sp it is not modelled")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp
