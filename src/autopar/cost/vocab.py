"""Vocabulary-parallel embedding, LM head and loss: Megatron-LM's tensor parallelism of a language model's ends.

autopar's runtime keeps a tied LM head whole on every tp rank (and gathers an untied column-parallel head's logits
before the loss). Megatron-LM splits the vocabulary over tp instead (``VocabParallelEmbedding``,
``parallel_lm_logits``, ``vocab_parallel_cross_entropy`` in ``megatron/mpu``). `vocabulary_split` finds where;
the block model prices it as an assignment of its blocks (`autopar.cost.intra_layers`), for a micro-batch of T
tokens, hidden size h, a vocabulary of V entries (V / tp per rank: Megatron-LM pads V to a multiple of 128 tp;
priced as V / tp):

- embedding: the lookup's block split by its vocabulary: each rank holds V / tp rows of the table (its parameters,
  gradients and optimizer state 1/tp) and looks up every token (ids outside its range masked to zeros); the partial
  outputs are summed by one all-reduce of T h values forward where whole values are needed
  (``reduce_from_tensor_model_parallel_region``, nothing backward). The lookup's traffic is priced split over tp
  like any split op, where Megatron-LM writes the whole masked output on every rank: T h values per rank, under
  0.1% of a stage of the SC'21 models;
- LM head: its block column-parallel, V / tp output columns per rank (its FLOPs and its logits 1/tp), the input
  replicated, so its input gradient is summed by one all-reduce of T h values backward
  (``copy_to_tensor_model_parallel_region``); no gather of the logits;
- loss: the ops computed from the logits run on the V / tp logits of each rank (their memory-bound work and saved
  tensors 1/tp, no conversion: Megatron-LM's fused cross entropy, which no per-op layout expresses), with three
  all-reduces of T fp32 values forward (the logits' maximum, the target's logit, the sum of exponentials), nothing
  backward.

A tied head's copy on the last pipeline stage is split the same way (`PipelineModel` divides it by the stage's tp).
The head is the parameter-reading contraction after the last repeated layer; the split region is everything
computed from its output; the embeddings split are those reading a table of V rows. Memory follows the split
(the tables, their gradients and optimizer state, the logits and what the loss saves, 1/tp), except the last
pipeline stage's buffer of returned outputs, which stays as autopar's runtime keeps it (whole logits per
micro-batch; Megatron-LM returns only the loss).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from autopar.capture import Graph, Node
from autopar.cost.layers import LayerCost, _is_param_contraction

log = logging.getLogger(__name__)

LOSS_REDUCTIONS = 3  # all-reduces of the vocab-parallel cross entropy's forward: max, target logit, sum of exp
LOSS_ITEMSIZE = 4  # Megatron-LM computes the loss in fp32 (its logits are cast with .float())


@dataclass(frozen=True, slots=True)
class VocabSplit:
    """Where Megatron-LM splits a language model by vocabulary: its LM heads (node ids), the embedding lookups in a
    table of V rows, the ops computed from the heads' outputs (the loss, split with them), the first of those that
    is not a view (where the loss's reductions are counted), and the tokens of a micro-batch at the traced batch."""

    heads: frozenset[int]
    tables: frozenset[int]
    region: frozenset[int]
    loss: int | None
    tokens: int

    @property
    def reductions(self) -> tuple[float, ...]:
        """Bytes of each of the loss's forward all-reduces at the traced batch."""
        return (self.tokens * LOSS_ITEMSIZE,) * LOSS_REDUCTIONS


def vocabulary_split(layers: list[LayerCost], graph: Graph) -> VocabSplit | None:
    """The vocabulary split of the model whose rows are ``layers`` (from `analyse(graph)`); None where it has no
    head after its last repeated layer."""
    ends = [layer.nodes[-1].id for layer in layers if layer.repeated and layer.nodes]
    after = max(ends) if ends else -1
    heads = [node for layer in layers if not layer.repeated for node in layer.nodes
             if node.id > after and _is_param_contraction(node)]
    if not heads:
        log.info("no LM head after the last repeated layer: the vocabulary is not split")
        return None
    vocab = heads[-1].outputs[0].shape[-1]
    region = {head.id for head in heads}
    loss = None
    for node in graph.nodes:
        if node.id in region or not any(s.node in region for s in node.sources if s.state is None):
            continue
        region.add(node.id)
        if loss is None and not node.is_view:
            loss = node.id
    repeated = {node.id for layer in layers if layer.repeated for node in layer.nodes}
    tables = frozenset(node.id for node in graph.nodes if node.id not in repeated and _is_vocab_table(node, vocab))
    return VocabSplit(heads=frozenset(h.id for h in heads), tables=tables,
                      region=frozenset(region - {h.id for h in heads}), loss=loss,
                      tokens=heads[-1].outputs[0].numel // vocab)


def _is_vocab_table(node: Node, vocab: int) -> bool:
    """An embedding lookup in a table of ``vocab`` rows."""
    return node.op.startswith("aten.embedding.") and bool(node.sources) and node.sources[0].state is not None \
        and node.inputs[0].shape[0] == vocab
