"""Pipeline cost model (Aceso §3.3): uneven stages, each with its own dp x tp and per-layer recomputation.

A configuration cuts the chain of profile rows (embedding, layers, head) into contiguous stages. Stage ``s`` holds
``N / pp`` devices as a (dp_s, tp_s) grid, tp innermost. A micro-batch of ``B`` samples crosses the pipeline; stage
``s`` splits it ``dp_s`` ways, so each device runs ``B / dp_s`` samples, and its tensor-parallel layers ``tp_s``
ways. The graph is traced once, at any batch ``b``: a transformer's or a CNN's work, bytes and activations are
linear in the batch, so a node costs its roofline time with its work scaled by ``(B / dp_s) / b`` (and divided by
``tp_s`` where TP splits it; the per-kernel overhead is paid once), and TP collectives scale the same way. Per
micro-batch, stage ``s`` takes ``t_s = f_s + b_s`` (compute, its TP communication, and the point-to-point sends to
its neighbours); recomputation adds forward work to ``b_s``. Gradient synchronisation over each stage's dp axis is
counted as `autopar.cost.memory.gradient_sync` counts it: DDP buckets under ZeRO 0, per FSDP unit (each repeated
layer, and the stage's other parameters) under ZeRO 1-3.

The iteration is simulated (`autopar.cost.simulator`, FlexFlow's task-graph simulator): every stage x micro-batch
x (forward, recomputation, backward), every send and every dp collective on per-device FIFO streams, in the order
torch.distributed.pipelining runs the schedule, DDP buckets and FSDP units overlapped with the backward; the
estimate's iteration and its compute / exposed communication / bubble split are the timeline's, on its critical
device. A model built with ``screen=True`` prices by the closed form instead,

    iteration = m * max_d T_d + (sum_d T_d - max_d T_d) / v + max_d exposed_d

for ``m`` micro-batches, ``T_d`` the time per micro-batch of device ``d`` (its stage's ``t_s``, or under
interleaved 1F1B the sum over its ``v`` chunks, stage ``s`` on device ``s % pp``; ``v = 1`` otherwise) and
``exposed_d`` the part of its data-parallel collectives its compute does not hide, in closed form as the simulator
overlaps them (`simulator.exposed_sync`; with ``overlap`` off, all of them after the last backward): it is what the
searches rank thousands of configurations by. Pricing a
configuration's stages takes about 2 ms; simulating it adds 1 ms to 1 s (a task per stage, micro-batch, FSDP unit
and collective: 50,000 tasks for gpt3-175b at pp 8 under ZeRO 3), and `autopar plan` prices ~10,000
configurations for gpt3-175b on 1,024 GPUs. Delta simulation (`PipelineSimulation.change`) re-times a one-stage
change some 15x faster than a full simulation, but a change reaches most of a pipeline's later tasks and the
searches change the depth, the micro-batch or ZeRO as often as one stage, so it does not bring simulation to the
closed form's cost. The plans a user sees, the chosen one, its runners-up and the baselines, are re-priced by the
simulator, and the best simulated of them is the plan (`autopar.api.search.simulated`).

Memory per stage is its peak as the runtime allocates it (`autopar.cost.stage_memory`, `autopar.cost.memory`):
model states of its parameters (what TP splits over ``tp_s``) as its data-parallel wrapper holds them, the
micro-batches in flight (1F1B: ``pp - s``, GPipe: ``m``, interleaved: Megatron's warm-up count), each layer's
backward walked op by op, the schedule's buffers; the device reserve apart.

The collectives each stage's devices issue are counted per call (`StageReport.collectives`), the way the runtime
issues them: ``autopar run --check-comm`` and ``autopar dryrun`` compare the two.

A stage marked ``intra`` prices each repeated layer by the intra-op planner's layout of it on the stage's tp axis
where that is faster than Megatron's (`cost.intra_layers`), with the gradient all-reduce over tp its whole-kept
weights need once an iteration.

Layer prices are cached by (layer signature, tp, samples per device, recompute, sp): repeated layers are priced
once, so a configuration of a 1,000-layer model costs a sum over its layers, not a pass over its nodes.
"""

from __future__ import annotations

import itertools
import operator
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

from autopar.capture import Graph, StateInfo
from autopar.cluster import Cluster, Collective, build_mesh, collective_seconds
from autopar.cluster.calls import CommCall, Phase, merge_calls
from autopar.cost.checkpoint import SegmentCosts, check_segments, segment_costs
from autopar.cost.intra_layers import Conditions, IntraLayers, LayerLayout
from autopar.cost.layers import ExpertGroup, LayerCost, analyse, experts_in
from autopar.cost.memory import Precision, ddp_buckets, flat_buckets, gradient_itemsize, gradient_sync
from autopar.cost.simulator import PipelineSimulation, PipelineSpec, StageTimes, Unit, closed_form, exposed_sync
from autopar.cost.stage_memory import StageMemoryModel
from autopar.cost.types import KERNELS, RECOMPUTE, SCHEDULES, CollectiveUse, Estimate, MemoryBreakdown
from autopar.cost.uses import collective_uses
from autopar.plan.records import expert_parallel_limits
from autopar.profiling.db import UnitEntry, unit_fingerprint


@dataclass(frozen=True, slots=True)
class LayerPrice:
    """One layer for one micro-batch on one device of a stage."""

    forward: float
    backward: float  # recomputed forward included
    comm_forward: float
    comm_backward: float
    activations: float  # bytes kept until its backward
    temporary: float
    params: float  # parameters on one device: what TP splits divided by tp, the rest whole
    collectives: tuple[CommCall, ...]  # on the tp axis per micro-batch, merged (`merge_calls`)
    # the forward's collectives alone (what a recomputing segment replays), and its last ones, which a segment
    # ending in this layer does not replay (checkpointing stops once it has every saved tensor: those after the
    # last op that saves one), with their seconds; none where a post-norm saves the last reduction's output
    forward_collectives: tuple[CommCall, ...] = ()
    tail: tuple[CommCall, ...] = ()
    tail_seconds: float = 0.0
    measured: bool = False  # forward and backward are a profile database's times (their collectives inside)
    measured_ops: float = 0.0  # seconds of forward and backward the profile database's op times priced


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    start: int  # first profile row (index into the layer chain)
    end: int  # one past the last
    tp: int = 1
    dp: int = 1
    recompute: tuple[str, ...] = ()  # per row of the stage; empty: "none" everywhere
    # checkpointed runs of two or more rows, [start, end) each, nested or disjoint (`cost.checkpoint`); a run keeps
    # only its input and replays its forward in the backward. Rows inside one are "none" or "full" (a one-row run)
    segments: tuple[tuple[int, int], ...] = ()
    # lay each repeated layer out by the intra-op planner's choice on the tp axis (`cost.intra_layers`) where that
    # is faster than Megatron's column/row pairs
    intra: bool = False
    # an intra stage's layouts as a plan records them, (row, ((module inside the row, split), ...)) per row laid out
    # (the rows not named keep Megatron's): priced as written rather than chosen again (`PipelineModel.stage_view`),
    # so that a plan is checked against what it says on any cluster. None: chosen by the cost model
    layouts: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] | None = None
    # worked out once: the searches look stages up by hash hundreds of thousands of times (`__setstate__`)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __setstate__(self, state: list) -> None:
        """Unpickled: the fields, and a hash of this process's (a string's hash differs between processes)."""
        for f, value in zip(fields(self), state):
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "_hash", self._key_hash())

    def _key_hash(self) -> int:
        return hash((self.start, self.end, self.tp, self.dp, self.recompute, self.segments, self.intra, self.layouts))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", self._key_hash())
        if not 0 <= self.start < self.end:
            raise ValueError(f"stage rows [{self.start}, {self.end}) are empty or negative")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"stage tp and dp must be positive, got tp={self.tp}, dp={self.dp}")
        if self.recompute and len(self.recompute) != self.end - self.start:
            raise ValueError("stage recompute needs one entry per row")
        if not _LEVELS.issuperset(self.recompute):  # one pass in C: a 1,000-row stage is made many times a search
            bad = next(r for r in self.recompute if r not in _LEVELS)
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {bad!r}")
        if self.segments:
            check_segments(self.segments, self.start, self.end, self.recompute_of)
        if self.intra and self.tp == 1:
            raise ValueError("intra-op layer layouts need a stage with tp > 1")
        if self.layouts is not None and (not self.intra
                                         or any(not self.start <= r < self.end for r, _ in self.layouts)):
            raise ValueError("a stage's recorded layer layouts need an intra stage, and rows of its own")

    def recompute_of(self, row: int) -> str:
        return self.recompute[row - self.start] if self.recompute else "none"

    def recomputed_rows(self) -> set[int]:
        """Rows recomputed in any way: a level other than none, or inside a checkpointed run."""
        rows = {r for r in range(self.start, self.end) if self.recompute_of(r) != "none"}
        return rows.union(*(range(a, b) for a, b in self.segments))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineConfig:
    stages: tuple[Stage, ...]
    micro_batch: int  # samples per micro-batch (what the graph was traced at)
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    chunks: int = 1  # interleaved 1F1B: stages per device, stage v on device v % pp
    # expert parallelism: each mixture's experts split over ``ep`` data-parallel ranks, their tokens moved to them
    # and back by all-to-alls (`PipelineModel.expert_parallel`); so far ep is every stage's whole dp
    # (`expert_parallel_limits`)
    ep: int = 1

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        if type(self.ep) is not int or self.ep < 1:
            raise ValueError(f"ep must be a positive integer, got {self.ep!r}")
        reason = expert_parallel_limits(self.ep, [(s.dp, s.tp) for s in self.stages])
        if reason:
            raise ValueError(reason)
        if (self.schedule == "interleaved") != (self.chunks > 1):
            raise ValueError(f"the interleaved schedule needs 2 or more chunks per device and only it does, got "
                             f"schedule {self.schedule!r} with {self.chunks} chunks")
        if len(self.stages) % self.chunks or (self.chunks > 1 and len(self.stages) // self.chunks < 2):
            raise ValueError(f"{len(self.stages)} stages do not make {self.chunks} chunks on each of 2 or more devices")
        if self.chunks > 1 and len({(s.dp, s.tp) for s in self.stages}) > 1:
            raise ValueError("an interleaved pipeline needs one dp x tp grid for all its stages")
        for a, b in zip(self.stages, self.stages[1:]):
            if a.end != b.start:
                raise ValueError(f"stages must be contiguous: one ends at row {a.end}, the next starts at {b.start}")
        sizes = {s.tp * s.dp for s in self.stages}
        if len(sizes) != 1:
            raise ValueError(f"every stage needs the same device count (tp x dp), got {sorted(sizes)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0-3, got {self.zero}")

    @property
    def pp(self) -> int:
        """Pipeline depth in devices (stages over chunks)."""
        return len(self.stages) // self.chunks

    @property
    def devices(self) -> int:
        return self.pp * self.stages[0].tp * self.stages[0].dp


@dataclass(slots=True)
class StageReport:
    """Per-stage figures the search reads to find the bottleneck."""

    compute: float  # per micro-batch, forward and backward (recomputation included)
    comm: float  # per micro-batch: TP collectives and point-to-point sends
    sync: float  # gradient synchronisation per iteration
    memory: MemoryBreakdown
    # of ``sync``, what the stage's compute does not hide when data-parallel collectives overlap it
    # (`simulator.exposed_sync`): the screen's, where the simulator is not run
    exposed: float = 0.0
    calls: tuple[CommCall, ...] = ()  # per iteration on each device (`collectives` sums those of one collective)
    parts: _Split | None = None  # what the simulator needs beyond the figures above (`cost.simulator`)

    @property
    def collectives(self) -> tuple[CollectiveUse, ...]:
        """What one device of the stage issues in an iteration."""
        return collective_uses(self.calls)

    @property
    def seconds(self) -> float:
        return self.compute + self.comm


@dataclass(frozen=True, slots=True)
class StageView:
    mesh: object
    samples: float
    in_flight: float
    price: Callable[[int, str], LayerPrice]  # (row, recompute level) -> its price on one device
    layouts: dict  # row -> `LayerLayout`, for rows the stage lays out by the intra-op planner
    units_measured: int = 0  # the ZeRO stage the repeated layers were timed under as FSDP units (1, 3), or 0
    # ZeRO 1: the repeated layers' times hold their share of their units' once-a-step gathers and reduce-scatters
    # (measured at a step's edges), which `_price_sync` then prices at nothing
    steps_measured: bool = False


@dataclass(slots=True)
class PipelineEstimate:
    estimate: Estimate
    stages: list[StageReport] = field(default_factory=list)
    # the simulated iteration its estimate reads; None when the closed form priced it (a search's screen)
    simulation: PipelineSimulation | None = None
    # how the searches rank it (`search.pipeline.score`), worked out once: they ask for it many times
    ranking: tuple[bool, float] | None = field(default=None, repr=False, compare=False)


_LEVELS = frozenset(RECOMPUTE)
_REPORTS_KEPT = 200_000  # stage reports cached before the cache starts again


class RangeMax:
    """The largest of ``values[a:b]`` in constant time, after a set-up of n log n (a sparse table): asked for
    every stage a search makes, of a chain of any depth."""

    __slots__ = ("_table",)

    def __init__(self, values: Sequence[float]) -> None:
        self._table = [list(values)]
        width = 1
        while 2 * width <= len(values):
            row = self._table[-1]
            self._table.append(list(map(max, row[:len(row) - width], row[width:])))
            width *= 2

    def __call__(self, a: int, b: int) -> float:
        if not 0 <= a < b <= len(self._table[0]):
            raise ValueError(f"[{a}, {b}) is not a non-empty range of the {len(self._table[0])} values")
        level = (b - a).bit_length() - 1
        row = self._table[level]
        return max(row[a], row[b - (1 << level)])


class PipelineModel:
    """Prices pipeline configurations of one traced graph on one cluster (layer prices cached)."""

    def __init__(self, graph: Graph, cluster: Cluster, *, traced_batch: int, dtype: str = "bf16",
                 screen: bool = False, kernels: str = "eager", precision: Precision | None = None,
                 vocab_parallel: bool = False, scatter_gather_sends: bool = False,
                 profile=None) -> None:  # noqa: ANN001 - an autopar.profiling.ProfileDB
        """``vocab_parallel`` and ``scatter_gather_sends`` price Megatron-LM's vocabulary split
        (`autopar.cost.vocab`) and pipeline sends (`_send`) where autopar's runtime does otherwise (the default).
        ``profile`` (an `autopar.profiling.ProfileDB`): layers it has measured under a layout are priced by its
        times, the rest by the roofline (`measured_share` says how much of an estimate was measured)."""
        self.graph = graph
        self.screen = screen  # estimate by the closed form unless asked to simulate (searches' screen)
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        self.kernels = kernels  # how memory-bound ops run: one kernel each, or fused (`compute.sequence_seconds`)
        self.traced_batch = traced_batch
        self.cluster = cluster
        self.dtype = dtype
        self.precision = precision or Precision.of(dtype)  # bytes per parameter of each model state
        self.vocab_parallel, self.scatter_gather_sends = vocab_parallel, scatter_gather_sends
        self.layers = analyse(graph)
        self.profile = profile
        self.op_times = None  # the profile database's op times (`autopar.profiling.ops.OpTimes`), if it has any
        if profile is not None:
            from autopar.profiling.segments import row_fingerprints

            self._fingerprints = row_fingerprints(self)
            self._ranks = cluster.ranks_per_host
            self.op_times = profile.op_times(ranks=self._ranks, dtype=dtype) or None
        ids: dict[tuple, int] = {}  # layers that price alike share an id (a cheap price-cache key)
        self._signature = [ids.setdefault(self._layer_signature(layer), len(ids)) for layer in self.layers]
        self._prices: dict[tuple, LayerPrice] = {}
        self._params: dict[tuple, float] = {}
        self._meshes: dict[tuple[int, int, int], object] = {}
        # a stage's gradient synchronisation (seconds, collectives, units), by its shape
        self._syncs: dict[tuple, tuple[float, tuple[CommCall, ...], tuple]] = {}
        self.intra_layers = IntraLayers(self)
        self._layouts: dict[tuple, dict[int, LayerLayout]] = {}  # an intra stage's layer layouts, by its shape
        # stage reports by what they depend on (`_report_key`): a configuration one search step changed re-prices
        # only the stages it changed
        self._reports: dict[tuple, StageReport] = {}
        self._stage_keys: dict[Stage, tuple] = {}  # `stage_key`'s, by stage
        self._alike: dict[Stage, list[tuple[int, int]]] = {}  # `_alike_rows`' of stages without layouts
        self._heaviest: dict[tuple[int, int], tuple[int, ...]] = {}  # `heaviest_first`
        self._calls: dict[tuple, tuple] = {}  # stage reports' calls, one object for alike ones
        self.memory = StageMemoryModel(self)  # stages' peaks as the runtime allocates them
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._tied = [(row, index[owner], size) for row, layer in enumerate(self.layers)  # (reader, owner, size)
                      for owner, size in layer.tied if owner in index]

    @cached_property
    def _row_params(self) -> list[list[StateInfo]]:
        """Each row's trainable parameters (a parameter of no row's module: the last row's)."""
        index = {layer.name: row for row, layer in enumerate(self.layers)}
        rows: list[list[StateInfo]] = [[] for _ in self.layers]
        for info in self.graph.state.values():
            if not info.is_buffer and info.requires_grad:
                rows[index.get(self.graph.layer_of(info.fqn.rpartition(".")[0]), len(self.layers) - 1)].append(info)
        return rows

    def _root_unit(self, stage: Stage, zero: int) -> UnitEntry | None:
        """The profile database's measurement of ``stage``'s root FSDP unit (its rows outside the repeated layers)
        under ZeRO 1-3 without tensor parallelism, if it has one: measured by its parameters' shapes, which a weight
        both pipeline ends hold would change (then none)."""
        if self.profile is None or zero == 0 or stage.tp > 1 or stage.dp == 1:
            return None
        inside = range(stage.start, stage.end)
        if any((row in inside) != (owner in inside) for row, owner, _ in self._tied):
            return None
        shapes = [info.tensor.shape for row in range(stage.start, stage.end) if not self.layers[row].repeated
                  for info in self._row_params[row]]
        if not shapes:
            return None
        return self.profile.unit(unit_fingerprint(shapes), dp=stage.dp, ranks=self._ranks, dtype=self.dtype)

    def root_units_measured(self, config: PipelineConfig) -> int:
        """How many of ``config``'s stages have their root unit's gathers and reduce-scatters from the profile
        database (the rest from the links)."""
        return sum(self._root_unit(stage, config.zero) is not None for stage in config.stages)

    @cached_property
    def _ddp_gradients(self) -> tuple[int, ...]:
        """Elements of each trainable parameter in the order its gradient becomes ready in the backward, the
        order DDP rebuilds its buckets in after the first step: rows last to first, and in a row its parameters
        last read first (a tied weight once, in the row that owns it, whose read comes first)."""
        return self._ddp_order(experts=True)

    @cached_property
    def _ddp_gradients_but_experts(self) -> tuple[int, ...]:
        """`_ddp_gradients` without the experts' (expert parallelism: DDP leaves each rank's experts alone)."""
        return self._ddp_order(experts=False)

    def _ddp_order(self, *, experts: bool) -> tuple[int, ...]:
        rows = self._row_params
        skipped = set() if experts else {g.module for groups in self.expert_groups for g in groups}
        order: list[int] = []
        for row in reversed(range(len(self.layers))):
            read: dict[str, int] = {}
            for node in self.layers[row].nodes:
                for source in node.sources:
                    if source.state is not None:
                        read.setdefault(source.state, len(read))
            ranked = sorted(rows[row], key=lambda info: read.get(info.fqn, len(read)))
            order += [info.tensor.numel for info in reversed(ranked) if info.fqn.rpartition(".")[0] not in skipped]
        return tuple(order)

    @cached_property
    def split_widths(self) -> frozenset[int]:
        """Sizes tensor parallelism must divide: the repeated layers' attention heads (query and key/value heads,
        as the runtime requires) and column-parallel outputs (read once; the search asks for every configuration it
        changes)."""
        return frozenset(self._split_width_places)

    def split_width_where(self, width: int) -> str:
        """What in the repeated layers has ``width`` (one of `split_widths`): the first module whose column output
        or attention heads have it, as ``module 'name' (its type, its output features)`` or ``module 'name' (its
        attention heads)``."""
        return self._split_width_places.get(width, "the model")

    @cached_property
    def _split_width_places(self) -> dict[int, str]:
        """Each width of `split_widths` and the first module that has it, in one pass over the repeated layers."""
        places: dict[int, str] = {}
        for layer in self.layers:
            if not layer.repeated:
                continue
            for node in layer.nodes:
                if node.id in layer.columns and node.outputs:
                    places.setdefault(node.outputs[0].shape[-1],
                                      f"module {node.module!r} ({node.module_type}, its output features)")
                whole = self.graph.multi_query_of(node.module) is not None  # kept whole: its heads are not split
                if "scaled_dot_product" in node.op and node.inputs and not whole:  # query and key/value heads (GQA)
                    for t in node.inputs[:3]:
                        if len(t.shape) == 4:
                            places.setdefault(t.shape[1], f"module {node.module!r} (its attention heads)")
        return places

    @staticmethod
    def _layer_signature(layer: LayerCost) -> tuple:
        return (
            layer.repeated, layer.params, layer.sharded_params, layer.sp_partial_params, layer.sp_partial_tensors,
            layer.tp_partial_params,
            len(layer.nodes), layer.saved_sharded, layer.saved_replicated, layer.input_bytes, layer.stream_input,
            sum(n.flops_forward for n in layer.nodes), sum(n.bytes_read + n.bytes_written for n in layer.nodes),
        )

    def price(self, row: int, *, tp: int, samples: float, recompute: str, sp: bool, mesh) -> LayerPrice:  # noqa: ANN001
        """Row ``row`` on one device running ``samples`` samples of a micro-batch, in Megatron's layout on the
        stage's ``tp`` devices, priced by the block model (`IntraLayers.row_prices`); a row outside the repeated
        layers is not recomputed (its price at "none" for every level)."""
        tp_axis = mesh.axis("tp")
        key = (self._signature[row], self.intra_layers.price_key(row), tp, samples, recompute, sp, tp_axis)
        found = self._prices.get(key)
        if found is None:
            prices = self.intra_layers.row_prices(row, tp_axis, samples=samples, sp=sp)
            if prices is None:
                raise ValueError(f"{self.layers[row].name or 'the model'}: Megatron's layout over tp {tp} does not "
                                 "apply to it")
            found = prices.get(recompute, prices["none"])
            if self.profile is not None:
                found = self._measured(row, found, tp=tp, samples=samples, recompute=recompute, sp=sp)
            self._prices[key] = found
        return found

    def _measured(self, row: int, price: LayerPrice, *, tp: int, samples: float, recompute: str, sp: bool,
                  zero: int = 0) -> LayerPrice:
        """``price`` with the profile database's forward and backward where it measured this row's layer under
        this layout (its tensor-parallel collectives are inside them, so they are priced at nothing apart; under
        ``zero`` 3 its unit's gathers and reduce-scatter too, which `_price_sync` then prices at nothing)."""
        entry = self._entry(row, tp=tp, samples=samples, recompute=recompute, sp=sp, zero=zero)
        if entry is None:
            return price
        return replace(price, forward=entry.forward, backward=entry.backward, comm_forward=0.0, comm_backward=0.0,
                       tail_seconds=0.0, measured=True)

    def _entry(self, row: int, *, tp: int, samples: float, recompute: str, sp: bool, zero: int):  # noqa: ANN202
        key = self._fingerprints[row]
        if key is None or self.kernels != "eager":  # the runtime profiled runs eager kernels
            return None
        layer = self.layers[row]
        return self.profile.get(key, tp=tp, sp=sp, recompute=recompute if layer.repeated else "none",
                                samples=samples, ranks=self._ranks, dtype=self.dtype, zero=zero)

    def _at_edges(self, row: int, price: LayerPrice, *, tp: int, samples: float, recompute: str, sp: bool,
                  micro_batches: int) -> LayerPrice:
        """A measured ZeRO 1 ``price`` with its share of the layer's once-a-step work: a step's first forward
        gathers the unit's weights and its last backward reduce-scatters the gradients, timed by the profile
        database (`Entry.step_forward`); each of ``micro_batches`` carries 1 / ``micro_batches`` of the extra."""
        entry = self._entry(row, tp=tp, samples=samples, recompute=recompute, sp=sp, zero=1)
        forward = max(0.0, entry.step_forward - entry.forward) / micro_batches
        backward = max(0.0, entry.step_backward - entry.backward) / micro_batches
        return replace(price, forward=price.forward + forward, backward=price.backward + backward)

    def _steps_measured(self, stage: Stage, samples: float, sp: bool) -> bool:
        """Whether the profile database timed every repeated layer of ``stage`` at a ZeRO 1 step's edges (all or
        none, as `_units_measured`)."""
        for row, _ in self._alike_rows(stage):
            if self.layers[row].repeated:
                entry = self._entry(row, tp=stage.tp, samples=samples, recompute=stage.recompute_of(row), sp=sp,
                                    zero=1)
                if entry is None or entry.step_forward is None or entry.step_backward is None:
                    return False
        return True

    def _units_measured(self, stage: Stage, samples: float, sp: bool, zero: int) -> bool:
        """Whether the profile database timed every repeated layer of ``stage`` as its own FSDP unit under ZeRO
        ``zero`` (1 or 3) at its recomputation level: only then are those times used for them (ZeRO 3: their
        units' gathers and reduce-scatters inside; ZeRO 1: FSDP's work per micro-batch, its once-a-step
        collectives priced apart unless `_steps_measured`). All or none: a stage is never priced half one way."""
        if self.profile is None or stage.dp == 1 or zero not in (1, 3):
            return False
        return all(self._entry(row, tp=stage.tp, samples=samples, recompute=stage.recompute_of(row), sp=sp,
                               zero=zero) is not None
                   for row, _ in self._alike_rows(stage) if self.layers[row].repeated)

    def measured_share(self, config: PipelineConfig, *, global_batch: int) -> float:
        """The share of ``config``'s per-micro-batch layer time (compute and tensor-parallel collectives, over all
        stages) that the profile database measured: layers it timed whole, and ops it timed alone (`profile-ops`)
        in the others; 0 without one."""
        measured = total = 0.0
        for index, stage in enumerate(config.stages):
            view = self.stage_view(config, index, global_batch=global_batch)
            for row, count in self._alike_rows(stage, view.layouts):
                price = view.price(row, stage.recompute_of(row))
                seconds = count * (price.forward + price.backward + price.comm_forward + price.comm_backward)
                total += seconds
                measured += seconds if price.measured else count * price.measured_ops
        return measured / total if total else 0.0

    def device_params(self, row: int, tp_axis) -> float:  # noqa: ANN001 - an AxisPlacement
        """Parameters of row ``row`` one device of a stage holds in Megatron's layout on ``tp_axis`` (the block
        model's, `IntraLayers.row_params`)."""
        key = (self._signature[row], self.intra_layers.price_key(row), tp_axis)
        found = self._params.get(key)
        if found is None:
            found = self._params[key] = self.intra_layers.row_params(row, tp_axis)
        return found

    @cached_property
    def expert_groups(self) -> list[list[ExpertGroup]]:
        """Each row's mixtures of experts (`autopar.cost.layers.experts_in`)."""
        return [experts_in(self.graph, layer.nodes) for layer in self.layers]

    def row_expert_params(self, row: int) -> int:
        """Elements of the experts' parameters in row ``row``, whole (expert parallelism holds 1 / ep of them on
        each device, outside FSDP and the all-reduces)."""
        return sum(group.params for group in self.expert_groups[row])

    def expert_parallel(self, row: int, price: LayerPrice, level: str, *, ep: int, samples: float,
                        mesh) -> LayerPrice:  # noqa: ANN001 - a cluster Mesh
        """``price`` of row ``row`` with its experts split over ``ep`` data-parallel ranks, as the runtime runs
        them (`autopar.runtime.experts`): each device holds 1 / ep of the experts' parameters, and each
        micro-batch's forward issues per mixture three all-to-alls on dp (every expert's token count, then the
        token-expert pairs' hidden states to the ranks holding their experts, and the experts' outputs back), its
        backward two (the gradients of those two), a recomputed layer's backward the forward's three again.
        Compute is the experts' share of one process's (tokens spread evenly over the experts: routing decides
        the real spread, so the all-to-alls' sizes are this even spread's, not checked per rank); the pairs sent
        and received are transient memory beside the layer's, and the backward keeps one tensor of the received
        pairs' hidden states more than one process keeps (counted among the tensors autograd saves on the
        ranks), unless the layer is recomputed whole."""
        groups = self.expert_groups[row] if ep > 1 else []
        if not groups:
            return price
        axis = mesh.axis("dp")
        forward: list[CommCall] = []
        backward: list[CommCall] = []
        moved = held = kept = 0.0
        for group in groups:
            if group.experts % ep:
                raise ValueError(f"{group.module}: its {group.experts} experts do not split over ep {ep}")
            nbytes = group.rows * group.row_bytes * samples / self.traced_batch
            pairs = CommCall(kind=Collective.ALL_TO_ALL, axis="dp", bytes=nbytes, phase=Phase.FORWARD, calls=2)
            counts = CommCall(kind=Collective.ALL_TO_ALL, axis="dp", bytes=8 * group.experts, phase=Phase.FORWARD)
            forward += [counts, pairs]
            backward.append(pairs.during(Phase.BACKWARD))
            moved, held = max(moved, 2 * nbytes), held + group.params * (1 - 1 / ep)
            kept += nbytes if level != "full" else 0.0
        replayed = [c.during(Phase.BACKWARD) for c in forward] if level == "full" else []

        def seconds(calls: list[CommCall]) -> float:
            return sum(c.calls * collective_seconds(c.kind, c.bytes, axis, self.cluster) for c in calls)

        return replace(price, comm_forward=price.comm_forward + seconds(forward),
                       comm_backward=price.comm_backward + seconds(backward + replayed),
                       temporary=price.temporary + moved, params=price.params - held,
                       activations=price.activations + kept,
                       collectives=merge_calls([*price.collectives, *forward, *backward, *replayed]),
                       forward_collectives=merge_calls([*price.forward_collectives, *forward]), tail=(),
                       tail_seconds=0.0)

    def estimate(self, config: PipelineConfig, *, global_batch: int, simulate: bool | None = None,
                 overlap: bool = True) -> PipelineEstimate:
        """Price ``config``: simulated (`cost.simulator`, data-parallel collectives overlapped unless ``overlap``
        is False or the cluster's devices cannot overlap them, `Cluster.overlaps_communication`) unless
        ``simulate`` is False, or it is None on a model built with ``screen=True``: then the closed form prices it,
        and the result carries no simulation."""
        overlap = overlap and self.cluster.overlaps_communication
        if config.devices != self.cluster.num_devices:
            raise ValueError(f"the configuration uses {config.devices} devices, the cluster has {self.cluster.num_devices}")
        if config.stages[-1].end != len(self.layers):
            raise ValueError(f"stages cover rows 0..{config.stages[-1].end}, the model has {len(self.layers)}")
        if global_batch % config.micro_batch:
            raise ValueError(f"--batch {global_batch} is not a multiple of the micro-batch {config.micro_batch}")
        for s in config.stages:
            if config.micro_batch % s.dp:
                raise ValueError(f"micro-batch {config.micro_batch} does not split over dp {s.dp}")
        if config.ep > 1 and not any(self.expert_groups):
            raise ValueError(f"ep {config.ep} (expert parallelism) splits experts that hold one weight per expert and "
                             "run by a grouped matmul, as Hugging Face's do, and the model has none (a mixture whose "
                             "experts are modules of their own, an nn.ModuleList of MLPs, cannot be split so far)")
        m = global_batch // config.micro_batch
        pp, chunks, virtual = config.pp, config.chunks, len(config.stages)
        copies = self._tied_copies(config)
        reports: list[StageReport] = []
        for index, stage in enumerate(config.stages):
            key = self._report_key(config, index, m, copies.get(index))
            known = self._reports.get(key)
            if known is not None:  # a stage a search's one-stage change left as it was: priced once
                reports.append(known)
                continue
            view = self.stage_view(config, index, global_batch=global_batch)
            mesh = view.mesh
            fwd = bwd = comm = forward_tp = around = 0.0
            params = 0
            per_micro_batch: list[CommCall] = []  # the rows' tp collectives (and their segments' replays)
            split = _Split(view=view)  # the simulator's view of the same figures
            for row, count in self._alike_rows(stage, view.layouts):
                price = view.price(row, stage.recompute_of(row))
                fwd, bwd = fwd + count * price.forward, bwd + count * price.backward
                comm += count * (price.comm_forward + price.comm_backward)
                forward_tp += count * price.comm_forward
                if not self.layers[row].repeated:  # the root unit's compute (ZeRO 1-3)
                    around += count * (price.forward + price.backward)
                params += count * price.params
                per_micro_batch += price.collectives if count == 1 else [c.times(count) for c in price.collectives]
            extra = None
            if stage.segments:
                extra = segment_costs(stage, view.price)
                bwd, comm = bwd + extra.backward, comm + extra.comm
                split.replayed, split.replayed_tp = extra.backward, extra.comm
                per_micro_batch += extra.collectives
            on_compute = (fwd + forward_tp, bwd + comm - forward_tp)  # a micro-batch's, with its tp collectives
            stage_calls = [c.times(m) for c in merge_calls(per_micro_batch)]
            if virtual > 1:  # per micro-batch: activations to the next stage, gradients back to the previous one
                boundary = self._boundary_bytes(stage, config) * config.micro_batch / stage.dp / self.traced_batch
                sends = (index > 0) + (index < virtual - 1)
                split.send, calls = self._send(boundary, stage, config, mesh)
                comm += 2 * sends * split.send
                # counted where sent (a scatter/gather's all-gather: as many, where received)
                stage_calls += [c.times(sends * m) for c in calls]
            reduced = sum(layout.reduced for layout in view.layouts.values())
            if reduced and config.zero > 0 and stage.dp > 1:
                # weights a layout keeps whole while splitting their work, under ZeRO 1-3 across dp: FSDP sums each
                # one's gradient over tp on its own, whole, before it reduce-scatters them over dp (as it does the
                # norm weights' under sequence parallelism, below): once a step under ZeRO 1, every micro-batch
                # under ZeRO 2 and 3
                tensors = sum(layout.reduced_tensors for layout in view.layouts.values())
                seconds, call = self._one_by_one(reduced, tensors, 1 if config.zero == 1 else m, mesh)
                split.tp_once, comm = split.tp_once + seconds, comm + seconds / m
                stage_calls.append(call)
            elif reduced:  # weights a layout keeps whole while splitting their work: gradients summed over tp
                nbytes = reduced * gradient_itemsize(self.dtype)
                seconds = collective_seconds(Collective.ALL_REDUCE, nbytes, mesh.axis("tp"), self.cluster)
                split.tp_once, comm = split.tp_once + seconds, comm + seconds / m
                stage_calls.append(CommCall(kind=Collective.ALL_REDUCE, axis="tp", bytes=nbytes, phase=Phase.SYNC))
            alike = list(self._alike_rows(stage, view.layouts)) if stage.tp > 1 else []
            partial = sum(self.layers[r].sp_partial_params * n for r, n in alike if r not in view.layouts) \
                if config.sp else 0.0
            # replicated weights on the heads tp splits (q/k norms): each rank's share of their gradient, per rank
            # (a ZeRO shard of it under ZeRO 1-3)
            heads = sum(self.layers[r].tp_partial_params * n for r, n in alike if r not in view.layouts)
            # norm weights' gradients from sequence shards, and those: summed in one all-reduce (a layout's own
            # partial gradients are in ``reduced``). Under ZeRO 1-3 across dp, FSDP sums each norm weight's
            # gradient over tp on its own, whole, before it reduce-scatters them over dp: once a step under ZeRO 1,
            # every micro-batch under ZeRO 2 and 3
            fsdp_sums = config.zero > 0 and stage.dp > 1 and partial
            if fsdp_sums:
                tensors = sum(self.layers[r].sp_partial_tensors * n for r, n in alike if r not in view.layouts)
                seconds, call = self._one_by_one(partial, tensors, 1 if config.zero == 1 else m, mesh)
                split.tp_once, comm = split.tp_once + seconds, comm + seconds / m
                stage_calls.append(call)
                partial = 0.0
            if partial or heads:
                nbytes = (partial + heads / (stage.dp if config.zero else 1)) * gradient_itemsize(self.dtype)
                seconds = collective_seconds(Collective.ALL_REDUCE, nbytes, mesh.axis("tp"), self.cluster)
                split.tp_once, comm = split.tp_once + seconds, comm + seconds / m
                stage_calls.append(CommCall(kind=Collective.ALL_REDUCE, axis="tp", bytes=nbytes, phase=Phase.SYNC))
            copy = sum(size for size, holds_copy in copies.get(index, []) if holds_copy)
            params += copy
            sync, split.units = self._sync(stage, config.zero, m, mesh, stage_calls, extra=copy, view=view,
                                           ep=config.ep)
            for size, _ in copies.get(index, []):  # a weight both ends hold: gradients summed over pp
                # (under ZeRO 1-3 each rank sums its own shard of them)
                nbytes = size * gradient_itemsize(self.dtype) / (stage.dp if config.zero else 1)
                seconds = collective_seconds(Collective.ALL_REDUCE, nbytes, mesh.axis("pp"), self.cluster)
                split.pp_once, sync = split.pp_once + seconds, sync + seconds
                stage_calls.append(CommCall(kind=Collective.ALL_REDUCE, axis="pp", bytes=nbytes, phase=Phase.SYNC))
            memory = self.stage_memory(config, index, view, micro_batches=m, copy=copy, segments=extra)
            stage_calls = tuple(stage_calls)  # one object for alike stages' calls: `_issued` counts them by it
            stage_calls = self._calls.setdefault(stage_calls, stage_calls)
            exposed = _exposed(split, config.zero, m, *on_compute, around=around / max(fwd + bwd, 1e-30))
            reports.append(StageReport(compute=fwd + bwd, comm=comm, sync=sync, memory=memory,
                                       calls=stage_calls, parts=split, exposed=exposed))
            if len(self._reports) >= _REPORTS_KEPT:
                self._reports.clear()
            self._reports[key] = reports[-1]
        devices = _per_device(reports, pp) if chunks > 1 else reports
        simulate = not self.screen if simulate is None else simulate
        simulation = self._simulate(config, reports, m, overlap) if simulate else None
        iteration, compute, exposed, bubble = _timing(simulation, reports, devices, m, chunks, overlap)
        worst = max(devices, key=lambda r: r.memory.total / r.memory.budget)
        model_flops = (self.graph.flops_forward + self.graph.flops_backward) * m * config.micro_batch / self.traced_batch
        per_device = model_flops / iteration / self.cluster.num_devices
        estimate = Estimate(
            iteration_seconds=iteration,
            compute_seconds=compute,
            exposed_comm_seconds=exposed,
            bubble_seconds=bubble,
            throughput_samples_per_second=global_batch / iteration,
            tflops_per_device=per_device / 1e12,
            mfu=per_device / self.cluster.device.peak(self.dtype),
            memory=worst.memory,
            collectives=collective_uses(_issued(reports)),
            micro_batches=m,
            cluster=self.cluster.name,
        )
        return PipelineEstimate(estimate=estimate, stages=reports, simulation=simulation)

    def _one_by_one(self, params: float, tensors: int, times: int, mesh) -> tuple[float, CommCall]:  # noqa: ANN001
        """FSDP's sums over tp of ``tensors`` gradients of ``params`` elements in all, each whole on its own,
        ``times`` a step: their seconds, and the calls."""
        each = params * gradient_itemsize(self.dtype) / tensors
        seconds = times * tensors * collective_seconds(Collective.ALL_REDUCE, each, mesh.axis("tp"), self.cluster)
        return seconds, CommCall(kind=Collective.ALL_REDUCE, axis="tp", bytes=each, phase=Phase.SYNC,
                                 calls=times * tensors)

    def heaviest_first(self, start: int, end: int) -> tuple[int, ...]:
        """Rows ``start`` .. ``end`` - 1, those saving the most activations for backward first: where one more
        level of recomputation frees the most (the searches ask for it at every step)."""
        found = self._heaviest.get((start, end))
        if found is None:
            if len(self._heaviest) >= _REPORTS_KEPT:
                self._heaviest.clear()
            found = self._heaviest[(start, end)] = tuple(sorted(
                range(start, end), key=lambda r: -self.layers[r].saved_sharded - self.layers[r].saved_replicated))
        return found

    def _alike_rows(self, stage: Stage, layouts: dict | None = None) -> list[tuple[int, int]]:
        """The stage's rows as runs (first row, rows) that price alike: like rows (`_runs`) at one recomputation
        level and, where the stage has intra-op layouts (``layouts``), in one layout; a deep model's stage is
        priced per run."""
        found = None if layouts else self._alike.get(stage)
        if found is not None:
            return found
        ends = self._runs[1] if self._runs is not None else None
        levels = [stage.end]  # where each run of one recomputation level ends
        recompute = stage.recompute
        if recompute:  # the rows whose level differs from the next row's, found in C (stages are deep)
            changes = itertools.compress(range(stage.start + 1, stage.end),
                                         map(operator.ne, recompute[1:], recompute[:-1]))
            levels = [*changes, stage.end]
        runs, row, level = [], stage.start, 0
        while row < stage.end:
            while levels[level] <= row:
                level += 1
            stop = min(ends[row], levels[level]) if ends is not None else row + 1
            if layouts:
                end, stop = stop, row + 1
                while stop < end and layouts.get(stop) is layouts.get(row):
                    stop += 1
            runs.append((row, stop - row))
            row = stop
        if not layouts:
            if len(self._alike) >= _REPORTS_KEPT:
                self._alike.clear()
            self._alike[stage] = runs
        return runs

    def _report_key(self, config: PipelineConfig, index: int, m: int, copies: list | None) -> tuple:
        """What a stage's report depends on: the stage (`stage_key`), whether it is first or last, the
        micro-batches it holds, what its next stage sends back (the gradient buffer its memory holds), the
        configuration's global settings and the tied weights it shares; the stage tps where sends gather."""
        last = index == len(config.stages) - 1
        onward = None if last else self._boundary_bytes(config.stages[index + 1], config)
        tps = tuple(s.tp for s in config.stages) if self.scatter_gather_sends else ()
        in_flight = _in_flight(config.schedule, index, config.pp, config.chunks, m)
        return (self.stage_key(config.stages[index]), index == 0, onward, in_flight, len(config.stages),
                config.chunks, config.schedule, config.micro_batch, config.zero, config.sp, m, tuple(copies or ()),
                tps, config.ep)

    def stage_key(self, stage: Stage) -> tuple:
        """`_stage_key`, kept by stage."""
        found = self._stage_keys.get(stage)
        if found is None:
            if len(self._stage_keys) >= _REPORTS_KEPT:
                self._stage_keys.clear()
            found = self._stage_keys[stage] = self._stage_key(stage)
        return found

    def _stage_key(self, stage: Stage) -> tuple:
        """What a stage's own figures depend on: its width, recomputation and checkpointed runs, and its rows by
        content (`_runs`), so a stage priced at one place stands for a stage of the same rows at another (a
        search moving a cut, the middle stages of an even pipeline); its place itself where its rows cannot stand
        for others (intra-op layouts, which are laid out per row)."""
        runs = self._runs
        if runs is None or stage.intra:
            return (stage,)
        content = runs[0]
        parts = tuple((content[row], count) for row, count in self._alike_rows(stage))
        segments = tuple((a - stage.start, b - stage.start) for a, b in stage.segments)
        return (parts, stage.tp, stage.dp, stage.recompute, segments)

    @cached_property
    def _runs(self) -> tuple[list, list[int]] | None:
        """Per row, what it holds for a stage (rows alike share it: same price signature and own buffers) and one
        past the run of like rows it starts; a row a stage treats by its place (split at the loss, tied to
        another, running no op) is its own. None where the backward does not meet like rows in chain order: then
        stages are known by their place."""
        memory = self.memory
        special = set(memory._split_rows) | {row for reader, owner, _ in self._tied for row in (reader, owner)}
        own, met = memory._buffers[1], memory._met_at
        content: list = [("row", row) if row in special or not layer.nodes else
                         (self._signature[row], own.get(row, 0.0)) for row, layer in enumerate(self.layers)]
        order = [met[row] for row, key in enumerate(content) if key[0] != "row"]
        if any(b <= a for a, b in zip(order, order[1:])):
            return None
        ends = [len(content)] * len(content)
        for row in range(len(content) - 2, -1, -1):
            ends[row] = ends[row + 1] if content[row + 1] == content[row] else row + 1
        return content, ends

    def _simulate(self, config: PipelineConfig, reports: list[StageReport], m: int,
                  overlap: bool) -> PipelineSimulation:
        stages = tuple(r.parts.times(self.layers, s, config.zero) for r, s in zip(reports, config.stages))
        spec = PipelineSpec(stages=stages, micro_batches=m, schedule=config.schedule, chunks=config.chunks,
                            zero=config.zero, overlap=overlap)
        simulation = PipelineSimulation.full(spec)
        cores, devices = self.cluster.device.host_cores, len(config.stages) // config.chunks
        if (cores is not None and self.cluster.device.is_cpu and self.cluster.nodes == 1
                and self.cluster.num_devices > cores and devices > 1):
            # CPU ranks, more than the host's cores: a stage waiting in the pipeline's fill or drain leaves its
            # cores to the busy ones, which then run faster than measured with every rank busy
            ranks = tuple(config.stages[d].tp * config.stages[d].dp for d in range(devices))
            simulation = simulation.shared(ranks, self._pace(sum(ranks), cores))
        return simulation

    def _pace(self, ranks: int, cores: int) -> Callable[[int], float]:
        """How long a task takes with k of the host's ``ranks`` busy, as a share of its time with all of them
        (what the profile and the calibration measured): as the profile database measured layers with k and
        with ``ranks`` ranks on the host (`ProfileDB.pace`), else the cores shared out evenly,
        max(k, cores) / max(ranks, cores)."""
        measured: dict[int, float | None] = {}

        def pace(k: int) -> float:
            if k >= ranks:
                return 1.0
            if k not in measured:
                measured[k] = self.profile.pace(k, ranks, dtype=self.dtype) if self.profile is not None else None
            found = measured[k]
            return found if found is not None else max(k, cores) / max(ranks, cores)

        return pace

    def stage_memory(self, config: PipelineConfig, index: int, view: StageView, *, micro_batches: int,
                     copy: float = 0.0, segments: SegmentCosts | None = None) -> MemoryBreakdown:
        """Peak bytes on one device of stage ``index`` as the runtime allocates them, the device reserve apart
        (`autopar.cost.stage_memory`); ``copy``: parameters of a tied weight's copy the stage holds."""
        return self.memory.peak(config, index, view, micro_batches=micro_batches, copy=copy, segments=segments)

    def held_bytes(self, config: PipelineConfig, index: int, *, global_batch: int) -> tuple[float, float]:
        """What stage ``index`` holds besides activations and transients as its backward starts (infinity where
        the end of its step cannot fit), and the loss's transient: a recomputation search's budget
        (`autopar.cost.stage_memory.StageMemoryModel.held`)."""
        return self.memory.held(config, index, global_batch=global_batch)

    def stage_view(self, config: PipelineConfig, index: int, *, global_batch: int) -> StageView:
        """Stage ``index`` of ``config`` on one of its devices: its mesh, samples per device, micro-batches in
        flight, and its rows' prices (with its intra-op layer layouts, where it has them)."""
        stage = config.stages[index]
        mesh = self._mesh(config.pp, stage.dp, stage.tp)
        samples = config.micro_batch / stage.dp
        m = global_batch // config.micro_batch
        in_flight = _in_flight(config.schedule, index, config.pp, config.chunks, m)
        layouts: dict[int, LayerLayout] = {}
        if stage.intra:
            key = (stage.start, stage.end, stage.tp, stage.dp, samples, config.zero, m, in_flight, config.sp, mesh,
                   stage.layouts)
            found = self._layouts.get(key)
            if found is None:
                found = self._layouts[key] = self._stage_layouts(stage, mesh, samples, config, m, in_flight)
            layouts = found

        units = not layouts and self._units_measured(stage, samples, config.sp, config.zero)
        steps = units and config.zero == 1 and self._steps_measured(stage, samples, config.sp)

        def price(row: int, level: str) -> LayerPrice:
            layout = layouts.get(row)
            if layout is not None:
                return layout.prices[level]
            found = self.price(row, tp=stage.tp, samples=samples, recompute=level, sp=config.sp, mesh=mesh)
            if units and self.layers[row].repeated:
                found = self._measured(row, found, tp=stage.tp, samples=samples, recompute=level, sp=config.sp,
                                       zero=config.zero)
                if steps:
                    found = self._at_edges(row, found, tp=stage.tp, samples=samples, recompute=level,
                                           sp=config.sp, micro_batches=m)
            return self.expert_parallel(row, found, level, ep=config.ep, samples=samples, mesh=mesh)

        return StageView(mesh=mesh, samples=samples, in_flight=in_flight, price=price, layouts=layouts,
                         units_measured=config.zero if units else 0, steps_measured=steps)

    def _stage_layouts(self, stage: Stage, mesh, samples: float, config: PipelineConfig, m: int,  # noqa: ANN001
                       in_flight: float) -> dict[int, LayerLayout]:
        when = Conditions(samples=samples, dp=stage.dp, dp_axis=mesh.axis("dp"), zero=config.zero, micro_batches=m,
                          in_flight=in_flight, sp=config.sp)
        layouts = {}
        if stage.layouts is not None:
            for row, splits in stage.layouts:
                layouts[row] = self.intra_layers.layout_as(row, mesh.axis("tp"), when, splits)
            return layouts
        for row in range(stage.start, stage.end):
            if self.layers[row].repeated:
                megatron = self.price(row, tp=stage.tp, samples=samples, recompute="none", sp=config.sp, mesh=mesh)
                layout = self.intra_layers.layout(row, mesh.axis("tp"), when, megatron)
                if layout is not None:
                    layouts[row] = layout
        return layouts

    def _mesh(self, pp: int, dp: int, tp: int):  # noqa: ANN202
        key = (pp, dp, tp)
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = self._meshes[key] = build_mesh(self.cluster, {"pp": pp, "dp": dp, "tp": tp})
        return mesh

    def _tied_copies(self, config: PipelineConfig) -> dict[int, list[tuple[int, bool]]]:
        """Per stage, weights it shares with another stage (a head tied to the embedding): (size on one device,
        whether this stage holds the extra copy). TP does not split them (the runtime keeps tied weights whole),
        except under ``vocab_parallel``: size / tp."""
        copies: dict[int, list[tuple[float, bool]]] = {}
        if not self._tied:
            return copies
        starts = [stage.start for stage in config.stages]
        for row, owner, size in self._tied:
            index, other = bisect_right(starts, row) - 1, bisect_right(starts, owner) - 1
            if other != index:
                mine, theirs = (size / config.stages[index].tp, size / config.stages[other].tp) \
                    if self.vocab_parallel else (size, size)
                copies.setdefault(index, []).append((mine, True))
                copies.setdefault(other, []).append((theirs, False))
        return copies

    def _send(self, boundary: float, stage: Stage, config: PipelineConfig,
              mesh) -> tuple[float, tuple[CommCall, ...]]:  # noqa: ANN001
        """Seconds of one activation (or gradient) of ``boundary`` bytes crossing to a neighbouring stage, and its
        collectives, one call each. Every tp rank sends all of it (autopar's runtime):

            t = send_recv(M) on pp

        or, with ``scatter_gather_sends`` (Megatron-LM's scatter/gather, which it skips under sequence
        parallelism, where M is already 1/tp), each tp rank sends its 1/tp and the receiver all-gathers over tp:

            t = send_recv(M / tp) on pp + all_gather(M) on tp
        """
        pp_axis = mesh.axis("pp")
        if not self.scatter_gather_sends or stage.tp == 1 or config.sp:
            return (collective_seconds(Collective.SEND_RECV, boundary, pp_axis, self.cluster),
                    (CommCall(kind=Collective.SEND_RECV, axis="pp", bytes=boundary, phase=Phase.SEND),))
        if len({s.tp for s in config.stages}) > 1:
            raise ValueError("scatter_gather_sends prices Megatron-LM's sends between stages of one tp width, got "
                             f"tp {sorted({s.tp for s in config.stages})}")
        piece = boundary / stage.tp
        seconds = collective_seconds(Collective.SEND_RECV, piece, pp_axis, self.cluster) + \
            collective_seconds(Collective.ALL_GATHER, boundary, mesh.axis("tp"), self.cluster)
        return seconds, (CommCall(kind=Collective.SEND_RECV, axis="pp", bytes=piece, phase=Phase.SEND),
                         CommCall(kind=Collective.ALL_GATHER, axis="tp", bytes=boundary, phase=Phase.SEND))

    def _boundary_bytes(self, stage: Stage, config: PipelineConfig) -> float:
        """The largest stream the stage's repeated layers read (`LayerCost.stream_input`; the model's first
        one's where the stage has none): what crosses its boundaries."""
        size = self._streams(stage.start, stage.end)
        if size < 0:
            size = next((layer.stream_input for layer in self.layers if layer.repeated), 0)
        return size / (stage.tp if config.sp else 1)

    @cached_property
    def _streams(self) -> RangeMax:
        return RangeMax([layer.stream_input if layer.repeated else -1 for layer in self.layers])

    def _sync(self, stage: Stage, zero: int, m: int, mesh, calls: list[CommCall], *, extra: float = 0,  # noqa: ANN001
              view: StageView | None = None, ep: int = 1) -> tuple[float, tuple]:
        """Gradient synchronisation of one stage over its dp axis, its collectives added to ``calls``. ZeRO 1-3 run
        per FSDP unit: each repeated layer, and the stage's other parameters together (the root unit, with
        ``extra`` parameters: a tied weight's copy); ZeRO 0 all-reduces DDP buckets (or by hand, one flat buffer).
        Under expert parallelism (``ep`` > 1) neither reads the experts: each expert's gradient is whole on the one
        rank holding it, and FSDP neither shards nor gathers them."""
        if stage.dp == 1:
            return 0.0, ()
        layouts = view.layouts if view is not None else {}
        shapes = tuple(sorted((row, layout.prices["none"].params) for row, layout in layouts.items()))
        place = (stage.start, stage.end) if shapes else self.stage_key(stage)  # a layout's shapes are by row
        # the units' collectives are in their times
        measured = view is not None and (view.units_measured == 3 or view.steps_measured)
        key = (place, stage.tp, stage.dp, zero, m, extra, mesh.axis("dp"), shapes, measured, ep)
        cached = self._syncs.get(key)
        if cached is None:
            cached = self._syncs[key] = self._price_sync(stage, zero, m, mesh, extra, dict(shapes), measured, ep)
        total, synced, units = cached
        calls += synced
        return total, units

    def _price_sync(self, stage: Stage, zero: int, m: int, mesh, extra: float,  # noqa: ANN001
                    layouts: dict[int, float], measured: bool = False,
                    ep: int = 1) -> tuple[float, tuple[CommCall, ...], tuple]:
        """(seconds, collectives, the simulator's units) of the stage's gradient synchronisation; ``measured``:
        the repeated layers' units are inside their measured times (`StageView.units_measured`), so their
        collectives are counted but cost nothing here."""
        uses: list[CommCall] = []
        itemsize = gradient_itemsize(self.dtype)
        units, rest = [], extra
        tp_axis = mesh.axis("tp")

        def synced(row: int) -> float:  # under expert parallelism each rank's experts are its own: not synced
            return self.device_params(row, tp_axis) - (self.row_expert_params(row) if ep > 1 else 0)

        for row, count in self._alike_rows(stage):
            layer = self.layers[row]
            if not layer.repeated:
                rest += synced(row) * count
            else:
                units += [(layouts[r] * itemsize, False) if r in layouts else
                          (synced(r) * itemsize, False) for r in range(row, row + count)] \
                    if layouts else [(synced(row) * itemsize, False)] * count
        rest *= itemsize
        if rest:
            units.append((rest, True))
        if zero == 0 and stage.tp == 1 and (stage.start, stage.end) == (0, len(self.layers)):  # DDP
            order = self._ddp_gradients if ep == 1 else self._ddp_gradients_but_experts
            units = [(nbytes, True) for nbytes in ddp_buckets(n * itemsize for n in order)]
        elif zero == 0:  # by hand, in slices of one flat buffer
            units = [(nbytes, True) for nbytes in flat_buckets(sum(nbytes for nbytes, _ in units))]
        axis = mesh.axis("dp")
        total = 0.0
        calls: dict[tuple[float, bool], dict[Collective, float]] = {}  # one call's seconds per kind, by unit
        unit = self._root_unit(stage, zero)
        timed = {} if unit is None else {Collective.ALL_GATHER: unit.gather,
                                         Collective.REDUCE_SCATTER: unit.reduce_scatter}
        for (nbytes, root), same in Counter(units).items():  # repeated layers are alike: price each size once
            for kind, count in gradient_sync(zero, m, root=root):
                if root and kind in timed:  # the root unit's calls as the profile database timed them
                    seconds = timed[kind]
                else:
                    seconds = 0.0 if measured and not root else collective_seconds(kind, nbytes, axis, self.cluster)
                calls.setdefault((nbytes, root), {})[kind] = seconds
                total += same * count * seconds
                uses.append(CommCall(kind=kind, axis="dp", bytes=nbytes, phase=Phase.SYNC, calls=same * count))
        # for the simulator, the units in order (ZeRO 1-3: the stage's repeated rows, then the root unit; ZeRO 0:
        # the buckets) as (bytes, root), with one call's seconds of each kind by (bytes, root)
        return total, merge_calls(uses), (tuple(units), calls)


@dataclass(slots=True)
class _Split:
    """What a stage's simulation needs beyond its report, recorded while it is priced (cheaply: the searches' screen
    never reads it): its view (to re-read its rows' prices), one send, the once-per-iteration sums, the segments'
    replays, and the dp units (`_price_sync`)."""

    view: StageView
    send: float = 0.0
    tp_once: float = 0.0
    pp_once: float = 0.0
    replayed: float = 0.0  # checkpointed segments: replayed forward compute, per micro-batch
    replayed_tp: float = 0.0  # and their collectives
    units: tuple = ()  # ((bytes, root) per unit in order, {(bytes, root): {kind: one call's seconds}}) or ()

    def times(self, layers: list[LayerCost], stage: Stage, zero: int) -> StageTimes:
        """The stage's figures apart: each row at its recomputation level and at none, recomputation being the
        difference of their backwards (and of their collectives)."""
        f = ftp = b = btp = 0.0
        r, rtp = self.replayed, self.replayed_tp
        rows = {}
        for row in range(stage.start, stage.end):
            level = stage.recompute_of(row)
            price = self.view.price(row, level)
            base = price if level == "none" else self.view.price(row, "none")
            f, ftp, b, btp = f + price.forward, ftp + price.comm_forward, b + base.backward, btp + base.comm_backward
            r += max(0.0, price.backward - base.backward)
            rtp += max(0.0, price.comm_backward - base.comm_backward)
            rows[row] = (base.forward, base.backward)
        return StageTimes(forward=f, backward=b, recompute=r, forward_tp=ftp, backward_tp=btp, recompute_tp=rtp,
                          send=self.send, units=self._units(layers, stage, zero, rows), tp_once=self.tp_once,
                          pp_once=self.pp_once)

    def _units(self, layers: list[LayerCost], stage: Stage, zero: int,
               rows: dict[int, tuple[float, float]]) -> tuple[Unit, ...]:
        """Each unit's shares of the stage's compute: a DDP bucket's share of the gradient bytes (ZeRO 0); an FSDP
        unit's share of the rows it holds (its repeated row, or the root's other rows), over the units' total."""
        if not self.units:
            return ()
        units, calls = self.units
        shares = [(n, n) for n, _ in units]
        if zero:
            repeated = [rows[r] for r in range(stage.start, stage.end) if layers[r].repeated]
            rest = [rows[r] for r in range(stage.start, stage.end) if not layers[r].repeated]
            shares = (repeated + [(sum(f for f, _ in rest), sum(b for _, b in rest))])[:len(units)]
            if not all(sum(x) > 0 for x in zip(*shares)):
                shares = [(n, n) for n, _ in units]
        forward = sum(f for f, _ in shares) or 1.0
        backward = sum(b for _, b in shares) or 1.0
        reduction = Collective.ALL_REDUCE if zero == 0 else Collective.REDUCE_SCATTER
        return tuple(Unit(forward=f / forward, backward=b / backward, gather=calls[u].get(Collective.ALL_GATHER, 0.0),
                          reduce=calls[u][reduction], root=u[1]) for (f, b), u in zip(shares, units))


def _exposed(split: _Split, zero: int, m: int, forward: float, backward: float, *, around: float) -> float:
    """The screen's exposed data-parallel time of a stage (`simulator.exposed_sync`): its units as runs of alike
    ones, each with its share of a micro-batch's compute (DDP buckets by their bytes; FSDP units: the repeated
    layers alike, the root unit ``around``, the share of the rows outside them) and one call's seconds."""
    if not split.units:
        return split.pp_once
    units, calls = split.units
    roots = sum(1 for _, root in units if root)
    repeated = len(units) - roots
    total = sum(nbytes for nbytes, _ in units) or 1.0
    reduction = Collective.ALL_REDUCE if zero == 0 else Collective.REDUCE_SCATTER
    runs: list[tuple[Unit, int]] = []
    for (nbytes, root), group in itertools.groupby(units):  # a deep stage's units are a few runs of alike ones
        if zero == 0 or not repeated:  # buckets: their bytes' share
            share = nbytes / total
        elif root:
            share = around if repeated else 1.0 / roots
        else:
            share = (1.0 - (around if roots else 0.0)) / repeated
        runs.append((Unit(forward=share, backward=share, gather=calls[(nbytes, root)].get(Collective.ALL_GATHER, 0.0),
                          reduce=calls[(nbytes, root)][reduction], root=root), sum(1 for _ in group)))
    return exposed_sync(forward=forward, backward=backward, units=runs, zero=zero, micro_batches=m,
                        after=split.pp_once)


def _timing(simulation: PipelineSimulation | None, reports: list[StageReport], devices: list[StageReport], m: int,
            chunks: int, overlap: bool = True) -> tuple[float, float, float, float]:
    """(iteration, compute, exposed comm, bubble): the simulated timeline's, on its critical device
    (`simulator.tasks`); without a simulation, the closed form's (`simulator.closed_form`), whose compute is the
    slowest device's m micro-batches and exposed comm the rest beside the bubble; its sync the data-parallel
    collectives the stages' compute does not hide (`StageReport.exposed`) where they overlap it, else all of them."""
    if simulation is None:
        found = closed_form(seconds=[r.seconds for r in reports],
                            sync=[r.exposed if overlap else r.sync for r in reports], micro_batches=m, chunks=chunks)
        compute = m * devices[found.slowest].compute
        return found.iteration, compute, found.iteration - compute - found.bubble, found.bubble
    timeline = simulation.timeline
    compute, exposed, bubble = timeline.split(timeline.critical())
    return timeline.iteration, compute, exposed, bubble


def _issued(reports: list[StageReport]) -> list[CommCall]:
    """What every stage's devices issue in the iteration, alike records merged: stages that issue the same calls
    (one tuple, `PipelineModel.estimate`) are read once and counted."""
    counted: dict[int, list] = {}
    for report in reports:
        found = counted.get(id(report.calls))
        if found is None:
            counted[id(report.calls)] = [report.calls, 1]
        else:
            found[1] += 1
    if len(counted) == len(reports):
        return [c for report in reports for c in report.calls]
    return [c if count == 1 else c.times(count) for calls, count in counted.values() for c in calls]


def _in_flight(schedule: str, index: int, pp: int, chunks: int, m: int) -> float:
    """Micro-batches whose activations stage ``index`` holds at its peak: all of them under GPipe, the ones the
    1F1B warm-up starts before the first backward otherwise (Megatron-LM's counts, interleaved: per chunk)."""
    if schedule == "gpipe":
        return m
    if chunks == 1:
        return min(pp - index, m)
    device = index % pp
    warmup = (pp - device - 1) * 2 + (chunks - 1) * pp + 1
    return min(warmup, m * chunks) / chunks


def _per_device(reports: list[StageReport], pp: int) -> list[StageReport]:
    """Interleaved chunks summed onto their devices (stage v runs on device v % pp)."""
    devices = []
    for device in range(pp):
        mine = reports[device::pp]
        memory = MemoryBreakdown(
            parameters=sum(r.memory.parameters for r in mine), gradients=sum(r.memory.gradients for r in mine),
            optimizer=sum(r.memory.optimizer for r in mine), activations=sum(r.memory.activations for r in mine),
            other=max(r.memory.other for r in mine), reserve=mine[0].memory.reserve, budget=mine[0].memory.budget,
        )
        devices.append(StageReport(compute=sum(r.compute for r in mine), comm=sum(r.comm for r in mine),
                                   sync=sum(r.sync for r in mine), exposed=sum(r.exposed for r in mine), memory=memory,
                                   calls=tuple(c for r in mine for c in r.calls)))
    return devices


def even_stages(model: PipelineModel, pp: int, *, tp: int, dp: int, recompute: str = "none") -> tuple[Stage, ...]:
    """Repeated layers spread evenly (Megatron's split); the embedding joins the first stage, the head the last."""
    rows = len(model.layers)
    blocks = [i for i, layer in enumerate(model.layers) if layer.repeated] or list(range(rows))
    if pp > len(blocks):
        raise ValueError(f"--pp {pp} is more pipeline stages than the model's {len(blocks)} repeated layers")
    per, extra = divmod(len(blocks), pp)
    cuts, taken = [0], 0
    for s in range(pp - 1):
        taken += per + (1 if s < extra else 0)
        cuts.append(blocks[taken])
    cuts.append(rows)
    levels = [recompute if layer.repeated else "none" for layer in model.layers]  # only layers recompute
    return tuple(
        Stage(start=a, end=b, tp=tp, dp=dp, recompute=tuple(levels[a:b])) for a, b in zip(cuts, cuts[1:])
    )
