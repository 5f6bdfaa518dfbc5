"""Cluster model: devices, link tiers, mesh placement, collective costs, presets, and the live detector."""

from autopar.cluster.collectives import Collective, collective_seconds, flat_seconds
from autopar.cluster.mesh import Axis, AxisPlacement, Mesh, build_mesh
from autopar.cluster.presets import PRESETS
from autopar.cluster.spec import Cluster, Device, Link, Measured, cluster_from_dict, cluster_to_dict, load_cluster

__all__ = [
    "PRESETS",
    "Axis",
    "AxisPlacement",
    "Cluster",
    "Collective",
    "Device",
    "Link",
    "Measured",
    "Mesh",
    "build_mesh",
    "cluster_from_dict",
    "cluster_to_dict",
    "collective_seconds",
    "flat_seconds",
    "load_cluster",
]
