"""Clipping the gradients' norm on a plan's ranks (`ParallelModel.clip_grad_norm_`) clips by the norm one process
computes over the whole model: pipeline stages hold their own layers, FSDP and tensor parallelism hold shards, and
an intra-op plan under ZeRO 1-3 holds this rank's slices of the weights it keeps whole; each element is counted
once, whatever the number of ranks holding it."""

from __future__ import annotations

import json
import math

import intra_ranks
import pytest
import torch

from autopar.cli.main import main
from autopar.cli.run import compare
from autopar.cluster.ranks import run_ranks
from autopar.plan import Plan, load_plan
from autopar.runtime import reference, run_plan
from autopar.runtime.train import Workload

TINY = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "32"]


def test_intra_op_plans_under_zero_clip_by_the_norm_one_process_computes() -> None:
    """The GPT in Megatron's layout under ZeRO 3 (one layer recomputed, two micro-batches: its tied table and head
    and its norms kept in slices), and the LLaMA in data parallelism under ZeRO 1 over a 2 x 2 mesh, clipped to a
    norm of order 2 and of order inf below the one their gradients have: every step's norm matches one process
    running PyTorch's own clipping, and so do the losses of the AdamW steps after it."""
    from autopar.search.intra import choice_of, plan_of_choice

    name, work, space = intra_ranks._space("gpt", (2, 2), batch=8, traced=4)
    megatron = intra_ranks.assignments("gpt", 1, seed=0, micro_batches=(2,), zero=(3,))[0]
    megatron = plan_of_choice(space, choice_of(space, Plan.from_dict(megatron).blocks), global_batch=8,
                              micro_batches=2, zero=3, dtype="fp32", recompute=["layers.0"]).to_plan(name, work)
    dp = intra_ranks.assignments("llama", 2, seed=0, micro_batches=(1,), zero=(1,))[1]
    assert dp["zero"] == 1
    plans = [megatron.to_dict(), dp, megatron.to_dict(), dp]
    clips = [(0.5, 2.0), (0.5, 2.0), (0.01, math.inf), (0.01, math.inf)]
    results = run_ranks(intra_ranks.with_extras, 4, args=(plans, 3, [{"clip": clip} for clip in clips]))
    for per_plan in results:
        for (max_norm, _), got in zip(clips, per_plan):
            assert min(got["norms"]) > max_norm  # clipping acts in every step
            assert got["norm"] < 1e-5, got
            assert got["loss"] < 1e-4 and got["drift"] == 0.0, got


@pytest.mark.parametrize("layout", [["--pp", "2", "--dp", "2", "--zero", "1"], ["--pp", "2", "--tp", "2"],
                                    ["--tp", "2", "--dp", "2", "--zero", "3"]])
def test_autopar_run_clips_pipelines_and_sharded_stages_by_the_whole_models_norm(tmp_path, capsys, layout) -> None:
    """`autopar run --clip-grad-norm` on 4 ranks: two stages (the tied head's gradient on both ends, counted
    once) over dp under ZeRO 1 or over tp, and one stage of FSDP over tensor-parallel shards: each step's norm is
    one process's, and losses and gradients match."""
    path = tmp_path / "plan.json"
    assert main(["estimate", *TINY, "--cluster", "cpu", "--batch", "8", "--mbs", "2", *layout, "--out",
                 str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "4", "--steps", "3", "--check", "--clip-grad-norm", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["check"]["ok"], data["check"]
    norms = [step["grad_norm"] for step in data["steps"]]
    plan = load_plan(path)
    ref = reference(Workload.of(plan), steps=3, clip=1.0)
    assert min(ref.grad_norms) > 1  # clipping acts in every step
    assert norms == pytest.approx(ref.grad_norms, rel=1e-5)


def test_a_norm_counted_on_one_rank_only_is_caught_by_the_check(tmp_path, capsys, monkeypatch) -> None:
    """The check compares each step's norm with one process's: a run whose norm is wrong (here each rank's own
    gradients' norm, as ``torch.nn.utils.clip_grad_norm_`` on a stage's parameters gives) fails, naming it."""
    from autopar.runtime.train import StepLog

    path = tmp_path / "plan.json"
    assert main(["estimate", *TINY, "--cluster", "cpu", "--batch", "8", "--pp", "2", "--out", str(path)]) == 0
    capsys.readouterr()
    work = Workload.of(load_plan(path))
    ref = reference(work, steps=2, clip=1.0)
    wrong = StepLog(losses=list(ref.losses), grads=list(ref.grads), grad_norms=[n * 0.8 for n in ref.grad_norms])
    result = compare(wrong, ref)
    assert not result["ok"] and "norm" in result["message"]


def test_clipping_asks_for_a_positive_bound(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    assert main(["estimate", *TINY, "--cluster", "cpu", "--batch", "8", "--dp", "2", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--clip-grad-norm", "0"]) == 2
    assert "--clip-grad-norm must be a positive number, got 0.0" in capsys.readouterr().err


def test_one_process_clips_as_pytorch_does_by_the_norm_summed_in_float64() -> None:
    """A model `parallelize` did not make (one process) clips as PyTorch's function does, by the norm summed in
    float64 as the ranks sum it: PyTorch's own fp32 norm of a gradient of millions of elements (an embedding's) can
    be 1e-4 off, enough for ranks and one process to clip apart."""
    from autopar.runtime.apply import ParallelModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50_000, 64), torch.nn.Linear(64, 2))
    twin = torch.nn.Sequential(torch.nn.Embedding(50_000, 64), torch.nn.Linear(64, 2))
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50_000, (64, 16))
    for m in (model, twin):
        m(ids).square().sum().backward()
    exact = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    ours = ParallelModel(model, 0, lambda cls, **kw: cls(model.parameters(), **kw)).clip_grad_norm_(0.1)
    theirs = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1))
    assert ours == pytest.approx(exact, rel=1e-12)
    assert theirs == pytest.approx(exact, rel=1e-3)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-3, atol=0)
