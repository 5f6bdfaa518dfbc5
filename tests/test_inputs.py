"""Every input bounded and finite: one stderr line naming the bad flag, file or field (exit 2), strict JSON, exit 3
when nothing fits, --out checked before any work, Ctrl-C keeps the best plan."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from autopar.cli.main import main
from autopar.plan import load_plan
from autopar.cluster import PRESETS, cluster_to_dict, load_cluster
from autopar.files import check_writable, read_text, write_atomic

SMALL = ["gpt3-125m", "--layers", "2", "--seq", "128"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def write_cluster(edit) -> None:  # noqa: ANN001
    data = cluster_to_dict(PRESETS["a100-80g-sxm"])
    edit(data)
    Path("cluster.yaml").write_text(yaml.safe_dump(data))


# ---- cluster files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["device"].update(kernel_overhead_us=math.nan),
         "device.kernel_overhead_us must be zero or a positive finite number up to 1,000,000, got nan"),
        (lambda d: d["device"].update(reserved_gib=math.inf),
         "device.reserved_gib must be zero or a positive finite number up to 65,536, got inf"),
        (lambda d: d["device"].update(reserved_gib=80),
         "device.reserved_gib must be less than device.memory_gib (80), got 80"),
        (lambda d: d["links"]["intra"].update(bandwidth_gbps=math.nan),
         "links.intra.bandwidth_gbps must be a positive finite number up to 1,000,000, got nan"),
        (lambda d: d["links"]["inter"].update(latency_us=-1),
         "links.inter.latency_us must be zero or a positive finite number up to 10,000,000, got -1"),
        (lambda d: d["links"]["intra"].update(measured={"ranks": 2, "bytes": [0, 0], "seconds": [1e-3, 1e-3]}),
         "links.intra.measured.bytes[0] must be an integer from 1 to 1,125,899,906,842,624, got 0"),
        (lambda d: d["links"]["intra"].update(measured={"ranks": 2, "bytes": [8, 8], "seconds": [1e-3, 1e-3]}),
         "links.intra.measured.bytes must be strictly ascending, got [8, 8]"),
        (lambda d: d["links"]["intra"].update(measured={"ranks": 2, "bytes": [8, 16, 32], "seconds": [1e-3, 2e-3]}),
         "links.intra.measured.bytes and links.intra.measured.seconds must have the same length, got 3 and 2"),
        (lambda d: d["links"]["intra"].update(measured={"ranks": 2, "bytes": [8, 16], "seconds": [1e-3, math.nan]}),
         "links.intra.measured.seconds[1] must be a positive finite number up to 3,600, got nan"),
        (lambda d: d.update(devices_per_node=8.5), "devices_per_node must be an integer from 1 to 1,024, got 8.5"),
        (lambda d: d.update(nodes=True), "nodes must be an integer from 1 to 131,072, got True"),
        (lambda d: d["device"]["peak_tflops"].update(bf16=1e9),
         "device.peak_tflops.bf16 must be a positive finite number up to 1,000,000, got 1000000000.0"),
        (lambda d: d["device"]["peak_tflops"].update(tf32=100),
         "unknown field device.peak_tflops.tf32 (known: bf16, fp16, fp32)"),
        (lambda d: d["device"].update(memory_gb=80), "unknown field device.memory_gb (known: name, memory_gib, "
         "peak_tflops, hbm_gbps, efficiency, gemm_efficiency, kernel_overhead_us, reserved_gib, host_cores)"),
        (lambda d: d["device"]["efficiency"].update(matmul=math.nan), "device.efficiency.matmul must be in (0, 1], got nan"),
        (lambda d: d.update(links=[1]), "links must be a mapping, got [1]"),
    ],
)
def test_cluster_file_fields_are_named_with_the_file(capsys, tmp_path, monkeypatch, edit, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    write_cluster(edit)
    code, out, err = run_cli(capsys, "estimate", *SMALL, "--batch", "4", "--cluster", "cluster.yaml", "--json")
    assert (code, out, err) == (2, "", f"autopar estimate: error: cluster.yaml: {message}\n")


def test_nan_in_a_cluster_file_never_reaches_a_plan(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_cluster(lambda d: d["device"].update(kernel_overhead_us=math.nan))
    code, out, _ = run_cli(capsys, "plan", *SMALL, "--gpus", "2", "--batch", "4", "--cluster", "cluster.yaml")
    assert code == 2 and "nan" not in out


def test_cluster_file_must_be_a_small_regular_utf8_file(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe.yaml")
    Path("big.yaml").write_text("#" * (1024 * 1024 + 1))
    Path("latin.yaml").write_bytes(b"name: caf\xe9\n")
    Path("broken.yaml").write_text("device: [1, 2\nlinks: 3\n")
    Path("list.yaml").write_text("- 1\n- 2\n")
    cases = {
        "/dev/zero": "/dev/zero: cluster file must be a regular file, got a character device",
        "pipe.yaml": "pipe.yaml: cluster file must be a regular file, got a named pipe",
        ".": ".: cluster file must be a regular file, got a folder",
        "nothing.yaml": "unknown cluster 'nothing.yaml': not a preset (a100-40g-pcie, a100-80g-sxm, v100-32g-nvlink, "
                        "h100-80g-sxm, h200-141g-sxm, cpu) and no such file",
        "big.yaml": "big.yaml: cluster file must be at most 1 MiB, got 1,048,577 bytes",
        "latin.yaml": "latin.yaml: cluster file must be UTF-8 text, got byte 0xe9 at offset 9",
        "broken.yaml": "broken.yaml: cannot parse cluster file: expected ',' or ']', but got ':' at line 2, column 6",
        "list.yaml": "list.yaml: a cluster file holds a mapping (name, device, links, ...), got [1, 2]",
    }
    for spec, message in cases.items():
        code, out, err = run_cli(capsys, "estimate", *SMALL, "--batch", "4", "--cluster", spec)
        assert (code, out, err) == (2, "", f"autopar estimate: error: {message}\n"), spec


def test_calibrated_cluster_files_still_load(tmp_path) -> None:
    from autopar.cluster import Link, Measured
    from dataclasses import replace

    measured = Measured(ranks=2, bytes=(1024, 1 << 20), seconds=(1e-3, 2e-3))
    cluster = replace(PRESETS["a100-80g-sxm"], name="calibrated", intra=Link(bandwidth=1e9, latency=1e-3, measured=measured))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False))
    assert load_cluster(str(path)) == cluster


# ---- flags -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "gpt3-125m", "--layers", "1000000"],
         "autopar profile: error: --layers must be a positive integer up to 2,048, got '1000000'"),
        (["profile", "gpt3-125m", "--hidden", "1000000"],
         "autopar profile: error: --hidden must be a positive integer up to 131,072, got '1000000'"),
        (["profile", "gpt3-125m", "--heads", "0"], "autopar profile: error: --heads must be a positive integer up to 1,024, got '0'"),
        (["profile", "gpt3-125m", "--vocab", "1e9"],
         "autopar profile: error: --vocab must be a positive integer up to 4,194,304, got '1e9'"),
        (["profile", "gpt3-125m", "--ffn", "-1"], "autopar profile: error: --ffn must be a positive integer up to 1,048,576, got '-1'"),
        (["profile", "moe-125m-e8", "--experts", "99999"],
         "autopar profile: error: --experts must be a positive integer up to 4,096, got '99999'"),
        (["profile", "gpt3-125m", "--seq", "0"], "autopar profile: error: --seq must be a positive integer up to 1,048,576, got '0'"),
        (["profile", "gpt3-125m", "--seq", "1048576", "--batch", "8192"],
         "autopar profile: error: --batch 8192 x --seq 1048576 = 8,589,934,592 tokens per batch; at most "
         "4,294,967,296 (2^32) are supported"),
        (["estimate", "gpt3-125m", "--batch", "-4"],
         "autopar estimate: error: --batch must be a positive integer up to 16,777,216, got '-4'"),
        (["estimate", "gpt3-125m", "--batch", "0"],
         "autopar estimate: error: --batch must be a positive integer up to 16,777,216, got '0'"),
        (["estimate", "gpt3-125m", "--tp", "1.5"], "autopar estimate: error: --tp must be a positive integer up to 131,072, got '1.5'"),
        (["estimate", "gpt3-125m", "--tp", "1024", "--pp", "1024"],
         "autopar estimate: error: --tp 1024 x --pp 1024 x --dp 1 = 1,048,576 devices; at most 131,072 are supported"),
        (["estimate", "gpt3-125m", "--zero", "4"], "autopar estimate: error: --zero must be one of 0, 1, 2, 3, got 4"),
        (["plan", "gpt3-125m", "--gpus", "abc"], "autopar plan: error: --gpus must be a positive integer up to 131,072, got 'abc'"),
        (["plan", "gpt3-125m", "--gpus", "200000"],
         "autopar plan: error: --gpus must be a positive integer up to 131,072, got '200000'"),
        (["plan", "gpt3-125m", "--gpus", "4", "--budget-s", "nan"],
         "autopar plan: error: --budget-s must be a positive finite number of seconds up to 86,400, got 'nan'"),
        (["plan", "gpt3-125m", "--gpus", "4", "--budget-s", "inf"],
         "autopar plan: error: --budget-s must be a positive finite number of seconds up to 86,400, got 'inf'"),
        (["plan", "gpt3-125m", "--gpus", "4", "--budget-s", "-1"],
         "autopar plan: error: --budget-s must be a positive finite number of seconds up to 86,400, got '-1'"),
        (["plan", "gpt3-125m", "--mesh", "1024x1024", "--search", "ilp"],
         "autopar plan: error: --mesh 1024x1024 has 1,048,576 devices; at most 131,072 are supported"),
        (["plan", "gpt3-125m", "--mesh", "2x2x2x2", "--search", "ilp"],
         "autopar plan: error: --mesh '2x2x2x2' must be one to three positive sizes, like 8 or 2x4"),
        (["plan", "gpt3-125m", "--gpus", "4", "--search", "best"],
         "autopar plan: error: --search must be one of auto, aceso, mcmc, exhaustive, megatron, dp, fsdp, ilp, got 'best'"),
        (["analyze", "gpt3-125m", "--gpus", "0"], "autopar analyze: error: --gpus must be a positive integer up to 131,072, got '0'"),
        (["frobnicate"], "autopar: error: COMMAND must be one of profile, profile-ops, profile-segments, estimate, analyze, plan, export, run, dryrun, calibrate, "
                         "models, got 'frobnicate'"),
    ],
)
def test_bad_flags_print_one_line_naming_the_flag(capsys, argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert (code, out, err) == (2, "", message + "\n")


def test_a_tensor_parallel_size_that_splits_heads_unevenly_is_refused(capsys) -> None:
    code, out, err = run_cli(capsys, "estimate", *SMALL, "--tp", "5", "--batch", "8")
    assert (code, out) == (2, "")
    assert err == ("autopar estimate: error: --tp 5 does not divide the model's attention heads and column-parallel "
                   "widths [12, 2304, 3072] (here 12, of module 'layers.0.attn' (its attention heads)): choose a --tp "
                   "that divides them all\n")


def test_a_bad_flag_prints_no_usage_block_from_the_console(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "autopar.cli.main", "plan", "gpt3-125m", "--gpus", "abc"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "autopar plan: error: --gpus must be a positive integer up to 131,072, got 'abc'\n"


def test_a_huge_layer_count_is_refused_at_once() -> None:
    start = time.perf_counter()
    assert main(["profile", "gpt3-125m", "--layers", "1000000"]) == 2
    assert time.perf_counter() - start < 1


# ---- --out -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["plan", *SMALL, "--gpus", "2"], ["estimate", *SMALL, "--dp", "2"]])
@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("", "--out must name a file, got ''"),
        ("missing/plan.json", "--out missing/plan.json: folder 'missing' does not exist"),
        (".", "--out .: is a folder; give a file path"),
    ],
)
def test_out_is_checked_before_any_work(capsys, tmp_path, monkeypatch, command: list[str], out: str,
                                        message: str) -> None:
    monkeypatch.chdir(tmp_path)
    import autopar.cli.common
    import autopar.cli.plan

    def no_trace(*_, **__):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("traced before checking --out")

    monkeypatch.setattr(autopar.cli.plan, "trace", no_trace)
    monkeypatch.setattr(autopar.cli.common, "trace", no_trace)  # estimate's and plan's model traces (load_and_trace)
    code, stdout, err = run_cli(capsys, *command, "--batch", "4", "--out", out)
    assert (code, stdout, err) == (2, "", f"autopar {command[0]}: error: {message}\n")


def test_files_helpers_name_the_path_the_user_gave(tmp_path) -> None:
    target = tmp_path / "plan.json"
    write_atomic(target, "{}\n")
    assert target.read_text() == "{}\n" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert read_text(target, what="plan file", limit=64) == "{}\n"
    with pytest.raises(ValueError, match=r"plan.json: plan file must be at most 2 bytes, got 3 bytes"):
        read_text(target, what="plan file", limit=2)
    with pytest.raises(ValueError, match=r"^nowhere/x.json: cannot write: No such file or directory$"):
        write_atomic("nowhere/x.json", "x")
    with pytest.raises(ValueError, match=r"^--out x/: ends with a separator; give a file path$"):
        check_writable("x/", flag="--out")
    check_writable(target, flag="--out")


# ---- exit 3 and strict JSON --------------------------------------------------------------------------------------


def test_estimate_that_does_not_fit_exits_3_with_advice(capsys, tmp_path) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["estimate", *SMALL, "--cluster", "cpu", "--gpus", "1", "--batch", "4096", "--mbs", "4096"]
    code, out, err = run_cli(capsys, *argv, "--out", str(out_file))
    assert code == 3 and not out_file.exists()
    assert err == ("autopar estimate: does not fit 1 x cpu: 178 GiB per device of 6 GiB (172 GiB missing); FSDP "
                   "with full recomputation fits on 2 devices\n")
    assert "DOES NOT FIT: this configuration needs 178 GiB per device of 6 GiB, 172 GiB missing" in out
    assert "micro-batch of 1 per dp rank: 1.35 GiB per device, fits" in out
    assert f"plan not written to {out_file}: it does not fit" in out
    code, out, _ = run_cli(capsys, *argv, "--json")
    data = strict_json(out)
    assert code == 3 and data["fits"] is False and data["estimate"]["memory"]["fits"] is False
    assert data["fit"]["devices"]["count"] == 2
    assert {o["change"] for o in data["fit"]["options"] if o["fits"]} >= {"micro-batch of 1 per dp rank"}


def test_plan_that_does_not_fit_exits_3_and_writes_nothing(capsys, tmp_path) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, "plan", *SMALL, "--hidden", "8192", "--heads", "64", "--cluster", "cpu",
                             "--gpus", "1", "--batch", "4", "--budget-s", "2", "--out", str(out_file), "--json")
    data = strict_json(out)
    assert code == 3 and data["fits"] is False and not out_file.exists()
    assert err.startswith("autopar plan: no plan fits 1 x cpu: the least-over needs ")
    assert len(err.splitlines()) == 1
    assert data["fit"]["missing_bytes"] == data["fit"]["total_bytes"] - data["fit"]["budget_bytes"] > 0


def test_plan_that_fits_says_so_in_strict_json(capsys) -> None:
    code, out, _ = run_cli(capsys, "plan", *SMALL, "--gpus", "2", "--batch", "4", "--budget-s", "2", "--json")
    assert code == 0 and strict_json(out)["fits"] is True


def test_main_refuses_to_print_nan_as_json(capsys, monkeypatch) -> None:
    import autopar.cli.models

    monkeypatch.setattr(autopar.cli.models, "run", lambda args: {"x": math.nan})
    code, out, err = run_cli(capsys, "models", "--json")
    assert (code, out) == (2, "")
    assert err == "autopar models: error: the result holds a value JSON cannot carry (Out of range float values " \
                  "are not JSON compliant: nan)\n"


def test_key_errors_name_the_input_file(capsys, monkeypatch) -> None:
    import autopar.cli.dryrun

    def missing(args):  # noqa: ANN001, ANN202
        raise KeyError("model")

    monkeypatch.setattr(autopar.cli.dryrun, "run", missing)
    code, _, err = run_cli(capsys, "dryrun", "p.json")
    assert (code, err) == (2, "autopar dryrun: error: p.json: missing field 'model'\n")


# ---- Ctrl-C during --search ilp ----------------------------------------------------------------------------------


def test_ctrl_c_during_the_intra_op_search_keeps_the_best_plan(capsys, tmp_path, monkeypatch) -> None:
    """The search is stopped mid-way by SIGINT; the plans found so far are printed and written."""
    import autopar.cli.plan
    from autopar.search import plan_intra

    stopped = threading.Event()

    def interrupted_search(*args, kinds, should_stop, **kwargs):  # noqa: ANN002, ANN003, ANN202
        found = plan_intra(*args, kinds=kinds, should_stop=should_stop, **kwargs)  # a full search: baselines, ilp
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the search would go on: it asks the search to stop
        if should_stop():
            stopped.set()
        return found

    monkeypatch.setattr(autopar.cli.plan, "plan_intra", interrupted_search)
    out_file = tmp_path / "plan.json"
    # --allow-unrunnable: the programme's plan itself, whether or not `autopar run` could run it
    code, out, err = run_cli(capsys, "plan", *SMALL, "--gpus", "2", "--batch", "4", "--search", "ilp",
                             "--allow-unrunnable", "--out", str(out_file), "--json")
    assert code == 0, err
    data = strict_json(out)
    assert data["interrupted"] is True and data["plan"]["kind"] == "ilp"
    assert json.loads(out_file.read_text())["plan"] == data["plan"]
    assert stopped.wait(10)


@pytest.mark.slow
def test_ctrl_c_stops_a_running_intra_op_search_promptly(tmp_path) -> None:
    out_file = tmp_path / "plan.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "autopar.cli.main", "plan", "llama-7b", "--layers", "8", "--seq", "1024", "--gpus", "8",
         "--mesh", "2x2x2", "--batch", "256", "--search", "ilp", "--budget-s", "600", "--out", str(out_file), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(20)  # imports, tracing, the baselines: mid-search on this machine (the whole search takes 46 s)
    proc.send_signal(signal.SIGINT)
    # then the plans in hand are checked on a fake process group of 8, as every plan is: 7-12 s each on this mesh
    # when the machine is idle, several times that on a busy one (the timeout guards against a hang; the search's
    # own time below is what this test measures)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode == 130:  # before any plan of any kind, or after the search had ended and written its plan
        assert err == "autopar: interrupted\n"
        assert not out_file.exists() or load_plan(out_file).kind  # never half a file
        return
    assert proc.returncode == 0, err
    data = strict_json(out)
    assert data["interrupted"] is True and out_file.exists()
    # the search itself stopped at its next step: it began after the imports and the trace, well within the 20 s
    # before Ctrl-C, and a step (an attempt's edge matrices, polled per row; one solve) takes seconds
    assert data["search_seconds"] < 20 + 10


def test_a_config_transformers_cannot_build_is_refused_in_one_line(capsys) -> None:
    """transformers' own code failing on a config (DBRX's default config lacks a field its attention reads) is an
    error naming the model and the reason, exit 2, not a traceback."""
    from torch import nn

    from autopar.zoo.hf_auto import _construct

    class Broken(nn.Module):
        def __init__(self, config: object) -> None:
            raise AttributeError("'BrokenConfig' object has no attribute 'rope_theta'")

    with pytest.raises(ValueError, match=r"hf:broken: transformers cannot build Broken from this config "
                                         r"\(AttributeError: 'BrokenConfig' object has no attribute 'rope_theta'\)"):
        _construct("hf:broken", Broken, None, "meta")
    code, _, err = run_cli(capsys, "profile", "hf:dbrx")
    assert "Traceback" not in err
    if code:  # the transformers this was written with cannot build DBRX's default config
        assert code == 2 and "hf:dbrx: transformers cannot build DbrxForCausalLM from this config" in err
