"""The profile rows of a traced graph (the chain of layers the pipeline cuts) and Megatron's roles in them.

Parameter-reading contractions alternate column- and row-parallel: one whose activation input does not depend on
an open column-parallel output is column-parallel (QKV, FC1, gate/up, the LM head) and opens a sharded region; one
whose input lies in that region is row-parallel (attention output projection, FC2, down) and closes it. Tensors in
a region exist 1/tp per device; activations outside it (LayerNorm inputs and outputs, dropout masks on the residual
stream) are replicated unless sequence parallelism shards them too (Korthikanti et al. 2022).

These roles are not priced here: every row is priced by the block model (`autopar.cost.intra_layers`), Megatron's
layout being one assignment of its blocks. They are what that assignment is checked against (it splits the ops the
roles split, `tests/test_one_model.py`), what the stage memory walk splits (`autopar.cost.stage_memory`), the widths
tensor parallelism must divide, and the whole weights whose gradients the runtime sums over tp (norms on sequence
shards, q and k norms on split heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.capture import Graph, Node

_CONTRACTIONS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._grouped_mm.", "aten.convolution.")


@dataclass(slots=True)
class LayerCost:
    """One profile row (a layer, or the embedding / head / loss): its ops, and Megatron's roles in it."""

    name: str
    repeated: bool
    params: int = 0
    sharded_params: int = 0  # of those, what TP splits (column weights and biases, row weights)
    tied: list[tuple[str, int]] = field(default_factory=list)  # (owner's row, size) of weights read from elsewhere
    sp_partial_params: int = 0  # norm weights that see sequence shards: gradients summed over tp once a step
    sp_partial_tensors: int = 0  # how many weights those are (FSDP sums each on its own)
    # replicated weights applied to the activations tp splits (q and k norms per head, `_applied_to_shards`):
    # each rank's gradient covers its own heads, so they are summed over tp once a step, with or without SP
    tp_partial: frozenset[str] = frozenset()
    tp_partial_params: int = 0  # their elements
    # biases a column-parallel linear adds in an op of its own (``mm`` then ``add``, as a Linear on a 3-D input
    # that is not contiguous runs): split with the column's output features, as its weight
    column_biases: frozenset[str] = frozenset()
    nodes: list[Node] = field(default_factory=list)
    sharded: set[int] = field(default_factory=set)  # node ids whose work TP splits
    columns: set[int] = field(default_factory=set)  # column-parallel contractions: split work, replicated input
    saved_sharded: int = 0
    saved_replicated: int = 0
    input_bytes: int = 0  # the layer's activation input (what full recomputation keeps)
    # its largest input from the repeated layers before it (the residual stream, or what else one layer hands the
    # next, T5's position bias): what a pipeline stage boundary sends and sequence parallelism scatters; not inputs
    # made beside the chain of layers (rotary tables, masks, encoder outputs)
    stream_input: int = 0


def _is_param_contraction(node: Node) -> bool:
    return node.op.startswith(_CONTRACTIONS) and node.reads_params


def _is_convolution(node: Node) -> bool:
    """A convolution (a ViT's patch embedding, Whisper's audio stem): Megatron's layout keeps it whole on tp, its
    work repeated on each rank, as the runtime runs it. Its input and output are the replicated stream, so its
    gradient is alike on every tp rank and needs no sum."""
    return node.op.startswith("aten.convolution.")


def weight_out_dim(graph: Graph, node: Node, source) -> int:  # noqa: ANN001 - a Node's source reference
    """The dim of the 2-D weight ``source`` (a parameter contraction ``node`` reads) that holds the contraction's
    output features: 0 for a Linear's (out, in) weight, which the contraction reads transposed; 1 for a weight
    read as it is stored, (in, out), as GPT-2's Conv1D does. Falls back to 0 where the weight reaches the
    contraction through anything but a transpose."""
    from autopar.analysis.dims import Split, op_dims

    index = node.sources.index(source)
    features = [d.inputs[index] for d in op_dims(node).dims
                if d.inputs[index] is not None and d.split is Split.FREE and any(o is not None for o in d.outputs)]
    if len(features) != 1:
        return 0
    if source.node < 0:  # read as stored
        return features[0]
    view = graph.node(source.node)
    if view.op in ("aten.t.default", "aten.transpose.int") and view.sources and view.sources[0].node < 0:
        return 1 - features[0]
    return 0


_CHOICES = ("aten.topk.", "aten.sort.", "aten.argmax.", "aten.argsort.", "aten.max.dim")


def routers(graph: Graph) -> frozenset[int]:
    """The parameter contractions that choose rather than compute (a mixture of experts' router, whose scores pick
    each token's experts with a ``topk``) and those with one output feature (Qwen2-MoE's shared-expert gate):
    tensor parallelism keeps them whole, on every device, as Megatron-LM keeps its router. A router's output reaches
    a top-k or sort through ops that are no contraction, in its own profile row (the search stays in the row: the
    residual stream would otherwise lead it through every later layer)."""
    nodes = graph.nodes
    row = {node.id: graph.layer_of(node.module) for node in nodes}
    consumers: dict[int, list[Node]] = {}
    for node in nodes:
        for s in node.sources:
            if s.state is None and s.node >= 0:
                consumers.setdefault(s.node, []).append(node)
    found = set()
    for node in nodes:
        if not _is_param_contraction(node) or not node.outputs:
            continue
        if node.outputs[0].shape and node.outputs[0].shape[-1] == 1:
            found.add(node.id)
            continue
        frontier, seen = [node.id], {node.id}
        while frontier and node.id not in found:
            for user in consumers.get(frontier.pop(), ()):
                if user.id in seen or user.op.startswith(_CONTRACTIONS) or row[user.id] != row[node.id]:
                    continue
                if user.op.startswith(_CHOICES):
                    found.add(node.id)
                    break
                seen.add(user.id)
                frontier.append(user.id)
    return frozenset(found)


def kept_whole(graph: Graph) -> frozenset[int]:
    """The parameter contractions tensor parallelism keeps whole, on every rank, beside tied weights and
    convolutions: the routers (`routers`), and every contraction of an attention with one key/value head
    (`Graph.multi_query`), whose heads no tp degree divides: its q, k, v and output projections all run whole, on
    the whole sequence, so its weights' gradients need no sum."""
    found = set(routers(graph))
    if graph.multi_query:
        found.update(node.id for node in graph.nodes
                     if _is_param_contraction(node) and graph.multi_query_of(node.module) is not None)
    return frozenset(found)


def multi_query_outputs(graph: Graph) -> frozenset[int]:
    """The last parameter contraction of each multi-query attention (`Graph.multi_query`), its output projection:
    under sequence parallelism its whole output is handed on as this rank's sequence shard at once, as the runtime
    does at the attention's output (`runtime.apply.whole_attentions`)."""
    if not graph.multi_query:
        return frozenset()
    last: dict[str, int] = {}
    for node in graph.nodes:
        attention = graph.multi_query_of(node.module) if _is_param_contraction(node) else None
        if attention is not None:
            last[attention] = node.id
    return frozenset(last.values())


def expert_weight_dim(graph: Graph, node: Node, source, *, column: bool) -> int | None:  # noqa: ANN001
    """The dim of the 3-D expert weight ``source`` (one (in, out) or (out, in) matrix per expert, which the
    grouped contraction ``node`` reads as stored or through one transpose) that tensor parallelism splits: the
    output features for a ``column``, the contracted ones otherwise. None where the weight reaches the
    contraction through anything else."""
    from autopar.analysis.dims import Split, op_dims

    index = node.sources.index(source)
    found = [d.inputs[index] for d in op_dims(node).dims if d.inputs[index] is not None and (
        (d.split is Split.FREE and any(o is not None for o in d.outputs)) if column else d.split is Split.PARTIAL)]
    if len(found) != 1:
        return None
    if source.node < 0:
        return found[0]
    view = graph.node(source.node)
    if view.op == "aten.transpose.int" and view.sources and view.sources[0].node < 0 and len(view.args) >= 3:
        rank = len(view.inputs[0].shape)
        a, b = (d % rank for d in view.args[1:3])
        return b if found[0] == a else a if found[0] == b else found[0]
    return None


def _reads_foreign_weight(node: Node) -> bool:
    """A parameter owned by another module (a tied weight): TP keeps it, and the contraction, whole."""
    return any(s.state is not None and s.state.rpartition(".")[0] != node.module for s in node.sources if s.state)


def _stream_of_first_layers(rows: dict[str, LayerCost], largest: dict[str, int]) -> None:
    """A repeated layer that reads no other repeated layer (the first of a stack, reading the embedding) carries
    the stream of the next layer that does (the stack's layers are alike); where none does (a stack of one), its
    largest activation input."""
    ordered = [layer for layer in rows.values() if layer.repeated]
    following = 0
    for layer in reversed(ordered):
        if layer.stream_input:
            following = layer.stream_input
        else:
            layer.stream_input = following or largest[layer.name]


def analyse(graph: Graph) -> list[LayerCost]:
    """Per-row costs in execution order, with the TP roles of their nodes marked."""
    repeated = {fqn for g in graph.repeats for fqn in g.instances}
    rows: dict[str, LayerCost] = {}
    for row in graph.layers():
        rows[row.name] = LayerCost(name=row.name, repeated=row.name in repeated, params=row.params)
    # node id -> the column-parallel contractions whose sharded region its output lies in
    open_region: dict[int, frozenset[int]] = {}
    closed: set[int] = set()  # columns some row-parallel contraction consumed
    whole = kept_whole(graph)
    for node in graph.nodes:
        layer = rows[graph.layer_of(node.module)]
        layer.nodes.append(node)
        activation_sources = [s for s in node.sources if s.state is None and s.node >= 0]
        region = frozenset().union(*(open_region.get(s.node, ()) for s in activation_sources))
        in_region = bool(region)
        if _is_param_contraction(node) and (_reads_foreign_weight(node) or _is_convolution(node)
                                            or node.id in whole):
            pass  # a tied weight, a convolution, a router or a multi-query attention's: TP keeps it whole
        elif _is_param_contraction(node):
            if in_region:  # row-parallel: consumes the shard, produces partial sums
                layer.sharded.add(node.id)
                closed.update(region)
            else:  # column-parallel: replicated input, sharded output
                layer.sharded.add(node.id)
                layer.columns.add(node.id)
                open_region[node.id] = frozenset((node.id,))
        elif in_region:
            layer.sharded.add(node.id)
            open_region[node.id] = region
    _gather_unclosed(rows, open_region, closed)
    for layer in rows.values():
        split: set[str] = set()
        for node in layer.nodes:
            if node.id in layer.sharded and _is_param_contraction(node):
                for source in node.sources:
                    info = graph.state.get(source.state) if source.state else None
                    if info is not None and (node.id in layer.columns or len(info.tensor.shape) >= 2):
                        split.add(source.state)
        layer.column_biases = frozenset(_column_biases(graph, layer))
        split |= layer.column_biases
        layer.sharded_params = sum(graph.state[fqn].tensor.numel for fqn in split)
        layer.tp_partial = frozenset(_applied_to_shards(graph, layer) - layer.column_biases)
        layer.tp_partial_params = sum(graph.state[fqn].tensor.numel for fqn in layer.tp_partial)
        # weights read here and owned by another row: a head tied to the embedding, whichever of the two the
        # weight is named by (nanoGPT's embedding reads the head's)
        foreign = {s.state for node in layer.nodes for s in node.sources
                   if s.state in graph.state and not graph.state[s.state].is_buffer
                   and graph.layer_of(s.state.rpartition(".")[0]) != layer.name}
        layer.tied = [(graph.layer_of(fqn.rpartition(".")[0]), graph.state[fqn].tensor.numel)
                      for fqn in sorted(foreign) if fqn in graph.state]
        for node in layer.nodes:  # a column-parallel op saves its replicated input; the rest of a region is split
            if node.id in layer.sharded and node.id not in layer.columns:
                layer.saved_sharded += node.saved_bytes
            else:
                layer.saved_replicated += node.saved_bytes
    # a layer's activation input (what full recomputation keeps): float values it reads from outside itself, once
    # each; `Graph.module_memory(...).bwd_out` by definition, computed here in one pass for all layers
    layer_of_node = {}
    for layer in rows.values():
        for node in layer.nodes:
            layer_of_node[node.id] = layer
    largest: dict[str, int] = {}  # per repeated layer, its largest activation input from outside it
    for layer in rows.values():
        if not layer.repeated:
            continue
        seen: set[tuple[int, int]] = set()
        largest[layer.name] = 0
        for node in layer.nodes:
            for s, t in zip(node.sources, node.inputs):
                if s.state is not None or (s.node, s.index) in seen or not t.dtype.startswith(("float", "bfloat")):
                    continue
                source = layer_of_node.get(s.node) if s.node >= 0 else None
                if source is layer:
                    continue
                seen.add((s.node, s.index))
                layer.input_bytes += t.nbytes
                largest[layer.name] = max(largest[layer.name], t.nbytes)
                if source is not None and source.repeated:  # from the layer before: the stream
                    layer.stream_input = max(layer.stream_input, t.nbytes)
    _stream_of_first_layers(rows, largest)
    first = next((layer for layer in rows.values() if layer.repeated), None)
    if first is not None:
        _sequence_shards(graph, list(rows.values()), first)
    return list(rows.values())


def _sequence_shards(graph: Graph, ordered: list[LayerCost], first: LayerCost) -> None:
    """Where sequence parallelism leaves the stream in sequence shards, as the runtime does: from the first
    repeated layer through the layers, and after them up to the first contraction that needs the whole sequence
    (a column-parallel one: a column-parallel head, or BERT's MLM head's dense layer, which gathers its input
    itself; or a tied contraction TP keeps whole). Weights read outside contractions while the stream is in shards
    (norms) get a partial gradient on each rank (``sp_partial_params``)."""
    sharded = True
    for layer in ordered[ordered.index(first):]:
        read: set[str] = set()
        for node in layer.nodes:
            if _is_param_contraction(node) and not layer.repeated and sharded:
                if node.id in layer.columns or (node.id not in layer.sharded and _reads_foreign_weight(node)):
                    sharded = False
            elif ((layer.repeated or sharded) and not node.is_view and not _is_param_contraction(node)
                  and graph.multi_query_of(node.module) is None):  # an attention kept whole sees the whole sequence
                read.update(s.state for s in node.sources
                            if s.state and s.state in graph.state and not graph.state[s.state].is_buffer)
        read -= layer.tp_partial  # applied to the heads tp splits, not to sequence shards: summed as such
        read -= layer.column_biases  # split with a column's features, which it sees for the whole sequence
        layer.sp_partial_params = sum(graph.state[fqn].tensor.numel for fqn in read)
        layer.sp_partial_tensors = len(read)


def _applied_to_shards(graph: Graph, layer: LayerCost) -> set[str]:
    """The parameters tp keeps whole that the layer applies to the activations tp splits, between a column-parallel
    and a row-parallel contraction (q and k norms per head, as Qwen3 and Gemma 3 have), directly or through ops on
    parameters alone (Gemma's ``1 + weight``): each rank computes their gradient from its own part of the
    activations, so the gradients are summed over tp once a step (`LayerCost.tp_partial`)."""
    made = computed_from_state(layer.nodes)
    found: set[str] = set()
    for node in layer.nodes:
        if node.id in made or node.id not in layer.sharded or _is_param_contraction(node):
            continue
        for ref in node.sources:
            for name in ([ref.state] if ref.state else made.get(ref.node, ())):
                info = graph.state.get(name)
                if info is not None and not info.is_buffer and info.requires_grad:
                    found.add(name)
    return found


def _column_biases(graph: Graph, layer: LayerCost) -> set[str]:
    """The 1-D parameters split with a column-parallel contraction's output features: those the column's own module
    adds to its output in an op after it (its bias, where the Linear ran as ``mm`` and ``add``), and those another
    module applies along the whole of those features, to a value as large as the column's output (OLMo 2's q and k
    norms, over all heads at once: the runtime runs such a norm on each rank's features, its weight split with
    them, `runtime.apply.split_norms`). A norm per head (Qwen3's) applies its weight along a head's features instead: it
    stays whole, its gradient summed over tp (`_applied_to_shards`)."""
    columns = [graph.node(c) for c in layer.columns]
    modules = {c.module for c in columns}
    # (elements, features) of each column's output: its matmul's (rows, features) or a view of them
    shapes = {(c.outputs[0].numel, c.outputs[0].shape[-1]) for c in columns if c.outputs and c.outputs[0].shape}
    found: set[str] = set()
    for node in layer.nodes:
        if node.id not in layer.sharded or _is_param_contraction(node):
            continue
        along = any(s.state is None and t.shape and (t.numel, t.shape[-1]) in shapes
                    for s, t in zip(node.sources, node.inputs))
        for ref in node.sources:
            info = graph.state.get(ref.state) if ref.state else None
            if info is None or info.is_buffer or len(info.tensor.shape) != 1:
                continue
            owner = ref.state.rpartition(".")[0]
            if (owner == node.module and node.module in modules) or (
                    along and owner == node.module and any(info.tensor.shape[0] == f for _, f in shapes)):
                found.add(ref.state)
    return found


def computed_from_state(nodes: list[Node]) -> dict[int, set[str]]:
    """Node id -> the parameters and buffers it is computed from, for the nodes of ``nodes`` computed from model
    state alone (Gemma's norms scale by ``1 + weight``, a cast of the weight first): such a value carries its
    parameters' gradients as the parameters themselves do."""
    found: dict[int, set[str]] = {}
    for node in nodes:
        names: set[str] = set()
        for ref in node.sources:
            if ref.state is not None:
                names.add(ref.state)
            elif ref.node in found:
                names |= found[ref.node]
            else:  # an activation or a model input
                break
        else:
            if names:
                found[node.id] = names
    return found


def _gather_unclosed(rows: dict[str, LayerCost], open_region: dict[int, frozenset[int]], closed: set[int]) -> None:
    """Columns no row-parallel op consumed gather their output in the forward; what reads it runs replicated."""
    unclosed = {c for layer in rows.values() for c in layer.columns} - closed
    if not unclosed:
        return
    for layer in rows.values():
        for node in layer.nodes:
            if node.id not in unclosed and node.id in layer.sharded and \
                    open_region.get(node.id, frozenset()) <= unclosed and \
                    not (_is_param_contraction(node) and node.id not in layer.columns):
                layer.sharded.discard(node.id)


@dataclass(frozen=True, slots=True)
class ExpertGroup:
    """A mixture's experts as expert parallelism moves their tokens: each rank holds ``experts`` / ep of them and
    sends every token-expert pair (``rows`` of ``row_bytes`` each, at the traced batch) to the rank holding its
    expert, and the result back (`experts_in`)."""

    module: str  # the experts module (its parameters are the experts', one matrix per expert along dim 0)
    experts: int
    params: int  # elements of the module's parameters
    rows: int  # token-expert pairs its grouped matmul multiplies, at the traced batch
    row_bytes: int  # bytes of one pair's hidden state


def experts_in(graph: Graph, nodes: list[Node]) -> list[ExpertGroup]:
    """The experts among ``nodes``: modules whose grouped matmul (``aten._grouped_mm``) reads a 3-D weight of
    their own, one matrix per expert (Hugging Face's experts, `transformers.integrations.moe`), priced by the first
    such matmul's token rows (the gate/up projection's input)."""
    found: dict[str, ExpertGroup] = {}
    for node in nodes:
        if not node.op.startswith("aten._grouped_mm.") or node.module in found or len(node.inputs[0].shape) != 2:
            continue
        owned = [s.state for s in node.sources if s.state is not None and s.state.rpartition(".")[0] == node.module]
        weights = [graph.state[fqn] for fqn in owned if fqn in graph.state and len(graph.state[fqn].tensor.shape) == 3]
        if not weights:
            continue
        own = [info for fqn, info in graph.state.items() if fqn.rpartition(".")[0] == node.module
               and not info.is_buffer]
        rows, width = node.inputs[0].shape
        found[node.module] = ExpertGroup(
            module=node.module, experts=weights[0].tensor.shape[0], params=sum(i.tensor.numel for i in own),
            rows=rows, row_bytes=node.inputs[0].nbytes // max(rows, 1))
    return list(found.values())
