"""Vocabulary-parallel embedding, LM head and loss: Megatron-LM's tensor parallelism of a language model's ends.

autopar's runtime keeps a tied LM head whole on every tp rank (and gathers an untied column-parallel head's logits
before the loss). Megatron-LM splits the vocabulary over tp instead (``VocabParallelEmbedding``,
``parallel_lm_logits``, ``vocab_parallel_cross_entropy`` in ``megatron/mpu``). `split_vocabulary` marks that split
on the layer rows of `autopar.cost.layers.analyse`, so the pipeline model prices it with the same terms as any
tensor-parallel row (`autopar.cost.pipeline.price_layer`), for a micro-batch of T tokens, hidden size h, a
vocabulary of V entries (V / tp per rank: Megatron-LM pads V to a multiple of 128 tp; priced as V / tp):

- embedding: each rank holds V / tp rows of the table (its parameters, gradients and optimizer state 1/tp) and
  looks up every token (ids outside its range masked to zeros); the outputs are summed by one all-reduce of
  T h values forward (``reduce_from_tensor_model_parallel_region``, nothing backward). The lookup's traffic is
  priced split over tp like any split op, where Megatron-LM writes the whole masked output on every rank: T h
  values per rank, under 0.1% of a stage of the SC'21 models;
- LM head: column-parallel, V / tp output columns per rank (its FLOPs and its logits 1/tp), the input replicated,
  so its input gradient is summed by one all-reduce of T h values backward (``copy_to_tensor_model_parallel_region``);
  no gather of the logits;
- loss: the cross entropy on the V / tp logits of each rank (its memory-bound work and saved tensors 1/tp), with
  three all-reduces of T fp32 values forward (the logits' maximum, the target's logit, the sum of exponentials),
  nothing backward.

A tied head's copy on the last pipeline stage is split the same way (`PipelineModel` divides it by the stage's tp).
The head is the parameter-reading contraction after the last repeated layer; the split region is everything
computed from its output; the embeddings split are those reading a table of V rows. Memory follows the split
(the tables, their gradients and optimizer state, the logits and what the loss saves, 1/tp), except the last
pipeline stage's buffer of returned outputs, which stays as autopar's runtime keeps it (whole logits per
micro-batch; Megatron-LM returns only the loss).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from autopar.capture import Graph, Node
from autopar.cost.layers import LayerCost, _is_param_contraction

log = logging.getLogger(__name__)

LOSS_REDUCTIONS = 3  # all-reduces of the vocab-parallel cross entropy's forward: max, target logit, sum of exp
LOSS_ITEMSIZE = 4  # Megatron-LM computes the loss in fp32 (its logits are cast with .float())


def split_vocabulary(layers: list[LayerCost], graph: Graph) -> list[LayerCost]:
    """``layers`` (from `analyse(graph)`, left unchanged) with the embedding, LM head and loss split over tp by
    vocabulary as Megatron-LM runs them (the module docstring has the terms); unchanged where the model has no
    head after its last repeated layer."""
    ends = [layer.nodes[-1].id for layer in layers if layer.repeated and layer.nodes]
    row_of = {node.id: row for row, layer in enumerate(layers) for node in layer.nodes}
    after = max(ends) if ends else -1
    heads = [node for layer in layers if not layer.repeated for node in layer.nodes
             if node.id > after and _is_param_contraction(node)]
    if not heads:
        log.info("no LM head after the last repeated layer: the vocabulary is not split")
        return list(layers)
    vocab = heads[-1].outputs[0].shape[-1]
    rows = {row: _copy(layer) for row, layer in enumerate(layers)}
    for head in heads:
        layer = rows[row_of[head.id]]
        if head.id not in layer.columns:  # a tied head was kept whole: it becomes column-parallel
            layer.column_inputs.append(max(t.nbytes for s, t in zip(head.sources, head.inputs) if s.state is None))
            _split(layer, head, column=True)
        elif head.output_bytes in layer.gathered_outputs:  # an untied head's logits are no longer gathered
            layer.gathered_outputs.remove(head.output_bytes)
    region = {head.id for head in heads}
    loss_row = None
    for node in graph.nodes:
        if node.id in region or not any(s.node in region for s in node.sources if s.state is None):
            continue
        region.add(node.id)
        row = row_of[node.id]
        _split(rows[row], node, column=False)
        if loss_row is None and not node.is_view:
            loss_row = row
    tokens = heads[-1].outputs[0].numel // vocab
    if loss_row is not None:
        rows[loss_row].row_outputs.extend([tokens * LOSS_ITEMSIZE] * LOSS_REDUCTIONS)
    for node in graph.nodes:
        if node.id in row_of and _is_vocab_table(node, vocab) and not layers[row_of[node.id]].repeated:
            _split_embedding(rows, row_of[node.id], node, graph, {layer.name: r for r, layer in enumerate(layers)})
    return [rows[row] for row in range(len(layers))]


def _is_vocab_table(node: Node, vocab: int) -> bool:
    """An embedding lookup in a table of ``vocab`` rows."""
    return node.op.startswith("aten.embedding.") and bool(node.sources) and node.sources[0].state is not None \
        and node.inputs[0].shape[0] == vocab


def _split_embedding(rows: dict[int, LayerCost], row: int, node: Node, graph: Graph, index: dict[str, int]) -> None:
    """The lookup split (its table 1/tp on the row that owns it) and its output summed forward."""
    layer = rows[row]
    _split(layer, node, column=False)
    layer.row_outputs.append(node.output_bytes)
    fqn = node.sources[0].state
    owner = index.get(graph.layer_of(fqn.rpartition(".")[0]))
    if owner is not None:
        rows[owner].sharded_params += node.inputs[0].numel


def _split(layer: LayerCost, node: Node, *, column: bool) -> None:
    """Mark ``node`` split over tp in ``layer``: its work 1/tp, and what it saves 1/tp unless it is a column
    (which saves its replicated input)."""
    if node.id in layer.sharded:
        return
    layer.sharded.add(node.id)
    if column:
        layer.columns.add(node.id)
    else:
        layer.saved_replicated -= node.saved_bytes
        layer.saved_sharded += node.saved_bytes


def _copy(layer: LayerCost) -> LayerCost:
    """A copy whose collections can change without touching ``layer``."""
    return replace(layer, sharded=set(layer.sharded), columns=set(layer.columns), row_outputs=list(layer.row_outputs),
                   column_inputs=list(layer.column_inputs), gathered_outputs=list(layer.gathered_outputs))
