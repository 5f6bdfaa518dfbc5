"""A pipeline iteration as a task graph: stage x micro-batch x (forward, recompute, backward), the point-to-point
sends between stages, and the data-parallel collectives, built for the task simulator (`simulator.tasks`).

Inputs are per-stage figures (`StageTimes`): compute seconds per micro-batch, the tensor-parallel collectives each
phase ends with, one send's seconds, and the stage's FSDP units (ZeRO 1-3) or DDP buckets (ZeRO 0) with their
collectives' seconds. Stage v runs on device (pipeline rank) v % pp, in the order `simulator.schedules` gives.

Per device the streams are (as NCCL runs them): compute; tp (the compute task's collectives, as its tail: the
compute stream waits for them); dp (one communicator: gradient sync, ZeRO gathers, the tied-weight sum over pp);
pp (this device's sends). A send starts once its data is computed, the sender's pp stream is free and the receiver
has posted the receive; the receiving action waits for it, and the sender waits for it where the schedule waits.
Recomputation (R) runs at the head of its backward, after the gradient has arrived.

Data-parallel collectives, with overlap on (as DDP and FSDP2 run them):

- ZeRO 0 (DDP): the last micro-batch's backward is cut into one piece per bucket (a bucket's share of the
  gradient bytes, which accrue at an even rate); each bucket all-reduces once its piece ends. Earlier micro-batches
  accumulate gradients without sync.
- ZeRO 1: the weights are all-gathered per unit at the start of the step (the stage's first forward waits for
  them); the last micro-batch's backward is cut per unit (its share of the backward compute), each unit's gradients
  reduce-scattered after its piece.
- ZeRO 2: as ZeRO 1, with a reduce-scatter after each unit's piece of every micro-batch's backward.
- ZeRO 3 (FSDP2): every forward and backward is cut per unit; a unit's piece waits for its all-gather, the
  all-gather of the unit after next is issued when a piece ends (one unit prefetched), and each unit's gradients
  are reduce-scattered after its backward piece. The root unit (the stage's non-repeated layers) is gathered
  before each forward only and runs first in the forward, last in the backward.

With overlap off every data-parallel collective runs after the device's last backward, one after another, with its
call count (`autopar.cost.memory.gradient_sync`): the accounting of the closed form (`closed_form`), which it then
equals where the closed form is exact (tests/test_simulator.py states where).

A tensor-parallel gradient sum (weights a layout keeps whole, norm weights under SP) and the sum of a tied weight's
gradients over pp run once, after the stage's last backward.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.simulator.schedules import BACKWARD, FORWARD, Action, programs
from autopar.cost.simulator.tasks import Kind, Stream, Task, Timeline, simulate

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
        calls = sum(u.gather * g + u.reduce * r for u in st.units for g, r in [_calls(spec.zero, m, u.root)])
        sync.append(calls + st.pp_once)
    return seconds, sync


def _calls(zero: int, m: int, root: bool) -> tuple[int, int]:
    """(all-gathers, reductions) of one unit per iteration (`autopar.cost.memory.gradient_sync`)."""
    return {0: (0, 1), 1: (1, 1), 2: (1, m), 3: (m if root else 2 * m, m)}[zero]


def _seconds(st: StageTimes, recipe: tuple) -> tuple[float, float]:
    """(seconds, tail) of a task of stage ``st`` by its recipe."""
    code, unit, count = recipe
    if code == "F":
        share = st.units[unit].forward if unit >= 0 else 1.0
        return st.forward * share, st.forward_tp * share
    if code == "B":
        share = st.units[unit].backward if unit >= 0 else 1.0
        return st.backward * share, st.backward_tp * share
    if code == "R":
        return st.recompute, st.recompute_tp
    if code == "S":
        return st.send, 0.0
    if code == "G":
        return st.units[unit].gather * count, 0.0
    if code == "D":
        return st.units[unit].reduce * count, 0.0
    if code == "T":
        return st.tp_once, 0.0
    return st.pp_once, 0.0  # "P"


class _Builder:
    """Drafts a spec's tasks rank by rank in program order (each stream's FIFO order), then the sends."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        # the tasks being drafted, as columns (their ``after`` grows until the graph is complete)
        self.kinds: list[Kind] = []
        self.devices: list[int] = []
        self.streams: list[Stream] = []
        self.stages: list[int] = []
        self.micro_batches: list[int] = []
        self.recipes: list[tuple] = []  # how its seconds follow from its stage's figures (`_seconds`)
        self.afters: list[list[int]] = []
        self.peers: dict[int, int] = {}  # send -> receiving device
        self.first: dict[Action, int] = {}  # an action's first compute task (it takes the receive and the waits)
        self.last: dict[Action, int] = {}  # its last compute task (what its send carries)
        self.previous: dict[int, int] = {}  # device -> its latest compute task
        self.gathered: dict[int, int] = {}  # ZeRO 1-2 with overlap: stage -> its last start-of-step all-gather

    def add(self, kind: Kind, device: int, stream: Stream, stage: int, micro_batch: int, recipe: tuple,
            after: Sequence[int] = ()) -> int:
        index = len(self.kinds)
        self.kinds.append(kind)
        self.devices.append(device)
        self.streams.append(stream)
        self.stages.append(stage)
        self.micro_batches.append(micro_batch)
        self.recipes.append(recipe)
        self.afters.append(list(after))
        if stream is Stream.COMPUTE:
            self.previous[device] = index
        return index

    def build(self) -> _Builder:
        spec = self.spec
        ranks = programs(spec.schedule, pp=spec.pp, chunks=spec.chunks, micro_batches=spec.micro_batches)
        for rank, program in enumerate(ranks):
            own = range(rank, len(spec.stages), spec.pp)
            if spec.overlap and spec.zero in (1, 2):
                for v in own:
                    for u in range(len(spec.stages[v].units)):
                        self.gathered[v] = self.add(Kind.ALL_GATHER, rank, Stream.DP, v, -1, ("G", u, 1))
            for action in program.actions:
                if action.kind == FORWARD:
                    self._forward(rank, action)
                else:
                    self._backward(rank, action)
            if not spec.overlap:
                self._serial_sync(rank, own)
        self._sends(ranks)
        return self

    def _forward(self, rank: int, action: Action) -> None:
        v, mb = action.stage, action.micro_batch
        st = self.spec.stages[v]
        if self.spec.overlap and self.spec.zero == 3 and st.units:
            order = [u for u, unit in enumerate(st.units) if unit.root] + \
                    [u for u, unit in enumerate(st.units) if not unit.root]
            self.first[action], self.last[action] = self._pieces(rank, action, FORWARD, order, order, reduce=False)
            return
        after = [self.gathered[v]] if mb == 0 and v in self.gathered else []
        self.first[action] = self.last[action] = self.add(Kind.FORWARD, rank, Stream.COMPUTE, v, mb, ("F", -1, 1),
                                                          after)

    def _backward(self, rank: int, action: Action) -> None:
        spec = self.spec
        v, mb = action.stage, action.micro_batch
        st = spec.stages[v]
        split = spec.overlap and st.units and (spec.zero in (2, 3) or mb == spec.micro_batches - 1)
        if split:
            order = [u for u, unit in reversed(list(enumerate(st.units))) if not unit.root] + \
                    [u for u, unit in enumerate(st.units) if unit.root]
            gathers = [u for u in order if not st.units[u].root] if spec.zero == 3 else []
            first, last = self._pieces(rank, action, BACKWARD, order, gathers, reduce=True)
        else:
            first = None
            if st.recomputes:
                first = self.add(Kind.RECOMPUTE, rank, Stream.COMPUTE, v, mb, ("R", -1, 1))
            last = self.add(Kind.BACKWARD, rank, Stream.COMPUTE, v, mb, ("B", -1, 1))
            first = last if first is None else first
        self.first[action], self.last[action] = first, last
        if mb == spec.micro_batches - 1:  # once per iteration, after the stage's last backward
            if st.tp_once > 0:
                self.add(Kind.ALL_REDUCE, rank, Stream.TP, v, mb, ("T", -1, 1), [last])
            if st.pp_once > 0 and spec.overlap:
                self.add(Kind.ALL_REDUCE, rank, Stream.DP, v, mb, ("P", -1, 1), [last])

    def _pieces(self, rank: int, action: Action, phase: str, order: list[int], gathers: list[int], *,
                reduce: bool) -> tuple[int, int]:
        """An action cut into one compute piece per unit (in ``order``): each of ``gathers`` all-gathered before
        its piece (two issued at the start, the next each time a piece ends), each unit's gradients reduced
        after its piece when ``reduce``. Recomputation, if any, heads a backward. (first, last) compute task."""
        v, mb = action.stage, action.micro_batch
        st = self.spec.stages[v]
        issued: dict[int, int] = {}
        start = [self.previous[rank]] if rank in self.previous else []

        def issue(k: int, after: list[int]) -> None:
            issued[gathers[k]] = self.add(Kind.ALL_GATHER, rank, Stream.DP, v, mb, ("G", gathers[k], 1), after)

        for k in range(min(2, len(gathers))):
            issue(k, start)
        following = min(2, len(gathers))
        first = None
        if phase == BACKWARD and st.recomputes:
            first = self.add(Kind.RECOMPUTE, rank, Stream.COMPUTE, v, mb, ("R", -1, 1),
                             [issued[gathers[0]]] if gathers else [])
        kind = Kind.FORWARD if phase == FORWARD else Kind.BACKWARD
        reduction = Kind.ALL_REDUCE if self.spec.zero == 0 else Kind.REDUCE_SCATTER
        piece = -1
        for u in order:
            piece = self.add(kind, rank, Stream.COMPUTE, v, mb, (phase, u, 1), [issued[u]] if u in issued else [])
            first = piece if first is None else first
            if reduce:
                self.add(reduction, rank, Stream.DP, v, mb, ("D", u, 1), [piece])
            if following < len(gathers):
                issue(following, [piece])
                following += 1
        return first, piece

    def _serial_sync(self, rank: int, own: range) -> None:
        """Overlap off: every dp collective of the device's stages after its last backward, one after another."""
        spec = self.spec
        after = [self.previous[rank]]
        reduction = Kind.ALL_REDUCE if spec.zero == 0 else Kind.REDUCE_SCATTER
        for v in own:
            st = spec.stages[v]
            for u, unit in enumerate(st.units):
                gathers, reductions = _calls(spec.zero, spec.micro_batches, unit.root)
                if gathers:
                    self.add(Kind.ALL_GATHER, rank, Stream.DP, v, -1, ("G", u, gathers), after)
                self.add(reduction, rank, Stream.DP, v, -1, ("D", u, reductions), after)
            if st.pp_once > 0:
                self.add(Kind.ALL_REDUCE, rank, Stream.DP, v, -1, ("P", -1, 1), after)

    def _sends(self, ranks: Sequence) -> None:
        """Each rank's sends in its program order; the receiver's action waits for its send, the sender waits
        where its schedule waits, and a send waits for the receiver to post the receive."""
        last_stage = len(self.spec.stages) - 1
        where = [{a: k for k, a in enumerate(program.actions)} for program in ranks]
        sends: dict[Action, int] = {}
        for rank, program in enumerate(ranks):
            for action in program.actions:
                if action.kind == FORWARD and action.stage < last_stage:
                    target = Action(FORWARD, action.stage + 1, action.micro_batch)
                elif action.kind == BACKWARD and action.stage > 0:
                    target = Action(BACKWARD, action.stage - 1, action.micro_batch)
                else:
                    continue
                receiver = target.stage % self.spec.pp
                posted = ranks[receiver].posts[where[receiver][target]]
                after = [self.last[action]]
                if posted >= 0:
                    after.append(self.last[ranks[receiver].actions[posted]])
                send = sends[action] = self.add(Kind.SEND, rank, Stream.PP, action.stage, action.micro_batch,
                                                ("S", -1, 1), after)
                self.peers[send] = receiver
                self.afters[self.first[target]].append(send)
        for program in ranks:
            for action, waits in zip(program.actions, program.waits):
                for k in waits:
                    if program.actions[k] in sends:
                        self.afters[self.first[action]].append(sends[program.actions[k]])


class PipelineSimulation:
    """A simulated pipeline iteration: the spec, its timeline, and what delta simulation needs (which tasks each
    stage owns and how their seconds follow from its figures)."""

    __slots__ = ("spec", "timeline", "_owners", "_recipes")

    def __init__(self, spec: PipelineSpec, timeline: Timeline, owners: tuple[tuple[int, ...], ...],
                 recipes: tuple[tuple, ...]) -> None:
        self.spec, self.timeline, self._owners, self._recipes = spec, timeline, owners, recipes

    @classmethod
    def full(cls, spec: PipelineSpec) -> PipelineSimulation:
        """Build the task graph and simulate it (Algorithm 1)."""
        b = _Builder(spec).build()
        tasks = []
        owners: list[list[int]] = [[] for _ in spec.stages]
        for i, (kind, device, stream, stage, micro_batch, recipe, after) in enumerate(
                zip(b.kinds, b.devices, b.streams, b.stages, b.micro_batches, b.recipes, b.afters)):
            seconds, tail = _seconds(spec.stages[stage], recipe)
            tasks.append(Task(kind=kind, device=device, stream=stream, seconds=seconds, tail=tail, after=tuple(after),
                              peer=b.peers.get(i, -1), stage=stage, micro_batch=micro_batch))
            owners[stage].append(i)
        return cls(spec, simulate(tasks), tuple(map(tuple, owners)), tuple(b.recipes))

    def change(self, stage: int, times: StageTimes) -> PipelineSimulation:
        """The simulation with stage ``stage``'s figures replaced (Algorithm 2): only its tasks get new seconds
        and only what they affect is re-timed. A change of the stage's shape (`StageTimes.shape`: its units,
        whether it recomputes, its once-per-iteration sums) makes a new task graph: that is simulated in full."""
        stages = list(self.spec.stages)
        old, stages[stage] = stages[stage], times
        spec = PipelineSpec(stages=tuple(stages), micro_batches=self.spec.micro_batches,
                            schedule=self.spec.schedule, chunks=self.spec.chunks, zero=self.spec.zero,
                            overlap=self.spec.overlap)
        if times.shape != old.shape:
            return PipelineSimulation.full(spec)
        changed: dict[int, Task] = {}
        tasks = self.timeline.tasks
        for i in self._owners[stage]:
            seconds, tail = _seconds(times, self._recipes[i])
            t = tasks[i]
            if seconds != t.seconds or tail != t.tail:
                changed[i] = Task(kind=t.kind, device=t.device, stream=t.stream, seconds=seconds, tail=tail,
                                  after=t.after, peer=t.peer, stage=t.stage, micro_batch=t.micro_batch)
        return PipelineSimulation(spec, self.timeline.resimulate(changed), self._owners, self._recipes)
