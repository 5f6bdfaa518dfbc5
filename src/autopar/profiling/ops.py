"""The op database (Aceso §3.3): each distinct aten op of a traced model, timed forward and backward on this device.

An op is known by what it computes, not by where it sits: its name, the shapes of its inputs for one sample (the
inputs an activation feeds have their first dim divided by the batch the model was traced at; parameters and
buffers keep theirs) and its dtype (`op_key`). Two layers of a model, or two models, that run the same op on the same
shapes share one entry.

Each entry holds times at several amounts of work per device (``work``: samples per device over the ways tensor
parallelism splits the op, ``s / t``), as the search prices them:

- ``s`` samples: the inputs an activation feeds are ``s`` times as deep in their first dim;
- ``t`` ways: the op's widest dim that splits with no communication (`analysis.dims`, its batch dim aside) is cut
  in ``t``, as a column- or head-parallel split cuts it.

The cost model asks for an op at the work its strategy gives it (`OpTimes.seconds`): a work measured gives its
times; one between two measured gives the times interpolated in log-log between them; one outside the range measured
is priced by the roofline, as is an op the database has not seen.

Ops are replayed from the trace with random inputs of their recorded shapes (indices 0, masks all true): an op
whose recorded arguments fix a shape (a view's sizes, an ``expand``) cannot run at other shapes and is timed at the
work it was traced at only, if at all; one that cannot be replayed is left to the roofline and listed as skipped.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.capture import Node
from autopar.capture.graph import TENSOR_ARG
from autopar.cluster.compute import GPU_BURST

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8}
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def is_timed(node: Node) -> bool:
    """Ops the database times: those the roofline prices at more than its kernel overhead (no views, no ops on
    state alone)."""
    return not node.is_view and bool(node.outputs) and any(s.state is None for s in node.sources) \
        and (node.flops_forward > 0 or node.bytes_read + node.bytes_written > 0)


def _feeds(node: Node) -> tuple[bool, ...]:
    """Per input: whether an activation (a model input or an op's output) feeds it, so it deepens with the batch."""
    return tuple(s.state is None for s in node.sources)


def sample_shapes(node: Node, traced_batch: int) -> tuple[tuple[int, ...], ...] | None:
    """The node's input shapes for one sample: activations' first dim divided by ``traced_batch``; None where one
    does not divide (an activation that does not grow with the batch, a table made from positions)."""
    shapes = []
    for info, fed in zip(node.inputs, _feeds(node)):
        shape = tuple(info.shape)
        if fed and shape and traced_batch > 1:
            if shape[0] % traced_batch:
                return None
            shape = (shape[0] // traced_batch, *shape[1:])
        shapes.append(shape)
    return tuple(shapes)


def op_key(node: Node, traced_batch: int) -> tuple | None:
    """The database key of ``node`` (traced at ``traced_batch`` samples): (op, per-sample input shapes, dtype)."""
    shapes = sample_shapes(node, traced_batch)
    if shapes is None:
        return None
    return (node.op, json.dumps([list(s) for s in shapes]), _dtype(node))


def _dtype(node: Node) -> str:
    return _DTYPES.get(node.outputs[0].dtype if node.outputs else "float32", "fp32")


def split_dim(node: Node) -> Any:
    """The dim tensor parallelism cuts when it splits ``node`` (`analysis.dims`): its widest dim that splits with
    no communication, a dim that is an activation's first (the batch, or the tokens) aside; None where there is
    none."""
    from autopar.analysis.dims import Split, op_dims

    try:
        dims = op_dims(node).dims
    except Exception:  # noqa: BLE001 - an op the dim rules do not know: it is timed whole only
        return None
    fed = _feeds(node)
    free = [d for d in dims if d.split is Split.FREE and d.size > 1
            and not any(where == 0 and i < len(fed) and fed[i] for i, where in enumerate(d.inputs))]
    return max(free, key=lambda d: d.size, default=None)


def shapes_at(node: Node, samples: int, ways: int) -> tuple[tuple[int, ...], ...] | None:
    """``node``'s input shapes (traced at one sample) with ``samples`` samples, its `split_dim` cut ``ways`` ways;
    None where the cut does not divide."""
    shapes = [list(info.shape) for info in node.inputs]
    for shape, fed in zip(shapes, _feeds(node)):
        if fed and shape:
            shape[0] *= samples
    if ways > 1:
        dim = split_dim(node)
        if dim is None or dim.size % ways:
            return None
        for i, where in enumerate(dim.inputs):
            if where is not None and i < len(shapes) and where < len(shapes[i]):
                shapes[i][where] //= ways
    return tuple(tuple(s) for s in shapes)


def _operator(name: str, device: str = "cpu") -> Any:
    """The aten overload a node's op names ("aten.addmm.default"); on a GPU, the attention core a CPU trace
    recorded becomes the device's own (`_attention`)."""
    if device != "cpu" and name in _CPU_ATTENTION:
        return _attention
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


# models are traced on a CPU's fake tensors, where SDPA dispatches to a CPU kernel no GPU has
_CPU_ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu.default"}


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, *_: Any) -> torch.Tensor:
    """What the CPU op computes, on this device's fastest kernel (flash attention on a GPU), grouped-query
    attention included."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=query.shape[-3] != key.shape[-3])


def _tensor(shape: tuple[int, ...], dtype: str, generator: torch.Generator, device: str = "cpu") -> torch.Tensor:
    torch_dtype = _TORCH_DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype {dtype}")
    if torch_dtype.is_floating_point:
        return torch.randn(shape, dtype=torch_dtype, generator=generator, device=device).requires_grad_()
    if torch_dtype is torch.bool:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return torch.zeros(shape, dtype=torch_dtype, device=device)


def time_op(node: Node, shapes: Sequence[tuple[int, ...]], *, repeats: int, sync: Any = None,
            barrier: Any = None, wrap: Any = None, inside: Any = None, device: str = "cpu",
            burst: int = 1) -> tuple[float, float]:
    """Median seconds of ``node``'s op forward, and of its backward (0 where no output needs a gradient), on
    random inputs of ``shapes``, after a warm-up. ``barrier`` (called before each run) keeps ranks measuring one
    op at once in step. ``wrap`` turns each input and output gradient into what the op runs on (a DTensor, to
    time DTensor's dispatch); ``inside`` (a function making a context manager) is entered around each forward, as
    a runtime runs its ops. Raises where the op cannot run on such inputs.

    ``burst`` (above 1 on a GPU) times that many runs issued back to back between two synchronisations, and
    counts their mean: in a training step the host queues the next op while the device runs this one, so an op
    costs the longer of its kernels and its launch, not their sum as one synchronised run measures it."""
    inside = inside or contextlib.nullcontext
    sync = sync or (lambda: None)
    barrier = barrier or (lambda: None)
    wrap = wrap or (lambda t: t)
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = [wrap(_tensor(shape, info.dtype, generator, device)) for shape, info in zip(shapes, node.inputs)]
    operator = _operator(node.op, device)

    in_place = node.op.split(".")[1].endswith("_")  # an in-place op writes a copy: a leaf cannot be written

    def call() -> Any:
        it = iter(t.clone() if in_place else t for t in tensors)
        # a list of tensors (cat, stack) was recorded as a tuple of TENSOR_ARG
        args = [next(it) if a == TENSOR_ARG else [next(it) if x == TENSOR_ARG else x for x in a]
                if isinstance(a, tuple) and TENSOR_ARG in a else a for a in node.args]
        args += list(it)  # tensors the record kept apart from its arguments (none for most ops)
        with inside():
            return operator(*args)

    def flat(out: Any) -> list[torch.Tensor]:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]

    inputs = [t for t in tensors if t.requires_grad]
    with torch.no_grad():
        call()  # warm-up (and the error, if it cannot run)
    if burst < 1:
        raise ValueError(f"burst must be at least 1, got {burst}")
    forward, backward = [], []
    for _ in range(repeats + 1):
        barrier()
        sync()
        begin = time.perf_counter()
        with torch.no_grad():
            for _ in range(burst):
                call()
        sync()
        forward.append((time.perf_counter() - begin) / burst)
        out = flat(call())
        if not out or not inputs:
            continue
        grads = [wrap(torch.randn(o.shape, dtype=o.dtype, generator=generator, device=device)) for o in out]
        barrier()
        sync()
        begin = time.perf_counter()
        for i in range(burst):  # one graph, walked ``burst`` times: its saved tensors are kept until the last
            torch.autograd.grad(out, inputs, grads, allow_unused=True, retain_graph=i < burst - 1)
        sync()
        backward.append((time.perf_counter() - begin) / burst)
    return _median(forward[1:]), _median(backward[1:]) if backward else 0.0


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


@dataclass(frozen=True, slots=True)
class Job:
    """One distinct op to time: its key, a node that runs it (traced at one sample), and where it was seen."""

    key: tuple
    node: Node
    name: str


def distinct_ops(nodes: Iterable[Node]) -> list[Job]:
    """The distinct timed ops of a model traced at one sample, first occurrence kept."""
    jobs: dict[tuple, Job] = {}
    for node in nodes:
        if not is_timed(node):
            continue
        key = op_key(node, 1)
        if key is not None and key not in jobs:
            jobs[key] = Job(key, node, node.module)
    return list(jobs.values())


def profile_ops_rank(rank: int, rendezvous: Any, jobs: Sequence[Job], points: Sequence[tuple[int, int]],
                     repeats: int, on_cuda: bool, sizes: Sequence[int] = ()) -> tuple | None:
    """One rank of `autopar profile-ops`: every job at every (samples, ways) point, all ranks on the same op at
    once (as the ranks of a plan share the host while it trains), DTensor's dispatch, and with 2 ranks or more each
    collective kind at ``sizes`` (`autopar.profiling.collectives`). Returns on rank 0 (key, name, work, forward,
    backward) per point measured, (key, name, why) per op that could not run, the dispatch and the collectives'
    (kind, group, points); None on the others."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # dropout's random ops on replicated DTensors (timing the dispatch) warn that a CPU mesh lacks DTensor's RNG
    warnings.filterwarnings("ignore", message="DTensor random operators")
    rendezvous.join(rank, backend="nccl" if on_cuda else "gloo")
    sync = torch.cuda.synchronize if on_cuda else None
    barrier = dist.barrier if dist.get_world_size() > 1 else None
    burst = GPU_BURST if on_cuda else 1  # `time_op`'s burst
    try:
        times, skipped = measure(jobs, points, repeats=repeats, sync=sync, barrier=barrier,
                                 device="cuda" if on_cuda else "cpu", burst=burst)
        dispatch = dispatch_overhead(jobs, repeats=repeats, sync=sync, barrier=barrier,
                                     device="cuda" if on_cuda else "cpu", burst=burst)
        collectives = []
        if dist.get_world_size() > 1 and sizes:
            from autopar.profiling.collectives import time_collectives

            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
            collectives = time_collectives(sizes, repeats=repeats, device=device, sync=sync)
    finally:
        dist.destroy_process_group()
    return (times, skipped, dispatch, collectives) if rank == 0 else None


def dispatch_overhead(jobs: Sequence[Job], *, repeats: int, sync: Any = None, barrier: Any = None,
                      device: str = "cpu", burst: int = 1) -> tuple[float, float] | None:
    """What DTensor adds to one op, forward and backward (seconds): the median over ``jobs`` (at one sample, unsplit)
    of each op's time on replicated DTensors over every rank, inside the modes the runtime runs a forward in
    (`autopar.runtime.intra.running`), less its time on plain tensors. An intra-op plan runs
    every op of the model through DTensor's dispatch (`autopar.runtime.intra`); the cost model adds this to each
    (`autopar.cost.intra.IntraCost`). None where no op could be timed both ways."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from autopar.runtime.intra import running

    mesh = init_device_mesh(device, (dist.get_world_size(),))

    def replicated(t: torch.Tensor) -> torch.Tensor:
        out = DTensor.from_local(t.detach(), mesh, [Replicate()], run_check=False)
        return out.requires_grad_() if t.requires_grad else out

    forward, backward = [], []
    for job in jobs:
        shapes = shapes_at(job.node, 1, 1)
        if shapes is None:
            continue
        try:
            plain = time_op(job.node, shapes, repeats=repeats, sync=sync, barrier=barrier, device=device,
                            burst=burst)
            wrapped = time_op(job.node, shapes, repeats=repeats, sync=sync, barrier=barrier, wrap=replicated,
                              inside=running, device=device, burst=burst)
        except Exception:  # noqa: BLE001 - an op DTensor has no rule for, or that cannot be replayed: left out
            continue
        forward.append(wrapped[0] - plain[0])
        if plain[1] and wrapped[1]:
            backward.append(wrapped[1] - plain[1])
    if not forward:
        return None
    return max(_median(forward), 0.0), max(_median(backward), 0.0) if backward else 0.0


def measure(jobs: Sequence[Job], points: Sequence[tuple[int, int]], *, repeats: int, sync: Any = None,
            barrier: Any = None, device: str = "cpu", burst: int = 1) -> tuple[list[tuple], list[tuple]]:
    """`profile_ops_rank`'s work in this process."""
    times: list[tuple] = []
    skipped: list[tuple] = []
    for job in jobs:
        ran = False
        why = ""
        for samples, ways in points:
            shapes = shapes_at(job.node, samples, ways)
            if shapes is None:
                continue
            try:
                forward, backward = time_op(job.node, shapes, repeats=repeats, sync=sync, barrier=barrier,
                                            device=device, burst=burst)
            except Exception as exc:  # noqa: BLE001 - an op that cannot run at these shapes: the roofline prices it
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                continue
            ran = True
            times.append((job.key, job.name, samples / ways, forward, backward))
        if not ran:
            skipped.append((job.key, job.name, why or "no point divides its dims"))
    return times, skipped


class OpTimes:
    """The database's op times for one dtype and one number of ranks on the host, as the cost model reads them."""

    def __init__(self, curves: dict[tuple, list[tuple[float, float, float]]],
                 dispatch: tuple[float, float] | None = None) -> None:
        self.curves = {key: sorted(points) for key, points in curves.items() if points}
        self.dispatch = dispatch  # DTensor's seconds per op, forward and backward (`dispatch_overhead`)

    def __bool__(self) -> bool:
        return bool(self.curves) or self.dispatch is not None

    def seconds(self, node: Node, *, traced_batch: int, shard: float) -> tuple[float, float] | None:
        """(forward, backward) seconds of ``node`` (traced at ``traced_batch`` samples) with its work split
        ``shard`` ways (below 1: more samples than traced), or None where the database cannot say."""
        if not is_timed(node) or shard <= 0:
            return None
        key = op_key(node, traced_batch)
        points = self.curves.get(key) if key is not None else None
        if not points:
            return None
        work = traced_batch / shard
        low = next((p for p in reversed(points) if p[0] <= work * (1 + 1e-9)), None)
        high = next((p for p in points if p[0] >= work * (1 - 1e-9)), None)
        if low is None or high is None:
            return None
        if high[0] <= low[0] * (1 + 1e-9):
            return low[1], low[2]
        at = math.log(work / low[0]) / math.log(high[0] / low[0])
        return _between(low[1], high[1], at), _between(low[2], high[2], at)


def _between(a: float, b: float, at: float) -> float:
    if a <= 0 or b <= 0:
        return a + (b - a) * at
    return math.exp(math.log(a) + (math.log(b) - math.log(a)) * at)
