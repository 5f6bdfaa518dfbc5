"""ParallelBlocks (CFP §3): the planner's search unit.

A block starts at a *leading* op, a contraction that reads parameters (a linear layer, an embedding, an expert
matmul, a convolution), and takes the ops after it that its partition reaches (CFP Algorithm 1). In one pass in
execution order:

- a leading op opens a new block;
- another op joins the latest block among those that produced its activation inputs: the attention core joins
  the QKV projection's block, a residual add joins the block of the branch it closes, a LayerNorm joins the block
  before it (so a GPT layer is four blocks: QKV + attention core, output projection, FC1, FC2); where some of
  those inputs depend on the model's inputs and others do not (a position table's lookup of positions made by
  ``arange``), the latest block among the former;
- ops that read only parameters, buffers or model inputs (a weight transpose, a rotary table slice, a label
  reshape) form *input branches*: they join the block of their first consumer and take their layout from it.

A value used by several blocks (the residual stream) gets the layout its producer's block gives it; each consumer
pays the conversion to the layout it needs (an edge in the search). Each block's candidates are the ways to split
its leading op's iteration dims over the mesh axes: for a linear layer on a 1-D mesh its rows (batch), its output
features (column-parallel) or its input features (row-parallel).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from autopar.analysis.dims import op_dims
from autopar.capture import Graph, Node


NEAR = 16  # producers at most this many blocks back are fingerprinted by offset


@dataclass(frozen=True, slots=True)
class ParallelBlock:
    id: int
    leader: int  # node id of the leading contraction
    nodes: tuple[int, ...]  # every node of the block, input branches included, in execution order
    branch: frozenset[int]  # the input-branch nodes among them
    layer: str  # the profile row of the leading op (a repeated layer's FQN, "embed", "head", ...)
    fingerprint: str  # contraction ops and their dependencies (CFP §4.1): equal fingerprints, same parallel behaviour

    def __len__(self) -> int:
        return len(self.nodes)


def is_leader(node: Node) -> bool:
    return node.reads_params and _is_contraction(node)


def _is_contraction(node: Node) -> bool:
    # contractions carry FLOPs (or are embedding lookups); checking that first skips most dimension-map lookups
    return (node.flops_forward > 0 or node.op == "aten.embedding.default") and op_dims(node).contraction


@dataclass(frozen=True, slots=True)
class BlockGraph:
    """The blocks of one graph, with each node's block and whether its value depends on a model input."""

    graph: Graph
    blocks: tuple[ParallelBlock, ...]
    owner: tuple[int, ...]  # node id -> block id
    activation: tuple[bool, ...]  # node id -> its outputs depend on a model input (not only on model state)


def build_blocks(graph: Graph, *, layers: frozenset[str] = frozenset()) -> BlockGraph:
    """Group every node of ``graph`` into ParallelBlocks (one pass; cost grows with the node count only).

    ``layers``: profile rows (repeated layers) whose edges the blocks keep. An op of one of them that reads no
    value a block of its own layer made (the pre-norm at a layer's start, reading the stream the layer before
    made) does not join the block before it: it opens its layer's first block, before that block's leading op.
    Each of these layers is then exactly its blocks, and what crosses from one to the next is a value between
    blocks. Without ``layers`` the pre-norm joins the block that made its input."""
    nodes = graph.nodes
    owner: list[int] = [-1] * len(nodes)  # block index of each node; -1: input branch (assigned after)
    activation: list[bool] = [False] * len(nodes)
    members: list[list[int]] = []
    leaders: list[int] = []
    waiting: dict[str, list[int]] = {}  # a layer's ops before its first leading op, by layer
    for node in nodes:
        activation[node.id] = any(
            (s.node < 0 and s.state is None) or (s.node >= 0 and activation[s.node]) for s in node.sources
        )
        row = graph.layer_of(node.module) if layers else ""
        if is_leader(node):
            owner[node.id] = len(members)
            members.append([*waiting.pop(row, ()), node.id])
            for early in members[-1][:-1]:
                owner[early] = owner[node.id]
            leaders.append(node.id)
            continue
        # the blocks that made its inputs; of those, the ones whose values depend on the model's inputs where any
        # does (a position table's lookup added to the token embeddings joins the tokens' block: the sum has the
        # batch's layout, not the table's)
        made = [s.node for s in node.sources if s.node >= 0 and s.state is None and owner[s.node] >= 0]
        producers = [owner[i] for i in ([i for i in made if activation[i]] or made)]
        if row in layers and producers:
            own = [p for p in producers if graph.layer_of(nodes[leaders[p]].module) == row]
            if not own:  # it starts its layer: it waits for the layer's first leading op
                waiting.setdefault(row, []).append(node.id)
                owner[node.id] = -2
                continue
            producers = own
        elif row in waiting and any(p == -2 for p in (owner[s.node] for s in node.sources if s.node >= 0)):
            waiting[row].append(node.id)  # reads an op that waits: waits with it
            owner[node.id] = -2
            continue
        if producers:
            owner[node.id] = max(producers)
            members[owner[node.id]].append(node.id)
    for row, ids in waiting.items():  # a layer with no leading op after them: they join the block they read from
        for i in ids:
            producers = [owner[s.node] for s in nodes[i].sources if s.node >= 0 and s.state is None
                         and owner[s.node] >= 0]
            owner[i] = max(producers) if producers else -1
            if owner[i] >= 0:
                members[owner[i]].append(i)
    if not members:
        raise ValueError("the model has no parameterised contraction (linear, embedding, convolution) to plan")
    # input branches join their first consumer's block (walk backwards so chains of branch ops follow)
    first_consumer: dict[int, int] = {}
    for node in nodes:
        for s in node.sources:
            if s.node >= 0 and s.node not in first_consumer:
                first_consumer[s.node] = node.id
    branch_of: dict[int, set[int]] = {}
    for i in reversed([i for i in range(len(nodes)) if owner[i] < 0]):
        consumer = first_consumer.get(i)
        block = owner[consumer] if consumer is not None and owner[consumer] >= 0 else len(members) - 1
        owner[i] = block
        members[block].append(i)
        branch_of.setdefault(block, set()).add(i)
    blocks = []
    for b, ids in enumerate(members):
        ordered = tuple(sorted(ids))
        blocks.append(
            ParallelBlock(
                id=b,
                leader=leaders[b],
                nodes=ordered,
                branch=frozenset(branch_of.get(b, ())),
                layer=graph.layer_of(nodes[leaders[b]].module),
                fingerprint=_fingerprint(nodes, ordered, owner, activation, b),
            )
        )
    return BlockGraph(graph=graph, blocks=tuple(blocks), owner=tuple(owner), activation=tuple(activation))


def _fingerprint(nodes: list[Node], ids: tuple[int, ...], owner: list[int], activation: list[bool], block: int) -> str:
    """Contraction ops (op and shapes) and where each activation from outside the block comes from, by relative
    block offset: the fine-grained dependency graph of contractions CFP uses, cheap to compare."""
    parts: list[str] = []
    for i in ids:
        node = nodes[i]
        if _is_contraction(node):
            parts.append(f"{node.op}{[t.shape for t in node.inputs]}")
        for s in node.sources:
            if s.node >= 0 and s.state is None and owner[s.node] != block and activation[s.node]:
                offset = owner[s.node] - block
                # a near producer is named by its offset, a far one (an encoder output read by every decoder
                # layer) by what it is, so the decoder layers still match one another
                where = str(offset) if offset >= -NEAR else nodes[s.node].op
                parts.append(f"<{where}:{nodes[s.node].outputs[s.index].shape}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()
