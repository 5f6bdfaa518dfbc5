"""Intra-op cost of a ParallelBlock under one candidate: the terms of MAP §5.1 / CFP Eq. 7-9, priced analytically.

A candidate fixes how the block's leading op splits over each mesh axis; every other op of the block follows its
first in-block input (`_follow`): it keeps a sharded dim sharded when its dimension map lets it, passes a pending
Partial sum through when it is linear, reduce-scatters a Partial onto one of its free dims when it is not (the
Megatron-SP move; all-reduce when no dim divides), and gathers a dim it cannot split. What comes out, per micro-batch:

- compute: roofline time of the block's ops with their work split ``shard`` ways, forward and backward, memory-bound
  ops fused or not as ``kernels`` says (`compute.sequence_seconds`);
- conversions inside the block, forward and their backward (`sharding.LayoutCosts`), including the gradient
  all-reduce of a whole input consumed by split work (a column-parallel layer's input);
- activation bytes saved for backward and the largest single output, per device;
- the parameters it owns with their layout and the mesh axes over which their gradients are summed (data
  parallelism for that parameter: synchronised once per iteration, or sharded under ZeRO);
- the layouts it needs for values coming from other blocks (``entries``) and gives to the values it produces
  (``exits``): the search prices those pairs as resharding edges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.analysis import BlockGraph, Linearity, ParallelBlock, Split, op_dims
from autopar.analysis.dims import OpDims, is_piece, split_axis
from autopar.capture import Node
from autopar.cluster import Cluster, Collective, collective_seconds
from autopar.cluster.calls import CommCall, Phase
from autopar.cluster.mesh import Mesh
from autopar.cost.compute import sequence_seconds
from autopar.cost.memory import gradient_sync, op_transient
from autopar.sharding import (
    PASS,
    REPLICATE,
    Layout,
    LayoutCosts,
    Strategy,
    Transfer,
    apply,
)
from autopar.sharding.layout import Partial, StridedShard, is_shard, shard_of

# Values are named relative to the block so that blocks of one signature share one cost: ("out", position in the
# block, output index) for what it produces, ("in", position, input index) for a value it reads from another block,
# ("param", position, input index) for a parameter read at that use. `IntraCost.locate` turns them into node ids.
Key = tuple[str, int, int]
# leading op's iteration dim per mesh axis (None: replicated), and GATHERED last where the leading op's output is
# gathered to whole at once (a column-parallel layer with a whole output, as torch's ColwiseParallel with
# output_layouts=Replicate() gives it: Megatron's LM head, which no row-parallel layer follows)
Candidate = tuple[int | None | str, ...]
GATHERED = "gathered"
# or SCATTERED last where a whole leading op's output is handed on at once in the layout values arrive in between
# layers (``arrival``): under sequence parallelism, this rank's sequence shard of a multi-query attention's output
SCATTERED = "scattered"


@dataclass(frozen=True, slots=True)
class ParamUse:
    key: Key  # ("param", position, input index) of its first use in the block
    numel: int  # whole parameter
    local: float  # elements per device under the block's layout (before ZeRO)
    layout: Layout
    reduce_axes: tuple[int, ...]  # axes that hold it whole while splitting the work: its data-parallel axes


@dataclass(slots=True)
class BlockCost:
    compute_forward: float = 0.0
    compute_backward: float = 0.0
    comm_forward: float = 0.0
    comm_backward: float = 0.0
    saved: float = 0.0
    temporary: float = 0.0
    params: list[ParamUse] = field(default_factory=list)
    entries: dict[Key, tuple[Layout, Layout]] = field(default_factory=dict)  # value -> (layout needed, gradient)
    exits: dict[Key, Layout] = field(default_factory=dict)
    collectives: list[CommCall] = field(default_factory=list)  # per micro-batch, one call each, forward or backward
    # the same calls by conversion: (position of the op that needs it, the value converted as a key relative to the
    # block, layout needed, gradient layout, its calls)
    conversions: list[tuple[int, Key, Layout, Layout, tuple[CommCall, ...]]] = field(default_factory=list)
    conversion_forward: list[float] = field(default_factory=list)  # seconds of each conversion's forward
    strategies: dict[int, Strategy] = field(default_factory=dict)  # position in the block -> the op's strategy
    measured: float = 0.0  # seconds of compute (forward and backward) priced by the profile database's op times

    @property
    def seconds(self) -> float:
        return self.compute_forward + self.compute_backward + self.comm_forward + self.comm_backward

    def add(self, transfer: Transfer, position: int, value: Key, need: Layout, grad: Layout) -> None:
        """The conversion of ``value`` (named relative to the block, as every block of its signature names it) to
        ``need`` (its gradient from ``grad``) the op at ``position`` needs."""
        self.comm_forward += transfer.forward
        self.comm_backward += transfer.backward
        self.collectives.extend(transfer.collectives)
        self.conversions.append((position, value, need, grad, tuple(transfer.collectives)))
        self.conversion_forward.append(transfer.forward)


class IntraCost:
    """Prices blocks of one graph on one mesh; results are cached per block content and candidate."""

    def __init__(self, blocks: BlockGraph, mesh: Mesh, cluster: Cluster, *, like: IntraCost | None = None,
                 scatter_partials: bool = True, kernels: str = "eager",
                 arrival: Callable[[IntraCost, tuple[int, int]], Layout] | None = None, ops: Any = None,
                 traced_batch: int = 1, dtensor: bool = False) -> None:
        """``like``: the same model traced at another batch size. Its block signature classes and parameter owners
        carry over (blocks alike at one size are alike at every size), which skips every pass over all nodes.

        ``scatter_partials``: where an op cannot take a pending Partial sum, reduce-scatter it onto one of the op's
        free dims and run the op split (Megatron's sequence parallelism generalised), or, when False, all-reduce it
        to whole and run the op replicated (Megatron's tensor parallelism without SP, as the runtime applies it).
        ``kernels``: how memory-bound ops run (`compute.sequence_seconds`). ``arrival``: the layout a value made
        by another block arrives in, where the blocks' edges have one (the stream between a pipeline stage's
        layers, `cost.intra_layers`): an op before its block's leading op (a layer's pre-norm, `build_blocks`'s
        ``layers``) follows it; without one such an op runs whole. ``ops``: measured op times
        (`autopar.profiling.ops.OpTimes`) that price the ops they hold instead of the roofline, the graph traced at
        ``traced_batch`` samples. ``dtensor``: price the ops as DTensor runs them (`autopar.runtime.intra`): a
        split into pieces (``split``, ``chunk``) of a dim that is sharded gathers it first (DTensor cuts the
        whole tensor's pieces), where Megatron's runtime lays a fused weight out per piece and splits freely."""
        self.scatter_partials = scatter_partials
        self.arrival = arrival
        self.bg = blocks
        self.kernels = kernels
        self.ops, self.traced_batch, self.dtensor = ops, traced_batch, dtensor
        self.nodes = _NodeView(blocks.graph)  # node by id; a deep graph's list is not built for this
        self.state = like.state if like is not None else blocks.graph.state  # parameters do not depend on batch
        self.mesh = mesh
        self.sizes = mesh.sizes
        self.cluster = cluster
        self.layouts = LayoutCosts(mesh, cluster)
        self.param_owner = like.param_owner if like is not None else self._param_owners()
        self.branch: frozenset[int] = like.branch if like is not None else frozenset().union(
            *(block.branch for block in blocks.blocks))
        self.signatures: list[int] = like.signatures if like is not None else self._signature_classes()
        self._cache: dict[tuple[int, Candidate], BlockCost | None] = {}
        self._downstream: dict[int, set[int]] = {}
        self._whole: frozenset[int] | None = None
        self._scattered: frozenset[int] | None = None

    # ---- candidates ---------------------------------------------------------------------------------------
    def candidates(self, block: ParallelBlock) -> list[Candidate]:
        """Splits of the leading op's dims over the mesh axes that divide evenly (CFP's candidate partitions). A
        leading op that reads no batch (a position table's lookup of the positions ``arange`` makes) may also run
        whole on every device, as data parallelism runs it: its work does not grow with the batch."""
        leader = self.nodes[block.leader]
        dims = op_dims(leader)
        splittable = [k for k, d in enumerate(dims.dims) if d.split is not Split.FIXED]
        found: list[Candidate] = [()]
        for _ in self.sizes:
            found = [c + (k,) for c in found for k in [*splittable, None]]
        valid = [c for c in found if apply(dims, c, leader.inputs, leader.outputs, self.sizes) is not None]
        split = [c for c in valid if all(k is not None for k in c)]
        if split:  # and whole on one axis (Megatron keeps embeddings and tied heads whole over tp)
            whole = [c for c in valid if sum(k is None for k in c) == 1]
            if self.roles(block)["batch"] is None and len(self.sizes) > 1 and (None,) * len(self.sizes) in valid:
                whole.append((None,) * len(self.sizes))
            return split + whole
        best = max((sum(k is not None for k in c) for c in valid), default=0)
        return [c for c in valid if sum(k is not None for k in c) == best] or [(None,) * len(self.sizes)]

    def roles(self, block: ParallelBlock) -> dict[str, int | None]:
        """The leading op's batch dim (at its activation input's dim 0), output-feature dim and contracted dim."""
        leader = self.nodes[block.leader]
        act = next((j for j, s in enumerate(leader.sources) if s.state is None), None)
        roles: dict[str, int | None] = {"batch": None, "column": None, "row": None}
        for k, d in enumerate(op_dims(leader).dims):
            if d.split is Split.FIXED:
                continue
            in_act = act is not None and d.inputs[act] is not None
            if in_act and d.inputs[act] == 0 and d.split is Split.FREE and roles["batch"] is None:
                roles["batch"] = k
            elif not in_act and d.split is Split.FREE and roles["column"] is None:
                roles["column"] = k
            elif d.split is Split.PARTIAL and roles["row"] is None:
                roles["row"] = k
        return roles

    def megatron(self, blocks: Iterable[ParallelBlock]) -> list[tuple[Candidate, Candidate]]:
        """Megatron-LM's layout of ``blocks`` (in execution order) as the runtime applies it, per block the
        candidate and its fallback. On the mesh's last axis (tp): a contraction reading a column-parallel block's
        output is row-parallel (its contracted dim split), any other contraction column-parallel (its output
        features split), except an embedding, a convolution and a contraction whose weight another module owns (a
        head tied to the embedding), a router or a multi-query attention's (`cost.layers.kept_whole`), which stay
        whole. The other axes split the batch. The fallback splits the batch on every axis (a layer Megatron cannot
        split stays data-parallel)."""
        from autopar.cost.layers import kept_whole, multi_query_outputs

        if self._whole is None:
            self._whole = kept_whole(self.bg.graph)
            self._scattered = multi_query_outputs(self.bg.graph) if self.scatter_partials and self.arrival else \
                frozenset()
        column: dict[int, bool] = {}
        last_row = -1  # the last row-parallel block's place
        found = []
        blocks = list(blocks)
        for block in blocks:
            roles = self.roles(block)
            leader = self.nodes[block.leader]
            source = next((s.node for s in leader.sources if s.state is None and s.node >= 0), None)
            producer = None if source is None else self.bg.owner[source]
            # row-parallel where it reads what a column-parallel block computed from its split output (not what
            # the block's ops before its leading op made: a layer's pre-norm, which q, k and v all read)
            is_row = producer is not None and producer != block.id and column.get(producer, False) \
                and source in self._after_leader(self.bg.blocks[producer])
            whole = "embedding" in leader.op or "convolution" in leader.op or block.leader in self._whole or any(
                s.state is not None and self._is_param(s.state) and self.param_owner.get(s.state) != block.id
                for s in leader.sources)
            column[block.id] = not (is_row or whole)
            if is_row and not whole:
                last_row = len(found)
            last = None if whole else roles["row"] if is_row else roles["column"]
            batch = (roles["batch"],) * (len(self.sizes) - 1)
            scattered = (SCATTERED,) if block.leader in self._scattered else ()
            found.append(((*batch, last, *scattered), (roles["batch"],) * len(self.sizes)))
        # a column-parallel block no row-parallel one follows gathers its output at once (the runtime's LM head)
        return [((*wanted, GATHERED), fallback) if column[block.id] and k > last_row else (wanted, fallback)
                for k, (block, (wanted, fallback)) in enumerate(zip(blocks, found))]

    def _after_leader(self, block: ParallelBlock) -> set[int]:
        """The ops of ``block`` computed from its leading op's output."""
        found = self._downstream.get(block.id)
        if found is None:
            found = self._downstream[block.id] = {block.leader}
            for i in block.nodes:
                if i > block.leader and i not in block.branch and any(
                        s.state is None and s.node in found for s in self.nodes[i].sources):
                    found.add(i)
        return found

    def describe(self, block: ParallelBlock, candidate: Candidate) -> str:
        """``"n"`` on a 1-D mesh, ``"m,n"`` on 2-D: the leading op's dim (by role) each axis splits."""
        dims = op_dims(self.nodes[block.leader]).dims
        marker = {GATHERED: ">R", SCATTERED: ">S"}.get(candidate[-1], "") if candidate else ""
        axes = candidate[:-1] if marker else candidate
        return ",".join("R" if k is None else (dims[k].name or str(k)) for k in axes) + marker

    # ---- block cost ---------------------------------------------------------------------------------------
    def signature(self, block: ParallelBlock) -> int:
        """Class of blocks that cost the same (see `_signature`)."""
        return self.signatures[block.id]

    def _signature_classes(self) -> list[int]:
        ids: dict[tuple, int] = {}
        return [ids.setdefault(self._signature(block), len(ids)) for block in self.bg.blocks]

    def _signature(self, block: ParallelBlock) -> tuple:
        """What a block's cost depends on: its ops, shapes and arguments, where each input comes from relative
        to the block, and which parameters it owns."""
        base = block.nodes[0]
        parts = []
        for i in block.nodes:
            node = self.nodes[i]
            sources = []
            for s in node.sources:
                if s.state is not None:
                    sources.append(("p", self.param_owner.get(s.state) == block.id, self._is_param(s.state)))
                elif s.node < 0:
                    sources.append(("in",))
                elif self.bg.owner[s.node] == block.id:
                    sources.append((s.node - base, s.index))
                else:
                    sources.append(("x", s.index, self.bg.activation[s.node] and s.node not in self.branch))
            parts.append((node.op, node.inputs, node.outputs, node.args, i in block.branch, tuple(sources)))
        return (block.leader - base, tuple(parts))

    def block_cost(self, block: ParallelBlock, candidate: Candidate) -> BlockCost | None:
        """Cost of ``block`` under ``candidate`` (None if the candidate does not apply); keys are relative to
        the block (see `Key`), so every block of one signature shares the result."""
        key = (self.signature(block), candidate)
        if key not in self._cache:
            self._cache[key] = self._evaluate(block, candidate)
        return self._cache[key]

    def _evaluate(self, block: ParallelBlock, candidate: Candidate) -> BlockCost | None:
        cost = BlockCost()
        marker = candidate[-1] if candidate and candidate[-1] in (GATHERED, SCATTERED) else None
        gathered, scattered = marker == GATHERED, marker == SCATTERED and self.arrival is not None
        axes = candidate[:-1] if marker else candidate
        position = {i: pos for pos, i in enumerate(block.nodes)}
        versions: dict[tuple[int, int], dict[Layout, None]] = {}  # layouts a value is available in, in the block
        named: dict[tuple[int, int], Key] = {}  # a value read from another block -> the key of its first read
        priced: list[tuple[Node, float]] = []  # the block's nodes with their shard, priced together at the end
        for i in block.nodes:
            node = self.nodes[i]
            if i in block.branch:  # on parameters, buffers or model inputs alone: whole on every device
                priced.append((node, 1))
                cost.saved += node.saved_bytes
                continue
            dims = self._dims(node)
            if i == block.leader:
                strategy = apply(dims, axes, node.inputs, node.outputs, self.sizes)
                if strategy is None:
                    return None
            else:
                strategy = self._follow(node, versions)
            cost.strategies[position[i]] = strategy
            for j, (src, info) in enumerate(zip(node.sources, node.inputs)):
                need, grad = strategy.inputs[j], strategy.gradients[j]
                if src.state is not None:
                    self._param_input(cost, block, ("param", position[i], j), src.state, node, j, need, grad)
                    continue
                if src.node >= 0 and src.node in self.branch and self.dtensor:
                    # a weight the model transforms before use (Gemma's norm multiplies by ``1 + weight.float()``):
                    # its gradient is the one this read gets, pending where that is
                    found = self._branch_param(src.node)
                    if found is not None and found[0] in position:
                        leaf, k, fqn = found
                        self._param_input(cost, block, ("param", position[leaf], k), fqn, node, j, need, grad)
                    continue
                if src.node < 0 or src.node in self.branch or (not self.bg.activation[src.node] and not self.dtensor):
                    continue  # model inputs and values made from them or from parameters alone (any block's input
                    # branches) are produced in any layout; but under DTensor a value a block's leading op made
                    # from parameters alone (GPT-2's position lookup) is in that op's layout, which DTensor converts
                    # like any other, its gradient too
                value = (src.node, src.index)
                if self.bg.owner[src.node] != block.id and value not in versions:
                    cost.entries[("in", position[i], j)] = (need, grad)
                    named[value] = ("in", position[i], j)
                    versions[value] = {need: None}
                    continue
                key = named.get(value) or ("out", position[src.node], src.index)
                self._convert(cost, versions[value], info, need, grad, position[i], key)
            for o, layout in enumerate(strategy.outputs):
                versions[(i, o)] = {layout: None}
                cost.exits[("out", position[i], o)] = layout
            if i == block.leader and self.dtensor and _masked_lookup(node, strategy):
                # a lookup in a table split by rows: DTensor can only sum its masked pending sum whole, which the
                # runtime does at once (`runtime.intra._reduce_masked_lookups`); its gradient arrives whole
                whole = tuple(REPLICATE if isinstance(p, Partial) else p for p in strategy.outputs[0])
                self._hand_on_at_once(cost, versions, node, position[i], whole)
            if i == block.leader and gathered:  # its output whole at once; its gradient a slice of a whole one
                self._hand_on_at_once(cost, versions, node, position[i], (REPLICATE,) * len(self.sizes))
            if i == block.leader and scattered:  # its output handed on in the layout between layers at once
                # a (tokens, features) output: its tokens split as its input's, behind whose views the batch shows
                read = next(((s.node, s.index) for s in node.sources if s.state is None and s.node >= 0), None)
                flat = len(node.outputs[0].shape) == 2 and read is not None
                self._hand_on_at_once(cost, versions, node, position[i], self.arrival(self, read if flat else (i, 0)))
            priced.append((node, strategy.shard))
            cost.saved += node.saved_bytes * self._saved_fraction(node, strategy, dims.contraction)
            if strategy.outputs:  # its backward: the gradients of its output and of its activation inputs
                cost.temporary = max(cost.temporary, op_transient(
                    node, outputs=[self.ways(layout) for layout in strategy.outputs],
                    inputs=[self.ways(layout) for layout in strategy.gradients]))
        if self.dtensor:
            self._hand_on_converted(block, cost)
        tally = [0.0, 0.0]
        cost.compute_forward, cost.compute_backward = sequence_seconds(
            priced, self.cluster.device, kernels=self.kernels, ops=self.ops, traced_batch=self.traced_batch,
            tally=tally)
        dispatch = self.ops.dispatch if self.ops is not None else None
        if dispatch is not None:  # DTensor's own work around every op the runtime runs through it, as measured
            forward = dispatch[0] * len(priced)
            backward = dispatch[1] * sum(1 for node, _ in priced if not node.is_view)
            cost.compute_forward += forward
            cost.compute_backward += backward
            tally[0], tally[1] = tally[0] + forward, tally[1] + backward
        cost.measured = tally[0] + tally[1]
        return cost

    def _hand_on_at_once(self, cost: BlockCost, versions: dict[tuple[int, int], dict[Layout, None]], node: Node,
                         pos: int, target: Layout) -> None:
        """The leading op ``node`` (at ``pos`` in its block) hands its output on in ``target`` at once, its gradient
        arriving in it too: the conversion priced there, the only layout the block and the blocks after it read."""
        self._convert(cost, versions[(node.id, 0)], node.outputs[0], target, target, pos, ("out", pos, 0))
        versions[(node.id, 0)] = {target: None}
        cost.exits[("out", pos, 0)] = target

    def _branch_param(self, node_id: int) -> tuple[int, int, str] | None:
        """The parameter an input-branch value is computed from alone, through ops of that one tensor (a cast, a
        scalar added, a view), as (the op that reads it, the input it reads it at, its FQN); None for any other
        value."""
        while True:
            node = self.nodes[node_id]
            tensors = [(k, s) for k, s in enumerate(node.sources) if s.state is not None or s.node >= 0]
            if len(tensors) != 1:
                return None
            k, source = tensors[0]
            if source.state is not None:
                return (node_id, k, source.state) if self._is_param(source.state) else None
            if source.node not in self.branch:
                return None
            node_id = source.node

    def handed_on(self, block: ParallelBlock, cost: BlockCost) -> tuple[int, Layout | None] | None:
        """The position in ``block`` of the last op of its leading module (whose output the module hands on), and
        the one layout the block converts that output to (None where it converts it to none, or to several); None
        where the module has no op in the block."""
        module = self.nodes[block.leader].module
        positions = [p for p, i in enumerate(block.nodes) if self.nodes[i].module == module]
        if not positions:
            return None
        last = max(positions)
        needs = {tuple(need) for _, value, need, _, calls in cost.conversions if value == ("out", last, 0) and calls}
        return last, (needs.pop() if len(needs) == 1 else None)

    def leading_edges(self, block: ParallelBlock, cand: Candidate) -> tuple[Layout, Layout]:
        """The layout the leading op of ``block`` under ``cand`` reads its activation in (the input that is no
        parameter: a lookup's indices may be a buffer, BERT's position ids), and the layout its module hands its
        output on in: where the block converts that output to one layout before anything else reads it (a
        row-parallel projection's pending sum reduce-scattered onto the sequence), that layout; else the layout the
        module's last op in the block makes it in (the leading op's, where the module ends in another block). What
        the runtime converts the module's input and output to (`autopar.runtime.intra`)."""
        cost = self.block_cost(block, cand)
        leader = self.nodes[block.leader]
        strategy = cost.strategies[block.nodes.index(block.leader)]
        act = next((j for j, s in enumerate(leader.sources) if s.state is None or not self._is_param(s.state)), 0)
        output = tuple(strategy.outputs[0])
        found = self.handed_on(block, cost)
        if found is not None:
            last, converted = found
            made = cost.strategies.get(last)
            if converted is not None:
                output = tuple(converted)
            elif made is not None and made.outputs:
                output = tuple(made.outputs[0])
        return tuple(strategy.inputs[act]), output

    def _hand_on_converted(self, block: ParallelBlock, cost: BlockCost) -> None:
        """Where the block converts its leading module's output to one layout (`handed_on`), the runtime converts
        it as the module hands it on (`runtime.intra._hook_inputs`), so other blocks read it in that layout: its
        exit (the layout `search.intra` records as the module's output)."""
        found = self.handed_on(block, cost)
        if found is not None and found[1] is not None and ("out", found[0], 0) in cost.exits:
            cost.exits[("out", found[0], 0)] = found[1]

    def _convert(self, cost: BlockCost, have: dict[Layout, None], info, need: Layout, grad: Layout,  # noqa: ANN001
                 position: int, value: Key) -> None:
        if need in have and grad == need:
            return
        itemsize = info.nbytes // max(info.numel, 1)
        best = min((self.layouts.convert(info.shape, itemsize, src, need, grad) for src in have), key=lambda t: t.seconds)
        cost.add(best, position, value, need, grad)
        have[need] = None

    def _param_input(
        self, cost: BlockCost, block: ParallelBlock, key: Key, fqn: str, node: Node, j: int, need: Layout, grad: Layout
    ) -> None:
        if not self._is_param(fqn):
            return  # buffers (rotary tables, masks) are cheap to hold whole or sliced anywhere
        layout = self._to_param_layout(node.sources[j], need)
        if self.param_owner.get(fqn) != block.id:  # a tied parameter: converted from its owner's layout
            cost.entries[key] = (layout, self._to_param_layout(node.sources[j], grad, keep_partial=True))
            return
        if any(self.locate(block, p.key) == fqn for p in cost.params):
            return
        numel = self.state[fqn].tensor.numel
        reduce_axes = tuple(a for a, p in enumerate(grad) if isinstance(p, Partial))
        cost.params.append(ParamUse(key, numel, numel / self.ways(layout), layout, reduce_axes))
        cost.exits[key] = layout

    def _to_param_layout(self, source, need: Layout, *, keep_partial: bool = False) -> Layout:  # noqa: ANN001
        """Map a layout needed at a use of a parameter back through its view chain (transpose, reshape) to the
        layout of the stored parameter; Partial (a bias in a row-parallel layer) is stored whole, but kept with
        ``keep_partial`` (a gradient)."""
        layout = need if keep_partial else tuple(REPLICATE if isinstance(p, Partial) else p for p in need)
        while source.node >= 0:
            node = self.nodes[source.node]
            dims = op_dims(node)
            mapped = []
            for p in layout:
                if is_shard(p):
                    k = next((k for k, d in enumerate(dims.dims) if d.outputs and d.outputs[0] == p.dim
                              and d.output_stride(0) == _stride(p)), None)
                    d_in = dims.dims[k].inputs[0] if k is not None else None
                    mapped.append(shard_of(d_in, dims.dims[k].input_stride(0)) if d_in is not None else REPLICATE)
                else:
                    mapped.append(p)
            layout = tuple(mapped)
            source = node.sources[0]
        return layout

    def _dims(self, node: Node) -> OpDims:
        """``node``'s dims (`analysis.dims.op_dims`), as DTensor splits them where ``dtensor``."""
        dims = op_dims(node)
        if self.dtensor and "scaled_dot_product" in node.op:
            # DTensor's rule for the fused attention splits batch and heads only (`runtime.intra.attention_rules`;
            # query rows split alone would need the causal mask moved with them): its query rows run whole
            return replace(dims, dims=tuple(replace(d, split=Split.FIXED) if d.name == "seq" else d for d in dims.dims))
        if self.dtensor and is_piece(node) and node.inputs:  # `dims._slice` splits these freely
            axis = split_axis(node)
            return replace(dims, dims=tuple(replace(d, split=Split.FIXED) if d.inputs and d.inputs[0] == axis else d
                                            for d in dims.dims))
        return dims

    def _follow(self, node: Node, versions: dict[tuple[int, int], dict[Layout, None]]) -> Strategy:
        """A non-leading op's strategy from its first in-block input (see the module docstring)."""
        dims = self._dims(node)
        primary = next(
            (j for j, s in enumerate(node.sources) if s.state is None and (s.node, s.index) in versions), None
        )
        if primary is not None:
            src = node.sources[primary]
            have = _settled(versions[(src.node, src.index)])
        else:  # it reads only values from other blocks: the layout the first arrives in, where they have one
            primary = next((j for j, s in enumerate(node.sources)
                            if s.state is None and s.node >= 0 and self.bg.activation[s.node]), None)
            if primary is None or self.arrival is None:
                return apply(dims, (None,) * len(self.sizes), node.inputs, node.outputs, self.sizes)  # type: ignore[return-value]
            src = node.sources[primary]
            have = self.arrival(self, (src.node, src.index))
        assignment: list = []
        for axis, p in enumerate(have):
            if is_shard(p):
                k = dims.dim_at_input(primary, p.dim, _stride(p))
                assignment.append(k if k is not None and dims.dims[k].split is not Split.FIXED else None)
            elif isinstance(p, Partial):
                assignment.append(self._partial_choice(node, dims, primary, versions, axis))
            else:
                assignment.append(None)
        strategy = apply(dims, tuple(assignment), node.inputs, node.outputs, self.sizes)
        while strategy is None:  # drop splits that do not divide, innermost axis first
            last = max(a for a, k in enumerate(assignment) if k is not None)
            assignment[last] = None
            strategy = apply(dims, tuple(assignment), node.inputs, node.outputs, self.sizes)
        return strategy

    def _partial_choice(self, node: Node, dims, primary: int, versions, axis: int):  # noqa: ANN001, ANN202
        """Pass a Partial through a linear op when its other inputs allow; else reduce-scatter onto a free dim."""
        if dims.linearity is Linearity.FIRST and primary == 0:
            others = [self._current(versions, s, axis) for s in node.sources[1:] if s.node >= 0 and s.state is None]
            if not any(isinstance(p, Partial) for p in others):
                return PASS
        if dims.linearity is Linearity.ALL:
            float_inputs = [
                (s, t) for s, t in zip(node.sources, node.inputs) if t.dtype.startswith(("float", "bfloat"))
            ]
            if all(isinstance(self._current(versions, s, axis), Partial) for s, _ in float_inputs):
                return PASS
        if not self.scatter_partials:
            return None
        n = self.sizes[axis]
        free = [k for k, d in enumerate(dims.dims)
                if d.split is Split.FREE and d.inputs[primary] is not None and d.size % n == 0]
        # the sequence first (the dim before the features: Megatron's sequence parallelism), then any other
        sequence = len(node.inputs[primary].shape) - 2
        free.sort(key=lambda k: dims.dims[k].inputs[primary] != sequence)
        return free[0] if free else None

    def _current(self, versions, source, axis: int):  # noqa: ANN001, ANN202
        if source.state is not None or source.node < 0:
            return REPLICATE
        have = versions.get((source.node, source.index))
        return _settled(have)[axis] if have else REPLICATE

    # ---- helpers ------------------------------------------------------------------------------------------
    def ways(self, layout: Layout) -> int:
        """Devices a value in ``layout`` is split over."""
        return math.prod(n for p, n in zip(layout, self.sizes) if is_shard(p))

    def saved_fraction(self, node: Node, strategy: Strategy) -> float:
        """The share of what ``node`` saves for backward that one device keeps under ``strategy``."""
        return self._saved_fraction(node, strategy, op_dims(node).contraction)

    def _saved_fraction(self, node: Node, strategy: Strategy, contraction: bool) -> float:
        if contraction:  # a contraction saves its activation inputs
            acts = [j for j, s in enumerate(node.sources) if s.state is None]
            if acts:
                return sum(1 / self.ways(strategy.inputs[j]) for j in acts) / len(acts)
        return 1 / self.ways(strategy.outputs[0]) if strategy.outputs else 1.0

    def _is_param(self, fqn: str) -> bool:
        info = self.state.get(fqn)
        return info is not None and not info.is_buffer and info.requires_grad

    def _param_owners(self) -> dict[str, int]:
        owners: dict[str, int] = {}
        for block in self.bg.blocks:
            for i in block.nodes:
                for s in self.nodes[i].sources:
                    if s.state is not None and s.state not in owners:
                        owners[s.state] = block.id
        return owners

    def value_info(self, value: tuple[int, int] | str):  # noqa: ANN201
        """Shape, dtype and bytes of a node output (node id, index) or a parameter (FQN)."""
        if isinstance(value, str):
            return self.state[value].tensor
        return self.nodes[value[0]].outputs[value[1]]

    def convert(self, value: tuple[int, int] | str, have: Layout, need: Layout, grad: Layout | None) -> Transfer:
        """Converting ``value`` from ``have`` to ``need`` (and its gradient back from ``grad``)."""
        info = self.value_info(value)
        return self.layouts.convert(info.shape, info.nbytes // max(info.numel, 1), have, need, grad)

    def transfer(self, block: ParallelBlock, key: Key, producer: ParallelBlock, pc: Candidate,
                 cc: Candidate) -> Transfer | None:
        """The conversion of the value ``block`` reads at ``key`` from ``producer`` (under ``pc``) to ``block``
        (under ``cc``); None if either candidate does not apply."""
        produced, consumed = self.block_cost(producer, pc), self.block_cost(block, cc)
        if produced is None or consumed is None:
            return None
        value = self.locate(block, key)
        have = produced.exits.get(self._exit_key(producer, value, produced))
        if have is None:
            return None
        need, grad = consumed.entries[key]
        if isinstance(value, str) and grad is not None:
            # a weight read by another block than its owner's (a head tied to the embedding): the pending sums of
            # its gradient over the owner's data-parallel axes join the owner's in the gradient synchronisation
            # (`sync_seconds`), as the runtime adds both uses' gradients before reducing them once
            use = next(p for p in produced.params if self.locate(producer, p.key) == value)
            grad = tuple(REPLICATE if isinstance(g, Partial) and a in use.reduce_axes else g
                         for a, g in enumerate(grad))
        return self.convert(value, have, need, grad)

    def _exit_key(self, producer: ParallelBlock, value: tuple[int, int] | str, cost: BlockCost) -> Key | None:
        if isinstance(value, str):  # a parameter: its owner's use
            return next((p.key for p in cost.params if self.locate(producer, p.key) == value), None)
        node, index = value
        return ("out", producer.nodes.index(node), index)

    def origin(self, value: tuple[int, int] | str) -> tuple:
        """A value named by what it views and its own shape: two views of one tensor to one shape (each linear
        layer flattening the same input) are one value, converted once for all its readers."""
        if isinstance(value, str):
            return (value,)
        node_id, index = value
        shape = self.nodes[node_id].outputs[index].shape
        while node_id >= 0 and self.nodes[node_id].is_view:
            source = self.nodes[node_id].sources[0]
            if source.state is not None:
                break
            node_id, index = source.node, source.index
        return (node_id, index, shape)

    def locate(self, block: ParallelBlock, key: Key) -> tuple[int, int] | str:
        """The node output (node id, index), or the parameter FQN, that a relative key names in ``block``."""
        kind, pos, index = key
        node = self.nodes[block.nodes[pos]]
        if kind == "out":
            return (node.id, index)
        source = node.sources[index]
        return source.state if kind == "param" else (source.node, source.index)  # type: ignore[return-value]


def _stride(p) -> int:  # noqa: ANN001
    return p.split_factor if isinstance(p, StridedShard) else 1


def _settled(versions: dict[Layout, None]) -> Layout:
    """The layout an op follows among those a value is available in: once a pending Partial sum has been reduced
    (for an earlier consumer), later consumers read the reduced version rather than reducing it again."""
    reduced = [layout for layout in versions if not any(isinstance(p, Partial) for p in layout)]
    return reduced[-1] if reduced else next(iter(versions))


class _NodeView:
    def __init__(self, graph) -> None:  # noqa: ANN001
        self.graph = graph

    def __getitem__(self, node_id: int) -> Node:
        return self.graph.node(node_id)


def sync_seconds(
    params: list[ParamUse], *, zero: int, micro_batches: int, itemsize: int, mesh: Mesh, cluster: Cluster,
    uses: list[CommCall] | None = None, latency: bool = True,
) -> float:
    """Gradient synchronisation per iteration for the parameters listed: all-reduce over their data-parallel
    axes (ZeRO 0), reduce-scatter + all-gather (ZeRO 1-2), or per micro-batch two all-gathers and a
    reduce-scatter (ZeRO 3, FSDP). Under ZeRO 1-2 a gradient reduced over several axes is scattered over them in
    turn, axis by axis in order, each on the shard the axes before it left (and the weights gathered back the
    other way): its optimizer state is split over all of them, as `model_states` counts it. Otherwise the
    gradients reduced over one axis go in one collective under ZeRO 0-2, as DDP's buckets and the runtime's
    flattened sum of sequence-parallel norm gradients send them (bucket latency once, not once per parameter),
    except ZeRO 2's reduce-scatters: each gradient on its own, as soon as the backward makes it, in every
    micro-batch (so that only one is whole at a time), paying its own latency; ZeRO 3 gathers (twice per
    micro-batch) and scatters each parameter on its own, nested over its axes as ZeRO 1-2. Without ``latency`` the
    buckets' fixed cost (a collective of no bytes) is left out: a block's share of the model's buckets, additive
    over blocks as the ILP needs it. Records each collective (its calls an iteration, on its mesh axis by name) in
    ``uses`` when given."""
    total = 0.0
    buckets: dict[tuple[str, int, int], float] = {}
    for p in params:
        nbytes = p.local * itemsize
        for axis in p.reduce_axes:
            # ZeRO 1-3 nest: each axis scatters (and gathers) the shard the axes before it left; ZeRO 0 sums it whole
            moved = nbytes / math.prod(mesh.sizes[a] for a in p.reduce_axes if a < axis) if zero else nbytes
            for kind, count in gradient_sync(zero, micro_batches):
                # weight by weight: ZeRO 3's collectives (`autopar.runtime.intra._ZeroShards`) and ZeRO 2's
                # reduce-scatters (each gradient once made); the others in one bucket per axis
                if zero == 3 or (zero == 2 and kind == Collective.REDUCE_SCATTER):
                    total += count * collective_seconds(kind, moved, mesh.placements[axis], cluster)
                    if uses is not None:
                        uses.append(CommCall(kind=kind, axis=mesh.names[axis], bytes=moved, phase=Phase.SYNC,
                                             calls=count))
                    continue
                buckets[(kind, axis, count)] = buckets.get((kind, axis, count), 0.0) + moved
    for (kind, axis, count), nbytes in buckets.items():
        total += count * collective_seconds(kind, nbytes, mesh.placements[axis], cluster)
        if not latency:
            total -= count * collective_seconds(kind, 0.0, mesh.placements[axis], cluster)
        if uses is not None:
            uses.append(CommCall(kind=kind, axis=mesh.names[axis], bytes=nbytes, phase=Phase.SYNC, calls=count))
    return total


def zero_ways(param: ParamUse, sizes: tuple[int, ...]) -> int:
    return math.prod(sizes[a] for a in param.reduce_axes)


def _masked_lookup(node: Node, strategy: Strategy) -> bool:
    """Whether ``node`` is an embedding lookup whose output ``strategy`` leaves a pending sum (its table split by
    rows)."""
    return node.op.startswith("aten.embedding.") and bool(strategy.outputs) and any(
        isinstance(p, Partial) for p in strategy.outputs[0])
