"""One model of a layer: every row of `autopar estimate`, the pipeline search and the intra-op search is priced by
the block model (`cost.intra`, `cost.intra_layers`), Megatron's layout being one assignment of it. Checked here
against what Megatron's layout is by construction, independently of the block model: the ops its column/row roles
split (`cost.layers.analyse`), the collectives Megatron-LM issues per layer (Korthikanti et al. 2022, Table 2),
and the parameters a tp rank holds; and the intra-op search's Megatron baseline equals `autopar estimate` for whole
models."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import trace
from autopar.cluster import build_mesh
from autopar.cluster.spec import load_cluster
from autopar.cost import ParallelConfig, estimate
from autopar.cluster.calls import merge_calls
from autopar.cost.compute import sequence_seconds
from autopar.cost.pipeline import PipelineModel
from autopar.search.intra import baseline_choice, build_space, estimate_choice
from autopar.zoo import load

MODELS = {
    "gpt": ("gpt3-125m", {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512, "seq": 64}),
    "llama": ("llama-7b", {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn": 512, "vocab": 512,
                           "seq": 64}),
    "llama-gqa": ("llama-7b", {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 512, "vocab": 512,
                               "seq": 64}),
}
BATCH, SEQ, HIDDEN = 2, 64, 256


def _graph(kind: str, batch: int = BATCH):
    name, overrides = MODELS[kind]
    zoo = load(name, batch=batch, dtype=torch.bfloat16, **overrides)
    return trace(zoo.module, example_kwargs=zoo.inputs)


@pytest.fixture(scope="module", params=sorted(MODELS))
def traced(request):  # noqa: ANN001, ANN201
    return request.param, _graph(request.param)


def _calls(price) -> dict:  # noqa: ANN001
    """A layer price's collectives: calls by (kind, bytes, phase)."""
    return {(c.kind.value, c.bytes, c.phase.value): c.calls for c in merge_calls(price.collectives)}


def _shards(model: PipelineModel, row: int, tp_axis, sp: bool) -> dict[int, int]:  # noqa: ANN001
    """The work split of each op of ``row`` under the block model's Megatron assignment."""
    layers = model.intra_layers
    ic = layers._cost(tp_axis, sp)
    found = {}
    for node in model.layers[row].nodes:
        b, pos = layers.place[node.id]
        block = layers.bg.blocks[b]
        if node.id in block.branch:
            found[node.id] = 1
            continue
        choice = layers._megatron_choice(ic, block.layer)[layers.rows[block.layer].index(block)]
        found[node.id] = ic.block_cost(block, choice).strategies[pos].shard
    return found


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_splits_the_ops_its_roles_split(traced, tp: int, sp: bool) -> None:  # noqa: ANN001
    """In each repeated layer the block model's Megatron assignment splits exactly the ops Megatron's roles split
    (the column-parallel contractions and what lies between them and their row-parallel partners), and under
    sequence parallelism every other op on sequence shards; its parameters on one rank are the roles' split ones
    over tp plus the rest whole."""
    kind, graph = traced
    model = PipelineModel(graph, load_cluster("a100-80g-sxm").with_devices(tp), traced_batch=BATCH)
    if any(width % tp for width in model.split_widths):  # 4 key/value heads at tp 8: refused, not priced
        return
    mesh = model._mesh(1, 1, tp)
    rows = [i for i, layer in enumerate(model.layers) if layer.repeated]
    assert rows
    for row in rows:
        layer = model.layers[row]
        shards = _shards(model, row, mesh.axis("tp"), sp)
        for node in layer.nodes:
            if node.is_view:
                continue
            expected = tp if node.id in layer.sharded or (sp and node.flops_forward == 0) else 1
            if sp and not node.sources:  # made from nothing (a mask, a position table): whole everywhere
                expected = 1
            assert shards[node.id] == expected, (kind, layer.name, node.op, node.module)
        price = model.price(row, tp=tp, samples=BATCH, recompute="none", sp=sp, mesh=mesh)
        assert price.params == pytest.approx(layer.sharded_params / tp + layer.params - layer.sharded_params)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_layer_issues_megatrons_collectives(traced, tp: int, sp: bool) -> None:  # noqa: ANN001
    """Per repeated layer and micro-batch, Megatron-LM's tensor parallelism communicates twice forward and twice
    backward on the stream (b x s x h values): without SP an all-reduce after the attention's and the MLP's
    row-parallel projection, and one of the input gradient of each column group (q, k and v read one input; so do
    gate and up); with SP each becomes a reduce-scatter / all-gather pair. Full recomputation replays the forward's
    calls in the backward, all but the layer's last reduction; selective replays none."""
    kind, graph = traced
    model = PipelineModel(graph, load_cluster("a100-80g-sxm").with_devices(tp), traced_batch=BATCH)
    if any(width % tp for width in model.split_widths):
        return
    mesh = model._mesh(1, 1, tp)
    stream = float(BATCH * SEQ * HIDDEN * 2)
    if sp:
        plain = {("reduce_scatter", stream, "forward"): 2, ("all_gather", stream, "forward"): 2,
                 ("all_gather", stream, "backward"): 2, ("reduce_scatter", stream, "backward"): 2}
        replayed = {("reduce_scatter", stream, "backward"): 1, ("all_gather", stream, "backward"): 2}
    else:
        plain = {("all_reduce", stream, "forward"): 2, ("all_reduce", stream, "backward"): 2}
        replayed = {("all_reduce", stream, "backward"): 1}
    full = {key: plain.get(key, 0) + replayed.get(key, 0) for key in {*plain, *replayed}}
    for row in [i for i, layer in enumerate(model.layers) if layer.repeated]:
        for level, expected in (("none", plain), ("selective", plain), ("full", full)):
            price = model.price(row, tp=tp, samples=BATCH, recompute=level, sp=sp, mesh=mesh)
            assert _calls(price) == expected, (kind, row, level)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallelism_scatters_the_stream_once_and_gathers_it_for_the_head(tp: int) -> None:
    """Around the layers under SP: the stream is scattered into sequence shards where the embedding hands it to the
    first layer (free forward, its gradient gathered backward, once), the final norm runs on the shards, and the
    untied head gathers its input; what is split by sequence there is priced so (the runtime's SequenceParallel)."""
    graph = _graph("llama")
    model = PipelineModel(graph, load_cluster("a100-80g-sxm").with_devices(tp), traced_batch=BATCH)
    mesh = model._mesh(1, 1, tp)
    stream = float(BATCH * SEQ * HIDDEN * 2)
    around = {}
    for row, layer in enumerate(model.layers):
        if not layer.repeated:
            for key, calls in _calls(model.price(row, tp=tp, samples=BATCH, recompute="none", sp=True,
                                                 mesh=mesh)).items():
                around[key] = around.get(key, 0) + calls
    assert around[("all_gather", stream, "backward")] == 1  # the scatter's gradient
    assert around[("all_gather", stream, "forward")] == 1  # the head's input
    norm = next(r for r, layer in enumerate(model.layers) if layer.name == "norm")
    whole = model.price(norm, tp=tp, samples=BATCH, recompute="none", sp=False, mesh=mesh)
    shards = model.price(norm, tp=tp, samples=BATCH, recompute="none", sp=True, mesh=mesh)
    assert shards.activations == pytest.approx(whole.activations / tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_estimate_equals_the_intra_op_megatron_baseline(traced, tp: int) -> None:  # noqa: ANN001
    _, graph = traced
    cluster = load_cluster("a100-80g-sxm").with_devices(tp)
    if any(width % tp for width in PipelineModel(graph, cluster, traced_batch=2).split_widths):
        return  # 4 key/value heads at tp 8: refused, not priced
    rows = estimate(graph, cluster, ParallelConfig(tp=tp, mbs=2), global_batch=2)
    # the layout priced as Megatron's runtime runs it (a fused QKV weight laid out per piece), not as DTensor does
    space = build_space(graph, build_mesh(cluster, {"x0": tp}), cluster, scatter_partials=False, dtensor=False)
    blocks = estimate_choice(space, baseline_choice(space, "megatron"), zero=0, micro_batches=1, global_batch=2,
                             dtype="bf16")
    assert blocks.iteration_seconds == pytest.approx(rows.iteration_seconds, rel=0.02)
    assert blocks.compute_seconds == pytest.approx(rows.compute_seconds, rel=0.02)
    assert blocks.memory.total == pytest.approx(rows.memory.total, rel=0.02)
    assert sorted((c.kind, c.bytes, c.count) for c in blocks.collectives) == \
        sorted((c.kind, c.bytes, c.count) for c in rows.collectives)


def test_scattering_partials_is_a_different_layout() -> None:
    """Scattering partial sums (sequence-parallel style) changes the collectives: the baseline must not."""
    graph = _graph("gpt")
    cluster = load_cluster("a100-80g-sxm").with_devices(4)
    mesh = build_mesh(cluster, {"x0": 4})
    kinds = []
    for scatter in (False, True):
        space = build_space(graph, mesh, cluster, scatter_partials=scatter, dtensor=False)
        found = estimate_choice(space, baseline_choice(space, "megatron"), zero=0, micro_batches=1, global_batch=2,
                                dtype="bf16")
        kinds.append({c.kind for c in found.collectives})
    assert kinds[0] == {"all_reduce"}
    assert "reduce_scatter" in kinds[1]


@pytest.fixture(scope="module", params=sorted(MODELS))
def wide(request):  # noqa: ANN001, ANN201
    """The same kinds of model at the width and sequence where activations are tens of MiB per collective (the
    latency of one call no longer decides a comparison)."""
    name, overrides = MODELS[request.param]
    shape = {**overrides, "hidden": 2048, "heads": 16, "seq": 2048}
    if "ffn" in shape:
        shape.update(kv_heads=16, ffn=5504)
    zoo = load(name, batch=4, dtype=torch.bfloat16, **shape)
    return trace(zoo.module, example_kwargs=zoo.inputs)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_under_sp_the_whole_model_differs_from_the_block_models_only_at_the_first_layers_norm(
        wide, tp: int) -> None:  # noqa: ANN001
    """Under sequence parallelism the intra-op search's Megatron baseline (pending sums scattered, on the whole
    graph) and `autopar estimate --sp` part in one place: the estimate scatters the stream where the first layer
    takes it, as the runtime does, so that layer's pre-norm runs on sequence shards; the whole-graph baseline first
    splits the stream at the first row-parallel output, so it runs that norm whole. Compute differs by exactly that
    norm's work, the iteration by little more."""
    cluster = load_cluster("a100-80g-sxm").with_devices(tp)
    rows = estimate(wide, cluster, ParallelConfig(tp=tp, mbs=4, sp=True), global_batch=4)
    space = build_space(wide, build_mesh(cluster, {"x0": tp}), cluster, scatter_partials=True, dtensor=False)
    blocks = estimate_choice(space, baseline_choice(space, "megatron"), zero=0, micro_batches=1, global_batch=4,
                             dtype="bf16")
    model = PipelineModel(wide, cluster, traced_batch=4)
    first = next(layer for layer in model.layers if layer.repeated)
    leader = next(n.id for n in first.nodes if n.flops_forward > 0 and any(s.state for s in n.sources))
    norm = [n for n in first.nodes if n.id < leader and not n.is_view]  # its pre-norm's ops
    assert norm
    whole, shards = (sum(sum(sequence_seconds([(n, ways)], cluster.device)) for n in norm) for ways in (1, tp))
    assert blocks.compute_seconds - rows.compute_seconds == pytest.approx(whole - shards, rel=1e-6)
    assert blocks.iteration_seconds == pytest.approx(rows.iteration_seconds, rel=0.15)
    kinds = {c.kind for c in rows.collectives}
    assert {"all_gather", "reduce_scatter"} <= kinds


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_grouped_query_attention_needs_a_tp_that_divides_its_key_value_heads(tp: int) -> None:
    """Grouped-query attention (4 key/value heads for 8 query heads) is split by heads as Megatron splits it, and
    a tp the key/value heads do not divide is not offered (the runtime refuses it)."""
    model = PipelineModel(_graph("llama-gqa"), load_cluster("a100-80g-sxm").with_devices(tp), traced_batch=BATCH)
    assert 4 in model.split_widths and 8 in model.split_widths
