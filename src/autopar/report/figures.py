"""The report's pictures as matplotlib figures (no pyplot: nothing global is touched), and a figure as SVG text to
inline in a page: its ids prefixed, so that several SVGs in one document never share one."""

from __future__ import annotations

import io
import re
from typing import Any

from autopar.plan import Plan
from autopar.report.records import Comparison, Role

GIB = 2**30
# memory kinds, bottom to top, as `MemoryBreakdown` names them
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "other", "reserve")
MEMORY_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#bab0ac")
ROLE_COLOURS = {Role.PLAN: "#4c78a8", Role.RUNNER_UP: "#9ecae9", Role.BASELINE: "#bab0ac"}
OVER = "#d62728"


def memory_figure(plan: Plan) -> Any:
    """Per stage, the busiest device's peak as stacked bars by kind (GiB) against the device budget (dashed);
    each bar's total above it, red where it exceeds the budget."""
    from matplotlib.figure import Figure

    stages = plan.stages
    figure = Figure(figsize=(min(14.0, max(8.0, 3.0 + 0.9 * len(stages))), 4.2), layout="constrained")
    axes = figure.add_subplot()
    xs = list(range(len(stages)))
    bottoms = [0.0] * len(stages)
    for kind, colour in zip(MEMORY_KINDS, MEMORY_COLOURS):
        heights = [getattr(s.memory, kind) / GIB for s in stages]
        axes.bar(xs, heights, bottom=bottoms, color=colour, width=0.62, label=kind, zorder=2)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    budget = max(s.memory.budget for s in stages) / GIB
    axes.axhline(budget, color="black", linestyle="--", linewidth=1, zorder=3, label=f"budget {budget:.1f} GiB")
    for x, stage, top in zip(xs, stages, bottoms):
        over = not stage.memory.fits
        axes.text(x, top, f"{top:.1f}", ha="center", va="bottom", fontsize=8, color=OVER if over else "black",
                  fontweight="bold" if over else "normal", zorder=4,
                  bbox=dict(facecolor="white", edgecolor="none", pad=1.0, alpha=0.85))
    axes.set_xlim(-0.6, max(len(stages), 3) - 0.4)  # a bar stays a bar's width when there are few stages
    axes.set_xticks(xs)
    axes.set_xticklabels([f"stage {k}\n{s.dp} x {s.tp}" for k, s in enumerate(stages)], fontsize=8)
    axes.set_ylabel("GiB per device")
    axes.set_ylim(0, max(budget, *bottoms) * 1.15)
    axes.grid(axis="y", color="#dddddd", linewidth=0.5, zorder=0)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return figure


def comparison_figure(comparisons: tuple[Comparison, ...], *, budget: float) -> Any:
    """Two panels, one row per configuration (the plan on top): its simulated iteration (s) and its memory per
    device against ``budget`` (bytes), drawn up to twice the budget (a bar that goes further stops there, labelled
    with its value). A configuration that does not fit is hatched and says so; one that does not exist (n/a) has
    no bar."""
    from matplotlib.figure import Figure

    rows = list(comparisons)
    figure = Figure(figsize=(12.0, 1.2 + 0.42 * len(rows)), layout="constrained")
    time_axes, memory_axes = figure.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    ys = list(range(len(rows)))[::-1]
    plan_seconds = next((c.iteration_seconds for c in rows if c.role is Role.PLAN), None)
    longest = max((c.iteration_seconds or 0.0 for c in rows), default=0.0) or 1.0
    # memory: up to twice the budget (or the largest that fits); larger bars stop there and say so
    scale = max([2 * budget / GIB] + [c.memory_bytes / GIB for c in rows if c.memory_bytes and c.fits])
    for y, c in zip(ys, rows):
        style = dict(color=ROLE_COLOURS[c.role], hatch=None if c.fits else "///", edgecolor="white" if c.fits
                     else OVER, linewidth=0 if c.fits else 0.8, height=0.62, zorder=2)
        if c.iteration_seconds is None:
            time_axes.text(0, y, " n/a: no such plan for this batch and these devices", va="center", fontsize=8)
            continue
        time_axes.barh(y, c.iteration_seconds, **style)
        ratio = f" ({c.iteration_seconds / plan_seconds:.2f}x)" if plan_seconds else ""
        fit = "" if c.fits else ", does not fit"
        time_axes.text(c.iteration_seconds + longest * 0.01, y, f"{c.iteration_seconds:.3f} s{ratio}{fit}",
                       va="center", fontsize=8, color="black" if c.fits else OVER)
        if c.memory_bytes is not None:
            gib = c.memory_bytes / GIB
            memory_axes.barh(y, min(gib, scale), **style)
            memory_axes.text(min(gib, scale), y, f" {gib:.1f}" + (" (off the scale)" if gib > scale else ""),
                             va="center", fontsize=8, color="black" if c.fits else OVER)
        else:
            memory_axes.text(0, y, " not reported", va="center", fontsize=8, color="#888888")
    time_axes.set_xlim(0, longest * 1.45)
    time_axes.set_yticks(ys)
    time_axes.set_yticklabels([c.label for c in rows], fontsize=8)
    time_axes.set_xlabel("simulated iteration (s)")
    memory_axes.axvline(budget / GIB, color="black", linestyle="--", linewidth=1, zorder=3)
    memory_axes.set_xlabel(f"memory per device (GiB; budget {budget / GIB:.1f}, dashed)")
    memory_axes.set_xlim(0, scale * 1.45)
    for axes in (time_axes, memory_axes):
        axes.grid(axis="x", color="#dddddd", linewidth=0.5, zorder=0)
    return figure


def inline_svg(figure: Any, *, prefix: str) -> str:
    """``figure`` as an ``<svg>`` element for an HTML page: no XML prolog, every id (clip paths, glyphs) prefixed
    with ``prefix`` and every reference to one rewritten, scaled to the page's width by CSS."""
    from matplotlib import rc_context

    buffer = io.StringIO()
    with rc_context({"svg.hashsalt": "autopar"}):  # the same picture, the same ids, run after run
        figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text[text.index("<svg"):], flags=re.S)  # RDF about the file
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', text)
    return re.sub(r'(url\(#|href="#)([^)"]+)',
                  lambda m: m.group(1) + (prefix + m.group(2) if m.group(2) in ids else m.group(2)), text)
