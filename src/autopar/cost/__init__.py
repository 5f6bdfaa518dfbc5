"""Cost model: roofline compute, collective costs on the mesh, memory, the pipeline model (uniform Megatron-style
configurations are its simplest case), and intra-op block costs."""

from autopar.cost.megatron import estimate
from autopar.cost.memory import gradient_sync, model_states
from autopar.cost.pipeline import PipelineConfig, PipelineEstimate, PipelineModel, Stage, even_stages
from autopar.cost.types import CollectiveUse, Estimate, MemoryBreakdown, ParallelConfig

__all__ = [
    "CollectiveUse",
    "Estimate",
    "MemoryBreakdown",
    "ParallelConfig",
    "PipelineConfig",
    "PipelineEstimate",
    "PipelineModel",
    "Stage",
    "estimate",
    "even_stages",
    "gradient_sync",
    "model_states",
]
