"""Training steps on synthetic data, on a rank of a plan or in one process as the reference.

Every rank builds the model from the plan's workload with one seed (so all start from the same weights), draws the
same global batch for each step from a seeded generator, and trains it with `ParallelModel.forward_backward`: its
data-parallel slice of each micro-batch (`autopar.plan.batch`), losses scaled by 1/micro-batches and gradients
accumulated, so a rank's averaged gradient equals the single-process gradient of the whole global batch. The
reference trains the same micro-batches in one process. Dropout is off: ranks and the reference must see the same
numbers. The optimizer is SGD (Adam's eps turns 1e-9 gradient noise into visible parameter differences).
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.plan import Plan
from autopar.plan.batch import split_batch
from autopar.runtime.apply import ParallelModel, loss_of  # noqa: F401 - bench/tp_runtime.py reads it here
from autopar.runtime.comm import CollectiveCounter
from autopar.zoo import config_for, load, synthetic_batch

LEARNING_RATE = 0.05


@dataclass(frozen=True, slots=True)
class Workload:
    model: str
    overrides: dict[str, int]
    seq: int
    batch: int  # global batch per step
    micro_batch: int  # samples per micro-batch across the data-parallel ranks
    micro_batches: int

    @classmethod
    def of(cls, plan: Plan) -> Workload:
        work = plan.workload
        if work is None:
            raise ValueError("the plan has no workload (model, overrides, seq, batch) to rebuild its model from: it "
                             "was made from Python (autopar.plan), or written by an older autopar; name its model "
                             "with --model (a zoo name, hf:<type> or path/to/file.py:function, with the --seq and "
                             "model overrides it was planned with), or run it in your own script with "
                             "autopar.parallelize(model, plan)")
        return cls(model=work.model, overrides=work.override_map, seq=work.seq, batch=work.batch,
                   micro_batch=plan.micro_batch_size, micro_batches=plan.micro_batches)


@dataclass
class StepLog:
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    collectives: list[list[dict]] = field(default_factory=list)  # per rank: calls and bytes per (kind, axis)
    random_draws: list[str] = field(default_factory=list)  # the reference's: where its first step drew random numbers
    grad_norms: list[float] = field(default_factory=list)  # with clipping: each step's norm before it
    # with a check: the whole weights before the first step and after each step (on a rank, those it holds)
    weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    apart: list[str] = field(default_factory=list)  # tied weights two pipeline stages hold different copies of


def build_model(work: Workload, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    zoo = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, device="cpu", dropout=0.0, **work.overrides)
    return zoo.module.train()


def global_batch(work: Workload, step: int) -> dict[str, torch.Tensor]:
    """The step's whole batch: token ids below the vocabulary, floats from a normal, from a seeded generator (a
    user's function: its inputs under the step's seed; `autopar.zoo.synthetic_batch`)."""
    config = config_for(work.model, seq=work.seq, **work.overrides)
    return synthetic_batch(config, batch=work.batch, seq=work.seq, seed=10_000 + step)


def train(
    parallel: ParallelModel, optimizer: torch.optim.Optimizer, work: Workload, *, steps: int,
    gradients=None,  # noqa: ANN001 - callable returning the whole gradients after backward
    counter: CollectiveCounter | None = None,  # counts the collectives of the last step
    watch_random: bool = False,  # note where the first step draws random numbers (`StepLog.random_draws`)
    dtype: torch.dtype | None = None,  # the batches' floating tensors in this dtype (a float64 reference)
    clip: float | None = None,  # clip the gradients' norm to this before each optimizer step
    weights=None,  # noqa: ANN001 - callable returning the whole weights, read before the first step and after each
    start=None,  # noqa: ANN001 - callable(step) loading the weights a step starts from, or doing nothing
) -> StepLog:
    """``steps`` steps on the workload's synthetic batches; losses as one process sees them
    (`ParallelModel.average_loss`). A model `parallelize` made takes its own rows of each batch; any other (the
    one-process reference) trains all of them, in the workload's micro-batches. With ``clip``, the gradients are
    clipped (`ParallelModel.clip_grad_norm_`) after they are read for the check: its one all-reduce is timed
    with the step but not counted with the plan's collectives. ``weights`` (a check's) is read untimed and
    uncounted too."""
    log = StepLog()
    if weights is not None:
        _paused(counter, lambda: log.weights.append(weights()))
    for step in range(steps):
        if start is not None:
            start(step)
        batch = global_batch(work, step)
        if dtype is not None:
            batch = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in batch.items()}
        if parallel.plan is None:
            batch = split_batch(batch, micro_batch_size=work.micro_batch, micro_batches=work.micro_batches, dp=1,
                                dp_rank=0)
        optimizer.zero_grad(set_to_none=True)
        counting = counter if counter is not None and step == steps - 1 else contextlib.nullcontext()
        _together(parallel)
        began = time.perf_counter()
        watching = RandomDraws() if watch_random and step == 0 else contextlib.nullcontext()
        with counting:
            with watching:
                loss = parallel.forward_backward(batch)
            if isinstance(watching, RandomDraws):
                log.random_draws = watching.places
            checking = time.perf_counter()
            if gradients is not None:
                _paused(counter, lambda: log.grads.append(gradients()))
            checking = time.perf_counter() - checking
            if clip is not None:
                _paused(counter, lambda: log.grad_norms.append(parallel.clip_grad_norm_(clip)))
            optimizer.step()
        _together(parallel)
        log.seconds.append(time.perf_counter() - began - checking)
        if weights is not None:
            _paused(counter, lambda: log.weights.append(weights()))
        log.losses.append(parallel.average_loss(loss))
        log.peak_bytes.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return log


def _together(parallel: ParallelModel) -> None:
    """Wait for every rank (a barrier, not counted) so that a step's time is the whole group's: from all ranks
    starting it to the last one finishing it, as the plan's estimate prices an iteration."""
    import torch.distributed as dist

    if parallel.plan is not None and dist.is_initialized():
        if dist.get_backend() == "nccl":
            torch.cuda.synchronize()
        dist.barrier()


def _paused(counter: CollectiveCounter | None, work) -> None:  # noqa: ANN001
    """Run ``work`` (the check's own gathers) without counting its collectives."""
    if counter is None:
        work()
        return
    counter.enabled = False
    try:
        work()
    finally:
        counter.enabled = True


def reference(work: Workload, *, steps: int, seed: int = 0, dtype: torch.dtype | None = None,
              clip: float | None = None, starts: list[dict[str, torch.Tensor]] | None = None) -> StepLog:
    """The same steps in one process with no parallelism; ``dtype``: the model and its floating inputs cast to it
    (float64: the rounding of an fp32 run shows against it). Its ``weights`` are the model's own before the first
    step, then each step's result.

    ``starts`` (a run's `StepLog.weights`): each step starts from the weights the run started it from, loaded by
    name, so that each step is compared from the same point. Runs that differ by fp32 rounding otherwise drift
    apart step by step, and where a unit's input crosses a kink (a ReLU at 0) between them they part for good: a
    check would report a mismatch no plan caused."""
    module = build_model(work, seed=seed)
    if dtype is not None:
        module = module.to(dtype)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    params = dict(module.named_parameters())

    def grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in params.items()}

    def start(step: int) -> None:
        if starts is None or step >= len(starts):
            return
        with torch.no_grad():
            for name, value in starts[step].items():
                if name in params:  # a name the run holds and this model does not: compare() names it
                    params[name].copy_(value)

    plain = ParallelModel(module, 0, lambda cls, **kw: cls(module.parameters(), **kw))
    return train(plain, optimizer, work, steps=steps, gradients=grads, watch_random=True, dtype=dtype, clip=clip,
                 weights=weights, start=start)


class RandomDraws:
    """Inside, notes each place the model draws random numbers (an aten op tagged ``nondeterministic_seeded`` that
    really draws: dropout at p 0, or attention at ``dropout_p`` 0, draws nothing), as ``op at file:line in function
    (module)``, the frame being the innermost outside torch and autopar, once per place.

    A one-process check cannot compare such a model with its ranks: ranks draw for their own rows, stages and
    shards from their own generators, so losses differ by the draws alone, which a loss mismatch would not say.
    `autopar run` sets every ``nn.Dropout`` to 0, but not ``F.dropout(x, p, training=self.training)``, noise
    added with ``torch.randn`` or random masking in the model's own code."""

    def __init__(self) -> None:
        self.places: list[str] = []
        self._modes: list = []

    def __enter__(self) -> RandomDraws:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.module_tracker import ModuleTracker

        tracker = ModuleTracker()
        places = self.places

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                kwargs = kwargs or {}
                if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
                    place = f"{func.overloadpacket.__name__} at {_user_frame()}{_innermost(tracker.parents)}"
                    if place not in places:
                        places.append(place)
                return func(*args, **kwargs)

        self._modes = [tracker, Watch()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _draws(func, args: tuple, kwargs: dict) -> bool:  # noqa: ANN001
    """Whether a seeded op draws at these arguments: dropout at p 0 or not training, and attention at dropout_p 0,
    return without drawing."""
    schema = func._schema.arguments
    value = {a.name: a.default_value for a in schema if a.has_default_value()}
    value |= dict(zip((a.name for a in schema), args)) | kwargs
    if "dropout_p" in value:
        return bool(value["dropout_p"])
    if "dropout" in func.overloadpacket.__name__:
        return bool(value.get("p", 1.0)) and value.get("train", True) is not False
    return True


def _user_frame() -> str:
    """``file:line in function`` of the innermost frame outside torch, autopar and the standard library (a
    Hugging Face model's own modelling file counts: it is where the draw is written)."""
    import os
    import sysconfig
    import traceback

    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
            sysconfig.get_paths()["stdlib"] + os.sep)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip) or "site-packages" in frame.filename and \
                not frame.filename.startswith(skip[:2]):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "an unknown place"


def _innermost(parents: set[str]) -> str:
    names = [name for name in parents if name != "Global"]
    return f", module {max(names, key=lambda n: (n.count('.'), len(n)))}" if names else ""
