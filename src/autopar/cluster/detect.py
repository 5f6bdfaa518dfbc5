"""Cluster detector (MAP section 4.2): measure a live process group and fit its link model.

Ranks are started on this machine with gloo (NCCL where GPUs are present), meet on a loopback rendezvous, time
all-reduce over message sizes from 1 KiB to 64 MiB, and rank 0 reports the median of each size; a rank that dies
ends the measurement at once (`autopar.cluster.ranks`). The fit is the line t = a + f * M / B of the ring
model (f = 2(n-1)/n) by least squares in relative error over messages of 4 MiB and more, where the bandwidth term
dominates; the per-step latency comes from the smallest message. The measured table is kept too: gloo's mid sizes
stray from any single line, and the collective cost model interpolates the table where one is present.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autopar.cluster.collectives import Collective, bus_factor
from autopar.cluster.compute import ComputeProfile, measure_compute
from autopar.cluster.presets import PRESETS
from autopar.cluster.ranks import Rendezvous, run_ranks, sigterm_raises
from autopar.cluster.spec import Cluster, Link, Measured

log = logging.getLogger(__name__)

SIZES = tuple(2**k for k in range(10, 22, 2)) + tuple(m * 2**20 for m in (4, 6, 8, 12, 16, 24, 32, 48, 64))
FIT_FROM = 4 * 2**20


@dataclass(frozen=True, slots=True)
class Calibration:
    cluster: Cluster
    ranks: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    bandwidth: float  # fitted bus bandwidth, bytes/s
    latency: float  # per ring step, seconds
    fit_error: float | None  # largest relative error of the fitted line over messages >= 4 MiB; None on one rank
    wall_seconds: float
    compute: ComputeProfile | None = None  # rank 0's, measured while every rank measured its own
    base: Cluster | None = None  # the preset the measurements replaced figures of
    links_measured: bool = True  # false on one rank: the links are the base's


def _worker(rank: int, rendezvous: Rendezvous, sizes: tuple[int, ...], compute: bool,
            ) -> tuple[list[float], Any, float | None]:
    torch.set_num_threads(1)
    backend = "nccl" if on_gpus(rendezvous.world) else "gloo"
    rendezvous.join(rank, backend=backend)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    try:
        results = _time_all_reduce(sizes, device) if rendezvous.world > 1 else []
        dist.barrier()
        profile = measure_compute(device, together=dist.barrier) if compute else None  # as they train
        dist.barrier()  # no rank tears the group down while a peer still finishes its last collective
    finally:
        dist.destroy_process_group()
    return results, profile, memory


def _time_all_reduce(sizes: tuple[int, ...], device: torch.device) -> list[float]:
    results = []
    for size in sizes:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buffer)  # warm up the connection for this size
        times = []
        for _ in range(9):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results.append(statistics.median(times))
    return results


def measure(nproc: int, sizes: tuple[int, ...] = SIZES, *, compute: bool = False,
            ) -> tuple[list[float], ComputeProfile | None, float | None]:
    """Median all-reduce seconds per size on ``nproc`` new ranks (rank 0's timings; none on one rank), with
    ``compute`` rank 0's `ComputeProfile`, measured while every rank measures its own, and its GPU's memory in
    bytes (None on a CPU).

    A rank that dies or raises stops the others and raises `RankError` naming it, within a second."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if nproc == 1 and not compute:
        raise ValueError("--nproc 1 measures no link (an all-reduce needs 2 ranks) and --links-only no compute: "
                         "nothing to measure; use --nproc 2 or more, or leave --links-only out")
    with sigterm_raises():
        seconds, profile, memory = run_ranks(_worker, nproc, args=(sizes, compute))[0]
    return list(seconds), profile, memory


def fit_link(sizes: tuple[int, ...], seconds: list[float], ranks: int) -> tuple[float, float, float]:
    """(bus bandwidth, per-step latency, largest relative error >= 4 MiB) of the ring all-reduce line."""
    factor = bus_factor(Collective.ALL_REDUCE, ranks)
    big = [(s, t) for s, t in zip(sizes, seconds) if s >= FIT_FROM]
    if len(big) < 2:
        raise ValueError("calibration needs at least two message sizes of 4 MiB or more")
    m = np.array([s for s, _ in big], dtype=float)
    t = np.array([t for _, t in big])
    design = np.stack([np.ones_like(m), factor * m], axis=1) / t[:, None]  # relative-error weighting
    (intercept, inverse_bandwidth), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inverse_bandwidth <= 0:
        raise RuntimeError("calibration measured no bandwidth trend; the machine may be too busy, rerun it")
    bandwidth = 1.0 / inverse_bandwidth
    predicted = max(intercept, 0.0) + factor * m / bandwidth
    error = float(np.max(np.abs(predicted - t) / t))
    latency = seconds[0] / (2 * (ranks - 1))
    return float(bandwidth), float(latency), error


def on_gpus(nproc: int) -> bool:
    """Whether ``nproc`` calibration ranks run on GPUs (one each, NCCL), as `_worker` starts them."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= nproc


def base_preset(name: str | None = None, nproc: int = 1) -> Cluster:
    """The preset a calibration of ``nproc`` ranks starts from: ``name``, else, where the ranks run on GPUs, the
    one whose device is this machine's first GPU (by its name: H100, H200, A100 80 or 40 GB, V100), else the
    ``cpu`` preset (which a GPU without a preset also gets). A preset of the other kind of device than the ranks
    run on is refused: its figures would be replaced by another device's."""
    if name is not None:
        if name not in PRESETS:
            raise ValueError(f"--base {name!r} is not a preset; presets: {', '.join(sorted(PRESETS))}")
        preset = PRESETS[name]
        if preset.device.is_cpu == on_gpus(nproc):
            where = "GPUs" if on_gpus(nproc) else (
                f"CPU processes ({nproc} ranks, {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                "CUDA devices)")
            raise ValueError(f"--base {name}: the {nproc} rank(s) run on {where} here, and {name} is of "
                             f"{preset.device.name} devices: name a preset of the devices measured")
        return preset
    if on_gpus(nproc):
        gpu = torch.cuda.get_device_name(0).upper()
        memory = torch.cuda.get_device_properties(0).total_memory
        for marker, preset in (("H200", "h200-141g-sxm"), ("H100", "h100-80g-sxm"), ("V100", "v100-32g-nvlink")):
            if marker in gpu:
                return PRESETS[preset]
        if "A100" in gpu:
            return PRESETS["a100-80g-sxm" if memory > 48 * 2**30 else "a100-40g-pcie"]
    return PRESETS["cpu"]


def calibrate(nproc: int, *, base: Cluster | None = None, progress: Callable[[str], None] | None = None,
              compute: bool = True) -> Calibration:
    """Measure, fit, and return ``base`` (default `base_preset`) with the measured links and, with ``compute``,
    the measured device (`ComputeProfile.device`). On one rank no link is measured: the links are ``base``'s,
    its topology too, and `Calibration.links_measured` is false."""
    start = time.perf_counter()
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    base = base or base_preset(nproc=nproc)
    if progress:
        what = f"all-reduce on {nproc} ranks, {len(SIZES)} sizes from 1 KiB to 64 MiB" if nproc > 1 else \
            "one rank (no link: the preset's links are kept)"
        progress(f"measuring {what}"
                 + (", then each rank's compute (GEMMs, bandwidth, attention, per-op cost)" if compute else "")
                 + " ...")
    sizes = tuple(sorted(SIZES)) if nproc > 1 else ()
    seconds, profile, memory = measure(nproc, sizes, compute=compute)
    device = profile.device(base.device, memory=memory) if profile is not None else base.device
    if device.is_cpu:  # ranks that are processes share the host's cores (`simulator.Timeline.shared`)
        from autopar.search.workers import cores

        device = replace(device, host_cores=cores())
    if nproc == 1:
        cluster = replace(base, name=f"{base.name}-calibrated", device=device)
        return Calibration(cluster, nproc, (), (), base.intra.bandwidth, base.intra.latency, None,
                           time.perf_counter() - start, profile, base, links_measured=False)
    bandwidth, latency, error = fit_link(sizes, seconds, nproc)
    link = Link(bandwidth=bandwidth, latency=latency, measured=Measured(ranks=nproc, bytes=sizes, seconds=tuple(seconds)))
    cluster = replace(base, name=f"{base.name}-calibrated", devices_per_node=nproc, nodes=1, intra=link, inter=link,
                      device=device)
    return Calibration(cluster, nproc, sizes, tuple(seconds), bandwidth, latency, error, time.perf_counter() - start,
                       profile, base)
