"""Plan reports: one self-contained HTML page (inline SVG pictures drawn with matplotlib, nothing fetched) with the
plan's stages, its simulated timeline, memory per stage against the device budget, and the runners-up and
baselines (``autopar plan ... --report FILE.html``, ``autopar estimate ... --report FILE.html``)."""

from __future__ import annotations

from autopar.cli.timeline import check_drawing
from autopar.files import write_atomic
from autopar.report.build import estimate_report, plan_report
from autopar.report.page import render_html
from autopar.report.records import Comparison, Report, Role

FORMATS = (".html", ".htm")


def check_report(path: str | None) -> None:
    """Refuse, before any work, a ``--report`` path that cannot be written, or a report matplotlib cannot draw."""
    check_drawing(path, flag="--report", formats=FORMATS, ending=".html")


def write_report(path: str, report: Report) -> None:
    """Write ``report``'s page to ``path`` atomically."""
    write_atomic(path, render_html(report))


__all__ = ["Comparison", "Report", "Role", "check_report", "estimate_report", "plan_report", "render_html",
           "write_report"]
