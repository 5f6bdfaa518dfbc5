"""What the cost model predicts for a plan (the `Estimate` of the CLI contract), as typed, validated records.

They live with the plan because a plan file carries its prediction: `autopar run --check-comm` and `dryrun`
compare what the runtime does with it, and a reader of the file must get numbers it can trust (finite, not
negative) or an error naming the field.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from autopar.plan.checks import at, finite, integer, mapping, sequence, text


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on the busiest device at its peak, by kind: weights (and module buffers), gradients, optimizer state
    (and master copy), activations saved for backward, other (temporaries, communication and schedule buffers),
    and the device reserve the framework holds outside the tensors (CUDA context, allocator caching)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    budget: float
    reserve: float = 0.0  # plans written before it was apart count it in ``other``

    def __post_init__(self) -> None:
        for f in fields(self):
            finite(f.name, getattr(self, f.name), low=0.0)

    @property
    def allocated(self) -> float:
        """What the tensors take: the peak a memory tracker (PyTorch's ``MemTracker``) measures."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    @property
    def total(self) -> float:
        return self.allocated + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def to_dict(self) -> dict[str, float]:
        return {**{k: round(v) for k, v in asdict(self).items()}, "total": round(self.total)}

    @classmethod
    def from_dict(cls, data: Any) -> MemoryBreakdown:
        data = mapping("", data)
        return cls(**{f.name: data.get(f.name) for f in fields(cls) if f.name in data or f.default is MISSING})


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveUse:
    """One collective as a device issues it in an iteration: ``count`` calls of ``bytes`` each on mesh ``axis``."""

    kind: str
    axis: str
    bytes: float  # buffer size of one call
    count: int  # calls per iteration on each device

    def __post_init__(self) -> None:
        text("kind", self.kind)
        text("axis", self.axis)
        finite("bytes", self.bytes, low=0.0)
        integer("count", self.count, low=0)

    @classmethod
    def from_dict(cls, data: Any) -> CollectiveUse:
        data = mapping("", data)
        return cls(kind=data.get("kind"), axis=data.get("axis"), bytes=data.get("bytes"), count=data.get("count"))


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
    cluster: str | None = None  # the cluster it was priced for (a preset's or a cluster file's name)

    def __post_init__(self) -> None:
        for name in ("iteration_seconds", "compute_seconds", "exposed_comm_seconds", "bubble_seconds",
                     "throughput_samples_per_second", "tflops_per_device", "mfu"):
            finite(name, getattr(self, name), low=0.0)
        integer("micro_batches", self.micro_batches, low=1)
        if self.cluster is not None:
            text("cluster", self.cluster, limit=1024)
        if not isinstance(self.memory, MemoryBreakdown):
            raise ValueError(f"memory must be a MemoryBreakdown, got {type(self.memory).__name__}")
        if not isinstance(self.collectives, tuple) or not all(isinstance(c, CollectiveUse) for c in self.collectives):
            raise ValueError("collectives must be a tuple of CollectiveUse")

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
            **({"cluster": self.cluster} if self.cluster is not None else {}),
            "memory": {**self.memory.to_dict(), "fits": self.memory.fits},
            "collectives": [
                {"kind": c.kind, "axis": c.axis, "bytes": round(c.bytes), "count": c.count} for c in self.collectives
            ],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Estimate:
        data = mapping("", data)
        scalars = {f.name: data.get(f.name) for f in fields(cls) if f.name not in ("memory", "collectives")}
        with at("memory"):
            memory = MemoryBreakdown.from_dict(data.get("memory"))
        collectives = []
        for k, entry in enumerate(sequence("collectives", data.get("collectives", []))):
            with at(f"collectives[{k}]"):
                collectives.append(CollectiveUse.from_dict(entry))
        return cls(**scalars, memory=memory, collectives=tuple(collectives))

