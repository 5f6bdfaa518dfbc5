"""Plans run with PyTorch's distributed engine on gloo ranks and match one process (losses and gradients)."""

import json

import pytest
import torch

from autopar.cli.main import main
from autopar.cli.run import compare
from autopar.runtime import StepLog, check_supported

TINY = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "32"]


def _plan(tmp_path, capsys, *extra: str) -> dict:
    path = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--cluster", "cpu", "--gpus", "2", "--batch", "8", "--out", str(path), *extra]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_data_parallel_plans_match_one_process(tmp_path, capsys, zero: int) -> None:
    data = _plan(tmp_path, capsys, "--search", "dp")
    data["plan"]["zero"] = zero  # DDP, DDP + ZeroRedundancyOptimizer, FSDP2
    path = tmp_path / f"zero{zero}.json"
    path.write_text(json.dumps(data))
    assert main(["run", str(path), "--nproc", "2", "--steps", "3", "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]["message"]
    assert len(out["steps"]) == 3 and out["steps"][2]["loss"] < out["steps"][0]["loss"]


def test_the_check_names_the_first_mismatch() -> None:
    grads = {"w": torch.ones(3), "b": torch.zeros(2)}
    ref = StepLog(losses=[1.0, 0.5], grads=[grads, grads])
    same = StepLog(losses=[1.0, 0.5], grads=[dict(grads), dict(grads)])
    assert compare(same, ref)["ok"]
    off = StepLog(losses=[1.0, 0.5], grads=[grads, {"w": torch.ones(3) * 1.01, "b": torch.zeros(2)}])
    result = compare(off, ref)
    assert not result["ok"] and "step 1" in result["message"] and "of w" in result["message"]
    assert "loss" in compare(StepLog(losses=[1.0, 0.6], grads=[]), ref)["message"]


def test_unsupported_plans_are_refused_by_name(tmp_path, capsys) -> None:
    plan = _plan(tmp_path, capsys, "--search", "dp")["plan"]
    check_supported(plan)
    tp = json.loads(json.dumps(plan))
    tp["stages"][0].update(tp=2, dp=1)
    with pytest.raises(NotImplementedError, match="tp 2"):
        check_supported(tp)
    with pytest.raises(NotImplementedError, match="intra-op"):
        check_supported({k: v for k, v in plan.items() if k != "stages"})
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"plan": tp, "estimate": {}}))
    assert main(["run", str(path), "--nproc", "2"]) == 2
    assert "tensor parallelism cannot be run yet" in capsys.readouterr().err
