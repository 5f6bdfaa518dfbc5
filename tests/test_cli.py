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
