"""Intra-op layouts for a pipeline stage's layers: the intra-op planner's sharding space on the stage's tp axis.

Megatron's tensor parallelism is one layout of a layer over the stage's ``tp`` devices: column-parallel, then
row-parallel, one all-reduce per pair. A stage may instead lay each repeated layer out block by block
(`analysis.blocks`): every ParallelBlock's leading op splits over the tp axis by any of its candidates
(`cost.intra`: rows of the batch or sequence, output features, the contracted dim, attention heads, experts),
and the values between blocks are converted where the layouts differ (`sharding.layout`). Batch-splitting a
small layer, say, trades Megatron's activation all-reduces for a gradient all-reduce over tp once an iteration.

Between layers the stream is whole on each tp device, as Megatron and the stage boundary have it (split by
sequence under sequence parallelism, as Megatron-SP has it), so each layer's layout is chosen on its own. Per
layer it is the intra-op ILP over the layer's blocks, solved exactly (all assignments at once with numpy for a
layer of a few blocks, `search.ilp.solve` with HiGHS beyond):

    minimise   sum_b c_b(x_b) + sum_(u,v) e_uv(x_u, x_v) + sync(x) / m
    subject to states(x) + in_flight * saved(x) <= the same for Megatron's layout

with ``c_b`` the block's compute and its conversions (scaled to the stage's samples per device), the conversion
of each value entering the layer from that layout and of each value leaving it back to it, ``e_uv`` the
conversions between the layer's blocks, and ``sync`` the gradient all-reduce over tp of weights a layout keeps
whole while splitting their work, plus their share of the data-parallel synchronisation. The memory bound keeps a
stage that fits under Megatron's layout fitting. A layout is used only where it is faster than Megatron's price
(`cost.pipeline.price_layer`) by the same terms; otherwise the layer stays Megatron's.

The planner traces once at batch 1 and scales, so a split of the batch dim alone (an attention core by samples)
is not among the candidates there; splits of the tokens of a flattened (batch x sequence) matmul are.

Blocks are grouped by their leading op, so a layer's blocks hold the ops after its last contraction up to the next
layer's first (its norm): the work attributed to a layer shifts by one norm, alike for every repeated layer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.analysis import ParallelBlock, build_blocks
from autopar.cluster import Collective, collective_seconds
from autopar.cluster.calls import CommCall, Phase, merge_calls
from autopar.cluster.mesh import AxisPlacement, Mesh
from autopar.cost.compute import node_seconds, sequence_seconds
from autopar.cost.intra import Candidate, IntraCost
from autopar.cost.memory import gradient_itemsize, gradient_sync, model_states
from autopar.sharding import REPLICATE, short_layout
from autopar.sharding.layout import Shard, shard_of

if TYPE_CHECKING:
    from autopar.cost.pipeline import LayerPrice, PipelineModel

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
    calls: list[CommCall]
    saved: float
    temporary: float
    params: float
    reduced: float
    attention: tuple[float, float]  # (forward seconds, saved bytes) of its attention core
    # of ``calls``, the conversions of values entering the layer, by (entry key, layout needed, gradient layout): a
    # value several of the layer's blocks read in one layout (q, k and v projections of one input) is converted once
    entering: tuple[tuple[tuple, tuple[CommCall, ...]], ...] = ()


class IntraLayers:
    """Per-layer intra-op layouts of one pipeline model's graph (blocks built on first use, layouts cached)."""

    def __init__(self, model: PipelineModel) -> None:
        self.model = model
        self._ready = False
        self._costs: dict[AxisPlacement, IntraCost] = {}
        self._parts: dict[tuple, _Part | None] = {}
        self._layouts: dict[tuple, LayerLayout | None] = {}
        self._row_keys: dict[int, tuple] = {}

    def _build(self) -> None:
        if self._ready:
            return
        graph = self.model.graph
        self.bg = build_blocks(graph)
        self.rows: dict[str, list[ParallelBlock]] = defaultdict(list)
        for block in self.bg.blocks:
            self.rows[block.layer].append(block)
        # values a row's blocks produce that blocks of another row read: converted to whole on leaving the row
        self.leaving: dict[str, set[tuple[int, int]]] = defaultdict(set)
        owner, blocks = self.bg.owner, self.bg.blocks
        for node in graph.nodes:
            here = owner[node.id]
            for s in node.sources:
                if s.state is None and s.node >= 0 and self.bg.activation[s.node] and here >= 0:
                    there = owner[s.node]
                    if there >= 0 and blocks[there].layer != blocks[here].layer:
                        self.leaving[blocks[there].layer].add((s.node, s.index))
        self._ready = True

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

    def _cost(self, placement: AxisPlacement, sp: bool) -> IntraCost:
        """The block model on the tp axis; partial sums are scattered by sequence under sequence parallelism and
        all-reduced without it, as the runtime's Megatron layouts do."""
        found = self._costs.get((placement, sp))
        if found is None:
            like = next(iter(self._costs.values()), None)
            mesh = Mesh(("tp",), (placement.size,), (placement,))
            found = self._costs[(placement, sp)] = IntraCost(self.bg, mesh, self.model.cluster, like=like,
                                                             scatter_partials=sp, kernels=self.model.kernels)
        return found

    def megatron(self, row: int, tp_axis: AxisPlacement, *, samples: float, sp: bool) -> dict | None:
        """Row ``row`` under Megatron's layout (`IntraCost.megatron`) on the tp axis, priced by the block model:
        recompute level -> `LayerPrice` for one device running ``samples`` samples. None where the row has no
        blocks."""
        self._build()
        blocks = self.rows.get(self.model.layers[row].name, [])
        if not blocks:
            return None
        ic = self._cost(tp_axis, sp)
        choice = tuple(wanted if ic.block_cost(b, wanted) is not None else fallback
                       for b, (wanted, fallback) in zip(blocks, ic.megatron(blocks)))
        scale = samples / self.model.traced_batch
        return {level: self._price(ic, blocks, choice, row, scale, tp_axis, level, sp)
                for level in ("none", "selective", "full")}

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
        ic, blocks, name = self._cost(tp_axis, when.sp), terms.blocks, self.model.layers[row].name
        choice = tuple(terms.candidates[v][i] for v, i in enumerate(indices))
        scale = when.samples / self.model.traced_batch
        prices = {level: self._price(ic, blocks, choice, row, scale, tp_axis, level, when.sp)
                  for level in ("none", "selective", "full")}
        reduced = sum(self._part(ic, b, c, name, scale, tp_axis, when.sp).reduced for b, c in zip(blocks, choice))
        if not self.seconds_of(prices["none"], reduced, tp_axis, when) < self.seconds_of(megatron, 0.0, tp_axis, when):
            return None
        splits = tuple((_relative(self.model.graph.node(b.leader).module, name), ic.describe(b, c))
                       for b, c in zip(blocks, choice))
        params = tuple((_relative(ic.locate(b, p.key), name), short_layout(p.layout))
                       for b, c in zip(blocks, choice) for p in ic.block_cost(b, c).params)
        return LayerLayout(splits=splits, prices=prices, reduced=reduced, params=params, choice=choice)

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
        comm = sum(collective_seconds(c.kind, c.bytes, tp_axis, self.model.cluster) for c in part.calls)
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
        key = (ic.signature(block), cand, scale, tp_axis, sp, self._outside(block, row))
        if key in self._parts:
            return self._parts[key]
        bc = ic.block_cost(block, cand)
        part = None
        if bc is not None:
            device = self.model.cluster.device
            graph = self.model.graph
            attn_seconds = attn_saved = 0.0
            priced = [(graph.node(block.nodes[pos]), strategy.shard / scale) for pos, strategy in bc.strategies.items()]
            forward, backward = sequence_seconds(priced, device, kernels=self.model.kernels)
            for (node, shard), strategy in zip(priced, bc.strategies.values()):
                if "attention" in node.op:
                    attn_seconds += node_seconds(node, device, backward=False, shard=shard)
                    attn_saved += node.output_bytes * scale / max(strategy.shard, 1)
            calls = [c.scaled(scale) for c in bc.collectives]
            entering = []
            # values from other layers arrive in the layout between layers; values other layers read leave in it
            for key_in, (need, grad) in bc.entries.items():
                value = ic.locate(block, key_in)
                if isinstance(value, str) or self.bg.blocks[self.bg.owner[value[0]]].layer != row:
                    edge = _WHOLE if isinstance(value, str) else _between(ic, value, sp, tp_axis.size)
                    move = ic.convert(value, edge, need, grad)
                    if not math.isfinite(move.seconds):
                        self._parts[key] = None
                        return None
                    moved = [c.scaled(scale) for c in move.collectives]
                    calls += moved
                    entering.append(((key_in, need, grad), tuple(moved)))
            leaving = self.leaving.get(row, set())
            for (kind, pos, index), have in bc.exits.items():
                if kind != "out" or (block.nodes[pos], index) not in leaving:
                    continue
                value = (block.nodes[pos], index)
                edge = _between(ic, value, sp, tp_axis.size)
                if have == edge:
                    continue
                move = ic.convert(value, have, edge, edge)
                if not math.isfinite(move.seconds):
                    self._parts[key] = None
                    return None
                calls += [c.scaled(scale) for c in move.collectives]
            params = sum(p.local for p in bc.params)
            part = _Part(forward, backward, calls, bc.saved * scale, bc.temporary * scale, params,
                         sum(p.local for p in bc.params if p.reduce_axes), (attn_seconds, attn_saved),
                         tuple(entering))
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

    def _inner_calls(self, ic: IntraCost, blocks: list[ParallelBlock], choice: tuple[Candidate, ...],
                     scale: float) -> list[CommCall]:
        index = {b.id: v for v, b in enumerate(blocks)}
        calls: list[CommCall] = []
        done: set[tuple] = set()  # a value several blocks of one module read in one layout is converted once
        for b, cand in zip(blocks, choice):
            for key_in, producer in self._inner_inputs(ic, b, [cand], index):
                what = (ic.origin(ic.locate(b, key_in)), _scope(ic, b), *ic.block_cost(b, cand).entries[key_in])
                if what in done:
                    continue
                done.add(what)
                move = ic.transfer(b, key_in, producer, choice[index[producer.id]], cand)
                calls += [c.scaled(scale) for c in move.collectives]
        return calls

    def _price(self, ic: IntraCost, blocks: list[ParallelBlock], choice: tuple[Candidate, ...], row: int, scale: float,
               tp_axis: AxisPlacement, level: str, sp: bool) -> LayerPrice:
        from autopar.cost.pipeline import LayerPrice

        layer = self.model.layers[row]
        parts = [self._part(ic, b, c, layer.name, scale, tp_axis, sp) for b, c in zip(blocks, choice)]
        calls = [c for p in parts for c in p.calls] + self._inner_calls(ic, blocks, choice, scale)
        for c in _converted_again(ic, blocks, parts):
            calls.remove(c)
        forward = sum(p.forward for p in parts)
        backward = sum(p.backward for p in parts)
        saved = sum(p.saved for p in parts)
        temporary = max(p.temporary for p in parts)
        forward_calls = [c for c in calls if c.phase is Phase.FORWARD]
        # eager checkpointing stops once it has every saved tensor; a compiled layer replays its forward whole
        tail = next((c for c in reversed(parts[-1].calls) if c.phase is Phase.FORWARD), None) \
            if self.model.kernels == "eager" else None
        if level == "full":  # the forward replays in the backward, its conversions too, except the layer's last
            # (checkpointing stops once it has every saved tensor; the layer's output is not one of them)
            backward += forward
            replay = [c.during(Phase.BACKWARD) for c in forward_calls]
            if tail is not None:
                replay.remove(tail.during(Phase.BACKWARD))
            calls = calls + replay
            temporary = max(temporary, saved)
            saved = layer.input_bytes * scale / (tp_axis.size if sp else 1)  # the layer's input
        elif level == "selective":
            backward += sum(p.attention[0] for p in parts)
            saved -= sum(p.attention[1] for p in parts)
        seconds = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.0}
        for c in calls:
            seconds[c.phase] += collective_seconds(c.kind, c.bytes, tp_axis, self.model.cluster)
        return LayerPrice(
            forward=forward, backward=backward, comm_forward=seconds[Phase.FORWARD],
            comm_backward=seconds[Phase.BACKWARD], activations=saved, temporary=temporary,
            params=sum(p.params for p in parts), collectives=merge_calls(calls),
            forward_collectives=merge_calls(forward_calls), tail=tail,
            tail_seconds=0.0 if tail is None else collective_seconds(tail.kind, tail.bytes, tp_axis,
                                                                     self.model.cluster),
        )


def _converted_again(ic: IntraCost, blocks: list[ParallelBlock], parts: list[_Part]) -> list[CommCall]:
    """Conversions of a value entering the layer that an earlier block of the same module (`_scope`) already made
    in the same layouts: the runtime converts it once and every reader uses the result (gradients summed before
    one reduction)."""
    seen: set[tuple] = set()
    again: list[CommCall] = []
    for block, part in zip(blocks, parts):
        for (key_in, need, grad), moves in part.entering:
            what = (ic.origin(ic.locate(block, key_in)), _scope(ic, block), need, grad)
            if what in seen:
                again += moves
            seen.add(what)
    return again


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
