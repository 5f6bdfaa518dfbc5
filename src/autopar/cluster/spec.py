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
      # optional: GEMM efficiency by the GFLOPs of one kernel (interpolated in log GFLOPs, flat beyond the
      # ends); without it every GEMM runs at efficiency.matmul
      gemm_efficiency: {gflop: [10, 100, 1000], efficiency: [0.45, 0.65, 0.75]}
      kernel_overhead_us: 4
      reserved_gib: 2             # CUDA context, NCCL buffers, allocator fragmentation
      # optional, CPU processes only (`autopar calibrate` writes it): the cores a host's ranks share
      # host_cores: 2
    links:
      intra: {bandwidth_gbps: 230, latency_us: 3}
      inter: {bandwidth_gbps: 22, latency_us: 8}
      # optional measured table (from `autopar calibrate`): all-reduce bus bandwidth by message size
      # intra: {..., measured: {ranks: 2, bytes: [...], seconds: [...]}}
      # optional tables of one collective kind on groups of `ranks` (from a profile database's collectives):
      # intra: {..., tables: [{kind: all_gather, ranks: 2, bytes: [...], seconds: [...]}]}
"""

from __future__ import annotations

import math
import os
import reprlib
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from autopar.files import CLUSTER_FILE_LIMIT, read_text

GB = 1e9
GIB = 2**30


def _positive(owner: str, name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """Times of one collective kind (all-reduce unless named) measured on a live process group of ``ranks``, by
    message size (bytes ascending)."""

    ranks: int
    bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    kind: str = "all_reduce"

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"measured.kind must be one of {', '.join(COLLECTIVE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"measured.ranks must be at least 2, got {self.ranks!r}")
        if len(self.bytes) != len(self.seconds) or len(self.bytes) < 2:
            raise ValueError("measured.bytes and measured.seconds must be lists of the same length (2 or more)")
        if any(not isinstance(b, int) or b < 1 for b in self.bytes):
            raise ValueError(f"measured.bytes must be positive integers, got {self.bytes!r}")
        if any(a >= b for a, b in zip(self.bytes, self.bytes[1:])):
            raise ValueError(f"measured.bytes must be strictly ascending, got {self.bytes!r}")
        for s in self.seconds:
            _positive("measured", "seconds", s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One link tier as seen by one device: bus bandwidth (bytes/s) and per-step latency (s)."""

    bandwidth: float
    latency: float
    measured: Measured | None = None  # all-reduce on the ranks `calibrate` ran
    # collectives timed by kind on groups of their ranks (a profile database's; `autopar.profiling.db.ProfileDB.links`)
    tables: tuple[Measured, ...] = ()

    def table(self, kind: str, ranks: int) -> Measured | None:
        """The table measured for ``kind`` on groups of ``ranks``, if any."""
        return next((t for t in self.tables if t.kind == kind and t.ranks == ranks), None)

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
    # GEMM efficiency by the FLOPs of one kernel: (flops, efficiency) points, flops ascending, efficiency not
    # decreasing; interpolated in log(flops), flat beyond the ends. Empty: every contraction runs at
    # efficiency["matmul"]
    gemm_efficiency: tuple[tuple[float, float], ...] = ()
    # where devices are CPU processes: the cores a host's ranks share (as `autopar calibrate` measured them, all
    # ranks busy); None: each device computes on its own (a GPU). See `simulator.Timeline.shared`
    host_cores: int | None = None

    def __post_init__(self) -> None:
        owner = f"device {self.name}"
        if self.host_cores is not None and (not isinstance(self.host_cores, int) or isinstance(self.host_cores, bool)
                                            or not 1 <= self.host_cores <= MAX_CORES):
            raise ValueError(f"{owner}: host_cores must be an integer from 1 to {MAX_CORES:,}, got "
                             f"{self.host_cores!r}")
        _positive(owner, "memory", self.memory)
        _positive(owner, "hbm_bandwidth", self.hbm_bandwidth)
        if not self.peak_flops:
            raise ValueError(f"{owner}: peak_tflops needs at least one dtype")
        for dtype, value in self.peak_flops.items():
            _positive(owner, f"peak_tflops.{dtype}", value)
        for kind in ("matmul", "attention", "memory"):
            value = self.efficiency.get(kind)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{owner}: efficiency.{kind} must be in (0, 1], got {value!r}")
        for name, value in (("kernel_overhead", self.kernel_overhead), ("reserved", self.reserved)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{owner}: {name} must be zero or a positive finite number, got {value!r}")
        if self.reserved >= self.memory:
            raise ValueError(f"{owner}: reserved ({self.reserved!r} bytes) must be less than memory "
                             f"({self.memory!r} bytes)")
        check_curve(owner, self.gemm_efficiency)

    def matmul_efficiency(self, flops: float) -> float:
        """Fraction of peak a contraction kernel of ``flops`` FLOPs reaches: the GEMM curve at ``flops``
        (`interpolate`), or ``efficiency["matmul"]`` where the device has no curve."""
        if not self.gemm_efficiency:
            return self.efficiency["matmul"]
        return interpolate(self.gemm_efficiency, flops)

    @property
    def is_cpu(self) -> bool:
        """A CPU process (the ``cpu`` preset and what `autopar calibrate` measures of it), not a GPU."""
        return self.name.startswith("cpu")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype; bf16 falls back to fp16 (V100) and then to fp32."""
        for candidate in (dtype, "fp16" if dtype == "bf16" else dtype, "fp32"):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        raise ValueError(f"device {self.name} has no peak for {dtype}")


MAX_CURVE = 64  # points of a GEMM efficiency curve


def check_curve(owner: str, curve: Any) -> None:
    """A GEMM efficiency curve: a tuple of 2 to 64 (flops, efficiency) pairs, flops positive, finite and strictly
    ascending, efficiency in (0, 1] and not decreasing (a larger GEMM never runs further from peak)."""
    if not isinstance(curve, tuple) or (curve and not 2 <= len(curve) <= MAX_CURVE):
        raise ValueError(f"{owner}: gemm_efficiency must be a tuple of 2 to {MAX_CURVE} (flops, efficiency) "
                         f"points, got {_shown(curve)}")
    for k, point in enumerate(curve):
        if not isinstance(point, tuple) or len(point) != 2:
            raise ValueError(f"{owner}: gemm_efficiency[{k}] must be a (flops, efficiency) pair, got {_shown(point)}")
        flops, efficiency = point
        _positive(owner, f"gemm_efficiency[{k}] flops", flops)
        if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
            raise ValueError(f"{owner}: gemm_efficiency[{k}] efficiency must be in (0, 1], got {_shown(efficiency)}")
    for k, ((f0, e0), (f1, e1)) in enumerate(zip(curve, curve[1:])):
        if f1 <= f0:
            raise ValueError(f"{owner}: gemm_efficiency flops must be strictly ascending, got {f0:g} then {f1:g} "
                             f"at points {k} and {k + 1}")
        if e1 < e0:
            raise ValueError(f"{owner}: gemm_efficiency must not decrease with flops, got {e0:g} then {e1:g} at "
                             f"points {k} and {k + 1}")


def interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear in ``log(x)`` through the points ``(x_i, y_i)`` (x ascending), flat beyond the ends:

        y = y_i + (log x - log x_i) / (log x_(i+1) - log x_i) * (y_(i+1) - y_i)   for x_i <= x <= x_(i+1)
    """
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (y1 - y0)
    return curve[-1][1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    name: str
    device: Device
    devices_per_node: int
    nodes: int
    intra: Link  # between devices of one node
    inter: Link  # between nodes, per device

    def __post_init__(self) -> None:
        counts = (self.devices_per_node, self.nodes)
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
            raise ValueError(
                f"cluster {self.name}: devices_per_node and nodes must be at least 1, got "
                f"{self.devices_per_node} and {self.nodes}"
            )

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def ranks_per_host(self) -> int:
        """Ranks sharing one host: a node's devices, or all of them where the cluster is part of one node."""
        return min(self.devices_per_node, self.num_devices)

    @property
    def overlaps_communication(self) -> bool:
        """Whether data-parallel collectives can run beside compute, as DDP and FSDP issue them. On GPUs they do
        (NCCL on its own multiprocessors). Ranks that are CPU processes compute and communicate on the same cores
        (gloo's threads), so their collectives add to the step: on 2 shared cores a ZeRO 3 step of a small GPT
        measured 0.536 s where its ops and its collectives, each timed alone, sum to 0.368 s and overlapped
        would be 0.222 s."""
        return not self.device.is_cpu

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


# Bounds of the file's fields, in the file's units: generous for any real machine, finite so that nothing
# downstream overflows or divides by zero.
MAX_MEMORY_GIB = 65_536
MAX_TFLOPS = 1_000_000
MAX_GBPS = 1_000_000
MAX_OVERHEAD_US = 1_000_000  # one second per kernel launch
MAX_LATENCY_US = 10_000_000  # ten seconds per step
MAX_DEVICES_PER_NODE = 1_024
MAX_NODES = 131_072
MAX_MEASURED = 1_024  # sizes in a measured table
MAX_MESSAGE_BYTES = 2**50
MAX_MEASURED_SECONDS = 3_600
MAX_GFLOP = 1_000_000_000_000  # GFLOPs of one GEMM kernel: a zettaFLOP, beyond any real one
DTYPE_NAMES = ("bf16", "fp16", "fp32")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MAX_TABLES = 64  # collective tables on one link tier
EFFICIENCY_KINDS = ("matmul", "attention", "memory")
MAX_CORES = 65_536
_FIELDS = {
    "": ("name", "devices_per_node", "nodes", "device", "links"),
    "device.": ("name", "memory_gib", "peak_tflops", "hbm_gbps", "efficiency", "gemm_efficiency", "kernel_overhead_us",
                "reserved_gib", "host_cores"),
    "device.gemm_efficiency.": ("gflop", "efficiency"),
    "links.": ("intra", "inter"),
    "link": ("bandwidth_gbps", "latency_us", "measured", "tables"),
    "measured": ("ranks", "bytes", "seconds", "kind"),
}


def _shown(value: Any) -> str:
    return reprlib.repr(value)  # bounded, even for a YAML alias bomb


class _FileReader:
    """Reads fields of one cluster file; every error names the file and the field and says what is valid."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def mapping(self, value: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where.rstrip('.') or 'the file'} must be a mapping, got {_shown(value)}")
        for key in value:
            if key not in known:
                raise self.fail(f"unknown field {where}{key} (known: {', '.join(known)})")
        return value

    def need(self, mapping: dict[str, Any], key: str, where: str) -> Any:
        if key not in mapping:
            raise self.fail(f"missing field {where}{key}")
        return mapping[key]

    def number(self, value: Any, name: str, *, most: float, zero: bool = False) -> float:
        """A finite number in (0, most] (or [0, most] with ``zero``)."""
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not (value >= 0 if zero else value > 0) or value > most:
            kind = "zero or a positive" if zero else "a positive"
            raise self.fail(f"{name} must be {kind} finite number up to {most:,}, got {_shown(value)}")
        return float(value)

    def count(self, value: Any, name: str, *, least: int, most: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
            raise self.fail(f"{name} must be an integer from {least} to {most:,}, got {_shown(value)}")
        return value

    def text(self, value: Any, name: str) -> str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) or not str(value).strip():
            raise self.fail(f"{name} must be a non-empty string, got {_shown(value)}")
        return str(value)[:200]

    def listed(self, value: Any, name: str) -> list[Any]:
        if not isinstance(value, list) or not 2 <= len(value) <= MAX_MEASURED:
            raise self.fail(f"{name} must be a list of 2 to {MAX_MEASURED:,} values, got {_shown(value)}")
        return value


def _device(r: _FileReader, dev: Any) -> Device:
    dev = r.mapping(dev, "device.", _FIELDS["device."])
    memory_gib = r.number(r.need(dev, "memory_gib", "device."), "device.memory_gib", most=MAX_MEMORY_GIB)
    peaks = r.mapping(r.need(dev, "peak_tflops", "device."), "device.peak_tflops.", DTYPE_NAMES)
    if not peaks:
        raise r.fail(f"device.peak_tflops needs at least one of {', '.join(DTYPE_NAMES)}")
    efficiency = {"matmul": 0.7, "attention": 0.55, "memory": 0.8}
    for kind, value in r.mapping(dev.get("efficiency", {}), "device.efficiency.", EFFICIENCY_KINDS).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise r.fail(f"device.efficiency.{kind} must be in (0, 1], got {_shown(value)}")
        efficiency[kind] = float(value)
    reserved_gib = r.number(dev.get("reserved_gib", 2.0), "device.reserved_gib", zero=True, most=MAX_MEMORY_GIB)
    if reserved_gib >= memory_gib:
        raise r.fail(f"device.reserved_gib must be less than device.memory_gib ({memory_gib:g}), got {reserved_gib:g}")
    return Device(
        name=r.text(dev.get("name", "device"), "device.name"),
        memory=memory_gib * GIB,
        peak_flops={k: r.number(v, f"device.peak_tflops.{k}", most=MAX_TFLOPS) * 1e12 for k, v in peaks.items()},
        hbm_bandwidth=r.number(r.need(dev, "hbm_gbps", "device."), "device.hbm_gbps", most=MAX_GBPS) * GB,
        efficiency=efficiency,
        kernel_overhead=r.number(dev.get("kernel_overhead_us", 4.0), "device.kernel_overhead_us", zero=True,
                                 most=MAX_OVERHEAD_US) / 1e6,
        reserved=reserved_gib * GIB,
        gemm_efficiency=_gemm_curve(r, dev.get("gemm_efficiency")),
        host_cores=(r.count(dev["host_cores"], "device.host_cores", least=1, most=MAX_CORES)
                    if dev.get("host_cores") is not None else None),
    )


def _gemm_curve(r: _FileReader, value: Any) -> tuple[tuple[float, float], ...]:
    """``device.gemm_efficiency: {gflop: [...], efficiency: [...]}``: GFLOPs of one GEMM kernel, ascending, and
    the fraction of peak it reaches, not decreasing; absent: every GEMM at ``efficiency.matmul``."""
    if value is None:
        return ()
    where = "device.gemm_efficiency"
    curve = r.mapping(value, f"{where}.", _FIELDS[f"{where}."])
    gflop = r.listed(r.need(curve, "gflop", f"{where}."), f"{where}.gflop")
    efficiency = r.listed(r.need(curve, "efficiency", f"{where}."), f"{where}.efficiency")
    if len(gflop) != len(efficiency) or len(gflop) > MAX_CURVE:
        raise r.fail(f"{where}.gflop and {where}.efficiency must have the same length (2 to {MAX_CURVE}), got "
                     f"{len(gflop)} and {len(efficiency)}")
    sizes = [r.number(g, f"{where}.gflop[{i}]", most=MAX_GFLOP) for i, g in enumerate(gflop)]
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise r.fail(f"{where}.gflop must be strictly ascending, got {_shown(sizes)}")
    fractions = []
    for i, e in enumerate(efficiency):
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise r.fail(f"{where}.efficiency[{i}] must be in (0, 1], got {_shown(e)}")
        fractions.append(float(e))
    if any(a > b for a, b in zip(fractions, fractions[1:])):
        raise r.fail(f"{where}.efficiency must not decrease as gflop grows (a larger GEMM never runs further from "
                     f"peak), got {_shown(fractions)}")
    return tuple((g * 1e9, e) for g, e in zip(sizes, fractions))


def _measured(r: _FileReader, value: Any, where: str) -> Measured:
    m = r.mapping(value, f"{where}.", _FIELDS["measured"])
    sizes = r.listed(r.need(m, "bytes", f"{where}."), f"{where}.bytes")
    seconds = r.listed(r.need(m, "seconds", f"{where}."), f"{where}.seconds")
    if len(sizes) != len(seconds):
        raise r.fail(f"{where}.bytes and {where}.seconds must have the same length, got {len(sizes)} and "
                     f"{len(seconds)}")
    sizes = [r.count(b, f"{where}.bytes[{i}]", least=1, most=MAX_MESSAGE_BYTES) for i, b in enumerate(sizes)]
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise r.fail(f"{where}.bytes must be strictly ascending, got {_shown(sizes)}")
    kind = m.get("kind", "all_reduce")
    if kind not in COLLECTIVE_KINDS:
        raise r.fail(f"{where}.kind must be one of {', '.join(COLLECTIVE_KINDS)}, got {_shown(kind)}")
    return Measured(
        ranks=r.count(r.need(m, "ranks", f"{where}."), f"{where}.ranks", least=2, most=MAX_NODES),
        bytes=tuple(sizes),
        seconds=tuple(r.number(s, f"{where}.seconds[{i}]", most=MAX_MEASURED_SECONDS) for i, s in enumerate(seconds)),
        kind=kind,
    )


def _link(r: _FileReader, links: dict[str, Any], tier: str) -> Link:
    where = f"links.{tier}"
    spec = r.mapping(r.need(links, tier, "links."), f"{where}.", _FIELDS["link"])
    bandwidth = r.number(r.need(spec, "bandwidth_gbps", f"{where}."), f"{where}.bandwidth_gbps", most=MAX_GBPS)
    latency = r.number(spec.get("latency_us", 0.0), f"{where}.latency_us", zero=True, most=MAX_LATENCY_US)
    measured = spec.get("measured")
    tables = spec.get("tables", [])
    if not isinstance(tables, list) or len(tables) > MAX_TABLES:
        raise r.fail(f"{where}.tables must be a list of at most {MAX_TABLES} tables, got {_shown(tables)}")
    return Link(bandwidth=bandwidth * GB, latency=latency / 1e6,
                measured=None if measured is None else _measured(r, measured, f"{where}.measured"),
                tables=tuple(_measured(r, t, f"{where}.tables[{i}]") for i, t in enumerate(tables)))


def cluster_from_dict(data: dict[str, Any], *, source: str = "cluster") -> Cluster:
    """Build and validate a `Cluster` from the file format above; errors name the file and the bad field, and
    say what would be valid (unknown fields are refused: a misspelt optional field would silently be ignored)."""
    r = _FileReader(source)
    data = r.mapping(data, "", _FIELDS[""])
    device = _device(r, r.need(data, "device", ""))
    links = r.mapping(r.need(data, "links", ""), "links.", _FIELDS["links."])
    return Cluster(
        name=r.text(data.get("name", source), "name"),
        device=device,
        devices_per_node=r.count(r.need(data, "devices_per_node", ""), "devices_per_node", least=1,
                                 most=MAX_DEVICES_PER_NODE),
        nodes=r.count(data.get("nodes", 1), "nodes", least=1, most=MAX_NODES),
        intra=_link(r, links, "intra"),
        inter=_link(r, links, "inter"),
    )


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    d = cluster.device

    def link(l: Link) -> dict[str, Any]:
        out: dict[str, Any] = {"bandwidth_gbps": l.bandwidth / GB, "latency_us": l.latency * 1e6}
        if l.measured is not None:
            m = l.measured
            out["measured"] = {"ranks": m.ranks, "bytes": list(m.bytes), "seconds": list(m.seconds)}
        if l.tables:
            out["tables"] = [{"kind": t.kind, "ranks": t.ranks, "bytes": list(t.bytes), "seconds": list(t.seconds)}
                             for t in l.tables]
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
            **({"gemm_efficiency": {"gflop": [f / 1e9 for f, _ in d.gemm_efficiency],
                                    "efficiency": [e for _, e in d.gemm_efficiency]}}
               if d.gemm_efficiency else {}),
            **({"host_cores": d.host_cores} if d.host_cores is not None else {}),
        },
        "links": {"intra": link(cluster.intra), "inter": link(cluster.inter)},
    }


def _parse_error(exc: Exception) -> str:
    """A YAML or TOML parse error in one line: what went wrong and where."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


MAX_NESTING = 64  # a cluster file nests a few levels (links.intra.bandwidth); far more is not a cluster file


def _bracket_depth(text: str) -> int:
    """The deepest nesting of unquoted ``[`` and ``{`` in ``text`` (comments skipped), in one pass."""
    depth = deepest = 0
    quote = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote is not None:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


def load_cluster(spec: str) -> Cluster:
    """A preset name (see `PRESETS`) or a path to a .yaml/.yml/.toml file (a regular file of at most 1 MiB)."""
    from autopar.cluster.presets import PRESETS

    if spec in PRESETS:
        return PRESETS[spec]
    if not spec or not os.path.lexists(spec):
        raise ValueError(f"unknown cluster {spec!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    text = read_text(spec, what="cluster file", limit=CLUSTER_FILE_LIMIT)
    if _bracket_depth(text) > MAX_NESTING:  # PyYAML takes seconds over thousands of levels before it gives up
        raise ValueError(f"{spec}: cannot parse cluster file: nested more than {MAX_NESTING} levels deep")
    try:
        data = tomllib.loads(text) if Path(spec).suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{spec}: cannot parse cluster file: {_parse_error(exc)}") from None
    except RecursionError:
        raise ValueError(f"{spec}: cannot parse cluster file: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{spec}: a cluster file holds a mapping (name, device, links, ...), got {_shown(data)}")
    return cluster_from_dict(data, source=spec)
