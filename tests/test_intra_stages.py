"""Pipeline stages whose layers the intra-op planner lays out block by block (`Stage.layouts`) run
(`autopar.runtime.intra.lay_out_layers`): a plan records each layer's layout and each leading module's input and
output layouts; the cost model prices the recorded layouts as written; each such plan either passes the plan-time
check and trains what one process trains, with the collectives it priced, or is refused when planned, saying why."""

from __future__ import annotations

import json
import random

import intra_stages
import pytest

from autopar.plan import Plan

# Megatron's layout, run through DTensor: q, k and v cut from the fused projection's own shard; and the layout
# the planner picks for LLaMA-70B and GPT-3 175B on A100s: the attention's output gathered for a projection split by
# output features, the norm after it run on those features, the MLP's input gathered again
MEGATRON = {"attn.qkv": "n", "attn.proj": "k", "mlp.fc1": "n", "mlp.fc2": "k"}
GATHERED = {"attn.qkv": "n", "attn.proj": "n", "mlp.fc1": "n", "mlp.fc2": "k"}
LLAMA = {"attn.qkv": "n", "attn.proj": "n", "mlp.gate": "n", "mlp.up": "n", "mlp.down": "k"}
HF = {"self_attn.q_proj": "n", "self_attn.k_proj": "n", "self_attn.v_proj": "n", "self_attn.o_proj": "n",
      "mlp.gate_proj": "n", "mlp.up_proj": "n", "mlp.down_proj": "k"}


def _run(tmp_path, data: dict, capsys) -> dict:  # noqa: ANN001
    """`autopar run --check --check-comm` of the plan ``data`` over 3 steps: its JSON output."""
    from autopar.cli.main import main
    from autopar.plan import save_plan

    path = tmp_path / "plan.json"
    plan = Plan.from_dict(data)
    save_plan(str(path), plan)
    capsys.readouterr()
    code = main(["run", str(path), "--nproc", str(plan.devices), "--steps", "3", "--check", "--check-comm", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_a_plan_records_each_laid_out_module_and_its_layouts_price_as_written() -> None:
    """The plan names, per laid-out leading module, the layouts its input and output take (the runtime converts
    them there); the layouts read back price as they were priced; a split the layer cannot make is refused naming
    the module."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.intra_layers import Conditions
    from autopar.cost.pipeline import PipelineModel
    from autopar.zoo import load

    plan = Plan.from_dict(intra_stages.plan("gpt", GATHERED))
    entries = {m.fqn: m for m in plan.modules}
    assert [str(p) for p in entries["layers.0.attn.proj"].input] == ["R", "R"]  # the attention's output, gathered
    assert entries["layers.0.attn.proj"].output[1].is_shard()  # handed on split by features
    assert entries["layers.0.mlp.fc2"].input[1].is_shard()
    assert plan.stages[0].intra and dict(plan.stages[0].layouts)["layers.1"] == tuple(GATHERED.items())

    name, overrides = intra_stages.MODELS["gpt"]
    zoo = load(name, batch=2, seq=intra_stages.SEQ, **overrides)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(2),
                          traced_batch=2)
    row = next(r for r, layer in enumerate(model.layers) if layer.repeated)
    mesh = model._mesh(1, 1, 2)
    when = Conditions(samples=2, dp=1, dp_axis=mesh.axis("dp"), zero=0, micro_batches=2, in_flight=2)
    laid = model.intra_layers.layout_as(row, mesh.axis("tp"), when, tuple(GATHERED.items()))
    assert laid.splits == tuple(GATHERED.items())
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.proj as 'x'"):
        model.intra_layers.layout_as(row, mesh.axis("tp"), when, tuple({**GATHERED, "attn.proj": "x"}.items()))
    with pytest.raises(ValueError, match="leads no block"):
        model.intra_layers.layout_as(row, mesh.axis("tp"), when, tuple({**GATHERED, "attn.nowhere": "n"}.items()))


def test_laid_out_layers_pass_the_plan_time_check_or_are_refused_saying_why() -> None:
    """Random layouts of a tiny GPT's layers on tp 2: each is either applied on a fake process group with the
    collectives its estimate counts, or refused with the difference; never an error of PyTorch's, never a plan
    that computes something else in silence (those that pass are trained against one process below)."""
    from autopar.runtime.validate import check_runnable

    choices = intra_stages.options("gpt")
    rng = random.Random(5)
    draws = [MEGATRON, GATHERED] + [{m: rng.choice(c) for m, c in choices.items()} for _ in range(8)]
    passed = 0
    for splits in draws:
        plan = Plan.from_dict(intra_stages.plan("gpt", splits))
        try:
            check_runnable(plan)
            passed += 1
        except ValueError as exc:
            assert "do not carry through the model as its estimate assumes" in str(exc), (splits, exc)
    assert passed >= 3


def test_sequence_parallelism_with_laid_out_layers_is_refused_when_planned() -> None:
    from autopar.runtime.validate import check_runnable

    with pytest.raises(NotImplementedError, match="intra-op planner"):
        check_runnable(Plan.from_dict(intra_stages.plan("llama", LLAMA, sp=True)))


def test_laid_out_layers_train_as_one_process_with_the_collectives_they_priced(tmp_path, capsys) -> None:
    """GPT's layers with the attention's output gathered for its projection, recomputed in full (the replay stops
    where checkpointing stops, after the last op that saves a tensor, as priced), on tp 2."""
    data = _run(tmp_path, intra_stages.plan("gpt", GATHERED, recompute="full"), capsys)
    assert data["check"]["ok"] and data["check_comm"]["ok"]
    assert data["check"]["max_grad_diff"] < 1e-5


def test_a_pipeline_of_laid_out_layers_trains_as_one_process(tmp_path, capsys) -> None:
    """LLaMA (grouped-query attention) in two stages of tp 2, each layer laid out as the planner lays out LLaMA-70B's:
    its norms between the gathers run on split features."""
    data = _run(tmp_path, intra_stages.plan("llama", LLAMA, pp=2), capsys)
    assert data["check"]["ok"] and data["check_comm"]["ok"]


@pytest.mark.parametrize("zero", [1, 3])
def test_laid_out_layers_under_zero_train_as_one_process(tmp_path, capsys, zero: int) -> None:
    """dp 2 x tp 2 under ZeRO: FSDP shards the laid-out weights over dp, and sums over tp the gradients of the
    weights a layout keeps whole while splitting their work (the MLP's input split by tokens), each whole, as
    priced."""
    splits = {"attn.qkv": "R", "attn.proj": "R", "mlp.fc1": "m", "mlp.fc2": "R"}
    data = _run(tmp_path, intra_stages.plan("gpt", splits, dp=2, batch=8, zero=zero), capsys)
    assert data["check"]["ok"] and data["check_comm"]["ok"]
    summed = [r for r in data["check_comm"]["ranks"][0]["rows"] if (r["kind"], r["axis"]) == ("all_reduce", "tp")]
    assert summed and summed[0]["counted"] > 0


@pytest.mark.parametrize("family", ["hf-llama", "hf-qwen3"])
def test_hugging_face_layers_laid_out_train_as_one_process(tmp_path, capsys, family: str) -> None:
    """Hugging Face's LLaMA and Qwen3 from config, each layer laid out as the planner lays out LLaMA-70B's: their
    RMSNorm, written out, takes the mean of its squares over split features (summed in a small all-reduce, as
    priced); Qwen3's q and k norms per head."""
    data = _run(tmp_path, intra_stages.plan(family, HF), capsys)
    assert data["check"]["ok"] and data["check_comm"]["ok"]
