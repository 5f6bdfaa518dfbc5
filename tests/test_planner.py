"""The intra-op planner against the known optima of its own cost model, and plan files."""

import dataclasses
import json

import pytest

from autopar.capture import trace
from autopar.cluster import build_mesh, load_cluster
from autopar.cluster.spec import GIB
from autopar.cost.intra import sync_seconds
from autopar.cost.memory import gradient_itemsize
from autopar.plan import load_plan, save_plan
from autopar.search import build_space, plan_intra
from autopar.zoo import load


def _plan(name: str, *, gpus: int, batch: int, mesh=None, memory_gib: float | None = None, **overrides):
    zoo = load(name, batch=1, **overrides)
    cluster = load_cluster("a100-80g-sxm").with_devices(gpus)
    if memory_gib is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory_gib * GIB))
    found = plan_intra(
        lambda size: trace(zoo.module, example_kwargs=zoo.inputs_at(size)),
        cluster, mesh or (gpus,), global_batch=batch, time_limit=60,
    )
    return found


def test_plain_data_parallel_when_the_model_fits() -> None:
    found = _plan("gpt3-350m", gpus=8, batch=64)
    ilp, dp = found["ilp"], found["dp"]
    assert dp.estimate.memory.fits
    assert ilp.choice == dp.choice and ilp.zero == 0
    assert ilp.estimate.iteration_seconds == pytest.approx(dp.estimate.iteration_seconds)


def test_ctrl_c_while_the_programme_prices_its_conversions_keeps_the_baselines(monkeypatch) -> None:
    """Ctrl-C mid-way through the first attempt's edge matrices (seconds each on a 3-D mesh) stops the search at
    once, with each baseline found before it; the baselines price no conversion matrix of their own."""
    import autopar.search.intra as intra

    zoo = load("llama-7b", batch=1, layers=2, hidden=256, heads=4, kv_heads=4, ffn=512, seq=64)
    cluster = load_cluster("a100-80g-sxm").with_devices(4)
    pressed, rows = [], []
    original = intra._edge_matrix

    def edge_matrix(space, block, key, producer, should_stop=None):  # noqa: ANN001, ANN202
        pressed.append(True)  # Ctrl-C as the programme starts on its conversions
        try:
            return original(space, block, key, producer, should_stop)
        finally:
            rows.append(block.id)

    monkeypatch.setattr(intra, "_edge_matrix", edge_matrix)
    found = plan_intra(lambda size: trace(zoo.module, example_kwargs=zoo.inputs_at(size)), cluster, (2, 2),
                       global_batch=16, time_limit=600, should_stop=lambda: bool(pressed),
                       kinds=("dp", "fsdp", "megatron", "ilp"))  # as `autopar plan` orders them
    assert set(found) == {"ilp", "dp", "fsdp", "megatron"}
    assert found["ilp"] is None and found["dp"] is not None and found["fsdp"] is not None
    assert len(rows) == 1  # stopped in the first matrix, before its first row


def test_memory_bound_plan_fits_and_beats_fsdp_and_megatron() -> None:
    found = _plan("gpt3-2.7b", gpus=8, batch=16, memory_gib=24)
    ilp = found["ilp"]
    assert not found["dp"].estimate.memory.fits
    assert ilp.estimate.memory.fits and ilp.estimate.memory.total <= ilp.estimate.memory.budget
    for kind in ("fsdp", "megatron"):
        other = found[kind]
        if other is not None and other.estimate.memory.fits:
            assert ilp.estimate.iteration_seconds <= other.estimate.iteration_seconds * (1 + 1e-9)


def test_mlp_pairs_column_then_row_when_tensor_parallel() -> None:
    found = _plan("gpt3-175b", gpus=8, batch=8, layers=4)
    plan = found["ilp"].to_plan("gpt3-175b").to_dict()
    assert found["ilp"].estimate.memory.fits and not found["dp"].estimate.memory.fits
    splits = {b["module"]: b["split"] for b in plan["blocks"]}
    for layer in range(4):
        fc1, fc2 = splits[f"layers.{layer}.mlp.fc1"], splits[f"layers.{layer}.mlp.fc2"]
        assert (fc1, fc2) == ("n", "k")  # column-parallel FC1 feeds row-parallel FC2 with no resharding
    # one reduction closes the pair: FC2's pending sum, handed on reduce-scattered over the sequence
    assert plan["modules"]["layers.0.mlp.fc2"]["output"] == "S(1)"


def test_estimate_equals_the_ilp_objective() -> None:
    found = _plan("gpt3-350m", gpus=8, batch=32, memory_gib=12, layers=4)
    ilp = found["ilp"]
    assert ilp.solution is not None and ilp.solution.optimal
    # the objective is the estimate less the fixed cost of the gradient buckets (one collective per reduced mesh
    # axis, whatever the layout), which no block's choice changes; up to the all-reduce's latency, which is the
    # tree's for an empty bucket and the ring's for a full one
    space = ilp.space
    synced = [p for cls in space.classes
              for p in space.cost.block_cost(cls.block, space.candidates[cls.var][ilp.choice[cls.var]]).params * cls.count]
    assert synced
    kw = dict(zero=ilp.zero, micro_batches=ilp.micro_batches, itemsize=gradient_itemsize("bf16"), mesh=space.mesh, cluster=space.cost.cluster)
    buckets = sync_seconds(synced, **kw) - sync_seconds(synced, latency=False, **kw)
    assert buckets > 0
    assert ilp.estimate.iteration_seconds == pytest.approx(ilp.solution.objective + buckets, rel=5e-3)


def test_two_dimensional_mesh_never_exceeds_the_budget() -> None:
    found = _plan("gpt3-2.7b", gpus=8, batch=16, mesh=(2, 4), memory_gib=24)
    for plan in found.values():
        if plan is not None and plan.estimate.memory.fits:
            assert plan.estimate.memory.total <= plan.estimate.memory.budget
    assert found["ilp"].estimate.memory.fits


def test_variables_do_not_grow_with_depth() -> None:
    cluster = load_cluster("a100-80g-sxm").with_devices(8)
    mesh = build_mesh(cluster, {"x0": 8})
    sizes = []
    for layers in (4, 40):
        zoo = load("gpt3-125m", batch=8, seq=128, layers=layers)
        space = build_space(trace(zoo.module, example_kwargs=zoo.inputs), mesh, cluster)
        sizes.append((len(space.representative), sum(len(c) for c in space.candidates)))
        assert sum(space.count) == len(space.blocks.blocks)
    assert sizes[0] == sizes[1]


def test_plan_file_round_trip_and_validation(tmp_path) -> None:
    found = _plan("gpt3-125m", gpus=4, batch=8, layers=2)
    plan = found["ilp"].to_plan("gpt3-125m")
    path = tmp_path / "plan.json"
    save_plan(path, plan)
    assert load_plan(path) == plan
    bad = json.loads(path.read_text())
    bad["plan"]["modules"]["layers.0.attn.qkv"]["params"]["layers.0.attn.qkv.weight"] = "S(x)"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="layers.0.attn.qkv"):
        load_plan(path)
    bad["plan"]["schema"] = 99
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="schema is 99; this autopar reads plan schemas 1, 2"):
        load_plan(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "batch", "overrides"),
    [
        ("t5-base", 64, {}),
        ("moe-350m-e16", 64, {"layers": 8}),
        ("wrn-50-2", 256, {}),
        ("bert-large", 64, {}),
        ("llama3-8b", 64, {"layers": 8}),
        ("gpt3-6.7b", 32, {}),
    ],
)
def test_plan_is_never_slower_than_a_fitting_baseline(name: str, batch: int, overrides: dict) -> None:
    found = _plan(name, gpus=8, batch=batch, **overrides)
    ilp = found["ilp"]
    assert ilp.estimate.memory.fits
    for kind in ("dp", "fsdp", "megatron"):
        other = found[kind]
        if other is not None and other.estimate.memory.fits:
            assert ilp.estimate.iteration_seconds <= other.estimate.iteration_seconds * (1 + 1e-9), kind


def test_a_plan_that_fits_only_by_recomputing_recomputes_the_fewest_layers() -> None:
    """GPT-3 350M cut to 8 layers on 8 devices of 3.2 GiB: one micro-batch of the whole batch fits no layout
    keeping every activation, and more micro-batches split the sequence (slower); the plan recomputes the fewest
    layers that make it fit (one fewer does not), and pays their forward again."""
    from autopar.search.intra import estimate_choice, replay

    found = _plan("gpt3-350m", gpus=8, batch=8, memory_gib=3.2, layers=8)
    ilp = found["ilp"]
    assert ilp.estimate.memory.fits and ilp.micro_batches == 1
    assert 0 < len(ilp.recompute) < 8 and ilp.recompute == tuple(f"layers.{k}" for k in range(len(ilp.recompute)))
    kw = dict(zero=ilp.zero, micro_batches=1, global_batch=8, dtype="bf16")
    fewer = estimate_choice(ilp.space, ilp.choice, recompute=ilp.recompute[:-1], **kw)
    assert not fewer.memory.fits
    kept = estimate_choice(ilp.space, ilp.choice, **kw)
    again = replay(ilp.space, ilp.choice, ilp.recompute)
    assert ilp.estimate.compute_seconds == pytest.approx(kept.compute_seconds + again.compute)
    assert ilp.estimate.memory.activations == pytest.approx(again.activations)
    assert again.activations < kept.memory.activations
    plan = ilp.to_plan("gpt3-350m")
    assert plan.recompute == ilp.recompute
