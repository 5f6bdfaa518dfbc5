"""The task-graph simulator's core (FlexFlow §5, Algorithms 1-2): typed tasks in, a timeline out.

A task runs on one stream of one device for ``seconds`` (plus a ``tail``: tensor-parallel collectives that end a
compute task, during which its compute stream waits on the tp stream). It starts when every task in ``after`` has
ended and its stream has finished the task before it:

    start(t) = max(0, max_{p in after(t)} end(p), end(previous task on t's stream))
    end(t)   = start(t) + (seconds(t) + tail(t))

Streams are FIFO in issue order: a stream runs its tasks in the order they appear in the task list (the order the
program enqueues them, as a CUDA or NCCL stream does). Sends queue per receiving device (ProcessGroupNCCL runs
point-to-point work on one communicator, and stream, per pair of ranks), whatever their direction. FlexFlow's device queues order tasks by ready time; with one
program per device the issue order is fixed, so the simulation is a longest-path pass in topological order.

Full simulation (`simulate`) builds the dependency graph (``after`` plus each stream's chain), orders it (Kahn) and
times every task. Delta simulation (`Timeline.resimulate`) takes new durations for some tasks of the same graph and
re-times only tasks downstream of them, in the same topological order, stopping wherever an end time comes out
unchanged. Both evaluate the same expression per task, and ``max`` and one addition are exact functions of their
inputs, so the delta timeline equals the full one bit for bit.

Read-offs on device d over [0, iteration], iteration = max_t end(t):

- compute(d): time its compute stream runs kernels (tasks' ``seconds``; tails excluded);
- exposed comm(d): time inside the union of d's communication intervals (tails, tp/dp/pp tasks of d, transfers it
  receives) and outside its compute intervals;
- bubble(d) = iteration - compute(d) - exposed comm(d): time d neither computes nor communicates;
- the critical device is the one with the largest compute + exposed comm (the least bubble; lowest index on ties),
  and the estimate's split is its three terms, which add up to the iteration.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

log = logging.getLogger(__name__)


class Stream(str, Enum):
    """A device's streams: one runs kernels, the others NCCL communicators (one NCCL stream each)."""

    COMPUTE = "compute"
    TP = "tp"  # tensor-parallel collectives: the compute stream waits for them (critical path)
    DP = "dp"  # data-parallel gradient sync and FSDP/ZeRO gathers
    PP_FORWARD = "pp_forward"  # sends of activations to the next stage
    PP_BACKWARD = "pp_backward"  # sends of gradients to the previous stage


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    RECOMPUTE = "R"
    SEND = "send"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.RECOMPUTE})
PP_STREAMS = frozenset({Stream.PP_FORWARD, Stream.PP_BACKWARD})


class _TaskFields(NamedTuple):
    kind: Kind
    device: int
    stream: Stream
    seconds: float
    tail: float
    after: tuple[int, ...]
    peer: int
    stage: int
    micro_batch: int


class Task(_TaskFields):
    """One task. ``after`` names tasks by their index in the task list (earlier or later ones). Made by keyword,
    and checked (`check_task`); `Task.unchecked` makes one from fields already checked (the builder's hundreds of
    thousands, whose kinds and times it checks once each)."""

    __slots__ = ()

    def __new__(cls, *, kind: Kind, device: int, stream: Stream, seconds: float, tail: float = 0.0,  # noqa: D102
                after: tuple[int, ...] = (), peer: int = -1, stage: int = -1, micro_batch: int = -1) -> Task:
        check_task(kind, stream, seconds, tail, peer, device)
        return tuple.__new__(cls, (kind, device, stream, seconds, tail, after, peer, stage, micro_batch))

    @classmethod
    def unchecked(cls, kind: Kind, device: int, stream: Stream, seconds: float, tail: float, after: tuple[int, ...],
                  peer: int, stage: int, micro_batch: int) -> Task:
        return tuple.__new__(cls, (kind, device, stream, seconds, tail, after, peer, stage, micro_batch))

    def __reduce__(self):  # noqa: ANN204 - pickled as its fields (the constructor takes keywords only)
        return Task.unchecked, tuple(self)


def check_task(kind: Kind, stream: Stream, seconds: float, tail: float, peer: int, device: int = 0) -> None:
    """Raise ValueError unless a task of these fields can run: finite, non-negative times; compute kinds, and
    only they, on the compute stream; a tail only on compute; a peer for sends only, which run on a pp stream."""
    if not (0.0 <= seconds < math.inf and 0.0 <= tail < math.inf):
        raise ValueError(f"task seconds and tail must be finite and not negative, got {seconds!r} and "
                         f"{tail!r} ({kind.value} on device {device})")
    compute = stream is Stream.COMPUTE
    if compute != (kind in COMPUTE_KINDS):
        raise ValueError(f"a {kind.value} task cannot run on the {stream.value} stream")
    if tail and not compute:
        raise ValueError("only compute tasks have a tp tail")
    sends = peer >= 0
    if sends != (kind is Kind.SEND) or sends != (stream in PP_STREAMS):
        raise ValueError("a send, and only a send, has a peer and runs on a pp stream")


@dataclass(frozen=True, slots=True)
class Graph:
    """The dependency graph of a task list: predecessors (``after`` and the stream chain), successors, and one
    topological order with each task's position in it."""

    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    position: tuple[int, ...]


def graph(tasks: Sequence[Task]) -> Graph:
    n = len(tasks)
    preds: list[list[int]] = []
    succs: list[list[int]] = [[] for _ in range(n)]
    last: dict[tuple, int] = {}
    for i, t in enumerate(tasks):
        mine = list(t.after)
        for p in mine:
            if not 0 <= p < n or p == i:
                raise ValueError(f"task {i} ({t.kind.value} on device {t.device}) waits for task {p}, which is "
                                 f"{'itself' if p == i else 'not in the list'}")
        key = (t.device, t.peer) if t.peer >= 0 else (t.device, t.stream)  # sends: one queue per peer
        previous = last.get(key)
        if previous is not None:
            mine.append(previous)
        last[key] = i
        preds.append(mine)
    for i, mine in enumerate(preds):
        for p in mine:
            succs[p].append(i)
    waiting = [len(mine) for mine in preds]
    ready = [i for i in range(n) if not waiting[i]]
    order: list[int] = []
    while ready:  # Kahn's algorithm
        i = ready.pop()
        order.append(i)
        for q in succs[i]:
            waiting[q] -= 1
            if not waiting[q]:
                ready.append(q)
    if len(order) < n:
        stuck = next(i for i in range(n) if waiting[i])
        t = tasks[stuck]
        raise ValueError(f"the tasks' dependencies form a cycle (task {stuck}: {t.kind.value} of stage {t.stage}, "
                         f"micro-batch {t.micro_batch} on device {t.device} never becomes ready)")
    position = [0] * n
    for k, i in enumerate(order):
        position[i] = k
    return Graph(preds=tuple(map(tuple, preds)), succs=tuple(map(tuple, succs)), order=tuple(order),
                 position=tuple(position))


def simulate(tasks: Sequence[Task]) -> Timeline:
    """Full simulation: build the graph and time every task in topological order."""
    tasks = tuple(tasks)
    g = graph(tasks)
    duration = [t.seconds + t.tail for t in tasks]
    start = [0.0] * len(tasks)
    end = [0.0] * len(tasks)
    preds = g.preds
    for i in g.order:
        s = 0.0
        for p in preds[i]:
            e = end[p]
            if e > s:
                s = e
        start[i] = s
        end[i] = s + duration[i]
    return Timeline(tasks, g, duration, start, end)


class Timeline:
    """Start and end of every task, with what read-offs need (iteration, per-device busy time and split)."""

    __slots__ = ("tasks", "graph", "duration", "start", "end", "_splits")

    def __init__(self, tasks: tuple[Task, ...], g: Graph, duration: list[float], start: list[float],
                 end: list[float]) -> None:
        self.tasks, self.graph, self.duration, self.start, self.end = tasks, g, duration, start, end
        self._splits: list[tuple[float, float, float]] | None = None

    @property
    def iteration(self) -> float:
        return max(self.end, default=0.0)

    @property
    def devices(self) -> int:
        return 1 + max((t.device for t in self.tasks), default=-1)

    def resimulate(self, changed: Mapping[int, Task]) -> Timeline:
        """Delta simulation: the timeline with tasks ``changed`` (index -> task of new ``seconds``/``tail``, same
        device, stream, kind and ``after``), re-timing only what they affect."""
        tasks = list(self.tasks)
        duration = self.duration[:]
        for i, task in changed.items():
            old = tasks[i]
            if (task.kind, task.device, task.stream, task.after) != (old.kind, old.device, old.stream, old.after):
                raise ValueError(f"task {i} changes more than its time: delta simulation keeps the task graph")
            tasks[i] = task
            duration[i] = task.seconds + task.tail
        start, end = self.start[:], self.end[:]
        if changed:
            _propagate(self.graph, changed, duration, start, end)
        return Timeline(tuple(tasks), self.graph, duration, start, end)

    def shared(self, ranks: Sequence[int], pace: Callable[[int], float]) -> Timeline:
        """This timeline as it runs where the devices are processes sharing one host's cores, device d being
        ``ranks[d]`` of them, every task's time measured with all of them busy at once: over a span where k ranks
        are busy, each runs ``pace(k)`` times as long as measured (``pace(sum(ranks))`` is 1; with more ranks
        than cores, fewer busy ranks run faster: processor sharing); a span where none is runs as simulated, as
        does every span where ``pace`` gives 1. Where a pipeline's stages wait in its fill and drain, the busy
        ones have the cores to themselves. Each span changes length as a whole, so tasks keep their order and
        dependencies; the result is for reading (its iteration, splits, drawing), not for `resimulate`."""
        if not self.tasks:
            return self
        edges = sorted({t for pair in zip(self.start, self.end) for t in pair})
        busy: list[set[int]] = [set() for _ in edges[1:]]  # devices busy in each span, once however many streams
        for task, s, e in zip(self.tasks, self.start, self.end):
            for k in range(bisect.bisect_left(edges, s), bisect.bisect_left(edges, e)):
                busy[k].add(task.device)
        counts = [sum(ranks[d] for d in devices) for devices in busy]
        warped = [0.0]
        for (a, b), k in zip(zip(edges, edges[1:]), counts):
            warped.append(warped[-1] + (b - a) * (pace(k) if k else 1.0))
        at = dict(zip(edges, warped))
        start = [at[x] for x in self.start]
        end = [at[x] for x in self.end]
        tasks = tuple(Task.unchecked(t.kind, t.device, t.stream, _warp(edges, warped, s + t.seconds) - at[s],
                                     at[e] - _warp(edges, warped, e - t.tail) if t.tail else 0.0, t.after, t.peer,
                                     t.stage, t.micro_batch)
                      for t, s, e in zip(self.tasks, self.start, self.end))
        return Timeline(tasks, self.graph, [b - a for a, b in zip(start, end)], start, end)

    def busy(self, device: int) -> dict[Stream, float]:
        """Seconds each stream of ``device`` is busy (a compute task's tail counts on the tp stream)."""
        found = dict.fromkeys(Stream, 0.0)
        for t in self.tasks:
            if t.device == device:
                found[t.stream] += t.seconds
                if t.tail:
                    found[Stream.TP] += t.tail
        return found

    def split(self, device: int) -> tuple[float, float, float]:
        """(compute, exposed comm, bubble) of ``device``; they add up to the iteration."""
        if self._splits is None:
            self._splits = self._all_splits()
        return self._splits[device] if device < len(self._splits) else (0.0, 0.0, self.iteration)

    def critical(self) -> int:
        """The device with the largest compute + exposed comm (lowest index on ties)."""
        best, found = -1.0, 0
        for d in range(self.devices):
            compute, exposed, _ = self.split(d)
            if compute + exposed > best:
                best, found = compute + exposed, d
        return found

    def _all_splits(self) -> list[tuple[float, float, float]]:
        n = self.devices
        compute: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        comm: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        for t, s, e in zip(self.tasks, self.start, self.end):
            if t.stream is Stream.COMPUTE:
                compute[t.device].append((s, s + t.seconds))
                if t.tail:
                    comm[t.device].append((e - t.tail, e))
            elif e > s:
                comm[t.device].append((s, e))
                if t.peer >= 0:
                    comm[t.peer].append((s, e))
        iteration = self.iteration
        found = []
        for spans, talks in zip(compute, comm):
            spans.sort()
            busy = sum(b - a for a, b in spans)
            exposed = _outside(_union(talks), spans)
            found.append((busy, exposed, max(0.0, iteration - busy - exposed)))
        return found


def _warp(edges: list[float], warped: list[float], x: float) -> float:
    """``x`` on the warped clock: linear within its span of ``edges``."""
    k = min(max(bisect.bisect_right(edges, x) - 1, 0), len(edges) - 2)
    a, b = edges[k], edges[k + 1]
    return warped[k] + (x - a) / (b - a) * (warped[k + 1] - warped[k]) if b > a else warped[k]


def _propagate(g: Graph, changed: Mapping[int, Task], duration: list[float], start: list[float],
               end: list[float]) -> None:
    """Re-time, in topological order, the changed tasks and every task whose predecessor's end moved."""
    dirty = bytearray(len(duration))
    for i in changed:
        dirty[i] = 1
    order, preds, succs = g.order, g.preds, g.succs
    for k in range(min(g.position[i] for i in changed), len(order)):
        i = order[k]
        if not dirty[i]:
            continue
        s = 0.0
        for p in preds[i]:
            e = end[p]
            if e > s:
                s = e
        start[i] = s
        e = s + duration[i]
        if e != end[i]:
            end[i] = e
            for q in succs[i]:
                dirty[q] = 1


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def _outside(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of sorted disjoint ``spans`` not covered by sorted disjoint ``cover``."""
    total, j = 0.0, 0
    for a, b in spans:
        length = b - a
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            length -= min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
        total += length
    return total
