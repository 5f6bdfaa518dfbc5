"""Parallel configurations and what the cost model says about them (the `Estimate` of CLI.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """One Megatron-style configuration: global tp x pp x dp, micro-batch, recomputation, ZeRO stage, SP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    mbs: int = 1
    recompute: str = "none"
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per device under the interleaved schedule

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "mbs", "chunks"):
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
        if self.schedule == "interleaved" and (self.chunks < 2 or self.pp < 2):
            raise ValueError(f"--schedule interleaved needs --chunks 2 or more and --pp 2 or more, got --chunks "
                             f"{self.chunks} and --pp {self.pp}")
        if self.schedule != "interleaved" and self.chunks != 1:
            raise ValueError(f"--chunks {self.chunks} applies to --schedule interleaved only")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on the busiest device."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    budget: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def to_dict(self) -> dict[str, float]:
        return {**{k: round(v) for k, v in asdict(self).items()}, "total": round(self.total)}


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveUse:
    kind: str
    axis: str
    bytes: float  # buffer size of one call
    count: int  # calls per iteration on each device


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    iteration_seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    bubble_seconds: float
    throughput_samples_per_second: float
    tflops_per_device: float
    mfu: float
    memory: MemoryBreakdown
    collectives: tuple[CollectiveUse, ...] = field(default_factory=tuple)
    micro_batches: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration_seconds": self.iteration_seconds,
            "compute_seconds": self.compute_seconds,
            "exposed_comm_seconds": self.exposed_comm_seconds,
            "bubble_seconds": self.bubble_seconds,
            "throughput_samples_per_second": self.throughput_samples_per_second,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "micro_batches": self.micro_batches,
            "memory": {**self.memory.to_dict(), "fits": self.memory.fits},
            "collectives": [
                {"kind": c.kind, "axis": c.axis, "bytes": round(c.bytes), "count": c.count} for c in self.collectives
            ],
        }
