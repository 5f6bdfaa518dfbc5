"""What the pipeline simulator takes: per-stage figures (`StageTimes`, with their dp `Unit`s) and the
iteration's shape (`PipelineSpec`); and the closed form the simulator replaces, kept as its test oracle and as
the searches' screen."""


from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass


log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """An FSDP unit (ZeRO 1-3) or a DDP bucket (ZeRO 0) of one stage: its shares of the stage's forward and
    backward compute (each summing to 1 over the stage's units) and one call's seconds of its collectives."""

    forward: float
    backward: float
    gather: float = 0.0  # one all-gather of its weights
    reduce: float = 0.0  # one all-reduce (ZeRO 0) or reduce-scatter (ZeRO 1-3) of its gradients
    root: bool = False

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "gather", "reduce"):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(f"unit {name} must be finite and not negative, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """One stage on one of its devices, per micro-batch unless said otherwise (seconds)."""

    forward: float
    backward: float  # recomputation excluded
    recompute: float = 0.0
    forward_tp: float = 0.0  # tensor-parallel collectives on the critical path of each phase
    backward_tp: float = 0.0
    recompute_tp: float = 0.0
    send: float = 0.0  # one transfer of the stage's boundary tensor (activations forward, gradients back)
    units: tuple[Unit, ...] = ()
    tp_once: float = 0.0  # per iteration, after the last backward: gradient sums over tp
    pp_once: float = 0.0  # per iteration, after the last backward: a tied weight's gradient sum over pp

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "recompute", "forward_tp", "backward_tp", "recompute_tp", "send",
                     "tp_once", "pp_once"):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(f"stage {name} must be finite and not negative, got {value!r}")
        if self.units:
            for name in ("forward", "backward"):
                total = sum(getattr(u, name) for u in self.units)
                if abs(total - 1.0) > 1e-6:
                    raise ValueError(f"units' {name} shares must sum to 1, got {total!r}")

    @property
    def recomputes(self) -> bool:
        return self.recompute > 0 or self.recompute_tp > 0

    @property
    def shape(self) -> tuple:
        """What decides the stage's tasks (not their times): delta simulation keeps it."""
        return (tuple(u.root for u in self.units), self.recomputes, self.tp_once > 0, self.pp_once > 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSpec:
    stages: tuple[StageTimes, ...]  # virtual stages; stage v on device v % pp
    micro_batches: int
    schedule: str = "1f1b"
    chunks: int = 1
    zero: int = 0
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if (self.schedule == "interleaved") != (self.chunks > 1):
            raise ValueError(f"interleaved takes 2 or more chunks and only it does, got {self.schedule!r} with "
                             f"{self.chunks} chunks")
        if not self.stages or len(self.stages) % self.chunks:
            raise ValueError(f"{len(self.stages)} stages do not make {self.chunks} chunks per device")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be 1 or more, got {self.micro_batches!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0-3, got {self.zero!r}")

    @property
    def pp(self) -> int:
        return len(self.stages) // self.chunks


@dataclass(frozen=True, slots=True)
class ClosedForm:
    iteration: float
    bubble: float
    slowest: int  # the device with the largest time per micro-batch


def closed_form(*, seconds: Sequence[float], sync: Sequence[float], micro_batches: int, chunks: int = 1) -> ClosedForm:
    """The pipeline's closed form (Aceso §3.3, Narayanan et al. 2021), on per-stage figures summed onto devices
    (stage v on device v % pp): ``T_d`` the time per micro-batch of device d, ``sync_d`` its gradient sync,

        iteration = m * max_d T_d + (sum_d T_d - max_d T_d) / v + max_d sync_d

    with the bubble the middle term. The test oracle of the simulator, and the searches' screen."""
    pp = len(seconds) // chunks
    times = [sum(seconds[d::pp]) for d in range(pp)]
    syncs = [sum(sync[d::pp]) for d in range(pp)]
    slowest = max(range(pp), key=lambda d: times[d])
    bubble = (sum(times) - times[slowest]) / chunks
    return ClosedForm(iteration=micro_batches * times[slowest] + bubble + max(syncs), bubble=bubble, slowest=slowest)


def spec_seconds(spec: PipelineSpec) -> tuple[list[float], list[float]]:
    """Per-stage ``T`` and ``sync`` of the closed form for ``spec``: T counts each phase's compute and tp
    collectives, the stage's sends and receives (2 per neighbour) and its once-per-iteration tp sum spread over the
    micro-batches; sync its collectives' calls (`gradient_sync`) and the tied-weight sum."""
    m, last = spec.micro_batches, len(spec.stages) - 1
    seconds, sync = [], []
    for v, st in enumerate(spec.stages):
        neighbours = (v > 0) + (v < last)
        seconds.append(st.forward + st.forward_tp + st.backward + st.backward_tp + st.recompute + st.recompute_tp
                       + 2 * neighbours * st.send + st.tp_once / m)
        total = sum(u.gather * g + u.reduce * r for u in st.units for g, r in [calls(spec.zero, m, u.root)])
        sync.append(total + st.pp_once)
    return seconds, sync


def calls(zero: int, m: int, root: bool) -> tuple[int, int]:
    """(all-gathers, reductions) of one unit per iteration (`autopar.cost.memory.gradient_sync`)."""
    return {0: (0, 1), 1: (1, 1), 2: (1, m), 3: (m if root else 2 * m, m)}[zero]


