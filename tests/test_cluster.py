"""Cluster files and presets, mesh placement over link tiers, and collective formulas against hand values."""

from __future__ import annotations

import json
import dataclasses
import math

import pytest
import torch
import yaml

from autopar.cluster import (
    PRESETS,
    AxisPlacement,
    Collective,
    Link,
    build_mesh,
    cluster_to_dict,
    collective_seconds,
    flat_seconds,
    load_cluster,
)

GB = 1e9


def test_presets_exist_and_round_trip_through_yaml_and_toml(tmp_path) -> None:
    assert {"a100-40g-pcie", "a100-80g-sxm", "v100-32g-nvlink", "h100-80g-sxm", "cpu"} <= set(PRESETS)
    cluster = PRESETS["a100-80g-sxm"].with_devices(64)
    assert (cluster.nodes, cluster.devices_per_node) == (8, 8)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster_to_dict(cluster)))
    assert load_cluster(str(path)) == cluster
    toml = tmp_path / "c.toml"
    toml.write_text(
        'name = "t"\ndevices_per_node = 4\n[device]\nmemory_gib = 16\nhbm_gbps = 900\npeak_tflops = {fp16 = 100}\n'
        "[links.intra]\nbandwidth_gbps = 100\nlatency_us = 2\n[links.inter]\nbandwidth_gbps = 10\n"
    )
    loaded = load_cluster(str(toml))
    assert loaded.intra.bandwidth == 100 * GB and loaded.device.peak("bf16") == 100e12


def test_every_preset_reads_back_exactly_as_written(tmp_path) -> None:
    """Microseconds (kernel overhead, link latency) come back as the same floats, and a CPU host's cores too."""
    import dataclasses

    cpu = PRESETS["cpu"]
    for name, cluster in [*PRESETS.items(), ("cores", dataclasses.replace(
            cpu, device=dataclasses.replace(cpu.device, host_cores=2)))]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cluster_to_dict(cluster)))
        assert load_cluster(str(path)) == cluster, name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["links"]["intra"].update(bandwidth_gbps=-5), "links.intra.bandwidth_gbps must be a positive"),
        (lambda d: d["device"].pop("memory_gib"), "missing field device.memory_gib"),
        (lambda d: d["device"]["efficiency"].update(matmul=1.5), "efficiency.matmul must be in (0, 1]"),
        (lambda d: d["device"]["peak_tflops"].update(bf16="fast"), "peak_tflops.bf16 must be a positive"),
        (lambda d: d["device"].update(host_cores=0), "device.host_cores must be an integer from 1"),
        (lambda d: d["device"].update(host_cores=2.5), "device.host_cores must be an integer from 1"),
    ],
)
def test_bad_cluster_files_name_the_field(tmp_path, edit, message: str) -> None:
    data = cluster_to_dict(PRESETS["a100-80g-sxm"])
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=str(path)) as err:
        load_cluster(str(path))
    assert message in str(err.value)


def test_unknown_preset_and_impossible_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown cluster 'a100'.*a100-80g-sxm"):
        load_cluster("a100")
    with pytest.raises(ValueError, match="not a whole number of a100-80g-sxm nodes"):
        PRESETS["a100-80g-sxm"].with_devices(12)
    with pytest.raises(ValueError, match="has 128 devices but the cluster has 64"):
        build_mesh(PRESETS["a100-80g-sxm"].with_devices(64), {"dp": 16, "tp": 8})
    with pytest.raises(ValueError, match="latency must be zero or positive"):
        Link(bandwidth=1.0, latency=-1.0)


def test_mesh_axes_map_to_link_tiers() -> None:
    cluster = PRESETS["a100-80g-sxm"].with_devices(64)
    mesh = build_mesh(cluster, {"pp": 2, "dp": 4, "tp": 8})
    assert mesh.axis("tp") == AxisPlacement("tp", 8, intra=8, inter=1)  # inside a node: NVLink
    assert mesh.axis("dp") == AxisPlacement("dp", 4, intra=1, inter=4)  # one member per node: InfiniBand
    mesh = build_mesh(cluster, {"dp": 16, "tp": 4})
    assert mesh.axis("dp") == AxisPlacement("dp", 16, intra=2, inter=8)  # both: hierarchical
    assert mesh.axis("dp").hierarchical


def test_ring_formulas_by_hand() -> None:
    link = Link(bandwidth=100 * GB, latency=5e-6)
    m, n = 1e9, 8
    assert flat_seconds(Collective.ALL_GATHER, m, n, link) == pytest.approx(7 / 8 * 0.01 + 7 * 5e-6)
    assert flat_seconds(Collective.REDUCE_SCATTER, m, n, link) == pytest.approx(7 / 8 * 0.01 + 7 * 5e-6)
    assert flat_seconds(Collective.ALL_TO_ALL, m, n, link) == pytest.approx(7 / 8 * 0.01 + 7 * 5e-6)
    assert flat_seconds(Collective.ALL_REDUCE, m, n, link) == pytest.approx(2 * 7 / 8 * 0.01 + 14 * 5e-6)
    assert flat_seconds(Collective.BROADCAST, m, n, link) == pytest.approx(0.01 + 3 * 5e-6)
    assert flat_seconds(Collective.SEND_RECV, m, 2, link) == pytest.approx(0.01 + 5e-6)
    # small messages on many ranks: the tree beats the ring's 2(n-1) latency steps
    small = flat_seconds(Collective.ALL_REDUCE, 1024, 64, link)
    assert small == pytest.approx(2 * 1024 / (100 * GB) + 2 * 6 * 5e-6)
    assert flat_seconds(Collective.ALL_REDUCE, m, 1, link) == 0.0
    with pytest.raises(ValueError, match="must not be negative"):
        flat_seconds(Collective.ALL_REDUCE, -1, 2, link)


def test_hierarchical_all_reduce_by_hand() -> None:
    cluster = PRESETS["a100-80g-sxm"].with_devices(16)
    axis = AxisPlacement("dp", 16, intra=8, inter=2)
    m = 1e9
    intra, inter = cluster.intra, cluster.inter
    expected = (
        7 / 8 * m / intra.bandwidth + 7 * intra.latency  # reduce-scatter in the node
        + 1 / 2 * 2 * (m / 8) / inter.bandwidth + 2 * inter.latency  # all-reduce of an eighth across 2 nodes
        + 7 / 8 * m / intra.bandwidth + 7 * intra.latency  # all-gather in the node
    )
    assert collective_seconds(Collective.ALL_REDUCE, m, axis, cluster) == pytest.approx(expected)
    # crossing nodes costs more than staying inside one
    inside = collective_seconds(Collective.ALL_REDUCE, m, AxisPlacement("tp", 8, 8, 1), cluster)
    assert inside < collective_seconds(Collective.ALL_REDUCE, m, AxisPlacement("dp", 8, 1, 8), cluster)


def test_measured_table_is_interpolated() -> None:
    from autopar.cluster import Measured

    measured = Measured(ranks=2, bytes=(1024, 1 << 20, 64 << 20), seconds=(1e-3, 2e-3, 64e-3))
    link = Link(bandwidth=1 * GB, latency=1e-3, measured=measured)
    # at a measured size the all-reduce on the calibrated group size takes the measured time
    assert flat_seconds(Collective.ALL_REDUCE, 1 << 20, 2, link) == pytest.approx(2e-3)
    between = flat_seconds(Collective.ALL_REDUCE, 8 << 20, 2, link)
    assert 2e-3 < between < 64e-3 and math.isfinite(between)


def test_link_fit_recovers_bandwidth_from_noisy_measurements() -> None:
    import numpy as np

    from autopar.cluster.detect import fit_link

    rng = np.random.default_rng(0)
    sizes = tuple(2**k for k in range(10, 27))  # 1 KiB .. 64 MiB
    bandwidth, latency = 1.2e9, 0.8e-3
    seconds = [(latency + 2 * 0.5 * s / bandwidth) * rng.uniform(0.9, 1.1) for s in sizes]  # 2 ranks, +-10%
    fitted, _, error = fit_link(sizes, seconds, 2)
    assert fitted == pytest.approx(bandwidth, rel=0.15)
    assert error < 0.25


def test_a_deeply_nested_cluster_file_is_refused_before_yaml_parses_it(tmp_path) -> None:  # noqa: ANN001
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"deep.yaml: cannot parse cluster file: nested more than 64 levels deep"):
        load_cluster(str(deep))
    quoted = tmp_path / "quoted.yaml"  # brackets in quotes and comments are text, not nesting
    quoted.write_text("name: '" + "[" * 100 + "'  # " + "{" * 100 + "\n")
    with pytest.raises(ValueError) as caught:
        load_cluster(str(quoted))
    assert "levels deep" not in str(caught.value) and "missing field device" in str(caught.value)


def test_measured_compute_becomes_the_device_the_cost_model_reads(tmp_path) -> None:
    """GEMM rates by shape become a peak and a non-decreasing efficiency curve (a larger GEMM measured slower than
    a smaller one is given the smaller one's figure); the bandwidth is taken at efficiency 1; the attention core is
    a share of that peak; one op's cost is the mean of its forward and backward. The device reads back from YAML."""
    from autopar.cluster.compute import ComputeProfile

    profile = ComputeProfile(
        gemm=((8, 8, 8, 1e9), (32, 32, 32, 20e9), (64, 64, 64, 15e9), (256, 256, 256, 40e9), (512, 512, 512, 50e9)),
        bandwidth=8e9, attention=25e9, op_forward=4e-6, op_backward=8e-6, seconds=1.0)
    assert profile.peak == 50e9
    curve = profile.curve()
    assert [round(e, 3) for _, e in curve] == [0.02, 0.4, 0.4, 0.8, 1.0]
    assert [f for f, _ in curve] == [2 * 8**3, 2 * 32**3, 2 * 64**3, 2 * 256**3, 2 * 512**3]
    device = profile.device(PRESETS["cpu"].device)
    assert device.peak("fp32") == device.peak("bf16") == 50e9
    assert device.hbm_bandwidth == 8e9 and device.efficiency["memory"] == 1.0
    assert device.efficiency["attention"] == pytest.approx(0.5) and device.kernel_overhead == pytest.approx(6e-6)
    assert device.matmul_efficiency(2 * 64**3) == pytest.approx(0.4)
    cluster = dataclasses.replace(PRESETS["cpu"].with_devices(2), device=device)
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(cluster_to_dict(cluster)))
    assert load_cluster(str(path)).device == device


def test_every_compute_figure_is_measured_with_the_peers_at_the_same_point(monkeypatch) -> None:
    """`calibrate` passes its barrier as ``together``: it runs before each timed figure (every GEMM shape, the
    bandwidth, the attention core, a small op forward and with its backward), so that ranks sharing cores are
    timed beside peers doing the same work rather than while they wait."""
    from autopar.cluster import compute

    monkeypatch.setattr(compute, "GEMM_SHAPES", ((8, 8, 8), (16, 16, 16), (32, 32, 32)))
    monkeypatch.setattr(compute, "BANDWIDTH_FLOATS", 1024)
    monkeypatch.setattr(compute, "ATTENTION_SHAPE", (1, 2, 8, 4))
    monkeypatch.setattr(compute, "MIN_SECONDS", 0.0)
    meetings = []
    profile = compute.measure_compute(torch.device("cpu"), together=lambda: meetings.append(len(meetings)))
    assert len(meetings) == 3 + 4
    assert len(profile.gemm) == 3 and profile.peak > 0


def test_a_gpu_calibration_keeps_each_dtype_and_is_set_beside_the_preset_it_replaces() -> None:
    """On a GPU, bf16 and fp16 GEMMs are measured beside fp32: each dtype gets its own peak, the device keeps the
    bf16 curve (what GPU training computes in) and the attention core against the bf16 peak, and the GPU's memory.
    `against` sets each GEMM beside the preset's assumption: a share of the preset's peak for that dtype, and the
    preset's efficiency at that size."""
    from autopar.cluster.compute import ComputeProfile

    fp32 = ((256, 1024, 1024, 10e12), (4096, 4096, 4096, 50e12))
    bf16 = ((256, 1024, 1024, 20e12), (4096, 4096, 4096, 600e12))
    profile = ComputeProfile(gemm=fp32, bandwidth=4e12, attention=300e12, op_forward=1e-5, op_backward=2e-5,
                             seconds=1.0, low_precision=(("bf16", bf16),))
    assert profile.peaks == {"fp32": 50e12, "bf16": 600e12} and profile.curve_dtype == "bf16"
    base = PRESETS["h200-141g-sxm"].device
    device = profile.device(base, memory=140e9)
    assert device.peak("bf16") == 600e12 and device.peak("fp32") == 50e12
    assert device.memory == 140e9 and device.efficiency["attention"] == pytest.approx(0.5)
    assert device.matmul_efficiency(2 * 256 * 1024 * 1024) == pytest.approx(20 / 600)
    rows = profile.against(base)
    assert [(r["dtype"], r["m"]) for r in rows] == [("fp32", 256), ("fp32", 4096), ("bf16", 256), ("bf16", 4096)]
    assert rows[3]["of_preset_peak"] == pytest.approx(600 / 989) and rows[3]["preset_efficiency"] == 0.7
    assert profile.to_dict()["low_precision"]["bf16"][1]["tflops"] == pytest.approx(600)


@pytest.mark.slow
def test_one_rank_calibrates_compute_and_keeps_the_presets_links(capsys) -> None:
    """``--nproc 1`` (one GPU's compute): no link is measured, the base preset's links and topology are kept and the
    report says so; the preset named with --base (by default this machine's: here the CPU's) is the one replaced, and
    each GEMM is set beside it."""
    from autopar.cluster import compute
    from tests.test_cli import run_cli

    code, out, err = run_cli(capsys, "calibrate", "--nproc", "1", "--base", "cpu", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["fit"] is None and data["measurements"] == [] and data["base"] == "cpu"
    cluster = data["cluster"]
    assert cluster["devices_per_node"] == PRESETS["cpu"].devices_per_node
    assert cluster["links"]["inter"]["bandwidth_gbps"] == PRESETS["cpu"].inter.bandwidth / 1e9
    assert cluster["device"]["name"] == "cpu-process (measured)"
    assert len(data["against_base"]) == len(compute.GEMM_SHAPES)
    code, out, err = run_cli(capsys, "calibrate", "--nproc", "1")
    assert code == 0 and "links not measured (one rank): cpu's are kept" in out
    assert "measured against the cpu preset" in out


def test_a_calibration_with_nothing_to_measure_or_an_unknown_base_is_refused(capsys) -> None:
    from tests.test_cli import run_cli

    code, out, err = run_cli(capsys, "calibrate", "--nproc", "1", "--base", "tpu")
    assert code == 2 and "--base 'tpu' is not a preset" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, "calibrate", "--nproc", "1", "--links-only")
    assert code == 2 and "nothing to measure" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, "calibrate", "--nproc", "2", "--base", "h100-80g-sxm")  # CPU ranks here
    assert code == 2 and "--base h100-80g-sxm: the 2 rank(s) run on CPU processes" in err


def test_a_burst_of_runs_counts_each_run_and_stops_after_the_time_measured() -> None:
    """A GPU's figures are timed as bursts of runs issued back to back; each repeat's wall time counts towards the
    time `_timed` measures for, so a burst of 10 runs stops after as long as single runs would, not ten times
    longer."""
    import time as clock

    from autopar.cluster.compute import MIN_SECONDS, _timed

    calls = []

    def work() -> None:
        calls.append(1)
        clock.sleep(0.005)

    seconds = _timed(work, lambda: None, lambda: None, burst=10)
    assert 0.004 < seconds < 0.05
    # one warm-up, then bursts of 10 until their runs take MIN_SECONDS: about MIN_SECONDS / 5 ms runs
    assert 30 <= len(calls) - 1 <= 10 * math.ceil(MIN_SECONDS / 0.005 / 10) + 10
    assert (len(calls) - 1) % 10 == 0
