"""What a plan report shows: the plan with its estimate, the simulated iteration, and the configurations it was
compared with (runners-up and baselines), as typed records. `autopar.report.build` makes them from the result the
CLI prints (``autopar plan`` / ``autopar estimate --json``, the documented contract)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from autopar.plan import Plan


class Role(str, Enum):
    PLAN = "plan"
    RUNNER_UP = "runner-up"
    BASELINE = "baseline"


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """One configuration beside the plan: its iteration time (None: no such plan exists for this batch and these
    devices) and per-device memory (None: not reported for it), and whether that memory fits."""

    label: str
    role: Role
    iteration_seconds: float | None
    memory_bytes: float | None = None
    fits: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        for name in ("iteration_seconds", "memory_bytes"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of at least 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """A plan report: ``title`` and ``subtitle`` head the page; ``simulation`` is the simulator's iteration
    (`autopar.cost.simulator.PipelineSimulation`) drawn as the timeline; ``notes`` are shown under the summary."""

    title: str
    subtitle: str
    plan: Plan
    comparisons: tuple[Comparison, ...]
    simulation: Any = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan) or self.plan.estimate is None:
            raise ValueError("plan must be a Plan carrying its estimate")
        if not self.plan.is_pipeline:
            raise ValueError("a report shows a pipeline plan's stages; this is an intra-op plan")
        if any(s.memory is None for s in self.plan.stages):
            raise ValueError("every stage of the plan must carry its memory breakdown")
        if not all(isinstance(c, Comparison) for c in self.comparisons):
            raise ValueError("comparisons must be Comparison records")
