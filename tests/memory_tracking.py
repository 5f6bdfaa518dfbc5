"""Peak memory of one training step as the runtime runs it, measured by PyTorch's `MemTracker`.

`MemTracker` (``torch.distributed._tools.mem_tracker``) is a dispatch mode: it sees every tensor an op creates while
it is active, and the parameters, gradients and optimizer states of what it is told to track; its peak is the
largest sum of live storages, as the allocator would hand them out (no caching, no fragmentation, no CUDA context:
the cost model's device reserve is not part of it).

- `single_stage_peak`: a single-stage plan applied as `autopar run` applies it, on rank 0 of a fake process group of
  the plan's full size. Fake tensors (no memory, no arithmetic) stand in for the weights, except under DDP, whose
  constructor reads weight values: there the (small) model is real, and DDP is built inside the tracker so that
  its gradient buckets are seen; a no-op communication hook stands in for the all-reduce, which the fake group does
  not complete. The step is the rehearsal's (`autopar.runtime.validate`): every micro-batch forward and backward,
  the by-hand gradient synchronisation, the optimizer step.
- `pipeline_peaks`: a pipeline plan on real gloo ranks (its schedule exchanges shapes with real peers, which a fake
  group cannot answer), one training step through `autopar.runtime.train`, each rank tracking itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from autopar.plan import Plan

# two small zoo models, as the runtime builds them (dropout off): activations and model states both count
MODELS = {
    "gpt": ("gpt3-125m", {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8192}),
    "llama": ("llama-7b", {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn": 688, "vocab": 8192}),
}
# how the runtime parallelises them on 2 ranks
KINDS = {
    "DP": {"dp": 2, "mbs": 2},
    "ZeRO 1": {"dp": 2, "mbs": 2, "zero": 1},
    "ZeRO 2": {"dp": 2, "mbs": 2, "zero": 2},
    "ZeRO 3": {"dp": 2, "mbs": 2, "zero": 3},
    "TP": {"tp": 2, "mbs": 4},
    "TP+SP": {"tp": 2, "mbs": 4, "sp": True},
    "PP": {"pp": 2, "mbs": 2},
}
# sequence and global batch: 256 x 8 (two micro-batches a step, four through the pipeline; the peak comes as the
# backward starts, at the loss) and 64 x 4 (one micro-batch; it comes where model states and gradients pile up)
SIZES = {"long": (256, 8), "short": (64, 4)}


@dataclass(frozen=True)
class Case:
    model: str
    kind: str
    size: str

    @property
    def name(self) -> str:
        return f"{self.model} {self.kind} {self.size}"


CASES = [Case(model, kind, size) for size in SIZES for model in MODELS for kind in KINDS]


def plan_for(case: Case, *, dtype: str = "fp32", precision: Any = None) -> tuple[Plan, list[Any]]:
    """The plan a user gets for ``case`` (`autopar estimate --out` does the same: trace, price, write), and its
    predicted memory per stage. The model is traced as the runtime builds it, dropout off."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost import ParallelConfig
    from autopar.cost.megatron import pipeline_config
    from autopar.cost.pipeline import PipelineModel
    from autopar.plan import Workload
    from autopar.search.pipeline import Found, pipeline_plan
    from autopar.zoo import load

    name, overrides = MODELS[case.model]
    seq, batch = SIZES[case.size]
    config = ParallelConfig(**KINDS[case.kind])
    zoo = load(name, batch=config.mbs, seq=seq, dtype=torch.float32, dropout=0.0, **overrides)
    cluster = load_cluster("cpu").with_devices(config.devices)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), cluster, traced_batch=config.mbs, dtype=dtype,
                          precision=precision)
    pipeline = pipeline_config(model, config)
    result = model.estimate(pipeline, global_batch=batch)
    work = Workload(model=name, overrides=tuple(sorted(overrides.items())), seq=seq, batch=batch, dtype=dtype)
    plan = pipeline_plan(model, Found(pipeline, result, 1), name=name, kind="estimate", global_batch=batch,
                         workload=work)
    return plan, [stage.memory for stage in result.stages]


def measured_peaks(plan: Plan) -> list[int]:
    """Per pipeline stage, the peak bytes of its first rank in one training step of ``plan``."""
    if plan.pp == 1:
        return [single_stage_peak(plan)]
    peaks = pipeline_peaks(plan)
    return peaks[:: plan.devices // plan.pp]


class _NoModules:
    """Stands in for `MemTracker`'s module tracker where module hooks cannot be had: a pipeline stage's backward
    runs through ``autograd.grad``-style calls that the tracker's multi-grad hooks refuse. Every op then counts as
    forward work at the top level, which changes the tracker's categories, not its totals."""

    parents = frozenset({"Global"})
    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class PeakTracker(MemTracker):
    """`MemTracker` that lets the root module run again in one step (micro-batches, a pipeline schedule): its
    per-module statistics restart, its memory accounting goes on. With ``modules=False`` it installs no module
    hooks at all (see `_NoModules`)."""

    def __init__(self, *, modules: bool = True) -> None:
        super().__init__()
        if not modules:
            self._mod_tracker = _NoModules()

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # "multiple iterative calls" of the root: a new micro-batch
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    @property
    def peak(self) -> int:
        """Largest total bytes live at once (one device: this rank's CPU)."""
        return sum(snap["Total"] for snap in self.get_tracker_snapshot("peak").values())


def uses_ddp(plan: Plan) -> bool:
    """Whether `autopar run` wraps this plan's model in DDP (ZeRO 0 over dp, no TP, one stage)."""
    dp, tp = plan.grid
    return plan.pp == 1 and plan.zero == 0 and dp > 1 and tp == 1


def single_stage_peak(plan: Plan, *, optimizer: type[torch.optim.Optimizer] = torch.optim.SGD, steps: int = 1) -> int:
    """Rank 0's peak bytes in ``steps`` training steps of ``plan`` (one stage), applied as `autopar run` applies it,
    with ``optimizer`` (the runtime's SGD by default; from the second step on another's state is held)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.apply import parallelize
    from autopar.runtime.train import LEARNING_RATE, Workload, build_model, global_batch
    from autopar.runtime.validate import _materialise
    from autopar.zoo import load

    work = Workload.of(plan)
    ddp = plan.is_pipeline and uses_ddp(plan)
    tracker = PeakTracker()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.devices)
    try:
        if ddp:
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            model = build_model(work)
            tracker.track_external(model)
            fake = contextlib.nullcontext()
            with tracker:  # DDP's buckets are made by its constructor
                parallel = parallelize(model, plan)
            parallel.module.register_comm_hook(None, noop_hook)
        else:
            model = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, device="meta", dropout=0.0,
                         **work.overrides).module.train()
            parallel = parallelize(model, plan, ddp=False)
            fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            if not ddp:
                _materialise(parallel.module)
                tracker.track_external(parallel.module)
            stepper = parallel.make_optimizer(optimizer, lr=LEARNING_RATE)
            batch = global_batch(work, 0)
            with tracker:
                for _ in range(steps):
                    stepper.zero_grad(set_to_none=True)
                    parallel.forward_backward(batch)  # rank 0's rows of the global batch
                    stepper.step()
    finally:
        dist.destroy_process_group()
    return tracker.peak


def pipeline_peaks(plan: Plan) -> list[int]:
    """Every rank's peak bytes in one training step of pipeline ``plan`` on real gloo ranks."""
    from autopar.cluster.ranks import run_ranks

    return run_ranks(_pipeline_rank, plan.devices, args=(plan,))


def _pipeline_rank(rank: int, rendezvous: Any, plan: Plan) -> int:
    import torch.distributed as dist

    from autopar.runtime.apply import parallelize
    from autopar.runtime.train import LEARNING_RATE, Workload, build_model, train

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="gloo")
    try:
        work = Workload.of(plan)
        parallel = parallelize(build_model(work), plan)
        optimizer = parallel.make_optimizer(torch.optim.SGD, lr=LEARNING_RATE)
        tracker = PeakTracker(modules=False)
        tracker.track_external(parallel.module)
        with tracker:
            train(parallel, optimizer, work, steps=1)
        dist.barrier()
        return tracker.peak
    finally:
        dist.destroy_process_group()


# intra-op plans (`autopar plan --search ilp`) of the same models: a baseline layout on a mesh, the first
# ``recomputed`` repeated layers recomputed in full
INTRA_KINDS = {"DP": ("dp", (2,)), "Megatron 2x2": ("megatron", (2, 2))}


def intra_plan_for(model: str, kind: str, *, recomputed: int, size: str = "long", zero: int = 0,
                   micro_batches: int = 1) -> tuple[Plan, Any]:
    """An intra-op plan of ``model`` in layout ``kind`` (`INTRA_KINDS`) with its first ``recomputed`` layers
    recomputed, priced on the cpu preset as `autopar plan --search ilp` prices it, and its predicted memory."""
    import math

    from autopar.capture import trace
    from autopar.cluster import build_mesh, load_cluster
    from autopar.plan import Workload
    from autopar.search.intra import baseline_choice, build_space, plan_of_choice, repeated_layers
    from autopar.zoo import load

    name, overrides = MODELS[model]
    layout, mesh = INTRA_KINDS[kind]
    seq, batch = SIZES[size]
    cluster = load_cluster("cpu").with_devices(math.prod(mesh))
    rows = batch // micro_batches  # one micro-batch, as the search traces it
    zoo = load(name, batch=rows, seq=seq, dtype=torch.float32, dropout=0.0, **overrides)
    space = build_space(trace(zoo.module, example_kwargs=zoo.inputs),
                        build_mesh(cluster, {f"x{i}": n for i, n in enumerate(mesh)}), cluster, traced_batch=rows)
    work = Workload(model=name, overrides=tuple(sorted(overrides.items())), seq=seq, batch=batch, dtype="fp32")
    intra = plan_of_choice(space, baseline_choice(space, layout), global_batch=batch, dtype="fp32", kind=layout,
                           micro_batches=micro_batches, zero=zero, recompute=repeated_layers(space)[:recomputed])
    plan = intra.to_plan(name, work)
    return plan, plan.estimate.memory
