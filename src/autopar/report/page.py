"""A plan report as one self-contained HTML page: inline CSS and SVG pictures, no script, nothing fetched.

Sections: the estimate's summary; the stage table; the simulated timeline (`autopar.cli.timeline.draw`, the
picture ``--timeline`` writes); memory per stage against the device budget; the runners-up and baselines.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from autopar import __version__
from autopar.cli.render import binary_bytes
from autopar.plan import Estimate, Plan, Stage
from autopar.report.figures import GIB, comparison_figure, inline_svg, memory_figure
from autopar.report.records import Report

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1320px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
p.sub { color: #555; margin-top: 0; } p.note { color: #8a5300; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; } td.over { color: #d62728; font-weight: bold; }
figure { margin: 8px 0; } figure svg { max-width: 100%; height: auto; }
figure.wide { overflow-x: auto; } figure.wide svg { max-width: none; }
figcaption { color: #555; font-size: 12px; } footer { color: #888; font-size: 12px; margin-top: 32px; }
"""


def render_html(report: Report) -> str:
    """The page of ``report`` (a string of UTF-8 HTML)."""
    e = report.plan.estimate
    parts = [f"<h1>{escape(report.title)}</h1>", f'<p class="sub">{escape(report.subtitle)}</p>', _summary(e)]
    parts += [f'<p class="note">{escape(note)}</p>' for note in report.notes]
    parts += ["<h2>Stages</h2>", _stage_table(report.plan)]
    if report.simulation is not None:
        from autopar.cli.timeline import draw

        picture = inline_svg(draw(report.simulation, title=""), prefix="timeline-")  # the page has the title
        parts += ["<h2>Simulated iteration</h2>", _figure(picture, "One row group per device (pipeline rank), a lane "
                  "per stream; boxes are forward (F), recompute (R) and backward (B) of each micro-batch; blank is "
                  "idle. The dashed line ends the iteration. Scroll sideways where it is wider than the page.",
                  wide=True)]
    memory = inline_svg(memory_figure(report.plan), prefix="memory-")
    parts += ["<h2>Memory per stage</h2>", _figure(memory, "The busiest device of each stage at its peak, by kind, "
              "against the device's memory (dashed). Reserve is what the framework holds outside the tensors.")]
    if report.comparisons:
        budget = max(s.memory.budget for s in report.plan.stages)
        chart = inline_svg(comparison_figure(report.comparisons, budget=budget), prefix="compare-")
        parts += ["<h2>Runners-up and baselines</h2>", _figure(chart, "Each priced by the same cost model and "
                  "simulated; hatched: does not fit the device. Runners-up are the best of the other layouts the "
                  "search priced; their memory is not reported, only whether it fits."), _comparison_table(report)]
    parts += ["<h2>Collectives per iteration, per device</h2>", _collectives(e)]
    parts.append(f"<footer>autopar {escape(__version__)}: every figure is the cost model's estimate.</footer>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(report.title)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def _figure(svg: str, caption: str, *, wide: bool = False) -> str:
    """A picture and its caption; ``wide``: kept at its own size, scrolled sideways where the page is narrower (a
    timeline of many micro-batches would be unreadable scaled down)."""
    opening = '<figure class="wide">' if wide else "<figure>"
    return f"{opening}{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: Sequence[int] = (0,),
           over: Sequence[int] = ()) -> str:
    """An HTML table; the columns listed in ``left`` left-aligned, the rest right; rows listed in ``over`` red."""
    head = "".join(f'<th class="{"l" if k in left else ""}">{escape(h)}</th>' for k, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cells = "".join(f'<td class="{"l" if k in left else ""}{" over" if r in over else ""}">{escape(c)}</td>'
                        for k, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _summary(e: Estimate) -> str:
    it = e.iteration_seconds
    mem = e.memory
    rows = [["iteration", f"{it:.3f} s"], ["throughput", f"{e.throughput_samples_per_second:.2f} samples/s"],
            ["per device", f"{e.tflops_per_device:.0f} TFLOP/s, MFU {e.mfu:.1%}"],
            ["compute", f"{e.compute_seconds:.3f} s ({e.compute_seconds / it:.0%})"],
            ["exposed communication", f"{e.exposed_comm_seconds:.3f} s ({e.exposed_comm_seconds / it:.0%})"],
            ["bubble", f"{e.bubble_seconds:.3f} s ({e.bubble_seconds / it:.0%})"],
            ["memory (busiest device)", f"{mem.total / GIB:.1f} of {mem.budget / GIB:.1f} GiB"
             + ("" if mem.fits else ": does not fit")]]
    return _table(["estimate", ""], rows, over=[] if mem.fits else [6])


def _span(stage: Stage) -> str:
    rows = [r or "<root>" for r in stage.layers]
    return rows[0] if len(rows) == 1 else f"{rows[0]} .. {rows[-1]} ({len(rows)} rows)"


def _stage_table(plan: Plan) -> str:
    rows, over = [], []
    for k, s in enumerate(plan.stages):
        modes = [m for _, m in s.recompute]
        recomputed = ", ".join(f"{modes.count(m)} {m}" for m in ("full", "selective") if m in modes) or "-"
        if s.segments:
            recomputed += "; " + _count(len(s.segments), "checkpointed run")
        ms = "-" if s.seconds_per_micro_batch is None else f"{s.seconds_per_micro_batch * 1e3:.1f} ms"
        rows.append([str(k), str(k % plan.pp), _span(s), f"{s.dp} x {s.tp}" + (" intra" if s.intra else ""), ms,
                     f"{s.memory.total / GIB:.1f} / {s.memory.budget / GIB:.0f} GiB", recomputed])
        over += [] if s.memory.fits else [k]
    head = ", ".join([_count(plan.pp, "pipeline device") + " x " + _count(plan.chunks, "chunk"), plan.schedule,
                      f"micro-batch {plan.micro_batch_size} x {plan.micro_batches}", f"ZeRO {plan.zero}"]
                     + (["sequence parallel"] if plan.sp else []) + [f"{plan.kernels} kernels"])
    table = _table(["stage", "device", "layers", "dp x tp", "per micro-batch", "memory", "recomputed layers"], rows,
                   left=(2, 6), over=over)
    return f"<p>{escape(head)}</p>{table}"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _comparison_table(report: Report) -> str:
    plan = next((c.iteration_seconds for c in report.comparisons if c.iteration_seconds), None)
    rows = []
    for c in report.comparisons:
        seconds = "n/a" if c.iteration_seconds is None else f"{c.iteration_seconds:.3f} s"
        memory = "-" if c.memory_bytes is None else f"{c.memory_bytes / GIB:.1f} GiB"
        ratio = f"{c.iteration_seconds / plan:.2f}x" if plan and c.iteration_seconds else "-"
        rows.append([c.label, c.role.value, seconds, memory, "yes" if c.fits else "no", ratio])
    over = [k for k, c in enumerate(report.comparisons) if not c.fits]
    return _table(["configuration", "kind", "iteration", "memory", "fits", "vs plan"], rows, left=(0, 1), over=over)


def _collectives(e: Estimate) -> str:
    if not e.collectives:
        return "<p>(none)</p>"
    rows = [[c.axis, c.kind, binary_bytes(c.bytes), f"{c.count:,}"] for c in e.collectives]
    return _table(["axis", "kind", "size", "count"], rows, left=(0, 1))
