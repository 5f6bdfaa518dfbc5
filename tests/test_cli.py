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
        (["profile", "gpt3-125m", "--batch", "0"], "--batch must be positive"),
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
    # the fitted line stays near its own large-message measurements (gloo on a shared CPU is noisy)
    assert data["fit"]["max_relative_error_from_4mib"] < 0.5
    code, out, err = run_cli(
        capsys, "estimate", "gpt3-125m", "--layers", "2", "--seq", "128", "--cluster", str(out_file),
        "--batch", "4", "--dp", "2", "--dtype", "fp32", "--json",
    )
    assert code == 0, err
    assert json.loads(out)["cluster"] == "cpu-calibrated"
