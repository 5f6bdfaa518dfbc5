"""The block model of a pipeline stage's rows on its tp axis: the one cost model of a layer, every layout an
assignment of it.

Each profile row (a repeated layer, the embedding, the head, the loss) is priced by its own ops as the blocks they
belong to lay them out (`analysis.blocks`, `cost.intra`): each op's work split as its block's strategy splits it,
what it saves and its largest output likewise, and the conversions each op needs (`row_prices`). Megatron's tensor
parallelism is one assignment of the blocks (`IntraCost.megatron`: column-parallel, then row-parallel, an LM head
column-parallel and gathered at once, embeddings and tied heads whole; Megatron-LM's vocabulary split as an option,
`cost.vocab`); tp 1 is the same model on an axis of one device, where nothing splits or moves. So `autopar
estimate`, the Megatron grid, the pipeline searches, the intra-op layouts below and the baselines price every row
through this one model.

The blocks keep the repeated layers' edges (`build_blocks(layers=...)`): a layer's pre-norm opens its first block.
Between layers the stream is in one layout on each tp device, as Megatron and the stage boundary have it: whole, or
split by sequence under sequence parallelism, as Megatron-SP and the runtime have it (`_between`): a value leaving a
repeated layer, or read by one, is converted to it where it leaves, and arrives in it (the stream scattered where
the embedding hands it to the first layer, gathered where a whole head reads it after the last). Around the layers
a value crosses between rows in the layout it was made in. A value several ops of one module need in one layout (q,
k and v of one input) is converted once, as the runtime converts it.

A stage may lay each repeated layer out block by block instead of Megatron's way: every ParallelBlock's leading op
splits over the tp axis by any of its candidates (`cost.intra`: rows of the batch or sequence, output features, the
contracted dim, attention heads, experts), and the values between blocks are converted where the layouts differ
(`sharding.layout`). Batch-splitting a small layer, say, trades Megatron's activation all-reduces for a gradient
all-reduce over tp once an iteration. As the stream between layers has one layout, each layer's layout is chosen on
its own: the intra-op ILP over the layer's blocks, solved exactly (all assignments at once with numpy for a layer
of a few blocks, `search.ilp.solve` with HiGHS beyond):

    minimise   sum_b c_b(x_b) + sum_(u,v) e_uv(x_u, x_v) + sync(x) / m
    subject to states(x) + in_flight * saved(x) <= the same for Megatron's layout

with ``c_b`` the block's compute and its conversions (scaled to the stage's samples per device), the conversion
of each value entering the layer from that layout and of each value leaving it back to it, ``e_uv`` the
conversions between the layer's blocks, and ``sync`` the gradient all-reduce over tp of weights a layout keeps
whole while splitting their work, plus their share of the data-parallel synchronisation. The memory bound keeps a
stage that fits under Megatron's layout fitting. A layout is used only where its row's price is faster than
Megatron's by the same terms; otherwise the layer stays Megatron's.

The planner traces once at batch 1 and scales, so a split of the batch dim alone (an attention core by samples)
is not among the candidates there; splits of the tokens of a flattened (batch x sequence) matmul are.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from autopar.analysis import ParallelBlock, build_blocks
from autopar.cluster import Collective, collective_seconds
from autopar.cluster.calls import CommCall, Phase, merge_calls
from autopar.cluster.mesh import AxisPlacement, Mesh
from autopar.cost.compute import node_seconds, sequence_seconds
from autopar.cost.intra import Candidate, IntraCost, ParamUse
from autopar.cost.memory import gradient_itemsize, gradient_sync, model_states, op_transient
from autopar.cost.vocab import vocabulary_split
from autopar.sharding import REPLICATE, short_layout
from autopar.sharding.layout import Shard, shard_of

if TYPE_CHECKING:
    from collections.abc import Iterator

    from autopar.capture.graph import Node
    from autopar.cost.pipeline import LayerPrice, PipelineModel
    from autopar.sharding.strategies import Strategy

_WHOLE = (REPLICATE,)
_DENSE = 1 << 16  # layers with at most this many assignments are solved by enumeration, larger ones by HiGHS


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """A repeated layer's blocks laid out on a stage's tp axis, with its price per micro-batch on one device."""

    splits: tuple[tuple[str, str], ...]  # (leading op's module, its split as `IntraCost.describe` names it)
    prices: dict  # recompute level -> LayerPrice
    reduced: float  # parameters (per device) kept whole over tp while their work splits: gradients summed over tp
    params: tuple[tuple[str, str], ...] = ()  # (parameter inside the layer, its layout on tp: S(0), S(1), R)
    choice: tuple[Candidate, ...] = ()  # per block, the candidate chosen
    reduced_tensors: int = 0  # how many tensors ``reduced`` counts the elements of


@dataclass(frozen=True, slots=True)
class Terms:
    """One layer's layout problem: its blocks, their candidates, and the ILP's arrays (`search.ilp`)."""

    blocks: list[ParallelBlock]
    candidates: list[list[Candidate]]
    costs: list[np.ndarray]
    memory: list[np.ndarray]
    edges: list


@dataclass(frozen=True, slots=True)
class Conditions:
    """What a layer's layout is chosen for (besides the layer and the stage's tp axis)."""

    samples: float  # samples of a micro-batch per device
    dp: int
    dp_axis: AxisPlacement
    zero: int
    micro_batches: int
    in_flight: float
    sp: bool = False  # between layers the stream is split by sequence, not whole


@dataclass(slots=True)
class _Part:
    """One block under one candidate, scaled: compute, conversions (one call each on tp, forward or backward),
    memory."""

    forward: float
    backward: float
    # per conversion: (position of the op it runs at, what it converts or None, its calls); what it converts is
    # (the value as a key relative to the block, layout needed, gradient layout), since blocks of one signature share
    # a part: a value several ops of one module need in one layout (q, k and v projections of one input) is
    # converted once (`IntraLayers._placed_calls`, which names the value by `IntraCost.origin` in its own block)
    calls: list[tuple[int, tuple | None, tuple[CommCall, ...]]]
    saved: float
    temporary: float
    params: float
    reduced: float
    reduced_tensors: int = 0


class IntraLayers:
    """The block model of one pipeline model's graph on a stage's tp axis: each profile row priced from its ops'
    strategies under an assignment of its blocks (Megatron's, or a repeated layer's intra-op layout), and the
    layouts themselves (blocks built on first use, prices and layouts cached)."""

    def __init__(self, model: PipelineModel) -> None:
        self.model = model
        self._ready = False
        self._costs: dict[tuple[AxisPlacement, bool], IntraCost] = {}
        self._parts: dict[tuple, _Part | None] = {}
        self._layouts: dict[tuple, LayerLayout | None] = {}
        self._row_keys: dict[int, tuple] = {}
        self._megatron: dict[tuple, tuple[Candidate, ...]] = {}
        self._placed: dict[tuple, list[tuple[int, int, CommCall]] | None] = {}

    def _build(self) -> None:
        if self._ready:
            return
        graph = self.model.graph
        repeated = frozenset(layer.name for layer in self.model.layers if layer.repeated)
        self.bg = build_blocks(graph, layers=repeated)
        self.rows: dict[str, list[ParallelBlock]] = defaultdict(list)  # blocks by their leading op's row
        for block in self.bg.blocks:
            self.rows[block.layer].append(block)
        self.place = {node: (block.id, pos) for block in self.bg.blocks for pos, node in enumerate(block.nodes)}
        # values a row's blocks produce that blocks of another row read: converted to the layout between layers on
        # leaving a repeated layer, or where a repeated layer reads them (`_to_layers`)
        self.repeated = repeated
        self.vocab = vocabulary_split(self.model.layers, graph) if self.model.vocab_parallel else None
        self.leaving: dict[str, set[tuple[int, int]]] = defaultdict(set)
        self._to_layers: set[tuple[int, int]] = set()
        owner, blocks = self.bg.owner, self.bg.blocks
        for node in graph.nodes:
            here = owner[node.id]
            for s in node.sources:
                if s.state is None and s.node >= 0 and self.bg.activation[s.node] and here >= 0:
                    there = owner[s.node]
                    if there >= 0 and blocks[there].layer != blocks[here].layer:
                        self.leaving[blocks[there].layer].add((s.node, s.index))
                        if blocks[here].layer in repeated:
                            self._to_layers.add((s.node, s.index))
        self._ready = True

    def _between_layers(self, value: tuple[int, int], *, made_in: str, read_in: str | None = None) -> bool:
        """Whether ``value`` crosses from row ``made_in`` (to ``read_in``) in the layout between layers: where it
        leaves a repeated layer or a repeated layer reads it. Between rows around the layers (an embedding's
        output read by the sum of embeddings) it stays in the layout it was made in."""
        return made_in in self.repeated or (read_in is not None and read_in in self.repeated) \
            or value in self._to_layers

    def _param_made_in(self, ic: IntraCost, fqn: str) -> tuple:
        """The layout of a parameter read outside its owner's block (a tied head's weight): its owner's, under
        Megatron's layout (whole, but for a vocabulary split)."""
        use = self._param_use(ic, fqn) if self.vocab is not None else None
        return _WHOLE * len(ic.sizes) if use is None else use.layout

    def _made_in(self, ic: IntraCost, value: tuple[int, int]) -> tuple:
        """The layout a value made outside the repeated layers leaves its block in, under Megatron's layout."""
        block = self.bg.blocks[self.bg.owner[value[0]]]
        bc = ic.block_cost(block, self._candidate(ic, block))
        found = None if bc is None else bc.exits.get(("out", block.nodes.index(value[0]), value[1]))
        return found if found is not None else _WHOLE * len(ic.sizes)

    def _candidate(self, ic: IntraCost, block: ParallelBlock, chosen: dict[int, Candidate] | None = None) -> Candidate:
        """The candidate ``chosen`` names for ``block``, else Megatron's (`_megatron_choice`)."""
        found = (chosen or {}).get(block.id)
        if found is None:
            found = self._megatron_choice(ic, block.layer)[self.rows[block.layer].index(block)]
        return found

    def _param_use(self, ic: IntraCost, fqn: str, chosen: dict[int, Candidate] | None = None) -> ParamUse | None:
        """A parameter as the block that reads it first lays it out under its candidate (`_candidate`); None where
        no op reads it or that block has no cost under its candidate."""
        owner = ic.param_owner.get(fqn)
        if owner is None:
            return None
        block = self.bg.blocks[owner]
        bc = ic.block_cost(block, self._candidate(ic, block, chosen))
        return None if bc is None else next((p for p in bc.params if ic.locate(block, p.key) == fqn), None)

    def _row_key(self, row: int, tp_axis: AxisPlacement) -> tuple:
        """Rows whose blocks are alike (signatures, and which values cross the layer's edge) share a layout."""
        found = self._row_keys.get(row)
        if found is None:
            self._build()
            name = self.model.layers[row].name
            ic = self._cost(tp_axis, False)  # block signatures do not depend on the mesh: every IntraCost shares them
            found = self._row_keys[row] = tuple(
                (ic.signature(b), self._outside(b, name)) for b in self.rows.get(name, []))
        return found

    def price_key(self, row: int) -> tuple:
        """What a row's price depends on besides the stage: a repeated layer's blocks (`_row_key`), alike for
        alike layers; any other row's place."""
        if not self.model.layers[row].repeated:
            return ("row", row)
        return self._row_key(row, None)

    def _cost(self, placement: AxisPlacement | None, sp: bool) -> IntraCost:
        """The block model on the tp axis; partial sums are scattered by sequence under sequence parallelism and
        all-reduced without it, as the runtime's Megatron layouts do, and values arrive at a layer in the layout
        between layers (`_between`). ``placement`` None: any (for what does not depend on the mesh)."""
        self._build()
        if placement is None:
            found = next(iter(self._costs.values()), None)
            if found is not None:
                return found
            placement = AxisPlacement(name="tp", size=1, intra=1, inter=1)
        found = self._costs.get((placement, sp))
        if found is None:
            like = next(iter(self._costs.values()), None)
            mesh = Mesh(("tp",), (placement.size,), (placement,))
            found = self._costs[(placement, sp)] = IntraCost(
                self.bg, mesh, self.model.cluster, like=like, scatter_partials=sp, kernels=self.model.kernels,
                arrival=lambda ic, value: _between(ic, value, sp, placement.size))
        return found

    # ---- assignments ---------------------------------------------------------------------------------------------
    def _megatron_choice(self, ic: IntraCost, name: str) -> tuple[Candidate, ...]:
        """Megatron's layout (`IntraCost.megatron`) of the blocks led in row ``name``, each block's fallback where
        its own split does not divide."""
        key = (id(ic), name)
        found = self._megatron.get(key)
        if found is None:
            blocks = self.rows.get(name, [])
            found = self._megatron[key] = tuple(
                wanted if ic.block_cost(b, wanted) is not None else fallback
                for b, (wanted, fallback) in zip(blocks, map(self._vocabulary, blocks, ic.megatron(blocks))))
        return found

    def _vocabulary(self, block: ParallelBlock, options: tuple[Candidate, Candidate]) -> tuple[Candidate, Candidate]:
        """Megatron-LM's split of the vocabulary (`autopar.cost.vocab`), where the model is priced with it: an LM
        head column-parallel without a gather, an embedding of the vocabulary split by it."""
        if self.vocab is None or (block.leader not in self.vocab.heads and block.leader not in self.vocab.tables):
            return options
        roles = self._cost(None, False).roles(block)
        return ((roles["column"] if block.leader in self.vocab.heads else roles["row"],), options[1])

    # ---- prices of profile rows ------------------------------------------------------------------------------
    def row_prices(self, row: int, tp_axis: AxisPlacement, *, samples: float, sp: bool,
                   choice: tuple[Candidate, ...] | None = None) -> dict | None:
        """Row ``row`` on one device running ``samples`` samples of a micro-batch, priced by the block model: per
        recompute level (a row outside the repeated layers: "none" only) its `LayerPrice`. Every block is in
        Megatron's layout, except, given ``choice``, the blocks led in this (repeated) row. None where a block
        it needs has no cost under its candidate.

        A row is priced by its own ops, wherever their blocks start (the final norm sits in the last layer's last
        block): each op's work split as its block's strategy splits it (an op on parameters or model inputs alone,
        whole), what it saves and the largest output likewise, and the conversions each op needs, including those
        of values entering or leaving a row of blocks in the layout between layers (the stream scattered by
        sequence at the first layer, and gathered where a whole head reads it)."""
        self._build()
        ic = self._cost(tp_axis, sp)
        scale = samples / self.model.traced_batch
        found = self._row_calls(ic, row, tp_axis, sp, choice)
        if found is None:
            return None
        chosen, calls, again = found
        priced, saved, temporary, attention = self._row_ops(ic, row, chosen, tp_axis.size, scale)
        tally = [0.0, 0.0]  # seconds the op database measured, forward and backward
        forward, backward = self._sequence(priced, tally)
        params = self.row_params(row, tp_axis, chosen=chosen)
        levels = ("none", "selective", "full") if self.model.layers[row].repeated else ("none",)
        return {level: self._assemble(row, level, forward, backward, [c.scaled(scale) for c in calls], saved,
                                      temporary, params, attention, scale, tp_axis, sp, tally, again)
                for level in levels}

    def _sequence(self, priced: list, tally: list[float] | None = None) -> tuple[float, float]:
        """`sequence_seconds` of ``priced`` on the model's device, ops the profile database timed at their
        measured times (their forward and backward seconds added to ``tally``)."""
        return sequence_seconds(priced, self.model.cluster.device, kernels=self.model.kernels,
                                ops=self.model.op_times, traced_batch=self.model.traced_batch, tally=tally)

    def _row_calls(self, ic: IntraCost, row: int, tp_axis: AxisPlacement, sp: bool,
                   choice: tuple[Candidate, ...] | None) -> tuple[dict[int, Candidate], list[CommCall], bool] | None:
        """The candidate of every block row ``row``'s ops belong to (`row_prices`), the collectives those ops issue
        per micro-batch at the traced batch, in the order issued, and for each whether a full recomputation's replay
        issues it again (a forward one); None where a block has no cost."""
        layer = self.model.layers[row]
        chosen: dict[int, Candidate] = {}
        placed: list[tuple[int, int, CommCall, bool]] = []  # (op id, order, call, whether issued before the op)
        ids = {n.id for n in layer.nodes}
        for name in dict.fromkeys(self.bg.blocks[self.place[n.id][0]].layer for n in layer.nodes):
            blocks = self.rows[name]
            picked = choice if choice is not None and name == layer.name else self._megatron_choice(ic, name)
            chosen.update(zip((b.id for b in blocks), picked))
            calls = self._placed_calls(ic, name, picked, tp_axis, sp)
            if calls is None:
                return None
            placed += [(blocks[k].nodes[pos], order, c, before) for order, (k, pos, c, before) in enumerate(calls)
                       if blocks[k].nodes[pos] in ids]
        region = self._vocab_region(tp_axis.size)
        if region:  # Megatron-LM's fused cross entropy on the split logits: its reductions, no conversion
            placed = [item for item in placed if item[0] not in region]
            if self.vocab.loss in ids:
                placed += [(self.vocab.loss, -1, CommCall(kind=Collective.ALL_REDUCE, axis="tp", bytes=nbytes,
                                                          phase=Phase.FORWARD), False)
                           for nbytes in self.vocab.reductions]
        placed.sort(key=lambda item: item[:2])
        # which forward calls checkpointing's replay issues again: it stops once it has every tensor the backward
        # saved, so it issues a call only where an op after the op it is placed at saves one (a norm after the
        # block's last row-parallel projection, as Gemma 2's and OLMo 2's post-norms are), or where the call
        # converts that op's input and the op saves one itself (a projection's output is reduced after the op, its
        # saved input made before). A dropout's mask is not counted: `autopar run` runs the model with dropout off,
        # and the replay is priced as the ranks run it
        last = max((n.id for n in layer.nodes if n.saved_bytes and not n.module_type.endswith("Dropout")), default=-1)
        again = tuple(c.phase is Phase.FORWARD and (op < last or (op == last and before))
                      for op, _, c, before in placed)
        return chosen, [c for _, _, c, _ in placed], again

    def _vocab_region(self, tp: int) -> frozenset[int]:
        """The loss's ops where Megatron-LM's vocabulary split runs them on split logits (`cost.vocab`)."""
        return self.vocab.region if self.vocab is not None and tp > 1 else frozenset()

    def _op_splits(self, ic: IntraCost, row: int, chosen: dict[int, Candidate],
                   tp: int) -> Iterator[tuple[Node, Strategy | None, int]]:
        """Row ``row``'s ops in order, each with how its block's candidate in ``chosen`` splits it: (op, its
        strategy, the devices its work splits over), the strategy None where the op is split evenly that many
        ways (whole: on parameters or model inputs alone; tp: in Megatron-LM's vocabulary region). Every block
        has a cost under ``chosen`` (`_row_calls` returned it)."""
        blocks, region = self.bg.blocks, self._vocab_region(tp)
        for node in self.model.layers[row].nodes:
            b, pos = self.place[node.id]
            if node.id in blocks[b].branch:
                yield node, None, 1
            elif node.id in region:
                yield node, None, tp
            else:
                strategy = ic.block_cost(blocks[b], chosen[b]).strategies[pos]
                yield node, strategy, strategy.shard

    def _row_ops(self, ic: IntraCost, row: int, chosen: dict[int, Candidate], tp: int,
                 scale: float) -> tuple[list, float, float, list]:
        """Row ``row``'s ops at ``scale`` times the traced batch, each as its block's candidate in ``chosen``
        splits it (`_op_splits`): (op, its shard over the scale) for `sequence_seconds`, the bytes saved for
        backward, the largest output, and its attention cores as (op, shard over the scale, output bytes kept)."""
        priced, attention = [], []
        saved = temporary = 0.0
        for node, strategy, shard in self._op_splits(ic, row, chosen, tp):
            if strategy is None:
                kept, out = node.saved_bytes / shard, node.output_bytes / shard
            else:
                kept = node.saved_bytes * ic.saved_fraction(node, strategy)
                out = node.output_bytes / ic.ways(strategy.outputs[0]) if strategy.outputs else 0.0
            priced.append((node, shard / scale))
            saved += kept * scale
            if not node.is_view:
                temporary = max(temporary, out * scale)
            if "attention" in node.op:
                attention.append((node, shard / scale, node.output_bytes * scale / max(shard, 1)))
        return priced, saved, temporary, attention

    def row_memory(self, row: int, tp_axis: AxisPlacement, *, sp: bool) -> tuple[list[float], list[float],
                                                                                 list[float]]:
        """Row ``row``'s ops in Megatron's layout on one device at the traced batch, as the stage memory walk reads
        them (`autopar.cost.memory.row_peak`), one entry per op in order: bytes it saves for backward, what its
        backward holds at once (`autopar.cost.memory.op_transient`, each tensor split as the op's strategy splits
        it or its gradient), and the elements of the row's parameters whose gradients it makes (each at the last
        op of the row reading it, where the backward meets it first)."""
        self._build()
        ic = self._cost(tp_axis, sp)
        found = self._row_calls(ic, row, tp_axis, sp, None)
        if found is None:
            raise ValueError(f"{self.model.layers[row].name or 'the model'}: Megatron's layout over tp "
                             f"{tp_axis.size} does not apply to it")
        chosen = found[0]
        nodes = self.model.layers[row].nodes
        saved, passing = [], []
        for node, strategy, ways in self._op_splits(ic, row, chosen, tp_axis.size):
            if strategy is None:
                saved.append(node.saved_bytes / ways)
                passing.append(op_transient(node) / ways)
            else:
                saved.append(node.saved_bytes * ic.saved_fraction(node, strategy))
                passing.append(op_transient(node, outputs=[ic.ways(x) for x in strategy.outputs],
                                            inputs=[ic.ways(x) for x in strategy.gradients]))
        local = self._param_sizes(row, tp_axis, chosen)
        params, seen = [0.0] * len(nodes), set()
        for k in range(len(nodes) - 1, -1, -1):
            for source in nodes[k].sources:
                if source.state in local and source.state not in seen:
                    seen.add(source.state)
                    params[k] += local[source.state]
        return saved, passing, params

    def row_params(self, row: int, tp_axis: AxisPlacement, *, chosen: dict[int, Candidate] | None = None) -> float:
        """Parameters of row ``row`` one device holds under its blocks' layouts (Megatron's unless ``chosen``
        names a block's candidate): each as the block that reads it first lays it out (a tied weight as its
        owner's row lays it out)."""
        return sum(self._param_sizes(row, tp_axis, chosen or {}).values())

    def _param_sizes(self, row: int, tp_axis: AxisPlacement, chosen: dict[int, Candidate]) -> dict[str, float]:
        """Elements of each trainable parameter of row ``row`` on one device (`row_params`)."""
        ic = self._cost(tp_axis, False)
        sizes = {}
        for info in self.model._row_params[row]:
            use = self._param_use(ic, info.fqn, chosen)  # None: read by no op, held whole
            sizes[info.fqn] = float(info.tensor.numel if use is None else use.local)
        return sizes

    def _placed_calls(self, ic: IntraCost, name: str, choice: tuple[Candidate, ...], tp_axis: AxisPlacement,
                      sp: bool) -> list[tuple[int, int, CommCall, bool]] | None:
        """The collectives of the blocks led in row ``name`` under ``choice``, per micro-batch at the traced batch,
        as (block index in the row, position of the op it runs at, call, whether it converts a value that op reads,
        before it runs, rather than reduces what the op made): each block's own conversions, those of
        values entering the row and leaving it, and those between its blocks, a value converted once per module
        and layout (`_scope`: the runtime converts it once and every reader of the module uses the result,
        gradients summed before one reduction). None where a block has no cost under its candidate."""
        row = self._row_index.get(name)
        key = (self._row_key(row, tp_axis) if row is not None and self.model.layers[row].repeated else name,
               ic.mesh.placements[0], sp, choice)
        if key in self._placed:
            return self._placed[key]
        blocks = self.rows[name]
        parts = [self._part(ic, b, c, name, 1.0, tp_axis, sp) for b, c in zip(blocks, choice)]
        found: list[tuple[int, int, CommCall]] | None = None
        if all(p is not None for p in parts):
            found, seen = [], set()
            index = {b.id: v for v, b in enumerate(blocks)}
            for k, (block, cand, part) in enumerate(zip(blocks, choice, parts)):
                scope = _scope(ic, block)
                conversions = [(pos, what if what is None else (ic.origin(ic.locate(block, what[0])), *what[1:]), calls)
                               for pos, what, calls in part.calls]  # the values this block converts, by origin
                for key_in, producer in self._inner_inputs(ic, block, [cand], index):  # from the row's other blocks
                    need, grad = ic.block_cost(block, cand).entries[key_in]
                    move = ic.transfer(block, key_in, producer, choice[index[producer.id]], cand)
                    conversions.append((key_in[1], (ic.origin(ic.locate(block, key_in)), need, grad),
                                        tuple(move.collectives)))
                for pos, what, calls in conversions:
                    if what is not None:
                        if (what, scope) in seen:
                            continue
                        seen.add((what, scope))
                    found += [(k, pos, c, what is not None) for c in calls]  # a value converted for its reader
        self._placed[key] = found
        return found

    @cached_property
    def _row_index(self) -> dict[str, int]:
        return {layer.name: row for row, layer in enumerate(self.model.layers)}

    def _assemble(self, row: int, level: str, forward: float, backward: float, calls: list[CommCall], saved: float,
                  temporary: float, params: float, attention: list, scale: float, tp_axis: AxisPlacement,
                  sp: bool, tally: Sequence[float] = (0.0, 0.0), again: Sequence[bool] = ()) -> LayerPrice:
        """A row's `LayerPrice` at recompute ``level`` from its ops' figures (``calls`` in the order issued;
        ``tally``: the forward and backward seconds among them the profile database measured; ``again``:
        per call, whether a full recomputation's replay issues it again, `_row_calls`)."""
        measured = tally[0] + tally[1]
        from autopar.cost.pipeline import LayerPrice

        layer, device = self.model.layers[row], self.model.cluster.device
        forward_calls = [c for c in calls if c.phase is Phase.FORWARD]
        # eager checkpointing stops once it has every saved tensor, before the layer's last calls where nothing after
        # them saves a tensor (the layer's output is not one of them; `_row_calls`), whether the layer is
        # checkpointed alone or ends a checkpointed run of layers (`cost.checkpoint`); a compiled layer replays its
        # forward whole
        eager = self.model.kernels == "eager"
        replayed = [c for c, issued in zip(calls, again) if issued or not eager and c.phase is Phase.FORWARD]
        tail = tuple(c for c, issued in zip(calls, again) if eager and c.phase is Phase.FORWARD and not issued)
        if level == "full":  # the forward replays in the backward, its conversions too, except that tail
            backward += forward
            measured += tally[0]
            replay = [c.during(Phase.BACKWARD) for c in replayed]
            calls = calls + replay
            temporary = max(temporary, saved)
            saved = layer.input_bytes * scale / (tp_axis.size if sp else 1)  # the layer's input
        elif level == "selective":  # the attention core replays; its output is not kept
            backward += sum(node_seconds(node, device, backward=False, shard=shard) for node, shard, _ in attention)
            saved -= sum(kept for _, _, kept in attention)
        seconds = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.0}
        for c in calls:
            seconds[c.phase] += collective_seconds(c.kind, c.bytes, tp_axis, self.model.cluster)
        return LayerPrice(
            forward=forward, backward=backward, comm_forward=seconds[Phase.FORWARD],
            comm_backward=seconds[Phase.BACKWARD], activations=saved, temporary=temporary, params=params,
            collectives=merge_calls(calls), forward_collectives=merge_calls(forward_calls), tail=tail,
            tail_seconds=sum(collective_seconds(c.kind, c.bytes, tp_axis, self.model.cluster) for c in tail),
            measured_ops=measured,
        )

    # ---- choosing a layout -------------------------------------------------------------------------------------
    def layout(self, row: int, tp_axis: AxisPlacement, when: Conditions, megatron: LayerPrice) -> LayerLayout | None:
        """The fastest layout of repeated row ``row`` that needs no more memory than Megatron's (``megatron``, its
        price without recomputation), or None where Megatron's layout is as fast."""
        key = (self._row_key(row, tp_axis), tp_axis, when, megatron)
        if key not in self._layouts:
            self._layouts[key] = self._choose(row, tp_axis, when, megatron)
        return self._layouts[key]

    def _choose(self, row: int, tp_axis: AxisPlacement, when: Conditions, megatron: LayerPrice) -> LayerLayout | None:
        from autopar.search.ilp import dense_optimum, solve

        terms = self.terms(row, tp_axis, when)
        if terms is None:
            return None
        limit = self.memory_limit(when, megatron)
        if math.prod(len(c) for c in terms.costs) <= _DENSE:
            found = dense_optimum(terms.costs, terms.edges, terms.memory, limit)
            if found is None:
                return None
            indices = found[0]
        else:
            solution = solve(terms.costs, terms.edges, terms.memory, limit, time_limit=5.0)
            if not solution.feasible:
                return None
            indices = solution.choice
        choice = tuple(terms.candidates[v][i] for v, i in enumerate(indices))
        found = self._laid_out(row, tp_axis, when, terms.blocks, choice)
        if found is None or not self.seconds_of(found.prices["none"], found.reduced, tp_axis, when) \
                < self.seconds_of(megatron, 0.0, tp_axis, when):
            return None
        return found

    def layout_as(self, row: int, tp_axis: AxisPlacement, when: Conditions,
                  splits: Sequence[tuple[str, str]]) -> LayerLayout:
        """Repeated row ``row`` laid out by ``splits`` (module inside the row -> its split, as `LayerLayout.splits`
        names them: a plan's record), whether or not the cost model would choose it. Raises ValueError naming the
        module where the row has no such block or split (a plan made for another model or tp size)."""
        self._build()
        name = self.model.layers[row].name
        blocks = self.rows.get(name, [])
        ic = self._cost(tp_axis, when.sp)
        wanted = dict(splits)
        choice = []
        for b in blocks:
            module = _relative(self.model.graph.node(b.leader).module, name)
            split = wanted.pop(module, None)
            found = next((c for c in ic.candidates(b) if ic.describe(b, c) == split), None)
            if found is None:
                raise ValueError(f"the plan lays out {name}.{module} as {split!r}, which a tp of {tp_axis.size} "
                                 f"does not offer there" if split is not None else
                                 f"the plan lays out layer {name!r} without a split for its module {module!r}")
            choice.append(found)
        if wanted:
            raise ValueError(f"the plan lays out {name}.{next(iter(wanted))}, which leads no block of that layer")
        laid = self._laid_out(row, tp_axis, when, blocks, tuple(choice))
        if laid is None:
            raise ValueError(f"layer {name!r} laid out as the plan says has an op the cost model cannot price")
        return laid

    def _laid_out(self, row: int, tp_axis: AxisPlacement, when: Conditions, blocks: list[ParallelBlock],
                  choice: tuple[Candidate, ...]) -> LayerLayout | None:
        ic, name = self._cost(tp_axis, when.sp), self.model.layers[row].name
        scale = when.samples / self.model.traced_batch
        prices = self.row_prices(row, tp_axis, samples=when.samples, sp=when.sp, choice=choice)
        if prices is None:
            return None
        parts = [self._part(ic, b, c, name, scale, tp_axis, when.sp) for b, c in zip(blocks, choice)]
        reduced = sum(part.reduced for part in parts)
        splits = tuple((_relative(self.model.graph.node(b.leader).module, name), ic.describe(b, c))
                       for b, c in zip(blocks, choice))
        params = tuple((_relative(ic.locate(b, p.key), name), short_layout(p.layout))
                       for b, c in zip(blocks, choice) for p in ic.block_cost(b, c).params)
        return LayerLayout(splits=splits, prices=prices, reduced=reduced, params=params, choice=choice,
                           reduced_tensors=sum(part.reduced_tensors for part in parts))

    def edges(self, row: int, tp_axis: AxisPlacement, layout: LayerLayout, *, sp: bool) -> dict[str, tuple]:
        """Per leading op of row ``row`` laid out by ``layout``, its module's name and the layouts on tp its input
        is read in and its output handed on in (`IntraCost.leading_edges`): what a plan records for the runtime."""
        self._build()
        ic = self._cost(tp_axis, sp)
        blocks = self.rows.get(self.model.layers[row].name, [])
        return {self.model.graph.node(b.leader).module: ic.leading_edges(b, c) for b, c in zip(blocks, layout.choice)}

    def terms(self, row: int, tp_axis: AxisPlacement, when: Conditions) -> Terms | None:
        """The ILP of repeated row ``row``'s layout (None where it has no blocks or tp is 1)."""
        from autopar.search.ilp import Edge

        self._build()
        name = self.model.layers[row].name
        blocks = self.rows.get(name, [])
        if not blocks or tp_axis.size == 1:
            return None
        ic = self._cost(tp_axis, when.sp)
        scale = when.samples / self.model.traced_batch
        cands = [ic.candidates(b) for b in blocks]
        per_param = self._per_param(when)
        costs, memory = [], []
        for b, options in zip(blocks, cands):
            c_row, m_row = np.full(len(options), math.inf), np.zeros(len(options))
            for i, cand in enumerate(options):
                part = self._part(ic, b, cand, name, scale, tp_axis, when.sp)
                if part is None:
                    continue
                c_row[i] = self._seconds(part, tp_axis, when)
                m_row[i] = per_param * part.params + when.in_flight * part.saved
            costs.append(c_row)
            memory.append(m_row)
        index = {b.id: v for v, b in enumerate(blocks)}
        edges = [Edge(u, v, matrix) for v, b in enumerate(blocks)
                 for u, matrix in self._inner_edges(ic, b, cands, index, scale, tp_axis).items()]
        return Terms(blocks, cands, costs, memory, edges)

    def memory_limit(self, when: Conditions, megatron: LayerPrice) -> float:
        """Bytes a layer's layout may hold: what Megatron's layout of it holds (model states and in-flight
        activations)."""
        return self._per_param(when) * megatron.params + when.in_flight * megatron.activations

    def _per_param(self, when: Conditions) -> float:
        return sum(model_states(1.0, dtype=self.model.dtype, zero=when.zero, dp=when.dp))

    def _seconds(self, part: _Part, tp_axis: AxisPlacement, when: Conditions) -> float:
        comm = sum(collective_seconds(c.kind, c.bytes, tp_axis, self.model.cluster)
                   for _, _, calls in part.calls for c in calls)
        return part.forward + part.backward + comm + self._sync(part.params, part.reduced, tp_axis, when)

    def seconds_of(self, price: LayerPrice, reduced: float, tp_axis: AxisPlacement, when: Conditions) -> float:
        """A layer's price per micro-batch with its share of the iteration's gradient synchronisation."""
        return price.forward + price.backward + price.comm_forward + price.comm_backward + self._sync(
            price.params, reduced, tp_axis, when)

    def _sync(self, params: float, reduced: float, tp_axis: AxisPlacement, when: Conditions) -> float:
        itemsize = gradient_itemsize(self.model.dtype)
        cluster = self.model.cluster
        total = 0.0
        if reduced:  # summed over tp once (each rank's ZeRO shard of them under ZeRO 1-3)
            total += collective_seconds(Collective.ALL_REDUCE, reduced * itemsize / (when.dp if when.zero else 1),
                                        tp_axis, cluster)
        if when.dp > 1:
            for kind, count in gradient_sync(when.zero, when.micro_batches):
                total += count * collective_seconds(kind, params * itemsize, when.dp_axis, cluster)
        return total / when.micro_batches

    # ---- pricing ------------------------------------------------------------------------------------------------
    def _part(self, ic: IntraCost, block: ParallelBlock, cand: Candidate, row: str, scale: float,
              tp_axis: AxisPlacement, sp: bool) -> _Part | None:
        key = (ic.signature(block), cand, scale, tp_axis, sp, self._outside(block, row),
               None if row in self.repeated else row)  # around the layers, what enters depends on its maker
        if key in self._parts:
            return self._parts[key]
        bc = ic.block_cost(block, cand)
        part = None
        if bc is not None:
            calls = [(pos, (value, need, grad), tuple(c.scaled(scale) for c in moved))
                     for pos, value, need, grad, moved in bc.conversions]
            # values from other layers arrive in the layout between layers; values other layers read leave in it
            for key_in, (need, grad) in bc.entries.items():
                value = ic.locate(block, key_in)
                maker = None if isinstance(value, str) else self.bg.blocks[self.bg.owner[value[0]]].layer
                if maker != row:
                    edge = self._param_made_in(ic, value) if isinstance(value, str) else \
                        _between(ic, value, sp, tp_axis.size) if self._between_layers(value, made_in=maker, read_in=row) \
                        else self._made_in(ic, value)
                    move = ic.convert(value, edge, need, grad)
                    if not math.isfinite(move.seconds):
                        self._parts[key] = None
                        return None
                    calls.append((key_in[1], (key_in, need, grad), tuple(c.scaled(scale) for c in move.collectives)))
            leaving = self.leaving.get(row, set())
            for (kind, pos, index), have in bc.exits.items():
                value = (block.nodes[pos], index)
                if kind != "out" or value not in leaving or not self._between_layers(value, made_in=row):
                    continue
                edge = _between(ic, value, sp, tp_axis.size)
                if have == edge:
                    continue
                move = ic.convert(value, have, edge, edge)
                if not math.isfinite(move.seconds):
                    self._parts[key] = None
                    return None
                calls.append((pos, None, tuple(c.scaled(scale) for c in move.collectives)))
            priced = [(self.model.graph.node(n), (1 if n in block.branch else bc.strategies[pos].shard) / scale)
                      for pos, n in enumerate(block.nodes)]
            forward, backward = self._sequence(priced)
            part = _Part(forward, backward, calls, bc.saved * scale, bc.temporary * scale,
                         sum(p.local for p in bc.params), sum(p.local for p in bc.params if p.reduce_axes),
                         sum(1 for p in bc.params if p.reduce_axes))
        self._parts[key] = part
        return part

    def _outside(self, block: ParallelBlock, row: str) -> tuple:
        """Which of the block's inputs and outputs cross the layer's edge (part of a block's cost key: the same
        block signature can sit at a layer's edge in one place and inside it in another)."""
        leaving = self.leaving.get(row, set())
        return tuple(block.nodes.index(n) for n, _ in sorted(leaving) if n in block.nodes)

    def _inner_edges(self, ic: IntraCost, block: ParallelBlock, cands: list[list[Candidate]], index: dict[int, int],
                     scale: float, tp_axis: AxisPlacement) -> dict[int, np.ndarray]:
        """Seconds to convert each value ``block`` reads from an earlier block of its layer, per candidate pair."""
        v = index[block.id]
        found: dict[int, np.ndarray] = {}
        for key_in, producer in self._inner_inputs(ic, block, cands[v], index):
            u = index[producer.id]
            matrix = found.setdefault(u, np.zeros((len(cands[u]), len(cands[v]))))
            for j, pc in enumerate(cands[u]):
                for i, cc in enumerate(cands[v]):
                    move = ic.transfer(block, key_in, producer, pc, cc)
                    matrix[j, i] += math.inf if move is None or not math.isfinite(move.seconds) else sum(
                        collective_seconds(c.kind, c.bytes * scale, tp_axis, self.model.cluster)
                        for c in move.collectives)
        return found

    def _inner_inputs(self, ic: IntraCost, block: ParallelBlock, options: list[Candidate],
                      index: dict[int, int]) -> list[tuple]:
        """(entry key, producer block) of each value ``block`` reads from another block of its layer."""
        bc = next((c for c in (ic.block_cost(block, cand) for cand in options) if c is not None), None)
        found = []
        for key_in in bc.entries if bc is not None else ():
            value = ic.locate(block, key_in)
            if not isinstance(value, str) and self.bg.owner[value[0]] in index:
                found.append((key_in, self.bg.blocks[self.bg.owner[value[0]]]))
        return found


def _scope(ic: IntraCost, block: ParallelBlock) -> str:
    """Where the runtime converts a block's input once for all its readers: the module holding the block's leading
    linear (q, k and v of one attention module, gate and up of one MLP). Two modules reading one value (Phi's
    attention and MLP read one norm's output) convert it each, and each reduces its gradient."""
    return ic.nodes[block.leader].module.rpartition(".")[0]


def _between(ic: IntraCost, value: tuple[int, int], sp: bool, tp: int) -> tuple:
    """The layout of a value passed between layers: whole, or under sequence parallelism split by sequence, where
    it divides: (batch, sequence, features) at dim 1; tokens flattened from it, (batch x sequence, features), at
    dim 0 with the batch as stride (each device holds its sequence shard of every sample: `StridedShard`)."""
    shape = ic.value_info(value).shape
    if not sp or len(shape) not in (2, 3):
        return _WHOLE
    dim = len(shape) - 2
    if shape[dim] % tp:
        return _WHOLE
    if dim == 1:
        return (Shard(1),)
    outer = _batch_of_tokens(ic, value, shape[0])
    return (shard_of(0, outer) if (shape[0] // outer) % tp == 0 else _WHOLE[0],)


def _batch_of_tokens(ic: IntraCost, value: tuple[int, int], tokens: int) -> int:
    """The batch a (tokens, features) value flattens, found behind its views (1 when none shows it)."""
    node_id, index = value
    while node_id >= 0 and ic.nodes[node_id].is_view:
        source = ic.nodes[node_id].sources[0]
        if source.state is not None:
            break
        node_id, index = source.node, source.index
        shape = ic.nodes[node_id].outputs[index].shape
        if len(shape) >= 3 and shape[0] * shape[1] == tokens:
            return shape[0]
    return 1


def _relative(module: str, row: str) -> str:
    """A module's name inside its layer ("attn.qkv" in "layers.3"): alike for every repeated layer."""
    return module[len(row) + 1 :] if module.startswith(row + ".") else module
