"""The simulated iteration for users: ``--timeline FILE`` (a picture, SVG or PNG by extension) and the ``--json``
``timeline`` object (per device: the compute / exposed comm / bubble split and each stream's busy and idle time).

The picture: one row group per device (pipeline rank), one lane per stream it uses (compute, then tp, dp, and its
sends: activations and gradients share a lane, two colours), boxes labelled with their micro-batch where they are
wide enough (F3, R3, B3; a later chunk of an interleaved device in a lighter shade), communication coloured by kind
and drawn at least a hair wide so that short transfers show, idle time left blank, the time axis in milliseconds.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from typing import Any

from autopar.cost.simulator import Kind, PipelineSimulation, Stream
from autopar.files import check_writable, write_atomic

FORMATS = (".svg", ".png")
LANES = {Stream.COMPUTE: "compute", Stream.TP: "tp", Stream.DP: "dp", Stream.PP_FORWARD: "sends"}
COLOURS = {
    Kind.FORWARD: "#4c78a8", Kind.RECOMPUTE: "#f58518", Kind.BACKWARD: "#54a24b", "tp": "#b279a2", "strip": "#f58518",
    Kind.ALL_REDUCE: "#e45756", Kind.ALL_GATHER: "#9d755d", Kind.REDUCE_SCATTER: "#ff9da6",
    Stream.PP_FORWARD: "#5a5a5a", Stream.PP_BACKWARD: "#a8a8a8",
}
NAMES = {Kind.FORWARD: "forward", Kind.RECOMPUTE: "recompute", Kind.BACKWARD: "backward",
         "tp": "tp collectives", "strip": "recompute", Kind.ALL_REDUCE: "all-reduce", Kind.ALL_GATHER: "all-gather",
         Kind.REDUCE_SCATTER: "reduce-scatter", Stream.PP_FORWARD: "send activations",
         Stream.PP_BACKWARD: "send gradients"}


def check_timeline(path: str | None) -> None:
    """Refuse, before any work, a ``--timeline`` path that cannot be written or drawn."""
    check_drawing(path, flag="--timeline", formats=FORMATS, ending=".svg or .png")


def check_drawing(path: str | None, *, flag: str, formats: Iterable[str], ending: str) -> None:
    """Refuse, before any work, a path given to ``flag`` whose suffix is not one of ``formats`` (named ``ending``
    in the message), that cannot be written, or that matplotlib (not installed) cannot draw."""
    if path is None:
        return
    if os.path.splitext(path)[1].lower() not in formats:
        raise ValueError(f"{flag} {path}: give a file ending in {ending}")
    check_writable(path, flag=flag)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} draws with matplotlib, which is not installed: pip install 'autopar[plot]'") \
            from None


def timeline_data(simulation: PipelineSimulation) -> dict[str, Any]:
    """The ``--json`` ``timeline`` object (seconds)."""
    t = simulation.timeline
    spec = simulation.spec
    iteration = t.iteration
    devices = []
    for d in range(spec.pp):
        compute, exposed, bubble = t.split(d)
        busy = t.busy(d)
        devices.append({
            "device": d, "stages": list(range(d, len(spec.stages), spec.pp)),
            "compute_seconds": compute, "exposed_comm_seconds": exposed, "bubble_seconds": bubble,
            "streams": {s.value: {"busy_seconds": busy[s], "idle_seconds": max(0.0, iteration - busy[s])}
                        for s in Stream},
        })
    return {"iteration_seconds": iteration, "critical_device": t.critical(), "schedule": spec.schedule,
            "micro_batches": spec.micro_batches, "overlap": spec.overlap, "devices": devices}


def write_timeline(simulation: PipelineSimulation, path: str, *, title: str) -> None:
    """Draw ``simulation`` to ``path`` (SVG or PNG by its extension), written atomically."""
    figure = draw(simulation, title=title)
    kind = os.path.splitext(path)[1].lower().lstrip(".")
    buffer = io.BytesIO()
    figure.savefig(buffer, format=kind, dpi=150 if kind == "png" else None, bbox_inches="tight",
                   metadata={"Date": None} if kind == "svg" else None)
    data = buffer.getvalue()
    write_atomic(path, data.decode("utf-8") if kind == "svg" else data)


def _lane(stream: Stream) -> Stream:
    return Stream.PP_FORWARD if stream is Stream.PP_BACKWARD else stream  # the sends share a lane


def _lanes(simulation: PipelineSimulation) -> list[tuple[int, Stream]]:
    """(device, lane) rows, the device's compute first, then the streams it uses."""
    used = {(t.device, _lane(t.stream)) for t in simulation.timeline.tasks}
    used |= {(t.device, Stream.TP) for t in simulation.timeline.tasks if t.tail}
    return [(d, s) for d in range(simulation.spec.pp) for s in LANES if s is Stream.COMPUTE or (d, s) in used]


def _boxes(simulation: PipelineSimulation) -> dict[tuple[int, Stream], list[tuple[float, float, Any, str, int]]]:
    """Per lane: (start, width, colour key, label, chunk). A forward or backward cut into per-unit pieces is one
    labelled box (its recomputed pieces as strips, key "strip"); tp collectives at their true place and width."""
    t, pp = simulation.timeline, simulation.spec.pp
    boxes: dict[tuple[int, Stream], list] = {}
    for run in _actions(t):
        first, last = t.tasks[run[0]], t.tasks[run[-1]]
        chunk = first.stage // pp
        lane = boxes.setdefault((first.device, Stream.COMPUTE), [])
        whole = len(run) <= 2 and not (len(run) == 2 and first.kind is last.kind)
        for i in run if whole else ():
            task = t.tasks[i]
            lane.append((t.start[i], t.end[i] - task.tail - t.start[i], task.kind, f"{task.kind.value}"
                         f"{task.micro_batch}", chunk))
        if not whole:
            phase = Kind.FORWARD if first.kind is Kind.FORWARD else Kind.BACKWARD
            lane.append((t.start[run[0]], t.end[run[-1]] - last.tail - t.start[run[0]], phase,
                         f"{phase.value}{first.micro_batch}", chunk))
            lane += [(t.start[i], t.tasks[i].seconds, "strip", "", chunk) for i in run
                     if t.tasks[i].kind is Kind.RECOMPUTE]
        tp = boxes.setdefault((first.device, Stream.TP), [])
        tp += [(t.end[i] - t.tasks[i].tail, t.tasks[i].tail, "tp", "", chunk) for i in run if t.tasks[i].tail]
    for i, task in enumerate(t.tasks):
        if task.stream is not Stream.COMPUTE and t.end[i] > t.start[i]:
            key = task.stream if task.kind is Kind.SEND else task.kind
            boxes.setdefault((task.device, _lane(task.stream)), []).append(
                (t.start[i], t.end[i] - t.start[i], key, "", max(task.stage, 0) // pp))
    return boxes


def _actions(t: Any) -> list[list[int]]:
    """Compute tasks grouped into actions: consecutive tasks of one device, stage, micro-batch and phase (a
    backward's recomputation belongs to it)."""
    runs: dict[int, list[list[int]]] = {}
    for i, task in enumerate(t.tasks):
        if task.stream is not Stream.COMPUTE:
            continue
        key = (task.stage, task.micro_batch, task.kind is Kind.FORWARD)
        mine = runs.setdefault(task.device, [])
        if mine and mine[-1][0] == key:
            mine[-1][1].append(i)
        else:
            mine.append((key, [i]))
    return [run for device in runs.values() for _, run in device]


def draw(simulation: PipelineSimulation, *, title: str) -> Any:
    """A matplotlib Figure of the simulated iteration (no pyplot: nothing global is touched)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = _lanes(simulation)
    boxes = _boxes(simulation)
    scale = 1e3  # seconds -> ms
    iteration = simulation.timeline.iteration * scale
    actions = max(len(lane) for (d, stream), lane in boxes.items() if stream is Stream.COMPUTE)
    width = min(30.0, max(14.0, 0.17 * actions))  # wider for many micro-batches, so their labels fit
    points = (width - 1.8) * 72  # the time axis, roughly, in points
    figure = Figure(figsize=(width, 1.4 + 0.32 * len(lanes)), layout="constrained")
    axes = figure.add_subplot()
    row = {lane: len(lanes) - 1 - k for k, lane in enumerate(lanes)}
    critical = simulation.timeline.critical()
    # limits first and autoscaling off: matplotlib rescales over every artist at each bar added otherwise, which
    # made a 64-micro-batch pipeline's 20,000 boxes take minutes
    axes.set_ylim(-0.6, len(lanes) - 0.4)
    axes.set_xlim(0, iteration * 1.01)
    axes.set_autoscale_on(False)
    for lane, y in row.items():
        if lane[1] is Stream.COMPUTE and lane[0] % 2 == 0:  # shade every other device's row group
            group = [r for (d, _), r in row.items() if d == lane[0]]
            axes.axhspan(min(group) - 0.5, max(group) + 0.5, color="#f2f2f2", zorder=0)
        _draw_lane(axes, boxes.get(lane, []), y, lane[1], scale=scale, iteration=iteration, points=points)
    axes.axvline(iteration, color="black", linewidth=0.8, linestyle="--", zorder=4)
    axes.set_yticks(list(row.values()))
    axes.set_yticklabels([f"rank {d}{' (critical)' if d == critical and s is Stream.COMPUTE else ''}  {LANES[s]}"
                          if s is Stream.COMPUTE else LANES[s] for d, s in row], fontsize=7)
    axes.set_xlabel("ms")
    axes.set_title(title, fontsize=9)
    axes.grid(axis="x", color="#dddddd", linewidth=0.5, zorder=1)
    kinds = sorted({Kind.RECOMPUTE if key == "strip" else key for lane in boxes.values() for _, _, key, _, _ in lane},
                   key=lambda k: list(COLOURS).index(k))
    handles = [Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds]
    if simulation.spec.chunks > 1:
        handles.append(Patch(color=COLOURS[Kind.FORWARD], alpha=0.55, label="later chunk (lighter)"))
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle"))
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=7, frameon=False)
    return figure


def _draw_lane(axes: Any, boxes: list, y: float, stream: Stream, *, scale: float, iteration: float,
               points: float) -> None:
    """One lane's boxes, as one bar collection per look (kind, chunk shade, outline): a few artists per lane
    instead of one per task."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for start, span, key, label, chunk in boxes:
        wide = span * scale > iteration * 0.003
        shown = span * scale  # dp collectives and sends: a hair at least, so that short ones show
        if stream in (Stream.DP, Stream.PP_FORWARD):
            shown = max(shown, iteration * 0.0012)
        look = (key, 1.0 if chunk == 0 else 0.55, "white" if wide and key != "strip" else "none")
        groups.setdefault(look, []).append((start * scale, shown))
        if label and span * scale / iteration * points > 3.4 * len(label):  # ~3.3 points a character
            axes.text((start + span / 2) * scale, y, label, ha="center", va="center", fontsize=5.5,
                      color="white", zorder=3)
    for (key, alpha, edge), spans in groups.items():
        low, height = (y - 0.38, 0.22) if key == "strip" else (y - 0.38, 0.76)
        axes.broken_barh(spans, (low, height), facecolors=COLOURS[key], edgecolor=edge, linewidth=0.3, alpha=alpha,
                         zorder=3 if key == "strip" else 2)
