"""Logical mesh axes laid over physical devices, and which link tier each axis uses.

Devices are numbered node by node (node k holds devices k*D .. k*D + D-1) and the mesh is laid out row-major, the
last axis fastest, as `init_device_mesh` does. An axis with stride s (the product of the sizes after it) and size n
groups devices {base + j*s}: it stays in one node when s*n <= D, puts every member on its own node when s >= D, and
otherwise spans D/s devices per node times n*s/D nodes (hierarchical).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from autopar.cluster.spec import Cluster


class Axis(str, Enum):
    """Mesh axis names. An axis is a mesh dimension; a tensor has dims."""

    PP = "pp"
    DP = "dp"
    TP = "tp"
    CP = "cp"
    EP = "ep"


@dataclass(frozen=True, slots=True)
class AxisPlacement:
    """How one mesh axis sits on the cluster: ``intra`` members per node times ``inter`` nodes."""

    name: str
    size: int
    intra: int
    inter: int

    @property
    def hierarchical(self) -> bool:
        return self.intra > 1 and self.inter > 1


@dataclass(frozen=True, slots=True)
class Mesh:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    placements: tuple[AxisPlacement, ...]

    def axis(self, name: str) -> AxisPlacement:
        for placement in self.placements:
            if placement.name == name:
                return placement
        raise KeyError(f"mesh has no axis {name!r} (axes: {', '.join(self.names)})")

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def build_mesh(cluster: Cluster, axes: dict[str, int]) -> Mesh:
    """Lay ``axes`` (outermost first) over ``cluster``; the product of sizes must equal its device count."""
    names, sizes = tuple(axes), tuple(axes.values())
    for name, size in axes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name} must have a positive size, got {size!r}")
    total = 1
    for s in sizes:
        total *= s
    if total != cluster.num_devices:
        shape = " x ".join(f"{n}={s}" for n, s in axes.items())
        raise ValueError(
            f"mesh {shape} has {total} devices but the cluster has {cluster.num_devices}; the axis sizes must "
            "multiply to the device count (--gpus)"
        )
    per_node = cluster.devices_per_node
    placements = []
    stride = total
    for name, size in axes.items():
        stride //= size
        if stride * size <= per_node:
            intra, inter = size, 1
        elif stride >= per_node:
            intra, inter = 1, size
        else:
            intra = per_node // stride
            inter = size // intra
            if intra * inter != size:
                raise ValueError(f"mesh axis {name}={size} does not divide evenly over nodes of {per_node} devices")
        placements.append(AxisPlacement(name, size, intra, inter))
    return Mesh(names, sizes, tuple(placements))
