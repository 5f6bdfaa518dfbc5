"""Run an intra-op plan (``--search ilp``, and the dp/megatron/fsdp layouts priced beside it) with DTensor.

An intra-op plan gives every parameter a layout on the plan's mesh (`ModuleLayout.params`), every leading op
(a linear layer, an embedding) the layout of the activation it reads (`ModuleLayout.input`), and its module the
layout it hands its output on in (`ModuleLayout.output`). The runtime applies exactly that, and lets DTensor carry
the layouts through everything else:

- each parameter becomes a DTensor in its planned layout, cut from the whole weight every rank built with one seed
  (no communication); tied parameters stay one parameter; buffers (rotary tables, masks) become replicated
  DTensors;
- the model's inputs enter replicated on every rank (every rank reads the global micro-batch); a forward pre-hook
  on each planned module redistributes its input into the layout the plan gives it (a batch split of a replicated
  value is a local slice, a gather of a split one a collective), and a forward hook its output into the layout
  the plan hands it on in; each conversion's gradient comes back converted there too (`_hook_inputs`);
- between planned modules, DTensor's own sharding propagation runs each op on the layouts it is given, so a
  split head, a fused projection cut by ``split`` or ``chunk``, a reshape or a loss is computed as one process
  computes it whatever the model's code looks like: where a layout cannot be kept, DTensor converts it. Where
  DTensor would choose otherwise than the plan among layouts that compute the same (a norm's rows, which value
  of a residual add to convert, how to reduce a softmax's pending sum), `_AsPlanned` makes the plan's choice;
- after the last micro-batch's backward, the gradients DTensor leaves pending (``Partial``: the data-parallel sums)
  are all-reduced over each mesh axis in one flat buffer per axis, as the cost model prices them
  (`autopar.cost.intra.sync_seconds`), and every gradient is put in its parameter's layout for the optimizer;
- under ZeRO 1 they are reduce-scattered instead, axis by axis, and the optimizer updates only this rank's slice of
  each weight the plan holds whole where it splits the work, then the weights are all-gathered back
  (`_ZeroShards`); under ZeRO 2 each weight's gradient is reduce-scattered as soon as the backward has made it
  (in every micro-batch), so that no more than one is whole at a time; under ZeRO 3 each weight is moreover held
  as this rank's slice between its uses and gathered where it is read (`_Zero3Hooks`).

What the runtime issues is counted and compared with the plan's prediction by ``autopar run --check-comm`` and by
the plan-time rehearsal: where DTensor converts a value the plan did not price, the counts differ and the plan is
refused, never run on a different cost in silence.

CPU attention (``_scaled_dot_product_flash_attention_for_cpu``) has no DTensor rule in PyTorch; `attention_rules`
registers one: the batch and head dims split, the sequence and head dims whole, as CUDA's flash attention rule.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autopar.plan import Plan
from autopar.plan.batch import LocalBatch, split_batch
from autopar.runtime.apply import ParallelModel, loss_of

_REGISTERED = False


def attention_rules() -> None:
    """Register DTensor sharding rules for CPU's fused attention and its backward (once per process): every
    tensor split alike on the batch (dim 0) or the heads (dim 1), or all whole. A mask of one row or one head is
    read whole by every shard."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def mask(attn_mask: Any, dim: int | None) -> list:
        if attn_mask is None:
            return []
        if dim is None or attn_mask.shape[dim] == 1:
            return [Replicate()]
        return [Shard(dim)]

    def options(tensors_in: int, tensors_out: int, attn_mask: Any, scalars: int) -> list:
        found = []
        for dim in (None, 0, 1):
            place = Replicate() if dim is None else Shard(dim)
            if attn_mask is not None and dim is not None and attn_mask.ndim < 4:
                continue  # a mask broadcast from fewer dims: whole only
            found.append(([place] * tensors_out, [place] * tensors_in + [None] * scalars + mask(attn_mask, dim)))
        return found

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, *,  # noqa: ANN001, ANN202, ARG001
                 attn_mask=None, scale=None):  # noqa: ANN001
        return options(3, 2, attn_mask, 2)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,  # noqa: ANN001, ANN202
                  attn_mask=None, scale=None):  # noqa: ANN001, ARG001
        return options(6, 3, attn_mask, 2)

    _REGISTERED = True


_GRADIENT_RULES = False


def linear_gradient_rules() -> None:
    """Let an activation's backward keep a pending sum (once per process).

    ``sigmoid_backward(grad, y)`` and its kin (tanh, SiLU, GELU, ReLU's threshold) are linear in the gradient: a
    gradient that is a pending sum over tp (what column-parallel projections hand back to the ops before them)
    passes through as one, to be reduced once where the cost model prices it. DTensor has no such rule for them
    and reduces it there first, an all-reduce the plan never priced. Registered for every plan (tensor-parallel
    stages apply DTensor too): each op keeps DTensor's own options (all whole, or split alike on any dim) and
    gains (pending sum, whole) -> pending sum."""
    global _GRADIENT_RULES
    if _GRADIENT_RULES:
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def options(grad: Any, extra: int) -> list:
        found = [([Replicate()], [Replicate(), Replicate()] + [None] * extra),
                 ([Partial()], [Partial(), Replicate()] + [None] * extra)]
        found += [([Shard(d)], [Shard(d), Shard(d)] + [None] * extra) for d in range(grad.ndim)]
        return found

    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for op, extra in ((aten.sigmoid_backward.default, 0), (aten.tanh_backward.default, 0),
                      (aten.silu_backward.default, 0), (aten.gelu_backward.default, 0),
                      (aten.threshold_backward.default, 1)):
        propagator.op_single_dim_strategy_funcs.pop(op, None)  # the pointwise rule, which DTensor tries first
        register_sharding(op)(lambda grad_output, *rest, _extra=extra, **kw: options(grad_output, _extra))
    _GRADIENT_RULES = True


class _AsPlanned(torch.overrides.TorchFunctionMode):
    """Inside, some ops run as the plan prices them rather than as DTensor would choose on its own.

    - A norm (``layer_norm``, ``rms_norm``) reads its normalised dims whole and keeps the rest of its input's
      layout, as the plan runs it: DTensor would otherwise also split the rows over an axis the input is whole on
      (a free slice for it, but the stream then leaves the norm in a layout the plan does not have, and its
      gradient comes back pending over that axis). For ``rms_norm`` it is also what makes it run: DTensor runs it
      (a composite op) as its decomposition, which adds eps in place to the mean of the squares, and over a split
      feature dim that mean is a pending average, which an in-place op cannot keep.
    - A softmax (or a loss over logits) given a pending sum reduce-scatters it onto a dim it does not reduce over
      (`_scattered`), where the plan scatters pending sums, rather than all-reducing it as DTensor would.
    - A weight another module holds, read by a module the plan has read it in another layout (`ModuleLayout.reads`:
      a head tied to an embedding split by features reads the table whole), is converted as the module's ops first
      read it (`_read`).
    - The fused attention given a pending sum (q, k and v of a projection split by the features it contracts)
      reduces it before the call, onto the batch or the heads as the plan prices it (`_attention_inputs`).
      DTensor would reduce it inside the call, where autograd saves the pending sum, so the attention's backward
      would reduce it again, and the gradient would return split, to be gathered whole after q, k and v are
      joined, not piece by piece where the plan prices it.
    - A sum of two values of one shape in different layouts (a residual add of the stream as one block left it and
      a branch as another hands it on) converts the older value (the stream, made in an earlier block) to the
      layout of the newer one (the branch the block made), as the plan converts a value a block reads from another
      to the layout of the block's own, and as a conversion whose gradient is converted back
      (`DTensor.redistribute`): DTensor would convert whichever it chooses inside the add, where autograd does not
      see it, and the gradient would return in the other layout, converted wherever it is next read, not where the
      plan prices it. Pending sums are left to DTensor."""

    def __init__(self, *, scatter: bool = True) -> None:
        super().__init__()
        self.scatter = scatter  # the plan reduce-scatters pending sums an op cannot take (else all-reduces them)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        kwargs = kwargs or {}
        if _READING and any(id(a) in _READING for a in args):
            args = tuple(_read(a) if id(a) in _READING else a for a in args)
        if func in _CUTS and args and getattr(args[0], "_autopar_pieces", None) is not None:
            found = _cut_pieces(func, args, kwargs)
            if found is not None:
                return found
        if func in _MEANS and args and isinstance(args[0], DTensor):
            found = _row_statistic(func, args, kwargs, scatter=self.scatter)
            if found is not None:
                return found
        if func in _NORMS and args and isinstance(args[0], DTensor):
            x = args[0]
            shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
            first = x.ndim - len(shape)
            found = _split_norm(func, x, shape, args[2:], kwargs, scatter=self.scatter)
            if found is not None:
                return found
            placements = [Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim >= first) else p
                          for p in x.placements]
            if placements != list(x.placements):
                args = (x.redistribute(x.device_mesh, placements), *args[1:])
        elif func in _ATTENTIONS and len(args) >= 3 and all(isinstance(t, DTensor) for t in args[:3]):
            args = (*_attention_inputs(args[:3], scatter=self.scatter), *args[3:])
        elif func in _ROWWISE and self.scatter and args and isinstance(args[0], DTensor):
            args = (_scattered(args[0], reduced=-1 if func is not torch.nn.functional.cross_entropy else 1), *args[1:])
        elif func in _SUMS and len(args) >= 2 and isinstance(args[0], DTensor) and isinstance(args[1], DTensor):
            a, b = args[0], args[1]
            if a.shape == b.shape and a.placements != b.placements:
                older, newer = (a, b) if _made(a) <= _made(b) else (b, a)
                if not any(isinstance(p, Partial) for p in (*newer.placements, *older.placements)):
                    converted = older.redistribute(older.device_mesh, newer.placements)
                    a, b = (converted, b) if older is a else (a, converted)
                    args = (a, b, *args[2:])
        return _stamped(func(*args, **kwargs))


def running(*, scatter: bool = True) -> Any:  # noqa: ANN401
    """The context an intra-op plan's forward runs in: `_AsPlanned`, and tensors the model makes itself (positions
    from arange, a mask) read as replicated."""
    import contextlib

    from torch.distributed.tensor.experimental import implicit_replication

    stack = contextlib.ExitStack()
    stack.enter_context(_AsPlanned(scatter=scatter))
    stack.enter_context(implicit_replication())
    return stack


_SUMS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
_MEANS = (torch.mean, torch.Tensor.mean)
_CUTS = (torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.Tensor.split_with_sizes)


def _split_norm(func: Any, x: Any, shape: Any, rest: tuple, kwargs: dict, *,  # noqa: ANN401
                scatter: bool = False) -> Any:  # noqa: ANN401
    """A norm whose input and weight the plan splits alike by features (a weight ``S(0)`` on the axis that splits
    the input's last dim, whole on every other), run on each rank's features, as the cost model prices it: each
    rank's share of the statistics over the features, summed per row (`_mean_of_rows`; two for a LayerNorm: its
    mean, then its variance), instead of gathering the features. None where the norm is not so split."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = ("weight", "bias", "eps") if func in (torch.layer_norm, torch.nn.functional.layer_norm) else \
        ("weight", "eps")
    given = dict(zip(names, rest)) | {k: v for k, v in kwargs.items() if k in names}
    weight, bias, eps = given.get("weight"), given.get("bias"), given.get("eps")
    last = Shard(x.ndim - 1)
    if len(shape) != 1 or not isinstance(weight, DTensor) or last not in x.placements:
        return None
    if any(w != (Shard(0) if p == last else Replicate()) for w, p in zip(weight.placements, x.placements)
           if not p.is_partial()):
        return None
    if func in (torch.rms_norm, torch.nn.functional.rms_norm):
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        out = x * torch.rsqrt(_mean_of_rows(x.pow(2), scatter=scatter) + eps)
    else:
        eps = 1e-5 if eps is None else eps
        centred = x - _mean_of_rows(x, scatter=scatter)
        out = centred * torch.rsqrt(_mean_of_rows(centred.pow(2), scatter=scatter) + eps)
    out = out * weight
    return _stamped(out + bias if bias is not None else out)


def _row_statistic(func: Any, args: tuple, kwargs: dict, *, scatter: bool = False) -> Any:  # noqa: ANN401
    """A mean over the last dim, kept, of a value split by features over an axis (a norm written out, as Hugging
    Face's RMSNorm is: the mean of the squares): each rank's share summed at once, in an all-reduce of one value per
    row, and its gradient summed back there, as `_split_norm` runs a norm and the cost model prices it (DTensor
    would leave the mean pending and, in the backward, reduce-scatter the whole value instead). None otherwise."""
    from torch.distributed.tensor import Shard

    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    last = Shard(x.ndim - 1)
    if not keep or len(dims) != 1 or dims[0] is None or dims[0] % x.ndim != x.ndim - 1 or last not in x.placements \
            or not x.is_floating_point() or any(p.is_partial() for p in x.placements):
        return None
    return _stamped(_mean_of_rows(x, share=func(*args, **kwargs), scatter=scatter))


def _mean_of_rows(x: Any, *, share: Any = None, scatter: bool = False) -> Any:  # noqa: ANN401
    """The mean of each row of ``x`` (split by features over an axis) over its last dim, kept, whole on every rank:
    each rank's share summed in an all-reduce of one value per row, and its gradient summed back there.
    ``share``: the mean as the model took it, still pending (default ``x.mean(-1, keepdim=True)``). With
    ``scatter`` (a plan that reduce-scatters the pending sums an op cannot take, `_scattered`), the sum is
    reduce-scattered over the rows and then gathered, each a conversion whose gradient is converted back, as
    such a plan prices it."""
    from torch.distributed.tensor import Replicate, Shard

    last = Shard(x.ndim - 1)
    rows = [Replicate() if p == last or p.is_partial() else p for p in x.placements]
    share = x.mean(-1, keepdim=True) if share is None else share
    if scatter:
        scattered = _scattered(share, reduced=-1)
        if scattered is not share:
            return scattered.redistribute(x.device_mesh, rows)
    return _Settle.apply(share.redistribute(x.device_mesh, rows))


def _marks_pieces(pieces: tuple[int, ...]) -> Any:  # noqa: ANN401
    """A forward hook marking a fused projection's output as one its model cuts into ``pieces`` (widths, in the
    model's order along the last dim), its output features laid out per rank (`lay_out_layers`: each rank's shard
    holds its share of every piece), for `_cut_pieces`."""
    from torch.distributed.tensor import DTensor

    def hook(_module: nn.Module, _args: tuple, output: Any) -> None:  # noqa: ANN401
        if isinstance(output, DTensor):
            output._autopar_pieces = pieces

    return hook


def _cut_pieces(func: Any, args: tuple, kwargs: dict) -> tuple | None:  # noqa: ANN401
    """A fused projection's output (`_marks_pieces`) split by features over one axis cut into its pieces as the cost
    model prices the cut (`analysis.dims`: each shard holds its share of every piece, as Megatron's runtime lays the
    projection out): each rank cuts its own shard into its shares, with no conversion, each piece handed on split
    by features. None where the cut is not into those pieces or the value is otherwise laid out (DTensor then
    converts, and the rehearsal's count of collectives sees what it did)."""
    from torch.distributed.tensor import DTensor, Shard

    x = args[0]
    pieces = x._autopar_pieces
    chunks = func in (torch.chunk, torch.Tensor.chunk)
    how = args[1] if len(args) > 1 else kwargs.get("chunks" if chunks else "split_size_or_sections",
                                                      kwargs.get("split_size", kwargs.get("split_sizes")))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim % x.ndim != x.ndim - 1:
        return None
    if chunks:
        fits = how == len(pieces) and len(set(pieces)) == 1
    elif isinstance(how, int):
        fits = all(w == how for w in pieces)
    else:
        fits = [int(w) for w in how] == list(pieces)
    if not fits:
        return None
    mesh, placements = x.device_mesh, list(x.placements)
    split = [a for a, p in enumerate(placements) if p == Shard(x.ndim - 1)]
    if len(split) != 1 or any(not p.is_replicate() for a, p in enumerate(placements) if a != split[0]):
        return None
    tp = mesh.size(split[0])
    if any(w % tp for w in pieces):
        return None
    local = x.to_local().split([w // tp for w in pieces], dim=-1)
    return tuple(_stamped(DTensor.from_local(part, mesh, placements, run_check=False, shape=(*x.shape[:-1], w),
                                             stride=_contiguous(*x.shape[:-1], w)))
                 for part, w in zip(local, pieces))


def _contiguous(*shape: int) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


_NORMS = (torch.rms_norm, torch.nn.functional.rms_norm, torch.layer_norm, torch.nn.functional.layer_norm)
_ROWWISE = (torch.log_softmax, torch.nn.functional.log_softmax, torch.Tensor.log_softmax, torch.softmax,
            torch.nn.functional.softmax, torch.Tensor.softmax, torch.nn.functional.cross_entropy)


_ATTENTIONS = (torch.nn.functional.scaled_dot_product_attention,)


def _attention_inputs(qkv: tuple, *, scatter: bool) -> tuple:
    """Query, key and value with their pending sums reduced, as the plan converts the fused attention's inputs
    (`autopar.cost.intra.IntraCost._follow`): on each mesh axis the query is split on (its batch or its heads,
    the dims DTensor's rule for the attention splits, `attention_rules`), all three are split alike; where the
    query is a pending sum, onto its batch, else its heads, whichever that axis divides (with ``scatter``; else
    summed whole); on any other axis, whole. Converted with `DTensor.redistribute`, so autograd saves the reduced
    values and gathers their gradients back where each was reduced."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    query = qkv[0]
    if not any(isinstance(p, Partial) for t in qkv for p in t.placements):
        return qkv
    mesh, targets = query.device_mesh, list(query.placements)
    for axis, p in enumerate(query.placements):
        if isinstance(p, Shard) and p.dim in (0, 1):
            continue
        targets[axis] = Replicate()
        if isinstance(p, Partial) and p.reduce_op in _SCATTERED and scatter:
            dim = _dividing_dim(query.shape, targets, mesh, axis, (0, 1))
            if dim is not None:
                targets[axis] = Shard(dim)
    return tuple(t.redistribute(mesh, [targets[a] if isinstance(p, Partial) else p for a, p in enumerate(t.placements)])
                 if any(isinstance(p, Partial) for p in t.placements) else t for t in qkv)


_SCATTERED = ("sum", "avg")  # pending sums and means, which a reduce-scatter makes as it splits them


def _scattered(x: Any, *, reduced: int) -> Any:  # noqa: ANN401
    """``x``'s pending sums reduce-scattered onto a dim the op does not reduce over (``reduced``), the one before
    the last first (the sequence, or a flattened loss's rows), as the plan scatters a pending sum an op cannot
    take (`autopar.cost.intra.IntraCost`, ``scatter_partials``); a sum no such dim divides is left to DTensor."""
    from torch.distributed.tensor import Partial, Shard

    placements = list(x.placements)
    if not any(isinstance(p, Partial) and p.reduce_op in _SCATTERED for p in placements):
        return x
    mesh, rank = x.device_mesh, x.ndim
    reduced %= rank
    order = sorted((d for d in range(rank) if d != reduced), key=lambda d: d != rank - 2)
    for axis, p in enumerate(placements):
        if not (isinstance(p, Partial) and p.reduce_op in _SCATTERED):
            continue
        dim = _dividing_dim(x.shape, placements, mesh, axis, order)
        if dim is not None:
            placements[axis] = Shard(dim)
    return x if placements == list(x.placements) else x.redistribute(mesh, placements)


def _dividing_dim(shape: Any, placements: list, mesh: Any, axis: int, order: Any) -> int | None:  # noqa: ANN401
    """The first dim of ``order`` that mesh ``axis`` can split further, beside the axes ``placements`` already
    split it over, evenly; None if none can."""
    from torch.distributed.tensor import Shard

    for dim in order:
        ways = math.prod(mesh.size(a) for a, q in enumerate(placements) if isinstance(q, Shard) and q.dim == dim)
        if shape[dim] % (ways * mesh.size(axis)) == 0:
            return dim
    return None


_MADE = itertools.count()  # the order DTensors are made in: `_AsPlanned` and the conversion hooks number them


def _stamped(x: Any) -> Any:  # noqa: ANN401
    """``x``, a DTensor numbered as the latest made (anything else as it is)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x._autopar_made = next(_MADE)
    return x


def _made(x: Any) -> int:  # noqa: ANN401
    """When ``x`` was made (`_stamped`; -1: by nothing that numbers)."""
    return getattr(x, "_autopar_made", -1)


def _views_copy_where_needed() -> None:
    """Let ``view`` copy where a DTensor's own shard cannot be viewed (once per process).

    DTensor decides that a ``reshape`` is a view from the whole tensor's strides; a value it has redistributed
    holds a contiguous shard under the strides the value had before (a transposed attention output gathered over
    heads, say), and the view then fails on the shard although one process would have copied. There the view is
    made of a contiguous copy of the shard: the same values, not an alias (model code writing in place into a view
    to change its source would not see the change; one process's ``reshape`` gives no such guarantee either)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    view = torch.ops.aten.view.default
    if view in handlers:
        return

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        del handlers[view]  # the default dispatch, this once
        try:
            try:
                return op_call(*args, **kwargs)
            except (RuntimeError, ValueError) as exc:
                text = str(exc)
                if "view size is not compatible" not in text and "Cannot view a tensor" not in text:
                    raise
                x = args[0]  # DTensor thinks it contiguous already: the copy is of its shard
                shard = DTensor.from_local(x.to_local().contiguous(), x.device_mesh, x.placements, run_check=False,
                                           shape=x.shape, stride=x.stride())
                return op_call(shard, *args[1:], **kwargs)
        finally:
            handlers[view] = handler

    handlers[view] = handler


class IntraParallelModel(ParallelModel):
    """A model laid out by an intra-op plan: DTensor parameters, inputs entering replicated, hooks converting the
    planned modules' inputs, and the gradients' pending sums reduced per mesh axis after the last micro-batch."""

    mesh: Any = None
    loss_divisor: int = 1  # ranks whose local losses add up to one copy of the loss (`average_loss`)
    converted: dict | None = None  # the input hooks' conversions of the running forward (`_hook_inputs`)
    shards: Any = None  # `_ZeroShards` under ZeRO 1-3: the slices of the weights this rank owns

    def forward_backward(self, batch: Mapping[str, torch.Tensor] | LocalBatch) -> torch.Tensor:
        """Forward and backward over the plan's micro-batches of the global ``batch`` (every rank reads all of
        each micro-batch, replicated; the plan's layouts split it), each loss scaled by 1 / micro-batches, then
        the gradient sums (`finish_backward`). Returns this rank's share of the mean loss (`average_loss` adds
        the shares up)."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.experimental import implicit_replication

        plan = self.plan
        assert plan is not None and self.mesh is not None
        if isinstance(batch, LocalBatch):
            micro = batch.micro_batches
        else:
            micro = split_batch(batch, micro_batch_size=plan.micro_batch_size, micro_batches=plan.micro_batches,
                                dp=1, dp_rank=0).micro_batches
        whole = [Replicate()] * self.mesh.ndim
        losses = []
        m = len(micro)
        gathering = contextlib.nullcontext()
        if self.zero in (2, 3):
            self.shards.hook()
        if self.zero == 3:
            self.shards.zero3.start(self.module)
            gathering = self.shards.zero3
        for inputs in micro:
            placed = {k: DTensor.from_local(v, self.mesh, whole, run_check=False) if isinstance(v, torch.Tensor) else v
                      for k, v in inputs.items()}
            # a tensor the model makes in its forward (positions from arange, a mask) is read as replicated
            if self.converted is not None:
                self.converted.clear()
            with running(scatter=plan.kind != "megatron"), gathering:
                loss = loss_of(self.module(**placed)) / m
            if self.converted is not None:
                self.converted.clear()  # what it holds is this forward's: let it go with the graph
            if isinstance(loss, DTensor):
                self.loss_divisor = _copies(loss.placements, self.mesh.shape)
                # the whole loss is the sum (or mean) of the ranks' shares; its gradient on each is that of the
                # whole loss, replicated
                local = loss.to_local(grad_placements=_share_gradient(loss.placements))
            else:
                self.loss_divisor, local = self.mesh.size(), loss
            with implicit_replication():
                local.backward()
            losses.append(local.detach())
        self.finish_backward()
        return torch.stack(losses).sum()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        if self.shards is None:
            return super().full_gradients()
        return self._whole(self.shards.gradients().items())

    def _held_gradients(self) -> list[tuple[torch.Tensor, int]]:
        """`ParallelModel._held_gradients` on the plan's mesh (every rank): a DTensor gradient's own shard, held
        alike on the axes its layout replicates it on; a weight ZeRO keeps in slices, this rank's slice of its
        gradient (`_ZeroShards.masters`, what the optimizer steps), held alike on the axes its weight is whole on
        but not sliced over."""
        from autopar.runtime.apply import _refuse_pending

        sizes, shards, held = tuple(self.mesh.shape), self.shards, []
        for name, param in self.module.named_parameters():
            owned = shards.axes.get(id(param)) if shards is not None else None
            if owned:
                grad = shards.masters[id(param)].grad
                if grad is not None:
                    held.append((grad, math.prod(size for a, (pl, size) in enumerate(zip(param.placements, sizes))
                                                 if pl.is_replicate() and a not in owned)))
                continue
            grad = param.grad
            if grad is None:
                continue
            if not hasattr(grad, "placements"):
                held.append((grad, math.prod(sizes)))
                continue
            _refuse_pending(name, grad)
            held.append((grad._local_tensor, math.prod(size for pl, size in zip(grad.placements, sizes)
                                                       if pl.is_replicate())))
        return held

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if self.shards is None or self.shards.zero < 3:
            return super().full_parameters()
        return self._whole(self.shards.weights().items())

    def average_loss(self, local: torch.Tensor) -> float:
        import torch.distributed as dist

        if self.plan is None or not dist.is_initialized():
            return float(local)
        total = local.detach().to(dtype=torch.float64).reshape(1)
        if dist.get_backend() == "nccl":
            total = total.cuda()
        dist.all_reduce(total)
        return float(total) / self.loss_divisor

    def finish_backward(self) -> None:
        """The gradients' pending sums over each mesh axis in one all-reduce per axis (the plan's gradient
        synchronisation), then each gradient put in its parameter's layout."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if self.shards is not None:  # reduce-scattered into this rank's slices (ZeRO 2: as the backward went)
            if self.zero == 1:
                self.shards.scatter()
            return
        named = [(name, p) for name, p in self.module.named_parameters() if p.grad is not None]
        params = [p for _, p in named]
        for p in params:  # a gradient made whole where its weight is split (a lookup's rows) is cut first, for free
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor):
                cut = [q if isinstance(g, Replicate) and q.is_shard() else g
                       for g, q in zip(p.grad.placements, p.placements)]
                if cut != list(p.grad.placements):
                    p.grad = p.grad.redistribute(p.device_mesh, cut)
        for axis in range(self.mesh.ndim):
            pending = [p for p in params
                       if isinstance(p.grad, DTensor) and isinstance(p.grad.placements[axis], Partial)]
            if not pending:
                continue
            for name, p in named:
                if isinstance(p.grad, DTensor):
                    _check_summed(name, p.grad, axis, self.mesh)
            flat = torch.cat([p.grad.to_local().reshape(-1) for p in pending])
            dist.all_reduce(flat, group=self.mesh.get_group(axis))
            offset = 0
            for p in pending:
                grad = p.grad
                local = flat[offset : offset + grad.to_local().numel()].view(grad.to_local().shape)
                offset += local.numel()
                placements = list(grad.placements)
                placements[axis] = Replicate()
                p.grad = DTensor.from_local(local, grad.device_mesh, placements, run_check=False,
                                            shape=grad.shape, stride=grad.stride())
        for p in params:
            if isinstance(p, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _copies(placements: Any, sizes: tuple[int, ...]) -> int:
    """How many ranks hold one copy of a value in ``placements``: the sizes of the axes it is replicated on (or
    averaged over); a pending sum's shares add up to one copy."""
    from torch.distributed.tensor import Partial

    n = 1
    for p, size in zip(placements, sizes):
        if not (isinstance(p, Partial) and p.reduce_op == "sum"):
            n *= size
    return n


def _share_gradient(placements: Any) -> list:
    """The layout of a scalar loss's gradient as each rank's share receives it: whole (Replicate) for a replicated
    loss or a pending sum, a pending mean's 1 / n (``Partial("avg")`` read back as its share)."""
    from torch.distributed.tensor import Partial, Replicate

    return [Partial("avg") if isinstance(p, Partial) and p.reduce_op == "avg" else Replicate() for p in placements]


def parallelize_intra(model: nn.Module, plan: Plan, *, mesh: Any = None) -> IntraParallelModel:
    """Lay ``model`` out as the intra-op ``plan`` says, in place (see the module's docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    attention_rules()
    _views_copy_where_needed()
    shape, names = tuple(plan.mesh.shape), tuple(plan.mesh.axes)
    if dist.get_world_size() != math.prod(shape):
        raise ValueError(f"the plan needs {math.prod(shape)} ranks, this process group has {dist.get_world_size()}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if mesh is None:
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    elif tuple(mesh.shape) != shape:
        raise ValueError(f"the plan needs a mesh of shape {shape}, got {tuple(mesh.shape)}")
    _place_state(model, plan, mesh)
    _reduce_masked_lookups(model)  # first: a masked lookup's sum is made before its output is converted
    converted = _hook_inputs(model, plan, mesh)
    _reads(model, plan)
    _layers(model, plan, converted)
    axes = {mesh.get_group(a).group_name: name for a, name in enumerate(names)}
    spanning = [name for name, size in zip(names, shape) if size == dist.get_world_size()]
    axes[dist.group.WORLD.group_name] = spanning[0] if spanning else "world"
    if plan.zero in (1, 2, 3):
        shards = _ZeroShards(model, mesh, plan.zero)
        if plan.zero == 3:  # set up at the first forward, on the weights the module holds then
            shards.zero3 = _Zero3Hooks(shards, plan)
        parallel = IntraParallelModel(model, plan.zero, lambda cls, **kw: _ShardedOptimizer(shards, cls, **kw),
                                      axes=axes)
        parallel.shards = shards
    else:
        parallel = IntraParallelModel(model, plan.zero, lambda cls, **kw: cls(model.parameters(), **kw), axes=axes)
    parallel.mesh, parallel.plan, parallel.rank = mesh, plan, dist.get_rank()
    parallel.converted = converted
    return parallel


def _layers(model: nn.Module, plan: Plan, cache: dict[int, tuple]) -> None:
    """Each layer of the plan's blocks runs its forward in a scope of the conversion cache (`_scoped`), and each
    layer the plan recomputes (``Plan.recompute``) runs as one checkpoint: only its inputs are kept, and its
    forward runs again in the backward, with every conversion in it, as the cost model prices it (`replay`). The
    replay runs the whole forward (checkpoint's early stop is off: a replay that stopped at the last tensor the
    backward needs would skip the conversions after it) and runs it as planned (`_AsPlanned`, which the backward
    is not inside)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    modules = dict(model.named_modules())
    scatter = plan.kind != "megatron"
    for name in plan.recompute:
        if name not in modules:
            raise ValueError(f"the plan recomputes {name!r}, which the model does not have")
    for name in dict.fromkeys(b.layer for b in plan.blocks):
        layer = modules.get(name) if name else None
        if layer is None:
            continue
        scoped = _scoped(layer.forward, cache)
        if name not in plan.recompute:
            layer.forward = scoped
            continue

        def replayed(*args: Any, _scoped: Any = scoped, **kwargs: Any) -> Any:  # noqa: ANN401
            with _as_planned(scatter=scatter):
                return _scoped(*args, **kwargs)

        def checkpointed(*args: Any, _replayed: Any = replayed, **kwargs: Any) -> Any:  # noqa: ANN401
            # (the setting, not the argument: a setting made around the step would override the argument)
            with set_checkpoint_early_stop(False):
                return checkpoint(_replayed, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def _scoped(forward: Any, cache: dict[int, tuple]) -> Any:  # noqa: ANN401
    """``forward``, the conversions it caches (`_hook_inputs`: a value several of the layer's modules read in one
    layout, converted once) dropped when it returns, or raises: a value a layer converted is read by that layer
    alone, and holding it to the end of the model's forward would keep what a recomputed layer lets go."""

    def run(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        before = set(cache)
        try:
            return forward(*args, **kwargs)
        finally:
            for key in set(cache) - before:
                del cache[key]

    return run


def _as_planned(*, scatter: bool) -> Any:  # noqa: ANN401
    """`running`'s context, entering only what is not already active: the forward is inside it already, the
    backward's replay of a recomputed layer is not (and leaving a second `implicit_replication` would switch it off
    for the rest of the backward)."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.overrides import _get_current_function_mode_stack

    stack = contextlib.ExitStack()
    if not any(isinstance(mode, _AsPlanned) for mode in _get_current_function_mode_stack()):
        stack.enter_context(_AsPlanned(scatter=scatter))
    if not DTensor._op_dispatcher._allow_implicit_replication:
        stack.enter_context(implicit_replication())
    return stack


# Optimizers whose update of an element reads only that element's weight, gradient and state: updating each rank's
# slice of a flattened weight is then the same as updating the whole weight.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD")


class _ZeroShards:
    """ZeRO 1-3 for an intra-op plan's DTensor weights. A weight whose gradient DTensor leaves a pending sum on
    some mesh axes (the plan holds it whole there while splitting the work) is owned slice by slice over those
    axes: its local gradient, flattened and padded to divide evenly, is reduce-scattered over each such axis in
    turn (one flat buffer per axis, every weight reduced over it in it, as `autopar.cost.intra.sync_seconds`
    prices it), leaving this rank the sum of its slice. The optimizer steps those slices (`masters`), and the
    weights are all-gathered back axis by axis the other way. A weight whose gradient is not pending anywhere is
    stepped in place, on its own shard. Which axes a weight is owned over is learnt from its first gradient: a
    weight can be held whole on an axis whose work is not split either (computed alike on every rank there), and
    then its gradient is whole there too; under ZeRO 3 the plan names them (`own_planned`), and the weights it names
    are not gathered back after the step but where they are read."""

    def __init__(self, module: nn.Module, mesh: Any, zero: int = 1) -> None:
        self.module, self.mesh, self.zero = module, mesh, zero
        self.masters: dict[int, torch.Tensor] = {}  # id(parameter) -> the tensor the optimizer steps
        self.axes: dict[int, tuple[int, ...]] = {}  # id(parameter) -> the axes its slice is owned over
        self.params: dict[int, nn.Parameter] = {}
        self.names: dict[int, str] = {}
        self.hooked: set[int] = set()
        # ZeRO 3: the weights whose storage holds them whole now, and per weight the modules that read it and how
        # many of them have still to run in this forward (`_Zero3Hooks`)
        self.gathered: set[int] = set()
        self.users: dict[int, int] = {}
        self.remaining: dict[int, int] = {}
        self.zero3: _Zero3Hooks | None = None

    def _ways(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.mesh.size(a) for a in axes)

    def hook(self) -> None:
        """ZeRO 2: every weight's gradient reduce-scattered as soon as the backward has made it (its whole copy let
        go). Hooked on the parameters the module holds now (a caller may have replaced them since it was laid
        out), once each."""
        for name, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in self.hooked:
                p.register_post_accumulate_grad_hook(_scatter_one(self, name, free=self.zero == 3))
                self.hooked.add(id(p))

    def _own(self, name: str, p: nn.Parameter, axes: tuple[int, ...]) -> None:
        """Take ``p`` on, owned over ``axes`` (learnt from its gradient); a later gradient pending elsewhere is
        refused."""
        known = self.axes.get(id(p))
        if known is not None:
            if known != axes and id(p) in self.users:  # ZeRO 3: the axes the plan named
                raise NotImplementedError(
                    f"ZeRO 3 of an intra-op plan: the plan keeps {name} in slices over mesh axes "
                    f"{[_axis_name(self.mesh, a) for a in known]} (its reduced axes), but its gradient is pending on "
                    f"{[_axis_name(self.mesh, a) for a in axes]}: the plan's layouts do not carry through the model as "
                    "priced")
            if known != axes:
                raise NotImplementedError(
                    f"ZeRO of an intra-op plan: the gradient of {name} is pending on mesh axes "
                    f"{[_axis_name(self.mesh, a) for a in axes]}, and was on {[_axis_name(self.mesh, a) for a in known]} "
                    "before; its slices must be owned over the same axes every micro-batch")
            return
        self.params[id(p)], self.axes[id(p)], self.names[id(p)] = p, axes, name
        local = p._local_tensor.detach()
        if axes:  # this rank's slice of the weight: what it steps
            ways = self._ways(axes)
            whole = local.is_contiguous() and local.numel() % ways == 0
            flat = local.reshape(-1) if whole else _padded(local.reshape(-1), ways)
            for a in axes:
                flat = flat.view(self.mesh.size(a), -1)[self.mesh.get_local_rank(a)]
            # a view of the weight's own storage where the slices divide it evenly (no copy: an fp32 weight has no
            # master copy to hold), else a copy of the padded slice; under ZeRO 3 always a copy, since the weight's
            # storage is let go between its uses
            self.masters[id(p)] = flat if whole and self.zero < 3 else flat.clone()
        else:  # its own shard, stepped in place
            self.masters[id(p)] = local

    def own_planned(self, plan: Plan) -> None:
        """ZeRO 3: every weight the plan names ``reduced`` axes for owned in slices over them from the start (its
        first gradient then has to be pending exactly there, `_own`), its whole copy let go until it is read
        (`_Zero3Hooks`)."""
        reduced = {p.name: tuple(p.reduced) for entry in plan.modules for p in entry.params if p.reduced}
        users: dict[int, int] = {}
        for _, module in self.module.named_modules(remove_duplicate=False):
            for p in module._parameters.values():
                if p is not None:
                    users[id(p)] = users.get(id(p), 0) + 1
        for name, p in self.module.named_parameters():
            axes = reduced.get(name)
            if not axes or not p.requires_grad:
                continue
            local = p._local_tensor
            compact = local.is_contiguous() and local.storage_offset() == 0 and \
                local.untyped_storage().nbytes() == local.numel() * local.element_size()
            if not compact:  # storage of its own (a shard cut from the whole weight can be a view of it)
                with torch.no_grad():
                    fresh = local.detach().clone(memory_format=torch.contiguous_format)
                    local.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
            self._own(name, p, axes)
            self.users[id(p)] = self.remaining[id(p)] = users.get(id(p), 1)
            self.gathered.add(id(p))
            self.free(id(p))

    def free(self, k: int) -> None:
        """ZeRO 3: let go of weight ``k``'s whole copy (its storage emptied: what autograd saved of it is gathered
        again before the backward reads it)."""
        if k not in self.gathered:
            return
        self.gathered.discard(k)
        self.params[k]._local_tensor.untyped_storage().resize_(0)

    def materialize(self, k: int) -> None:
        """ZeRO 3: weight ``k`` whole again in its own storage, gathered from the slices (one collective per axis,
        for this weight alone, as the cost model prices it)."""
        if k in self.gathered:
            return
        local = self.params[k]._local_tensor
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(local):
            local.untyped_storage().resize_(local.numel() * local.element_size())
            self.gather({k: self.masters[k].detach()}, into={k: local})
        self.gathered.add(k)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight whole in its layout (a DTensor), by name; under ZeRO 3 those kept in slices gathered."""
        owned = {k: self.masters[k].detach() for k in self.masters if self.axes[k] and k not in self.gathered}
        return self._laid_out(owned, {name: p.detach() for name, p in self.module.named_parameters()})

    def _laid_out(self, slices: Mapping[int, torch.Tensor], others: Mapping[str, torch.Tensor],
                  ) -> dict[str, torch.Tensor]:
        """``slices`` (this rank's, by weight) gathered into DTensors in their weights' layouts, by name, and
        ``others`` (by name) where no slice gave one."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, local in self.gather(slices).items():
            p = self.params[k]
            out[self.names[k]] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
        for name, tensor in others.items():
            out.setdefault(name, tensor)
        return out

    def scatter(self, params: list[tuple[str, nn.Parameter]] | None = None) -> None:
        """Reduce-scatter the pending gradients of ``params`` (default: every parameter) into the masters'
        gradients (added to what they hold), each axis in one flat buffer; the weights' own gradients are then let
        go. A gradient pending nowhere is put in its weight's layout and left where it is."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Partial

        current: dict[int, torch.Tensor] = {}
        for name, p in self.module.named_parameters() if params is None else params:
            grad = p.grad
            if grad is None:
                continue
            if not isinstance(grad, DTensor):
                raise NotImplementedError(f"ZeRO of an intra-op plan: the gradient of {name} is not laid out on the "
                                          "mesh")
            sharded = [a for a, pl in enumerate(grad.placements)
                       if isinstance(pl, Partial) and not p.placements[a].is_replicate()]
            if sharded:  # a pending sum where its weight is split: summed onto the weight's split (DTensor's way)
                grad = grad.redistribute(p.device_mesh, [p.placements[a] if a in sharded else pl
                                                         for a, pl in enumerate(grad.placements)])
            axes = tuple(a for a, pl in enumerate(grad.placements) if isinstance(pl, Partial))
            for a in axes:
                _check_summed(name, grad, a, self.mesh)
            self._own(name, p, axes)
            if not axes:
                p.grad = grad if tuple(grad.placements) == tuple(p.placements) else grad.redistribute(
                    p.device_mesh, p.placements)
                continue
            want = [pl if isinstance(pl, Partial) else mine for pl, mine in zip(grad.placements, p.placements)]
            if want != list(grad.placements):  # on the axes it is not summed over: its weight's layout
                grad = grad.redistribute(p.device_mesh, want)
            current[id(p)] = _padded(grad.to_local().reshape(-1), self._ways(axes))
            p.grad = None
        for a in range(self.mesh.ndim):
            keys = [k for k in current if a in self.axes[k]]
            if not keys:
                continue
            n = self.mesh.size(a)
            flat = torch.cat([current[k].view(n, -1) for k in keys], dim=1).reshape(-1)
            out = flat.new_empty(flat.numel() // n)
            # (torch 2.13 names it reduce_scatter_single; older releases reduce_scatter_tensor)
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, flat, group=self.mesh.get_group(a))
            for k, piece in zip(keys, out.split([current[k].numel() // n for k in keys])):
                current[k] = piece
        for k, piece in current.items():
            master = self.masters[k]
            if master.grad is None:
                master.grad = piece.clone()
            else:
                master.grad.add_(piece)

    def gather(self, slices: Mapping[int, torch.Tensor], *, into: Mapping[int, torch.Tensor] | None = None,
               ) -> dict[int, torch.Tensor]:
        """Each weight's own shard, whole, from this rank's ``slices`` of weights owned over some axes:
        all-gathered axis by axis the other way round, each axis in one flat buffer. With ``into`` (a tensor per
        weight, of its shard's shape), the last axis's pieces are copied there rather than into new tensors."""
        import torch.distributed as dist

        current = {k: v.reshape(-1) for k, v in slices.items()}
        for a in reversed(range(self.mesh.ndim)):
            keys = [k for k in current if a in self.axes[k]]
            if not keys:
                continue
            n = self.mesh.size(a)
            flat = torch.cat([current[k] for k in keys])
            out = flat.new_empty(flat.numel() * n)
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, flat, group=self.mesh.get_group(a))
            rows = out.view(n, -1)
            offset = 0
            for k in keys:
                size = current[k].numel()
                if into is not None and k in into and a == min(self.axes[k]):
                    # its last axis: rank r's piece is the r-th run of the whole (padded) flattened shard, copied
                    # into place
                    target = into[k].reshape(-1)
                    for r in range(n):
                        stop = min((r + 1) * size, target.numel())
                        if stop > r * size:
                            target[r * size : stop].copy_(rows[r, offset : offset + stop - r * size])
                    current[k] = into[k]
                else:
                    current[k] = rows[:, offset : offset + size].reshape(-1)
                offset += size
        out = {}
        for k, flat in current.items():
            local = self.params[k]._local_tensor
            out[k] = flat.reshape(-1)[: local.numel()].view(local.shape)
        return out

    def write_back(self) -> None:
        """Every weight owned in slices made whole again from its stepped slice, gathered into the weight's own
        storage (the gather's buffers are the only copies made). Under ZeRO 3 only those the plan did not name
        (`own_planned`: the others are gathered where they are read), which are kept whole as under ZeRO 2."""
        owned = {k: m.detach() for k, m in self.masters.items() if self.axes[k] and k not in self.users}
        with torch.no_grad():
            into = {k: self.params[k]._local_tensor for k in owned if self.params[k]._local_tensor.is_contiguous()}
            for k, whole in self.gather(owned, into=into).items():
                if k not in into:
                    self.params[k]._local_tensor.copy_(whole)

    def gradients(self) -> dict[str, torch.Tensor]:
        """Every gradient, each in its weight's layout (a DTensor), by parameter name: those owned in slices
        gathered (`gather`), the others as they are."""
        owned = {k: m.grad for k, m in self.masters.items() if self.axes[k] and m.grad is not None}
        return self._laid_out(owned, {name: p.grad for name, p in self.module.named_parameters()
                                      if p.grad is not None})

    def zero_grad(self) -> None:
        for master in self.masters.values():
            master.grad = None
        for p in self.module.parameters():
            p.grad = None


def _scatter_one(shards: _ZeroShards, name: str, *, free: bool = False) -> Any:  # noqa: ANN401
    def hook(param: nn.Parameter) -> None:
        shards.scatter([(name, param)])
        if free:  # ZeRO 3: its backward is done with the whole weight
            shards.free(id(param))
    return hook


# what reads a tensor's description, not its elements (``__get__``: a property such as ``dtype`` or ``requires_grad``)
# or sets up autograd around it (a hook on its gradient)
_METADATA = frozenset({"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                       "element_size", "storage_offset", "untyped_storage", "data_ptr", "__len__", "get_device",
                       "is_floating_point", "is_complex", "register_hook", "register_post_accumulate_grad_hook",
                       "retain_grad", "requires_grad_"})


class _Zero3Hooks(torch.overrides.TorchFunctionMode):
    """ZeRO 3 around every module that holds weights kept in slices (`_ZeroShards.own_planned`): before its forward
    each is gathered whole (unless it already is); after it, a weight whose last holder in this forward has run is
    let go, and a hook on the module's outputs gathers it again as the backward reaches them, before the
    module's own backward reads what autograd saved of it. Each weight is gathered twice per micro-batch and its
    gradient reduce-scattered once (`_scatter_one`, which then lets it go), as `autopar.cost.intra.sync_seconds`
    prices ZeRO 3.

    A module of a recomputed layer lets its weights go after its first forward and sets no such hook: its replay
    in the backward gathers them (and keeps them until their gradients are made). A weight several modules hold
    (a tied embedding and head) stays whole from its first holder's forward to its last's. A weight read where
    none of its holders runs (a position table read as ``model.pos.weight[:n]`` in the model's own forward) is
    gathered as it is read (this mode, entered around the forward) and kept until the model's forward returns,
    then gathered again as the backward starts."""

    def __init__(self, shards: _ZeroShards, plan: Plan) -> None:
        super().__init__()
        self.shards, self.plan = shards, plan
        self.started = False
        self.adopted: list[int] = []

    def start(self, model: nn.Module) -> None:
        """Once, at the first forward: the weights the model holds now owned in slices, and the hooks set."""
        if self.started:
            return
        self.started = True
        self.shards.own_planned(self.plan)
        modules = dict(model.named_modules())
        recomputed = {id(m) for name in self.plan.recompute if name in modules for m in modules[name].modules()}
        for module in model.modules():
            owned = [id(p) for p in module._parameters.values() if p is not None and id(p) in self.shards.users]
            if owned:
                module.register_forward_pre_hook(self._before(owned))
                module.register_forward_hook(self._after(owned, again=id(module) not in recomputed), prepend=True)
        model.register_forward_hook(self._after_model)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _METADATA:  # reads no element: the weight may stay let go
            return func(*args, **kwargs)
        shards = self.shards
        for value in itertools.chain(args, kwargs.values()):
            for t in value if isinstance(value, (list, tuple)) else (value,):
                k = id(t)
                if k in shards.users and k not in shards.gathered and t is shards.params.get(k):
                    shards.materialize(k)
                    self.adopted.append(k)
        return func(*args, **kwargs)

    def _after_model(self, _module: nn.Module, _args: tuple, output: Any) -> None:  # noqa: ANN401
        adopted, self.adopted = list(dict.fromkeys(self.adopted)), []
        for k in adopted:
            self.shards.free(k)
        if adopted:
            self._gather_again(output, adopted)

    def _before(self, owned: list[int]) -> Any:  # noqa: ANN401
        def hook(_module: nn.Module, _args: tuple) -> None:
            for k in owned:
                self.shards.materialize(k)
        return hook

    def _after(self, owned: list[int], *, again: bool) -> Any:  # noqa: ANN401
        """The forward hook of a module holding ``owned``; ``again``: set the backward's gathering (not for a
        module of a recomputed layer, whose replay gathers)."""
        shards = self.shards

        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:  # noqa: ANN401
            if torch._C._current_graph_task_id() != -1:
                return  # a recomputed layer's replay, in the backward: kept until its gradients are made
            for k in owned:
                shards.remaining[k] -= 1
                if shards.remaining[k] <= 0:  # its last holder in this forward
                    shards.remaining[k] = shards.users[k]
                    shards.free(k)
            if again:
                self._gather_again(output, owned)
        return hook

    def _gather_again(self, output: Any, keys: list[int]) -> None:  # noqa: ANN401
        """Gather the weights ``keys`` once the backward reaches any tensor of ``output`` that needs a gradient."""
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            shards = self.shards
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda _grads: [shards.materialize(k) for k in keys], mode="any")


def _tensors(value: Any) -> list[torch.Tensor]:  # noqa: ANN401
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them, as models return)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "to_tuple"):  # a Hugging Face ModelOutput
        return _tensors(value.to_tuple())
    return []


def _padded(flat: torch.Tensor, ways: int) -> torch.Tensor:
    extra = -flat.numel() % ways
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def _check_summed(name: str, grad: Any, axis: int, mesh: Any) -> None:  # noqa: ANN401
    """Refuse a gradient left pending on mesh ``axis`` as anything but a sum (the runtime reduces sums only)."""
    from torch.distributed.tensor import Partial

    placement = grad.placements[axis]
    if isinstance(placement, Partial) and placement.reduce_op != "sum":
        raise NotImplementedError(f"the gradient of {name} is a pending {placement} on mesh axis "
                                  f"{_axis_name(mesh, axis)}; only sums are reduced")


def _axis_name(mesh: Any, axis: int) -> str:
    return mesh.mesh_dim_names[axis] if mesh.mesh_dim_names else str(axis)


class _ShardedOptimizer(torch.optim.Optimizer):
    """The optimizer of an intra-op plan under ZeRO 1-3: the inner optimizer (an elementwise one, `ELEMENTWISE`)
    steps this rank's slices (`_ZeroShards.masters`); then the weights are gathered whole.

    The inner optimizer is made at the first step, once the first gradients have said which weights are owned in
    slices. Until then ``param_groups`` is one group of the optimizer's settings (made by building the optimizer
    once over a stand-in tensor, which also checks them), so that a learning-rate scheduler can be attached at once:
    the inner optimizer takes that group's settings, and whatever a scheduler wrote there, when it is made. A
    state loaded before the first step (``load_state_dict``) is loaded into it then. ``zero_grad`` lets go of
    every gradient."""

    def __init__(self, shards: _ZeroShards, cls: type, **kwargs: Any) -> None:  # noqa: ANN401
        # (Optimizer.__init__ is not called: it needs the parameters, which the first gradients name)
        if cls.__name__ not in ELEMENTWISE:
            raise NotImplementedError(
                f"ZeRO 1-3 of an intra-op plan updates each rank's slice of the flattened weights; {cls.__name__} is "
                f"not known to update elementwise (known: {', '.join(ELEMENTWISE)}): plan with ZeRO 0")
        self.shards, self.cls, self.kwargs = shards, cls, kwargs
        stand_in = cls([torch.zeros(1, requires_grad=True)], **kwargs)
        self.defaults = dict(stand_in.defaults)
        self.inner: torch.optim.Optimizer | None = None
        self._groups = [{**stand_in.param_groups[0], "params": []}]
        self._pending_state: dict | None = None

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.inner.param_groups if self.inner is not None else self._groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # noqa: ANN401
        return self.inner.state if self.inner is not None else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cls.__name__}, each rank stepping its slices)"

    def state_dict(self) -> dict:
        return {} if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.inner is None:
            self._pending_state = state_dict
        else:
            self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:  # noqa: ARG002
        raise NotImplementedError("the optimizer of a ZeRO 1-3 intra-op plan steps the slices the plan gives each "
                                  "rank; it takes no other parameters")

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - gradients are always let go
        self.shards.zero_grad()

    def step(self, closure: Any = None) -> Any:  # noqa: ANN401
        shards = self.shards
        for k, master in shards.masters.items():
            if not shards.axes[k]:  # its gradient in its weight's layout: this rank's shard of it
                grad = shards.params[k].grad
                master.grad = None if grad is None else grad.to_local()
        if self.inner is None:
            group = self._groups[0]
            self.inner = self.cls(list(shards.masters.values()), **self.kwargs)
            self.inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
            if self._pending_state is not None:
                self.inner.load_state_dict(self._pending_state)
                self._pending_state = None
        elif len(self.inner.param_groups[0]["params"]) != len(shards.masters):
            raise NotImplementedError("ZeRO of an intra-op plan: a weight got its first gradient after the first "
                                      "step; every weight the optimizer steps must have one at the first")
        loss = self.inner.step(closure)
        shards.write_back()
        return loss


# weights being read in another layout than their holder keeps them in, while the module reading them runs:
# id(weight) -> [weight, layout to read it in, the axes its holder sums its gradient over, the converted weight]
_READING: dict[int, list] = {}


def _read(weight: Any) -> Any:  # noqa: ANN401
    """``weight`` in the layout the running module reads it in (`_reads`), converted once per call."""
    entry = _READING[id(weight)]
    if entry[3] is None:
        entry[3] = _Read.apply(weight, entry[1], entry[2])
    return entry[3]


class _Read(torch.autograd.Function):
    """A weight converted to the layout a module reads it in; its gradient converted back to the weight's own
    layout, the sums over the axes its holder reduces its gradient over left pending for that reduction (as the
    plan prices a tied weight's gradient), any other sum made here."""

    @staticmethod
    def forward(ctx: Any, weight: Any, layout: tuple, reduced: tuple[int, ...]) -> Any:  # noqa: ANN401
        from torch.distributed.tensor import Partial, Replicate

        ctx.mesh = weight.device_mesh
        ctx.back = tuple(Partial() if a in reduced and isinstance(p, Replicate) else p
                         for a, p in enumerate(weight.placements))
        return weight.redistribute(ctx.mesh, layout)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:  # noqa: ANN401
        from torch.distributed.tensor import Partial, Replicate

        back = tuple(b if isinstance(b, Partial) and isinstance(g, Partial) else
                     Replicate() if isinstance(b, Partial) else b for b, g in zip(ctx.back, grad.placements))
        return (grad.redistribute(ctx.mesh, back) if tuple(grad.placements) != back else grad), None, None


def _reads(model: nn.Module, plan: Plan) -> None:
    """For each module the plan has read a weight another module holds in another layout (`ModuleLayout.reads`),
    hooks that mark the weight to be converted (`_read`) while the module runs."""
    modules = dict(model.named_modules())
    weights = dict(model.named_parameters(remove_duplicate=False))
    reduced = {p.name: tuple(p.reduced) for entry in plan.modules for p in entry.params}
    for entry in plan.modules:
        for name, _ in entry.reads:
            if name not in weights:
                raise ValueError(f"the plan has module {entry.fqn!r} read weight {name!r}, which the model does "
                                 "not have: was the plan made for another model?")
        if not entry.reads:
            continue
        module = modules.get(entry.fqn)
        if module is None:
            raise ValueError(f"the plan has module {entry.fqn!r} read weights, but the model has no such module: "
                             "was the plan made for another model?")
        found = [(weights[name], tuple(layout), reduced.get(name, ())) for name, layout in entry.reads]

        def start(_module: nn.Module, _args: tuple, _found: list = found) -> None:
            for weight, layout, axes in _found:
                _READING[id(weight)] = [weight, layout, axes, None]

        def stop(_module: nn.Module, _args: tuple, _output: Any, _found: list = found) -> None:  # noqa: ANN401
            for weight, *_ in _found:
                _READING.pop(id(weight), None)

        module.register_forward_pre_hook(start)
        module.register_forward_hook(stop, always_call=True)


def _place_state(model: nn.Module, plan: Plan, mesh: Any) -> None:
    """Every parameter in its planned layout (replicated where the plan names none), buffers replicated; every rank
    cuts its own shard of the whole tensor it holds, so nothing is sent."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    layouts = {p.name: tuple(p.placements) for entry in plan.modules for p in entry.params}
    whole = (Replicate(),) * mesh.ndim
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in made:
                fqn = f"{prefix}.{name}" if prefix else name
                placed = distribute_tensor(param.detach(), mesh, layouts.get(fqn, whole), src_data_rank=None)
                made[id(param)] = nn.Parameter(placed, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not isinstance(buffer, DTensor):
                module._buffers[name] = DTensor.from_local(buffer, mesh, whole, run_check=False)


def _hook_inputs(model: nn.Module, plan: Plan, mesh: Any) -> dict[int, tuple]:
    """A forward pre-hook per planned module that puts its activation input in the layout the plan gives the
    module's leading op, and a forward hook that puts its output in the layout the plan hands it on in
    (`ModuleLayout.output`). The leading op of a linear layer reads the input flattened to (tokens, features): a
    split of its tokens is a split of the input's first dim where that divides evenly, a split of its features one
    of the last dim. Where the plan's layout has no such counterpart on the input, the module is left to DTensor.

    Each conversion is also one of the gradient, as the plan prices it: the gradient that comes back through the
    converted value is put in the layout the value had (its pending sums reduced) before it reaches the op that
    made the value, also where the forward needed no conversion (`_Settle`), rather than left for DTensor to
    reduce wherever it is next read. A value several modules read in one layout (a norm's output before q, k and
    v) is converted once (the returned cache, emptied before each forward), as the plan prices it."""
    modules = dict(model.named_modules())
    cache: dict[int, tuple] = {}
    for entry in plan.modules:
        if entry.fqn in modules:
            _hook_module(modules[entry.fqn], entry.input, entry.output, mesh=mesh, cache=cache)
    return cache


def _hook_module(module: nn.Module, read: tuple | None, handed: tuple | None, *, mesh: Any,  # noqa: ANN401
                 cache: dict[int, tuple]) -> None:
    """`_hook_inputs` for one module: its input put in ``read``, its output in ``handed`` (None: left alone)."""
    if read is not None and isinstance(module, nn.Embedding):
        # the indices a lookup reads may arrive as another argument than its first (OPT's position table takes
        # the attention mask first and its positions by keyword): every index tensor it is given is converted
        module.register_forward_pre_hook(_indices_converter(tuple(read), mesh), with_kwargs=True)
    elif read is not None:
        flattened = isinstance(module, nn.Linear)
        module.register_forward_pre_hook(_converter(tuple(read), mesh, flattened=flattened, cache=cache))
    if handed is not None:
        module.register_forward_hook(_output_converter(tuple(handed), mesh))


def _reduce_masked_lookups(model: nn.Module) -> None:
    """A forward hook on every embedding: a lookup in a table split by rows leaves its output a masked pending sum
    (DTensor's ``MaskPartial``), which DTensor can sum (all-reduce) but cannot reduce-scatter into a split; the
    sum is made at once, so that whatever reads the output next may split it."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial

    def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        if isinstance(output, DTensor) and any(isinstance(p, MaskPartial) for p in output.placements):
            placements = [Replicate() if isinstance(p, MaskPartial) else p for p in output.placements]
            return output.redistribute(output.device_mesh, placements)
        return None

    for module in model.modules():
        if isinstance(module, nn.Embedding):
            if _rows_split_on_several_axes(module):
                module.forward = _split_lookup(module)
            module.register_forward_hook(hook)


def _rows_split_on_several_axes(module: nn.Embedding) -> bool:
    """Whether ``module`` is a plain lookup (``nn.Embedding`` itself, no padding row, norm limit or sparse
    gradient) whose table the plan splits by rows over more than one mesh axis: DTensor's masked lookup keeps one
    mask per value and fails on the second axis ("MaskBuffer has been materialized with conflicting data")."""
    from torch.distributed.tensor import DTensor, Shard

    weight = module.weight
    if type(module) is not nn.Embedding or not isinstance(weight, DTensor):
        return False
    if module.padding_idx is not None or module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return False
    return sum(isinstance(p, Shard) and p.dim == 0 for p in weight.placements) > 1


def _split_lookup(module: nn.Embedding) -> Any:  # noqa: ANN401
    """A lookup in a table split by rows over several mesh axes: each rank looks up the ids that fall in its own
    rows (zeros for the others) and the output is a pending sum over those axes, summed at once (an all-reduce per
    axis, as DTensor sums a lookup split over one). The gradient reaches each rank's rows through its own shard."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight = module.weight
    mesh = weight.device_mesh
    # this rank's rows (worked out here, on the real mesh: under a rehearsal's fake tensors it could not be)
    (rows, _), (start, _) = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)

    def forward(ids: Any) -> Any:  # noqa: ANN401
        weight = module.weight
        if not isinstance(ids, DTensor):
            ids = DTensor.from_local(ids, mesh, [Replicate()] * mesh.ndim, run_check=False)
        split = [isinstance(p, Shard) and p.dim == 0 for p in weight.placements]
        if any(s and not p.is_replicate() for s, p in zip(split, ids.placements)):
            raise NotImplementedError(f"the ids looked up in a table split by rows over mesh axes "
                                      f"{[_axis_name(mesh, a) for a, s in enumerate(split) if s]} are split there too")
        local = ids.to_local()
        outside = (local < start) | (local >= start + rows)
        found = torch.nn.functional.embedding((local - start).masked_fill(outside, 0), weight.to_local())
        found = found.masked_fill(outside.unsqueeze(-1), 0.0)
        pending = [Partial() if s else p for s, p in zip(split, ids.placements)]
        out = DTensor.from_local(found, mesh, pending, run_check=False)
        return out.redistribute(mesh, [Replicate() if s else p for s, p in zip(split, ids.placements)])

    return forward


def _converter(target: tuple, mesh: Any, *, flattened: bool, cache: dict[int, tuple]) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], DTensor):
            return None
        x = args[0]
        placements = _lift(target, x.shape, mesh.shape, flattened=flattened, shard=Shard)
        if placements is None:
            return None
        key = id(x)
        found = cache.get(key)
        if found is not None and found[0] is x and found[1] == placements:
            return (found[2], *args[1:])
        converted = _stamped(_convert(x, mesh, placements))
        cache[key] = (x, placements, converted)
        return (converted, *args[1:])

    return hook


def _indices_converter(target: tuple, mesh: Any) -> Any:  # noqa: ANN401
    """A forward pre-hook (with keywords) putting every integer tensor a lookup module is given in ``target``,
    where it has that layout's dims: a plain one (indices the model makes itself, from ``torch.ones``, say) is
    whole on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def convert(x: Any) -> Any:  # noqa: ANN401
        if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dtype == torch.bool or x.dim() == 0:
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
        placements = _lift(target, x.shape, mesh.shape, flattened=False, shard=Shard)
        if placements is None or tuple(x.placements) == placements:
            return x
        return _stamped(x.redistribute(mesh, placements))

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    return hook


def _output_converter(target: tuple, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Partial, Shard

    def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        if not isinstance(output, DTensor):
            return None
        placements = _lift(target, output.shape, mesh.shape, flattened=False, shard=Shard)
        if placements is None:
            return None
        if tuple(output.placements) == placements:
            # handed on as made; its gradient comes back in that layout too, sums pending over a split that a
            # reader broadcast (a position lookup added to every sample) reduced here, as the plan prices them (a
            # hook, not an op: the model may add to its output in place, as Falcon's MLP does)
            if output.requires_grad:
                output.register_hook(_settled_gradient(output))
            return None
        if any(isinstance(p, Partial) and not isinstance(q, Partial) for p, q in zip(placements, output.placements)):
            return None  # a pending sum is made by an op, not by a conversion: left to DTensor
        return _stamped(output.redistribute(mesh, placements))

    return hook


def _settled_gradient(x: Any) -> Any:  # noqa: ANN401
    """A gradient hook for ``x``: its gradient put in ``x``'s layout, pending sums reduced (as `_Settle`)."""
    from torch.distributed.tensor import Partial, Replicate

    mesh = x.device_mesh
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)

    def hook(grad: Any) -> Any:  # noqa: ANN401
        return grad.redistribute(mesh, placements) if tuple(grad.placements) != placements else None

    return hook


def _convert(x: Any, mesh: Any, placements: tuple) -> Any:
    """``x`` in ``placements``, its gradient coming back in ``x``'s own layout with no pending sum."""
    if tuple(x.placements) != placements:
        return x.redistribute(mesh, placements)  # its backward puts the gradient in x's layout, sums reduced
    return _Settle.apply(x)


class _Settle(torch.autograd.Function):
    """The identity forward; backward, the gradient put in the input's layout, pending sums reduced (what
    `DTensor.redistribute`'s backward does, for a value that needed no conversion)."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:  # noqa: ANN401
        from torch.distributed.tensor import Partial, Replicate

        ctx.mesh = x.device_mesh
        ctx.placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # noqa: ANN401
        if tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad


def _lift(target: tuple, shape: torch.Size, sizes: tuple[int, ...], *, flattened: bool, shard: type) -> tuple | None:
    """``target`` (the leading op's input layout) as a layout of the module's input of ``shape``; None where it has
    none (a strided split, a split that does not divide the input's dim)."""
    from torch.distributed.tensor import Partial, Replicate

    out = []
    ways: dict[int, int] = {}
    for p, size in zip(target, sizes):
        if isinstance(p, (Replicate, Partial)):
            out.append(p)
            continue
        if type(p) is not shard:
            return None  # a strided split
        dim = p.dim
        if flattened and len(shape) > 2:
            # a split of the tokens (every dim but the features, flattened) is one of the first dim longer than
            # one (a micro-batch of one sample: its sequence)
            dim = next((d for d in range(len(shape) - 2) if shape[d] > 1), len(shape) - 2) if dim == 0 else \
                len(shape) - 1 if dim == 1 else None
        if dim is None or dim >= len(shape):
            return None
        ways[dim] = ways.get(dim, 1) * size
        if shape[dim] % ways[dim]:
            return None
        out.append(shard(dim))
    return tuple(out)


# ---- intra-op layer layouts inside a pipeline stage --------------------------------------------------------------


def laid_out_layers(plan: Plan) -> set[str]:
    """The layers a pipeline plan's intra stages lay out block by block (`Stage.layouts`); the others of those
    stages keep Megatron's layout."""
    return {layer for stage in plan.stages if stage.intra for layer, _ in stage.layouts}


def megatron_part(plan: Plan) -> Plan:
    """``plan`` without the module entries of its intra-laid-out layers: what Megatron's layouts apply to."""
    import dataclasses

    laid = laid_out_layers(plan)
    if not laid:
        return plan
    return dataclasses.replace(plan, modules=tuple(m for m in plan.modules
                                                   if not any(_inside(m.fqn, layer) for layer in laid)))


def _inside(fqn: str, layer: str) -> bool:
    return fqn == layer or fqn.startswith(f"{layer}.")


def lay_out_layers(part: nn.Module, plan: Plan, mesh: Any,  # noqa: ANN401 - a DeviceMesh
                   permutations: dict[str, tuple[int, torch.Tensor]]) -> list[nn.Parameter]:
    """Lay out the intra-laid-out layers ``part`` (one pipeline stage, its modules under their names in the whole
    model) holds as the plan says, on the stage's 1-D tp ``mesh``; returns their parameters.

    A fused projection the model cuts into pieces (q, k and v; `apply.fused_pieces`) whose output features the plan
    splits is laid out as Megatron's runtime lays it out, as the cost model prices it: its rows reordered so that
    each rank's shard holds its share of every piece (recorded in ``permutations``), and its output cut locally
    (`_cut_pieces`), each piece handed on split by features, with no conversion.

    Each parameter becomes a DTensor in its planned tp placement (cut from the whole weight, nothing sent), buffers
    replicated; each leading op's module converts its input and output as planned (`_hook_module`), as in an
    intra-op plan. The layer meets the rest of the stage as Megatron's layers do: it is handed the stream as local
    tensors (whole, or this rank's sequence shard under sequence parallelism), which enter as DTensors in that
    layout (its other tensor arguments, masks and rotary tables, replicated), and it hands its output back in that
    layout, as local tensors; in between DTensor carries the layouts, run as planned (`_AsPlanned`). A layer the
    plan recomputes in full replays as planned inside its checkpoint. The gradients of weights kept whole while
    their work splits are left pending over tp, summed after the last micro-batch (`ParallelModel`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from autopar.runtime.apply import _pieces_order, fused_pieces, out_features_dim

    attention_rules()
    _views_copy_where_needed()
    modules = dict(part.named_modules())
    tp = mesh.size()
    entries = {e.fqn: e for e in plan.modules}
    placed = {p.name: p.on(1) for e in plan.modules for p in e.params}
    stream = Shard(1) if plan.sp else Replicate()
    cache: dict[int, tuple] = {}
    params: list[nn.Parameter] = []
    for name in sorted(laid_out_layers(plan)):
        layer = modules.get(name)
        if layer is None:  # another stage's
            continue
        for prefix, module in layer.named_modules(prefix=name):
            parent, _, child = prefix.rpartition(".")
            pieces = fused_pieces(modules.get(parent), child)
            out = out_features_dim(module) if pieces is not None else None
            weight = placed.get(f"{prefix}.weight")
            if pieces is None or not (isinstance(weight, Shard) and weight.dim == out) or any(w % tp for w in pieces):
                pieces = None
            else:  # each rank's share of every piece in its contiguous shard, as Megatron's runtime has it
                order = _pieces_order(pieces, tp=tp)
                with torch.no_grad():
                    for key, dim in (("weight", out), ("bias", 0)):
                        param = module._parameters.get(key)
                        if param is not None:
                            param.copy_(param.index_select(dim, order))
                            permutations[f"{prefix}.{key}"] = (dim, order)
            for key, param in list(module._parameters.items()):
                if param is None or isinstance(param, DTensor):
                    continue
                local = distribute_tensor(param.detach(), mesh, [placed.get(f"{prefix}.{key}", Replicate())],
                                          src_data_rank=None)
                module._parameters[key] = nn.Parameter(local, requires_grad=param.requires_grad)
                params.append(module._parameters[key])
            for key, buffer in list(module._buffers.items()):
                if buffer is not None and not isinstance(buffer, DTensor):
                    module._buffers[key] = DTensor.from_local(buffer, mesh, [Replicate()], run_check=False)
            entry = entries.get(prefix)
            if entry is not None:
                _hook_module(module, *(None if x is None else (x[1],) for x in (entry.input, entry.output)),
                             mesh=mesh, cache=cache)
            if pieces is not None:
                module.register_forward_hook(_marks_pieces(pieces))
        layer.forward = _on_stream(layer.forward, mesh, stream, cache, scatter=plan.sp)
    return params


def _on_stream(forward: Any, mesh: Any, stream: Any, cache: dict[int, tuple], *, scatter: bool) -> Any:  # noqa: ANN401
    """A laid-out layer's forward between Megatron's local tensors (`lay_out_layers`): ``forward`` (the layer's own,
    or its full recomputation's checkpoint of it, whose replay then runs as planned too)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils._pytree import tree_map
    from torch.utils.checkpoint import checkpoint

    from autopar.runtime.apply import _checkpointed

    recomputed = isinstance(forward, functools.partial) and forward.func is _checkpointed
    inner = _scoped(forward.args[1] if recomputed else forward, cache)

    def planned(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        with _as_planned(scatter=scatter):
            return inner(*args, **kwargs)

    def core(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        if not recomputed:
            return planned(*args, **kwargs)
        # checkpointing's own early stop: the replay ends after the last op that saves a tensor, as priced
        # (`cost.intra_layers.IntraLayers._row_calls`)
        return checkpoint(planned, *args, use_reentrant=False, **kwargs)

    def enter(x: Any, placement: Any) -> Any:  # noqa: ANN401
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [placement], run_check=False)
        return x

    def leave(x: Any, placement: Any) -> Any:  # noqa: ANN401
        if not isinstance(x, DTensor):
            return x
        if tuple(x.placements) != (placement,):
            x = x.redistribute(mesh, [placement])
        # a view of the DTensor's shard: FSDP, wrapping the layer, would lose its hook on the output to an in-place
        # op on the view, so the layer hands on a tensor of its own, as a Megatron layer's residual add does
        local = x.to_local()
        return local.clone() if local._base is not None else local

    def run(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        whole = Replicate()
        if args:
            args = (enter(args[0], stream), *tree_map(lambda x: enter(x, whole), args[1:]))
            kwargs = tree_map(lambda x: enter(x, whole), kwargs)
        else:
            kwargs = {k: enter(v, stream) if k == "hidden_states" else tree_map(lambda x: enter(x, whole), v)
                      for k, v in kwargs.items()}
        out = core(*args, **kwargs)
        if isinstance(out, DTensor):
            return leave(out, stream)
        if isinstance(out, tuple) and out and isinstance(out[0], DTensor):
            return (leave(out[0], stream), *tree_map(lambda x: leave(x, whole), out[1:]))
        return tree_map(lambda x: leave(x, whole), out)

    return run
