"""Estimate of one Megatron-style configuration (global tp x pp x dp, micro-batch, recompute, ZeRO, SP).

A Megatron configuration is the uniform case of the pipeline model (`cost.pipeline`): every stage has the same
dp x tp, repeated layers split evenly over the stages (the embedding joins the first, the head and loss the last),
one recomputation setting for every layer. The graph is traced at the per-device micro-batch ``mbs``, so the
pipeline micro-batch is ``mbs x dp``. The mesh is (pp, dp, tp), tp innermost, so tensor parallelism stays inside
a node when it fits.
"""

from __future__ import annotations

from autopar.capture import Graph
from autopar.cluster import Cluster
from autopar.cost.pipeline import PipelineConfig, PipelineModel, even_stages
from autopar.cost.types import Estimate, ParallelConfig


def estimate(
    graph: Graph, cluster: Cluster, config: ParallelConfig, *, global_batch: int, dtype: str = "bf16",
    kernels: str = "eager",
) -> Estimate:
    """Price ``config`` for a model whose ``graph`` was traced at one micro-batch (batch = ``config.mbs``), its
    memory-bound ops run as ``kernels`` says (`autopar.cost.compute`), its vocabulary, pipeline sends and
    data-parallel overlap as the configuration's ``vocab_parallel``, ``scatter_gather_sends`` and ``overlap_dp``
    say (`ParallelConfig`)."""
    if config.devices != cluster.num_devices:
        raise ValueError(
            f"tp x pp x dp = {config.tp} x {config.pp} x {config.dp} = {config.devices} devices, but the cluster "
            f"has {cluster.num_devices} (--gpus)"
        )
    if global_batch % (config.dp * config.mbs):
        raise ValueError(
            f"--batch {global_batch} is not a multiple of dp x mbs = {config.dp} x {config.mbs}"
        )
    model = PipelineModel(graph, cluster, traced_batch=config.mbs, dtype=dtype, kernels=kernels,
                          vocab_parallel=config.vocab_parallel, scatter_gather_sends=config.scatter_gather_sends)
    return model.estimate(pipeline_config(model, config), global_batch=global_batch,
                          overlap=config.overlap_dp).estimate


def pipeline_config(model: PipelineModel, config: ParallelConfig) -> PipelineConfig:
    """The Megatron-LM configuration as a pipeline one: even stages, one dp x tp grid, one recomputation level."""
    return PipelineConfig(
        stages=even_stages(model, config.pp * config.chunks, tp=config.tp, dp=config.dp, recompute=config.recompute),
        micro_batch=config.mbs * config.dp,
        zero=config.zero,
        sp=config.sp,
        schedule=config.schedule,
        chunks=config.chunks,
        ep=config.ep,
    )
