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


def exposed_sync(*, forward: float, backward: float, units: Sequence[tuple[Unit, int]], zero: int,
                 micro_batches: int, after: float = 0.0) -> float:
    """Seconds of one stage's data-parallel collectives that its own compute does not hide, with overlap as the
    simulator has it (`simulator.build`), in closed form: the searches' screen, where the closed form adds the whole
    sync after the last backward. ``units``: the stage's units as runs (a unit, how many alike follow one another);
    ``forward``, ``backward``: a micro-batch's (recomputation and tp collectives included); ``after``: what runs
    once after the last backward (a tied weight's sum over pp). With ``m`` micro-batches, a unit's one all-gather
    ``g_u`` and one reduction ``r_u`` and its share of the compute, the backward cut per unit in the simulator's
    order (its repeated layers last to first, then the root), and

        drain = max(0, max_k (B * sum_{j <= k} share_j + sum_{j >= k} r_j) - B)

    the reductions still running after a backward whose piece k ends at B times the shares so far, one after
    another, the stage exposes

        ZeRO 0 (DDP buckets after the last backward's pieces)      drain
        ZeRO 1 (reduce-scatters likewise, then every gather)       drain + sum g
        ZeRO 2 (reduce-scatters after every backward's pieces)     max(drain, m sum r - (m B + (m - 1) F)) + sum g
        ZeRO 3 (gathers ahead of each use, reduce-scatters after)  max(g_first + r_last, W - m (F + B), S)
            W = m sum_u (g_u (twice off the root) + r_u): all the collectives against all the compute
            S = m sum_u (max(0, g_u - F share_u) + max(0, g_u + r_u - B share_u)): a use whose collectives
                outlast its compute stalls the next (the gathers run only two uses ahead)

    plus ``after``. Exact for ZeRO 0 and 1 on one stage; within a few percent for ZeRO 2 and 3 on layers alike
    (tests/test_simulator.py). It counts no pipeline bubble as room to hide collectives in."""
    if not units:
        return after
    m = micro_batches
    order = [run for run in reversed(units) if not run[0].root] + [run for run in units if run[0].root]
    drain, end, pending = 0.0, 0.0, sum(u.reduce * k for u, k in order)
    for unit, count in order:  # within a run the quantity is linear: its ends bound it
        piece = backward * unit.backward
        drain = max(drain, end + piece + pending - backward,
                    end + count * piece + pending - (count - 1) * unit.reduce - backward)
        end += count * piece
        pending -= count * unit.reduce
    gathers = sum(u.gather * k for u, k in units)
    reductions = sum(u.reduce * k for u, k in units)
    if zero == 0:
        exposed = drain
    elif zero == 1:
        exposed = drain + gathers
    elif zero == 2:
        exposed = max(drain, m * reductions - (m * backward + (m - 1) * forward)) + gathers
    else:
        first = next((u for u, _ in units if u.root), units[0][0])
        work = m * sum((u.gather * (1 if u.root else 2) + u.reduce) * k for u, k in units)
        stalls = m * sum((max(0.0, u.gather - forward * u.forward)
                          + max(0.0, (0.0 if u.root else u.gather) + u.reduce - backward * u.backward)) * k
                         for u, k in units)
        exposed = max(first.gather + order[-1][0].reduce, work - m * (forward + backward), stalls)
    return max(0.0, exposed) + after


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


