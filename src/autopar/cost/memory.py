"""Memory per device as the runtime allocates it: model states, wrapper buffers, activations and temporaries.

Bytes per parameter come from a `Precision`. ``fp32`` is what ``autopar run`` trains in: fp32 weights and gradients
and SGD without momentum, which keeps no optimizer state (4 + 4 bytes). ``bf16`` and ``fp16`` are priced as mixed
precision with Adam (Rajbhandari et al. 2020): 2-byte weights and gradients, a 4-byte fp32 master copy and 8 bytes
of Adam state, 16 in all; the runtime does not train in them yet (it builds an fp32 model whatever the plan's
dtype), so those figures are not checked against it.

How the runtime holds the states depends on its data-parallel wrapper (`holding`):

- none (dp 1): weights and gradients whole;
- DDP (ZeRO 0, one stage, no TP): also its gradient buckets, a second copy of every gradient (DDP's default
  ``gradient_as_bucket_view=False``), made when the model is wrapped;
- by hand (ZeRO 0 with TP or a pipeline): after the last backward, one flat copy of the gradients to all-reduce;
- FSDP2 (ZeRO 1-3, `fully_shard` on every repeated layer, then the root): every parameter sharded over dp. ZeRO 1
  and 2 keep every unit gathered from the first forward to the last backward (a whole copy besides the shards);
  ZeRO 3 gathers a unit for its forward and again for its backward, prefetching the next unit there, while the root
  unit (the rest of the model) stays gathered from its forward to the end of the backward. Gradients are
  reduce-scattered per unit (ZeRO 1: once, after the last micro-batch; 2 and 3: after every one).

The peak is the largest of the moments `stage_peak` walks through: each layer's backward in the first, a middle and
the last micro-batch, and the end of the step (gradient synchronisation and the optimizer step). The device reserve
(CUDA context, allocator caching) is none of these: `MemoryBreakdown.reserve` carries it apart, and
`MemoryBreakdown.allocated` is what PyTorch's memory tracker can be compared with.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from autopar.cluster import Collective

OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}  # fp32 state per parameter, made at the first step


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """Bytes per parameter of each model state: the weights the forward reads, their gradients, an fp32 master
    copy the optimizer updates where the weights are lower precision, and the optimizer's own state."""

    weight: int
    gradient: int
    master: int
    optimizer: int

    @classmethod
    def of(cls, dtype: str, *, optimizer: str | None = None) -> Precision:
        """``dtype``'s recipe: fp32 weights and gradients, or mixed precision (2-byte weights and gradients and a
        4-byte master); ``optimizer`` defaults to what trains in it: SGD for fp32 (``autopar run``), Adam otherwise."""
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be fp32, bf16 or fp16, got {dtype!r}")
        name = optimizer or ("sgd" if dtype == "fp32" else "adam")
        if name not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {name!r}")
        if dtype == "fp32":
            return cls(weight=4, gradient=4, master=0, optimizer=OPTIMIZER_STATE_BYTES[name])
        return cls(weight=2, gradient=2, master=4, optimizer=OPTIMIZER_STATE_BYTES[name])

    @property
    def states(self) -> int:
        """Bytes the optimizer step owns per parameter: master copy and optimizer state."""
        return self.master + self.optimizer


def model_states(params: float, *, dtype: str, zero: int, dp: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes on one device holding ``params`` parameters before ZeRO, as the ZeRO
    paper shards them: stage 1 the optimizer's (master copy and state), 2 also the gradients, 3 also the weights.

        weights = params * weight / (dp if zero >= 3),  gradients = params * gradient / (dp if zero >= 2),
        optimizer = params * (master + state) / (dp if zero >= 1)

    The searches' budget; what the runtime holds besides (gathered units, buckets) is `stage_peak`'s."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    p = Precision.of(dtype)
    return (
        params * p.weight / (dp if zero >= 3 else 1),
        params * p.gradient / (dp if zero >= 2 else 1),
        params * p.states / (dp if zero >= 1 else 1),
    )


def gradient_itemsize(dtype: str) -> int:
    """Bytes per weight and per gradient element: 4 in fp32 training, 2 in mixed precision (bf16, fp16)."""
    return 4 if dtype == "fp32" else 2


DDP_BUCKET_BYTES = 25 * 2**20  # gradients all-reduce in buckets of this size (DDP's default bucket_cap_mb)


def gradient_sync(zero: int, micro_batches: int, *, root: bool = False) -> list[tuple[Collective, int]]:
    """Collectives per iteration that keep data-parallel replicas' parameters in step, with their call counts, on a
    buffer the size of one FSDP unit's gradients (the whole model's, where it is one unit):

    - ZeRO 0: one all-reduce (per DDP bucket, see `ddp_buckets`, or per slice, `flat_buckets`);
    - ZeRO 1: the weights all-gathered once before the first micro-batch, the accumulated gradients
      reduce-scattered once after the last;
    - ZeRO 2: the same gather, and a reduce-scatter after every micro-batch (gradients stay sharded);
    - ZeRO 3 (FSDP): per micro-batch an all-gather before the forward, another before the backward (not for the
      ``root`` unit, which keeps its weights between the two) and a reduce-scatter of the gradients.
    """
    m = micro_batches
    if zero == 0:
        return [(Collective.ALL_REDUCE, 1)]
    if zero == 1:
        return [(Collective.ALL_GATHER, 1), (Collective.REDUCE_SCATTER, 1)]
    if zero == 2:
        return [(Collective.ALL_GATHER, 1), (Collective.REDUCE_SCATTER, m)]
    return [(Collective.ALL_GATHER, m if root else 2 * m), (Collective.REDUCE_SCATTER, m)]


def ddp_buckets(gradients: Iterable[float]) -> list[float]:
    """Bucket sizes `DistributedDataParallel` all-reduces gradients of these sizes (bytes, in the order they
    become ready in the backward) in, as it rebuilds its buckets after the first step: a tensor is never split,
    and a bucket closes once it holds `DDP_BUCKET_BYTES` or more (so a large embedding makes one large bucket)."""
    buckets, current = [], 0.0
    for nbytes in gradients:
        current += nbytes
        if current >= DDP_BUCKET_BYTES:
            buckets.append(current)
            current = 0.0
    if current or not buckets:
        buckets.append(current)
    return buckets


def flat_buckets(nbytes: float) -> list[float]:
    """Slice sizes of ``nbytes`` of gradients all-reduced by hand as one flat buffer in `DDP_BUCKET_BYTES` slices
    (`autopar.runtime.apply`, where no wrapper does it: tp x dp, pipelines)."""
    full, rest = divmod(nbytes, DDP_BUCKET_BYTES)
    return [float(DDP_BUCKET_BYTES)] * int(full) + ([rest] if rest or not full else [])


# ---- how the runtime holds model states ------------------------------------------------------------------------


class Holding(enum.Enum):
    """The wrapper that keeps a stage's data-parallel replicas in step (`autopar.runtime.apply`)."""

    NONE = "none"  # dp 1: the plain module
    DDP = "ddp"  # DistributedDataParallel
    BY_HAND = "by_hand"  # gradients all-reduced over dp by hand after the last backward
    FSDP = "fsdp"  # FSDP2 fully_shard per repeated layer and the root


def holding(*, dp: int, tp: int, stages: int, zero: int) -> Holding:
    """What `autopar.runtime.apply.parallelize` wraps a stage in: nothing at dp 1, FSDP2 under ZeRO 1-3, DDP for
    ZeRO 0 on one stage without TP (DDP takes no DTensor parameters and cannot follow a pipeline schedule), the
    by-hand all-reduce otherwise."""
    if dp == 1:
        return Holding.NONE
    if zero > 0:
        return Holding.FSDP
    return Holding.DDP if stages == 1 and tp == 1 else Holding.BY_HAND


def ddp_bucket_bytes(params: float, precision: Precision) -> float:
    """DDP's gradient buckets: ``params * gradient`` bytes, a copy of every gradient kept from wrapping on (the
    runtime leaves ``gradient_as_bucket_view`` off, so ``param.grad`` and the bucket are separate tensors)."""
    return params * precision.gradient


def optimizer_state_bytes(params: float, precision: Precision, *, shards: int) -> float:
    """Master copy and optimizer state of ``params`` parameters sharded ``shards`` ways (FSDP's dp, else 1):
    ``params * (master + optimizer) / shards``. Made at the first step, so a step's forward and backward meet
    them from the second step on; SGD without momentum makes none."""
    return params * precision.states / shards


# ---- one stage's peak ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RowPeak:
    """The most one row's backward holds at once, for one micro-batch on one device, by kind (`row_peak`)."""

    saved: float = 0.0  # of its saved activations, those still held
    gradients: float = 0.0  # of its parameters' gradients, those made by then
    transient: float = 0.0  # the gradients flowing through the op running then


@dataclass(frozen=True, slots=True, kw_only=True)
class RowMemory:
    """One layer (or part of one) of a stage, for one micro-batch on one device, in the order the backward meets
    it."""

    activations: float  # bytes saved for its backward, held from its forward to its backward
    params: float  # parameters on this device
    kept: RowPeak  # its backward's peak where its gradients stay (first backward, or FSDP until reduce-scattered)
    added: RowPeak  # ... where each one is added into an earlier gradient at once (later backwards)
    unit: bool = False  # a repeated layer: an FSDP unit of its own (the other rows share the root unit)
    count: int = 1  # rows like it one after the other (a run of repeated layers, priced once)
    # a weight read here and by a row the backward meets later (a head tied to the embedding): autograd keeps the
    # gradient made here until it adds the later one to it, out of place
    shared: float = 0.0  # its parameters, where the backward meets it first
    summed: float = 0.0  # its parameters, where the two gradients are added
    # of its parameters, those this device holds as its own (expert parallelism's experts, split over dp already):
    # outside FSDP (neither sharded nor gathered), DDP's buckets and the by-hand copy; their gradients and
    # optimizer state stay whole on this device
    local: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleBuffers:
    """Per micro-batch bytes a pipeline schedule (`torch.distributed.pipelining`) holds on a stage: a buffer for
    the received activation (not on the first stage) and one for the received gradient (not on the last), for
    every micro-batch, made at the first step and kept; a sent activation, kept until its backward (the received
    gradient's size); a sent gradient, until the send completes (the received activation's size); and on the last
    stage the output (logits), which the schedule keeps for every micro-batch until the next step and, as the step
    ends, concatenates into one more copy to return (the runtime does not pass ``return_outputs=False``)."""

    received: float = 0.0
    received_gradient: float = 0.0
    output: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StageLoad:
    """What one device of a stage holds, for `stage_peak`."""

    rows: tuple[RowMemory, ...]  # backward order
    precision: Precision
    holding: Holding
    zero: int
    dp: int
    micro_batches: int
    in_flight: float  # micro-batches whose activations the stage holds at its first backward
    later_in_flight: float  # ... at its second
    kept_outputs: float = 1.0  # outputs the schedule keeps at the first backward (see `ScheduleBuffers.output`)
    buffers: float = 0.0  # module buffers (rotary tables, norm statistics)
    schedule: ScheduleBuffers = ScheduleBuffers()
    # `walk`'s results, shared by loads of the same rows (walks do not depend on the micro-batches in flight);
    # None: walked each time
    walks: dict | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Moment:
    """Bytes live on the device at one moment, by kind."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    other: float = 0.0  # temporaries, communication and schedule buffers

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other


def stage_peak(load: StageLoad) -> Moment:
    """The largest of the stage's moments (`backward_moments`, `end_moment`)."""
    return max([*backward_moments(load), end_moment(load)], key=lambda moment: moment.total)


def _params(load: StageLoad) -> float:
    return sum(row.params * row.count for row in load.rows)


def _local(load: StageLoad) -> float:
    """Parameters the device holds as its own (`RowMemory.local`), outside every data-parallel wrapper."""
    return sum(row.local * row.count for row in load.rows)


def _root(load: StageLoad) -> float:
    """Parameters of the FSDP root unit (the rows that are no repeated layer), the device's own left out."""
    return sum((row.params - row.local) * row.count for row in load.rows if not row.unit)


def _shards(load: StageLoad) -> int:
    return load.dp if load.holding is Holding.FSDP else 1


def _optimizer(load: StageLoad) -> float:
    """Master copies and optimizer state: FSDP's shards of them, and the device's own parameters' whole."""
    local = _local(load)
    return (optimizer_state_bytes(_params(load) - local, load.precision, shards=_shards(load))
            + optimizer_state_bytes(local, load.precision, shards=1))


def schedule_bytes(load: StageLoad, *, finished: int, kept: float, in_flight: float = 0.0) -> float:
    """The schedule's buffers with ``in_flight`` micro-batches between forward and backward, ``finished`` of them
    done and ``kept`` outputs kept; the received activations of those in flight are left out, as their first layer
    saved them (they are among the activations):

        (m - in_flight) * received + (m + in_flight) * received_gradient + min(finished, 1) * received
        + kept * output"""
    s, m = load.schedule, load.micro_batches
    return ((m - in_flight + min(finished, 1)) * s.received + (m + in_flight) * s.received_gradient
            + kept * s.output)


def steady_bytes(load: StageLoad) -> Moment:
    """What the stage holds through its forwards and backwards, whatever the moment: weights as the wrapper keeps
    them (FSDP: the shards and the root unit gathered; the other units are `walk`'s; the device's own parameters
    whole), buffers, DDP buckets and the optimizer state of earlier steps."""
    p, params, shards, local = load.precision, _params(load), _shards(load), _local(load)
    weights = params * p.weight
    if load.holding is Holding.FSDP:
        weights = (params - local) * p.weight / shards + _root(load) * p.weight + local * p.weight
    buckets = ddp_bucket_bytes(params - local, p) if load.holding is Holding.DDP else 0.0
    return Moment(parameters=weights + load.buffers, optimizer=_optimizer(load), other=buckets)


def backward_moments(load: StageLoad, *, rows: int | None = None) -> list[Moment]:
    """The peak of the first backward, of a middle one and of the last (one of each that the step has), each
    being the largest over the rows of `walk`, with the micro-batches then in flight and the gradients of earlier
    backwards:

        first (k = 0):   in_flight micro-batches, no gradients yet
        later (k >= 1):  min(later_in_flight, m - k) in flight, every gradient (sharded under ZeRO 2-3)

    A later backward is priced at k = 1 (most in flight) and k = m - 1 (most schedule buffers kept). With ``rows``,
    only the backwards' first ``rows`` rows are walked."""
    m = load.micro_batches
    moments = [_backward(load, first=True, last=m == 1, in_flight=load.in_flight, finished=0,
                         kept=load.kept_outputs, rows=rows)]
    for k in sorted({1, m - 1} if m > 1 else set()):
        flight = min(load.later_in_flight, m - k)
        kept = min(m, k + load.kept_outputs) if load.kept_outputs < m else m
        moments.append(_backward(load, first=False, last=k == m - 1, in_flight=flight, finished=k, kept=kept,
                                 rows=rows))
    return moments


def _backward(load: StageLoad, *, first: bool, last: bool, in_flight: float, finished: int, kept: float,
              rows: int | None = None) -> Moment:
    base = steady_bytes(load)
    activations = sum(row.activations * row.count for row in load.rows)
    held = earlier_gradients(load, first=first)
    buffers = schedule_bytes(load, finished=finished, kept=kept, in_flight=in_flight)
    peak = walk(load, first=first, last=last, rows=rows)
    return Moment(
        parameters=base.parameters + peak.parameters, gradients=held + peak.gradients, optimizer=base.optimizer,
        activations=(in_flight - 1) * activations + peak.activations,
        other=base.other + buffers + peak.other,
    )


def earlier_gradients(load: StageLoad, *, first: bool) -> float:
    """Gradients a backward finds from earlier micro-batches: none in the first; in a later one every gradient,
    whole where they accumulate whole (no FSDP, or ZeRO 1, which reduce-scatters once at the end), sharded under
    ZeRO 2-3: ``params * gradient`` or ``params * gradient / dp`` (the device's own parameters' whole)."""
    if first:
        return 0.0
    sharded = load.holding is Holding.FSDP and load.zero >= 2
    local = _local(load)
    return ((_params(load) - local) / (load.dp if sharded else 1) + local) * load.precision.gradient


def walk(load: StageLoad, *, first: bool, last: bool, rows: int | None = None) -> Moment:
    """The largest moment of one micro-batch's backward, row by row in the order it meets them. At row ``r``, with
    ``A`` the activations of the rows it has not met yet, ``R`` the row's `RowPeak` (``kept`` in the first backward
    and wherever FSDP keeps a unit's gradients until it reduce-scatters them, ``added`` otherwise), ``p``
    parameters, ``g`` and ``w`` gradient and weight bytes:

        activations = A - a_r + R.saved,   transient = R.transient
        gradients   = sum_{i < r} p_i * g + R.gradients       first backward, gradients accumulating whole
                    = R.gradients                             later backwards (added into earlier ones in place)
        under ZeRO 2-3 (and ZeRO 1's last backward, which reduce-scatters its accumulated gradients):
                    = sum_{i < r, unit} p_i * g / dp          first backward: units' reduce-scattered shards
                      + sum_{i < r, root} p_i * g             the root unit's, whole until the backward ends
                      + p_prev * g + R.gradients              the last reduce-scatter's input, held until the next
        and once a unit's backward is done, its reduce-scatter: A - a_r activations, and in place of the last
        input and ``R.gradients`` the unit's whole gradients and their input, 2 * p_r * g.
        gathered    = (p_r + p_next) * w         ZeRO 3: the unit computing and the next one, prefetched
                    = sum_{i >= r, unit} p_i * w ZeRO 1-2: every unit until its backward, after which the last
                                                 backward frees it (the others keep every unit)

    A weight two rows read (``shared`` where the backward meets it first, ``summed`` where it meets it again) has
    its first gradient held whole from one to the other, where the second one (in a later backward; in the first it
    is among ``R.gradients``) and their sum, made out of place, are transient. ZeRO 1's last backward frees its
    whole gradients unit by unit; `earlier_gradients` counts them held throughout. With ``rows``, only the first
    ``rows`` rows are walked."""
    walks, key = load.walks, (first, last, rows, load.holding, load.zero, load.dp)
    if walks is not None and key in walks:
        return walks[key]
    found = _walk(load, first=first, last=last, rows=rows)
    if walks is not None:
        walks[key] = found
    return found


def _walk(load: StageLoad, *, first: bool, last: bool, rows: int | None) -> Moment:
    p, until, rows = load.precision, rows, load.rows
    fsdp = load.holding is Holding.FSDP
    scatters = fsdp and (load.zero >= 2 or last)
    units = [(row.params - row.local) * p.weight if row.unit else 0.0 for row in rows]
    following, suffix = [0.0] * (len(rows) + 1), [0.0] * (len(rows) + 1)  # after each run: the next unit's size,
    for index in range(len(rows) - 1, -1, -1):  # and all later units'
        suffix[index] = suffix[index + 1] + (units[index + 1] * rows[index + 1].count if index + 1 < len(rows) else 0)
        following[index] = units[index + 1] if index + 1 < len(rows) and units[index + 1] else following[index + 1]
    remaining = sum(row.activations * row.count for row in rows)
    made = root = held = pending = 0.0  # gradients left so far: whole (or shards), the root unit's, shared
    best, top = (0.0, 0.0, 0.0, 0.0), 0.0  # weights' first ones, the last reduce-scatter's input
    for index, row in enumerate(rows[:until]):
        new, unit, k = row.params * p.gradient, units[index], row.count
        synced, own = new - row.local * p.gradient, row.local * p.gradient  # FSDP's, and the device's own
        held += row.shared * p.gradient
        peak = row.kept if first or scatters else row.added
        grow_made = (synced / load.dp + own if scatters else new) if first and not (scatters and not row.unit) \
            else 0.0
        grow_root = new if scatters and not row.unit else 0.0
        # a run of like rows changes linearly along it, but for its first row (the last reduce-scatter's input)
        # and its last (the unit after it): its largest moments are among these
        for t in sorted({0, min(1, k - 1), max(k - 2, 0), k - 1}):
            before = (made + t * grow_made if first else 0.0) + root + t * grow_root + held
            waiting = pending if t == 0 or not (scatters and row.unit) else synced
            if fsdp and load.zero == 3:
                after = unit if unit and t < k - 1 else following[index]
                gathered = unit + after
            elif fsdp:
                gathered = suffix[index] + (k - t) * unit if last else suffix[0] + rows[0].count * units[0]
                after = gathered - (unit if last else 0.0)
            else:
                gathered = after = 0.0
            others = remaining - (t + 1) * row.activations
            moment = (gathered, before + waiting + peak.gradients, others + peak.saved,
                      peak.transient + row.summed * p.gradient * (1 if first else 2))
            if sum(moment) > top:
                best, top = moment, sum(moment)
            if scatters and row.unit and after + before + 2 * synced + own + others > top:  # its reduce-scatter
                best = (after, before + 2 * synced + own, others, 0.0)
                top = sum(best)
        remaining -= k * row.activations
        held -= row.summed * p.gradient
        made += k * grow_made
        root += k * grow_root
        if scatters and row.unit:
            pending = synced
    return Moment(parameters=best[0], gradients=best[1], activations=best[2], other=best[3])


def held_bytes(load: StageLoad) -> tuple[float, float, float]:
    """What the stage holds besides activations and transients while the backward meets the rows before the first
    repeated layer (the loss, the head: every activation still held), the largest transient of those rows, and
    what it holds at the end of the step (`end_moment`). A choice of the layers' activations (their recomputation)
    fits where

        in_flight * activations + max(that transient, the layers' largest) <= budget - held   and   end <= budget"""
    bare = tuple(replace(row, activations=0.0, kept=RowPeak(gradients=row.kept.gradients),
                         added=RowPeak(gradients=row.added.gradients)) for row in load.rows)
    empty = replace(load, rows=bare, walks=None)
    layers = max(next((index for index, row in enumerate(load.rows) if row.unit), len(load.rows)), 1)
    transient = max(max(row.kept.transient, row.added.transient) for row in load.rows[:layers]) if load.rows else 0.0
    held = max(moment.total for moment in backward_moments(empty, rows=layers))
    return held, transient, end_moment(empty).total


def end_moment(load: StageLoad) -> Moment:
    """After the last backward: the gradient synchronisation, with every micro-batch's schedule buffers (and, as
    the schedule returns, the last stage's outputs concatenated, ``m * output`` more, where that exceeds the
    synchronisation's own buffer):

        DDP       weights + gradients + buckets            params * (w + g) + synced * g
        by hand   weights + gradients + their flat copy    params * (w + g) + synced * g
        FSDP      shards, and the root unit's whole gradients with its reduce-scatter input (its shard comes
                  once they are freed)   synced * w / dp + (synced - root) * g / dp + 2 * root * g + own * (w + g)

    with the optimizer state ``synced * (master + state) / shards + own * (master + state)`` (``synced``: the
    parameters FSDP or an all-reduce reads, all but the device's own, ``own``: expert parallelism's experts). The
    optimizer step that follows holds no more: SGD updates in place, and Adam is priced as fused Adam does it
    (PyTorch's default foreach Adam takes the square root of every second moment at once on CUDA, ``params * 4 /
    shards`` more; on CPU it goes tensor by tensor, twice the largest one more)."""
    p, params, shards, own = load.precision, _params(load), _shards(load), _local(load)
    m = load.micro_batches
    buffers = schedule_bytes(load, finished=m, kept=m if load.schedule.output else 0.0)
    merged = m * load.schedule.output
    synced = params - own
    weights = synced * p.weight / shards + own * p.weight + load.buffers
    gradients = synced * p.gradient / shards + own * p.gradient
    optimizer = _optimizer(load)
    if load.holding is Holding.FSDP:
        root = _root(load) * p.gradient
        sync = Moment(parameters=weights, gradients=gradients - root / shards + root, optimizer=optimizer,
                      other=buffers + max(root, merged))
    else:
        copy = ddp_bucket_bytes(synced, p) if load.holding in (Holding.DDP, Holding.BY_HAND) else 0.0
        sync = Moment(parameters=weights, gradients=gradients, optimizer=optimizer, other=buffers + max(copy, merged))
    return sync


# ---- what a layer's backward holds ------------------------------------------------------------------------------


def op_transient(node, *, outputs: Sequence[float] | None = None,  # noqa: ANN001 - a capture Node
                 inputs: Sequence[float] | None = None) -> float:
    """What one op's backward holds at once on top of what its layer saved: the gradient of its output and the
    gradients of its activation inputs (not of parameters: those are the gradients' own term),

        sum_{float outputs k} bytes_k / outputs[k] + sum_{float activation inputs j} bytes_j / inputs[j]

    with ``outputs[k]`` the devices output k is split over and ``inputs[j]`` those input j's gradient is split over
    (all 1 by default: the op whole; a row-parallel op's partial output and a column-parallel op's input gradient
    are whole). Views allocate nothing. At the loss this is log-softmax's backward: the gradients of the logits and
    of the log-probabilities, two logits-sized tensors."""
    if node.is_view:
        return 0.0
    total = 0.0
    for k, t in enumerate(node.outputs):
        if t.dtype.startswith(("float", "bfloat")):
            total += t.nbytes / (outputs[k] if outputs is not None else 1)
    for j, (t, s) in enumerate(zip(node.inputs, node.sources)):
        if s.state is None and t.dtype.startswith(("float", "bfloat")):
            total += t.nbytes / (inputs[j] if inputs is not None else 1)
    return total


def backward_transient(nodes: Iterable) -> float:
    """The most one op of ``nodes``, whole, holds at once in its backward (`op_transient`)."""
    return max((op_transient(node) for node in nodes), default=0.0)


def row_peak(saved: Sequence[float], transient: Sequence[float], gradients: Sequence[float], *,
             keep: bool = True) -> RowPeak:
    """The most a row's backward holds at once above the activations of other rows, walking its ops last to first,
    per op i (on one device, at the micro-batch's size) ``saved[i]``: bytes it saved for backward,
    ``transient[i]``: what its backward holds at once (`op_transient`), ``gradients[i]``: bytes of the parameter
    gradients it makes. At op n:

        saved     = sum_{i <= n} saved_i              (an op's saved tensors go once its backward has run)
        gradients = sum_{i >= n} gradients_i          (``keep``; otherwise gradients_n alone, added into an
                                                       earlier gradient as soon as it is made)
        transient = transient_n"""
    held = sum(saved)
    made = 0.0
    best = RowPeak()
    for kept, passing, grads in zip(reversed(saved), reversed(transient), reversed(gradients)):
        made += grads
        moment = RowPeak(saved=held, gradients=made if keep else grads, transient=passing)
        if moment.saved + moment.gradients + moment.transient > best.saved + best.gradients + best.transient:
            best = moment
        held -= kept
    return best
