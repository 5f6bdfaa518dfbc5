"""Mixtures of experts: Hugging Face's experts (one matrix per expert, run by a grouped matmul) split by features
under tensor parallelism, their routers kept whole, as Megatron-LM runs them, or by expert over the data-parallel
ranks (expert parallelism, all-to-alls moving the tokens), and priced so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.analysis import op_dims
from autopar.analysis.dims import Split
from autopar.capture import trace
from autopar.cli.main import main
from autopar.cost.layers import analyse, routers
from autopar.plan import load_plan
from autopar.sharding import PARTIAL, REPLICATE
from autopar.sharding.strategies import PASS, apply
from autopar.zoo import load

# a vocabulary of 1,024, not the models' own 32,000-152,000: the embedding and head would hold most of the weights and
# of the time the checks take
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "1024", "--seq", "32",
         "--cluster", "cpu", "--batch", "8", "--mbs", "2"]
KV = {"mixtral": ["--kv-heads", "2"], "qwen2_moe": [], "qwen3_moe": []}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _graph(name: str):  # noqa: ANN202
    zoo = load(f"hf:{name}", batch=2, seq=16, dtype=torch.float32, layers=2, hidden=64, heads=4, ffn=128,
               **({"kv_heads": 2} if name == "mixtral" else {}))
    return trace(zoo.module, example_kwargs=zoo.inputs)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_grouped_experts_split_by_features_and_routers_stay_whole(name: str) -> None:
    """The experts' grouped matmuls split their output features freely and leave partial sums over the contracted
    ones; the rows (sorted by expert, cut by ``offs``) and the experts are fixed. Megatron's roles: the gate/up
    weights column-parallel, the down weights row-parallel, the router (whose scores pick the experts) and
    Qwen2-MoE's one-feature shared-expert gate whole."""
    graph = _graph(name)
    grouped = [n for n in graph.nodes if n.op == "aten._grouped_mm.default" and ".layers.0." in n.module]
    assert len(grouped) == 2
    for node in grouped:
        dims = {d.name: d.split for d in op_dims(node).dims}
        assert dims == {"m": Split.FIXED, "k": Split.PARTIAL, "n": Split.FREE, "experts": Split.FIXED}
    whole = routers(graph)
    named = {graph.node(i).module.rpartition(".")[2] for i in whole if ".layers.0." in graph.node(i).module}
    assert named == ({"gate", "shared_expert_gate"} if name == "qwen2_moe" else {"gate"})
    layer = next(row for row in analyse(graph) if row.repeated)
    up, down = grouped
    assert up.id in layer.columns and down.id in layer.sharded and down.id not in layer.columns
    assert not whole & layer.sharded


def test_a_pending_sum_through_a_product_gives_the_other_factor_a_partial_gradient() -> None:
    """``pending * w`` passes a partial sum on, and ``w``'s gradient, ``grad * pending``, is then partial on each
    device too (the routing weights that scale each rank's share of the experts' outputs); a sum's operands get the
    whole gradient."""

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x * w) + x

    graph = trace(Scaled(), (torch.randn(4, 8), torch.randn(4, 1)))
    product = next(n for n in graph.nodes if n.op == "aten.mul.Tensor")
    strategy = apply(op_dims(product), (PASS,), product.inputs, product.outputs, (2,))
    assert strategy.outputs == ((PARTIAL,),) and strategy.gradients == ((REPLICATE,), (PARTIAL,))
    total = next(n for n in graph.nodes if n.op == "aten.add.Tensor")
    strategy = apply(op_dims(total), (PASS,), total.inputs, total.outputs, (2,))
    assert strategy.gradients == ((REPLICATE,), (REPLICATE,))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_plans_split_experts_by_features_and_keep_routers_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """A tp 2 plan is written (the plan-time rehearsal on a fake process group counts the collectives priced) with
    every expert's gate/up weights split by output features and its down weights by input features; the router
    and the shared-expert gate whole on every rank."""
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", f"hf:{name}", *SMALL, *KV[name], "--gpus", "2", "--tp", "2", "--pp", "1",
                        "--out", str(out))
    assert code == 0 and out.exists(), err
    modules = json.loads(out.read_text())["plan"]["modules"]
    experts = "model.layers.0.mlp.experts"
    assert modules[experts]["params"] == {f"{experts}.gate_up_proj": "[R, S(1)]", f"{experts}.down_proj": "[R, S(2)]"}
    assert modules["model.layers.0.mlp.gate"]["params"] == {"model.layers.0.mlp.gate.weight": "[R, R]"}
    if name == "qwen2_moe":
        gate = "model.layers.0.mlp.shared_expert_gate"
        assert modules[gate]["params"] == {f"{gate}.weight": "[R, R]"}
        assert modules["model.layers.0.mlp.shared_expert.down_proj"]["params"] == {
            "model.layers.0.mlp.shared_expert.down_proj.weight": "[R, S(1)]"}
    assert not [p for entry in modules.values() for p in entry.get("summed", [])]
    code, _, err = _cli(capsys, "estimate", f"hf:{name}", *SMALL, *KV[name], "--gpus", "2", "--tp", "2", "--pp", "1",
                        "--sp", "--out", str(tmp_path / "sp.json"))
    if name == "mixtral":  # the block of router and experts gathers the sequence and reduce-scatters its output
        assert code == 0, err
    else:  # its shared expert's projections would gather the sequence the block gathered: refused when planned
        assert code == 2 and "module 'model.layers.0.mlp' (Qwen2MoeSparseMoeBlock) holds experts and the split " \
            "projection 'model.layers.0.mlp.shared_expert.gate_proj' beside them" in err
        assert not (tmp_path / "sp.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "options", "ranks"), [
    ("mixtral", ["--tp", "2", "--pp", "1"], 2),
    ("mixtral", ["--tp", "2", "--pp", "1", "--sp"], 2),  # the block gathers the sequence and scatters its sum
    ("qwen2_moe", ["--tp", "2", "--pp", "1", "--experts", "8"], 2),  # beside a shared expert: column- and row-parallel
    ("mixtral", ["--tp", "2", "--pp", "2"], 4),
    ("mixtral", ["--tp", "2", "--pp", "1", "--dp", "2", "--zero", "3"], 4),  # FSDP gathers the weights of each forward
    ("mixtral", ["--tp", "2", "--pp", "1", "--recompute", "full"], 2),
])
def test_experts_split_by_features_train_as_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, options: list[str], ranks: int) -> None:
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", f"hf:{name}", *SMALL, *KV[name], "--gpus", str(ranks), *options,
                        "--out", str(out))
    assert code == 0, err
    code, text, err = _cli(capsys, "run", str(out), "--nproc", str(ranks), "--steps", "3", "--check", "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text and "check-comm: every rank's" in text


EP = [*SMALL, "--gpus", "2", "--dp", "2"]


def _estimate(capsys: pytest.CaptureFixture[str], name: str, *options: str) -> dict:
    code, out, err = _cli(capsys, "estimate", f"hf:{name}", *EP, *KV[name], *options, "--json")
    assert code == 0, err
    return json.loads(out)["estimate"]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_expert_parallel_plans_split_experts_by_expert_and_price_their_all_to_alls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Under --ep 2 every expert's parameters are split by expert over dp (the router, and a shared expert, whole
    and averaged over dp); each rank holds half the experts' parameters, gradients and optimizer states, the
    experts' gradients leave the dp all-reduce, and each micro-batch of each layer issues the all-to-alls the
    runtime issues: 3 in the forward (counts, tokens, results), 2 in the backward."""
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", f"hf:{name}", *EP, *KV[name], "--ep", "2", "--out", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())["plan"]
    assert data["ep"] == 2
    experts = "model.layers.0.mlp.experts"
    assert data["modules"][experts]["params"] == {f"{experts}.gate_up_proj": "[S(0), R]",
                                                  f"{experts}.down_proj": "[S(0), R]"}
    assert data["modules"]["model.layers.0.mlp.gate"]["params"] == {"model.layers.0.mlp.gate.weight": "[R, R]"}
    zoo = load(f"hf:{name}", batch=1, seq=32, layers=2, hidden=64, heads=4, ffn=128,
               **({"kv_heads": 2} if name == "mixtral" else {}))
    params = dict(zoo.module.named_parameters())
    count = params[f"{experts}.gate_up_proj"].shape[0]
    split = 2 * sum(params[f"{experts}.{w}"].numel() for w in ("gate_up_proj", "down_proj"))  # both layers
    whole, by_expert = _estimate(capsys, name), _estimate(capsys, name, "--ep", "2")
    bf16 = 2
    assert whole["memory"]["parameters"] - by_expert["memory"]["parameters"] == split // 2 * bf16
    assert whole["memory"]["gradients"] - by_expert["memory"]["gradients"] == split // 2 * bf16

    def synced(estimate: dict) -> int:
        return sum(c["bytes"] * c["count"] for c in estimate["collectives"] if c["kind"] == "all_reduce")

    assert synced(whole) - synced(by_expert) == split * bf16  # no expert's gradient all-reduced
    calls = {c["bytes"]: c["count"] for c in by_expert["collectives"] if c["kind"] == "all_to_all"}
    micro_batches, layers, top_k = 2, 2, 2 if name == "mixtral" else 4
    tokens = 32 * 8 // (micro_batches * 2)  # a micro-batch's tokens on one rank
    assert calls == {8 * count: layers * micro_batches, tokens * top_k * 64 * bf16: 4 * layers * micro_batches}


@pytest.mark.parametrize(("options", "message"), [
    (["--dp", "4", "--gpus", "4"], "--ep 2: expert parallelism splits the experts over each stage's whole "
                                   "data-parallel group, without tensor parallelism, so far: ep 2 needs dp 2 and tp 1 "
                                   "(got dp 4, tp 1)"),
    (["--tp", "2", "--gpus", "4"], "ep 2 needs dp 2 and tp 1 (got dp 2, tp 2)"),
])
def test_expert_parallelism_outside_what_runs_is_refused(
        capsys: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    code, _, err = _cli(capsys, "estimate", "hf:mixtral", *EP, *KV["mixtral"], "--ep", "2", *options)
    assert code == 2 and message in err


def test_expert_parallel_pipelines_leave_the_experts_out_of_each_stage_s_all_reduce(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2 stages of dp 2: each stage splits its layer's experts over its dp ranks, all-reduces the rest of its
    gradients by hand without them, and its all-to-alls are the single-stage plan's share of its layers; the
    plan passes the plan-time check, each stage rehearsed on its own."""
    pipeline = [*SMALL, *KV["mixtral"], "--gpus", "4", "--dp", "2", "--pp", "2"]

    def estimate(*options: str) -> dict:
        code, out, err = _cli(capsys, "estimate", "hf:mixtral", *pipeline, *options, "--json")
        assert code == 0, err
        return json.loads(out)["estimate"]

    def calls(estimate: dict, kind: str) -> int:
        return sum(c["bytes"] * c["count"] for c in estimate["collectives"] if c["kind"] == kind)

    zoo = load("hf:mixtral", batch=1, seq=32, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128)
    experts = sum(p.numel() for name, p in zoo.module.named_parameters() if ".experts." in name)
    whole, by_expert = estimate(), estimate("--ep", "2")
    bf16 = 2
    assert calls(whole, "all_reduce") - calls(by_expert, "all_reduce") == experts * bf16
    assert calls(by_expert, "all_to_all") == calls(_estimate(capsys, "mixtral", "--ep", "2"), "all_to_all")
    # the busier stage holds half of its layer's experts
    assert whole["memory"]["parameters"] - by_expert["memory"]["parameters"] == experts // 2 // 2 * bf16
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", "hf:mixtral", *pipeline, "--ep", "2", "--out", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["plan"]["ep"] == 2


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_under_zero_fsdp_leaves_the_experts_to_their_ranks_and_is_priced_so(
        capsys: pytest.CaptureFixture[str], zero: int) -> None:
    """Under ZeRO 1-3 FSDP shards, gathers and reduce-scatters every weight but the experts, which each rank holds
    1 / ep of, whole: its gathers and reduce-scatters carry the experts' bytes less, and the experts' gradients stay
    whole on their rank."""
    zoo = load("hf:mixtral", batch=1, seq=32, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=1024)
    experts = sum(p.numel() for name, p in zoo.module.named_parameters() if ".experts." in name)
    others = sum(p.numel() for name, p in zoo.module.named_parameters() if ".experts." not in name)
    whole = _estimate(capsys, "mixtral", "--zero", str(zero))
    by_expert = _estimate(capsys, "mixtral", "--zero", str(zero), "--ep", "2")

    def calls(estimate: dict, kind: str) -> int:
        return sum(c["bytes"] * c["count"] for c in estimate["collectives"] if c["kind"] == kind)

    bf16, micro_batches = 2, 2
    if zero < 3:
        assert calls(by_expert, "all_gather") == others * bf16  # once a step, every weight but the experts
    gathers = 1 if zero < 3 else 2 * micro_batches  # ZeRO 3: a layer's for its forward and again its backward
    assert calls(whole, "all_gather") - calls(by_expert, "all_gather") == experts * bf16 * gathers
    scatters = 1 if zero == 1 else micro_batches
    assert calls(whole, "reduce_scatter") - calls(by_expert, "reduce_scatter") == experts * bf16 * scatters
    assert not any(c["kind"] == "all_reduce" for c in by_expert["collectives"])
    if zero >= 2:  # at the end of the step: the others' gradient shards, and the rank's own experts' whole
        assert by_expert["memory"]["gradients"] >= (others / 2 + experts / 2) * bf16


def test_under_zero_3_experts_the_runtime_cannot_split_are_refused_naming_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under ZeRO 3 the plan cannot say which modules are experts, and the runtime splits Hugging Face's: experts it
    does not know as such (here Mixtral's, unmarked) are refused when checked, naming the module, not left to FSDP
    while the estimate priced them split."""
    from autopar.runtime.source import ModelSource
    from autopar.runtime.validate import check_runnable

    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", "hf:mixtral", *EP, *KV["mixtral"], "--ep", "2", "--zero", "3",
                        "--out", str(out))
    assert code == 0, err
    plan = load_plan(out)
    zoo = load("hf:mixtral", batch=1, seq=32, dtype=torch.float32, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128,
               vocab=1024)
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    for module in zoo.module.modules():
        if "is_transposed" in vars(module):
            del module.is_transposed  # as a user's own experts would lack it
    with pytest.raises(NotImplementedError, match="module 'model.layers.0.mlp.experts' .* cannot be split by expert"):
        check_runnable(plan, rehearse=False, source=ModelSource.of_module(zoo.module, zoo.inputs, graph=graph))


def test_a_model_prices_a_stage_with_and_without_expert_parallelism_apart() -> None:
    """One model prices dp and then ep (as a search does): each gets its own memory, as a fresh model gives."""
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage

    graph = _graph("mixtral")
    cluster = load_cluster("cpu").with_devices(2)

    def memory(model: PipelineModel, ep: int) -> float:
        config = PipelineConfig(stages=(Stage(start=0, end=len(model.layers), tp=1, dp=2),), micro_batch=2, ep=ep)
        return model.estimate(config, global_batch=8).stages[0].memory.allocated

    shared = PipelineModel(graph, cluster, traced_batch=2, dtype="fp32")
    plain = memory(shared, 1)
    by_expert = memory(shared, 2)
    assert by_expert < plain
    assert by_expert == memory(PipelineModel(graph, cluster, traced_batch=2, dtype="fp32"), 2)


def test_expert_parallel_plans_with_compiled_layers_are_not_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", "hf:mixtral", *EP, *KV["mixtral"], "--ep", "2", "--kernels", "compiled",
                        "--out", str(out))
    assert code == 2 and "the plan splits experts over ranks (ep) and compiles its layers" in err
    assert not out.exists()


def test_expert_parallelism_of_a_model_without_experts_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "estimate", "gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4",
                        "--vocab", "128", "--seq", "32", "--cluster", "cpu", "--batch", "8", "--gpus", "2", "--dp", "2",
                        "--ep", "2")
    assert code == 2 and "ep 2 (expert parallelism) splits experts that hold one weight per expert" in err
    assert "a mixture whose experts are modules of their own, an nn.ModuleList of MLPs, cannot be split" in err


def test_expert_parallel_plans_train_as_one_process_and_rehearse_in_bf16(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Mixtral's 8 experts, 4 on each of 2 ranks: losses, gradients and updates as one process, every rank's
    all-to-all calls as predicted and their bytes, which routing spreads unevenly, summed over the ranks as
    predicted; `dryrun` rehearses it in bf16 (the fake grouped matmul takes no fp32) with tokens spread evenly."""
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", "hf:mixtral", *EP, *KV["mixtral"], "--ep", "2", "--out", str(out))
    assert code == 0, err
    code, text, err = _cli(capsys, "dryrun", str(out), "--json")
    assert code == 0, err
    result = json.loads(text)
    assert result["ok"] and result["dtype"] == "bf16"
    assert {(r["kind"], r["counted"]) for r in result["rows"]} == {("all_reduce", 1), ("all_to_all", 20)}
    code, text, err = _cli(capsys, "run", str(out), "--nproc", "2", "--steps", "3", "--check", "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text and "check-comm: every rank's" in text


@pytest.mark.slow
@pytest.mark.parametrize(("name", "options", "ranks"), [
    ("qwen2_moe", ["--experts", "8"], 2),  # beside a shared expert and its gate, both whole (8 of its 60 experts)
    ("qwen3_moe", ["--experts", "8"], 2),
    ("mixtral", [], 4),  # 2 experts per rank
    ("mixtral", ["--recompute", "full"], 2),  # the recomputed forward sends the tokens again
    # 2 stages of dp 2, each splitting its own layers' experts; interleaved, 2 layers per device
    ("mixtral", ["--layers", "4", "--pp", "2", "--schedule", "interleaved", "--chunks", "2"], 4),
    ("qwen2_moe", ["--experts", "8", "--pp", "2", "--schedule", "gpipe"], 4),
    # FSDP shards the rest, each rank's experts left to it
    ("mixtral", ["--zero", "2"], 2),
    ("mixtral", ["--pp", "2", "--zero", "1"], 4),
    ("qwen2_moe", ["--experts", "8", "--zero", "3"], 2),
])
def test_more_expert_parallel_plans_train_as_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, options: list[str], ranks: int) -> None:
    out = tmp_path / "plan.json"
    dp = ranks // 2 if "--pp" in options else ranks
    code, _, err = _cli(capsys, "estimate", f"hf:{name}", *SMALL, *KV[name], "--gpus", str(ranks), "--dp", str(dp),
                        "--ep", str(dp), *options, "--out", str(out))
    assert code == 0, err
    code, text, err = _cli(capsys, "run", str(out), "--nproc", str(ranks), "--steps", "5", "--check", "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text and "check-comm: every rank's" in text


def test_the_default_search_splits_experts_over_the_devices_where_that_is_fastest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2-MoE's 60 experts hold most of its weights: splitting them over 2 CPU ranks sends 514 KiB of tokens a
    step instead of all-reducing 62 MiB of their gradients, and the search's plan says so; it passes the plan-time
    check, and a model without experts never gets such a plan."""
    out = tmp_path / "plan.json"
    code, text, err = _cli(capsys, "plan", "hf:qwen2_moe", *SMALL[:-4], "--batch", "8", "--gpus", "2", "--json",
                           "--out", str(out))
    assert code == 0, err
    data = json.loads(text)
    assert data["found_by"] == "ep" and data["plan"]["ep"] == 2 and data["not_runnable"] is None
    assert json.loads(out.read_text())["plan"]["ep"] == 2
    code, text, err = _cli(capsys, "plan", "gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab",
                           "128", "--seq", "32", "--cluster", "cpu", "--batch", "8", "--gpus", "2", "--json")
    assert code == 0 and json.loads(text)["plan"]["ep"] == 1


def test_the_search_splits_the_experts_of_the_best_configurations_that_can_have_them_split() -> None:
    """Besides data parallelism over every device, `expert_parallel` prices the twin of each of the best
    configurations priced so far with tp 1 (a pipeline among them, under any ZeRO stage) with its experts split over
    its dp, and returns the best of all those; configurations with tp get none."""
    from dataclasses import replace

    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineConfig, PipelineModel
    from autopar.search.pipeline import Evaluator, even_stages, expert_parallel, score

    zoo = load("hf:qwen2_moe", batch=2, seq=16, dtype=torch.float32, layers=2, hidden=64, heads=4, ffn=128,
               experts=8)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(4),
                          traced_batch=2, dtype="fp32")
    evaluate = Evaluator(model, global_batch=8)
    pipeline = PipelineConfig(stages=even_stages(model, 2, tp=1, dp=2), micro_batch=2)
    sharded, fsdp = replace(pipeline, zero=1), replace(pipeline, zero=3)
    tensor = PipelineConfig(stages=even_stages(model, 1, tp=2, dp=2), micro_batch=2)
    for config in (pipeline, sharded, fsdp, tensor):
        evaluate(config)
    found = expert_parallel(model, global_batch=8, evaluate=evaluate)
    twins = {config for config in evaluate.cache if config.ep > 1}
    assert {replace(pipeline, ep=2), replace(sharded, ep=2), replace(fsdp, ep=2)} <= twins
    assert not any(config.stages[0].tp > 1 for config in twins)
    assert found.by == "ep" and found.score == min(score(evaluate.cache[config]) for config in twins)


def test_routed_all_to_alls_are_checked_call_by_call_on_each_rank_and_in_bytes_over_all_ranks(monkeypatch) -> None:
    """Routing sends one rank more tokens than another: `run --check-comm` takes each rank's all-to-all calls as
    predicted and their bytes summed over the ranks, which routing cannot change; any other collective, and any
    plan without expert parallelism, is compared rank by rank in bytes too."""
    from types import SimpleNamespace

    from autopar.runtime import comm

    predicted = [{"kind": "all_to_all", "axis": "dp", "count": 4, "bytes": 400}]  # calls and bytes of a rank
    monkeypatch.setattr(comm, "stage_predictions", lambda plan: [predicted])

    def counted(*sent: tuple[int, int]) -> list[list[dict]]:
        return [[{"kind": "all_to_all", "axis": "dp", "count": calls, "bytes": nbytes}] for calls, nbytes in sent]

    plan = SimpleNamespace(ep=2, is_pipeline=True, grid=(2, 1), pp=1, stages=[None])
    assert comm.check_ranks(plan, counted((4, 300), (4, 500)))["ok"]
    result = comm.check_ranks(plan, counted((4, 300), (4, 600)))
    assert not result["ok"] and result["message"] == "all_to_all on dp: 900 bytes sent by all ranks together, 800 " \
                                                     "predicted"
    assert comm.check_ranks(plan, counted((4, 300), (5, 500)))["message"].startswith(
        "rank 1: all_to_all on dp: 5 calls")
    whole = SimpleNamespace(ep=1, is_pipeline=True, grid=(2, 1), pp=1, stages=[None])
    assert comm.check_ranks(whole, counted((4, 300), (4, 500)))["message"].startswith("rank 0: all_to_all on dp")
