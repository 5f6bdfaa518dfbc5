"""Fit the ``a100-80g-sxm`` preset's device parameters to Megatron-LM's weak-scaling table (bench/fidelity.py).

Run: python bench/fit_a100.py [--max-evaluations N] [--rounds R] [--loss soft_l1|linear] (about 3 minutes on 2
cores). Prints the fitted values as the Python of the preset (``autopar/cluster/presets.py``, where they are
copied by hand) and the table's errors with them.

Only device parameters are fitted, never a term per row:

- the GEMM efficiency curve at 100, 1,000 and 10,000 GFLOP per kernel (`Device.gemm_efficiency`; the table's
  GEMMs run 100 to 1,400 GFLOP per GPU, its LM heads 5,000 to 8,000), not decreasing by construction: the top
  point, the middle one as a fraction of it, the lowest as a fraction of the middle;
- the attention core's and memory-bound kernels' efficiencies;
- the links' efficiencies, bus bandwidth over line rate: NVLink 3 through NVSwitch (300 GB/s per GPU and
  direction) within a node, one 200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s) between nodes.

Each row is priced as `fidelity.iteration` prices it (through `autopar.cost.estimate`, with the options that make
it price what Megatron-LM ran), so this script fits whatever iteration model autopar has when it runs; the models
are traced once. The residual of a row is log(predicted / published); `scipy.optimize.least_squares` minimises
their robust sum (soft L1 at scale 0.05: squared below a 5% error, linear beyond, so a row the model misprices for
reasons other than the device does not dominate; ``--loss linear`` for plain least squares) within bounds at what
an A100 reaches: a GEMM at most 90% of peak, HBM streams at most 92%, InfiniBand at
most 95% of its line rate, NVLink at most 80% of its (NCCL's protocol costs some 20% on NVLink: its maintainers
quote 370 of 450 GB/s on H100, NVIDIA/nccl-tests#212; 8 A100-80G SXM measure about 200 GB/s of all-reduce bus
bandwidth, NVIDIA/nccl-tests#149).

The per-kernel overhead is not fitted: the table does not determine it (its kernels run milliseconds; between 5
and 10 us no row moves by more than 0.4%, and earlier fits put it at either end of a 2-10 us range), while models
of many small kernels (mixtures of experts, small widths) depend on it. It is held at `KERNEL_OVERHEAD_US`,
autopar's default for a GPU (`Device.kernel_overhead`: a CUDA launch's few microseconds).

Simulating the largest rows takes seconds each (tens of thousands of tasks), too slow for the hundreds of
evaluations a fit makes, so the fit runs in rounds: each round simulates the table once at the current values,
takes each row's ratio of simulated to closed-form iteration (the closed form, `PipelineModel` with
``screen=True``, prices the same stages without the timeline: 0.1-5% slower than the simulation here), and fits on
the closed form times those ratios; rounds repeat until no ratio moves by more than 0.1% (at most
``--rounds``). The errors printed at the end are the simulated ones, as bench/fidelity.py prints them.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import numpy as np
from scipy.optimize import least_squares

import fidelity
from autopar.cluster import Cluster, Link, load_cluster
from autopar.cluster.spec import GB
from autopar.cost import PipelineModel
from autopar.cost.megatron import pipeline_config

CURVE_GFLOP = (100.0, 1000.0, 10000.0)
KERNEL_OVERHEAD_US = 4.0  # held, not fitted (module docstring)
NVLINK3, HDR = 300 * GB, 25 * GB  # line rates per GPU and direction
# name, start, low, high
PARAMETERS = (
    ("gemm_top", 0.75, 0.3, 0.90),  # efficiency at 10,000 GFLOP
    ("gemm_mid_fraction", 0.95, 0.5, 1.0),  # at 1,000 GFLOP, as a fraction of the top
    ("gemm_low_fraction", 0.9, 0.5, 1.0),  # at 100 GFLOP, as a fraction of the middle
    ("attention", 0.5, 0.1, 0.9),
    ("memory", 0.8, 0.4, 0.92),
    ("intra_link", 230 / 300, 0.3, 0.80),
    ("inter_link", 22 / 25, 0.3, 0.95),
)


def cluster_of(x: np.ndarray, base: Cluster) -> Cluster:
    """The preset with the device parameters ``x`` (in the order of `PARAMETERS`)."""
    p = dict(zip((name for name, *_ in PARAMETERS), map(float, x)))
    mid = p["gemm_top"] * p["gemm_mid_fraction"]
    curve = ((CURVE_GFLOP[0] * 1e9, mid * p["gemm_low_fraction"]), (CURVE_GFLOP[1] * 1e9, mid),
             (CURVE_GFLOP[2] * 1e9, p["gemm_top"]))
    device = replace(base.device, gemm_efficiency=curve, kernel_overhead=KERNEL_OVERHEAD_US / 1e6,
                     efficiency={**base.device.efficiency, "matmul": p["gemm_top"], "attention": p["attention"],
                                 "memory": p["memory"]})
    return replace(base, device=device, intra=Link(bandwidth=p["intra_link"] * NVLINK3, latency=base.intra.latency),
                   inter=Link(bandwidth=p["inter_link"] * HDR, latency=base.inter.latency))


def rounded(cluster: Cluster) -> Cluster:
    """The values as the preset holds them: three decimals, bandwidths in whole GB/s, overhead in 0.1 us."""
    d = cluster.device
    device = replace(
        d, gemm_efficiency=tuple((f, round(e, 3)) for f, e in d.gemm_efficiency),
        efficiency={k: round(v, 3) for k, v in d.efficiency.items()},
        kernel_overhead=round(d.kernel_overhead * 1e6, 1) * 1e-6)
    return replace(cluster, device=device,
                   intra=Link(bandwidth=round(cluster.intra.bandwidth / GB) * GB, latency=cluster.intra.latency),
                   inter=Link(bandwidth=round(cluster.inter.bandwidth / GB) * GB, latency=cluster.inter.latency))


def as_python(cluster: Cluster) -> str:
    d = cluster.device
    curve = ", ".join(f"({f / 1e9:g}e9, {e:.3f})" for f, e in d.gemm_efficiency)
    return "\n".join([
        f"efficiency={{'matmul': {d.efficiency['matmul']:.3f}, 'attention': {d.efficiency['attention']:.3f}, "
        f"'memory': {d.efficiency['memory']:.3f}}},",
        f"gemm_efficiency=({curve}),",
        f"kernel_overhead={d.kernel_overhead * 1e6:.1f}e-6,",
        f"intra=Link(bandwidth={cluster.intra.bandwidth / GB:.0f} * GB, latency={cluster.intra.latency * 1e6:g}e-6),",
        f"inter=Link(bandwidth={cluster.inter.bandwidth / GB:.0f} * GB, latency={cluster.inter.latency * 1e6:g}e-6),",
    ])


def closed_form(row: fidelity.Row, graph, cluster: Cluster) -> float:  # noqa: ANN001
    """Seconds of one iteration of ``row`` by the pipeline model's closed form (the configuration `fidelity`
    prices, not simulated)."""
    config = row.config
    model = PipelineModel(graph, cluster.with_devices(row.gpus), traced_batch=config.mbs, kernels="compiled",
                          vocab_parallel=config.vocab_parallel, scatter_gather_sends=config.scatter_gather_sends,
                          screen=True)
    return model.estimate(pipeline_config(model, config), global_batch=row.batch,
                          overlap=config.overlap_dp).estimate.iteration_seconds


def fit(rows: list[fidelity.Row], graphs: list, base: Cluster, *, loss: str, max_evaluations: int,
        rounds: int) -> tuple[np.ndarray, int]:
    """Fitted parameters (in the order of `PARAMETERS`) and the evaluations of the table it took, in rounds of a
    fit on the closed form corrected by the simulation (module docstring)."""
    x = np.array([p[1] for p in PARAMETERS])
    bounds = (np.array([p[2] for p in PARAMETERS]), np.array([p[3] for p in PARAMETERS]))
    published = np.array([row.published for row in rows])
    flops = np.array([row.flops / row.gpus / 1e12 for row in rows])
    evaluations, ratios = 0, None
    for k in range(rounds):
        cluster = cluster_of(x, base)
        simulated = np.array([fidelity.iteration(row, g, cluster) for row, g in zip(rows, graphs)])
        new = simulated / np.array([closed_form(row, g, cluster) for row, g in zip(rows, graphs)])
        moved = np.inf if ratios is None else float(np.max(np.abs(new / ratios - 1)))
        ratios = new
        print(f"round {k + 1}: simulated / closed form {ratios.min():.3f}-{ratios.max():.3f}, moved {moved:.2%}")
        if moved < 1e-3:
            break

        def residuals(y: np.ndarray, ratios: np.ndarray = ratios) -> np.ndarray:
            nonlocal evaluations
            evaluations += 1
            c = cluster_of(y, base)
            seconds = np.array([closed_form(row, g, c) for row, g in zip(rows, graphs)]) * ratios
            return np.log(flops / seconds / published)

        x = least_squares(residuals, x, bounds=bounds, diff_step=1e-3, max_nfev=max_evaluations, loss=loss,
                          f_scale=0.05).x
    return x, evaluations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-evaluations", type=int, default=400, help="of the table per round (default 400)")
    parser.add_argument("--rounds", type=int, default=5, help="of simulation and fit (default 5)")
    parser.add_argument("--loss", choices=("linear", "soft_l1"), default="soft_l1",
                        help="least squares (linear) or robust (soft_l1, the default: a row the model gets wrong "
                        "for reasons other than the device pulls on the device's values linearly, not squared)")
    args = parser.parse_args()
    base = load_cluster("a100-80g-sxm")
    rows = fidelity.read_table()
    graphs = [fidelity.traced(row) for row in rows]
    start = time.perf_counter()
    x, evaluations = fit(rows, graphs, base, loss=args.loss, max_evaluations=args.max_evaluations,
                         rounds=args.rounds)
    fitted = rounded(cluster_of(x, base))
    print(f"fitted in {time.perf_counter() - start:.0f} s, {evaluations} closed-form evaluations of the table")
    for (name, _, low, high), value in zip(PARAMETERS, x):
        edge = " (at its bound)" if math.isclose(value, low, abs_tol=1e-3) or math.isclose(value, high, abs_tol=1e-3) \
            else ""
        print(f"  {name:<20} {value:8.3f}{edge}")
    print("\nfor presets.py:\n" + as_python(fitted))
    values = [row.flops / fidelity.iteration(row, g, fitted) / row.gpus / 1e12 for row, g in zip(rows, graphs)]
    errs, mean, worst = fidelity.errors(rows, values)
    print("\nwith the values as written (simulated):")
    for row, value, err in zip(rows, values, errs):
        print(f"  {row.params_billion:>7.1f}B  published {row.published:>4.0f}  predicted {value:6.1f}  {err:+6.1%}")
    slope = fidelity.slope(rows, values)
    print(f"mean |error| {mean:.1%}, max |error| {worst:.1%}, predicted trend {slope:+.1f} TFLOP/s per 10x "
          f"parameters ({'rises' if slope > 0 else 'does not rise'})")


if __name__ == "__main__":
    main()
