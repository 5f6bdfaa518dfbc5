"""Apply a plan to a model with PyTorch's own distributed engine.

On a (dp, tp) device mesh, or (pp, dp, tp) for a pipeline, tp innermost:

- data parallelism: ZeRO 0 is `DistributedDataParallel` (25 MiB buckets, no buffer broadcasts, ``no_sync`` until
  the last micro-batch); ZeRO 1-3 are FSDP2 `fully_shard` on every repeated layer and then the root. ZeRO 1 and 2
  keep the gathered weights from the first forward to the last backward (``reshard_after_forward=False``); ZeRO 1
  also accumulates whole gradients and reduce-scatters them once, ZeRO 2 after every micro-batch;
- Megatron tensor parallelism: `parallelize_module` with `ColwiseParallel` where the plan shards a weight's
  output features (``S(0)`` on tp) and `RowwiseParallel` where it shards input features (``S(1)``); attention runs on
  local tensors (CPU SDPA has no DTensor rule), so the zoo's fused QKV weight is permuted to hold each rank's
  heads' q, k and v side by side and the module's head counts become per-rank counts; with sequence parallelism
  the norms run on sequence shards;
- tp x dp: FSDP2 over dp for ZeRO 1-3; under ZeRO 0 (DDP does not take tensor-parallel parameters) the
  gradients are all-reduced over dp by hand after the last micro-batch, in DDP-sized buckets;
- pipelines (`autopar.runtime.pipeline`): each rank keeps its stage's modules, TP inside (under sequence
  parallelism stages hand each other sequence shards), dp by hand (ZeRO 0) or FSDP2 (ZeRO 1 reduce-scatters once
  a step, ZeRO 2-3 after every micro-batch), GPipe, 1F1B or interleaved 1F1B;
- recomputation per layer (`torch.utils.checkpoint`: the whole layer for ``full``, the attention core for
  ``selective``);
- ``kernels: compiled``: each repeated layer (every child of an ``nn.ModuleList``) is compiled in place with
  ``torch.compile(fullgraph=True)`` (`compile_layers`), so its memory-bound ops run fused as the plan priced them;
  a layer dynamo cannot capture whole raises instead of running partly eager.

- a stage whose layers the intra-op planner lays out (``intra``, ``layouts``): those layers' weights become
  DTensors on tp in the plan's placements and their leading modules convert their inputs and outputs as the plan
  records, DTensor carrying the layouts in between (`autopar.runtime.intra.lay_out_layers`); they meet the rest of
  the stage as Megatron's layers do, and FSDP or the by-hand all-reduce handle dp as for any layer.

Each of these issues the collectives `autopar.cost.pipeline` prices, call for call (``autopar run --check-comm``).
Stages of different dp x tp, and laid-out layers under sequence parallelism or compiled kernels, are refused with
an error that says so (intra-op plans of one stage run with DTensor, `autopar.runtime.intra`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.capture.graph import _within, multi_query_attentions
from autopar.capture.graph import positive_count as _count
from autopar.plan import Plan
from autopar.plan.batch import LocalBatch
from autopar.plan.records import expert_parallel_limits
from autopar.sharding import short

# what a pipeline's first stage may take (tokens, or images: ViT); its loss takes ``labels``
PIPELINE_FIRST = ("input_ids", "pixel_values")


@dataclass
class ParallelModel:
    """The parallelised module, how to build its optimizer, and what each micro-batch must tell it.

    A training step in one's own loop is ``loss = parallel.step(batch)`` (forward and backward over this rank's
    micro-batches, or the pipeline schedule, and the gradient synchronisation), then the optimizer's step, on
    every rank with the same global ``batch``."""

    module: nn.Module
    zero: int
    make_optimizer: Callable[..., torch.optim.Optimizer]
    # parameter -> (dim, order): the order its output features are stored in along ``dim`` (fused QKV weights)
    permutations: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    axes: dict[str, str] = field(default_factory=dict)  # process-group name -> mesh axis, for counting
    dp_group: Any = None  # set where gradients are all-reduced over dp by hand (`finish_backward`)
    # standing in for DDP (`parallelize(ddp=False)`): parameters in the order their gradients were made (at a
    # weight's last use), which DDP's buckets follow (`_watch_ready`); None where the by-hand all-reduce is the
    # runtime's own
    ready: dict[int, nn.Parameter] | None = None
    watched: set[int] = field(default_factory=set)
    pipeline: Any = None  # `autopar.runtime.pipeline.Pipeline` where the plan has several stages
    names: dict[str, str] = field(default_factory=dict)  # a stage's parameter name -> its name in the whole model
    chunks: list[nn.Module] = field(default_factory=list)  # an interleaved stage's chunks, synchronised one by one
    # replicated weights on the activations tp splits (`tp_partial_names`): gradients summed over ``tp_group``
    tp_partial: list[nn.Parameter] = field(default_factory=list)
    tp_group: Any = None
    plan: Plan | None = None  # the plan `parallelize` applied: which rows of a batch this rank trains
    rank: int = 0  # this process's rank in the plan's mesh
    # under tp, the random state the model's forward and backward draw from, the same on every rank of this rank's
    # tp group (`_tp_random`): (the CPU generator's state, the current CUDA device's or None)
    random: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # expert parallelism (`autopar.runtime.experts`): this rank's experts, whose gradients cover every dp rank's
    # tokens and are divided by ``expert_ranks`` (dp) after the backward instead of averaged over dp
    experts: list[nn.Parameter] = field(default_factory=list)
    expert_ranks: int = 1
    # the parameters of layers a pipeline stage lays out by the intra-op planner (`runtime.intra.lay_out_layers`):
    # the pending sums over tp of those kept whole while their work splits are summed in one all-reduce of their own
    # (under ZeRO 1-3 across dp, FSDP2 sums each such gradient itself before reduce-scattering it, as priced)
    laid_out: list[nn.Parameter] = field(default_factory=list)

    def step(self, batch: Mapping[str, torch.Tensor] | LocalBatch) -> float:
        """One step's forward and backward (`forward_backward`); returns the loss one process training the whole
        global batch would see: the mean of the micro-batches' losses, averaged over the data-parallel ranks (an
        all-reduce, `average_loss`). Every rank must call it, with the same global batch."""
        return self.average_loss(self.forward_backward(batch))

    def forward_backward(self, batch: Mapping[str, torch.Tensor] | LocalBatch) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches of ``batch`` (the global batch: every tensor holds
        it along dim 0; this rank takes its rows, `Plan.local_batch`), or through the plan's pipeline schedule,
        each loss scaled by 1 / micro-batches; then the gradient synchronisation the plan prices
        (`finish_backward`). The gradients are then those of the global batch's mean loss, ready for the
        optimizer. Returns this rank's loss, detached and not synchronised: the mean of its micro-batches' losses,
        0 on pipeline stages other than the last. A ``LocalBatch`` is taken as this rank's rows as they are."""
        local = batch if isinstance(batch, LocalBatch) else self._local(batch)
        m = len(local.micro_batches)
        if self.ready is not None:
            self._watch_ready()
        with self._model_random():
            if self.pipeline is not None:
                total = self._schedule(local)
            else:
                losses = []
                for k, inputs in enumerate(local.micro_batches):
                    with self.micro_batch(k, m):
                        loss = loss_of(self.module(**inputs)) / m
                        loss.backward()
                    losses.append(loss.detach())
                total = torch.stack(losses).sum()
        self.finish_backward()
        return total

    @contextlib.contextmanager
    def _model_random(self) -> Iterator[None]:
        """Inside, random ops (dropout) draw from `random`, the state this rank's tp group shares; the caller's own
        state is put back after. Tensor-parallel ranks hold the same replicated activations: a dropout mask drawn
        differently on each (ranks seeded apart, or drawing apart between steps) would make them differ, and the
        replicated weights would drift apart without an error."""
        if self.random is None:
            yield
            return
        cpu, cuda = self.random
        theirs = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda is not None else None)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        try:
            yield
        finally:
            self.random = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda is not None else None)
            torch.set_rng_state(theirs[0])
            if theirs[1] is not None:
                torch.cuda.set_rng_state(theirs[1])

    def average_loss(self, local: torch.Tensor) -> float:
        """A rank's loss (`forward_backward`) averaged over the data-parallel ranks: the sum over all ranks divided
        by the ranks holding a loss (a stage's dp x tp; tensor-parallel ranks hold equal ones). One collective; a
        model not made by `parallelize` (one process) returns its own loss."""
        import torch.distributed as dist

        if self.plan is None or not dist.is_initialized():
            return float(local)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        total = local.detach().to(device=device, dtype=torch.float64).reshape(1)
        dist.all_reduce(total)
        dp, tp = self.plan.grid
        return float(total) / (dp * tp)

    def _local(self, batch: Mapping[str, torch.Tensor]) -> LocalBatch:
        if self.plan is None:
            raise ValueError("this model was not made by autopar.parallelize, so it does not know which rows of a "
                             "global batch it trains: pass a LocalBatch (autopar.plan.batch.split_batch)")
        return self.plan.local_batch(batch, self.rank)

    def _schedule(self, local: LocalBatch) -> torch.Tensor:
        """One step through the pipeline schedule: this data-parallel rank's rows of every micro-batch, back to
        back (the schedule splits them again); the mean micro-batch loss on the last stage, 0 elsewhere."""
        inputs, pipe, losses = local.inputs, self.pipeline, []
        if set(inputs) != {pipe.inputs, pipe.target}:
            raise ValueError(f"a pipeline plan of this model feeds {pipe.inputs} to its first stage and {pipe.target} "
                             f"to its loss; the batch holds {sorted(inputs)}")
        with warnings.catch_warnings():
            # FSDP2 warns that a stage returning a view would lose its pre-backward hook to an in-place op on it;
            # what a stage returns is only sent to the next stage or read by the loss, neither in place
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPStageModule\) returned a view")
            if pipe.first:
                pipe.schedule.step(inputs[pipe.inputs])
            elif pipe.last:
                pipe.schedule.step(target=inputs[pipe.target], losses=losses)
            else:
                pipe.schedule.step()
        pipe.sync_tied()
        if not losses:
            return torch.zeros(())
        return torch.stack([loss.detach() for loss in losses]).sum() / len(local.micro_batches)

    def micro_batch(self, k: int, m: int) -> contextlib.AbstractContextManager:
        """Enter around micro-batch ``k`` of ``m``: gradients synchronise once per step, as the plan priced.

        DDP skips its all-reduce until the last micro-batch. FSDP2 keeps the weights it gathered until the last
        backward under ZeRO 1-2, and under ZeRO 1 also accumulates whole gradients and reduce-scatters them
        once."""
        last = k == m - 1
        if isinstance(self.module, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if last else self.module.no_sync()
        if self.zero in (1, 2) and hasattr(self.module, "set_reshard_after_backward"):
            self.module.set_reshard_after_backward(last)
            self.module.set_requires_gradient_sync(last or self.zero == 2)
        return contextlib.nullcontext()

    def finish_backward(self) -> None:
        """After the last micro-batch: sum the partial gradients sequence parallelism leaves (norm weights) over tp
        in one all-reduce (per chunk of an interleaved stage, as each chunk is priced), then all-reduce gradients
        over dp by hand where no wrapper does (`ddp_buckets` sizes), but the experts' (expert parallelism: each
        one's gradient is whole on the rank holding it, divided by dp here)."""
        for param in self.experts:
            if param.grad is not None:
                param.grad.div_(self.expert_ranks)
        summed = {id(p) for p in self.tp_partial}
        laid = {id(p) for p in self.laid_out}
        for chunk in self.chunks or [self.module]:
            params = list(chunk.parameters())
            if laid:  # priced as a call of their own (`PipelineModel.estimate`: ``reduced``)
                self._sum_over_tp([p for p in params if id(p) in laid], [])
            self._sum_over_tp(params, [p for p in params if id(p) in summed])
        if self.dp_group is None:
            return
        own = {id(p) for p in self.experts}
        if self.ready is not None:  # DDP's buckets, in the order its reducer fills them
            self._all_reduce_dp([p.grad for p in self.ready.values() if p.grad is not None and id(p) not in own],
                                buckets=True)
            return
        for chunk in self.chunks or [self.module]:  # each chunk in its own buckets, as priced per stage
            self._all_reduce_dp([p.grad for p in chunk.parameters() if p.grad is not None and id(p) not in own])

    def _sum_over_tp(self, params: list[nn.Parameter], replicated: list[nn.Parameter]) -> None:
        """Sum over tp, in one all-reduce, the gradients of ``params`` that sequence parallelism leaves partial and
        those of ``replicated`` (weights kept whole on the heads tp splits: `tp_partial`)."""
        import torch.distributed as dist

        partial = [p for p in params if p.grad is not None and hasattr(p.grad, "placements")
                   and any(pl.is_partial() for pl in p.grad.placements)]
        # q/k norms per head: each rank's gradient (or its ZeRO shard of it) covers its own heads
        heads = [_local(p.grad) for p in replicated if p.grad is not None]
        if partial or heads:
            from torch.distributed.tensor import DTensor, Replicate

            flat = torch.cat([p.grad.to_local().reshape(-1) for p in partial] + [g.reshape(-1) for g in heads])
            mesh = partial[0].grad.device_mesh if partial else None
            dist.all_reduce(flat, group=mesh.get_group() if mesh is not None else self.tp_group)  # one call
            offset = 0
            for p in partial:
                local = flat[offset : offset + p.grad.numel()].view(p.grad.shape)
                p.grad = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
                offset += p.grad.numel()
            for g in heads:
                g.copy_(flat[offset : offset + g.numel()].view(g.shape))
                offset += g.numel()

    def _watch_ready(self) -> None:
        """Note in ``ready`` each parameter as its gradient is made (hooks on the parameters the module holds now:
        a rehearsal replaces them after wrapping)."""
        def made(param: nn.Parameter) -> None:
            assert self.ready is not None
            self.ready.pop(id(param), None)
            self.ready[id(param)] = param

        for param in self.module.parameters():
            if param.requires_grad and id(param) not in self.watched:
                param.register_post_accumulate_grad_hook(made)
                self.watched.add(id(param))

    def _all_reduce_dp(self, grads: list[torch.Tensor], *, buckets: bool = False) -> None:
        """Average ``grads`` over dp: one flat buffer, all-reduced in DDP-sized slices (`flat_buckets`); with
        ``buckets``, in the buckets DDP makes of them in this order instead (`ddp_buckets`: whole tensors, a bucket
        closing once it holds `DDP_BUCKET_BYTES` or more). Both are the sizes the cost model prices."""
        import torch.distributed as dist

        from autopar.cost.memory import ddp_buckets, flat_buckets

        if not grads:
            return
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])
        size = flat.element_size()
        sizes = ddp_buckets(g.numel() * size for g in local) if buckets else flat_buckets(flat.numel() * size)
        start = 0
        for nbytes in sizes:
            end = start + int(nbytes) // size
            if end > start:
                dist.all_reduce(flat[start:end], group=self.dp_group)
            start = end
        flat /= dist.get_world_size(self.dp_group)
        offset = 0
        for g in local:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> float:
        """Scale every gradient the optimizer will step with so that their norm over the whole model is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does in one process training
        the whole batch; returns that norm, before clipping. Call it on every rank, after `step` and before the
        optimizer's step.

        ``torch.nn.utils.clip_grad_norm_`` on a rank's own parameters gives another norm: a pipeline stage holds
        its own layers only, and an intra-op plan under ZeRO 1-3 keeps the gradients of the weights it holds whole
        in this rank's slices (`make_optimizer`'s parameters), not on the model's parameters. Here every rank adds
        up what it holds (`_held_gradients`), each piece divided by the number of ranks holding the same piece, and
        one all-reduce over all ranks (8 bytes, not part of the plan's collectives) gives every rank the same
        norm. The sums are taken in float64, in one process too (a model `parallelize` did not make): PyTorch's
        fp32 norm of a large gradient can be well off (OPT's 50,272-row embedding's: 5e-4 below its float64
        value), and ranks adding up their shards in fp32 would be off in another way, so their clipping, and with
        it the weights, would drift apart from one process's."""
        import math

        import torch.distributed as dist

        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
        ranks = self.plan is not None and dist.is_initialized()
        held = self._held_gradients() if ranks else [
            (param.grad, 1) for _, param in _named_once(self.module) if param.grad is not None]
        with torch.no_grad():
            if math.isinf(p):
                local = max((float(t.abs().max()) for t, _ in held if t.numel()), default=0.0)
            else:
                local = sum(float(torch.linalg.vector_norm(t.double(), p)) ** p / copies for t, copies in held)
            if ranks:
                device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
                summed = torch.tensor([local], dtype=torch.float64, device=device)
                dist.all_reduce(summed, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
                local = float(summed)
            total = local if math.isinf(p) else local ** (1.0 / p)
            if error_if_nonfinite and not math.isfinite(total):
                raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                                   f"{total}, so they cannot be clipped")
            coefficient = min(max_norm / (total + 1e-6), 1.0)  # PyTorch's own, scaled even when it is 1
            for tensor, _ in held:
                tensor.mul_(coefficient)
        return total

    def _held_gradients(self) -> list[tuple[torch.Tensor, int]]:
        """Every gradient the optimizer steps with as this rank holds it (a DTensor's own shard, a plain tensor
        whole; each storage once), with how many ranks hold that same piece: the ranks of this stage where it is
        replicated (a plain tensor on all dp x tp of them, a DTensor on those of its mesh's axes it is replicated
        on, times the stage's ranks outside its mesh), and twice that for a weight both ends of a pipeline hold
        (the tied head, summed between them)."""
        import math

        assert self.plan is not None
        stage = math.prod(self.plan.grid)
        tied = {id(param) for param, _ in self.pipeline.tied} if self.pipeline is not None else set()
        held = []
        for name, param in _named_once(self.module):
            grad = param.grad
            if grad is None:
                continue
            if hasattr(grad, "placements"):
                mesh = grad.device_mesh
                _refuse_pending(name, grad)
                copies = stage // mesh.size() * math.prod(
                    size for pl, size in zip(grad.placements, mesh.shape) if pl.is_replicate())
                tensor = grad._local_tensor
            else:
                copies, tensor = stage, grad
            held.append((tensor, copies * (2 if id(param) in tied and self.pipeline.stages > 1 else 1)))
        return held

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient on this rank (FSDP's sharded gradients are gathered), under its name
        in the whole model."""
        return self._whole((name, p.grad) for name, p in _named_once(self.module) if p.grad is not None)

    def replace_parameters(self, new: Mapping[int, nn.Parameter]) -> None:
        """Follow parameters the module replaced (``new``: by the old one's id), where this object holds them
        itself: the weights whose gradients it sums over tp, and the pipeline's tied weights."""
        self.tp_partial = [new.get(id(p), p) for p in self.tp_partial]
        self.laid_out = [new.get(id(p), p) for p in self.laid_out]
        if self.pipeline is not None:
            self.pipeline.tied = [(new.get(id(p), p), group) for p, group in self.pipeline.tied]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Copies of the parameters this rank holds (a pipeline stage's, or all of them), whole (FSDP and tensor
        -parallel shards are gathered: every rank of the stage must call it), under their names in the whole model
        and in its own row order."""
        return self._whole((name, p.detach()) for name, p in _named_once(self.module))

    def _whole(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in tensors:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            tensor = tensor.detach().clone()
            whole = self.names.get(name, name)  # its name in the whole model
            permuted = self.permutations.get(whole)
            if permuted is not None:  # back to the model's own order
                dim, order = permuted
                restored = torch.empty_like(tensor)
                restored.index_copy_(dim, order, tensor)
                tensor = restored
            out.setdefault(whole, tensor)
        return out


def _named_once(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``module``'s parameters, each once (tied ones under their first name), inside a DDP wrapper."""
    inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    return inner.named_parameters()


def _refuse_pending(name: str, grad: Any) -> None:  # noqa: ANN401
    """A gradient still left as a pending sum has no norm of its own on a rank: refuse to clip it."""
    if any(pl.is_partial() for pl in grad.placements):
        raise RuntimeError(f"clip_grad_norm_: the gradient of {name} is still a pending sum "
                           f"({list(grad.placements)}): call it after the step's backward has finished")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (its storage: changing it changes the DTensor), or a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "placements") else tensor


def loss_of(output: Any) -> torch.Tensor:
    """The training loss a forward returned: the zoo's models return it, Hugging Face ones carry it as ``.loss``."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"the model's forward must return its loss, a scalar tensor or an output whose .loss is "
                         f"one; it returned {type(output).__name__}"
                         + (f" of shape {list(output.shape)}" if isinstance(output, torch.Tensor) else ""))
    return loss


def check_supported(plan: Plan) -> None:
    """Raise ``NotImplementedError`` naming what the runtime cannot apply yet."""
    if not plan.is_pipeline:
        reason = intra_unsupported(plan)
        if reason:
            raise NotImplementedError(reason)
        return
    stages = plan.stages
    compiled_selective = plan.kernels == "compiled" and any(
        s.tp > 1 and any(level == "selective" for _, level in s.recompute) for s in stages)
    laid = any(s.intra and s.layouts for s in stages)
    reason = unsupported(stages=len(stages), grids={(s.dp, s.tp) for s in stages},
                         intra=laid and not intra_layouts_runnable(plan.ep, plan.kernels, plan.sp),
                         compiled_selective=compiled_selective,
                         compiled_experts=plan.kernels == "compiled" and plan.ep > 1)
    if not reason:
        reason = expert_parallel_limits(plan.ep, [(s.dp, s.tp) for s in stages])
    if not reason:
        reason = schedule_limit(plan.schedule, plan.micro_batches, plan.micro_batch_size, plan.pp)
    if reason:
        raise NotImplementedError(reason)


def schedule_limit(schedule: str, micro_batches: int, micro_batch_size: int, pp: int) -> str | None:
    """Why PyTorch's schedule cannot run ``micro_batches`` of ``micro_batch_size`` samples on ``pp`` stages, or
    None: its 1F1B needs at least one micro-batch per stage (Megatron's runs fewer, warming up with every
    micro-batch there is)."""
    if schedule == "1f1b" and micro_batches < pp:
        return (f"the 1F1B schedule needs at least as many micro-batches as stages: {micro_batches} "
                f"micro-batch{'es' if micro_batches > 1 else ''} of {micro_batch_size} samples for pp {pp}; plan a "
                "smaller micro-batch (--mbs), or --schedule gpipe")
    return None


def intra_layouts_runnable(ep: int, kernels: str, sp: bool) -> bool:
    """Whether the runtime runs a pipeline stage's intra-op layer layouts (`autopar.runtime.intra.lay_out_layers`)
    in a plan of this ep, kernels and sequence parallelism: so far eager, without sequence parallelism (expert
    parallelism needs tp 1, which such a stage has not); any ZeRO stage."""
    return ep == 1 and kernels == "eager" and not sp


def intra_unsupported(plan: Plan) -> str | None:
    """Why the runtime cannot run an intra-op plan (`autopar.runtime.intra`), or None."""
    if plan.kernels == "compiled":
        return "the intra-op plan compiles its layers; intra-op plans run eager only so far (plan with --kernels eager)"
    return None


def unsupported(*, stages: int, grids: set[tuple[int, int]], intra: bool = False,
                compiled_selective: bool = False, compiled_experts: bool = False) -> str | None:
    """Why the runtime cannot run a pipeline plan of this shape (``grids``: the stages' (dp, tp)), or None. The
    planner keeps its search to shapes this accepts (unless ``--allow-unrunnable``). ``compiled_selective``: the
    plan compiles its layers and recomputes attention selectively in a stage with tp > 1; ``compiled_experts``: it
    compiles its layers and splits experts over ranks."""
    if compiled_experts:
        return ("the plan splits experts over ranks (ep) and compiles its layers, which torch.compile cannot capture "
                "whole: the all-to-alls' sizes come from routing, read on the host; plan with --kernels eager")
    if compiled_selective:
        return ("the plan recomputes attention selectively under tensor parallelism with compiled kernels, which "
                "torch.compile cannot compile here (AOT autograd saves a DeviceMesh among the checkpoint's tensors); "
                "plan with --kernels eager, or full recomputation")
    if intra:
        return ("the plan lays layers out by the intra-op planner (a stage marked intra) under sequence "
                "parallelism or with compiled kernels; the runtime runs such layers eager, without sequence "
                "parallelism, so far")
    if len(grids) > 1:
        return "the plan's stages have different dp x tp; the runtime needs one grid for all"
    return None


def parallelize(
    model: nn.Module, plan: Plan, *, mesh: Any = None, units: Iterable[nn.Module] = (), ddp: bool = True,
    compile: bool = True, example: Mapping[str, torch.Tensor] | None = None,  # noqa: A002
) -> ParallelModel:
    """Wrap ``model`` for ``plan`` on this rank, in place; train it through the returned `ParallelModel`.

    ``model`` is already on this rank's device, with the same initial weights on every rank (build it with one seed,
    or load one checkpoint, on every rank). A plan made from Python (`autopar.plan`) applies to the model it was
    made for, or one built the same way; any plan names modules and parameter shapes, and one made for another
    model is refused (`check_matches`).

    A plan with compiled kernels gets its repeated layers compiled (`compile_layers`); ``compile=False`` leaves
    them eager, for a rehearsal on fake tensors only (it checks layouts and collectives, not kernels).

    ``units`` are the repeated layers FSDP shards one by one (default: `repeated_layers`, those the cost model
    prices as FSDP units).
    With ``ddp=False``, ZeRO 0 all-reduces gradients by hand (`ParallelModel.finish_backward`, the same buckets)
    instead of wrapping the model in DDP. Needs an initialised default process group of the plan's size; ``mesh``
    (a `DeviceMesh` with dims ``("dp", "tp")``, or ``("pp", "dp", "tp")`` for a pipeline, of the plan's sizes) is made
    when not given. ``example``: one of this rank's micro-batches, needed only for a pipeline whose ``model`` is on
    the meta device (a rehearsal on a fake process group): its stages' shapes are worked out from it there, since
    stages on a fake process group cannot exchange them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.intra import linear_gradient_rules

    check_supported(plan)
    check_matches(model, plan)
    linear_gradient_rules()
    if not plan.is_pipeline:
        from autopar.runtime.intra import parallelize_intra

        return parallelize_intra(model, plan, mesh=mesh)
    stages = plan.stages
    pp, (dp, tp) = plan.pp, plan.grid
    if dist.get_world_size() != pp * dp * tp:
        raise ValueError(f"the plan needs {pp * dp * tp} ranks, this process group has {dist.get_world_size()}")
    compiled = plan.kernels == "compiled" and compile
    for stage in stages:
        recompute(model, dict(stage.recompute), compiled=compiled)
    checkpoint_segments(model, [list(segment) for stage in stages for segment in stage.segments])
    if compiled:
        compile_layers(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = ("pp", "dp", "tp") if pp > 1 else ("dp", "tp")
    shape = (pp, dp, tp) if pp > 1 else (dp, tp)
    if mesh is None:
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)  # tp innermost, as priced
    elif tuple(mesh.mesh_dim_names or ()) != names or tuple(mesh.shape) != shape:
        raise ValueError(f"the plan needs a mesh of shape {shape} with dims {names}, got {tuple(mesh.shape)} with "
                         f"dims {mesh.mesh_dim_names}")
    axes = {mesh.get_group(axis).group_name: axis for axis in names}
    sizes = dict(zip(names, mesh.shape))
    spanning = [axis for axis in names if sizes[axis] == dist.get_world_size()]
    axes[dist.group.WORLD.group_name] = spanning[0] if spanning else "world"
    if pp > 1:
        ids = None  # the first stage's input: the example's one entry, or its tokens or images
        if example is not None:
            ids = next(iter(example.values())) if len(example) == 1 else \
                next((example[k] for k in PIPELINE_FIRST if k in example), None)
        parallel = _pipelined(model, plan, mesh, axes, example=ids)
    else:
        parallel = _one_stage(model, plan, mesh, axes, units=units, ddp=ddp)
    parallel.plan, parallel.rank = plan, dist.get_rank()
    if tp > 1:
        parallel.random = _tp_random(mesh, device)
    return parallel


def _tp_random(mesh: Any, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's random state (the CPU generator's, and the current CUDA device's where there is one) as the
    first rank of its tp group holds it: one broadcast per state, once."""
    import torch.distributed as dist

    group = mesh.get_group("tp")
    source = dist.get_global_rank(group, 0)
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None]
    shared = []
    for state in states:
        if state is not None:
            moved = state.to(device)  # NCCL moves CUDA tensors only
            dist.broadcast(moved, src=source, group=group)
            state = moved.cpu()
        shared.append(state)
    return shared[0], shared[1]


def _one_stage(model: nn.Module, plan: Plan, mesh: Any, axes: dict[str, str], *, units: Iterable[nn.Module],
               ddp: bool) -> ParallelModel:
    """A single-stage plan: tensor parallelism over tp, a mixture's experts split over dp (expert parallelism),
    then data parallelism over dp (DDP, by hand, or FSDP2)."""
    from autopar.runtime.experts import expert_parallel_modules, split_by_expert
    from autopar.runtime.intra import lay_out_layers, megatron_part

    zero, (dp, tp) = plan.zero, plan.grid
    permutations, heads = _tensor_parallel(model, megatron_part(plan), mesh["tp"]) if tp > 1 else ({}, [])
    laid = lay_out_layers(model, plan, mesh["tp"], permutations) if tp > 1 else []
    modules = dict(model.named_modules())
    experts = [p for fqn in expert_parallel_modules(model, plan) for p in split_by_expert(modules[fqn], mesh["dp"])]
    own = {"experts": experts, "expert_ranks": dp}  # with tp 1 (`check_supported`)

    def summed() -> dict[str, Any]:  # by name, once wrapped: FSDP2 puts sharded parameters in the old ones' place
        params = dict(model.named_parameters())
        return {"tp_partial": [params[name] for name in heads], "tp_group": mesh.get_group("tp") if heads else None,
                "laid_out": laid}

    def plain(cls, **kw):  # noqa: ANN001, ANN003, ANN202
        return cls(model.parameters(), **kw)

    if dp == 1:
        return ParallelModel(model, zero, plain, permutations, axes, **summed())
    if zero > 0:
        layers = list(units) or repeated_layers(model)
        _fully_shard(model, layers, mesh["dp"], zero, experts=experts)
        return ParallelModel(model, zero, plain, permutations, axes, **summed(), **own)
    if tp > 1:  # DDP does not take tensor-parallel parameters: gradients all-reduce over dp by hand
        return ParallelModel(model, zero, plain, permutations, axes, dp_group=mesh.get_group("dp"), **summed())
    if not ddp:  # by hand in DDP's buckets, in the order the backward makes the gradients (the experts' left out)
        return ParallelModel(model, zero, plain, permutations, axes, dp_group=mesh.get_group("dp"), ready={},
                             **summed(), **own)
    wrapped = _ddp(model, ignored=[name for name, p in model.named_parameters() if any(p is e for e in experts)])
    return ParallelModel(wrapped, zero, lambda cls, **kw: cls(wrapped.parameters(), **kw), axes=axes, **own)


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers, as the trace finds them (`autopar.capture.reuse.find_units`: the outermost
    children of a ModuleList, Sequential or ModuleDict that share a class with a sibling and own parameters), in
    the order `named_modules` gives: the FSDP units the cost model prices, each on its own."""
    from autopar.capture.reuse import find_units

    found = find_units(model)
    return [m for m in model.modules() if id(m) in found]


def _fully_shard(root: nn.Module, layers: Iterable[nn.Module], mesh: Any, zero: int, *,
                 experts: Iterable[nn.Parameter] = ()) -> None:
    """FSDP2 per repeated layer, then the rest under ``root``; ZeRO 1-2 keep the weights gathered from the first
    forward to the last backward, ZeRO 3 gathers them again for the backward (the root keeps its own). ``experts``
    (expert parallelism: each rank's own experts, already split over dp) are left out of FSDP: neither sharded
    again nor gathered, their gradients never reduced."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(experts) or None
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=zero == 3, ignored_params=ignored)
    fully_shard(root, mesh=mesh, reshard_after_forward=False if zero < 3 else None, ignored_params=ignored)


def _prefetch_within(stage: nn.Module, layers: list[nn.Module]) -> None:
    """In a pipeline stage under ZeRO 3, each layer's backward prefetches the weights of the layer before it in
    the same micro-batch, and the stage's first layer those of the stage's root unit (kept gathered), as
    FSDP2's own prefetching does in one process. Left to itself, FSDP2 prefetches the unit that ran the forward
    before, in whichever micro-batch: a schedule that runs forwards between backwards (1F1B on a middle stage)
    then has a layer gathered for a backward that a forward reshards first, and gathered again, one gather more
    a step than the plan prices."""
    for at, layer in enumerate(layers):
        layer.set_modules_to_backward_prefetch([layers[at - 1] if at else stage])


def _ddp(module: nn.Module, *, ignored: list[str] = ()) -> nn.Module:
    """DDP over ``module``, leaving the parameters named ``ignored`` alone (expert parallelism's experts: each
    rank holds its own)."""
    from torch.nn.parallel import DistributedDataParallel

    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignored))
    # buffers are not broadcast each forward (the plan prices no such traffic; FSDP does not either): BatchNorm
    # statistics stay per rank
    return DistributedDataParallel(
        module, bucket_cap_mb=DDP_BUCKET_MB, forward_sync_buffers=False
    )


def _pipelined(model: nn.Module, plan: Plan, mesh: Any, axes: dict[str, str], *,
               example: torch.Tensor | None = None) -> ParallelModel:
    """This rank's stage: its modules, tensor parallelism over tp, a mixture's experts split over dp (expert
    parallelism), gradients all-reduced over dp after the schedule's last backward (by hand, in DDP-sized buckets:
    DDP's reducer cannot follow GPipe's forwards of every micro-batch before the first backward; the experts'
    left out), and the plan's schedule over pp."""
    from autopar.runtime import pipeline
    from autopar.runtime.experts import expert_parallel_modules, split_by_expert
    from autopar.runtime.intra import lay_out_layers, megatron_part

    dp, tp = plan.grid
    permutations: dict[str, tuple[int, torch.Tensor]] = {}
    heads: list[nn.Parameter] = []
    laid: list[nn.Parameter] = []
    sharded = plan.zero > 0 and dp > 1
    dp_group = mesh.get_group("dp") if dp > 1 and not sharded else None
    modules = dict(model.named_modules())
    mixtures = [modules[fqn] for fqn in expert_parallel_modules(model, plan)]
    experts: list[nn.Parameter] = []

    def wrap(part: nn.Module) -> nn.Module:
        names: list[str] = []
        if tp > 1:
            rows, names = _tensor_parallel(part, megatron_part(plan), mesh["tp"], model=model)
            permutations.update(rows)
            laid.extend(lay_out_layers(part, plan, mesh["tp"], permutations))
        held = {id(m) for m in part.modules()}
        own = [p for m in mixtures if id(m) in held for p in split_by_expert(m, mesh["dp"])]  # this part's experts
        experts.extend(own)
        if sharded:  # ZeRO 1: the schedule reduce-scatters after the last backward; 2-3 after every one
            layers = pipeline.stage_units(part)
            _fully_shard(part, layers, mesh["dp"], plan.zero, experts=own)
            if plan.zero == 3:
                _prefetch_within(part, layers)
        if names:  # by name, once wrapped (FSDP2 replaces the parameters)
            params = dict(part.named_parameters())
            heads.extend(params[name] for name in names)
        return part

    wrapped, part_names, pipe, groups = pipeline.build(model, plan, mesh, wrap=wrap,
                                                       micro_batches=plan.micro_batches, example=example)
    # one chunk: the stage itself; interleaved: the chunks side by side (parameter names gain "k.")
    if len(wrapped) == 1:
        module, names = wrapped[0], part_names[0]
    else:
        module = nn.ModuleDict({str(k): w for k, w in enumerate(wrapped)})
        names = {f"{k}.{name}": whole for k, chunk in enumerate(part_names) for name, whole in chunk.items()}
    return ParallelModel(
        module, plan.zero, lambda cls, **kw: cls(module.parameters(), **kw), permutations, {**axes, **groups},
        dp_group=dp_group, pipeline=pipe, names=names, chunks=wrapped, tp_partial=heads,
        tp_group=mesh.get_group("tp") if heads else None, experts=experts, expert_ranks=dp, laid_out=laid,
    )


DDP_BUCKET_MB = 25  # as `autopar.cost.memory.DDP_BUCKET_BYTES` prices it; set explicitly, no small first bucket


def check_matches(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan written for another model: every module and parameter it names must exist here, with the
    shape it was planned for."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    for entry in plan.modules:
        fqn = entry.fqn
        if fqn not in modules:
            raise ValueError(f"the plan shards module {fqn!r}, which the model does not have: was it planned for "
                             "another model or other --layers/--hidden?")
        for layout in entry.params:
            name = layout.name
            if name not in params:
                raise ValueError(f"the plan lays out parameter {name!r} of {fqn!r}, which the model does not have")
            if layout.shape is not None and tuple(params[name].shape) != layout.shape:
                raise ValueError(f"parameter {name!r} of {fqn!r} has shape {list(params[name].shape)}, the plan was "
                                 f"made for {list(layout.shape)}: was it planned with other --hidden/--heads/--vocab?")
    for number, stage in enumerate(plan.stages):
        for name in stage.layers:
            if name and name not in modules:
                raise ValueError(f"stage {number} of the plan holds layer {name!r}, which the model does not have")


def _tensor_parallel(
    module: nn.Module, plan: Plan, mesh: Any, *, model: nn.Module | None = None
) -> tuple[dict[str, tuple[int, torch.Tensor]], list[str]]:
    """Megatron TP over the 1-D ``mesh`` for the plan's modules ``module`` holds (all of them, or one pipeline
    stage's; ``model`` is the whole model, where tied weights are found); returns the orders of permuted
    fused-QKV parameters, and the names of the parameters whose gradients are summed over tp after the backward
    (`tp_partial_names`).

    A column-parallel linear whose block (its parent) also holds a row-parallel one feeds it shards; one with no
    row partner (an LM head) gathers its output. Where a block has several column linears reading one input
    (q, k and v; gate and up) the block's input (or the output of the norm the block applies to it first,
    `norms_before_columns`) becomes one replicated DTensor first, so its gradient is reduced once, as the cost model
    prices it. Works for the zoo's models and for Hugging Face ones alike, ``nn.Linear`` and GPT-2's ``Conv1D``
    (weight stored as (in, out)) alike."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    ColwiseParallel, RowwiseParallel, _ = _stream_styles()  # noqa: N806 - torch's styles, for a flattened stream too
    sp = plan.sp
    stream = Shard(1) if sp else Replicate()  # the residual stream between blocks: sequence shards under SP
    tp = mesh.size()
    placements = tensor_parallel_placements(module, plan, model=model)
    modules = dict(module.named_modules())
    columns = column_groups(placements)
    styles: dict[str, Any] = {}
    permutations: dict[str, tuple[int, torch.Tensor]] = {}
    fused_blocks: set[str] = set()
    heads = tp_partial_names(module, plan)
    split = split_norms(module, plan)  # norms over all heads at once, run on each rank's features
    norms = norms_before_columns(module, columns, sp=sp, summed=heads, split=split)
    # blocks that are layers of the stream themselves, with one column and no one norm it reads (OPT's decoder
    # layer holds its MLP's linears and two norms): under SP their input is sequence shards that their own norms
    # and residual adds run on, so their column gathers its input itself rather than the block gathering its own
    on_stream = {block for block, names in columns.items()
                 if sp and len(names) == 1 and _in_list(modules, block) and block not in norms}
    for fqn, placement in placements.items():
        parent_name = fqn.rpartition(".")[0]
        if placement == "E":  # a mixture's experts: `_split_experts`, below
            continue
        if placement == "S(1)":
            style = RowwiseParallel(output_layouts=stream)
        elif parent_name in columns:  # a row-parallel linear of the same block consumes the shards
            # its input arrives as a replicated DTensor (hook below) where several columns read it, and under SP,
            # where the norms before it hand on local sequence shards
            shared = len(columns[parent_name]) > 1 or (sp and parent_name not in on_stream)
            style = ColwiseParallel() if shared else ColwiseParallel(input_layouts=stream)
        else:  # a column layer with no row partner (the LM head): gather its output for what follows
            style = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        linear = modules[fqn]
        styles[fqn] = _conv1d_style(style) if is_conv1d(linear) else style
        parent, child = modules.get(parent_name), fqn.rpartition(".")[2]
        if placement == "S(0)" and grouped_qkv(parent, child):  # whole groups per rank as the weight stands
            _per_rank_heads(parent, tp)
            _alibi_per_rank(parent, mesh)
            fused_blocks.add(parent_name)
        pieces = fused_pieces(parent, child) if placement == "S(0)" else None
        if pieces is not None:
            order = _pieces_order(pieces, tp=tp)
            dim = out_features_dim(linear)
            with torch.no_grad():
                linear.weight.copy_(linear.weight.index_select(dim, order))
                if linear.bias is not None:
                    linear.bias.copy_(linear.bias[order])
            permutations[f"{fqn}.weight"] = (dim, order)
            if linear.bias is not None:
                permutations[f"{fqn}.bias"] = (0, order)
            if fused_qkv(parent, child) is not None:
                _per_rank_heads(parent, tp)
                fused_blocks.add(parent_name)
                if _named(parent, "MptAttention"):
                    _alibi_per_rank(parent, mesh)
    for block, names in columns.items():  # separate q, k and v: a head count the block's code reshapes by
        if block not in fused_blocks and len(names) > 1:
            _per_rank_head_counts(modules[block], tp)
    for block, names in columns.items():
        if (len(names) > 1 or sp) and block not in norms and block not in on_stream:
            _relayout_input(modules[block], mesh, stream, Replicate(), local=False)
        if len(names) > 1 and not sp:
            _share_other_inputs(modules[block], [modules[name] for name in names], mesh)
    gathered: list[str] = []
    whole = whole_attentions(module, placements) if sp else []
    if sp:  # norms inside a block see its heads, and those inside an attention kept whole the whole sequence
        from autopar.runtime.intra import laid_out_layers

        # layers laid out block by block take the stream's shards as they are and lay out their own norms
        laid = [name for name in laid_out_layers(plan) if name in modules]
        inside = {name.rpartition(".")[0] for name in heads} | set(split)
        inside.update(fqn for fqn, _ in module.named_modules() if any(_within(fqn, name) for name in [*whole, *laid]))
        gathered = _sequence_parallel(module, mesh, styles, inside=inside, laid=laid)
    parallelize_module(module, mesh, styles)
    for fqn, placement in placements.items():
        if placement == "E":
            entry = next(e for e in plan.modules if e.fqn == fqn)
            permutations.update(_split_experts(modules[fqn], mesh, expert_dims(modules[fqn], entry, fqn), fqn,
                                               sum_output=not sp))
            if sp:  # the block holding the experts and their router gathers the sequence and scatters its sum
                block = modules[fqn.rpartition(".")[0]]
                _relayout_input(block, mesh, stream, Replicate(), local=True)
                _relayout_output(block, mesh, Partial(), stream, local=True)
    for name in whole:
        # a multi-query attention tp keeps whole runs on the whole sequence: it gathers its input, and hands on
        # its rank's shard of its (replicated) output, whose gradient is gathered back in the backward
        _relayout_input(modules[name], mesh, stream, Replicate(), local=True)
        _relayout_output(modules[name], mesh, Replicate(), stream, local=True)
    for norm in split:
        _split_norm(modules[norm], mesh, scatter=sp)
    for fqn, placement in placements.items():  # after the styles' hooks: on the local tensor they hand on
        if placement == "S(1)" and _named(modules.get(fqn.rpartition(".")[0]), "FalconMLP"):
            # Falcon's parallel attention adds the attention's output into the MLP's in place, which autograd
            # forbids on the view of a DTensor's local shard a row-parallel layer returns
            modules[fqn].register_forward_hook(lambda _module, _args, output: output.clone())
    for norm in norms.values():  # after the styles' hooks: under SP the norm hands on its local sequence shard first
        _relayout_output(modules[norm], mesh, stream, Replicate())
    for norm in gathered:
        _relayout_output(modules[norm], mesh, stream, Replicate(), local=True)
    return permutations, heads


@functools.cache
def _stream_styles() -> tuple[type, type, type]:
    """torch's ColwiseParallel, RowwiseParallel and SequenceParallel, where a layer may flatten the stream's batch
    and sequence into rows before its MLP (OPT's decoder layer: ``reshape(-1, hidden)``): a sequence shard given as
    ``Shard(1)`` of a (batch, sequence, features) stream is then ``Shard(0)`` of the (rows, features) one. Each
    rank's rows are its own positions of every sample, gathered rank after rank: an MLP and a norm work row by row,
    and the reduce-scatter after the MLP hands each rank back its own rows."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    def rows(layouts: tuple, x: Any) -> tuple:
        return tuple(Shard(0) if p == Shard(1) else p for p in layouts) if x.dim() == 2 else layouts

    class Colwise(ColwiseParallel):
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # noqa: ANN001, ANN205
            return ColwiseParallel._prepare_input_fn(rows(input_layouts, inputs[0]), desired_input_layouts, mod, inputs,
                                                     device_mesh)

    class Rowwise(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
            return RowwiseParallel._prepare_output_fn(rows(output_layouts, outputs), use_local_output, mod, outputs,
                                                      device_mesh)

    class Sequence(SequenceParallel):
        @staticmethod
        def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):  # noqa: ANN001, ANN205
            return SequenceParallel._prepare_input_fn(rows(sequence_sharding, inputs[0]), mod, inputs, device_mesh)

    for style, base in ((Colwise, ColwiseParallel), (Rowwise, RowwiseParallel), (Sequence, SequenceParallel)):
        style.__name__ = style.__qualname__ = base.__name__
    return Colwise, Rowwise, Sequence


def _in_list(modules: dict[str, nn.Module], fqn: str) -> bool:
    """Whether the module ``fqn`` is an element of a list of layers (``nn.ModuleList``, ``nn.Sequential`` or a
    pipeline stage's ``nn.ModuleDict``)."""
    return isinstance(modules.get(fqn.rpartition(".")[0]), (nn.ModuleList, nn.Sequential, nn.ModuleDict))


def is_conv1d(module: Any) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 and its kin): a linear layer whose weight is stored as (in, out)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf)


def out_features_dim(module: nn.Module | None) -> int:
    """The dim of ``module``'s 2-D weight that holds its output features: 0 for ``nn.Linear``, 1 for ``Conv1D``."""
    return 1 if is_conv1d(module) else 0


def tp_role(module: nn.Module | None, dim: int) -> int:
    """The tp role of splitting ``module``'s 2-D weight on ``dim``: 0 where that splits its output features
    (column-parallel), 1 where it splits its input features (row-parallel), whichever way round the module stores
    its weight (a Linear's (out, in), GPT-2's ``Conv1D``'s (in, out))."""
    return dim if out_features_dim(module) == 0 else 1 - dim


def _conv1d_style(style: Any) -> Any:
    """``style`` (torch's ColwiseParallel or RowwiseParallel, which take ``nn.Linear`` only) for a ``Conv1D``, whose
    weight is the transpose of a Linear's: column-parallel splits its dim 1 (and the bias), row-parallel its dim 0
    (the bias stays whole, added once after the reduction). Inputs and outputs are laid out as for a Linear."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    column = isinstance(style, ColwiseParallel)

    def partition(_name: str, module: nn.Module, mesh: Any) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = (Shard(1) if name == "weight" else Shard(0)) if column else \
                (Shard(0) if name == "weight" else Replicate())
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                         requires_grad=param.requires_grad))

    class _Conv1DStyle(type(style)):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if not column:  # a row-parallel input arrives split by features, as for a Linear
                self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module, device_mesh, partition,
                functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    converted = _Conv1DStyle.__new__(_Conv1DStyle)
    converted.__dict__.update(style.__dict__)
    return converted


def whole_attentions(module: nn.Module, split: Iterable[str]) -> list[str]:
    """The multi-query attentions of ``module`` (`capture.graph.multi_query_attentions`) of which tensor
    parallelism splits no weight (``split``: the modules it splits, as `tensor_parallel_placements` names them):
    every rank runs them whole."""
    split = list(split)
    return [name for name in sorted(multi_query_attentions(module)) if not any(_within(fqn, name) for fqn in split)]


def fused_pieces(parent: Any, child: str) -> tuple[int, ...] | None:
    """Widths of the pieces, in order, that ``parent`` cuts the output features of its child ``child`` into, where
    the runtime lays that projection out per rank (`_pieces_order`: each rank's share of every piece in its one
    contiguous shard, so that the rank's own cut hands it its shares): a fused [q; k; v] projection (`fused_qkv`),
    and Phi-3's ``gate_up_proj``, which its MLP cuts into gate and up with ``.chunk(2)``; None otherwise."""
    qkv = fused_qkv(parent, child)
    if qkv is not None:
        heads, kv, size = qkv
        return heads * size, kv * size, kv * size
    proj = getattr(parent, child, None) if child == "gate_up_proj" else None
    if _named(parent, "Phi3MLP") and isinstance(proj, nn.Linear) and proj.out_features % 2 == 0:
        return proj.out_features // 2, proj.out_features // 2
    return None


def fused_qkv(parent: Any, child: str) -> tuple[int, int, int] | None:
    """(heads, key/value heads, head dim) where ``parent``'s child ``child`` is a fused [q; k; v] projection the
    runtime lays out per rank (`_pieces_order`) and ``parent`` is an attention whose head counts it can make
    per-rank (`_per_rank_heads`): the zoo's ``Attention.qkv``, GPT-2's self-attention ``c_attn`` (cut into q, k and
    v with ``.split(split_size)``), MPT's ``Wqkv`` (with ``.chunk(3)``) and Phi-3's ``qkv_proj`` (cut by slices at
    widths from its config); None otherwise."""
    from autopar.zoo.layers import Attention

    if isinstance(parent, Attention) and child == "qkv":
        return parent.heads, parent.kv_heads, parent.head_dim
    if child == "Wqkv" and _named(parent, "MptAttention"):  # cut into q, k and v with .chunk(3)
        heads, size, proj = getattr(parent, "n_heads", None), getattr(parent, "head_dim", None), parent.Wqkv
        if _count(heads) and _count(size) and isinstance(proj, nn.Linear) and proj.out_features == 3 * heads * size:
            return heads, heads, size
        return None
    if child == "qkv_proj" and _named(parent, "Phi3Attention"):
        heads = getattr(getattr(parent, "config", None), "num_attention_heads", None)
        kv, size = getattr(parent, "num_key_value_heads", None), getattr(parent, "head_dim", None)
        proj = getattr(parent, "qkv_proj", None)
        if (_count(heads) and _count(kv) and _count(size) and isinstance(proj, nn.Linear)
                and proj.out_features == (heads + 2 * kv) * size):
            return heads, kv, size
        return None
    sizes = [getattr(parent, name, None) for name in ("split_size", "num_heads", "head_dim")]
    if (child == "c_attn" and is_conv1d(getattr(parent, "c_attn", None))
            and getattr(parent, "is_cross_attention", None) is False and all(isinstance(n, int) for n in sizes)
            and parent.c_attn.nf == 3 * sizes[0] == 3 * sizes[1] * sizes[2]):
        return sizes[1], sizes[1], sizes[2]
    return None


def grouped_qkv(parent: Any, child: str) -> bool:
    """Whether ``parent``'s child ``child`` is a fused projection whose output features run group by group, each
    group's queries, key and value together, which ``parent`` forms heads from with its head counts: BLOOM's and
    Persimmon's ``query_key_value`` (a group per head), and Falcon's, without multi-query attention (a group per
    head) or with its new decoder architecture (a group per key/value head). Split by output features into
    contiguous blocks, each tp rank then holds whole groups as the weight stands; `_per_rank_heads` makes the counts
    one rank's."""
    proj = getattr(parent, child, None) if child == "query_key_value" else None
    heads, size = getattr(parent, "num_heads", None), getattr(parent, "head_dim", None)
    if not isinstance(proj, nn.Linear) or not _count(heads) or not _count(size):
        return False
    if _named(parent, "BloomAttention") or _named(parent, "PersimmonAttention"):
        # BLOOM's pretraining_tp path slices the output projection by full widths
        slow = getattr(parent, "pretraining_tp", 1) > 1 and getattr(parent, "slow_but_exact", False)
        return not slow and proj.out_features == 3 * heads * size
    if not _named(parent, "FalconAttention"):
        return False
    kv = getattr(parent, "num_kv_heads", None)
    if getattr(parent, "new_decoder_architecture", False):
        return _count(kv) and heads % kv == 0 and proj.out_features == (heads + 2 * kv) * size
    return not getattr(parent, "multi_query", True) and kv == heads and proj.out_features == 3 * heads * size


def _named(module: Any, name: str) -> bool:
    """Whether ``module`` is an instance of a class called ``name`` (or of a subclass of one): Hugging Face's
    attention classes, matched without importing their packages."""
    return any(cls.__name__ == name for cls in type(module).__mro__)


def _per_rank_heads(attention: nn.Module, tp: int) -> None:
    """Make ``attention``'s head counts (and GPT-2's split width) those of one tp rank, which holds 1/tp of them."""
    from autopar.zoo.layers import Attention

    if isinstance(attention, Attention):
        attention.heads //= tp
        attention.kv_heads //= tp
    elif grouped_qkv(attention, "query_key_value"):
        attention.num_heads //= tp
        if _count(getattr(attention, "num_kv_heads", None)):
            attention.num_kv_heads //= tp
    elif _named(attention, "Phi3Attention"):  # cuts q at its config's head count: give it a config of its own
        config = copy.copy(attention.config)
        config.num_attention_heads //= tp
        config.num_key_value_heads //= tp
        attention.config = config
        attention.num_key_value_heads //= tp
    elif _named(attention, "MptAttention"):
        attention.n_heads //= tp
    else:
        attention.split_size //= tp
        attention.num_heads //= tp
        attention.embed_dim //= tp


def _alibi_per_rank(attention: nn.Module, mesh: Any) -> None:
    """Give ``attention`` (BLOOM's, an ALiBi Falcon's, or MPT's) the ALiBi biases of its own heads: the model builds
    them for every head, as (batch x heads, 1, keys) or (batch, heads, 1, keys), or MPT's ``position_bias`` as
    (heads, 1, keys), and Falcon also adds them into a (batch, heads, queries, keys) attention mask; this rank
    attends over the ``num_heads`` (MPT's ``n_heads``, already one rank's) at its place in the tp group."""
    rank = mesh.get_local_rank()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        heads = module.n_heads if _named(module, "MptAttention") else module.num_heads
        whole, mine = heads * mesh.size(), slice(rank * heads, (rank + 1) * heads)
        changed = dict(kwargs)
        bias = kwargs.get("position_bias")
        if isinstance(bias, torch.Tensor) and bias.dim() == 3 and bias.shape[0] == whole > 1:
            changed["position_bias"] = bias[mine]
        alibi, mask = kwargs.get("alibi"), kwargs.get("attention_mask")
        for name, value in (("alibi", alibi), ("attention_mask", mask)):
            if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[1] == whole > 1:
                changed[name] = value[:, mine]  # (batch, heads, ...)
        if isinstance(alibi, torch.Tensor) and alibi.dim() == 3:  # (batch x heads, 1, keys)
            changed["alibi"] = alibi.view(-1, whole, *alibi.shape[1:])[:, mine].reshape(-1, *alibi.shape[1:])
        return args, changed

    attention.register_forward_pre_hook(hook, with_kwargs=True)


HEAD_COUNTS = ("num_heads", "num_key_value_heads", "num_kv_heads")


def _per_rank_head_counts(block: nn.Module, tp: int) -> None:
    """Make the head counts a block with separate column-parallel q, k and v keeps as attributes (``num_heads``,
    ``num_key_value_heads``) those of one tp rank, which holds 1/tp of the heads: attention code that forms heads
    with them (OPT's and Whisper's ``view(bsz, -1, self.num_heads, self.head_dim)``) would otherwise fold each
    rank's features into the sequence. Code that reads them otherwise is not trusted on this: the plan-time
    rehearsal (`autopar.runtime.validate`) compares every rank's attention with its share of the traced model's,
    and refuses the plan where they differ."""
    for name in HEAD_COUNTS:
        count = getattr(block, name, None)
        if isinstance(count, int) and not isinstance(count, bool) and count % tp == 0:
            setattr(block, name, count // tp)


def column_groups(placements: Mapping[str, str]) -> dict[str, list[str]]:
    """Block (the parent module) -> its column-parallel linears, for the columns whose block also holds a
    row-parallel one (attention, MLP), or, inside one of the model's numbered layers, whose nearest ancestor holding
    a row-parallel one is in that layer (BERT keeps q, k and v in ``attention.self`` and their row partner in
    ``attention.output``): those columns hand their shards on to the row, with no gather between. The rest (an LM
    head) gather their output. `check_runnable`'s rehearsal checks the pairing against the collectives the plan
    predicts."""
    rows = [fqn for fqn, placement in placements.items() if placement == "S(1)"]
    parents = {fqn.rpartition(".")[0] for fqn in rows}
    columns: dict[str, list[str]] = {}
    for fqn, placement in placements.items():
        if placement != "S(0)":
            continue
        parent = fqn.rpartition(".")[0]
        parts = fqn.split(".")
        ancestors = [".".join(parts[:depth]) for depth in range(len(parts) - 2, 0, -1)
                     if any(part.isdigit() for part in parts[:depth])]
        if parent in parents or any(row.startswith(f"{a}.") for a in ancestors for row in rows):
            columns.setdefault(parent, []).append(fqn)
    return columns


def norms_before_columns(
    module: nn.Module, columns: Mapping[str, list[str]], *, sp: bool, summed: Iterable[str], split: Iterable[str]
) -> dict[str, str]:
    """Block -> the norm it applies to its own input before its column linears read it (a pre-norm written inside
    the attention or MLP module), for the blocks whose columns share one replicated input (several columns, or
    any under SP). The norm is a direct child whose type is a LayerNorm or RMSNorm, over the columns' input
    features, not a per-head norm (q and k norms, whose weights tp sums: ``summed``) nor one over all heads at
    once (OLMo 2's, run split: ``split``, `split_norms`), and the block's only such child. The
    columns then read the norm's output, not the block's input, so that output becomes the DTensor they share.
    This is read from the module tree; `check_runnable` checks it against the traced model, so a plan whose
    columns read something else is refused when planned."""
    modules = dict(module.named_modules())
    summed, split = list(summed), set(split)
    found: dict[str, str] = {}
    for block, names in columns.items():
        if len(names) == 1 and not sp:
            continue
        features = {getattr(modules[name], "in_features", None) for name in names}
        norms = [
            f"{block}.{name}" for name, child in modules[block].named_children()
            if type(child).__name__.endswith(("LayerNorm", "RMSNorm")) and f"{block}.{name}" not in split
            and not any(p.startswith(f"{block}.{name}.") for p in summed)
            and {p.shape[-1] for p in child.parameters()} <= features
        ]
        if len(norms) == 1:
            found[block] = norms[0]
    return found


def tp_partial_names(module: nn.Module, plan: Plan) -> list[str]:
    """The parameters of ``module`` (the model, or one pipeline stage's modules) whose gradients the runtime sums
    over tp after the backward, as the plan marks them (``summed``: a weight tp keeps whole but applies to the
    activations it splits, a q or k norm per head; each rank computes its gradient from its own heads). One
    all-reduce, with sequence parallelism's norm weights where there are some, as the cost model prices.
    `check_runnable` checks the marks against the traced model."""
    if plan.grid[1] == 1:
        return []
    params = dict(module.named_parameters())
    return [p.name for entry in plan.modules for p in entry.params if p.summed and p.name in params]


def tensor_parallel_placements(module: nn.Module, plan: Plan, *, model: nn.Module | None = None) -> dict[str, str]:
    """The tp role (``S(0)``: output features, column-parallel; ``S(1)``: input features, row-parallel, as a
    Linear's weight is laid out; a ``Conv1D``'s placements are read transposed) of each module of ``module`` (the
    model, or one pipeline stage's modules; ``model`` the whole model, where tied weights are found) whose weight
    the plan splits over tp, weights tied to another module left whole. Raises NotImplementedError naming the
    first such module the runtime cannot split: `check_runnable` calls it on the whole model, so that a pipeline
    stage's refusal comes when the plan is made, not on the ranks."""
    from autopar.zoo.layers import Attention

    model = module if model is None else model
    placements: dict[str, str] = {}
    modules = dict(module.named_modules())
    tied = None
    for entry in plan.modules:
        fqn = entry.fqn
        if fqn not in modules:  # another pipeline stage's
            continue
        own = dict(modules[fqn].named_parameters(recurse=False))  # the model's, not the plan's (which may lack shapes)
        if any(p.name.rpartition(".")[2] in own and own[p.name.rpartition(".")[2]].dim() == 3
               and short(p.on(1)) != "R" for p in entry.params):
            expert_dims(modules[fqn], entry, fqn)  # raises where the runtime cannot split them
            placements[fqn] = "E"
            continue
        weight = next((p for p in entry.params if p.name.rpartition(".")[2] == "weight"), None)
        tp_placement = short(weight.on(1)) if weight is not None else "R"
        if tp_placement == "R":
            continue
        linear = modules[fqn]
        weight_tensor = getattr(linear, "weight", None)
        if tied is None:  # how many modules hold each parameter, counted once for the whole model
            tied = Counter(id(p) for p in _all_parameters(model))
        if weight_tensor is not None and tied[id(weight_tensor)] > 1:
            continue  # a weight tied to another module (a GPT head shares the embedding): kept whole
        if _is_split_norm(linear, entry):  # run split by `_split_norm`
            continue
        if not isinstance(linear, nn.Linear) and not is_conv1d(linear):
            raise NotImplementedError(f"module {fqn!r} ({type(linear).__name__}) cannot be split by tensor parallelism yet")
        if tp_placement in ("S(0)", "S(1)"):
            tp_placement = f"S({tp_role(linear, int(tp_placement[2]))})"
        parent = modules.get(fqn.rpartition(".")[0])
        if tp_placement == "S(0)" and isinstance(parent, Attention) and not fqn.endswith(".qkv"):
            raise NotImplementedError(f"attention projection {fqn!r} cannot be split yet")
        placements[fqn] = tp_placement
    for fqn in [fqn for fqn, placement in placements.items() if placement == "E" and plan.sp]:
        block = fqn.rpartition(".")[0]
        beside = next((other for other, placement in placements.items()
                       if placement != "E" and other.startswith(f"{block}.")), None)
        if beside is not None:  # the block would gather the sequence once; its split projections gather it again
            raise NotImplementedError(
                f"module {block!r} ({type(modules[block]).__name__}) holds experts and the split projection "
                f"{beside!r} beside them, which sequence parallelism cannot run yet: plan without --sp")
    return placements


def expert_dims(experts: nn.Module, entry: Any, fqn: str) -> dict[str, int]:  # noqa: ANN401 - a plan's entry
    """Parameter -> the dim tp splits it by, for a mixture's experts the plan splits by features (`_split_experts`):
    a Hugging Face experts module (`transformers.integrations.moe`) with one (E, out, in) or (E, in, out) matrix per
    expert in ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` and no biases, the first split by its output
    features and the second by its input features, as the plan says. Raises NotImplementedError naming ``fqn``
    otherwise."""
    own = dict(experts.named_parameters(recurse=False))
    column = "gate_up_proj" if "gate_up_proj" in own else "up_proj"
    dims = {p.name.rpartition(".")[2]: short(p.on(1)) for p in entry.params}
    transposed = getattr(experts, "is_transposed", None)
    reason = None
    if not isinstance(transposed, bool) or set(own) != {column, "down_proj"} or set(dims) != set(own):
        reason = "only Hugging Face experts with gate/up and down weights and no biases can be split"
    elif any(p.dim() != 3 for p in own.values()):
        reason = "its expert weights are not one matrix per expert"
    else:  # (E, out, in) as stored, or (E, in, out) where ``is_transposed``
        out_dim, in_dim = (2, 1) if transposed else (1, 2)
        if dims != {column: f"S({out_dim})", "down_proj": f"S({in_dim})"}:
            reason = f"the plan splits its weights as {dims}, not by the experts' features"
    if reason is not None:
        raise NotImplementedError(f"module {fqn!r} ({type(experts).__name__}) cannot be split by tensor parallelism "
                                  f"yet: {reason}")
    return {name: int(place[2]) for name, place in dims.items()}


def _expert_pieces(experts: nn.Module, column: str) -> tuple[int, ...] | None:
    """Widths of the pieces the experts cut their gate/up projection's output into (gate, then up), where they are
    concatenated; None where there is one piece (no gate) or the two are interleaved feature by feature, which a
    contiguous split already hands each rank its share of."""
    if column != "gate_up_proj" or not getattr(experts, "has_gate", False) or not getattr(
            experts, "is_concatenated", True):
        return None
    weight = getattr(experts, column)
    width = weight.shape[2 if experts.is_transposed else 1]
    return (width // 2, width // 2)


def _split_experts(experts: nn.Module, mesh: Any, dims: dict[str, int], fqn: str, *,  # noqa: ANN401 - a DeviceMesh
                   sum_output: bool = True) -> dict[str, tuple[int, torch.Tensor]]:
    """Run a mixture's experts split by features over the 1-D ``mesh``, as Megatron-LM runs its experts under tp:
    each rank holds every expert's share of the gate/up projection's output features (gate and up alike, the
    weight reordered so that a contiguous shard holds both: returned, for the checks that gather it) and the same
    share of the down projection's input features, its parameters DTensors split so (`expert_dims`). The router
    and the choice of experts run whole on every rank; the experts' own code runs on the local parts
    (`_LocalExperts`), each rank summing its part of every token's output, and the output is all-reduced over tp
    (with ``sum_output``; otherwise left for the caller to sum, as sequence parallelism reduce-scatters it).
    In the backward the gradient of the tokens each expert reads is all-reduced where they enter its gate/up
    projection, and that of the routing weights, which multiply each rank's partial output, where they enter the
    experts: as the block model prices it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    column = "gate_up_proj" if "gate_up_proj" in dims else "up_proj"
    permutations = {}
    pieces = _expert_pieces(experts, column)
    tp = mesh.size()
    for name, dim in dims.items():
        param = getattr(experts, name)
        data = param.data
        if name == column and pieces is not None:
            order = _pieces_order(pieces, tp=tp)
            data = data.index_select(dim, order)
            permutations[f"{fqn}.{name}"] = (dim, order)
        experts.register_parameter(name, nn.Parameter(distribute_tensor(data, mesh, [Shard(dim)]),
                                                      requires_grad=param.requires_grad))
    forward = experts.forward
    group = mesh.get_group()

    @functools.wraps(forward)
    def split_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        # the routing weights (any float input besides the tokens) multiply this rank's partial outputs
        args = tuple(_SumOverRanks.apply(a, group, None, False) if _is_float(a) else a for a in args)
        kwargs = {k: _SumOverRanks.apply(v, group, None, False) if _is_float(v) else v for k, v in kwargs.items()}
        # the weights as they are now: FSDP puts its gathered ones in their place for each forward
        roles = {id(getattr(experts, column)): "column", id(experts.down_proj): "row"}
        with _LocalExperts(roles, group):
            out = forward(hidden_states, *args, **kwargs)
        return _SumOverRanks.apply(out, group, None, True, False) if sum_output else out

    experts.forward = split_forward
    return permutations


def _is_float(value: Any) -> bool:  # noqa: ANN401
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class _LocalExperts(torch.overrides.TorchFunctionMode):
    """Inside split experts' forward (`_split_experts`): their weights read as their local parts, and the tokens a
    grouped matmul multiplies by the gate/up weights given a gradient summed over tp (each rank's covers its own
    features)."""

    _GROUPED = tuple(f for f in (getattr(torch, "_grouped_mm", None), getattr(nn.functional, "grouped_mm", None)) if f)

    def __init__(self, roles: dict[int, str], group: Any) -> None:  # noqa: ANN401
        super().__init__()
        self.roles, self.group = roles, group
        self.made: dict[int, tuple[torch.Tensor, str]] = {}  # views of the local weights (kept: ids stay unique)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        role = None

        def local(value: Any) -> Any:  # noqa: ANN401
            nonlocal role
            if isinstance(value, torch.Tensor):
                if id(value) in self.roles:
                    role = self.roles[id(value)]
                    return value.to_local()
                if id(value) in self.made:
                    role = self.made[id(value)][1]
            return value

        args = tuple(local(a) for a in args)
        kwargs = {k: local(v) for k, v in kwargs.items()}
        if func in self._GROUPED:
            if role == "column":
                args = (_SumOverRanks.apply(args[0], self.group, None, False), *args[1:])
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if role is not None and isinstance(out, torch.Tensor):
            self.made[id(out)] = (out, role)
        return out


def _is_split_norm(module: nn.Module, entry: Any) -> bool:  # noqa: ANN401 - a plan's module entry
    """Whether ``module`` is not a projection but holds only 1-D parameters, and the plan splits its weight over tp
    by features (OLMo 2's q and k norms, over all heads at once): the runtime runs it on each rank's features,
    its means taken over all ranks' (`_split_norm`)."""
    weight = next((p for p in entry.params if p.name.rpartition(".")[2] == "weight"), None)
    return (weight is not None and short(weight.on(1)) == "S(0)" and not isinstance(module, nn.Linear)
            and not is_conv1d(module) and all(p.dim() == 1 for p in module.parameters(recurse=False))
            and not list(module.children()))


def split_norms(module: nn.Module, plan: Plan) -> list[str]:
    """The modules of ``module`` (the model, or one pipeline stage's modules) run split under tp
    (`_is_split_norm`)."""
    if plan.grid[1] == 1:
        return []
    modules = dict(module.named_modules())
    return [entry.fqn for entry in plan.modules if entry.fqn in modules and _is_split_norm(modules[entry.fqn], entry)]


def _split_norm(norm: nn.Module, mesh: Any, *, scatter: bool) -> None:  # noqa: ANN401 - a DeviceMesh
    """Run ``norm``, which normalises the features a column-parallel projection hands on split (over all of them at
    once), on this rank's features: its parameters become DTensors split by features over the 1-D ``mesh`` (each
    rank's gradient then covers its own features, with nothing to sum), its own code runs on their local parts, and
    every mean it takes over its input's last dim is the mean over all ranks' features: the local sum all-reduced
    over tp, whose gradient is all-reduced back (one all-reduce of (rows, 1) each way, as priced). With
    ``scatter`` (sequence parallelism) that sum is reduce-scattered over the rows and gathered back instead, as the
    cost model prices a pending sum under SP (the same sum, in two collectives each way). DTensor's own propagation
    would also be right, but defers the backward's sum to the input's whole gradient, a reduce-scatter of every
    feature. The plan-time check lets only means over the last dim reduce inside such a norm
    (`validate._check_replicated_inside`)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, param in list(norm.named_parameters(recurse=False)):
        norm.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                                   requires_grad=param.requires_grad))
    forward = norm.forward
    group, ranks = mesh.get_group(), mesh.size()

    @functools.wraps(forward)
    def split_forward(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        with _OverAllFeatures(norm, group, ranks, scatter=scatter):
            return forward(*args, **kwargs)

    norm.forward = split_forward


class _OverAllFeatures(torch.overrides.TorchFunctionMode):
    """Inside a split norm's forward (`_split_norm`): its own parameters read as their local parts, and a mean over
    the last dim (``mean``, or inside ``rms_norm`` over that dim) taken over every rank's features."""

    _NORMS = (torch.rms_norm, nn.functional.rms_norm)

    def __init__(self, norm: nn.Module, group: Any, ranks: int, *, scatter: bool) -> None:  # noqa: ANN401
        super().__init__()
        self.scatter = scatter
        self.own = {id(p) for p in norm.parameters(recurse=False)}
        self.width = max((p.to_local().shape[0] for p in norm.parameters(recurse=False)), default=0)  # this rank's
        self.group, self.ranks = group, ranks

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        args = tuple(a.to_local() if id(a) in self.own else a for a in args)
        kwargs = {k: v.to_local() if id(v) in self.own else v for k, v in kwargs.items()}
        if func in (torch.mean, torch.Tensor.mean) and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
            if (len(dims) == 1 and isinstance(dims[0], int) and dims[0] % x.ndim == x.ndim - 1
                    and x.shape[-1] == self.width):
                keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
                return self.mean(x, keep)
        if func in self._NORMS and args:
            x, shape = args[0], args[1] if len(args) > 1 else kwargs["normalized_shape"]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            if len(tuple(shape)) == 1 and x.shape[-1] == self.width:  # as rms_norm computes, in fp32 at least
                eps = args[3] if len(args) > 3 else kwargs.get("eps")
                eps = torch.finfo(x.dtype).eps if eps is None else eps
                wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
                y = (wide * torch.rsqrt(self.mean(wide * wide, True) + eps)).type_as(x)
                return y if weight is None else y * weight
        return func(*args, **kwargs)

    def mean(self, x: torch.Tensor, keep: bool) -> torch.Tensor:
        total = x.sum(-1, keepdim=keep)
        # under SP: over the first dim the ranks divide (the batch or the sequence; the sum is the same)
        rows = next((d for d in range(total.dim() - (1 if keep else 0)) if total.shape[d] % self.ranks == 0), None)
        return _SumOverRanks.apply(total, self.group, rows if self.scatter else None) / (x.shape[-1] * self.ranks)


class _SumOverRanks(torch.autograd.Function):
    """Every rank's ``x`` summed over ``group`` in the ``forward`` and every rank's gradient summed in the
    ``backward``, each where asked (the other way it passes as it is), all-reduced, or with ``rows``
    reduce-scattered along that dim and gathered back. Both ways: a split norm's sum (each rank's output feeds that
    rank's own features, so every rank's share of the gradient reaches each input). Forward only: split experts'
    partial outputs (each rank's gradient is the whole one). Backward only: a value each rank applies to its own
    features alone (the tokens entering the experts, the routing weights)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rows: int | None = None,  # noqa: ANN401
                forward: bool = True, backward: bool = True) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.backward = group, rows, backward
        return _summed(x, group, rows) if forward else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN401
        return (_summed(grad, ctx.group, ctx.rows) if ctx.backward else grad), None, None, None, None


def _summed(x: torch.Tensor, group: Any, rows: int | None) -> torch.Tensor:  # noqa: ANN401
    import torch.distributed as dist

    if rows is None:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out
    ranks = dist.get_world_size(group)
    moved = x.movedim(rows, 0).contiguous()
    part = moved.new_empty((moved.shape[0] // ranks, *moved.shape[1:]))
    dist.reduce_scatter_tensor(part, moved, group=group)
    whole = torch.empty_like(moved)
    dist.all_gather_into_tensor(whole, part, group=group)
    return whole.movedim(0, rows)


def _relayout_input(module: nn.Module, mesh: Any, source: Any, target: Any, *, local: bool) -> None:
    """Before ``module`` runs, read its first input (positional, or the first keyword tensor) as a local tensor laid
    out as ``source`` on ``mesh`` and redistribute it to ``target`` (a local tensor again with ``local``). The same
    tensor passed again (CTRL's attention takes its input as v, k and q) is handed on as that one result, so its
    gradient is reduced once."""
    from torch.distributed.tensor import DTensor

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [source], run_check=False)
        x = x.redistribute(mesh, [target])
        return x.to_local() if local else x

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            first, converted = args[0], convert(args[0])
            return tuple(converted if a is first else a for a in args), {
                k: converted if v is first else v for k, v in kwargs.items()}
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        first, converted = kwargs[key], convert(kwargs[key])
        return args, {k: converted if v is first else v for k, v in kwargs.items()}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _share_other_inputs(block: nn.Module, columns: list[nn.Module], mesh: Any) -> None:
    """Columns of ``block`` that read one tensor other than the block's input (a cross-attention's k and v read
    the encoder's output) read it as one replicated DTensor, made once per forward of the block: its gradient is
    then reduced over tp once, as the cost model prices a shared input, not once per column."""
    from torch.distributed.tensor import DTensor, Replicate

    made: dict[int, tuple[torch.Tensor, Any]] = {}  # id of the plain tensor -> (it, its DTensor), one forward's

    def forget(*_: Any) -> None:
        made.clear()

    def share(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
            return None
        x = args[0]
        if id(x) not in made:
            made[id(x)] = (x, DTensor.from_local(x, mesh, [Replicate()], run_check=False))
        return (made[id(x)][1], *args[1:]), kwargs

    block.register_forward_pre_hook(forget)
    block.register_forward_hook(forget)
    for column in columns:
        column.register_forward_pre_hook(share, with_kwargs=True)


def _relayout_output(module: nn.Module, mesh: Any, source: Any, target: Any, *, local: bool = False) -> None:
    """After ``module`` runs, read its output (or the first of a tuple: an attention's, with its weights) as a
    local tensor laid out as ``source`` on ``mesh`` and hand it on redistributed to ``target``, as a DTensor (a local
    tensor again with ``local``)."""
    from torch.distributed.tensor import DTensor

    def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (hook(_module, _args, output[0]), *output[1:])
        if not isinstance(output, torch.Tensor):
            return output
        if not isinstance(output, DTensor):
            output = DTensor.from_local(output, mesh, [source], run_check=False)
        output = output.redistribute(mesh, [target])
        return output.to_local() if local else output

    module.register_forward_hook(hook)


def _sequence_parallel(module: nn.Module, mesh: Any, styles: dict[str, Any], *, inside: set[str],
                       laid: Iterable[str] = ()) -> list[str]:
    """Sequence parallelism around Megatron TP (Korthikanti et al.), as the cost model prices it: the stream is
    scattered into sequence shards where it enters the stack of layers (its gradient is gathered back), and the
    norms from there on run on shards and hand them on as local tensors, as the stream is between layers (a norm
    after a block, as Gemma's, meets the residual stream there; a block gathers its input itself), but not those
    ``inside`` a split block (they see its heads). Norms before the stack (BERT's embedding norm) see the whole
    sequence, as the embedding does. After the stack, the first split module (a column-parallel head, or the
    dense layer of BERT's MLM head) gathers its input itself and what follows it runs whole; a head TP leaves
    whole gathers its input. In a Hugging Face causal LM that gather comes right after the norm that ends its chain
    of layers (the first of its ``last`` modules, `pipeline.HF_CHAINS`), since the model may reshape that norm's
    output by the whole sequence before the head (GPT-2 does); the names of such norms are returned, for the
    caller to gather their outputs once the styles are applied. ``laid``: layers laid out block by block
    (`runtime.intra.lay_out_layers`), which take the stream's shards and hand them on as split ones do."""
    from torch.distributed.tensor import Replicate, Shard
    from autopar.runtime.pipeline import HF_CHAINS, chain_kind

    SequenceParallel = _stream_styles()[2]  # noqa: N806

    named = list(module.named_modules())
    split = [*styles, *laid]
    from autopar.runtime.pipeline import StageModule

    # the stack: the list of layers holding the split modules (the zoo's and LLaMA's ``layers``, GPT-2's ``h``,
    # BERT's ``layer``, a user's nn.Sequential; a pipeline stage's ModuleDict of its layers)
    stage = module if isinstance(module, StageModule) else None
    lists = (nn.ModuleList, nn.Sequential, nn.ModuleDict) if stage is not None else (nn.ModuleList, nn.Sequential)
    stack = next((name for name, m in named if isinstance(m, lists) and len(m)
                  and any(fqn.startswith(f"{name}.") for fqn in split)), None)
    if stack is None:
        raise NotImplementedError("sequence parallelism scatters the stream where it enters the model's list of "
                                  "layers, and no nn.ModuleList or nn.Sequential of this model holds a module tp "
                                  "splits: plan without --sp")
    # another list of layers (blocks holding split modules, not split modules themselves, as a head's
    # nn.Sequential of linears would be): an encoder's and a decoder's, one stream scattered and the other not
    other = next((fqn for fqn in split if not fqn.startswith(f"{stack}.")
                  and any(fqn.startswith(f"{name}.") and "." in fqn[len(name) + 1:] for name, m in named
                          if isinstance(m, (nn.ModuleList, nn.Sequential)) and not name.startswith(f"{stack}."))), None)
    if other is not None:
        raise NotImplementedError(f"sequence parallelism runs one list of layers on sequence shards ({stack!r}), and "
                                  f"module {other!r}, which tp splits, sits in another (an encoder-decoder model): "
                                  "plan without --sp")
    try:  # a stage's chain is the whole model's (a stage lacks the modules of the others)
        chain = HF_CHAINS.get(stage.kind if stage is not None else chain_kind(module))
    except NotImplementedError:
        chain = None
    # in the order the forward runs them: a Hugging Face model's modules after its layers (``last``) may be
    # registered before them (OPT's final norm)
    ends = [f"{chain.outer}.{name}" for name in chain.last] if chain is not None else []

    def after(fqn: str) -> bool:
        return any(fqn == end or fqn.startswith(f"{end}.") for end in ends)

    ordered = [(fqn, m) for fqn, m in named if not after(fqn)]
    end = max(i for i, (fqn, _) in enumerate(ordered) if fqn.startswith(f"{stack}."))
    ordered[end + 1 : end + 1] = [(fqn, m) for fqn, m in named if after(fqn)]
    within = False  # from the stack's first layer to the first split module after the stack
    for fqn, norm in ordered:
        in_stack = fqn.startswith(f"{stack}.")
        within = within or in_stack
        if within and not in_stack and fqn in styles:
            break
        if within and type(norm).__name__.endswith(("LayerNorm", "RMSNorm")) and fqn not in inside:
            styles[fqn] = SequenceParallel(use_local_output=True)
    if stage is None or stage.first:  # a later pipeline stage is handed the shards the stage before it made
        _relayout_input(next(iter(dict(named)[stack].children())), mesh, Replicate(), Shard(1), local=True)
    last = f"{chain.outer}.{chain.last[0]}" if chain is not None and chain.last else None  # its final norm
    gathered = []
    for name in dict.fromkeys(("head", "lm_head", *((chain.head,) if chain is not None else ()))):
        head = dict(module.named_children()).get(name)
        if head is None or any(fqn == name or fqn.startswith(f"{name}.") for fqn in split):
            continue  # a split head gathers its input itself
        if last in styles:  # kept whole (tied): gather the sequence first
            gathered.append(last)
        else:
            _relayout_input(head, mesh, Shard(1), Replicate(), local=True)
    return gathered


def _pieces_order(widths: tuple[int, ...], *, tp: int) -> torch.Tensor:
    """Order of a fused projection's output features, cut into pieces of ``widths`` (q, k and v; gate and up), that
    puts each rank's share of every piece, in piece order, in one contiguous shard."""
    if any(width % tp for width in widths):
        raise ValueError(f"tp {tp} does not divide the widths {list(widths)} a fused projection is cut into")
    starts = [sum(widths[:k]) for k in range(len(widths))]
    return torch.cat([(start + torch.arange(width)).view(tp, -1) for start, width in zip(starts, widths)],
                     dim=1).reshape(-1)


def _all_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every module's direct parameters, shared ones repeated (``named_parameters`` lists a shared one once)."""
    return [p for m in model.modules() for p in m._parameters.values() if p is not None]


def recompute(model: nn.Module, levels: dict[str, str], *, compiled: bool = False) -> None:
    """Apply the plan's recomputation: ``full`` checkpoints the whole layer (only its input is kept; the forward
    runs again in backward), ``selective`` checkpoints the attention core of the zoo's attention modules (q, k, v
    kept, scores and softmax redone). Parameter names do not change. With ``compiled``, a layer recomputed in full
    runs its forward compiled inside the checkpoint, checkpoint(compile(forward)): compiled around the checkpoint,
    AOT autograd fails on a tensor-parallel layer (it saves a DeviceMesh among the tensors); `compile_layers` leaves
    such a layer as it is."""
    from torch.utils.checkpoint import checkpoint

    from autopar.zoo.layers import Attention

    modules = dict(model.named_modules())
    for name, level in levels.items():
        layer = modules.get(name)
        if layer is None:
            raise ValueError(f"the plan recomputes {name!r}, which the model does not have")
        if level == "full":
            forward = torch.compile(layer.forward, fullgraph=True) if compiled else layer.forward
            layer.forward = functools.partial(_checkpointed, checkpoint, forward)
        elif level == "selective":
            cores = [m for m in layer.modules() if isinstance(m, Attention)]
            if not cores:
                raise NotImplementedError(f"selective recomputation of {name!r} needs the zoo's attention module")
            for core in cores:
                core.recompute_core = True
        else:
            raise ValueError(f"unknown recomputation {level!r} for {name!r}")


def compile_layers(model: nn.Module) -> list[nn.Module]:
    """Compile every repeated layer of ``model`` (each child of an ``nn.ModuleList``) in place with
    ``torch.compile(fullgraph=True)``: parameter names do not change, and compilation happens at the first call,
    after tensor parallelism, FSDP and recomputation have been applied to the layer. ``fullgraph`` makes a layer
    dynamo cannot capture whole raise rather than run partly eager. Returns the layers compiled."""
    layers = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst._modules.values()]
    for layer in layers:
        if "forward" not in layer.__dict__:  # else recomputed in full: compiled inside its checkpoint (`recompute`)
            layer.compile(fullgraph=True)
    return layers


def checkpoint_segments(model: nn.Module, segments: list[list[str]]) -> None:
    """Apply the plan's checkpointed segments: each ``[first, last]`` run of layers of one ``nn.ModuleList`` runs
    as one checkpoint, keeping only its input; runs may nest (`autopar.cost.checkpoint`). The model's own loop over
    the list then meets a run as one callable. Parameter names do not change."""
    modules = dict(model.named_modules())
    spans: dict[str, list[tuple[int, int]]] = {}
    for first, last in segments:
        (head, _, a), (other, _, b) = first.rpartition("."), last.rpartition(".")
        container = modules.get(head)
        if head != other or not isinstance(container, nn.ModuleList) or not (a.isdigit() and b.isdigit()) \
                or not int(a) < int(b) < len(container):
            raise ValueError(f"the plan checkpoints {first!r}..{last!r} together: a segment must be two or more "
                             "layers of one nn.ModuleList of the model, first to last")
        spans.setdefault(head, []).append((int(a), int(b) + 1))
    for head, found in spans.items():
        segment_layers(modules[head], found)


class _Run:
    """Layers called one after another as one checkpoint (only the input kept; the forward replays in the
    backward); an item may be a nested run. Attributes the model's loop reads come from the first layer."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __call__(self, x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._run, x, *args, use_reentrant=False, **kwargs)

    def _run(self, x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        for item in self.items:
            x = item(x, *args, **kwargs)
        return x

    def __getattr__(self, name: str):  # noqa: ANN204
        if name == "items":
            raise AttributeError(name)
        return getattr(self.items[0], name)


class _SegmentedList(nn.ModuleList):
    """A ModuleList that iterates its layers with checkpointed runs in place of their layers."""

    def __iter__(self):  # noqa: ANN204
        return iter(self._autopar_runs)

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        if isinstance(index, slice) and range(len(self))[index] == range(len(self)):
            return self  # a model that loops over layers[: n] with n all of them
        if isinstance(index, slice):
            raise NotImplementedError("a model slicing its checkpointed layer list cannot run segments")
        return super().__getitem__(index)


class _SegmentedDict(nn.ModuleDict):
    """A ModuleDict (a pipeline stage's layers, keyed by their index in the model) iterated the same way."""

    def values(self):  # noqa: ANN201
        return iter(self._autopar_runs)


def segment_layers(container: nn.Module, spans: list[tuple[int, int]]) -> None:
    """Make ``container`` (a ModuleList, or a ModuleDict keyed by layer index) iterate with the runs ``spans``
    (``[start, end)`` layer indices, nested or disjoint) checkpointed."""
    from autopar.cost.checkpoint import Segment, nest

    keys = {int(k): layer for k, layer in container._modules.items()}
    start, end = min(keys), max(keys) + 1

    def items(children) -> list:  # noqa: ANN001
        return [keys[c] if isinstance(c, int) else _Run(items(c.children)) for c in children]

    children = nest(start, end, [(a, b) for a, b in spans if start <= a and b <= end])
    if any(isinstance(c, Segment) for c in children):
        container.__class__ = _SegmentedDict if isinstance(container, nn.ModuleDict) else _SegmentedList
        container._autopar_runs = items(children)
        container._autopar_spans = list(spans)


def _checkpointed(checkpoint, forward, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
