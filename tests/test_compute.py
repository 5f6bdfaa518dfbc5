"""Compute pricing: memory-bound chains fused or not (the plan's kernels), and the GEMM efficiency curve."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import yaml

from autopar.capture import Node, Ref, TensorInfo
from autopar.cluster import PRESETS, Device, cluster_to_dict, load_cluster
from autopar.cost.compute import DataFlow, chain_bytes, node_seconds, sequence_seconds

N = 1 << 20  # elements of each activation
X = TensorInfo((N,), "float32")  # 4 MiB
DEVICE = Device(name="d", memory=80e9, peak_flops={"fp32": 100e12}, hbm_bandwidth=1e12,
                efficiency={"matmul": 0.5, "attention": 0.5, "memory": 0.5}, kernel_overhead=0.0)
RATE = 1e12 * 0.5  # bytes per second a memory-bound kernel moves


def _ew(i: int, *sources: int, saved: int = 0) -> Node:
    """An elementwise op reading the outputs of ``sources`` (-1: a model input) and writing one activation."""
    refs = tuple(Ref(s) for s in sources)
    return Node(id=i, op="aten.mul.Tensor", module="m", module_type="M", inputs=(X,) * len(refs), sources=refs,
                outputs=(X,), bytes_read=X.nbytes * len(refs), bytes_written=X.nbytes, saved_bytes=saved)


def _view(i: int, source: int) -> Node:
    return Node(id=i, op="aten.view.default", module="m", module_type="M", inputs=(X,), sources=(Ref(source),),
                outputs=(X,), is_view=True)


def _mm(i: int, source: int, *, m: int = 1024, k: int = 1024, n: int = 1024) -> Node:
    a, w, out = TensorInfo((m, k), "float32"), TensorInfo((k, n), "float32"), TensorInfo((m, n), "float32")
    return Node(id=i, op="aten.mm.default", module="m", module_type="M", inputs=(a, w),
                sources=(Ref(source), Ref(-1, state="m.weight")), outputs=(out,), flops_forward=2 * m * k * n,
                flops_backward=4 * m * k * n, bytes_read=a.nbytes + w.nbytes, bytes_written=out.nbytes)


def _chain(k: int) -> list[Node]:
    """x -> f1 -> f2 -> ... -> fk: k elementwise ops, each reading the one before."""
    return [_ew(0, -1)] + [_ew(i, i - 1) for i in range(1, k)]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_chain_of_k_elementwise_ops_is_one_pass_compiled_and_k_passes_eager(k: int) -> None:
    nodes = [(n, 1.0) for n in _chain(k)]
    one_pass = 2 * X.nbytes / RATE  # read the input, write the output
    eager, _ = sequence_seconds(nodes, DEVICE, kernels="eager")
    compiled, compiled_backward = sequence_seconds(nodes, DEVICE, kernels="compiled")
    assert eager == pytest.approx(k * one_pass)
    assert compiled == pytest.approx(one_pass)
    assert compiled_backward == pytest.approx(2 * one_pass)


def test_eager_is_the_sum_of_node_prices() -> None:
    nodes = [_ew(0, -1), _mm(1, 0), _ew(2, 1)]
    forward, backward = sequence_seconds([(n, 2.0) for n in nodes], DEVICE, kernels="eager")
    assert forward == sum(node_seconds(n, DEVICE, backward=False, shard=2.0) for n in nodes)
    assert backward == sum(node_seconds(n, DEVICE, backward=True, shard=2.0) for n in nodes)


def test_a_contraction_is_never_fused() -> None:
    device = replace(DEVICE, kernel_overhead=1e-3)
    mm = _mm(2, 1)
    nodes = [(_ew(0, -1), 1.0), (_ew(1, 0), 1.0), (mm, 1.0), (_ew(3, 2), 1.0), (_ew(4, 3), 1.0)]
    forward, backward = sequence_seconds(nodes, device, kernels="compiled")
    chain = 2 * X.nbytes / RATE + 1e-3  # each side of the matmul: one fused kernel
    assert forward == pytest.approx(2 * chain + node_seconds(mm, device, backward=False))
    backward_chain = 2 * 2 * X.nbytes / RATE + 1e-3  # twice the forward bytes, one kernel
    assert backward == pytest.approx(2 * backward_chain + node_seconds(mm, device, backward=True))
    alone, _ = sequence_seconds([(mm, 1.0)], device, kernels="compiled")
    assert alone == node_seconds(mm, device, backward=False)


def test_views_do_not_break_a_chain_and_an_output_read_later_is_written() -> None:
    nodes = [_ew(0, -1), _view(1, 0), _ew(2, 1), _ew(3, 2), _mm(4, 3), _ew(5, 4, 0)]
    priced = [(n, 1.0) for n in nodes]
    flow = DataFlow.of(nodes)
    assert flow.readers[(0, 0)] == {2, 5}  # node 5 reads node 0 (a residual) after the matmul
    # the first chain reads x, writes f0 (read after the matmul) and f3 (read by the matmul): three tensors
    assert chain_bytes([(nodes[0], 1.0), (nodes[2], 1.0), (nodes[3], 1.0)], flow=flow) == 3 * X.nbytes
    forward, _ = sequence_seconds(priced, DEVICE, kernels="compiled")
    last_chain = 3 * X.nbytes / RATE  # reads the matmul's output and f0, writes its own
    assert forward == pytest.approx(3 * X.nbytes / RATE + node_seconds(nodes[4], DEVICE, backward=False) + last_chain)


def test_a_value_saved_inside_a_chain_is_written_and_shards_divide_the_bytes() -> None:
    mask = _ew(1, 0, saved=X.nbytes)  # read only inside the chain, but kept for backward
    nodes = [(_ew(0, -1), 4.0), (mask, 4.0), (_ew(2, 0, 1), 4.0)]
    assert chain_bytes(nodes, flow=DataFlow.of(n for n, _ in nodes)) == 3 * X.nbytes / 4  # x, mask, output


def test_a_layer_of_a_traced_gpt_prices_fewer_bytes_compiled() -> None:
    from autopar.capture import trace
    from autopar.cost.layers import analyse
    from autopar.zoo import load

    zoo = load("gpt3-125m", batch=1, seq=128, layers=2, hidden=256, heads=4, vocab=512)
    layer = next(row for row in analyse(trace(zoo.module, example_kwargs=zoo.inputs)) if row.repeated)
    priced = [(n, 1.0) for n in layer.nodes]
    device = PRESETS["a100-80g-sxm"].device
    eager, compiled = (sequence_seconds(priced, device, kernels=k) for k in ("eager", "compiled"))
    kernels = sum(not n.is_view for n in layer.nodes)
    assert compiled[0] < eager[0] and compiled[1] < eager[1]
    # contractions and the attention core (5 kernels) stay; the rest fold into the chains between them
    matmuls = sum(node_seconds(n, device, backward=False) for n in layer.nodes if n.flops_forward)
    assert compiled[0] - matmuls < 0.5 * (eager[0] - matmuls) and kernels > 15


def test_an_unknown_kernels_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="kernels must be one of eager, compiled, got 'fused'"):
        sequence_seconds([(_ew(0, -1), 1.0)], DEVICE, kernels="fused")


# ---- the GEMM efficiency curve -------------------------------------------------------------------------------

CURVE = ((1e9, 0.3), (1e11, 0.7), (1e13, 0.8))


def test_the_curve_interpolates_in_log_flops_and_is_flat_beyond_its_ends() -> None:
    device = replace(DEVICE, gemm_efficiency=CURVE)
    assert device.matmul_efficiency(1e10) == pytest.approx(0.5)
    assert device.matmul_efficiency(1e12) == pytest.approx(0.75)
    assert device.matmul_efficiency(1e6) == 0.3 and device.matmul_efficiency(1e16) == 0.8
    values = [device.matmul_efficiency(10 ** (e / 4)) for e in range(24, 64)]
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert DEVICE.matmul_efficiency(1e6) == DEVICE.efficiency["matmul"]  # no curve: the constant


def test_small_gemms_run_further_from_peak() -> None:
    device = replace(DEVICE, gemm_efficiency=CURVE)
    small, large = _mm(0, -1, m=256, k=256, n=256), _mm(1, -1, m=8192, k=8192, n=8192)
    per_flop = [node_seconds(n, device, backward=False) / n.flops_forward for n in (small, large)]
    assert per_flop[0] > 2 * per_flop[1]
    # a GEMM split 8 ways by tensor parallelism is a smaller kernel, priced at the smaller kernel's efficiency
    kernel = large.flops_forward / 8
    split = node_seconds(large, device, backward=False, shard=8)
    assert split == pytest.approx(kernel / (100e12 * device.matmul_efficiency(kernel)))


@pytest.mark.parametrize(("curve", "message"), [
    (((1e9, 0.5),), "gemm_efficiency must be a tuple of 2 to 64"),
    (((1e9, 0.5), (1e9, 0.6)), "gemm_efficiency flops must be strictly ascending"),
    (((1e9, 0.6), (1e10, 0.5)), "gemm_efficiency must not decrease with flops, got 0.6 then 0.5 at points 0 and 1"),
    (((1e9, 0.5), (1e10, 1.5)), "gemm_efficiency[1] efficiency must be in (0, 1], got 1.5"),
    (((-1.0, 0.5), (1e10, 0.6)), "gemm_efficiency[0] flops must be a positive number"),
    ([(1e9, 0.5), (1e10, 0.6)], "gemm_efficiency must be a tuple"),
])
def test_a_bad_curve_is_refused_naming_the_field(curve, message: str) -> None:
    with pytest.raises(ValueError, match="device d: ") as err:
        replace(DEVICE, gemm_efficiency=curve)
    assert message in str(err.value)


def test_the_curve_round_trips_through_a_cluster_file(tmp_path) -> None:
    cluster = replace(PRESETS["a100-80g-sxm"], device=replace(PRESETS["a100-80g-sxm"].device, gemm_efficiency=CURVE))
    data = cluster_to_dict(cluster)
    assert data["device"]["gemm_efficiency"] == {"gflop": [1.0, 100.0, 10000.0], "efficiency": [0.3, 0.7, 0.8]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_cluster(str(path)).device.gemm_efficiency == CURVE
    del data["device"]["gemm_efficiency"]
    path.write_text(yaml.safe_dump(data))
    assert load_cluster(str(path)).device.gemm_efficiency == ()  # absent: the constant efficiency.matmul


@pytest.mark.parametrize(("curve", "message"), [
    ({"gflop": [1, 10], "efficiency": [0.5, 1.2]}, "device.gemm_efficiency.efficiency[1] must be in (0, 1], got 1.2"),
    ({"gflop": [10, 1], "efficiency": [0.5, 0.6]}, "device.gemm_efficiency.gflop must be strictly ascending"),
    ({"gflop": [1, 10], "efficiency": [0.6, 0.5]}, "device.gemm_efficiency.efficiency must not decrease"),
    ({"gflop": [1, 10, 100], "efficiency": [0.5, 0.6]}, "device.gemm_efficiency.gflop and "
                                                         "device.gemm_efficiency.efficiency must have the same length"),
    ({"gflop": [1, "x"], "efficiency": [0.5, 0.6]}, "device.gemm_efficiency.gflop[1] must be a positive"),
    ({"gflop": [1, 10]}, "missing field device.gemm_efficiency.efficiency"),
    ({"flops": [1, 10], "efficiency": [0.5, 0.6]}, "unknown field device.gemm_efficiency.flops"),
    ([0.5, 0.6], "device.gemm_efficiency must be a mapping"),
])
def test_a_bad_curve_in_a_cluster_file_names_the_field(tmp_path, curve, message: str) -> None:
    data = cluster_to_dict(PRESETS["a100-80g-sxm"])
    data["device"]["gemm_efficiency"] = curve
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=str(path)) as err:
        load_cluster(str(path))
    assert message in str(err.value)


def test_the_fitted_preset_prices_contractions_by_its_curve() -> None:
    device = PRESETS["a100-80g-sxm"].device
    assert len(device.gemm_efficiency) >= 2 and all(0 < e <= 1 for _, e in device.gemm_efficiency)
    assert math.isclose(device.matmul_efficiency(1e18), device.gemm_efficiency[-1][1])
    assert device.matmul_efficiency(1e9) == device.gemm_efficiency[0][1] <= device.gemm_efficiency[-1][1]
