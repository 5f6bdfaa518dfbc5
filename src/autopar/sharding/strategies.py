"""Per-op sharding strategies on an N-D mesh, generated from dimension maps (DTensor's einsum-strategy idea).

A strategy assigns each mesh axis one of the op's iteration dims (split that dim over the axis), ``None``
(replicate the work on that axis) or ``PASS`` (a linear op passes a pending Partial sum through). From the
assignment every input's and output's layout follows: a tensor is ``S(d)`` on an axis when the assigned iteration
dim sits at its dim ``d``, ``R`` when the dim is absent from it, and an output is ``P`` when the dim was
contracted away. Splitting needs every tensor dim the iteration dim touches to divide evenly by the axes splitting
it. `tests/test_sharding.py` checks these strategies against DTensor's own rules (`_dtensor.propagate`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from autopar.analysis import Linearity, OpDims, Split
from autopar.capture import Node, TensorInfo
from autopar.sharding.layout import PARTIAL, REPLICATE, Layout, is_shard, shard_of, short_layout

PASS = "P"
Assign = int | str | None


@dataclass(frozen=True, slots=True)
class Strategy:
    assignment: tuple[Assign, ...]  # per mesh axis
    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    gradients: tuple[Layout, ...]  # layout each input's gradient leaves the op in
    shard: int  # ways the op's work is split

    def __str__(self) -> str:
        ins = ", ".join(short_layout(x) for x in self.inputs)
        outs = ", ".join(short_layout(x) for x in self.outputs)
        return f"{ins} -> {outs}"


def apply(
    dims: OpDims,
    assignment: tuple[Assign, ...],
    inputs: tuple[TensorInfo, ...],
    outputs: tuple[TensorInfo, ...],
    sizes: tuple[int, ...],
) -> Strategy | None:
    """The layouts implied by ``assignment``; None when a split does not divide evenly or is not allowed."""
    n_in, n_out = len(inputs), len(outputs)
    in_layouts: list[list] = [[] for _ in range(n_in)]
    grad_layouts: list[list] = [[] for _ in range(n_in)]
    out_layouts: list[list] = [[] for _ in range(n_out)]
    factor: dict[int, int] = {}  # iteration dim -> product of axis sizes splitting it
    shard = 1
    for axis, choice in enumerate(assignment):
        n = sizes[axis]
        if choice is None:
            for j in range(n_in):
                in_layouts[j].append(REPLICATE)
                grad_layouts[j].append(REPLICATE)
            for o in range(n_out):
                out_layouts[o].append(REPLICATE)
            continue
        if choice == PASS:
            if dims.linearity is Linearity.NONE:
                return None
            for j, t in enumerate(inputs):
                partial = j == 0 or (dims.linearity is Linearity.ALL and _is_float(t))
                in_layouts[j].append(PARTIAL if partial else REPLICATE)
                # a product's other float factor (``pending * w``) gets ``grad * pending`` as its gradient: a
                # partial sum on each device, as the value it multiplied; a sum's operands get the whole gradient
                multiplier = j > 0 and dims.linearity is Linearity.FIRST and _is_float(t)
                grad_layouts[j].append(PARTIAL if multiplier else REPLICATE)
            for o in range(n_out):
                out_layouts[o].append(PARTIAL)
            continue
        dim = dims.dims[choice]
        if dim.split is Split.FIXED:
            return None
        total = factor.get(choice, 1) * n
        if dim.size % total:
            return None
        if choice in factor and any(dim.input_stride(j) > 1 for j in range(n_in)):
            return None  # DTensor does not unflatten a strided split made over two mesh axes
        factor[choice] = total
        shard *= n
        for j, t in enumerate(inputs):
            d = dim.inputs[j]
            if d is not None and t.shape[d] % total:
                return None
            if d is None and dim.split is Split.PARTIAL and j < dims.addends:  # a bias joins the pending sum
                in_layouts[j].append(PARTIAL)
                grad_layouts[j].append(REPLICATE)
                continue
            split = shard_of(d, _local_stride(dims, choice, factor, j, inputs=True)) if d is not None else None
            in_layouts[j].append(split or REPLICATE)
            grad_layouts[j].append(split or (PARTIAL if _is_float(t) else REPLICATE))
        for o, t in enumerate(outputs):
            d = dim.outputs[o]
            if d is not None and t.shape[d] % total:
                return None
            out_layouts[o].append(shard_of(d, _local_stride(dims, choice, factor, o, inputs=False)) if d is not None else (
                PARTIAL if dim.split is Split.PARTIAL else REPLICATE))
    return Strategy(
        assignment=tuple(assignment),
        inputs=tuple(tuple(x) for x in in_layouts),
        outputs=tuple(tuple(x) for x in out_layouts),
        gradients=tuple(tuple(x) for x in grad_layouts),
        shard=shard,
    )


def _local_stride(dims: OpDims, choice: int, factor: dict[int, int], index: int, *, inputs: bool) -> int:
    """The stride of a merged dim's split as DTensor counts it: a strided split interleaves the local pieces of the
    dims outside it, so the shards earlier mesh axes already took of those outer dims divide it (batch 4 split in
    2, then sequence flattened with it: ``S(0)/2``, not ``S(0)/4``)."""
    dim = dims.dims[choice]
    side = (lambda d: d.inputs[index]) if inputs else (lambda d: d.outputs[index])
    stride_of = (lambda d: d.input_stride(index)) if inputs else (lambda d: d.output_stride(index))
    stride = stride_of(dim)
    if stride == 1:
        return 1
    for k, other in enumerate(dims.dims):
        if k != choice and k in factor and side(other) == side(dim) and stride_of(other) < stride:
            stride //= factor[k]
    return stride


def strategies(node: Node, dims: OpDims, sizes: tuple[int, ...], *, partial: bool = False) -> list[Strategy]:
    """Every strategy of ``node`` on a mesh of ``sizes`` (splittable dims per axis, replication, and with
    ``partial`` the Partial pass-through of linear ops)."""
    options: list[Assign] = [None, *(k for k, d in enumerate(dims.dims) if d.split is not Split.FIXED)]
    if partial and dims.linearity is not Linearity.NONE:
        options.append(PASS)
    found = []
    for assignment in itertools.product(options, repeat=len(sizes)):
        strategy = apply(dims, assignment, node.inputs, node.outputs, sizes)
        if strategy is not None:
            found.append(strategy)
    return found


def count(dims: OpDims, sizes: tuple[int, ...]) -> int:
    """Size of an op's strategy set before divisibility (for reporting the size of the per-op space)."""
    splittable = sum(1 for d in dims.dims if d.split is not Split.FIXED)
    return (splittable + 1) ** len(sizes)


def _is_float(t: TensorInfo) -> bool:
    return t.dtype.startswith(("float", "bfloat"))


def local_bytes(t: TensorInfo, layout: Layout, sizes: tuple[int, ...]) -> float:
    """Bytes of ``t`` on one device under ``layout`` (Partial and Replicate keep the whole tensor)."""
    ways = math.prod(n for p, n in zip(layout, sizes) if is_shard(p))
    return t.nbytes / ways
