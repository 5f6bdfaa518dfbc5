"""`Cluster`: devices, their speed and memory, and the two link tiers between them; presets and YAML/TOML files.

File format (YAML or TOML; units in the key names):

    name: a100-80g-sxm
    devices_per_node: 8
    nodes: 4                      # optional: --gpus sets the device count
    device:
      name: A100-80G-SXM
      memory_gib: 80
      peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}
      hbm_gbps: 2039
      efficiency: {matmul: 0.7, attention: 0.55, memory: 0.8}
      kernel_overhead_us: 4
      reserved_gib: 2             # CUDA context, NCCL buffers, allocator fragmentation
    links:
      intra: {bandwidth_gbps: 230, latency_us: 3}
      inter: {bandwidth_gbps: 22, latency_us: 8}
      # optional measured table (from `autopar calibrate`): all-reduce bus bandwidth by message size
      # intra: {..., measured: {ranks: 2, bytes: [...], seconds: [...]}}
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

GB = 1e9
GIB = 2**30


def _positive(owner: str, name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """All-reduce times measured on a live process group, by message size (bytes ascending)."""

    ranks: int
    bytes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"measured.ranks must be at least 2, got {self.ranks}")
        if len(self.bytes) != len(self.seconds) or len(self.bytes) < 2:
            raise ValueError("measured.bytes and measured.seconds must be lists of the same length (2 or more)")
        if list(self.bytes) != sorted(self.bytes):
            raise ValueError("measured.bytes must be in ascending order")
        for s in self.seconds:
            _positive("measured", "seconds", s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One link tier as seen by one device: bus bandwidth (bytes/s) and per-step latency (s)."""

    bandwidth: float
    latency: float
    measured: Measured | None = None

    def __post_init__(self) -> None:
        _positive("link", "bandwidth", self.bandwidth)
        if not isinstance(self.latency, (int, float)) or self.latency < 0 or not math.isfinite(self.latency):
            raise ValueError(f"link: latency must be zero or positive, got {self.latency!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    name: str
    memory: float  # bytes
    peak_flops: dict[str, float]  # dtype name ("bf16", "fp16", "fp32") -> FLOP/s
    hbm_bandwidth: float  # bytes/s
    efficiency: dict[str, float] = field(default_factory=lambda: {"matmul": 0.7, "attention": 0.55, "memory": 0.8})
    kernel_overhead: float = 4e-6  # seconds per kernel launch
    reserved: float = 2 * GIB  # bytes the framework holds outside the model

    def __post_init__(self) -> None:
        owner = f"device {self.name}"
        _positive(owner, "memory", self.memory)
        _positive(owner, "hbm_bandwidth", self.hbm_bandwidth)
        if not self.peak_flops:
            raise ValueError(f"{owner}: peak_tflops needs at least one dtype")
        for dtype, value in self.peak_flops.items():
            _positive(owner, f"peak_tflops.{dtype}", value)
        for kind in ("matmul", "attention", "memory"):
            value = self.efficiency.get(kind)
            if value is None or not 0 < value <= 1:
                raise ValueError(f"{owner}: efficiency.{kind} must be in (0, 1], got {value!r}")
        if self.kernel_overhead < 0 or self.reserved < 0:
            raise ValueError(f"{owner}: kernel_overhead_us and reserved_gib must not be negative")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype; bf16 falls back to fp16 (V100) and then to fp32."""
        for candidate in (dtype, "fp16" if dtype == "bf16" else dtype, "fp32"):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        raise ValueError(f"device {self.name} has no peak for {dtype}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    name: str
    device: Device
    devices_per_node: int
    nodes: int
    intra: Link  # between devices of one node
    inter: Link  # between nodes, per device

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError(
                f"cluster {self.name}: devices_per_node and nodes must be at least 1, got "
                f"{self.devices_per_node} and {self.nodes}"
            )

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def with_devices(self, count: int) -> Cluster:
        """The same hardware sized to ``count`` devices (whole nodes, or part of one node)."""
        if count < 1:
            raise ValueError(f"--gpus must be at least 1, got {count}")
        if count <= self.devices_per_node:
            return replace(self, devices_per_node=count, nodes=1)
        if count % self.devices_per_node:
            raise ValueError(
                f"--gpus {count} is not a whole number of {self.name} nodes of {self.devices_per_node} devices"
            )
        return replace(self, nodes=count // self.devices_per_node)


def cluster_from_dict(data: dict[str, Any], *, source: str = "cluster") -> Cluster:
    """Build and validate a `Cluster` from the file format above; errors name the bad field."""

    def need(mapping: dict[str, Any], key: str, where: str) -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            raise ValueError(f"{source}: missing field {where}{key}")
        return mapping[key]

    dev = need(data, "device", "")
    links = need(data, "links", "")
    try:
        device = Device(
            name=str(dev.get("name", "device")),
            memory=_positive(source, "device.memory_gib", need(dev, "memory_gib", "device.")) * GIB,
            peak_flops={
                k: _positive(source, f"device.peak_tflops.{k}", v) * 1e12
                for k, v in need(dev, "peak_tflops", "device.").items()
            },
            hbm_bandwidth=_positive(source, "device.hbm_gbps", need(dev, "hbm_gbps", "device.")) * GB,
            efficiency={"matmul": 0.7, "attention": 0.55, "memory": 0.8, **dev.get("efficiency", {})},
            kernel_overhead=float(dev.get("kernel_overhead_us", 4.0)) * 1e-6,
            reserved=float(dev.get("reserved_gib", 2.0)) * GIB,
        )
        tiers = {}
        for tier in ("intra", "inter"):
            spec = need(links, tier, "links.")
            measured = spec.get("measured")
            tiers[tier] = Link(
                bandwidth=_positive(source, f"links.{tier}.bandwidth_gbps", need(spec, "bandwidth_gbps", f"links.{tier}.")) * GB,
                latency=float(spec.get("latency_us", 0.0)) * 1e-6,
                measured=None
                if measured is None
                else Measured(
                    ranks=int(measured["ranks"]),
                    bytes=tuple(int(b) for b in measured["bytes"]),
                    seconds=tuple(float(s) for s in measured["seconds"]),
                ),
            )
        return Cluster(
            name=str(data.get("name", source)),
            device=device,
            devices_per_node=int(need(data, "devices_per_node", "")),
            nodes=int(data.get("nodes", 1)),
            **tiers,
        )
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{source}: malformed cluster description ({type(exc).__name__}: {exc})") from exc
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(source) else f"{source}: {message}") from exc


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    d = cluster.device

    def link(l: Link) -> dict[str, Any]:
        out: dict[str, Any] = {"bandwidth_gbps": l.bandwidth / GB, "latency_us": l.latency * 1e6}
        if l.measured is not None:
            m = l.measured
            out["measured"] = {"ranks": m.ranks, "bytes": list(m.bytes), "seconds": list(m.seconds)}
        return out

    return {
        "name": cluster.name,
        "devices_per_node": cluster.devices_per_node,
        "nodes": cluster.nodes,
        "device": {
            "name": d.name,
            "memory_gib": d.memory / GIB,
            "peak_tflops": {k: v / 1e12 for k, v in d.peak_flops.items()},
            "hbm_gbps": d.hbm_bandwidth / GB,
            "efficiency": dict(d.efficiency),
            "kernel_overhead_us": d.kernel_overhead * 1e6,
            "reserved_gib": d.reserved / GIB,
        },
        "links": {"intra": link(cluster.intra), "inter": link(cluster.inter)},
    }


def load_cluster(spec: str) -> Cluster:
    """A preset name (see `PRESETS`) or a path to a .yaml/.yml/.toml file."""
    from autopar.cluster.presets import PRESETS

    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"unknown cluster {spec!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{spec}: cannot parse cluster file: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{spec}: a cluster file holds a mapping (name, device, links, ...)")
    return cluster_from_dict(data, source=spec)
