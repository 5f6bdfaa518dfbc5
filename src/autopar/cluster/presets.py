"""Built-in clusters. Figures are vendor peaks and commonly measured bus bandwidths (NCCL tests), per device.

Link bandwidths are *bus* bandwidths one device sustains in a ring (NVLink/NVSwitch within a node; its share of
the node's InfiniBand adapters between nodes). Efficiencies are the fraction of peak a well-tuned large GEMM,
attention kernel and memory-bound kernel reach; `autopar calibrate` replaces the link figures with measured ones.
The ``a100-80g-sxm`` figures are fitted to published runs (below); the others are vendor figures.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cluster.spec import GB, GIB, Cluster, Device, Link

_GPU_EFFICIENCY = {"matmul": 0.7, "attention": 0.55, "memory": 0.8}

_H100 = Cluster(
    name="h100-80g-sxm",
    device=Device(
        name="H100-80G-SXM", memory=80 * GIB, peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        hbm_bandwidth=3350 * GB, efficiency=dict(_GPU_EFFICIENCY),
    ),
    devices_per_node=8, nodes=1,
    intra=Link(bandwidth=370 * GB, latency=3e-6),  # NVLink 4 through NVSwitch
    inter=Link(bandwidth=45 * GB, latency=8e-6),  # 8 x 400 Gb/s InfiniBand
)

PRESETS: dict[str, Cluster] = {
    "a100-40g-pcie": Cluster(
        name="a100-40g-pcie",
        device=Device(
            name="A100-40G-PCIe", memory=40 * GIB, peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
            hbm_bandwidth=1555 * GB, efficiency=dict(_GPU_EFFICIENCY),
        ),
        devices_per_node=8, nodes=1,
        intra=Link(bandwidth=20 * GB, latency=10e-6),  # PCIe 4.0 x16 through host bridges
        inter=Link(bandwidth=12.5 * GB, latency=10e-6),  # one 100 Gb/s adapter per node, shared
    ),
    # Fitted by bench/fit_a100.py to Megatron-LM's weak-scaling runs on Selene (Narayanan et al., SC'21, Table 1;
    # bench/data), each row priced as Megatron-LM ran it (compiled kernels, vocabulary-parallel embedding and head,
    # scatter/gather pipeline sends, its DDP's overlap or not): mean error 1.9%, largest 5.6%. The attention figure
    # stands for Megatron-LM's attention core of 2021 (softmax materialised, no flash attention): see the README,
    # "Fidelity", for what the values absorb and which sit at the fit's bounds
    "a100-80g-sxm": Cluster(
        name="a100-80g-sxm",
        device=Device(
            name="A100-80G-SXM", memory=80 * GIB, peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
            hbm_bandwidth=2039 * GB, efficiency={"matmul": 0.723, "attention": 0.131, "memory": 0.920},
            gemm_efficiency=((100e9, 0.623), (1000e9, 0.723), (10000e9, 0.723)),
            kernel_overhead=4.0e-6,  # held at autopar's default, not fitted (bench/fit_a100.py)
        ),
        devices_per_node=8, nodes=1,
        intra=Link(bandwidth=240 * GB, latency=3e-6),  # NVLink 3 through NVSwitch: 80% of 300 GB/s (NCCL's)
        inter=Link(bandwidth=24 * GB, latency=8e-6),  # 8 x 200 Gb/s InfiniBand: one adapter per GPU
    ),
    "v100-32g-nvlink": Cluster(
        name="v100-32g-nvlink",
        device=Device(
            name="V100-32G-SXM2", memory=32 * GIB, peak_flops={"fp16": 125e12, "fp32": 15.7e12},
            hbm_bandwidth=900 * GB, efficiency=dict(_GPU_EFFICIENCY),
        ),
        devices_per_node=8, nodes=1,
        intra=Link(bandwidth=130 * GB, latency=5e-6),  # NVLink 2 hybrid cube mesh
        inter=Link(bandwidth=6 * GB, latency=10e-6),  # 4 x 100 Gb/s per node
    ),
    "h100-80g-sxm": _H100,
    # the H100's chip with more and faster memory: the same peaks, NVLink and network
    "h200-141g-sxm": replace(_H100, name="h200-141g-sxm", device=replace(
        _H100.device, name="H200-141G-SXM", memory=141 * GB, hbm_bandwidth=4800 * GB,
        peak_flops=dict(_H100.device.peak_flops), efficiency=dict(_GPU_EFFICIENCY))),
    # This machine: gloo over loopback between processes on 2 cores (see PYTORCH-FACTS); replace with
    # `autopar calibrate` output for a measured table.
    "cpu": Cluster(
        name="cpu",
        device=Device(
            name="cpu-process", memory=6 * GIB, peak_flops={"fp32": 50e9, "bf16": 20e9, "fp16": 10e9},
            hbm_bandwidth=10 * GB, efficiency={"matmul": 0.5, "attention": 0.3, "memory": 0.5},
            kernel_overhead=20e-6, reserved=0.25 * GIB,
        ),
        devices_per_node=4, nodes=1,
        intra=Link(bandwidth=1.0 * GB, latency=1.5e-3),
        inter=Link(bandwidth=1.0 * GB, latency=1.5e-3),
    ),
}
