"""The command line honours ../shared/CLI.md: names, JSON fields, one-line errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopar.cli.main import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "profile", "gpt3-125m", "--layers", "3", "--batch", "2", "--seq", "128", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["config"] == {"layers": 3, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 128, "batch": 2}
    assert set(data["flops"]) == {"forward", "backward"}
    assert data["params"] == sum(layer["params"] for layer in data["layers"])
    assert data["flops"]["forward"] == sum(layer["flops_forward"] for layer in data["layers"])
    blocks = [layer for layer in data["layers"] if layer["name"].startswith("layers.")]
    assert [b["name"] for b in blocks] == ["layers.0", "layers.1", "layers.2"]
    for layer in data["layers"]:
        assert set(layer) >= {"name", "params", "flops_forward", "flops_backward", "saved_bytes"}
    assert data["trace_seconds"] >= 0


def test_profile_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "profile", "llama-7b", "--layers", "4", "--seq", "256")
    assert code == 0
    assert "layers.0..layers.3 (x4)" in out and "LlamaBlock" in out and "total:" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["profile", "gpt-unknown"], "unknown model 'gpt-unknown'"),
        (["profile", "gpt3-125m", "--batch", "0"], "--batch must be a positive integer up to 16,777,216"),
        (["profile", "gpt3-125m", "--hidden", "100"], "hidden (100) must be divisible by heads (12)"),
    ],
)
def test_errors_are_one_line_and_name_the_input(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_models_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "models", "--json")
    names = {m["name"] for m in json.loads(out)["models"]}
    assert {"gpt3-175b", "llama-70b", "t5-3b", "hf:llama", "megatron-7.5b", "wrn-50-2"} <= names


def test_console_script_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autopar.cli.main", "profile", "bert-base", "--layers", "2", "--seq", "64", "--json"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["layers"] == 2


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    """``autopar ... | head``: the reader has gone before the output is written (``true`` reads nothing); the
    command ends quietly."""
    command = (f"{sys.executable} -m autopar.cli.main estimate gpt3-125m --layers 2 --hidden 64 --heads 4 --vocab 128 "
               "--seq 16 --gpus 2 --dp 2 --batch 4 | true")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False, timeout=120)
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_estimate_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "estimate", "gpt3-125m", "--layers", "2", "--seq", "256", "--cluster", "a100-80g-sxm",
        "--gpus", "8", "--batch", "32", "--tp", "2", "--pp", "2", "--mbs", "2", "--zero", "1", "--json",
    )
    assert code == 0, err
    data = json.loads(out)
    e = data["estimate"]
    assert data["parallel"]["dp"] == 2
    for key in ("iteration_seconds", "compute_seconds", "exposed_comm_seconds", "bubble_seconds",
                "throughput_samples_per_second", "tflops_per_device", "mfu"):
        assert e[key] >= 0
    assert set(e["memory"]) >= {"parameters", "gradients", "optimizer", "activations", "other", "total", "budget"}
    assert {c["axis"] for c in e["collectives"]} == {"tp", "dp", "pp"}


def test_estimate_with_compiled_kernels_is_faster_and_says_so(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    argv = ["estimate", "gpt3-125m", "--layers", "2", "--seq", "256", "--gpus", "8", "--batch", "32", "--tp", "2",
            "--mbs", "2"]
    found = {}
    for kernels in ("eager", "compiled"):
        plan = tmp_path / f"{kernels}.json"
        code, out, err = run_cli(capsys, *argv, "--kernels", kernels, "--json", "--out", str(plan))
        assert code == 0, err
        data = json.loads(out)
        assert data["parallel"]["kernels"] == kernels
        assert json.loads(plan.read_text())["plan"]["kernels"] == kernels
        found[kernels] = data["estimate"]
    assert found["compiled"]["compute_seconds"] < found["eager"]["compute_seconds"]
    assert found["compiled"]["collectives"] == found["eager"]["collectives"]  # no recomputation: the same calls
    code, out, _ = run_cli(capsys, *argv, "--kernels", "compiled")
    assert code == 0 and "compiled kernels" in out.splitlines()[0]
    code, _, err = run_cli(capsys, *argv, "--kernels", "fused")
    assert code == 2 and err == "autopar estimate: error: --kernels must be one of eager, compiled, got 'fused'\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--cluster", "a100"], "unknown cluster 'a100'"),
        (["--tp", "3", "--gpus", "8"], "!= --gpus 8"),
        (["--gpus", "12", "--dp", "12"], "not a whole number of a100-80g-sxm nodes"),
    ],
)
def test_estimate_errors(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run_cli(capsys, "estimate", "gpt3-125m", "--layers", "2", "--batch", "24", *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_calibrate_fits_and_writes_a_usable_cluster(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out_file = tmp_path / "cluster.yaml"
    code, out, err = run_cli(capsys, "calibrate", "--nproc", "2", "--out", str(out_file), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["wall_seconds"] < 60
    assert data["fit"]["bandwidth_gbps"] > 0
    compute = data["compute"]  # measured on every rank at once
    assert compute["peak_gflops"] > 0 and len(compute["gemm"]) == 20 and compute["bandwidth_gbps"] > 0
    device = data["cluster"]["device"]
    assert device["name"] == "cpu-process (measured)" and set(device["peak_tflops"]) == {"fp32"}
    assert device["peak_tflops"]["fp32"] == pytest.approx(compute["peak_gflops"] / 1e3)
    # the reported fit is the fit of the reported measurements; its quality is checked on synthetic data
    # (tests/test_cluster.py), since gloo on a shared 2-core CPU swings 2-3x between runs (PYTORCH-FACTS)
    from autopar.cluster.detect import fit_link

    sizes = tuple(m["bytes"] for m in data["measurements"])
    bandwidth, _, error = fit_link(sizes, [m["seconds"] for m in data["measurements"]], data["ranks"])
    assert data["fit"]["bandwidth_gbps"] == pytest.approx(bandwidth / 1e9)
    assert data["fit"]["max_relative_error_from_4mib"] == pytest.approx(error)
    assert len(sizes) >= 8 and list(sizes) == sorted(sizes)
    code, out, err = run_cli(
        capsys, "estimate", "gpt3-125m", "--layers", "2", "--seq", "128", "--cluster", str(out_file),
        "--batch", "4", "--dp", "2", "--dtype", "fp32", "--json",
    )
    assert code == 0, err
    assert json.loads(out)["cluster"] == "cpu-calibrated"


def test_analyze_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "analyze", "gpt3-125m", "--layers", "4", "--seq", "128", "--gpus", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["blocks"]) == 1 + 4 * 4 + 1
    block = data["blocks"][1]
    assert set(block) >= {"id", "layer", "ops", "leading_op", "candidates"}
    assert block["layer"] == 0 and block["leading_op"] == "aten.addmm.default"
    assert sorted(block["candidates"]) == ["R", "k", "m", "n"]  # R: whole on the axis (an embedding under Megatron)
    assert data["blocks"][0]["layer"] is None  # the embedding is no repeated layer
    assert data["unique_segments"] == 3
    assert [s["count"] for s in data["segments"]] == [1, 4, 1]
    assert data["space"]["reduced"] < 10 ** data["space"]["per_op_log10"]


def test_plan_json_fields_and_plan_file(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(
        capsys, "plan", "gpt3-125m", "--layers", "2", "--seq", "128", "--gpus", "4", "--batch", "16",
        "--search", "ilp", "--out", str(out_file), "--json",
    )
    assert code == 0, err
    data = json.loads(out)
    assert set(data) >= {"plan", "estimate", "baselines", "search_seconds"}
    assert set(data["baselines"]) == {"dp", "fsdp", "megatron"}
    for other in data["baselines"].values():
        assert set(other) == {"plan", "estimate"}
        assert data["estimate"]["iteration_seconds"] <= other["estimate"]["iteration_seconds"] * (1 + 1e-9)
    plan = data["plan"]
    assert plan["mesh"]["shape"] == [4] and plan["micro_batches"] * plan["micro_batch_size"] == 16
    assert plan["modules"]["layers.0.mlp.fc1"]["params"]["layers.0.mlp.fc1.weight"] in ("R", "S(0)", "S(1)")
    saved = json.loads(out_file.read_text())
    assert saved["plan"] == plan and saved["estimate"] == data["estimate"]


def test_plan_table_and_baseline_search(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "gpt3-125m", "--layers", "2", "--seq", "128", "--gpus", "4", "--batch", "8",
                             "--search", "ilp")
    assert code == 0, err
    assert "against the baselines" in out and "megatron" in out and "layers.0.mlp.fc2" in out
    code, out, err = run_cli(capsys, "plan", "gpt3-125m", "--layers", "2", "--gpus", "4", "--batch", "8",
                             "--search", "fsdp", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["zero"] == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "gpt3-125m", "--gpus", "8", "--mesh", "2x3", "--search", "ilp"], "--mesh 2x3 has 6 devices but --gpus is 8"),
        (["plan", "gpt3-125m", "--mesh", "2xq", "--search", "ilp"], "--mesh '2xq' is not a shape"),
        (["plan", "gpt3-125m", "--gpus", "4", "--budget-s", "0"], "--budget-s must be a positive finite number of seconds"),
        (["plan", "gpt3-125m", "--gpus", "4", "--batch", "3", "--search", "dp"], "no dp plan exists for --batch 3"),
        (["analyze", "gpt3-125m", "--gpus", "0"], "--gpus must be a positive integer"),
    ],
)
def test_plan_and_analyze_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_auto_json_fields_and_plan_file(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from autopar.plan import load_plan

    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, "plan", "gpt3-125m", "--layers", "4", "--gpus", "8", "--batch", "32",
                             "--budget-s", "10", "--out", str(out_file), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["search"] == "auto" and set(data) >= {"plan", "estimate", "baselines", "search_seconds"}
    assert set(data["baselines"]) == {"megatron", "dp", "fsdp"}
    plan = data["plan"]
    assert sum(len(s["layers"]) for s in plan["stages"]) == len({n for s in plan["stages"] for n in s["layers"]})
    assert all(s["dp"] * s["tp"] == plan["mesh"]["shape"][1] for s in plan["stages"])
    assert plan["micro_batch_size"] * plan["micro_batches"] == 32
    for other in data["baselines"].values():
        if other and other["estimate"]["memory"]["fits"]:
            assert data["estimate"]["iteration_seconds"] <= other["estimate"]["iteration_seconds"] * (1 + 1e-9)
    assert load_plan(out_file).to_dict() == plan
    runners = data["runners_up"]  # the best of other layouts, best first, none the plan's own layout
    assert 1 <= len(runners) <= 3
    layouts = [(r["pp"], r["dp_x_tp"], r["zero"], r["sp"]) for r in runners]
    assert len(set(map(str, layouts))) == len(layouts)
    own = [[s["dp"], s["tp"]] for s in plan["stages"]]
    assert (len(plan["stages"]), own, plan["zero"], plan["sp"]) not in layouts
    fitting = [r["iteration_seconds"] for r in runners if r["fits"]]
    assert fitting == sorted(fitting) and all(r["vs_plan"] >= 1 - 1e-9 for r in runners if r["fits"])


def test_plan_auto_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "gpt3-125m", "--layers", "4", "--gpus", "8", "--batch", "32",
                             "--budget-s", "5")
    assert code == 0, err
    assert "pipeline stage" in out and "dp x tp" in out and "against the baselines" in out
    assert "the best of other layouts the search priced" in out
    code, _, err = run_cli(capsys, "plan", "gpt3-125m", "--gpus", "8", "--mesh", "2x4")
    assert code == 2 and "--mesh applies to --search ilp" in err


def test_a_plan_the_runtime_would_refuse_is_refused_when_planned(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """XGLM's attention forms heads from the model's whole width, which a tp rank's share of q, k and v does not
    have: `estimate --out` writes no plan file and names the module, before any rank could start."""
    out = tmp_path / "plan.json"
    size = ["--layers", "2", "--hidden", "64", "--heads", "4"]
    code, _, err = run_cli(capsys, "estimate", "hf:xglm", *size, "--gpus", "2", "--tp", "2", "--batch", "2",
                           "--out", str(out))
    assert code == 2 and not out.exists()
    assert "the plan fails in module 'model.layers.0.self_attn'" in err
    code, _, _ = run_cli(capsys, "estimate", "hf:xglm", *size, "--gpus", "2", "--dp", "2", "--batch", "2",
                         "--out", str(out))
    assert code == 0 and out.exists()  # data parallelism of the same model runs


def test_refusal_names_the_module_a_plan_fails_in() -> None:
    from autopar.capture import trace
    from autopar.cli.plan import refusal
    from autopar.cluster import load_cluster
    from autopar.cost import ParallelConfig
    from autopar.cost.megatron import pipeline_config
    from autopar.cost.pipeline import PipelineModel
    from autopar.plan import Workload
    from autopar.search.pipeline import Found, pipeline_plan
    from autopar.zoo import load

    size = {"heads": 4, "hidden": 64, "layers": 2}
    zoo = load("hf:xglm", batch=1, seq=32, **size)  # its attention's output reshaped by the whole width
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs_at(1)),
                          load_cluster("a100-80g-sxm").with_devices(2), traced_batch=1)
    work = Workload(model="hf:xglm", overrides=tuple(size.items()), seq=zoo.seq, batch=2, dtype="bf16")
    reasons = {}
    for tp, dp in ((2, 1), (1, 2)):
        config = pipeline_config(model, ParallelConfig(tp=tp, dp=dp, mbs=1))
        found = Found(config, model.estimate(config, global_batch=2), 1)
        reasons[tp] = refusal(pipeline_plan(model, found, name="xglm", kind="estimate", global_batch=2, workload=work))
    assert reasons[1] is None
    assert reasons[2] is not None and "module 'model.layers.0.self_attn'" in reasons[2]


def test_estimate_timeline_json_and_picture(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """The `timeline` object: per device the split adds up to the iteration, each stream's busy and idle time too,
    and the estimate's split is the critical device's; --timeline draws PNG or SVG by the extension."""
    import xml.etree.ElementTree as ET

    pytest.importorskip("matplotlib")
    argv = ["estimate", "gpt3-125m", "--layers", "4", "--seq", "256", "--gpus", "8", "--batch", "32", "--pp", "2",
            "--chunks", "2", "--schedule", "interleaved", "--zero", "3"]
    code, out, err = run_cli(capsys, *argv, "--timeline", str(tmp_path / "t.png"), "--json")
    assert code == 0, err
    data = json.loads(out)
    timeline, e = data["timeline"], data["estimate"]
    assert timeline["iteration_seconds"] == pytest.approx(e["iteration_seconds"])
    assert [d["device"] for d in timeline["devices"]] == [0, 1] and timeline["devices"][0]["stages"] == [0, 2]
    for device in timeline["devices"]:
        parts = device["compute_seconds"] + device["exposed_comm_seconds"] + device["bubble_seconds"]
        assert parts == pytest.approx(timeline["iteration_seconds"])
        assert set(device["streams"]) == {"compute", "tp", "dp", "pp_forward", "pp_backward"}
        for stream in device["streams"].values():
            assert stream["busy_seconds"] + stream["idle_seconds"] == pytest.approx(timeline["iteration_seconds"])
    critical = timeline["devices"][timeline["critical_device"]]
    assert critical["compute_seconds"] == pytest.approx(e["compute_seconds"])
    assert critical["bubble_seconds"] == pytest.approx(e["bubble_seconds"])
    assert timeline["devices"][0]["streams"]["dp"]["busy_seconds"] > 0  # FSDP gathers and reduce-scatters
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli(capsys, *argv, "--timeline", str(tmp_path / "t.svg"))
    assert code == 0, err
    assert f"timeline written to {tmp_path / 't.svg'}" in out
    assert ET.parse(tmp_path / "t.svg").getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_timeline_refusals(capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before any work: the extension, the folder, matplotlib; an intra-op plan has no pipeline."""
    base = ["estimate", "gpt3-125m", "--layers", "2", "--gpus", "2", "--batch", "4", "--dp", "2"]
    for path, needle in [(tmp_path / "t.pdf", "give a file ending in .svg or .png"),
                         (tmp_path / "missing" / "t.svg", "does not exist"), (tmp_path, "give a file ending")]:
        code, out, err = run_cli(capsys, *base, "--timeline", str(path))
        assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "plan", "gpt3-125m", "--gpus", "4", "--search", "ilp", "--timeline",
                           str(tmp_path / "t.svg"))
    assert code == 2 and "--search ilp plans one mesh without a pipeline" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    code, out, err = run_cli(capsys, *base, "--timeline", str(tmp_path / "t.svg"))
    assert code == 2 and out == "" and "pip install 'autopar[plot]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.svg").exists()


def test_plan_timeline(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    pytest.importorskip("matplotlib")
    code, out, err = run_cli(capsys, "plan", "gpt3-125m", "--layers", "4", "--gpus", "8", "--batch", "32",
                             "--budget-s", "5", "--timeline", str(tmp_path / "p.svg"), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["timeline"]["iteration_seconds"] == pytest.approx(data["estimate"]["iteration_seconds"])
    assert len(data["timeline"]["devices"]) == data["plan"]["mesh"]["shape"][0]
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_run_reports_measured_against_predicted_only_for_the_device_it_was_priced_for(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    import dataclasses

    from autopar.cli.run import timing
    from autopar.plan import load_plan

    path = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", "gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4",
                           "--seq", "32", "--cluster", "cpu", "--gpus", "2", "--batch", "4", "--out", str(path))
    assert code == 0, err
    plan = load_plan(str(path))
    assert plan.estimate.cluster == "cpu"
    predicted = plan.estimate.iteration_seconds
    out = timing(plan, [9.0, 0.3, 0.1, 0.2])  # the first step is left out; the median of the rest
    assert out["measured_seconds"] == 0.2 and out["steps_timed"] == 3
    assert out["ratio"] == pytest.approx(0.2 / predicted) and out["why_no_ratio"] is None
    on_gpus = dataclasses.replace(plan, estimate=dataclasses.replace(plan.estimate, cluster="a100-80g-sxm"))
    out = timing(on_gpus, [0.5])
    assert out["ratio"] is None and "priced for a100-80g-sxm, not for these cpu ranks" in out["why_no_ratio"]
    older = dataclasses.replace(plan, estimate=dataclasses.replace(plan.estimate, cluster=None))
    assert timing(older, [0.5])["why_no_ratio"] == "the plan does not record the cluster it was priced for"


def test_a_causal_lm_at_sequence_1_is_refused_before_ranks_start(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path) -> None:
    """It has no next token to predict: its loss is NaN in one process as on the ranks. `run --check --json` used
    to start the ranks, fail the comparison of NaN with NaN, and print NaN, which is not JSON."""
    path = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", "hf:llama-tiny", "--seq", "32", "--cluster", "cpu", "--gpus", "2",
                           "--tp", "2", "--batch", "4", "--out", str(path))
    assert code == 0, err
    data = json.loads(path.read_text())
    data["plan"]["workload"]["seq"] = 1
    path.write_text(json.dumps(data))
    for command in (["dryrun", str(path)], ["run", str(path), "--nproc", "2", "--check", "--json"]):
        code, out, err = run_cli(capsys, *command)
        assert code == 2 and out == "" and "at sequence 1 has no next token to predict" in err


def test_losses_that_are_not_finite_fail_a_run_and_print_as_null() -> None:
    from autopar.cli.run import _finite, compare
    from autopar.runtime import StepLog

    nan = float("nan")
    checked = compare(StepLog(losses=[nan], grads=[{}]), StepLog(losses=[nan], grads=[{}]))
    assert not checked["ok"] and checked["message"].startswith("step 0: the loss is nan in one process too")
    assert json.dumps(_finite({"steps": [{"loss": nan, "seconds": 0.5}]}), allow_nan=False) == \
        '{"steps": [{"loss": null, "seconds": 0.5}]}'
