"""The intra-op planner: blocks and segments of a traced graph -> one ILP per (ZeRO stage, micro-batch count).

For one mesh the space is: a candidate per ParallelBlock (tied across instances of a repeated segment, so a
1,000-layer model has the variables of a 10-layer one), a ZeRO stage for the parameters' data-parallel axes, and
the number of micro-batches the global batch is accumulated over. The graph is traced once per micro-batch size;
for each, every block signature is priced once per candidate (`cost.intra`), the ILP (`search.ilp`) picks the
candidates under the device memory, and the cheapest plan over ZeRO stages and micro-batch counts wins.

Baselines are fixed choices priced by the same model: ``dp`` splits every leading op's batch-like dim over every
axis, ``fsdp`` does that with ZeRO-3, ``megatron`` splits the last axis Megatron-style (column-parallel layers on
their output features, the row-parallel layer after each on its input features, the embedding on its vocabulary)
and the other axes by batch. Each takes its own best micro-batch count.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autopar.analysis import BlockGraph, ParallelBlock, Segment, build_blocks, find_segments
from autopar.capture import Graph
from autopar.cluster import Cluster, build_mesh
from autopar.cluster.calls import CommCall, Phase
from autopar.cluster.mesh import Mesh
from autopar.cost.intra import GATHERED, Candidate, IntraCost, Key, ParamUse, sync_seconds
from autopar.cost.memory import Precision, gradient_itemsize, model_states
from autopar.cost.types import Estimate, MemoryBreakdown
from autopar.cost.uses import collective_uses
from autopar.plan import Block, ModuleLayout, ParamLayout, Plan, Workload
from autopar.plan import Mesh as PlanMesh
from autopar.search.heap import gc_paused
from autopar.search.ilp import Edge, Solution, solve
from autopar.sharding import Transfer
from autopar.sharding.layout import Shard

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)
BASELINES = ("dp", "fsdp", "megatron")


@dataclass(frozen=True, slots=True)
class BlockClass:
    """Blocks that cost the same and read the same kinds of values from the same kinds of producers: the unit the
    ILP terms and the estimate are summed over (a few per model, whatever its depth)."""

    block: ParallelBlock  # representative
    var: int
    count: int
    inputs: tuple[tuple[Key, ParallelBlock], ...]  # (entry key, producer block of the representative)


@dataclass(slots=True)
class Space:
    """Blocks, segments and tied candidate sets of one traced graph on one mesh."""

    graph: Graph
    blocks: BlockGraph
    segments: list[Segment]
    cost: IntraCost
    var_of: list[int]  # block id -> variable (one per unique block position in a unique segment)
    representative: list[ParallelBlock]  # variable -> its first block
    candidates: list[list[Candidate]]  # variable -> candidates
    count: list[int]  # variable -> number of blocks tied to it
    classes: list[BlockClass]
    # (block id, key, producer id) -> `_edge_matrix`: the same for every ZeRO stage and micro-batch count tried
    edges: dict[tuple[int, Key, int], np.ndarray] = field(default_factory=dict)
    # assignment -> `_conversions`, and (assignment, layers) -> `Replays`: the same at every ZeRO stage and
    # micro-batch count an assignment is priced at (`fit_by_recomputing` prices a few each)
    moves: dict[tuple[int, ...], dict] = field(default_factory=dict)
    replays: dict[tuple, Replays] = field(default_factory=dict)

    @property
    def mesh(self) -> Mesh:
        return self.cost.mesh


def build_space(graph: Graph, mesh: Mesh, cluster: Cluster, *, like: Space | None = None,
                scatter_partials: bool = True, kernels: str = "eager", ops: Any = None, traced_batch: int = 1,
                dtensor: bool = True) -> Space:
    """The space of ``graph`` on ``mesh``, its memory-bound ops run as ``kernels`` says (`cost.compute`). With
    ``like`` (the same model traced at another batch size, on the same mesh) the block structure, segments and
    classes are reused and only the shapes are new. ``scatter_partials``, ``ops`` (measured op times),
    ``traced_batch`` (the samples ``graph`` was traced at) and ``dtensor`` (priced as DTensor runs the ops, as
    `autopar run` runs an intra-op plan; False: as Megatron's runtime does): see `IntraCost`."""
    if like is not None and _same_structure(like, graph):
        old = like.blocks
        blocks = BlockGraph(graph=graph, blocks=old.blocks, owner=old.owner, activation=old.activation)
        cost = IntraCost(blocks, mesh, cluster, like=like.cost, scatter_partials=scatter_partials, kernels=kernels,
                         ops=ops, traced_batch=traced_batch, dtensor=dtensor)
        candidates = _with_gathered(cost, like.representative, [cost.candidates(b) for b in like.representative])
        return Space(graph, blocks, like.segments, cost, like.var_of, like.representative, candidates, like.count,
                     like.classes)
    blocks = build_blocks(graph)
    segments = find_segments(blocks.blocks)
    cost = IntraCost(blocks, mesh, cluster, scatter_partials=scatter_partials, kernels=kernels, ops=ops,
                     traced_batch=traced_batch, dtensor=dtensor)
    var_of = [-1] * len(blocks.blocks)
    index: dict[tuple[str, int], int] = {}
    representative: list[ParallelBlock] = []
    count: list[int] = []
    for seg in segments:
        for k in range(seg.count):
            for pos, b in enumerate(seg.instance(k)):
                key = (seg.fingerprint, pos)
                if key not in index:
                    index[key] = len(representative)
                    representative.append(blocks.blocks[b])
                    count.append(0)
                var_of[b] = index[key]
                count[index[key]] += 1
    candidates = _with_gathered(cost, representative, [cost.candidates(b) for b in representative])
    space = Space(graph, blocks, segments, cost, var_of, representative, candidates, count, [])
    space.classes = _classes(space)
    return space


def _with_gathered(cost: IntraCost, representative: list[ParallelBlock],
                   candidates: list[list[Candidate]]) -> list[list[Candidate]]:
    """``candidates`` with, for a block Megatron's layout splits by columns and gathers at once (an LM head,
    `IntraCost.megatron`), that candidate too: the ILP can choose what the runtime's Megatron layout runs."""
    for options, (wanted, _) in zip(candidates, cost.megatron(representative)):
        if wanted and wanted[-1] == GATHERED and wanted[:-1] in options:
            options.append(wanted)
    return candidates


def _same_structure(like: Space, graph: Graph) -> bool:
    """The same model at another batch size: same node count and layer spans, same leading ops (checked without
    building the new graph's node list)."""
    a = like.graph
    if a.num_nodes != graph.num_nodes or [r.spans for r in a.repeats] != [r.spans for r in graph.repeats]:
        return False
    return all(
        a.node(b.leader).op == graph.node(b.leader).op and a.node(b.leader).module == graph.node(b.leader).module
        for b in like.representative
    )


def _classes(space: Space) -> list[BlockClass]:
    ic = space.cost
    found: dict[tuple, list] = {}
    for block in space.blocks.blocks:
        v = space.var_of[block.id]
        first = next((c for c in (ic.block_cost(block, c) for c in space.candidates[v]) if c is not None), None)
        inputs = []
        shape = []
        for key in first.entries if first is not None else ():
            value = ic.locate(block, key)
            producer = space.blocks.blocks[
                ic.param_owner[value] if isinstance(value, str) else space.blocks.owner[value[0]]
            ]
            inputs.append((key, producer))
            shape.append((key, space.var_of[producer.id], ic.signature(producer), _relative(producer, value)))
        class_key = (v, ic.signature(block), tuple(shape))
        if class_key in found:
            found[class_key][2] += 1
        else:
            found[class_key] = [block, v, 1, tuple(inputs)]
    return [BlockClass(block=b, var=v, count=n, inputs=i) for b, v, n, i in found.values()]


# ---- one (zero, micro-batches) problem ------------------------------------------------------------------------


@dataclass(slots=True)
class Terms:
    """ILP arrays for one ZeRO stage and micro-batch count (seconds per iteration, bytes per device)."""

    costs: list[np.ndarray]
    memory: list[np.ndarray]
    transient: list[np.ndarray]  # largest temporary of each candidate (only the largest over blocks counts)
    states: list[np.ndarray]  # the part of ``memory`` that more micro-batches do not shrink (model states)
    edges: list[Edge]
    constant_memory: float


def _states(params: list[ParamUse], *, zero: int, dtype: str, sizes: tuple[int, ...]) -> tuple[float, float, float]:
    weights = grads = optim = 0.0
    for p in params:
        ways = math.prod(sizes[a] for a in p.reduce_axes)
        w, g, o = model_states(p.local, dtype=dtype, zero=zero, dp=ways)
        weights, grads, optim = weights + w, grads + g, optim + o
    return weights, grads, optim


class _Stopped(Exception):
    """The search was asked to stop (Ctrl-C) while it worked out an attempt's terms."""


def build_terms(space: Space, *, zero: int, micro_batches: int, dtype: str,
                should_stop: Callable[[], bool] | None = None, with_edges: bool = True) -> Terms:
    """The ILP's terms for ``space`` at one ZeRO stage and micro-batch count. ``should_stop``: polled while the
    edge matrices are worked out (on a 3-D mesh, seconds each), raising `_Stopped` once it is true. Without
    ``with_edges``, the terms have none: a baseline's plan, priced by `estimate_choice`, needs only its memory
    terms, and the baselines come first so that Ctrl-C finds one in hand."""
    ic, sizes, m = space.cost, space.mesh.sizes, micro_batches
    costs = [np.zeros(len(c)) for c in space.candidates]
    memory = [np.zeros(len(c)) for c in space.candidates]
    transient = [np.zeros(len(c)) for c in space.candidates]
    states = [np.zeros(len(c)) for c in space.candidates]
    edge_sum: dict[tuple[int, int], np.ndarray] = {}
    for cls in space.classes:
        cands = space.candidates[cls.var]
        c_row, m_row = np.zeros(len(cands)), np.zeros(len(cands))
        for i, cand in enumerate(cands):
            bc = ic.block_cost(cls.block, cand)
            if bc is None:
                c_row[i] = math.inf
                continue
            sync = sync_seconds(
                bc.params, zero=zero, micro_batches=m, itemsize=gradient_itemsize(dtype), mesh=space.mesh,
                cluster=ic.cluster, latency=zero == 3,  # ZeRO 0-2: the model's buckets' latency is not a block's
            )
            c_row[i] = m * bc.seconds + sync
            held = sum(_states(bc.params, zero=zero, dtype=dtype, sizes=sizes))
            m_row[i] = bc.saved + held
            states[cls.var][i] += cls.count * held
            transient[cls.var][i] = max(transient[cls.var][i], bc.temporary)
        costs[cls.var] += cls.count * c_row
        memory[cls.var] += cls.count * m_row
        for key, producer in cls.inputs if with_edges else ():
            pair = (space.var_of[producer.id], cls.var)
            matrix = (cls.count * m) * _edge_matrix(space, cls.block, key, producer, should_stop)
            edge_sum[pair] = edge_sum[pair] + matrix if pair in edge_sum else matrix
    edges = [Edge(u, v, matrix) for (u, v), matrix in edge_sum.items()]
    return Terms(costs, memory, transient, states, edges, ic.cluster.device.reserved)


def _edge_matrix(space: Space, block: ParallelBlock, key: Key, producer: ParallelBlock,
                 should_stop: Callable[[], bool] | None = None) -> np.ndarray:
    """Seconds per micro-batch to move one value, [producer candidate, consumer candidate]; worked out once per
    space (the search prices each space at several ZeRO stages, and a 3-D mesh's matrices took most of its time)."""
    cached = space.edges.get((block.id, key, producer.id))
    if cached is not None:
        return cached
    p_cands = space.candidates[space.var_of[producer.id]]
    cands = space.candidates[space.var_of[block.id]]
    matrix = np.full((len(p_cands), len(cands)), math.inf)
    for j, pc in enumerate(p_cands):
        if should_stop is not None and should_stop():
            raise _Stopped
        for i, cc in enumerate(cands):
            transfer = space.cost.transfer(block, key, producer, pc, cc)
            if transfer is not None:
                matrix[j, i] = transfer.seconds
    space.edges[(block.id, key, producer.id)] = matrix
    return matrix


def _relative(producer: ParallelBlock, value: tuple[int, int] | str) -> tuple | str:
    if isinstance(value, str):
        return value.rpartition(".")[2]
    return (producer.nodes.index(value[0]), value[1])


# ---- results --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class IntraPlan:
    """A chosen candidate per block on one mesh, with the ZeRO stage, micro-batching and its Estimate."""

    kind: str  # "ilp", "dp", "fsdp", "megatron"
    space: Space
    choice: tuple[int, ...]  # candidate index per variable
    zero: int
    micro_batches: int
    micro_batch_size: int
    estimate: Estimate
    solution: Solution | None = None
    floor: float = 0.0  # bytes no micro-batch count goes below (model states + reserve): above the budget, stop
    recompute: tuple[str, ...] = ()  # layers recomputed in full (`replay`)


    @property
    def axis_names(self) -> tuple[str, ...]:
        return axis_names(self)

    def to_plan(self, model: str, workload: Workload | None = None) -> Plan:
        return intra_plan(self, model, workload)


def estimate_choice(
    space: Space, choice: tuple[int, ...], *, zero: int, micro_batches: int, global_batch: int, dtype: str,
    recompute: Collection[str] = (),
) -> Estimate:
    """The Estimate (CLI.md) of one assignment: compute and communication are not overlapped (no pipeline).
    ``recompute``: layers recomputed in full (`replay`)."""
    return pricer(space, choice, zero=zero, micro_batches=micro_batches, global_batch=global_batch,
                  dtype=dtype)(recompute)


def pricer(
    space: Space, choice: tuple[int, ...], *, zero: int, micro_batches: int, global_batch: int, dtype: str,
    layers: Collection[str] = (),
) -> Callable[[Collection[str]], Estimate]:
    """`estimate_choice` of one assignment as a function of the layers it recomputes, what does not depend on them
    priced once; ``layers``: the layers it will be asked about (`Replays`), or any where empty."""
    ic, sizes, m = space.cost, space.mesh.sizes, micro_batches
    compute = comm = saved = temporary = 0.0
    weights = grads = optim = 0.0
    calls: list[CommCall] = []
    synced: list[ParamUse] = []
    # (use, blocks): under ZeRO 3, weights a module reads from its children, which the runtime gathers as they are
    # read and again for the whole backward (`autopar.runtime.intra._Zero3Hooks`)
    outside = space.graph.params_read_above if zero == 3 else frozenset()
    read_outside: list[tuple[ParamUse, int]] = []
    for cls in space.classes:
        n = cls.count
        bc = ic.block_cost(cls.block, space.candidates[cls.var][choice[cls.var]])
        assert bc is not None
        compute += n * m * (bc.compute_forward + bc.compute_backward)
        comm += n * m * (bc.comm_forward + bc.comm_backward)
        calls += [c.times(n * m) for c in bc.collectives]
        synced += bc.params * n
        read_outside += [(u, n) for u in bc.params if u.reduce_axes and ic.locate(cls.block, u.key) in outside]
        w, g, o = _states(bc.params, zero=zero, dtype=dtype, sizes=sizes)
        weights, grads, optim = weights + n * w, grads + n * g, optim + n * o
        saved += n * bc.saved
        temporary = max(temporary, bc.temporary)
    # the whole model's gradients at once: one bucketed collective per axis (ZeRO 0-2)
    comm += sync_seconds(synced, zero=zero, micro_batches=m, itemsize=gradient_itemsize(dtype), mesh=space.mesh,
                         cluster=ic.cluster, uses=calls)
    moved = _conversions(space, choice)
    for transfer, _ in moved.values():
        comm += m * transfer.seconds
        calls += [c.times(m) for c in transfer.collectives]
    before = (compute, comm, calls, saved)

    def priced(recompute: Collection[str]) -> Estimate:
        compute, comm, calls, saved = before
        if recompute:
            if not layers:
                again = replay(space, choice, recompute, moved=moved)
            else:  # the layers' table, made on the first set asked about
                key = (choice, tuple(layers))
                if key not in space.replays:
                    space.replays[key] = Replays(space, choice, layers, moved=moved)
                again = space.replays[key].of(recompute)
            compute += m * again.compute
            comm += m * again.comm
            calls = [*calls, *(c.times(m) for c in again.calls)]
            saved = again.activations
        device = ic.cluster.device
        iteration = compute + comm
        model_flops = (space.graph.flops_forward + space.graph.flops_backward) * m
        per_device = model_flops / iteration / ic.cluster.num_devices
        # the peak is the largest of the first backward's start (every activation saved, the loss's backward holding
        # its gradients; parameter gradients only where earlier micro-batches left them) and the moments of the
        # gradient synchronisation and the optimizer step (`_step_moments`)
        held = grads if m > 1 else 0.0
        moments = [(held, saved, temporary), *_step_moments(synced, zero=zero, dtype=dtype, sizes=sizes, grads=grads)]
        pending = [u for u in synced if u.reduce_axes] if zero == 3 else []
        if pending:
            # a weight kept in slices is whole while its module's backward runs, beside its whole gradient (the head's,
            # as the backward starts: the activations still saved, its temporaries too); a weight read outside its
            # own module (a position table sliced in the model's forward) is whole from the backward's start to its
            # gradient, since the runtime gathers such weights again as the backward reaches the model's output
            p = Precision.of(dtype)
            early = {id(u) for u, _ in read_outside}
            moments.append((held + max(u.local * p.gradient for u in pending), saved,
                            temporary + sum(n * u.local * p.weight for u, n in read_outside)
                            + max((u.local * p.weight for u in pending if id(u) not in early), default=0.0)))
        held, saved, other = max(moments, key=lambda moment: sum(moment))
        buffers = sum(s.tensor.nbytes for s in space.graph.state.values() if s.is_buffer)  # whole on every device
        memory = MemoryBreakdown(parameters=weights, gradients=held, optimizer=optim, activations=saved,
                                 other=other + buffers, reserve=device.reserved, budget=device.memory)
        return Estimate(
            iteration_seconds=iteration,
            compute_seconds=compute,
            exposed_comm_seconds=comm,
            bubble_seconds=0.0,
            throughput_samples_per_second=global_batch / iteration,
            tflops_per_device=per_device / 1e12,
            mfu=per_device / device.peak(dtype),
            memory=memory,
            collectives=collective_uses(calls, labels=dict(zip(space.mesh.names, _axis_labels(space, choice)))),
            micro_batches=m,
            cluster=ic.cluster.name,
        )

    return priced


def _step_moments(params: list[ParamUse], *, zero: int, dtype: str, sizes: tuple[int, ...],
                  grads: float) -> list[tuple[float, float, float]]:
    """(gradients, activations, other) bytes beside the weights and optimizer state at the moments of the step
    where the runtime's buffers peak (`autopar.runtime.intra`), from its weights pending on some mesh axis (held
    whole there): ``Wp`` and ``Gp`` bytes of them and of their gradients, ``n`` the size of the first such axis.

    - ZeRO 0, the all-reduce: every gradient, and the pending ones of one axis concatenated (the largest axis's);
    - ZeRO 1, the reduce-scatter: every gradient, their concatenation ``Gp`` and its scattered slice ``Gp / n``;
    - ZeRO 1 and 2, the gather after the step: the slices' gradients ``Gp / n`` (let go at the next step's start),
      the gradients of weights pending nowhere, and the gather's buffers: the slices concatenated ``Wp / n`` and
      the gathered weights ``Wp`` (copied from there into each weight)."""
    p = Precision.of(dtype)
    pending = [u for u in params if u.reduce_axes]
    if zero == 0:
        copy = max((sum(u.local * p.gradient for u in pending if a in u.reduce_axes) for a in range(len(sizes))),
                   default=0.0)
        return [(grads, 0.0, copy)]
    if zero > 2:
        return [(grads, 0.0, 0.0)]
    weights = sum(u.local * p.weight for u in pending)
    gradients = sum(u.local * p.gradient for u in pending)
    first = sum(u.local * p.weight / sizes[min(u.reduce_axes)] for u in pending)
    sliced = sum(u.local * p.gradient / sizes[min(u.reduce_axes)] for u in pending)
    others = sum(u.local * p.gradient for u in params if not u.reduce_axes)
    moments = [(sliced + others, 0.0, first + weights)]
    if zero == 1:
        moments.append((gradients + others, 0.0, gradients + sliced))
    return moments


def conversions(space: Space, choice: tuple[int, ...]) -> list[Transfer]:
    """The conversions of values between blocks per micro-batch, each value converted once per layout it is read
    in: two blocks reading one value in one layout (gate and up projections of one norm's output) share its
    conversion, and their gradients, summed by autograd, are converted back once. (The ILP's edge terms charge each
    reading block its own conversion: a bound the estimate of the chosen plan then tightens.)"""
    return [transfer for transfer, _ in _conversions(space, choice).values()]


def _conversions(space: Space, choice: tuple[int, ...]) -> dict[tuple, tuple[Transfer, list[int]]]:
    """`conversions`, each with the nodes that read the converted value (in the order the blocks run); worked out
    once per assignment (`Space.moves`), and not to be changed."""
    cached = space.moves.get(choice)
    if cached is not None:
        return cached
    ic = space.cost
    done: dict[tuple, tuple[Transfer, list[int]]] = {}
    for block in space.blocks.blocks:
        v = space.var_of[block.id]
        cand = space.candidates[v][choice[v]]
        consumed = ic.block_cost(block, cand)
        for key, (need, grad) in consumed.entries.items():
            value = ic.locate(block, key)
            owner = ic.param_owner[value] if isinstance(value, str) else space.blocks.owner[value[0]]
            producer = space.blocks.blocks[owner]
            pv = space.var_of[owner]
            what = (ic.origin(value), need, grad)
            if what not in done:
                done[what] = (ic.transfer(block, key, producer, space.candidates[pv][choice[pv]], cand), [])
            done[what][1].append(block.nodes[key[1]])
    space.moves[choice] = done
    return done


@dataclass(slots=True)
class Replay:
    """What recomputing some layers in full adds per micro-batch: their forward again in the backward (compute,
    and every forward collective of a conversion made inside them, issued again), and the activation bytes held
    at the step's peak (`replay`)."""

    compute: float = 0.0
    comm: float = 0.0
    calls: list[CommCall] = field(default_factory=list)
    activations: float = 0.0  # bytes per device at the peak, in place of every saved activation


def replay(space: Space, choice: tuple[int, ...], layers: Collection[str], *,
           moved: dict[tuple, tuple[Transfer, list[int]]] | None = None) -> Replay:
    """The `Replay` of recomputing ``layers`` (module names: everything run inside each one's forward is replayed,
    which a node's module says). Compute is priced by block (a block whose leading op lies in a layer is replayed
    with it), collectives and activations by the node that needs or saves them, so the calls counted are the ones
    the runtime's replay issues. ``moved``: the conversions between blocks (`_conversions`), where already made.

    Activations peak either at the end of the forward (what every other layer saved, and each recomputed layer's
    inputs) or while a recomputed layer's backward runs: by then the backward has freed what everything after it
    saved, and the layer's own activations are made again (what ran before it still holds its share)."""
    return Replays(space, choice, layers, moved=moved).of(layers)


def _any_nested(names: Sequence[str]) -> bool:
    """Whether one of the module ``names`` holds another (the root, "", holds no replayed node: see `Replays`)."""
    present = set(names)
    for name in names:
        while name:
            name = name.rpartition(".")[0]
            if name and name in present:
                return True
    return False


class Replays:
    """`replay` of any of ``layers`` at once, each node of the model walked once: `fit_by_recomputing` prices a
    dozen sets of a 320-layer model's layers, and walking every node for each took most of a plan's time.

    Per layer: its blocks' forward compute, the collectives of the conversions replayed with it, what it saves and
    what it keeps of its inputs, and its first node; per node, in the order nodes run: what it saves and its layer.
    Layers none of which holds another (repeated layers) answer for any subset; otherwise (a layer inside another
    is replayed with the outer one only when that is recomputed too) only for ``layers`` themselves, and other
    subsets are worked out afresh."""

    def __init__(self, space: Space, choice: tuple[int, ...], layers: Collection[str], *,
                 moved: dict[tuple, tuple[Transfer, list[int]]] | None = None) -> None:
        ic, graph = space.cost, space.graph
        self.space, self.choice, self.moved = space, choice, moved
        self.names = list(dict.fromkeys(layers))
        self.index = {name: k for k, name in enumerate(self.names)}
        self.nested = _any_nested(self.names)
        index, owner_of = self.index, {}

        def owner(module: str) -> int:  # the innermost of the layers that holds ``module``, or -1
            found = owner_of.get(module)
            if found is None:
                name, found = module, -1
                while name:  # (the root, "", holds no replayed node: a model is not recomputed whole)
                    if name in index:
                        found = index[name]
                        break
                    name = name.rpartition(".")[0]
                owner_of[module] = found
            return found

        n = len(self.names)
        self.compute, self.comm = np.zeros(n), np.zeros(n)
        self.calls: list[list[CommCall]] = [[] for _ in range(n)]
        self.saved, self.kept = np.zeros(n), np.zeros(n)
        self.first = np.full(n, -1, dtype=np.int64)  # -1: the layer runs no node
        nodes: list[int] = []
        held: list[float] = []
        owners: list[int] = []
        inputs: set[tuple[int, int, int]] = set()
        costs = [ic.block_cost(b, space.candidates[space.var_of[b.id]][choice[space.var_of[b.id]]])
                 for b in space.blocks.blocks]

        def again(k: int, transfer_calls: Sequence[CommCall], seconds: float) -> None:
            self.comm[k] += seconds
            self.calls[k].extend(replace(c, phase=Phase.BACKWARD) for c in transfer_calls if c.phase is Phase.FORWARD)

        for block, bc in zip(space.blocks.blocks, costs):
            assert bc is not None
            if block.layer in index:
                self.compute[index[block.layer]] += bc.compute_forward
            for (position, _, _, _, calls), seconds in zip(bc.conversions, bc.conversion_forward):
                k = owner(graph.node(block.nodes[position]).module)
                if k >= 0:
                    again(k, calls, seconds)
            for position, i in enumerate(block.nodes):
                node = graph.node(i)
                strategy = bc.strategies.get(position)
                saves = node.saved_bytes * (1.0 if strategy is None else ic.saved_fraction(node, strategy))
                k = owner(node.module)
                nodes.append(i)
                held.append(saves)
                owners.append(k)
                if k < 0:
                    continue
                self.saved[k] += saves
                self.first[k] = i if self.first[k] < 0 else min(self.first[k], i)
                for src in node.sources:  # what the layer reads from before it: kept as its input
                    if src.state is not None or src.node < 0 or not space.blocks.activation[src.node]:
                        continue
                    made = graph.node(src.node)
                    if owner(made.module) == k or (k, src.node, src.index) in inputs:
                        continue
                    inputs.add((k, src.node, src.index))
                    by = space.blocks.owner[src.node]
                    making = costs[by].strategies.get(space.blocks.blocks[by].nodes.index(src.node))
                    ways = ic.ways(making.outputs[src.index]) if making is not None and making.outputs else 1
                    self.kept[k] += made.outputs[src.index].nbytes / ways
        for transfer, readers in (moved if moved is not None else _conversions(space, choice)).values():
            for k in dict.fromkeys(owner(graph.node(i).module) for i in readers):
                if k >= 0:  # converted again in each replay that reads it
                    again(k, transfer.collectives, transfer.forward)
        order = np.argsort(np.asarray(nodes, dtype=np.int64), kind="stable")
        self.nodes = np.asarray(nodes, dtype=np.int64)[order]
        self.held = np.asarray(held, dtype=float)[order]
        self.owners = np.asarray(owners, dtype=np.int64)[order]

    def of(self, wanted: Collection[str]) -> Replay:
        """The `Replay` of recomputing ``wanted``, some of this table's layers."""
        chosen = np.zeros(len(self.names), dtype=bool)
        for name in wanted:
            k = self.index.get(name)
            if k is None:
                raise KeyError(f"layer {name!r} is not among the layers this table was made for")
            chosen[k] = True
        if self.nested and not chosen.all():
            return Replays(self.space, self.choice, wanted, moved=self.moved).of(wanted)
        picked = np.flatnonzero(chosen)
        out = Replay(compute=float(self.compute[picked].sum()), comm=float(self.comm[picked].sum()),
                     calls=[c for k in picked for c in self.calls[k]])
        # what runs outside the recomputed layers saves its share as usual
        replayed = self.owners >= 0
        replayed[replayed] = chosen[self.owners[replayed]]
        outside = np.where(replayed, 0.0, self.held)
        peak = float(outside.sum() + self.kept[picked].sum())  # the forward's end
        before = np.concatenate(([0.0], np.cumsum(outside)))
        inputs_held = 0.0
        for k in sorted((k for k in picked if self.first[k] >= 0), key=lambda k: self.first[k]):
            # what ran before the layer (the recomputed layers among it keep their inputs only), and the layer again
            earlier = float(before[np.searchsorted(self.nodes, self.first[k])])
            inputs_held += self.kept[k]
            peak = max(peak, earlier + inputs_held + self.saved[k])
        out.activations = float(peak)
        return out


# ---- baselines ------------------------------------------------------------------------------------------------


def baseline_choice(space: Space, kind: str) -> tuple[int, ...] | None:
    """Candidate per variable for a baseline; None when the model does not allow it on this mesh (a batch that
    does not divide, say). ``megatron`` is `IntraCost.megatron`'s layout."""
    ic, axes = space.cost, len(space.mesh.sizes)
    if kind == "megatron":
        options = ic.megatron(space.representative)
    else:
        options = [((ic.roles(block)["batch"],) * axes,) for block in space.representative]
    choice = []
    for v, wanted in enumerate(options):
        found = next((space.candidates[v].index(c) for c in wanted if c in space.candidates[v]), None)
        if found is None:
            return None
        choice.append(found)
    return tuple(choice)


# ---- driver ---------------------------------------------------------------------------------------------------


def micro_batch_counts(global_batch: int) -> list[int]:
    """Micro-batch counts tried, fewest first: powers of two dividing the batch, and the batch itself."""
    counts = [m for m in (2**k for k in range(0, 31)) if m <= global_batch and global_batch % m == 0]
    if global_batch not in counts:
        counts.append(global_batch)
    return counts


def plan_intra(
    trace_at: Callable[[int], Graph],
    cluster: Cluster,
    mesh_shape: tuple[int, ...],
    *,
    global_batch: int,
    dtype: str = "bf16",
    kinds: tuple[str, ...] = ("ilp", *BASELINES),
    time_limit: float = 30.0,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    kernels: str = "eager",
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    ops: Any = None,
) -> dict[str, IntraPlan | None]:
    """Best plan of each kind on a mesh of ``mesh_shape``, the programme's (``ilp``) with a ZeRO stage among
    ``zero_stages``; ``trace_at(micro_batch_size)`` traces the model, whose
    memory-bound ops run as ``kernels`` says; ``ops``: measured op times that price the ops they hold
    (`autopar.profiling.ops.OpTimes`).

    Fewer micro-batches mean larger ones: faster per sample but more activation memory. For each kind a binary
    search over the counts (`micro_batch_counts`) finds the fewest that fit, then more are tried while they get
    faster. A count that does not divide over the mesh (None) rules out every larger one too. A kind with no
    fitting plan returns its least-memory attempt (its Estimate says it does not fit). Each micro-batch size is
    traced once and shared by all kinds.

    Anytime: ``should_stop`` ends the search between attempts, like the time limit, or while an attempt's
    conversion matrices are worked out (seconds each on a 3-D mesh), with each kind's best plan so far."""
    budget = _Budget(time.perf_counter() + time_limit, should_stop)
    with gc_paused():
        return _plan_intra(trace_at, cluster, mesh_shape, global_batch, dtype, kinds, budget, progress,
                           kernels=kernels, zero_stages=zero_stages, ops=ops)


@dataclass(frozen=True, slots=True)
class _Budget:
    deadline: float  # time.perf_counter() at which the search stops
    should_stop: Callable[[], bool]

    def left(self) -> bool:
        return time.perf_counter() < self.deadline and not self.should_stop()


def _plan_intra(
    trace_at: Callable[[int], Graph],
    cluster: Cluster,
    mesh_shape: tuple[int, ...],
    global_batch: int,
    dtype: str,
    kinds: tuple[str, ...],
    budget: _Budget,
    progress: Callable[[str], None] | None,
    *,
    kernels: str,
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    ops: Any = None,
) -> dict[str, IntraPlan | None]:
    mesh = build_mesh(cluster, {f"x{i}": n for i, n in enumerate(mesh_shape)})
    counts = micro_batch_counts(global_batch)
    deadline = budget.deadline
    spaces: dict[tuple[int, bool], Space] = {}
    traced: dict[int, Graph] = {}
    best: dict[str, IntraPlan | None] = {}  # each kind's best plan so far

    def space_at(m: int, kind: str) -> Space:
        # Megatron's baseline is priced as the runtime applies it (no sequence parallelism: partial sums are
        # all-reduced); the search may scatter them (`IntraCost`)
        key = (m, kind != "megatron")
        if key not in spaces:
            size = global_batch // m
            if m not in traced:
                if progress:
                    progress(f"micro-batch {size} x {m}: tracing and pricing")
                traced[m] = trace_at(size)
            like = next((s for (_, scatter), s in spaces.items() if scatter == key[1]), None)
            spaces[key] = build_space(traced[m], mesh, cluster, like=like, scatter_partials=key[1], kernels=kernels,
                                      ops=ops, traced_batch=size)
        return spaces[key]

    try:
        for kind in kinds:
            tried: dict[int, IntraPlan | None] = {}

            def attempt(i: int, kind: str = kind, tried: dict = tried) -> IntraPlan | None:
                m = counts[i]
                if m not in tried:
                    tried[m] = _best_of_kind(space_at(m, kind), kind, m, global_batch // m, global_batch, dtype,
                                             deadline, zero_stages, should_stop=budget.should_stop)
                    candidates = [p for p in tried.values() if p is not None]
                    best[kind] = min(candidates, key=_rank) if candidates else None  # the best so far
                return tried[m]

            lo, hi, first_fit = 0, len(counts) - 1, None
            if kind == "ilp" and budget.left():
                # the whole batch at once first: the fastest where it fits, recomputing layers, say, where fewer
                # micro-batches would fit otherwise (the baselines keep every activation: their memory falls with more)
                found = attempt(0)
                if found is None:
                    hi = -1
                elif found.estimate.memory.fits:
                    first_fit, hi = 0, -1
                else:
                    lo = 1
            while lo <= hi and budget.left():
                mid = (lo + hi) // 2
                found = attempt(mid)
                if found is None:
                    hi = mid - 1
                elif found.estimate.memory.fits:
                    first_fit, hi = mid, mid - 1
                elif found.floor > found.estimate.memory.budget:
                    break  # the model states alone exceed the device: no micro-batch count can fit
                else:
                    lo = mid + 1
            if first_fit is not None:
                i = first_fit
                while i + 1 < len(counts) and budget.left():
                    following = attempt(i + 1)
                    # more micro-batches, while they get faster; and past a plan that recomputes layers to fit, until
                    # one keeps every activation (smaller micro-batches may fit without replaying anything)
                    if following is None or (_rank(following) >= _rank(tried[counts[i]])
                                             and not tried[counts[i]].recompute):
                        break
                    i += 1
            candidates = [p for p in tried.values() if p is not None]
            best[kind] = min(candidates, key=_rank) if candidates else None
    except _Stopped:  # Ctrl-C while an attempt's terms were worked out: each kind's best plan so far
        pass
    return {kind: best.get(kind) for kind in kinds}


def _rank(plan: IntraPlan) -> tuple:
    """Plans in order of preference: fitting before not, then faster (fitting) or smaller (not fitting)."""
    e = plan.estimate
    return (not e.memory.fits, e.iteration_seconds if e.memory.fits else e.memory.total)


def _best_of_kind(
    space: Space, kind: str, m: int, size: int, global_batch: int, dtype: str, deadline: float,
    zero_stages: tuple[int, ...] = ZERO_STAGES, *, should_stop: Callable[[], bool] | None = None,
) -> IntraPlan | None:
    """The best plan of ``kind`` at ``m`` micro-batches, over its ZeRO stages. ``should_stop`` (Ctrl-C) ends it
    at the next stage with the best found so far, or mid-terms with `_Stopped` where none is."""
    stages = (3,) if kind == "fsdp" else (0,) if kind in ("dp", "megatron") else ZERO_STAGES
    if kind == "ilp":  # the baselines keep their own stage: they are what the plan is compared with
        stages = tuple(z for z in stages if z in zero_stages)
    best: IntraPlan | None = None
    lowest = math.inf
    for zero in stages:
        if best is not None and should_stop is not None and should_stop():
            break  # Ctrl-C: this count's best stage so far (later stages reuse the space's edge matrices)
        terms = build_terms(space, zero=zero, micro_batches=m, dtype=dtype, should_stop=should_stop,
                            with_edges=kind == "ilp")
        budget = space.cost.cluster.device.memory - terms.constant_memory
        solution = None
        if kind == "ilp":
            solution = solve(
                terms.costs, terms.edges, terms.memory, budget, transient=terms.transient,
                time_limit=max(deadline - time.perf_counter(), 1.0),
            )
            if not solution.feasible:  # nothing fits: keep the least-memory legal assignment to report
                legal = [Edge(e.source, e.target, np.where(np.isfinite(e.costs), 0.0, math.inf)) for e in terms.edges]
                solution = solve(terms.memory, legal, None, time_limit=5.0)
                if not solution.feasible:
                    continue
            options = [solution.choice, baseline_choice(space, "dp")]
        else:
            options = [baseline_choice(space, kind)]
            if options[0] is None:
                return None
        choice, estimate = _better(space, options, zero, m, global_batch, dtype)
        if not math.isfinite(estimate.iteration_seconds):  # a baseline that needs an illegal conversion
            continue
        again: tuple[str, ...] = ()
        if kind == "ilp" and not estimate.memory.fits:
            # recomputing layers may make it fit: the assignment found, and the fastest one whatever its memory
            fastest = solve(terms.costs, terms.edges, None, time_limit=max(deadline - time.perf_counter(), 1.0))
            tries = [choice, *([fastest.choice] if fastest.feasible else [])]
            fitted = [(c, *fit_by_recomputing(space, c, zero, m, global_batch, dtype)) for c in dict.fromkeys(tries)]
            fitting = [f for f in fitted if f[2].memory.fits]
            if fitting:
                choice, again, estimate = min(fitting, key=lambda f: f[2].iteration_seconds)
        floor = terms.constant_memory + (
            sum(float(row.min()) for row in terms.states) if kind == "ilp"
            else sum(float(terms.states[v][i]) for v, i in enumerate(choice))
        )
        plan = IntraPlan(kind, space, choice, zero, m, size, estimate, solution, recompute=again)
        if best is None or _rank(plan) < _rank(best):
            best = plan
        lowest = min(lowest, floor)
    if best is not None:
        best.floor = lowest
    return best


def fit_by_recomputing(space: Space, choice: tuple[int, ...], zero: int, m: int, global_batch: int,
                       dtype: str) -> tuple[tuple[str, ...], Estimate]:
    """The fewest repeated layers, first ones first, whose recomputation in full makes ``choice`` fit the device
    (none where it fits as it is), with its Estimate; all of them where nothing fits. Memory falls as more are
    recomputed (each keeps only its input; one layer's activations are made again at a time), so the count is
    found by bisection."""
    layers = repeated_layers(space)
    price = pricer(space, choice, zero=zero, micro_batches=m, global_batch=global_batch, dtype=dtype, layers=layers)

    def priced(k: int) -> Estimate:
        return price(layers[:k])

    found = ((), priced(0))
    if found[1].memory.fits or not layers:
        return found
    found = (tuple(layers), priced(len(layers)))
    lo, hi = 1, len(layers) - 1
    while found[1].memory.fits and lo <= hi:
        mid = (lo + hi) // 2
        estimate = priced(mid)
        if estimate.memory.fits:
            found, hi = (tuple(layers[:mid]), estimate), mid - 1
        else:
            lo = mid + 1
    return found


def _better(space: Space, options: list[tuple[int, ...] | None], zero: int, m: int, global_batch: int,
            dtype: str) -> tuple[tuple[int, ...], Estimate]:
    """The first of ``options`` (the solver's assignment, or a baseline's) with its Estimate, or a later one (data
    parallelism) where the estimate prices it faster within the same memory: the ILP charges every reading block its
    own conversion of a shared value (`conversions`), so its optimum can be a little off the estimate's."""
    best: tuple[tuple[int, ...], Estimate] | None = None
    for choice in dict.fromkeys(c for c in options if c is not None):  # each distinct assignment priced once
        estimate = estimate_choice(space, choice, zero=zero, micro_batches=m, global_batch=global_batch, dtype=dtype)
        if best is None or (estimate.memory.fits >= best[1].memory.fits
                            and estimate.iteration_seconds < best[1].iteration_seconds):
            best = (choice, estimate)
    assert best is not None  # options[0] is never None
    return best


# ---- naming and output ----------------------------------------------------------------------------------------


def _axis_labels(space: Space, choice: tuple[int, ...]) -> tuple[str, ...]:
    """Name each mesh axis by what the plan does on it: "dp" where most parameter bytes stay whole (the axis
    splits data), "tp" where most are sharded."""
    sizes = space.mesh.sizes
    whole = [0.0] * len(sizes)
    split = [0.0] * len(sizes)
    for block in space.representative:
        v = space.var_of[block.id]
        bc = space.cost.block_cost(block, space.candidates[v][choice[v]])
        for p in bc.params if bc else ():
            for a, placement in enumerate(p.layout):
                (split if isinstance(placement, Shard) else whole)[a] += p.numel * space.count[v]
    names = ["dp" if whole[a] >= split[a] else "tp" for a in range(len(sizes))]
    if len(set(names)) < len(names):  # two axes of one kind: number them, outermost first
        names = [f"{n}{i}" for i, n in enumerate(names)]
    return tuple(names)


def plan_of_choice(space: Space, choice: tuple[int, ...], *, global_batch: int, micro_batches: int = 1, zero: int = 0,
                   dtype: str = "bf16", kind: str = "ilp", recompute: Sequence[str] = ()) -> IntraPlan:
    """The intra-op plan of one assignment (``choice``: a candidate per variable of ``space``, traced at the
    micro-batch size), priced: what a search would return had it chosen that assignment. Tests and benchmarks
    use it to run assignments no search would pick. ``recompute``: layers recomputed in full (see `repeated_layers`)."""
    estimate = estimate_choice(space, choice, zero=zero, micro_batches=micro_batches, global_batch=global_batch,
                               dtype=dtype, recompute=recompute)
    return IntraPlan(kind=kind, space=space, choice=tuple(choice), zero=zero, micro_batches=micro_batches,
                     micro_batch_size=global_batch // micro_batches, estimate=estimate, recompute=tuple(recompute))


def repeated_layers(space: Space) -> list[str]:
    """The repeated layers of ``space``'s model (what an intra-op plan may recompute), in the order they run."""
    return list(dict.fromkeys(b.layer for b in space.blocks.blocks if space.count[space.var_of[b.id]] > 1))


def choice_of(space: Space, blocks: Sequence[Block]) -> tuple[int, ...]:
    """The candidate per variable that an intra-op plan's ``blocks`` name (by each block's split): the inverse of
    `intra_plan`. Raises ValueError naming the first block the space does not have, or whose split it cannot
    make (a plan made for another model or mesh)."""
    ic = space.cost
    by_id = {b.id: b for b in blocks}
    choice: list[int | None] = [None] * len(space.candidates)
    for block in space.blocks.blocks:
        named = by_id.get(block.id)
        leader = space.graph.node(block.leader).module
        if named is None or named.module != leader:
            raise ValueError(f"the plan has no block {block.id} at module {leader!r}: was it made for another model?")
        v = space.var_of[block.id]
        found = next((k for k, c in enumerate(space.candidates[v]) if ic.describe(block, c) == named.split), None)
        if found is None or choice[v] not in (None, found):
            raise ValueError(f"the plan splits module {leader!r} as {named.split!r}, which this mesh and model do "
                             "not offer (or not alike in every layer)")
        choice[v] = found
    return tuple(c if c is not None else 0 for c in choice)


def repriced(plan: Plan, graph: Graph, cluster: Cluster, *, dtype: str = "fp32", ops: Any = None) -> IntraPlan:
    """An intra-op ``plan`` (as written) priced again for ``graph`` (its model traced at its micro-batch size) on
    ``cluster`` sized to it: its blocks' splits, micro-batching and ZeRO stage as the plan says; ``ops``: measured
    op times (`autopar.profiling.ops.OpTimes`)."""
    mesh = build_mesh(cluster, {f"x{i}": n for i, n in enumerate(plan.mesh.shape)})
    space = build_space(graph, mesh, cluster, kernels=plan.kernels, scatter_partials=plan.kind != "megatron",
                        ops=ops, traced_batch=plan.micro_batch_size)
    choice = choice_of(space, plan.blocks)
    estimate = estimate_choice(space, choice, zero=plan.zero, micro_batches=plan.micro_batches,
                               global_batch=plan.micro_batch_size * plan.micro_batches, dtype=dtype,
                               recompute=plan.recompute)
    return IntraPlan(kind=plan.kind, space=space, choice=choice, zero=plan.zero, micro_batches=plan.micro_batches,
                     micro_batch_size=plan.micro_batch_size, estimate=estimate, recompute=plan.recompute)


def measured_share(plan: IntraPlan) -> float:
    """The share of ``plan``'s iteration that measured op times (`autopar profile-ops`) priced; 0 without them."""
    space, m = plan.space, plan.micro_batches
    measured = 0.0
    for cls in space.classes:
        bc = space.cost.block_cost(cls.block, space.candidates[cls.var][plan.choice[cls.var]])
        measured += cls.count * m * (bc.measured if bc is not None else 0.0)
    return measured / plan.estimate.iteration_seconds if plan.estimate.iteration_seconds else 0.0


def axis_names(plan: IntraPlan) -> tuple[str, ...]:
    return _axis_labels(plan.space, plan.choice)


def _reduced(use: ParamUse) -> tuple[int, ...]:
    """The axes a parameter's gradient is summed over, as the plan records them: those that hold it whole (a
    gradient priced as summed where its weight is split would be a pricing the runtime cannot follow; left out,
    the plan-time rehearsal then finds the runtime's collectives differ and refuses the plan)."""
    return tuple(a for a in use.reduce_axes if use.layout[a].is_replicate())


def intra_plan(plan: IntraPlan, model: str, workload: Workload | None = None) -> Plan:
    """The typed plan: mesh, micro-batching, ZeRO stage, per-block choices and per-module layouts."""
    space, ic = plan.space, plan.space.cost
    names = axis_names(plan)
    blocks = []
    params: dict[str, dict[str, ParamLayout]] = {}
    edges: dict[str, tuple] = {}
    reads: dict[str, dict[str, tuple]] = {}
    for block in space.blocks.blocks:
        v = space.var_of[block.id]
        cand = space.candidates[v][plan.choice[v]]
        bc = ic.block_cost(block, cand)
        leader = space.graph.node(block.leader)
        blocks.append(Block(id=block.id, layer=block.layer, module=leader.module, split=ic.describe(block, cand)))
        params.setdefault(leader.module, {})
        edges[leader.module] = ic.leading_edges(block, cand)
        for p in bc.params:
            fqn = ic.locate(block, p.key)
            params.setdefault(fqn.rpartition(".")[0], {})[fqn] = ParamLayout(name=fqn, placements=tuple(p.layout),
                                                                             reduced=_reduced(p))
        for key, (need, _) in bc.entries.items():  # a tied weight, read here in the layout the block needs
            if key[0] == "param":
                reader = space.graph.node(block.nodes[key[1]]).module
                reads.setdefault(reader, {})[ic.locate(block, key)] = tuple(need)
    held = {name: layout.placements for layouts in params.values() for name, layout in layouts.items()}
    reads = {fqn: {name: need for name, need in found.items() if held.get(name) != need}
             for fqn, found in reads.items()}
    for fqn, found in reads.items():
        if found:
            params.setdefault(fqn, {})
    modules = tuple(
        ModuleLayout(fqn=fqn, params=tuple(layouts.values()), input=edges.get(fqn, (None, None))[0],
                     output=edges.get(fqn, (None, None))[1], reads=tuple(reads.get(fqn, {}).items()))
        for fqn, layouts in params.items()
    )
    return Plan(model=model, kind=plan.kind, mesh=PlanMesh(shape=tuple(space.mesh.sizes), axes=tuple(names)),
                micro_batch_size=plan.micro_batch_size, micro_batches=plan.micro_batches, zero=plan.zero,
                kernels=ic.kernels, blocks=tuple(blocks), recompute=plan.recompute, modules=modules, workload=workload,
                estimate=plan.estimate)
