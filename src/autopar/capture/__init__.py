"""Capture: trace a model on fake tensors into the Graph IR (MAP's symbolic profiler)."""

from autopar.capture.graph import Graph, LayerSummary, ModuleMemory, Node, Ref, RepeatGroup, StateInfo, TensorInfo
from autopar.capture.tracer import CaptureError, trace

__all__ = [
    "CaptureError",
    "Graph",
    "LayerSummary",
    "ModuleMemory",
    "Node",
    "Ref",
    "RepeatGroup",
    "StateInfo",
    "TensorInfo",
    "trace",
]
