"""Per-rank programs of the pipeline schedules, in the orders ``torch.distributed.pipelining`` runs them.

A rank's program is its compute actions in execution order (forward ``F`` or full backward ``B`` of one stage and
micro-batch), and for each action:

- ``waits``: earlier actions of the rank whose sends must have completed before it starts (the schedule waits on
  them: NCCL's work.wait() makes the compute stream wait for the communicator's stream);
- ``post``: the earlier action after which the rank posts the receive of its input (-1: at the start); a transfer
  cannot start before its receiver has posted the receive (NCCL's send/recv rendezvous).

ScheduleGPipe (torch `ScheduleGPipe._step_microbatches`): F0..F(m-1), each after receiving its input, sends fired
and not waited; all forward sends waited before B0; then B0..B(m-1).

Schedule1F1B (`Schedule1F1B._step_microbatches`): rank r runs w = min(m, pp - r) warm-up forwards, waiting after
each the send of the forward before it; then 1B1F: B(b) after a batch that holds the last forward's send and the
gradient's receive, F(f) after a batch that holds that backward's send and the activation's receive; then the
cool-down backwards, each waiting after its compute the send of the backward before it. Receives are posted in
the batch just before the action that needs them.

ScheduleInterleaved1F1B (`_get_1f1b_rank_ops` with Megatron's warm-up, ``microbatches_per_round``): stage v on
rank v % pp; the runtime fires sends after each compute and waits them at the end of the step; each receive is
posted where `_add_send_recv` places it (the lock-step lowering of the compute schedule, replicated here).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger(__name__)

FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
    """A compute action (a tuple: it keys the builder's maps, hashed in C)."""

    kind: str  # "F" or "B"
    stage: int
    micro_batch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Program:
    """One rank's compute actions in order, with the sends each waits for and where its receive is posted."""

    actions: tuple[Action, ...]
    waits: tuple[tuple[int, ...], ...]
    posts: tuple[int, ...]


def programs(schedule: str, *, pp: int, chunks: int, micro_batches: int) -> tuple[Program, ...]:
    """Every rank's program under ``schedule`` (gpipe, 1f1b, interleaved)."""
    if pp < 1 or chunks < 1 or micro_batches < 1:
        raise ValueError(f"a pipeline needs pp, chunks and micro-batches of 1 or more, got {pp}, {chunks}, "
                         f"{micro_batches}")
    if schedule == "gpipe":
        return tuple(_gpipe(r, pp, micro_batches) for r in range(pp))
    if schedule == "1f1b":
        return tuple(_one_f_one_b(r, pp, micro_batches) for r in range(pp))
    if schedule == "interleaved":
        return _interleaved(pp, chunks, micro_batches)
    raise ValueError(f"schedule must be gpipe, 1f1b or interleaved, got {schedule!r}")


def _gpipe(rank: int, pp: int, m: int) -> Program:
    actions = [Action(FORWARD, rank, i) for i in range(m)] + [Action(BACKWARD, rank, i) for i in range(m)]
    waits = [()] * (2 * m)
    waits[m] = (m - 1,)  # every forward send waited before the backwards (one stream: the last ends last)
    return Program(actions=tuple(actions), waits=tuple(waits), posts=tuple(range(-1, 2 * m - 1)))


def _one_f_one_b(rank: int, pp: int, m: int) -> Program:
    actions: list[Action] = []
    waits: list[tuple[int, ...]] = []
    pending: list[int] = []  # sends waited before the next compute

    def run(kind: str, mb: int) -> int:
        nonlocal pending
        actions.append(Action(kind, rank, mb))
        waits.append(tuple(pending))
        pending = []
        return len(actions) - 1

    warmup = min(m, pp - rank)
    fired = -1  # the warm-up send in flight
    last = -1
    for k in range(warmup):
        last = run(FORWARD, k)
        if fired >= 0:
            pending.append(fired)  # waited after this forward's compute
        fired = last if k != warmup - 1 else -1  # the last warm-up send is fused with the first receive
    forward, backward = warmup, 0
    while True:
        pending.append(last)  # fused batch: the forward's send with the gradient's receive
        last = run(BACKWARD, backward)
        backward += 1
        if forward == m:
            break
        pending.append(last)  # fused batch: the backward's send with the activation's receive
        last = run(FORWARD, forward)
        forward += 1
    fired = last
    while backward < m:
        last = run(BACKWARD, backward)
        pending.append(fired)  # waited after this backward's compute
        fired = last
        backward += 1
    return Program(actions=tuple(actions), waits=tuple(waits), posts=tuple(range(-1, len(actions) - 1)))


def interleaved_order(pp: int, chunks: int, m: int) -> dict[int, list[Action | None]]:
    """`ScheduleInterleaved1F1B`'s compute schedule (None: an idle step of the lock-step lowering)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    if m % rounds:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count to be a multiple of its rounds "
                         f"(max(1, m // pp) = {rounds}), got {m} micro-batches (torch refuses it)")
    return {rank: _interleaved_rank(rank, pp, chunks, m, per_round) for rank in range(pp)}


def _interleaved_rank(rank: int, pp: int, v: int, m: int, per_round: int) -> list[Action | None]:
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    steady = m * v - warmup
    ops: list[Action | None] = [None] * rank
    post_warmup = (v * pp + 2 * (pp - 1 - rank)) - (warmup + rank)
    forwards: dict[int, int] = defaultdict(int)
    backwards: dict[int, int] = defaultdict(int)

    def forward(op: int) -> Action:
        stage = ((op // per_round) % v) * pp + rank
        forwards[stage] += 1
        return Action(FORWARD, stage, forwards[stage] - 1)

    def backward(op: int) -> Action:
        stage = (v - 1 - ((op - warmup) // per_round) % v) * pp + rank
        backwards[stage] += 1
        return Action(BACKWARD, stage, backwards[stage] - 1)

    for op in range(warmup + steady + warmup):
        if op < warmup:
            ops.append(forward(op))
            if op == warmup - 1:
                ops.extend([None] * post_warmup)
        elif op < warmup + steady:
            ops += [forward(op), backward(op)]
        else:
            ops += [None, backward(op)]
    return ops


def _interleaved(pp: int, chunks: int, m: int) -> tuple[Program, ...]:
    order = interleaved_order(pp, chunks, m)
    posts = _receive_posts(order, stages=pp * chunks, pp=pp)
    result = []
    for rank in range(pp):
        actions = tuple(a for a in order[rank] if a is not None)
        result.append(Program(actions=actions, waits=((),) * len(actions),
                              posts=tuple(posts.get(a, -1) for a in actions)))
    return tuple(result)


def _receive_posts(order: dict[int, list[Action | None]], *, stages: int, pp: int) -> dict[Action, int]:
    """`_add_send_recv`'s lock-step lowering: ranks in turn take their next compute action once its input has
    arrived; a computed action's send puts the receive into the receiver's list. Returns, per action that
    receives, the index of the receiver's compute action its receive follows (-1: none yet)."""
    queues = {rank: list(actions) for rank, actions in order.items()}
    place = dict.fromkeys(queues, 0)
    done: dict[int, set] = {rank: set() for rank in queues}
    computed = dict.fromkeys(queues, 0)
    posts: dict[Action, int] = {}
    while any(place[r] < len(queues[r]) for r in queues):
        progress = False
        for rank in sorted(queues):
            if place[rank] == len(queues[rank]):
                continue
            action = queues[rank][place[rank]]
            if action is not None and not _ready(action, done[rank], stages):
                continue
            if action is not None:
                computed[rank] += 1
                done[rank].add(action)
                target = _consumer(action, stages)
                if target is not None:
                    receiver = target.stage % pp
                    done[receiver].add(("recv", target))
                    posts[target] = computed[receiver] - 1
            place[rank] += 1
            progress = True
        if not progress:
            raise ValueError("the interleaved schedule's lowering makes no progress (torch would refuse it)")
    return posts


def _consumer(action: Action, stages: int) -> Action | None:
    """The action that receives what ``action`` sends, if it sends."""
    if action.kind == FORWARD:
        return Action(FORWARD, action.stage + 1, action.micro_batch) if action.stage < stages - 1 else None
    return Action(BACKWARD, action.stage - 1, action.micro_batch) if action.stage > 0 else None


def _ready(action: Action, done: set, stages: int) -> bool:
    if action.kind == FORWARD and action.stage > 0:
        return ("recv", action) in done or Action(FORWARD, action.stage - 1, action.micro_batch) in done
    if action.kind == BACKWARD and action.stage < stages - 1:
        return ("recv", action) in done or Action(BACKWARD, action.stage + 1, action.micro_batch) in done
    return True
