"""Measure one device's compute as the cost model reads it (`autopar.cost.compute`): GEMM throughput over a grid
of shapes (peak and the efficiency curve), memory bandwidth, the attention core, and the fixed cost of one op.

Run on every rank at once inside `autopar calibrate` (`autopar.cluster.detect`), each figure started together, with
the thread count the runtime gives each rank (one on CPU), so that the figures are those of a rank training beside
its peers: on a CPU the ranks share cores, caches and memory bandwidth. On a GPU every kernel is timed with the
device synchronised.

The runtime trains in fp32 (`autopar run` builds the model in fp32), so fp32 is what is measured on a CPU; a
cluster file from `calibrate` there has an fp32 peak only, and bf16 or fp16 estimates on it fall back to it
(`Device.peak`). On a CUDA device, where training computes in bf16 or fp16 on tensor cores, those dtypes are
measured too (TF32 left as PyTorch's default has it, off for matrix products), over larger shapes: a GPU's small
GEMMs are bound by launching them, its large ones by the tensor cores.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from autopar.cluster.spec import MAX_CURVE, Device

# (m, k, n) of one product, from a projection of a tiny model to one of a mid-size one at batch x sequence rows
GEMM_SHAPES = tuple((m, k, n) for m in (64, 256, 1024, 4096) for k, n in ((64, 64), (256, 256), (256, 1024),
                                                                          (1024, 256), (1024, 1024)))
# on a GPU: from a projection of a small model at a few thousand tokens to one of a 70B model at 16k tokens
CUDA_GEMM_SHAPES = tuple((m, k, n) for m in (256, 1024, 4096, 16384) for k, n in ((1024, 1024), (1024, 4096),
                                                                                (4096, 1024), (4096, 4096),
                                                                                (8192, 8192)))
CUDA_DTYPES = ("bf16", "fp16")  # measured on a CUDA device besides fp32
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION_SHAPE = (4, 8, 256, 32)  # batch, heads, sequence, head dim
CUDA_ATTENTION_SHAPE = (4, 32, 4096, 128)  # a 7B model's attention at 4k tokens
BANDWIDTH_FLOATS = 1 << 22  # 16 MiB per tensor: past the caches of a CPU core
CUDA_BANDWIDTH_FLOATS = 1 << 28  # 1 GiB per tensor: far past a GPU's L2
MIN_SECONDS = 0.2  # each figure is the mean of repeats that take at least this long together
# runs a GPU's timings issue back to back between synchronisations: enough that the later launches hide behind the
# earlier kernels, as in a training step's stream (a CPU runs each op as it is issued: 1 there)
GPU_BURST = 10


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """What one rank measured: ``gemm`` as (flops, FLOP/s) per shape, bytes/s of a large elementwise add,
    the attention core's FLOP/s, and the seconds one small op costs forward and backward (autograd's share in)."""

    gemm: tuple[tuple[int, int, int, float], ...]  # (m, k, n, FLOP/s) in fp32
    bandwidth: float
    attention: float  # in `curve_dtype`
    op_forward: float
    op_backward: float
    seconds: float  # how long measuring took
    # GEMMs in the dtypes a GPU trains in, (dtype, ((m, k, n, FLOP/s), ...)); none on a CPU
    low_precision: tuple[tuple[str, tuple[tuple[int, int, int, float], ...]], ...] = ()

    @property
    def peak(self) -> float:
        """The fp32 peak: the fastest fp32 GEMM measured."""
        return max(rate for *_, rate in self.gemm)

    def rows(self, dtype: str) -> tuple[tuple[int, int, int, float], ...]:
        if dtype == "fp32":
            return self.gemm
        for name, rows in self.low_precision:
            if name == dtype:
                return rows
        raise KeyError(dtype)

    @property
    def peaks(self) -> dict[str, float]:
        """The fastest GEMM measured per dtype."""
        return {"fp32": self.peak, **{name: max(rate for *_, rate in rows) for name, rows in self.low_precision}}

    @property
    def curve_dtype(self) -> str:
        """The dtype whose efficiency curve and attention core the device keeps (`Device` has one curve): bf16
        where measured (what GPU training computes in), else fp32."""
        return "bf16" if any(name == "bf16" for name, _ in self.low_precision) else "fp32"

    def curve(self, dtype: str | None = None) -> tuple[tuple[float, float], ...]:
        """The GEMM efficiency curve `Device.gemm_efficiency` takes, of ``dtype`` (default `curve_dtype`): per
        power of two of FLOPs the median efficiency of the shapes there against that dtype's peak, made
        non-decreasing (a larger GEMM never runs further from peak: where a smaller one measured faster, the
        larger one is given its figure), at most `MAX_CURVE` points."""
        rows = self.rows(dtype or self.curve_dtype)
        bins: dict[int, list[tuple[float, float]]] = {}
        peak = max(rate for *_, rate in rows)
        for m, k, n, rate in rows:
            flops = 2.0 * m * k * n
            bins.setdefault(round(math.log2(flops)), []).append((flops, rate / peak))
        points, best = [], 0.0
        for key in sorted(bins):
            flops = statistics.median(f for f, _ in bins[key])
            best = max(best, statistics.median(e for _, e in bins[key]))
            points.append((flops, min(1.0, best)))
        return tuple(points[:MAX_CURVE])

    def device(self, base: Device, *, memory: float | None = None) -> Device:
        """``base`` with what was measured: the peak of each dtype measured, the GEMM curve (`curve_dtype`'s), the
        bandwidth (at efficiency 1: the figure is what an add reached), the attention core's efficiency against
        its dtype's peak, one op's cost, and ``memory`` (a GPU's, in bytes) where given."""
        curve = self.curve()
        efficiency = {**base.efficiency, "matmul": curve[-1][1], "memory": 1.0,
                      "attention": min(1.0, self.attention / self.peaks[self.curve_dtype])}
        return replace(base, name=f"{base.name} (measured)", peak_flops=self.peaks,
                       hbm_bandwidth=self.bandwidth, efficiency=efficiency, gemm_efficiency=curve,
                       kernel_overhead=(self.op_forward + self.op_backward) / 2,
                       memory=base.memory if memory is None else memory)

    def against(self, base: Device) -> list[dict]:
        """Each GEMM measured beside what ``base`` (a preset) assumes for it: the measured FLOP/s as a share of the
        preset's peak for that dtype, and the preset's efficiency at that size (`Device.matmul_efficiency`). A
        share above the preset's efficiency: the preset prices that GEMM too slow."""
        out = []
        for dtype in ("fp32", *(name for name, _ in self.low_precision)):
            peak = base.peak(dtype)
            for m, k, n, rate in self.rows(dtype):
                flops = 2.0 * m * k * n
                out.append({"dtype": dtype, "m": m, "k": k, "n": n, "tflops": rate / 1e12,
                            "of_preset_peak": rate / peak, "preset_efficiency": base.matmul_efficiency(flops)})
        return out

    def to_dict(self) -> dict:
        return {
            "peak_gflops": self.peak / 1e9,
            "peaks_tflops": {dtype: rate / 1e12 for dtype, rate in self.peaks.items()},
            "curve_dtype": self.curve_dtype,
            "gemm": [{"m": m, "k": k, "n": n, "gflops": rate / 1e9} for m, k, n, rate in self.gemm],
            "low_precision": {name: [{"m": m, "k": k, "n": n, "tflops": rate / 1e12} for m, k, n, rate in rows]
                              for name, rows in self.low_precision},
            "bandwidth_gbps": self.bandwidth / 1e9,
            "attention_gflops": self.attention / 1e9,
            "op_forward_us": self.op_forward * 1e6,
            "op_backward_us": self.op_backward * 1e6,
            "seconds": self.seconds,
        }


def measure_compute(device: torch.device, *, together: Callable[[], None] = lambda: None) -> ComputeProfile:
    """Time this process's compute on ``device`` (see the module's docstring). ``together`` runs before each figure
    is measured: the process group's barrier, so that every rank measures the same thing at the same time and none
    is timed while its peers wait or do lighter work. On 4 CPU ranks sharing 2 cores, unaligned figures gave a GEMM
    peak of 84-91 GFLOP/s per rank in three calibrations of four (a core of its own, what 2 ranks get); aligned,
    43-60 in six."""
    start = time.perf_counter()
    on_cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)
    shapes = CUDA_GEMM_SHAPES if on_cuda else GEMM_SHAPES
    burst = GPU_BURST if on_cuda else 1

    def gemms(dtype: torch.dtype) -> tuple[tuple[int, int, int, float], ...]:
        rows = []
        for m, k, n in shapes:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            seconds = _timed(lambda: torch.mm(a, b), sync, together, burst)
            rows.append((m, k, n, 2.0 * m * k * n / seconds))
            del a, b
        return tuple(rows)

    gemm = gemms(torch.float32)
    low = tuple((name, gemms(_TORCH[name])) for name in CUDA_DTYPES) if on_cuda else ()
    floats = CUDA_BANDWIDTH_FLOATS if on_cuda else BANDWIDTH_FLOATS
    x, y = torch.randn(floats, device=device), torch.randn(floats, device=device)
    out = torch.empty_like(x)
    bandwidth = 3 * x.numel() * x.element_size() / _timed(lambda: torch.add(x, y, out=out), sync, together, burst)
    del x, y, out
    b, h, s, d = CUDA_ATTENTION_SHAPE if on_cuda else ATTENTION_SHAPE
    dtype = torch.bfloat16 if on_cuda else torch.float32  # `ComputeProfile.curve_dtype`
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # causal on a GPU, as a language model trains; the FLOPs counted are the whole product's, as the cost model
    # counts them, so a causal kernel's rate reads up to twice what it computes
    attention = 4.0 * b * h * s * s * d / _timed(lambda: sdpa(q, k, v, is_causal=on_cuda), sync, together, burst)
    op_forward, op_backward = _op_seconds(device, sync, together)
    return ComputeProfile(gemm=gemm, bandwidth=bandwidth, attention=attention, op_forward=op_forward,
                          op_backward=op_backward, seconds=time.perf_counter() - start, low_precision=low)


def _timed(work: Callable[[], object], sync: Callable[[], None], together: Callable[[], None],
           burst: int = 1) -> float:
    """Mean seconds of ``work`` over repeats taking `MIN_SECONDS` together (at least 3), after ``together`` and
    one warm-up; each repeat issues ``burst`` runs back to back before it synchronises.

    The mean, not the median: where ranks share cores, a kernel shorter than the scheduler's time slice mostly
    runs without being interrupted, so the median reports a core of its own (85-90 GFLOP/s per rank on 4 ranks
    and 2 cores, against about 40 for GEMMs longer than a slice); over a window several slices long, the mean
    counts the time a rank waits for its core, as its training steps do.

    A burst (on a GPU) measures the kernel's own rate: one synchronised run also counts its launch and the
    synchronisation's round trip, which the cost model adds apart (``kernel_overhead``), so a small GEMM timed
    alone would pay them twice."""
    together()
    work()
    sync()
    times: list[float] = []
    while len(times) < 3 or sum(times) * burst < MIN_SECONDS:
        begin = time.perf_counter()
        for _ in range(burst):
            work()
        sync()
        times.append((time.perf_counter() - begin) / burst)
    return statistics.fmean(times)


def _op_seconds(device: torch.device, sync: Callable[[], None], together: Callable[[], None],
                ops: int = 200) -> tuple[float, float]:
    """Seconds per small op forward (recorded by autograd, as in training) and per op in its backward: a chain
    of ``ops`` elementwise ops on 64 floats, whose data costs nothing beside the op's own overhead."""
    leaf = torch.randn(64, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        x = leaf
        for _ in range(ops):
            x = x * 1.0001
        return x.sum()

    forward_seconds = _timed(forward, sync, together) / ops
    total = _timed(lambda: forward().backward(), sync, together) / ops
    return forward_seconds, max(total - forward_seconds, 0.0)
