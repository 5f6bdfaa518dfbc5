"""Intra-op plans run (`autopar.runtime.intra`): any legal per-block assignment of a tiny GPT and LLaMA trains what
one process trains on 4 gloo ranks, the plan-time rehearsal refuses a plan whose collectives differ from its
estimate, and the estimate counts a tied weight's gradient once."""

from __future__ import annotations

from typing import Any

import intra_ranks
import pytest
import torch

from autopar.cluster.ranks import run_ranks
from autopar.plan import Plan


def _rehearsed(plans: list[dict]) -> tuple[list[dict], list[str]]:
    """The plans whose rehearsal on a fake process group passes, and why the others were refused."""
    from autopar.runtime.validate import rehearsal

    passed, refused = [], []
    for data in plans:
        try:
            rehearsal(Plan.from_dict(data))
            passed.append(data)
        except (ValueError, NotImplementedError) as exc:  # a refusal, saying why
            refused.append(str(exc))
    return passed, refused


def _train_as_one_process(family: str, count: int, seed: int, **draws: Any) -> None:
    plans, refused = _rehearsed(intra_ranks.assignments(family, count, seed=seed, **draws))
    # DTensor cannot run a few layouts (a table split by rows on two axes, tied to the head): refused, saying why;
    # under ZeRO 3, a weight whose gradient is summed over other axes than the plan keeps its slices over is too
    assert len(plans) >= count * 0.8, refused
    assert all(why.startswith(("the plan fails", "ZeRO 3 of an intra-op plan")) for why in refused), refused
    results = run_ranks(intra_ranks.train_each, 4, args=(plans, 3))
    for k, plan in enumerate(plans):
        splits = [b["split"] for b in plan["blocks"]]
        for rank, per_plan in enumerate(results):
            got = per_plan[k]
            assert got["loss"] < 1e-4, (splits, rank, got)
            assert got["grads"] < 1e-4, (splits, rank, got)
            assert got["drift"] == 0.0, (splits, rank, got)  # replicated weights stay identical, bit for bit


@pytest.mark.parametrize("family", ["gpt", "llama", "hf-llama", "hf-gpt2"])
def test_random_intra_op_assignments_train_as_one_process(family: str) -> None:
    """Megatron's layout, pure data parallelism and 2 random assignments (layouts and micro-batches) per model:
    the zoo's GPT and LLaMA (fused QKV), Hugging Face's LlamaForCausalLM (q, k, v apart, its own rotary) and
    GPT2LMHeadModel (Conv1D, a position table looked up with positions the model makes)."""
    _train_as_one_process(family, 4, seed=11)


FORMS = ["hf-bert", "hf-opt", "hf-gemma", "hf-phi", "hf-qwen3"]


@pytest.mark.parametrize("family", FORMS)
def test_random_intra_op_assignments_of_hugging_face_models_pass_the_plan_time_check(family: str) -> None:
    """Megatron's layout, pure data parallelism and a random assignment of models whose forms the tiny zoo lacks
    (position and token-type tables looked up with buffers or keyword arguments, norms scaling by ``1 + weight``,
    q and k norms, a parallel attention and MLP): each issues, rehearsed on a fake process group of 4 ranks,
    exactly the collectives its estimate counts."""
    plans, refused = _rehearsed(intra_ranks.assignments(family, 3, seed=11))
    assert len(plans) == 3, refused


@pytest.mark.slow
@pytest.mark.parametrize("family", ["hf-bert", "hf-gemma", "hf-qwen3"])
def test_random_intra_op_assignments_of_hugging_face_models_train_as_one_process(family: str) -> None:
    """The same plans train on 4 gloo ranks as one process does (three of the forms; `autopar plan --search ilp`
    and `autopar run --check --check-comm` of each form's own plan are in the README's figures)."""
    _train_as_one_process(family, 3, seed=11)


def test_a_position_table_lookup_joins_the_batch_and_may_run_whole() -> None:
    """GPT-2 adds a position table's lookup (of positions `arange` makes, with no batch) to the token embeddings:
    the sum joins the tokens' block, so it takes the batch's layout rather than the table's, and the lookup may
    run whole on every device (as data parallelism runs it), so that every baseline has a layout of it."""
    from autopar.search.intra import baseline_choice

    _, _, space = intra_ranks._space("hf-gpt2", (2, 2), batch=8, traced=8)
    graph, ic = space.graph, space.cost
    blocks = {graph.node(b.leader).module: b for b in space.blocks.blocks}
    tokens, positions = blocks["transformer.wte"], blocks["transformer.wpe"]
    both = next(n for n in graph.nodes if n.op == "aten.add.Tensor" and {s.node for s in n.sources} >= {
        tokens.leader, positions.leader})
    assert both.id in tokens.nodes and both.id not in positions.nodes
    v = space.var_of[positions.id]
    assert "R,R" in [ic.describe(positions, c) for c in space.candidates[v]]
    assert all(baseline_choice(space, kind) is not None for kind in ("dp", "fsdp", "megatron"))


def test_the_plan_of_gpt2_on_a_2x2_mesh_is_the_programmes_own_and_runs(capsys) -> None:
    """`autopar plan hf:gpt2 --search ilp` on a 2 x 2 mesh had no baseline (the position lookup had no layout
    data parallelism could give it) and offered a plan `autopar run` refused (its lookup split by rows, whose
    pending sum and gradient the estimate left out): it now offers the programme's own plan, which passes the
    checks `autopar run` makes."""
    import json

    from autopar.cli.main import main

    argv = ["plan", "hf:gpt2", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "64", "--gpus", "4",
            "--mesh", "2x2", "--batch", "16", "--search", "ilp", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["kind"] == "ilp" and data["not_runnable"] is None and data["faster_unrunnable"] is None
    assert all(data["baselines"][kind] is not None for kind in ("dp", "fsdp", "megatron"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama", "hf-llama"])
def test_more_random_intra_op_assignments_train_as_one_process(family: str) -> None:
    """Five more plans (Megatron's layout, pure data parallelism and 3 random assignments), ZeRO 0-3 and layers
    recomputed drawn too (`python bench/intra_assignments.py --zero 0 1 2 3 --recompute` runs 50 of each)."""
    _train_as_one_process(family, 5, seed=1, zero=(0, 1, 2, 3), recompute=True)


@pytest.mark.parametrize("family", ["gpt", "llama", "hf-llama"])
def test_layouts_that_split_weights_pass_the_plan_time_check(family: str) -> None:
    """Megatron's layout (the fused QKV gathered to be cut, as DTensor does and the plan prices), and two layouts
    that are not Megatron's (attention split Megatron's way and the MLP by batch over both axes, and the other way
    round, the stream moved between them by all-to-alls): rehearsed on a fake process group of 4 ranks, each issues
    exactly the collectives its estimate counts."""
    from autopar.runtime.validate import check_runnable

    plans = intra_ranks.mixed(family)
    assert len(plans) == 3
    for label, data in plans.items():
        plan = Plan.from_dict(data)
        assert any(b.split.endswith(("n", "k")) for b in plan.blocks), label  # weights are split
        check_runnable(plan)


def test_a_data_parallel_intra_op_plan_runs_with_the_collectives_it_priced(tmp_path) -> None:
    """`autopar plan --search ilp` of a tiny GPT on a 2 x 2 mesh offers a plan that runs, and `autopar run --check
    --check-comm` trains it as one process does, issuing the collectives its estimate counted."""
    from autopar.cli.main import main
    from autopar.runtime.launch import run_plan

    out = tmp_path / "plan.json"
    code = main(["plan", "gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256",
                 "--seq", "32", "--search", "ilp", "--mesh", "2x2", "--batch", "8", "--out", str(out)])
    assert code == 0
    plan = Plan.load(out)
    assert not plan.is_pipeline and plan.zero == 0
    log = run_plan(plan, nproc=4, steps=3, check=True, check_comm=True)
    from autopar.runtime.comm import check_ranks

    assert check_ranks(plan, log.collectives)["ok"]


def _tiny_space(family: str, m: int = 1):  # noqa: ANN202
    from autopar.capture import trace
    from autopar.cluster import build_mesh, load_cluster
    from autopar.search.intra import build_space
    from autopar.zoo import load

    name, overrides = intra_ranks.MODELS[family]
    zoo = load(name, batch=8 // m, seq=intra_ranks.SEQ, dtype=torch.float32, **overrides)
    cluster = load_cluster("a100-80g-sxm").with_devices(4)
    return build_space(trace(zoo.module, example_kwargs=zoo.inputs), build_mesh(cluster, {"x0": 2, "x1": 2}), cluster)


def test_a_tied_weight_is_synchronised_once() -> None:
    """GPT's head reads the embedding's table: under data parallelism its gradient is summed with the embedding's
    in the one bucketed all-reduce per axis, as the runtime does, not once more on its own."""
    from autopar.search.intra import baseline_choice, estimate_choice

    space = _tiny_space("gpt")
    estimate = estimate_choice(space, baseline_choice(space, "dp"), zero=0, micro_batches=1, global_batch=8,
                               dtype="fp32")
    from autopar.zoo import load

    calls = [(c.kind, c.axis, c.count) for c in estimate.collectives]
    assert sorted(calls) == [("all_reduce", "dp0", 1), ("all_reduce", "dp1", 1)]
    name, overrides = intra_ranks.MODELS["gpt"]
    model = load(name, batch=1, seq=intra_ranks.SEQ, dtype=torch.float32, **overrides).module
    weights = sum(p.numel() * 4 for p in model.parameters())  # every parameter once, the tied table too
    assert all(c.bytes == weights for c in estimate.collectives)


def test_a_plan_names_its_blocks_splits_back() -> None:
    """`choice_of` reads a plan's blocks back into the assignment that made it, and refuses a split the model
    does not offer."""
    import random

    from autopar.plan import Block
    from autopar.search.intra import choice_of, plan_of_choice

    space = _tiny_space("llama")
    rng = random.Random(3)
    for _ in range(5):
        choice = tuple(rng.randrange(len(c)) for c in space.candidates)
        plan = plan_of_choice(space, choice, global_batch=8).to_plan("llama-7b")
        assert choice_of(space, plan.blocks) == choice
    blocks = list(plan.blocks)
    blocks[1] = Block(id=blocks[1].id, layer=blocks[1].layer, module=blocks[1].module, split="q,q")
    with pytest.raises(ValueError, match="do not offer"):
        choice_of(space, blocks)


def test_an_intra_op_plan_whose_collectives_differ_is_refused_when_planned() -> None:
    """Megatron's layout of the fused-QKV GPT passes: DTensor gathers the projection's output to split q, k and v
    (the split does not fall on the shards), which the plan prices (a split of a split dim gathers it first).
    A layout whose conversions DTensor makes elsewhere than the plan does (here a lookup split by sequence, then
    by vocabulary, among others) would not communicate as priced: refused, with the counts."""
    from autopar.runtime.validate import check_runnable

    plans = [Plan.from_dict(p) for p in intra_ranks.assignments("gpt", 3, seed=0, micro_batches=(1,))]
    assert [b.split for b in plans[0].blocks][1] == "m,n"  # Megatron's column split of the fused QKV
    check_runnable(plans[0])
    assert plans[2].blocks[0].split == "seq,vocab"
    with pytest.raises(ValueError, match="other collectives than priced"):
        check_runnable(plans[2])


def test_an_intra_op_plan_of_an_moe_model_is_refused_where_dtensor_cannot_run_its_experts(tmp_path, capsys) -> None:
    """DTensor works out each op's output on fake tensors on the ranks too, and the fake kernel of MoE's grouped
    matmul takes bf16 only on CPU: the ranks' fp32 step fails in the experts. The plan-time rehearsal, in fp32 as
    the ranks train, finds that and names the module (a rehearsal in bf16 passed and then counted half the bytes
    of the priced fp32 step). No plan of the intra-op space runs it, so `plan` offers none (exit 2, naming the
    module); with --allow-unrunnable it writes the fastest, saying so in `not_runnable`, and `run` refuses that plan
    before any rank starts."""
    import json

    from autopar.cli.main import main

    pytest.importorskip("transformers")
    path = tmp_path / "ilp.json"
    argv = ["plan", "hf:mixtral", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
            "--search", "ilp", "--gpus", "2", "--cluster", "cpu", "--seq", "32", "--batch", "8", "--out", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "can run on hf:mixtral" in err and "module 'model.layers.0.mlp.experts'" in err, err
    assert not path.exists()
    assert main([*argv, "--allow-unrunnable", "--json"]) == 0
    reason = json.loads(capsys.readouterr().out)["not_runnable"]
    assert reason and "module 'model.layers.0.mlp.experts'" in reason and "BF16" in reason, reason
    assert main(["run", str(path), "--nproc", "2", "--steps", "1"]) == 2
    assert "model.layers.0.mlp.experts" in capsys.readouterr().err


def test_a_data_parallel_intra_op_plan_of_two_micro_batches_passes_the_checks_and_the_dryrun() -> None:
    """The plan-time check rehearses one micro-batch (each issues the same collectives; the gradients synchronise
    once a step) against the prediction for one; `autopar dryrun` rehearses the whole step."""
    from autopar.runtime.dryrun import dryrun
    from autopar.runtime.validate import check_runnable

    plan = Plan.from_dict(intra_ranks.assignments("llama", 2, seed=0, micro_batches=(2,))[1])
    assert plan.micro_batches == 2 and {b.split for b in plan.blocks} <= {"batch,batch", "m,m"}
    check_runnable(plan)
    result = dryrun(plan, checked=True)
    assert result["ok"], result["message"]
    assert [(r["kind"], r["counted"]) for r in result["rows"]] == [("all_reduce", 1), ("all_reduce", 1)]


def test_plan_offers_the_fastest_intra_op_plan_that_runs_and_names_the_faster_one(capsys) -> None:
    """The programme's plan of a small Phi (Hugging Face's, from config: its attention and MLP read one norm's
    output side by side) on 2 devices has layers DTensor would run on other collectives than priced: `autopar plan
    --search ilp` offers the fastest plan that runs (here pure data parallelism), names the faster one and why it
    cannot run; `--allow-unrunnable` offers the programme's own. (A small LLaMA's plan on 2 devices was such a plan
    until its q, k and v, split by the features they contract, were reduced before the attention as priced: it
    now runs.)"""
    import json

    from autopar.cli.main import main

    pytest.importorskip("transformers")
    argv = ["plan", "hf:phi", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--gpus", "2",
            "--batch", "4", "--search", "ilp"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["kind"] == "dp" and data["not_runnable"] is None
    faster = data["faster_unrunnable"]
    assert faster["plan"]["kind"] == "ilp" and faster["vs_plan"] < 1
    assert "other collectives than priced" in faster["not_runnable"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "plan (dp, the fastest that runs of --search ilp)" in text
    assert "note: the fastest plan found, the ilp" in text
    assert main([*argv, "--allow-unrunnable", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["kind"] == "ilp" and "other collectives than priced" in data["not_runnable"]
    assert data["faster_unrunnable"] is None


@pytest.mark.slow
def test_the_programmes_own_plan_that_is_not_megatrons_runs_with_the_collectives_it_priced(tmp_path) -> None:
    """GPT's 2 layers (hidden 768) on 2 devices: the programme splits the embedding by features, the attention by
    batch and the MLP Megatron's way (column then row), converting the stream between them; `autopar plan` offers
    that plan as found, and `autopar run --check --check-comm` trains it as one process does with the collectives
    its estimate counted."""
    from autopar.cli.main import main
    from autopar.runtime.comm import check_ranks
    from autopar.runtime.launch import run_plan

    out = tmp_path / "plan.json"
    assert main(["plan", "gpt3-125m", "--layers", "2", "--seq", "128", "--gpus", "2", "--batch", "4", "--search",
                 "ilp", "--out", str(out)]) == 0
    plan = Plan.load(out)
    splits = {b.module: b.split for b in plan.blocks}
    assert plan.kind == "ilp" and splits["layers.0.attn.qkv"] == "m"
    assert (splits["layers.0.mlp.fc1"], splits["layers.0.mlp.fc2"]) == ("n", "k")
    log = run_plan(plan, nproc=2, steps=3, check=True, check_comm=True)
    assert check_ranks(plan, log.collectives)["ok"]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_layout_that_splits_q_k_and_v_by_the_features_they_contract_trains_as_one_process(family: str) -> None:
    """The layout `autopar plan gpt3-1.3b --search ilp --mesh 8x8` chooses (`intra_ranks.contracted`), on a tiny GPT
    and LLaMA on a 2 x 2 mesh: q, k and v are pending sums the attention reduce-scatters over the batch before it
    runs (so the backward neither reduces them again nor gathers their gradients joined), GPT's head reads the
    embedding it is tied to whole where the embedding keeps it split (`ModuleLayout.reads`), and LLaMA's first norm
    reduce-scatters and gathers the statistics of the embedding's split features, as the plan prices them. `autopar
    run --check --check-comm` trains it as one process does, with the collectives its estimate counted."""
    from torch.distributed.tensor import Replicate

    from autopar.runtime.comm import check_ranks
    from autopar.runtime.launch import run_plan
    from autopar.runtime.validate import check_runnable

    plan = Plan.from_dict(intra_ranks.variant(family, intra_ranks.contracted(family), base="dp"))
    assert {b.split for b in plan.blocks if ".attn." in b.module} == {"m,k"}
    reads = {e.fqn: dict(e.reads) for e in plan.modules if e.reads}
    assert reads == ({"head": {"embed.weight": (Replicate(), Replicate())}} if family == "gpt" else {})
    assert Plan.from_dict(plan.to_dict()) == plan
    check_runnable(plan)
    if family == "gpt":  # a plan whose reader names a weight the model lacks is refused, naming both
        data = plan.to_dict()
        data["modules"]["head"]["reads"] = {"lm.weight": "[R, R]"}
        with pytest.raises(ValueError, match="module 'head' read weight 'lm.weight', which the model does not have"):
            check_runnable(Plan.from_dict(data))
    log = run_plan(plan, nproc=4, steps=3, check=True, check_comm=True)
    assert check_ranks(plan, log.collectives)["ok"]


@pytest.mark.slow
def test_zero_1_to_3_of_the_contracted_layout_train_as_one_process() -> None:
    """The same layout under ZeRO 1, 2 and 3, for both models: the ranks' losses and first gradients are one
    process's, and replicated weights stay identical."""
    plans = [intra_ranks.variant(f, intra_ranks.contracted(f), base="dp", zero=z)
             for f in ("gpt", "llama") for z in (1, 2, 3)]
    _, refused = _rehearsed(plans)
    assert not refused, refused
    for rank, per_plan in enumerate(run_ranks(intra_ranks.train_each, 4, args=(plans, 3))):
        for plan, got in zip(plans, per_plan):
            assert got["loss"] < 1e-4 and got["grads"] < 1e-4 and got["drift"] == 0.0, (plan["model"], rank, got)


@pytest.mark.slow
def test_the_intra_op_plan_of_gpt3_1_3b_on_an_8x8_mesh_is_offered_and_its_dryrun_passes(tmp_path, capsys) -> None:
    """`autopar plan gpt3-1.3b --search ilp --mesh 8x8 --batch 64` offers the programme's own plan (q, k and v
    split by the features they contract; before, its rehearsal counted 218 reduce-scatters where 145 were priced,
    and data parallelism was offered instead), and `autopar dryrun` of it, at 64 ranks, counts every collective
    as priced."""
    import json

    from autopar.cli.main import main
    from autopar.runtime.dryrun import dryrun

    out = tmp_path / "plan.json"
    assert main(["plan", "gpt3-1.3b", "--search", "ilp", "--mesh", "8x8", "--batch", "64", "--json",
                 "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["kind"] == "ilp" and data["not_runnable"] is None and data["faster_unrunnable"] is None
    plan = Plan.load(out)
    assert {b.split for b in plan.blocks if b.module.endswith("attn.qkv")} == {"m,k"}
    result = dryrun(plan, checked=True)
    assert result["ok"], result["message"]


def test_zero_1_and_2_of_intra_op_plans_train_as_one_process_with_the_collectives_they_priced() -> None:
    """Megatron's layout under ZeRO 2 (two micro-batches: each gradient reduce-scattered as soon as it is made, in
    each) and pure data parallelism under ZeRO 1, on a 2 x 2 mesh: each passes the plan-time check (its
    reduce-scatters and all-gathers, axis by axis, as priced) and trains what one process trains, replicated
    weights identical."""
    from autopar.runtime.validate import check_runnable

    megatron = intra_ranks.assignments("gpt", 1, seed=0, micro_batches=(2,), zero=(2,))[0]
    dp = intra_ranks.assignments("llama", 2, seed=0, micro_batches=(1,), zero=(1,))[1]
    for data in (megatron, dp):
        check_runnable(Plan.from_dict(data))
    results = run_ranks(intra_ranks.train_each, 4, args=([megatron, dp], 3))
    for per_plan in results:
        for got in per_plan:
            assert got["loss"] < 1e-4 and got["grads"] < 1e-4, got
            assert got["drift"] == 0.0, got


def test_zero_3_of_intra_op_plans_gathers_each_weight_where_it_is_read_and_trains_as_one_process() -> None:
    """ZeRO 3 of two plans on a 2 x 2 mesh over 2 micro-batches: the GPT in Megatron's layout with one layer
    recomputed (its table tied to its head, its position table read in the model's own forward, not through its
    module) and the LLaMA in data parallelism over both axes. Each weight the plan holds whole where it splits the
    work names those axes (``reduced``) and is kept in slices over them: gathered twice per micro-batch, on each
    axis, and its gradient reduce-scattered once, each weight on its own, as the estimate prices it and the
    rehearsal counts; 4 ranks train what one process trains, the weights' gathered copies identical."""
    from autopar.runtime.validate import check_runnable, rehearsal
    from autopar.search.intra import choice_of, plan_of_choice

    name, work, space = intra_ranks._space("gpt", (2, 2), batch=8, traced=4)
    megatron = intra_ranks.assignments("gpt", 1, seed=0, micro_batches=(2,), zero=(3,))[0]
    megatron = plan_of_choice(space, choice_of(space, Plan.from_dict(megatron).blocks), global_batch=8,
                              micro_batches=2, zero=3, dtype="fp32", recompute=["layers.0"]).to_plan(name, work)
    dp = Plan.from_dict(intra_ranks.assignments("llama", 2, seed=0, micro_batches=(2,), zero=(3,))[1])
    weights = [p for entry in dp.modules for p in entry.params]
    assert weights and all(p.reduced == (0, 1) for p in weights)  # every weight whole on both axes
    for plan in (megatron, dp):
        assert plan.zero == 3 and plan.micro_batches == 2
        check_runnable(plan)  # the collectives as priced
        counted = {(c["kind"], c["axis"]): c["count"] for c in rehearsal(plan, count=True)}
        sliced = [p for entry in plan.modules for p in entry.params if p.reduced]
        for axis, label in enumerate(plan.mesh.axes):
            over = sum(axis in p.reduced for p in sliced)
            assert over > 0
            assert counted[("reduce_scatter", label)] >= 2 * over  # each weight's own, each micro-batch
            assert counted[("all_gather", label)] >= 2 * 2 * over  # twice each micro-batch
    results = run_ranks(intra_ranks.train_each, 4, args=([megatron.to_dict(), dp.to_dict()], 3))
    for per_plan in results:
        for got in per_plan:
            assert got["loss"] < 1e-4 and got["grads"] < 1e-4, got
            assert got["drift"] == 0.0, got


def test_an_intra_op_plan_names_the_axes_each_weight_is_summed_over() -> None:
    """``reduced`` (the axes a parameter's gradient is summed over) round-trips through the plan's JSON, is left
    out where empty, and names only axes that hold the weight whole."""
    import dataclasses

    from autopar.plan import FieldError

    data = intra_ranks.assignments("llama", 2, seed=0, zero=(3,))[1]  # data parallelism: every weight reduced
    plan = Plan.from_dict(data)
    assert Plan.from_dict(plan.to_dict()) == plan
    entry = next(e for e in plan.modules if e.params)
    assert "reduced" in entry.to_dict()
    whole = dataclasses.replace(entry, params=tuple(dataclasses.replace(p, reduced=()) for p in entry.params))
    assert "reduced" not in whole.to_dict()
    weight = entry.params[0]
    with pytest.raises(FieldError, match="in increasing order"):
        dataclasses.replace(weight, reduced=(1, 0))
    with pytest.raises(FieldError, match="from 0 to 1"):
        dataclasses.replace(weight, reduced=(2,))
    split = intra_ranks.variant("gpt", {"embed": "vocab,vocab"})
    table = next(m for m in Plan.from_dict(split).modules if m.fqn == "embed").params[0]
    with pytest.raises(FieldError, match="where the parameter is split"):
        dataclasses.replace(table, reduced=(0,))


def test_zero_1_of_an_intra_op_plan_scatters_over_each_axis_the_shard_the_one_before_left() -> None:
    """Data parallelism on a 2 x 2 mesh under ZeRO 1: the gradients are reduce-scattered over the first axis
    whole, then over the second half of them, and the weights gathered back the same way; the optimizer holds a
    quarter of them on each device."""
    from autopar.search.intra import baseline_choice, estimate_choice

    space = _tiny_space("gpt")
    estimate = estimate_choice(space, baseline_choice(space, "dp"), zero=1, micro_batches=1, global_batch=8,
                               dtype="fp32")
    calls = {(c.kind, c.axis): c for c in estimate.collectives}
    assert set(calls) == {(k, a) for k in ("reduce_scatter", "all_gather") for a in ("dp0", "dp1")}
    weights = calls[("reduce_scatter", "dp0")].bytes
    for kind in ("reduce_scatter", "all_gather"):
        assert calls[(kind, "dp0")].bytes == weights and calls[(kind, "dp1")].bytes == weights / 2
        assert calls[(kind, "dp0")].count == calls[(kind, "dp1")].count == 1


def test_zero_of_an_intra_op_plan_refuses_an_optimizer_that_is_not_elementwise() -> None:
    from autopar.runtime.intra import _ShardedOptimizer

    with pytest.raises(NotImplementedError, match="LBFGS is not known to update elementwise"):
        _ShardedOptimizer(None, torch.optim.LBFGS, lr=1.0)


def test_a_lookup_in_a_table_split_by_rows_over_both_axes_trains_as_one_process() -> None:
    """DTensor's masked lookup cannot split a table's rows over two mesh axes (its one mask per value conflicts);
    the runtime looks up each rank's own rows itself and sums the result over both axes. GPT's table (tied to its
    head) and LLaMA's, under ZeRO 0 and 1: the rehearsal passes and 3 AdamW steps on 4 ranks match one process."""
    from autopar.runtime.validate import rehearsal

    plans = [intra_ranks.variant("gpt", {"embed": "vocab,vocab"}),
             intra_ranks.variant("llama", {"embed": "vocab,vocab"}, zero=1)]
    for data in plans:
        table = next(m for m in Plan.from_dict(data).modules if m.fqn == "embed").params[0]
        assert [p.is_shard(0) for p in table.placements] == [True, True]  # its rows split over both axes
        rehearsal(Plan.from_dict(data))
    results = run_ranks(intra_ranks.train_each, 4, args=(plans, 3))
    for per_plan in results:
        for got in per_plan:
            assert got["loss"] < 1e-4 and got["grads"] < 1e-4, got
            assert got["drift"] == 0.0, got


def test_an_intra_op_plan_names_the_layers_it_recomputes() -> None:
    """``recompute`` lists layers of the plan's blocks, each once, and is an intra-op plan's own field (a pipeline
    plan's stages name theirs); it round-trips through the plan's JSON and leaves older files as they read."""
    import dataclasses

    from autopar.plan import FieldError

    data = intra_ranks.assignments("gpt", 1, seed=0)[0]
    assert "recompute" not in data  # none recomputed: the field is left out, as files written before it
    plan = Plan.from_dict({**data, "recompute": ["layers.1"]})
    assert plan.recompute == ("layers.1",) and Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(FieldError, match="recompute\\[0\\] names 'layers.7', which none of the plan's blocks lies in"):
        dataclasses.replace(plan, recompute=("layers.7",))
    with pytest.raises(FieldError, match="recompute\\[1\\] names 'layers.1' twice"):
        dataclasses.replace(plan, recompute=("layers.1", "layers.1"))
    with pytest.raises(FieldError, match="must be a tuple of layer names"):
        dataclasses.replace(plan, recompute=["layers.1"])


def test_recomputed_layers_of_intra_op_plans_replay_their_conversions_and_train_as_one_process() -> None:
    """Megatron's layout of the GPT under ZeRO 2 over 2 micro-batches with one layer recomputed, and the LLaMA in
    data parallelism under ZeRO 1 with both: the rehearsal counts the priced collectives (the recomputed layer's
    forward conversions issued again in the backward, as many as `replay` prices and no more), and 4 ranks train
    what one process trains."""
    from autopar.runtime.validate import check_runnable, rehearsal
    from autopar.search.intra import choice_of, estimate_choice, plan_of_choice, replay

    def recomputing(data: dict, family: str, layers: list[str]) -> Plan:  # the plan priced with them recomputed
        name, work, space = intra_ranks._space(family, (2, 2), batch=8, traced=data["micro_batch_size"])
        again = plan_of_choice(space, choice_of(space, Plan.from_dict(data).blocks), global_batch=8,
                               micro_batches=data["micro_batches"], zero=data["zero"], dtype="fp32", recompute=layers)
        return again.to_plan(name, work)

    megatron = recomputing(intra_ranks.assignments("gpt", 1, seed=0, micro_batches=(2,), zero=(2,))[0], "gpt",
                           ["layers.0"])
    dp = recomputing(intra_ranks.assignments("llama", 2, seed=0, micro_batches=(1,), zero=(1,))[1], "llama",
                     ["layers.0", "layers.1"])
    for plan, family in ((megatron, "gpt"), (dp, "llama")):
        data = plan.to_dict()
        check_runnable(plan)  # the collectives as priced, the replay's included
        counted = {(c["kind"], c["axis"]): c["count"] for c in rehearsal(plan, count=True)}
        kept = {(c["kind"], c["axis"]): c["count"]
                for c in rehearsal(Plan.from_dict({**data, "recompute": []}), count=True)}
        space = _tiny_space(family, plan.micro_batches)
        again = replay(space, choice_of(space, plan.blocks), plan.recompute)
        names = dict(zip(space.mesh.names, plan.mesh.axes))
        priced: dict = {}
        for call in again.calls:
            key = (call.kind.value, names[call.axis])
            priced[key] = priced.get(key, 0) + call.calls * plan.micro_batches
        assert {k: counted.get(k, 0) - kept.get(k, 0) for k in set(counted) | set(kept)} == {
            k: priced.get(k, 0) for k in set(counted) | set(kept)}
        # Megatron's layout converts inside its layers (issued again); data parallelism converts nothing there
        assert (sum(priced.values()) > 0) == (family == "gpt"), priced
        kept_all = estimate_choice(space, choice_of(space, plan.blocks), zero=plan.zero,
                                   micro_batches=plan.micro_batches, global_batch=8, dtype="fp32")
        assert plan.estimate.compute_seconds == pytest.approx(
            kept_all.compute_seconds + plan.micro_batches * again.compute)
        assert again.activations < replay(space, choice_of(space, plan.blocks), ()).activations  # every one saved
    results = run_ranks(intra_ranks.train_each, 4, args=([megatron.to_dict(), dp.to_dict()], 3))
    for per_plan in results:
        for got in per_plan:
            assert got["loss"] < 1e-4 and got["grads"] < 1e-4, got
            assert got["drift"] == 0.0, got


def test_a_learning_rate_scheduler_attaches_to_the_optimizer_of_a_zero_plan_before_its_first_step() -> None:
    """Under ZeRO 1-3 the optimizer stepping each rank's slices is made at the first step, once the gradients have
    named the slices; a `LambdaLR` attached as soon as `make_optimizer` returns (as training scripts do) sets the
    rate of every step, the first included, and the ranks train what one process does with the same schedule."""
    from autopar.runtime.intra import _ShardedOptimizer

    class Shards:
        masters: dict = {}

    optimizer = _ShardedOptimizer(Shards(), torch.optim.AdamW, lr=1e-3)
    assert isinstance(optimizer, torch.optim.Optimizer)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5 ** k)
    assert optimizer.param_groups[0]["initial_lr"] == 1e-3
    with pytest.raises(ValueError, match="Invalid learning rate"):  # its settings are checked when it is made
        _ShardedOptimizer(Shards(), torch.optim.AdamW, lr=-1.0)
    plans = [intra_ranks.assignments("llama", 2, seed=0, micro_batches=(1,), zero=(zero,))[1] for zero in (1, 3)]
    results = run_ranks(intra_ranks.with_extras, 4, args=(plans, 3, [{"decay": 0.5}] * 2))
    for per_plan in results:
        for got in per_plan:
            assert got["lrs"] == pytest.approx([5e-4, 2.5e-4, 1.25e-4])
            assert got["loss"] < 1e-4 and got["drift"] == 0.0, got
