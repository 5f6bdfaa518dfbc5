"""Measure one device's compute as the cost model reads it (`autopar.cost.compute`): GEMM throughput over a grid
of shapes (peak and the efficiency curve), memory bandwidth, the attention core, and the fixed cost of one op.

Run on every rank at once inside `autopar calibrate` (`autopar.cluster.detect`), each figure started together, with
the thread count the runtime gives each rank (one on CPU), so that the figures are those of a rank training beside
its peers: on a CPU the ranks share cores, caches and memory bandwidth. On a GPU every kernel is timed with the
device synchronised.

The runtime trains in fp32 (`autopar run` builds the model in fp32), so fp32 is what is measured; a cluster file
from `calibrate` has an fp32 peak only, and bf16 or fp16 estimates on it fall back to it (`Device.peak`).
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
ATTENTION_SHAPE = (4, 8, 256, 32)  # batch, heads, sequence, head dim
BANDWIDTH_FLOATS = 1 << 22  # 16 MiB per tensor: past the caches of a CPU core
MIN_SECONDS = 0.2  # each figure is the mean of repeats that take at least this long together


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """What one rank measured: ``gemm`` as (flops, FLOP/s) per shape, bytes/s of a large elementwise add,
    the attention core's FLOP/s, and the seconds one small op costs forward and backward (autograd's share in)."""

    gemm: tuple[tuple[int, int, int, float], ...]  # (m, k, n, FLOP/s)
    bandwidth: float
    attention: float
    op_forward: float
    op_backward: float
    seconds: float  # how long measuring took

    @property
    def peak(self) -> float:
        return max(rate for *_, rate in self.gemm)

    def curve(self) -> tuple[tuple[float, float], ...]:
        """The GEMM efficiency curve `Device.gemm_efficiency` takes: per power of two of FLOPs the median
        efficiency of the shapes there, made non-decreasing (a larger GEMM never runs further from peak: where a
        smaller one measured faster, the larger one is given its figure), at most `MAX_CURVE` points."""
        bins: dict[int, list[tuple[float, float]]] = {}
        peak = self.peak
        for m, k, n, rate in self.gemm:
            flops = 2.0 * m * k * n
            bins.setdefault(round(math.log2(flops)), []).append((flops, rate / peak))
        points, best = [], 0.0
        for key in sorted(bins):
            flops = statistics.median(f for f, _ in bins[key])
            best = max(best, statistics.median(e for _, e in bins[key]))
            points.append((flops, min(1.0, best)))
        return tuple(points[:MAX_CURVE])

    def device(self, base: Device) -> Device:
        """``base`` with what was measured: the fp32 peak, the GEMM curve, the bandwidth (at efficiency 1: the
        figure is what an add reached), the attention core's efficiency against that peak, and one op's cost."""
        curve = self.curve()
        efficiency = {**base.efficiency, "matmul": curve[-1][1], "memory": 1.0,
                      "attention": min(1.0, self.attention / self.peak)}
        return replace(base, name=f"{base.name} (measured)", peak_flops={"fp32": self.peak},
                       hbm_bandwidth=self.bandwidth, efficiency=efficiency, gemm_efficiency=curve,
                       kernel_overhead=(self.op_forward + self.op_backward) / 2)

    def to_dict(self) -> dict:
        return {
            "peak_gflops": self.peak / 1e9,
            "gemm": [{"m": m, "k": k, "n": n, "gflops": rate / 1e9} for m, k, n, rate in self.gemm],
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
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    gemm = []
    for m, k, n in GEMM_SHAPES:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        seconds = _timed(lambda: torch.mm(a, b), sync, together)
        gemm.append((m, k, n, 2.0 * m * k * n / seconds))
    x, y = torch.randn(BANDWIDTH_FLOATS, device=device), torch.randn(BANDWIDTH_FLOATS, device=device)
    out = torch.empty_like(x)
    bandwidth = 3 * x.numel() * x.element_size() / _timed(lambda: torch.add(x, y, out=out), sync, together)
    b, h, s, d = ATTENTION_SHAPE
    q, k, v = (torch.randn(b, h, s, d, device=device) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    attention = 4.0 * b * h * s * s * d / _timed(lambda: sdpa(q, k, v), sync, together)
    op_forward, op_backward = _op_seconds(device, sync, together)
    return ComputeProfile(gemm=tuple(gemm), bandwidth=bandwidth, attention=attention, op_forward=op_forward,
                          op_backward=op_backward, seconds=time.perf_counter() - start)


def _timed(work: Callable[[], object], sync: Callable[[], None], together: Callable[[], None]) -> float:
    """Mean seconds of ``work`` over repeats taking `MIN_SECONDS` together (at least 3), after ``together`` and
    one warm-up.

    The mean, not the median: where ranks share cores, a kernel shorter than the scheduler's time slice mostly
    runs without being interrupted, so the median reports a core of its own (85-90 GFLOP/s per rank on 4 ranks
    and 2 cores, against about 40 for GEMMs longer than a slice); over a window several slices long, the mean
    counts the time a rank waits for its core, as its training steps do."""
    together()
    work()
    sync()
    times: list[float] = []
    while len(times) < 3 or sum(times) < MIN_SECONDS:
        begin = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - begin)
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
