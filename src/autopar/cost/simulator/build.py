"""A pipeline iteration as a task graph: stage x micro-batch x (forward, recompute, backward), the point-to-point
sends between stages, and the data-parallel collectives, for the task simulator (`simulator.tasks`).

Stage v runs on device (pipeline rank) v % pp, its actions in the order `simulator.schedules` gives. Per device
the streams are (as NCCL runs them): compute; tp (a compute task's collectives, as its tail: the compute stream
waits for them); dp (one communicator: gradient sync, ZeRO gathers, the tied-weight sum over pp); pp_forward and
pp_backward (sends of activations and of gradients, queued per receiving device). A send starts once its data is
computed, its queue is free and the receiver has posted the receive; the receiving action waits for it, and the
sender waits for it where its schedule waits.

Data-parallel collectives, overlap on (as DDP and FSDP2 run them):

- ZeRO 0 (DDP): the last micro-batch's backward is cut into one piece per bucket (the bucket's share of the
  gradient bytes, which accrue at an even rate); each bucket all-reduces once its piece ends. Earlier micro-batches
  accumulate gradients without sync.
- ZeRO 1: the last micro-batch's backward is cut per unit (its share of the stage's compute), each unit's gradients
  reduce-scattered after its piece; after the stage's last backward the updated weights are all-gathered per unit
  (the optimizer step between is not priced). ZeRO 2: the same, with a reduce-scatter after each unit's piece of
  every micro-batch's backward.
- ZeRO 3 (FSDP2): every forward and backward is cut per unit; a unit's piece waits for its all-gather, which is
  issued once the unit two before it on the device has finished computing (two units gathered at a time, across
  micro-batches: the host runs ahead of the streams), and each unit's gradients are reduce-scattered after its
  backward piece. The root unit (the stage's non-repeated layers) is gathered before each forward only, runs first
  in the forward and last in the backward.

Recomputation runs at the head of its backward, after the gradient has arrived (per unit where the backward is
cut: a checkpointed layer replays its forward just before its backward).

With overlap off every data-parallel collective runs after the device's last backward, one after another, with its
call count (`autopar.cost.memory.gradient_sync`): the closed form's accounting (`spec.closed_form`), which it then
equals where the closed form is exact (tests/test_simulator.py says where).

A tensor-parallel gradient sum (weights a layout keeps whole, norm weights under SP) and the sum of a tied weight's
gradients over pp run once, after the stage's last backward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.simulator.schedules import BACKWARD, FORWARD, Action, Program, programs
from autopar.cost.simulator.spec import PipelineSpec, StageTimes, calls
from autopar.cost.simulator.tasks import Kind, Stream

log = logging.getLogger(__name__)

_KINDS = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "R": Kind.RECOMPUTE}


def seconds_of(st: StageTimes, recipe: tuple) -> tuple[float, float]:
    """(seconds, tail) of a task of stage ``st`` by its recipe (code, unit or -1, calls)."""
    code, unit, count = recipe
    if code == "F":
        share = st.units[unit].forward if unit >= 0 else 1.0
        return st.forward * share, st.forward_tp * share
    if code == "B":
        share = st.units[unit].backward if unit >= 0 else 1.0
        return st.backward * share, st.backward_tp * share
    if code == "R":
        share = st.units[unit].forward if unit >= 0 else 1.0
        return st.recompute * share, st.recompute_tp * share
    if code == "S":
        return st.send, 0.0
    if code == "G":
        return st.units[unit].gather * count, 0.0
    if code == "D":
        return st.units[unit].reduce * count, 0.0
    if code == "T":
        return st.tp_once, 0.0
    return st.pp_once, 0.0  # "P"


@dataclass(frozen=True, slots=True)
class _Entry:
    """One compute task of a device's sequence, before it is placed."""

    code: str  # F, R or B
    action: Action
    unit: int = -1  # the unit whose share it computes (-1: the whole stage)
    gather: bool = False  # the unit's weights must be all-gathered first (it opens the unit's use)
    reduce: bool = False  # the unit's gradients are reduced once it ends
    closes: bool = False  # the stage's last backward ends with it


class Tasks:
    """A spec's tasks, each a row (kind, device, stream, stage, micro-batch, recipe, after): the recipe says how
    its seconds follow from its stage's figures (`seconds_of`); ``after`` grows until the graph is complete."""

    def __init__(self) -> None:
        self.rows: list[tuple[Kind, int, Stream, int, int, tuple, list[int]]] = []
        self.peers: dict[int, int] = {}  # send -> receiving device

    def add(self, kind: Kind, device: int, stream: Stream, stage: int, micro_batch: int, recipe: tuple,
            after: Sequence[int] = ()) -> int:
        self.rows.append((kind, device, stream, stage, micro_batch, recipe, list(after)))
        return len(self.rows) - 1

    def after(self, index: int) -> list[int]:
        return self.rows[index][6]


def build(spec: PipelineSpec) -> Tasks:
    """Every device's tasks in program order (each stream's FIFO order), then the sends."""
    tasks = Tasks()
    ranks = programs(spec.schedule, pp=spec.pp, chunks=spec.chunks, micro_batches=spec.micro_batches)
    first: dict[Action, int] = {}  # an action's first compute task: it takes the receive and the waits
    last: dict[Action, int] = {}  # its last: what its send carries
    for rank, program in enumerate(ranks):
        entries = [e for action in program.actions for e in _expand(spec, action)]
        _place(spec, tasks, rank, entries, first, last)
        if not spec.overlap:
            _serial_sync(spec, tasks, rank, after=last[program.actions[-1]])
    _sends(spec, tasks, ranks, first, last)
    return tasks


def _expand(spec: PipelineSpec, action: Action) -> list[_Entry]:
    """An action's compute tasks: whole, or cut per unit where its collectives follow the units."""
    st = spec.stages[action.stage]
    m = spec.micro_batches
    closes = action.kind == BACKWARD and action.micro_batch == m - 1
    units = st.units if spec.overlap else ()
    if action.kind == FORWARD:
        if not (units and spec.zero == 3):
            return [_Entry("F", action)]
        order = [u for u, unit in enumerate(units) if unit.root] + [u for u, unit in enumerate(units) if not unit.root]
        return [_Entry("F", action, u, gather=True) for u in order]
    if not (units and (spec.zero in (2, 3) or closes)):
        whole = [_Entry("R", action)] if st.recomputes else []
        return whole + [_Entry("B", action, closes=closes)]
    order = [u for u, unit in reversed(list(enumerate(units))) if not unit.root] + \
            [u for u, unit in enumerate(units) if unit.root]
    found = []
    for u in order:
        gather = spec.zero == 3 and not units[u].root
        if st.recomputes:
            found.append(_Entry("R", action, u, gather=gather))
            gather = False
        found.append(_Entry("B", action, u, gather=gather, reduce=True))
    found[-1] = _Entry("B", action, found[-1].unit, gather=found[-1].gather, reduce=True, closes=closes)
    return found


def _place(spec: PipelineSpec, tasks: Tasks, rank: int, entries: list[_Entry], first: dict[Action, int],
           last: dict[Action, int]) -> None:
    """A device's compute tasks with its dp collectives in issue order: a unit's all-gather issued when the unit
    two uses before it has ended (the first two at the start), its reduction when its piece ends."""
    uses = [k for k, e in enumerate(entries) if e.gather]  # entries that open a gathered unit's use
    ends = [_use_end(entries, k) for k in uses]  # the entry that closes each use
    opening = {k: j for j, k in enumerate(uses)}
    gathered: dict[int, int] = {}
    reduction = Kind.ALL_REDUCE if spec.zero == 0 else Kind.REDUCE_SCATTER

    def issue(j: int, after: list[int]) -> None:
        e = entries[uses[j]]
        gathered[uses[j]] = tasks.add(Kind.ALL_GATHER, rank, Stream.DP, e.action.stage, e.action.micro_batch,
                                      ("G", e.unit, 1), after)

    for j in range(min(2, len(uses))):
        issue(j, [])
    closing = {end: j for j, end in enumerate(ends)}
    for k, e in enumerate(entries):
        a = e.action
        index = tasks.add(_KINDS[e.code], rank, Stream.COMPUTE, a.stage, a.micro_batch, (e.code, e.unit, 1),
                          [gathered[k]] if k in opening else [])
        first.setdefault(a, index)
        last[a] = index
        if e.reduce:
            tasks.add(reduction, rank, Stream.DP, a.stage, a.micro_batch, ("D", e.unit, 1), [index])
        if k in closing and closing[k] + 2 < len(uses):
            issue(closing[k] + 2, [index])
        if e.closes:
            _after_last_backward(spec, tasks, rank, a, index)


def _use_end(entries: list[_Entry], k: int) -> int:
    """The last entry of the unit use that entry ``k`` opens (its recomputation and backward, or its forward)."""
    e = entries[k]
    end = k
    while end + 1 < len(entries) and entries[end + 1].action == e.action and entries[end + 1].unit == e.unit \
            and not entries[end + 1].gather:
        end += 1
    return end


def _after_last_backward(spec: PipelineSpec, tasks: Tasks, rank: int, action: Action, index: int) -> None:
    """Once per iteration after the stage's last backward: its tp gradient sum, and with overlap its tied-weight
    sum over pp and (ZeRO 1-2) the updated weights' all-gathers."""
    st = spec.stages[action.stage]
    v, mb = action.stage, action.micro_batch
    if st.tp_once > 0:
        tasks.add(Kind.ALL_REDUCE, rank, Stream.TP, v, mb, ("T", -1, 1), [index])
    if not spec.overlap:
        return
    if spec.zero in (1, 2):
        for u in range(len(st.units)):
            tasks.add(Kind.ALL_GATHER, rank, Stream.DP, v, mb, ("G", u, 1), [index])
    if st.pp_once > 0:
        tasks.add(Kind.ALL_REDUCE, rank, Stream.DP, v, mb, ("P", -1, 1), [index])


def _serial_sync(spec: PipelineSpec, tasks: Tasks, rank: int, *, after: int) -> None:
    """Overlap off: every dp collective of the device's stages after its last backward, one after another."""
    reduction = Kind.ALL_REDUCE if spec.zero == 0 else Kind.REDUCE_SCATTER
    for v in range(rank, len(spec.stages), spec.pp):
        st = spec.stages[v]
        for u, unit in enumerate(st.units):
            gathers, reductions = calls(spec.zero, spec.micro_batches, unit.root)
            if gathers:
                tasks.add(Kind.ALL_GATHER, rank, Stream.DP, v, -1, ("G", u, gathers), [after])
            tasks.add(reduction, rank, Stream.DP, v, -1, ("D", u, reductions), [after])
        if st.pp_once > 0:
            tasks.add(Kind.ALL_REDUCE, rank, Stream.DP, v, -1, ("P", -1, 1), [after])


def _sends(spec: PipelineSpec, tasks: Tasks, ranks: Sequence[Program], first: dict[Action, int],
           last: dict[Action, int]) -> None:
    """Each rank's sends in its program order; the receiving action waits for its send, the sender waits where
    its schedule waits, and a send waits for the receiver to post the receive."""
    final = len(spec.stages) - 1
    where = [{a: k for k, a in enumerate(program.actions)} for program in ranks]
    sends: dict[Action, int] = {}
    for rank, program in enumerate(ranks):
        for action in program.actions:
            if action.kind == FORWARD and action.stage < final:
                target = Action(FORWARD, action.stage + 1, action.micro_batch)
            elif action.kind == BACKWARD and action.stage > 0:
                target = Action(BACKWARD, action.stage - 1, action.micro_batch)
            else:
                continue
            receiver = target.stage % spec.pp
            posted = ranks[receiver].posts[where[receiver][target]]
            after = [last[action]] + ([last[ranks[receiver].actions[posted]]] if posted >= 0 else [])
            stream = Stream.PP_FORWARD if action.kind == FORWARD else Stream.PP_BACKWARD
            send = sends[action] = tasks.add(Kind.SEND, rank, stream, action.stage, action.micro_batch,
                                             ("S", -1, 1), after)
            tasks.peers[send] = receiver
            tasks.after(first[target]).append(send)
    for program in ranks:
        for action, waits in zip(program.actions, program.waits):
            for k in waits:
                if program.actions[k] in sends:
                    tasks.after(first[action]).append(sends[program.actions[k]])
