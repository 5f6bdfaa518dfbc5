"""The estimate's options for pricing what Megatron-LM runs where autopar's runtime differs: the vocabulary split
over tp (`autopar.cost.vocab`), scatter/gather pipeline sends, data-parallel sync after the backward."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cluster import PRESETS, Collective, collective_seconds
from autopar.cost import ParallelConfig, estimate
from autopar.cost.layers import analyse
from autopar.cost.megatron import pipeline_config
from autopar.cost.pipeline import PipelineModel
from autopar.cost.vocab import LOSS_REDUCTIONS, vocabulary_split
from autopar.zoo import load

VOCAB, HIDDEN, SEQ = 4096, 256, 128


@pytest.fixture(scope="module")
def gpt() -> autopar.Graph:
    zoo = load("megatron-1.7b", batch=1, seq=SEQ, dtype=torch.bfloat16, layers=4, hidden=HIDDEN, heads=4,
               vocab=VOCAB)
    return autopar.trace(zoo.module, example_kwargs=zoo.inputs)


def _uses(result) -> dict[tuple[str, str, float], int]:  # noqa: ANN001
    return {(u.kind, u.axis, u.bytes): u.count for u in result.collectives}


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="vocab_parallel"):
        ParallelConfig(tp=2, sp=True, vocab_parallel=True)
    with pytest.raises(ValueError, match="overlap_dp"):
        ParallelConfig(overlap_dp=0)


def test_the_vocabulary_split_finds_the_head_the_table_and_the_loss(gpt: autopar.Graph) -> None:
    split = vocabulary_split(analyse(gpt), gpt)
    (head,) = split.heads
    assert gpt.node(head).op.startswith("aten.mm.") and gpt.node(head).module == "head"
    (table,) = split.tables
    assert gpt.node(table).op.startswith("aten.embedding.") and gpt.node(table).inputs[0].shape[0] == VOCAB
    ops = {gpt.node(n).op for n in split.region}
    assert {"aten._log_softmax.default", "aten.nll_loss_forward.default"} <= ops
    assert split.reductions == (SEQ * 4.0,) * LOSS_REDUCTIONS  # T fp32 values each


def test_vocab_parallel_rows_are_priced_as_megatron_lm_runs_them(gpt: autopar.Graph) -> None:
    """Per micro-batch: the embedding's partial sums all-reduced forward where whole values are needed, the head's
    input gradient all-reduced backward and no gather of its logits, the loss's three reductions of T fp32 values
    forward; the table and the head 1/tp on each rank."""
    tp = 4
    model = PipelineModel(gpt, PRESETS["a100-80g-sxm"].with_devices(tp), traced_batch=1, vocab_parallel=True)
    mesh = model._mesh(1, 1, tp)
    stream, calls, params = float(SEQ * HIDDEN * 2), {}, {}
    for row, layer in enumerate(model.layers):
        if not layer.repeated:
            price = model.price(row, tp=tp, samples=1, recompute="none", sp=False, mesh=mesh)
            params[layer.name] = price.params
            for c in price.collectives:
                key = (c.kind.value, c.bytes, c.phase.value)
                calls[key] = calls.get(key, 0) + c.calls
    assert calls == {("all_reduce", stream, "forward"): 1, ("all_reduce", stream, "backward"): 1,
                     ("all_reduce", float(SEQ * 4), "forward"): LOSS_REDUCTIONS}
    assert params["embed"] == VOCAB * HIDDEN / tp


@pytest.mark.parametrize("pp", [1, 2])
def test_vocab_parallel_prices_its_collectives_and_splits_the_head(gpt: autopar.Graph, pp: int) -> None:
    tp, batch = 4, 4
    cluster = PRESETS["a100-80g-sxm"].with_devices(tp * pp)
    whole = estimate(gpt, cluster, ParallelConfig(tp=tp, pp=pp), global_batch=batch)
    split = estimate(gpt, cluster, ParallelConfig(tp=tp, pp=pp, vocab_parallel=True), global_batch=batch)
    before, after = _uses(whole), _uses(split)
    stream = ("all_reduce", "tp", float(SEQ * HIDDEN * 2))
    assert after[stream] - before[stream] == 2 * batch  # embedding forward, head input backward, per micro-batch
    assert after[("all_reduce", "tp", float(SEQ * 4))] == LOSS_REDUCTIONS * batch
    if pp > 1:  # the tied weight's gradients summed between the ends: 1/tp of the table
        assert ("all_reduce", "pp", float(VOCAB * HIDDEN * 2 / tp)) in after
        assert ("all_reduce", "pp", float(VOCAB * HIDDEN * 2)) in before
    assert split.compute_seconds < whole.compute_seconds  # the head's and the loss's work 1/tp (on this small
    # model the extra collectives' latency outweighs it in the iteration)
    assert split.memory.total < whole.memory.total
    one = PRESETS["a100-80g-sxm"].with_devices(pp)
    assert estimate(gpt, one, ParallelConfig(pp=pp, vocab_parallel=True), global_batch=batch).iteration_seconds \
        == pytest.approx(estimate(gpt, one, ParallelConfig(pp=pp), global_batch=batch).iteration_seconds)


def test_scatter_gather_sends_send_a_tp_share_and_gather_it(gpt: autopar.Graph) -> None:
    tp, pp, batch = 4, 2, 4
    cluster = PRESETS["a100-80g-sxm"].with_devices(tp * pp)
    whole = _uses(estimate(gpt, cluster, ParallelConfig(tp=tp, pp=pp), global_batch=batch))
    config = ParallelConfig(tp=tp, pp=pp, scatter_gather_sends=True)
    shared = _uses(estimate(gpt, cluster, config, global_batch=batch))
    boundary = float(SEQ * HIDDEN * 2)
    sends = whole[("send_recv", "pp", boundary)]
    assert sends == 2 * batch  # each stage sends once per micro-batch (activations forward, gradients back)
    assert shared[("send_recv", "pp", boundary / tp)] == sends and shared[("all_gather", "tp", boundary)] == sends
    model = PipelineModel(gpt, cluster, traced_batch=1, scatter_gather_sends=True)
    pipeline = pipeline_config(model, config)
    mesh = model._mesh(pp, 1, tp)
    seconds, _ = model._send(boundary, pipeline.stages[0], pipeline, mesh)
    assert seconds == pytest.approx(collective_seconds(Collective.SEND_RECV, boundary / tp, mesh.axis("pp"), cluster)
                                    + collective_seconds(Collective.ALL_GATHER, boundary, mesh.axis("tp"), cluster))
    one = PRESETS["a100-80g-sxm"].with_devices(pp)
    assert _uses(estimate(gpt, one, ParallelConfig(pp=pp, scatter_gather_sends=True), global_batch=batch)) \
        == _uses(estimate(gpt, one, ParallelConfig(pp=pp), global_batch=batch))


def test_data_parallel_sync_after_the_backward_is_the_closed_form() -> None:
    """Without overlap a one-stage iteration is its micro-batches then every all-reduce: the closed form. With it
    DDP's buckets (100 MiB of gradients here: 4 of them) all-reduce during the last backward."""
    zoo = load("megatron-1.7b", batch=1, seq=SEQ, dtype=torch.bfloat16, layers=4, hidden=1024, heads=8, vocab=VOCAB)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    cluster = PRESETS["a100-80g-sxm"].with_devices(16)  # dp 16 over two nodes
    config = ParallelConfig(dp=16, mbs=1, overlap_dp=False)
    after = estimate(graph, cluster, config, global_batch=64)
    overlapped = estimate(graph, cluster, ParallelConfig(dp=16, mbs=1), global_batch=64)
    model = PipelineModel(graph, cluster, traced_batch=1, screen=True)
    closed = model.estimate(pipeline_config(model, config), global_batch=64, overlap=False).estimate
    assert after.iteration_seconds == pytest.approx(closed.iteration_seconds, rel=1e-9)
    assert after.iteration_seconds > overlapped.iteration_seconds
    # the searches' screen with overlap: on one stage under DDP, what the simulator finds
    screened = model.estimate(pipeline_config(model, config), global_batch=64).estimate
    assert screened.iteration_seconds == pytest.approx(overlapped.iteration_seconds, rel=1e-9)
