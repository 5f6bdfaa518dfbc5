"""Cost model: compute roofline, collective costs on the mesh, memory, and Megatron-style configuration estimates."""

from autopar.cost.megatron import estimate
from autopar.cost.memory import model_states
from autopar.cost.types import CollectiveUse, Estimate, MemoryBreakdown, ParallelConfig

__all__ = ["CollectiveUse", "Estimate", "MemoryBreakdown", "ParallelConfig", "estimate", "model_states"]
