"""The HTML plan report: one self-contained page (inline SVG, nothing fetched), its tables and pictures, and the
``--report`` flag of ``autopar plan`` and ``autopar estimate``."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from torch.distributed.tensor import Replicate, Shard

from autopar.cli.main import main
from autopar.plan import Estimate, MemoryBreakdown, Mesh, ModuleLayout, ParamLayout, Plan, Stage, Workload
from autopar.report import Comparison, Report, Role, render_html
from autopar.report.figures import GIB, MEMORY_KINDS, comparison_figure, memory_figure

pytest.importorskip("matplotlib")


def _memory(total_gib: float, budget_gib: float = 80.0) -> MemoryBreakdown:
    """A breakdown whose kinds add up to ``total_gib`` (reserve 2 GiB)."""
    share = (total_gib - 2.0) / 5
    return MemoryBreakdown(parameters=share * GIB, gradients=share * GIB, optimizer=share * GIB,
                           activations=share * GIB, other=share * GIB, budget=budget_gib * GIB, reserve=2.0 * GIB)


def _plan(totals: tuple[float, ...] = (60.0, 70.0, 90.0)) -> Plan:
    stages = []
    for k, total in enumerate(totals):
        rows = tuple(f"layers.{2 * k + i}" for i in range(2))
        stages.append(Stage(layers=(("embed",) if k == 0 else ()) + rows + (("head", "") if k == len(totals) - 1
                                                                              else ()),
                            dp=2, tp=2, recompute=((rows[0], "full"),) if k == 1 else (),
                            seconds_per_micro_batch=0.01 * (k + 1), memory=_memory(total)))
    worst = max(stages, key=lambda s: s.memory.total).memory
    estimate = Estimate(iteration_seconds=1.5, compute_seconds=1.2, exposed_comm_seconds=0.1, bubble_seconds=0.2,
                        throughput_samples_per_second=10.0, tflops_per_device=100.0, mfu=0.32, memory=worst)
    module = ModuleLayout(fqn="layers.0.attn.qkv", params=(
        ParamLayout(name="layers.0.attn.qkv.weight", placements=(Replicate(), Shard(0))),))
    return Plan(model="gpt-test", kind="auto", mesh=Mesh(shape=(len(totals), 4), axes=("pp", "dp_tp")),
                micro_batch_size=4, micro_batches=8, zero=1, stages=tuple(stages), modules=(module,),
                workload=Workload(model="gpt3-125m", seq=128, batch=32), estimate=estimate)


_ROWS = (
    Comparison(label="plan (auto)", role=Role.PLAN, iteration_seconds=1.5, memory_bytes=90 * GIB, fits=False),
    Comparison(label="runner-up 1: pp 2", role=Role.RUNNER_UP, iteration_seconds=1.6, fits=True),
    Comparison(label="megatron", role=Role.BASELINE, iteration_seconds=1.8, memory_bytes=70 * GIB, fits=True),
    Comparison(label="dp", role=Role.BASELINE, iteration_seconds=1.0, memory_bytes=2000 * GIB, fits=False),
    Comparison(label="fsdp", role=Role.BASELINE, iteration_seconds=None),
)


def test_the_page_is_self_contained_with_unique_ids() -> None:
    page = render_html(Report(title="T <&>", subtitle="S", plan=_plan(), comparisons=_ROWS))
    assert page.startswith("<!DOCTYPE html>") and "T &lt;&amp;&gt;" in page
    assert page.count("<svg") == 2  # memory and comparison (no simulation: no timeline)
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|url\(http|href=\"http", page)
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert ids and len(ids) == len(set(ids))
    referenced = set(re.findall(r'(?:url\(#|href="#)([^)"]+)', page))
    assert referenced <= set(ids)  # every reference points into its own picture
    assert all(i.startswith(("memory-", "compare-")) for i in ids)


def test_the_tables_say_what_the_plan_holds() -> None:
    page = render_html(Report(title="T", subtitle="S", plan=_plan(), comparisons=_ROWS, notes=("a note",)))
    stage_rows = re.findall(r"<tr>(<td.*?)</tr>", page.split("<h2>Stages</h2>")[1].split("<h2>")[0])
    assert len(stage_rows) == 3
    assert "embed .. layers.1 (3 rows)" in stage_rows[0] and "1 full" in stage_rows[1]
    assert 'class=" over">90.0 / 80 GiB' in stage_rows[2] and "over" not in stage_rows[0]
    assert "a note" in page and "n/a" in page and "memory (busiest device)" in page
    comparison = page.split("<h2>Runners-up and baselines</h2>")[1]
    assert "2000.0 GiB" in comparison and "0.67x" in comparison  # dp: 1.0 s against the plan's 1.5 s


def test_memory_bars_stack_each_stage_to_its_total() -> None:
    plan = _plan()
    axes = memory_figure(plan).axes[0]
    bars = [p for p in axes.patches]
    assert len(bars) == len(MEMORY_KINDS) * len(plan.stages)
    for k, stage in enumerate(plan.stages):
        stacked = sum(bar.get_height() for bar in bars[k::len(plan.stages)])
        assert stacked == pytest.approx(stage.memory.total / GIB)
    assert [line.get_ydata()[0] for line in axes.lines] == [pytest.approx(80.0)]  # the budget


def test_comparison_bars_hatch_what_does_not_fit() -> None:
    time_axes, memory_axes = comparison_figure(_ROWS, budget=80 * GIB).axes
    hatched = [bool(p.get_hatch()) for p in time_axes.patches]
    assert hatched == [True, False, False, True]  # fsdp (n/a) has no bar
    assert [round(p.get_width(), 3) for p in time_axes.patches] == [1.5, 1.6, 1.8, 1.0]
    widths = [round(p.get_width(), 3) for p in memory_axes.patches]
    assert widths == [90.0, 70.0, 160.0]  # dp's 2000 GiB stops at twice the budget, and says so
    assert any("2000.0 (off the scale)" in t.get_text() for t in memory_axes.texts)


def test_a_report_needs_a_pipeline_plan_with_its_memory() -> None:
    plan = _plan()
    with pytest.raises(ValueError, match="estimate"):
        Report(title="T", subtitle="S", plan=replace(plan, estimate=None), comparisons=())
    bare = replace(plan, stages=tuple(replace(s, memory=None) for s in plan.stages))
    with pytest.raises(ValueError, match="memory"):
        Report(title="T", subtitle="S", plan=bare, comparisons=())


_TINY = ["gpt3-125m", "--layers", "2", "--seq", "128", "--batch", "8"]


def test_the_flag_is_checked_before_any_work(tmp_path, capsys) -> None:
    assert main(["estimate", *_TINY, "--pp", "2", "--report", str(tmp_path / "r.txt")]) == 2
    assert "--report" in capsys.readouterr().err
    assert main(["estimate", *_TINY, "--pp", "2", "--report", str(tmp_path / "no" / "r.html")]) == 2
    assert main(["plan", *_TINY, "--search", "ilp", "--mesh", "2", "--report", str(tmp_path / "r.html")]) == 2
    assert "pipeline" in capsys.readouterr().err


def test_estimate_writes_its_report(tmp_path, capsys) -> None:
    path = tmp_path / "r.html"
    assert main(["estimate", *_TINY, "--pp", "2", "--tp", "2", "--mbs", "2", "--report", str(path)]) == 0
    assert f"report written to {path}" in capsys.readouterr().out
    page = path.read_text()
    assert page.count("<svg") == 2 and 'id="timeline-' in page and 'id="memory-' in page
    assert "tp 2 x pp 2 x dp 1" in page and "Runners-up" not in page


def test_plan_writes_its_report_with_the_baselines(tmp_path, capsys) -> None:
    path = tmp_path / "r.html"
    assert main(["plan", *_TINY, "--gpus", "4", "--budget-s", "5", "--report", str(path)]) == 0
    assert f"report written to {path}" in capsys.readouterr().out
    page = path.read_text()
    assert page.count("<svg") == 3 and "Runners-up and baselines" in page
    comparison = page.split("<h2>Runners-up and baselines</h2>")[1]
    assert all(f"<td class=\"l\">{kind}</td>" in comparison for kind in ("megatron", "dp", "fsdp"))


def test_runners_up_that_differ_only_in_their_intra_op_stages_read_differently() -> None:
    from autopar.api.report import stage_grids

    some = stage_grids({"dp_x_tp": [[8, 2]] * 4, "intra": [True, True, False, True]})
    other = stage_grids({"dp_x_tp": [[8, 2]] * 4, "intra": [False, True, False, False]})
    assert some == "8 x 2, intra-op stages 0, 1, 3" and other == "8 x 2, intra-op stage 1"
    assert stage_grids({"dp_x_tp": [[8, 2]] * 2, "intra": [True, True]}) == "8 x 2 intra"
    assert stage_grids({"dp_x_tp": [[8, 2], [4, 4]], "intra": [False, False]}) == "8 x 2, 4 x 4"
