"""Planning a user's own model from Python: `plan`, and `plan_once` for a script that runs on several ranks.

`plan` traces a copy of the model on the meta device (the user's weights are neither read nor moved), searches as
``autopar plan`` does (`autopar.api.search`), checks the plan against the model itself and returns it with its
report (`Plan.explain`). The plan has no workload (there is no zoo name to rebuild the model from): it runs in the
user's script, ``autopar.parallelize(model, plan)``.

Planning is not deterministic across processes: the searches stop when they converge, but at their time budget
(``budget_s``) where they have not by then, so two processes, or one machine busier than another, may find
different plans. A script running on several ranks must
plan once and share the plan: `plan_once` plans on one rank and broadcasts it (or the error) to the others.

Inside a process that already has a default process group (a ``torchrun`` script after
``init_process_group``) the planner's runtime check cannot make the fake process group it rehearses a plan on, so
`plan` runs in a child process started with ``spawn``: the model's class must be importable there (defined in a
module, or in a script whose work sits under ``if __name__ == "__main__":``), and the child takes a few seconds to
start.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.api.report import PYTHON, pipeline_report, render_pipeline
from autopar.api.search import SearchOptions, Subject, refusal, search_pipeline
from autopar.capture import trace
from autopar.cli.render import binary_bytes
from autopar.cluster import load_cluster
from autopar.cluster.spec import Cluster
from autopar.plan import Plan
from autopar.plan.checks import FieldError, integer, text
from autopar.plan.records import MAX_DEVICES
from autopar.runtime.source import ModelSource, meta_copy

log = logging.getLogger(__name__)

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "NotImplementedError": NotImplementedError,
                                       "TypeError": TypeError}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    """`plan`'s arguments, checked: what it plans for, and how it searches."""

    cluster: Cluster
    gpus: int
    name: str
    options: SearchOptions


def plan(
    model: nn.Module, example_inputs: Mapping[str, torch.Tensor], *, cluster: str | Cluster, gpus: int, batch: int,
    search: str = "auto", budget_s: float = 60.0, runnable_only: bool = True, kernels: str = "eager",
    optimizer: str = "adam", name: str | None = None,
) -> Plan:
    """A parallel plan for training ``model`` on ``gpus`` devices of ``cluster``.

    ``model``: an ``nn.Module`` on any device (the meta device too) whose forward, called with
    ``example_inputs`` as keyword arguments, returns the training loss (a scalar tensor, or an output whose
    ``.loss`` is one, as Hugging Face models return when given ``labels``). ``example_inputs``: a dict of tensors
    with the batch along dim 0, of any batch size: their first row is traced and costs scale with the batch.
    ``batch``: the global batch of one optimizer step, in samples; the plan splits it into micro-batches and over
    the data-parallel ranks (`Plan.local_batch`).

    ``cluster``: a preset name (``a100-80g-sxm``, ``cpu``, ...), a cluster file, or a `Cluster`. ``search``: auto,
    aceso, mcmc, exhaustive, or a baseline (megatron, dp, fsdp); ``budget_s``: the most the search may take (it
    stops sooner once it converges).
    ``runnable_only``: only plans `autopar.parallelize` can run on this model, checked on the model itself as
    ``autopar plan`` checks them (when the best would be refused its runners-up are tried; when none can run, a
    ValueError says why; a faster plan it cannot run is named in the report). ``kernels``: eager, or compiled
    (``torch.compile`` per repeated layer).
    ``optimizer``: sgd, momentum or adam, whose state the memory estimate holds (bf16 and fp16 models are priced as
    mixed precision, with an fp32 master copy). ``name``: the model's name in reports (default: its class).

    The model's dtype is its parameters'. Errors name the bad argument; a ValueError says so when no plan fits the
    devices' memory."""
    request = _request(model, example_inputs, cluster=cluster, gpus=gpus, name=name,
                       options=dict(search=search, batch=batch, budget_s=budget_s, runnable_only=runnable_only,
                                    kernels=kernels, optimizer=optimizer))
    rows = {key: torch.empty_like(value[:1], device="meta") for key, value in example_inputs.items()}
    if dist.is_available() and dist.is_initialized():
        return _in_child(meta_copy(model), rows, request)
    return _plan_here(meta_copy(model), rows, request)


def plan_once(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], *, src: int = 0,
              **options: Any) -> Plan:
    """`plan` on rank ``src`` of the default process group, broadcast to every rank, so that all ranks train one
    plan (planning stops at its time budget, so ranks planning for themselves could disagree). ``options`` are
    `plan`'s keyword arguments. An error on ``src`` is raised on every rank. Without a process group, `plan`."""
    if not (dist.is_available() and dist.is_initialized()):
        return plan(model, example_inputs, **options)
    box: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            box[0] = ("plan", plan(model, example_inputs, **options))
        except tuple(_ERRORS.values()) as exc:
            box[0] = (type(exc).__name__ if type(exc).__name__ in _ERRORS else "ValueError", str(exc))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=src, device=device)
    kind, value = box[0]
    if kind != "plan":
        raise _ERRORS[kind](value)
    return value


def _request(model: Any, example_inputs: Any, *, cluster: Any, gpus: Any, name: Any,
             options: dict[str, Any]) -> _Request:
    """`plan`'s arguments checked, each error naming its argument."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    dtype = _dtype(model)
    _check_inputs(example_inputs)
    if isinstance(cluster, str):
        try:
            cluster = load_cluster(cluster)
        except ValueError as exc:
            raise ValueError(f"cluster: {exc}") from None
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a preset name, a cluster file or a Cluster, got {type(cluster).__name__}")
    integer("gpus", gpus, high=MAX_DEVICES)
    name = text("name", name if name is not None else type(model).__name__, limit=1024)
    return _Request(cluster=cluster, gpus=gpus, name=name, options=SearchOptions(dtype=dtype, **options))


def _dtype(model: nn.Module) -> str:
    kinds = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(kinds) != 1 or next(iter(kinds)) not in _DTYPES:
        shown = ", ".join(sorted(str(k).removeprefix("torch.") for k in kinds)) or "none"
        raise ValueError(f"model must hold floating-point parameters of one dtype (float32, bfloat16 or float16) "
                         f"to be planned; its parameters are {shown}")
    return _DTYPES[next(iter(kinds))]


def _check_inputs(example_inputs: Any) -> None:
    if not isinstance(example_inputs, Mapping) or not example_inputs:
        raise TypeError(f"example_inputs must be a non-empty dict of keyword name -> tensor, got "
                        f"{type(example_inputs).__name__}")
    rows = set()
    for key, value in example_inputs.items():
        if not isinstance(key, str):
            raise TypeError(f"example_inputs keys must be the forward's keyword names, got {key!r}")
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] == 0:
            raise FieldError(f"example_inputs[{key!r}]", "must be a tensor with the batch along dim 0 (at least "
                             f"one row), got {type(value).__name__}"
                             + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""))
        rows.add(value.shape[0])
    if len(rows) > 1:
        raise FieldError("example_inputs", f"hold batches of different sizes {sorted(rows)} along dim 0")


def _plan_here(meta: nn.Module, rows: dict[str, torch.Tensor], request: _Request) -> Plan:
    """Trace, search and check in this process (which has no process group): the plan with its report."""
    start = time.perf_counter()
    cluster = request.cluster.with_devices(request.gpus)
    graph = trace(meta, example_kwargs=rows)
    source = ModelSource.of_module(meta, rows, graph=graph)
    subject = Subject.of(graph, meta, name=request.name, check=lambda p: refusal(p, source=source),
                         pipelines=len(rows) == 2)
    searched = search_pipeline(subject, cluster, request.options, started=start)
    memory = searched.chosen.result.estimate.memory
    if not searched.fits:
        raise ValueError(f"no {request.options.search} plan fits {request.gpus} x {cluster.name}: the least-over "
                         f"needs {binary_bytes(memory.total)} per device of {binary_bytes(memory.budget)}; give more "
                         "gpus, a smaller batch or a cluster with more memory")
    ids = rows.get("input_ids")  # token models: the report gives their sequence length
    config = {"batch": request.options.batch, "seq": ids.shape[1] if ids is not None and ids.dim() == 2 else None}
    data = pipeline_report(searched, model=request.name, config=config, cluster=cluster, params=graph.num_params)
    return replace(searched.plan, report=render_pipeline(data, runner=PYTHON))


def _in_child(meta: nn.Module, rows: dict[str, torch.Tensor], request: _Request) -> Plan:
    """`_plan_here` in a child process started with spawn (it has no process group); its error is raised here."""
    payload = io.BytesIO()
    torch.save((meta, rows, request), payload)  # meta tensors: no weights cross
    log.info("planning %s in a child process: this process has a process group already", request.name)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        kind, value = pool.submit(_child, payload.getvalue()).result()
    if kind != "plan":
        raise _ERRORS[kind](value)
    return value


def _child(payload: bytes) -> tuple[str, Any]:
    """In the child: plan, and return ("plan", plan) or (error kind, message): an error travels as its text, since
    not every exception class can be rebuilt from its pickle."""
    meta, rows, request = torch.load(io.BytesIO(payload), weights_only=False)
    try:
        return "plan", _plan_here(meta, rows, request)
    except tuple(_ERRORS.values()) as exc:
        return (type(exc).__name__ if type(exc).__name__ in _ERRORS else "ValueError"), str(exc)
