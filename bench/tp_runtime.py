"""Step time of a tensor-parallel plan applied by autopar against the same layout written by hand.

Run: python bench/tp_runtime.py [--steps N]. Two gloo ranks (one thread each) build the same Hugging Face
LLaMA-style model twice from one seed: once parallelised by `autopar.parallelize` from a tp=2 plan the planner's
functions wrote, once with `parallelize_module` and the usual hand-written style (q/k/v and gate/up column-wise,
o/down row-wise, the LM head column-wise with its output gathered). Steps of the two alternate, so machine noise
hits both alike; the medians are compared. Target: autopar / hand under 1.05.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from autopar.plan import Plan

OVERRIDES = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn": 1376, "vocab": 2048}
SEQ, BATCH = 128, 8


def make_plan() -> Plan:
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, even_stages
    from autopar.plan import Workload
    from autopar.search.pipeline import Found, pipeline_plan
    from autopar.zoo import load

    zoo = load("hf:llama-tiny", batch=1, seq=SEQ, **OVERRIDES)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(2),
                          traced_batch=1)
    config = PipelineConfig(stages=even_stages(model, 1, tp=2, dp=1), micro_batch=BATCH)
    work = Workload(model="hf:llama-tiny", overrides=tuple(sorted(OVERRIDES.items())), seq=SEQ, batch=BATCH,
                    dtype="fp32")
    return pipeline_plan(model, Found(config, model.estimate(config, global_batch=BATCH), 1), name="hf:llama-tiny",
                         kind="bench", global_batch=BATCH, workload=work)


def by_hand(model: torch.nn.Module, mesh) -> None:  # noqa: ANN001
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            styles[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            styles[f"{prefix}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, styles)


def rank_main(rank: int, rendezvous: str, plan: Plan, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.apply import parallelize
    from autopar.runtime.train import Workload, build_model, global_batch, loss_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    work = Workload.of(plan)
    ours = parallelize(build_model(work), plan).module
    theirs = build_model(work)
    by_hand(theirs, init_device_mesh("cpu", (2,)))
    batch = global_batch(work, 0)
    times: dict[str, list[float]] = {"autopar": [], "hand": []}
    for step in range(steps + 2):  # two warm-up steps each
        for name, module in (("autopar", ours), ("hand", theirs)):
            dist.barrier()
            start = time.perf_counter()
            loss_of(module(**batch)).backward()
            module.zero_grad(set_to_none=True)
            dist.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    plan = make_plan()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(rank_main, args=(str(Path(tmp) / "rdv"), plan, args.steps, out), nprocs=2, join=True)
        times = json.loads(Path(out).read_text())
    ours, hand = statistics.median(times["autopar"]), statistics.median(times["hand"])
    print(f"hf:llama-tiny {OVERRIDES} seq {SEQ} batch {BATCH}, tp=2 on 2 gloo ranks, {args.steps} steps each")
    print(f"median step (forward + backward): autopar {ours * 1e3:.1f} ms, by hand {hand * 1e3:.1f} ms")
    print(f"ratio autopar / hand: {ours / hand:.3f} (target < 1.05)")


if __name__ == "__main__":
    main()
