"""A simulated pipeline iteration, built in full or changed one stage at a time (delta simulation)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from autopar.cost.simulator.build import build, seconds_of
from autopar.cost.simulator.spec import PipelineSpec, StageTimes
from autopar.cost.simulator.tasks import Task, Timeline, check_task, simulate

log = logging.getLogger(__name__)


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
        b = build(spec)
        tasks = []
        owners: list[list[int]] = [[] for _ in spec.stages]
        times: dict[tuple, tuple[float, float]] = {}  # (stage, recipe) -> (seconds, tail)
        checked: set[tuple] = set()  # the kinds of task checked (`check_task`): each once, not once per task
        peers = b.peers
        make = Task.unchecked
        for i, (kind, device, stream, stage, micro_batch, recipe, after) in enumerate(b.rows):
            key = (stage, recipe)
            found = times.get(key)
            if found is None:
                found = times[key] = seconds_of(spec.stages[stage], recipe)
            peer = peers.get(i, -1)
            sort = (kind, stream, peer >= 0, found)
            if sort not in checked:
                check_task(kind, stream, found[0], found[1], peer, device)
                checked.add(sort)
            tasks.append(make(kind, device, stream, found[0], found[1], tuple(after), peer, stage, micro_batch))
            owners[stage].append(i)
        return cls(spec, simulate(tasks), tuple(map(tuple, owners)), tuple(row[5] for row in b.rows))

    def shared(self, ranks: tuple[int, ...], pace: Callable[[int], float]) -> PipelineSimulation:
        """The simulation as it runs on one host whose cores all its devices' ranks share, device d being
        ``ranks[d]`` processes, k busy ranks running ``pace(k)`` times as long as measured (`Timeline.shared`);
        for reading, not for `change`."""
        return PipelineSimulation(self.spec, self.timeline.shared(ranks, pace), self._owners, self._recipes)

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
            seconds, tail = seconds_of(times, self._recipes[i])
            t = tasks[i]
            if seconds != t.seconds or tail != t.tail:
                changed[i] = Task(kind=t.kind, device=t.device, stream=t.stream, seconds=seconds, tail=tail,
                                  after=t.after, peer=t.peer, stage=t.stage, micro_batch=t.micro_batch)
        return PipelineSimulation(spec, self.timeline.resimulate(changed), self._owners, self._recipes)
