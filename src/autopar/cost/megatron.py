"""Estimate of one Megatron-style configuration (global tp x pp x dp, micro-batch, recompute, ZeRO, SP).

Model: the mesh is (pp, dp, tp) with tp innermost, so tensor parallelism stays inside a node when it fits.
Repeated layers split evenly over pipeline stages (the embedding joins the first, the head and loss the last).
Per micro-batch, a stage takes  t_f + t_b  where each is the roofline time of its nodes (TP-sharded nodes split tp
ways) plus its TP collectives; recomputation adds forward work to t_b. 1F1B and GPipe both take
(m + p - 1) * max_s(t_s) for m micro-batches, of which (p - 1) * max_s(t_s) is the bubble. Data-parallel gradient
synchronisation (all-reduce, or reduce-scatter + all-gather under ZeRO) runs after the last backward, not
overlapped. Memory is that of the busiest stage: model states (`memory.model_states`), activations of the
micro-batches in flight (1F1B keeps p - s on stage s, GPipe all m), the largest temporary, and the device reserve.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from autopar.capture import Graph
from autopar.cluster import Cluster, Collective, build_mesh, collective_seconds
from autopar.cost.compute import node_seconds
from autopar.cost.layers import LayerCost, analyse
from autopar.cost.memory import model_states
from autopar.cost.types import CollectiveUse, Estimate, MemoryBreakdown, ParallelConfig


@dataclass(slots=True)
class _Stage:
    layers: list[LayerCost]
    forward: float = 0.0
    backward: float = 0.0
    comm_forward: float = 0.0
    comm_backward: float = 0.0
    activations: float = 0.0  # bytes per micro-batch
    temporary: float = 0.0
    params: int = 0


def split_stages(layers: list[LayerCost], pp: int) -> list[list[LayerCost]]:
    """Contiguous stages with repeated layers spread evenly; the rest stays with its neighbouring stage."""
    blocks = [i for i, layer in enumerate(layers) if layer.repeated]
    if pp == 1:
        return [layers]
    if len(blocks) < pp:
        raise ValueError(f"--pp {pp} is more pipeline stages than the model's {len(blocks)} repeated layers")
    per, extra = divmod(len(blocks), pp)
    cuts, taken = [], 0
    for s in range(pp - 1):
        taken += per + (1 if s < extra else 0)
        cuts.append(blocks[taken])  # stage s+1 starts at this layer
    bounds = [0, *cuts, len(layers)]
    return [layers[bounds[i] : bounds[i + 1]] for i in range(pp)]


def estimate(
    graph: Graph, cluster: Cluster, config: ParallelConfig, *, global_batch: int, dtype: str = "bf16"
) -> Estimate:
    """Price ``config`` for a model whose ``graph`` was traced at one micro-batch (batch = ``config.mbs``)."""
    if config.devices != cluster.num_devices:
        raise ValueError(
            f"tp x pp x dp = {config.tp} x {config.pp} x {config.dp} = {config.devices} devices, but the cluster "
            f"has {cluster.num_devices} (--gpus)"
        )
    if global_batch % (config.dp * config.mbs):
        raise ValueError(
            f"--batch {global_batch} is not a multiple of dp x mbs = {config.dp} x {config.mbs}"
        )
    micro_batches = global_batch // (config.dp * config.mbs)
    mesh = build_mesh(cluster, {"pp": config.pp, "dp": config.dp, "tp": config.tp})
    device = cluster.device
    pp_axis = mesh.axis("pp")
    uses: Counter[tuple[str, str, float]] = Counter()

    def comm(kind: Collective, nbytes: float, axis: str, count: int = 1) -> float:
        placement = mesh.axis(axis)
        if placement.size == 1 and kind is not Collective.SEND_RECV:
            return 0.0
        uses[(kind.value, axis, nbytes)] += count
        return count * collective_seconds(kind, nbytes, placement, cluster)

    stages = []
    for layers in split_stages(analyse(graph), config.pp):
        stage = _Stage(layers)
        for layer in layers:
            _price_layer(stage, layer, config, device, comm, micro_batches)
        stages.append(stage)

    p2p = 0.0
    if config.pp > 1:
        boundary = max(layer.input_bytes for layer in stages[0].layers + stages[-1].layers if layer.repeated)
        boundary /= config.tp if config.sp else 1
        p2p = collective_seconds(Collective.SEND_RECV, boundary, pp_axis, cluster)
        uses[(Collective.SEND_RECV.value, "pp", boundary)] += 2 * micro_batches
    per_micro = [s.forward + s.backward + s.comm_forward + s.comm_backward + (2 * p2p if config.pp > 1 else 0) for s in stages]
    slowest = max(range(len(stages)), key=lambda i: per_micro[i])
    bubble = (config.pp - 1) * per_micro[slowest]
    compute = micro_batches * (stages[slowest].forward + stages[slowest].backward)
    exposed = micro_batches * (per_micro[slowest] - stages[slowest].forward - stages[slowest].backward)

    # data-parallel synchronisation of the slowest stage's gradients (the others overlap with it)
    grad_bytes = stages[slowest].params / config.tp * _bytes_per(dtype)
    if config.zero == 0:
        exposed += comm(Collective.ALL_REDUCE, grad_bytes, "dp")
    elif config.zero in (1, 2):
        exposed += comm(Collective.REDUCE_SCATTER, grad_bytes, "dp") + comm(Collective.ALL_GATHER, grad_bytes, "dp")
    else:  # FSDP: gather parameters for forward and backward, scatter gradients, per micro-batch
        exposed += comm(Collective.ALL_GATHER, grad_bytes, "dp", 2 * micro_batches)
        exposed += comm(Collective.REDUCE_SCATTER, grad_bytes, "dp", micro_batches)
    iteration = compute + exposed + bubble

    memory = _memory(stages, config, cluster, micro_batches, dtype)
    model_flops = (graph.flops_forward + graph.flops_backward) * micro_batches * config.dp
    per_device = model_flops / iteration / cluster.num_devices
    return Estimate(
        iteration_seconds=iteration,
        compute_seconds=compute,
        exposed_comm_seconds=exposed,
        bubble_seconds=bubble,
        throughput_samples_per_second=global_batch / iteration,
        tflops_per_device=per_device / 1e12,
        mfu=per_device / device.peak(dtype),
        memory=memory,
        collectives=tuple(
            CollectiveUse(kind=k, axis=a, bytes=b, count=c) for (k, a, b), c in sorted(uses.items())
        ),
        micro_batches=micro_batches,
    )


def _bytes_per(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def _price_layer(stage: _Stage, layer: LayerCost, config: ParallelConfig, device, comm, micro_batches: int) -> None:  # noqa: ANN001
    tp = config.tp
    forward = backward = 0.0
    for node in layer.nodes:
        shard = tp if (node.id in layer.sharded or config.sp) else 1
        forward += node_seconds(node, device, backward=False, shard=shard)
        backward += node_seconds(node, device, backward=True, shard=shard)
    # the collectives below run once per micro-batch; comm() records them and returns their total time
    fwd_comm = bwd_comm = 0.0
    if tp > 1:
        for nbytes in layer.row_outputs:
            if config.sp:
                fwd_comm += comm(Collective.REDUCE_SCATTER, nbytes, "tp", micro_batches)
                bwd_comm += comm(Collective.ALL_GATHER, nbytes, "tp", micro_batches)
            else:
                fwd_comm += comm(Collective.ALL_REDUCE, nbytes, "tp", micro_batches)
        for nbytes in layer.column_inputs:
            if config.sp:
                fwd_comm += comm(Collective.ALL_GATHER, nbytes, "tp", micro_batches)
                bwd_comm += comm(Collective.REDUCE_SCATTER, nbytes, "tp", micro_batches)
            else:
                bwd_comm += comm(Collective.ALL_REDUCE, nbytes, "tp", micro_batches)
    fwd_comm /= micro_batches
    bwd_comm /= micro_batches
    saved = layer.saved_sharded / tp + layer.saved_replicated / (tp if config.sp else 1)
    if layer.repeated and config.recompute == "full":
        backward += forward
        if tp > 1:  # the recomputed forward replays its collectives
            bwd_comm += fwd_comm
            for nbytes in layer.row_outputs:
                comm(Collective.REDUCE_SCATTER if config.sp else Collective.ALL_REDUCE, nbytes, "tp", micro_batches)
            if config.sp:
                for nbytes in layer.column_inputs:
                    comm(Collective.ALL_GATHER, nbytes, "tp", micro_batches)
        stage.temporary = max(stage.temporary, saved)  # one layer's activations live during its recompute
        saved = layer.input_bytes / (tp if config.sp else 1)
    elif layer.repeated and config.recompute == "selective":
        attention = [n for n in layer.nodes if "attention" in n.op]
        backward += sum(node_seconds(n, device, backward=False, shard=tp) for n in attention)
        saved -= layer.attention_saved / tp
    stage.forward += forward
    stage.backward += backward
    stage.comm_forward += fwd_comm
    stage.comm_backward += bwd_comm
    stage.activations += saved
    stage.params += layer.params
    stage.temporary = max(stage.temporary, layer.largest_output / tp)


def _memory(stages: list[_Stage], config: ParallelConfig, cluster: Cluster, micro_batches: int, dtype: str) -> MemoryBreakdown:
    worst: MemoryBreakdown | None = None
    for index, stage in enumerate(stages):
        in_flight = micro_batches if config.schedule == "gpipe" else min(config.pp - index, micro_batches)
        params, grads, optim = model_states(stage.params / config.tp, dtype=dtype, zero=config.zero, dp=config.dp)
        candidate = MemoryBreakdown(
            parameters=params,
            gradients=grads,
            optimizer=optim,
            activations=stage.activations * in_flight,
            other=stage.temporary + cluster.device.reserved,
            budget=cluster.device.memory,
        )
        if worst is None or candidate.total > worst.total:
            worst = candidate
    assert worst is not None
    return worst
