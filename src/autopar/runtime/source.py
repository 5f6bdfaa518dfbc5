"""The model a plan is for, as the runtime's checks see it: fresh copies on the meta device, its chain of layers as
traced, and batches of the right shapes.

`autopar run` rebuilds the model from the plan's workload (a zoo name and its overrides, `ModelSource.of_workload`).
A plan made from Python by `autopar.plan` has no workload: its checks use the model it was planned for
(`ModelSource.of_module`), copied to the meta device by `meta_copy`, so the user's weights are neither read nor
touched and a billion-parameter model costs no memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from autopar.capture import Graph, trace

if TYPE_CHECKING:
    from autopar.runtime.train import Workload


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """How to get the model a plan is for: ``meta()`` a fresh copy on the meta device each call (the checks apply
    the plan to it), ``chain()`` its traced graph (whose chain of layers the stages must cover), ``batch(rows)`` a
    CPU batch of ``rows`` rows of the inputs its forward takes (values do not matter: the rehearsal runs on fake
    tensors)."""

    meta: Callable[[], nn.Module]
    chain: Callable[[], Graph]
    batch: Callable[[int], dict[str, torch.Tensor]]
    traced_at: Callable[[int], Graph] | None = None  # the whole model traced at a batch of that many rows

    @classmethod
    def of_workload(cls, work: Workload) -> ModelSource:
        """The zoo model a plan's workload names, as `autopar run` builds it (fp32, dropout off)."""
        from autopar.runtime.train import global_batch
        from autopar.zoo import load

        def build(device: str) -> nn.Module:
            return load(work.model, batch=1, seq=work.seq, dtype=torch.float32, device=device, dropout=0.0,
                        **work.overrides).module.train()

        def chain() -> Graph:  # as the planner traced it
            planned = load(work.model, batch=1, seq=work.seq, dtype=torch.float32, **work.overrides)
            return trace_chain(planned.module, planned.inputs)

        def traced_at(rows: int) -> Graph:
            planned = load(work.model, batch=rows, seq=work.seq, dtype=torch.float32, **work.overrides)
            return trace(planned.module, example_kwargs=planned.inputs)

        return cls(meta=lambda: build("meta"), chain=chain, batch=lambda rows: global_batch(work, 0),
                   traced_at=traced_at)

    @classmethod
    def of_module(cls, module: nn.Module, example_inputs: Mapping[str, torch.Tensor], *,
                  graph: Graph | None = None) -> ModelSource:
        """``module`` (any device; only its meta copies are used) and the keyword inputs of its forward (any batch
        size: a batch repeats their first row's shapes); ``graph``: its trace at batch 1, when already made."""
        meta = meta_copy(module)
        rows = {key: value[:1] for key, value in example_inputs.items()}
        traced = [graph] if graph is not None else []

        def chain() -> Graph:
            if not traced:
                traced.append(trace_chain(meta, {k: v.to("meta") for k, v in rows.items()}))
            return traced[0]

        def batch(count: int) -> dict[str, torch.Tensor]:
            return {key: torch.zeros(value.shape, dtype=value.dtype).expand(count, *value.shape[1:])
                    for key, value in rows.items()}

        def traced_at(count: int) -> Graph:
            return trace(meta, example_kwargs={k: v.to("meta") for k, v in batch(count).items()})

        return cls(meta=lambda: copy.deepcopy(meta), chain=chain, batch=batch, traced_at=traced_at)


def trace_chain(module: nn.Module, inputs: Mapping[str, torch.Tensor]) -> Graph:
    """``module``'s trace in its own dtype (fp32, as the runtime trains), or in bf16 where a kernel's fake
    implementation takes bf16 only: the chain of layers is the same in any dtype. (MoE's grouped matmul, the one
    such kernel known, the tracer already shapes in bf16 itself: `capture.tracer._shapes_in_bf16`; this retry is
    for any other.) Raises ValueError when neither traces."""
    from autopar.capture import CaptureError

    try:
        return trace(module, example_kwargs=dict(inputs))
    except CaptureError as exc:
        try:
            return trace(copy.deepcopy(module).to(torch.bfloat16), example_kwargs={
                k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()})
        except CaptureError:
            raise ValueError(f"the model cannot be traced as the runtime builds it (fp32): {exc}") from None


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (shapes, dtypes and
    ``requires_grad`` kept, no memory): the weights are never copied, and weights shared by several modules stay
    shared. The original is left as it was."""
    memo: dict[int, object] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in memo:
            continue
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(module, memo)
