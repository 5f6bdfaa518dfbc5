"""FlexFlow's task-graph execution simulator (§5, Algorithms 1-2) for pipeline iterations.

`tasks`: typed tasks on per-device FIFO streams in, a timeline out (full and delta simulation, read-offs: the
iteration, per-device busy time per stream, the compute / exposed communication / bubble split).
`schedules`: each rank's program under GPipe, 1F1B and interleaved 1F1B in torch.distributed.pipelining's orders.
`spec`: per-stage figures in (compute, tp collectives, sends, DDP buckets and FSDP units), and the closed form the
simulator replaces (kept as its oracle). `build`: a pipeline iteration's tasks from them, data-parallel overlap on
or off. `pipeline`: the simulated iteration, in full or changed one stage at a time.
Pure: no torch, no graph.
"""

from autopar.cost.simulator.pipeline import PipelineSimulation
from autopar.cost.simulator.spec import (
    ClosedForm, PipelineSpec, StageTimes, Unit, closed_form, exposed_sync, spec_seconds,
)
from autopar.cost.simulator.schedules import Action, Program, programs
from autopar.cost.simulator.tasks import Kind, Stream, Task, Timeline, simulate

__all__ = [
    "Action", "ClosedForm", "Kind", "PipelineSimulation", "PipelineSpec", "Program", "StageTimes", "Stream", "Task",
    "Timeline", "Unit", "closed_form", "exposed_sync", "programs", "simulate", "spec_seconds",
]
