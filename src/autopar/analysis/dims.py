"""Dimension maps: how each tensor dim of an op's inputs and outputs follows from the op's iteration dims.

This is the affine dependency of CFP (§3.2, Eq. 1-2, Table 1) at the granularity the planner needs. An op iterates
over a set of `Dim`s; each dim appears at one tensor dim of some inputs and outputs (or nowhere, for a broadcast
operand). Partitioning an iteration dim over a mesh axis shards every tensor dim it appears at:

- a dim that reaches an output (batch, rows, columns, heads) splits the op with no communication (``FREE``);
- a contracted dim (matmul's k, an embedding's vocabulary, a sum) leaves each device a partial result (``PARTIAL``);
- a dim the op cannot split without talking to other devices (a softmax or norm axis, a convolution's spatial dims,
  the inner dims of a reshape merge) is ``FIXED``.

Rules come from a registry filled by `dim_rule`; ops without a rule fall back to `_opaque` (logged once), which lets
only a leading dim shared by every operand split. Views, elementwise ops with broadcasting, reshapes that merge or
split dims, transposes, contractions (CFP Table 1's five classes) and the reductions in transformers have rules.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from autopar.capture import Node, TensorInfo

log = logging.getLogger(__name__)


class Split(str, Enum):
    FREE = "free"
    PARTIAL = "partial"
    FIXED = "fixed"


@dataclass(frozen=True, slots=True)
class Dim:
    size: int
    inputs: tuple[int | None, ...]  # tensor dim at each input (None: absent or broadcast)
    outputs: tuple[int | None, ...]  # tensor dim at each output (None: reduced away)
    split: Split
    name: str = ""  # role for people and baselines: "m", "n", "k", "batch", "heads", ...
    # a view's merge or unmerge of dims: splitting this dim splits the merged tensor dim with a stride, the
    # product of the dims outside it in the merge (DTensor's `_StridedShard` split factor); () is 1 everywhere
    input_strides: tuple[int, ...] = ()
    output_strides: tuple[int, ...] = ()

    def input_stride(self, index: int) -> int:
        return self.input_strides[index] if self.input_strides else 1

    def output_stride(self, index: int) -> int:
        return self.output_strides[index] if self.output_strides else 1


class Linearity(str, Enum):
    """Which inputs may arrive as Partial sums (the op commutes with the pending sum)."""

    NONE = "none"  # no Partial input allowed
    ALL = "all"  # every float input Partial, output Partial (add, sub)
    FIRST = "first"  # the first input Partial, the others replicated (mul, div, views, casts)


@dataclass(frozen=True, slots=True)
class OpDims:
    dims: tuple[Dim, ...]
    linearity: Linearity = Linearity.NONE
    contraction: bool = False
    addends: int = 0  # leading inputs added to the result (addmm's bias): Partial when a contracted dim splits

    def dim_at_input(self, index: int, tensor_dim: int, stride: int = 1) -> int | None:
        """The iteration dim found at input ``index``'s ``tensor_dim`` (split with ``stride``: `Dim.input_stride`)."""
        for k, d in enumerate(self.dims):
            if d.inputs[index] == tensor_dim and d.input_stride(index) == stride:
                return k
        return None


Rule = Callable[[Node], OpDims]
_RULES: dict[str, Rule] = {}
_WARNED: set[str] = set()


def dim_rule(*ops: str) -> Callable[[Rule], Rule]:
    """Register a rule for aten overloads named like ``"aten.mm.default"`` (or a packet: ``"aten.add"``)."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            _RULES[op] = fn
        return fn

    return register


def op_dims(node: Node) -> OpDims:
    """The dimension map of ``node`` (cached by op, shapes and arguments)."""
    return _cached(node.op, node.inputs, node.outputs, node.args, node.piece)


@lru_cache(maxsize=65536)
def _cached(op: str, inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], args: tuple,
            piece: bool = False) -> OpDims:
    node = Node(id=-1, op=op, module="", module_type="", inputs=inputs, sources=(), outputs=outputs, args=args,
                piece=piece)
    rule = _RULES.get(op) or _RULES.get(op.rpartition(".")[0])
    if rule is None:
        if "scaled_dot_product" in op:
            rule = _attention
        else:
            if op not in _WARNED:
                _WARNED.add(op)
                log.info("no dimension rule for %s: only a leading dim shared by all operands may split", op)
            rule = _opaque
    return rule(node)


# ---- helpers ---------------------------------------------------------------------------------------------------


def _aligned(node: Node, *, linearity: Linearity = Linearity.NONE, fixed: frozenset[int] = frozenset()) -> OpDims:
    """Elementwise with broadcasting: iteration dims are the first output's dims, inputs aligned from the right."""
    out = node.outputs[0].shape if node.outputs else ()
    rank = len(out)
    dims = []
    for o, size in enumerate(out):
        ins = []
        for t in node.inputs:
            d = o - (rank - len(t.shape))
            ins.append(d if d >= 0 and t.shape[d] == size else None)
        outs = tuple(o if len(x.shape) == rank and x.shape[o] == size else None for x in node.outputs)
        split = Split.FIXED if (o - rank) in fixed or o in fixed or size == 1 else Split.FREE
        dims.append(Dim(size, tuple(ins), outs, split))
    return OpDims(tuple(dims), linearity)


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# ---- elementwise and casts --------------------------------------------------------------------------------------

_SUMS = ("aten.add.Tensor", "aten.add_.Tensor", "aten.sub.Tensor", "aten.sub_.Tensor")
_PRODUCTS = (
    "aten.mul.Tensor", "aten.mul_.Tensor", "aten.div.Tensor", "aten.div_.Tensor", "aten.mul.Scalar",
    "aten.mul_.Scalar", "aten.div.Scalar", "aten.div_.Scalar", "aten.neg.default", "aten._to_copy.default",
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
    "aten.copy_.default",
)
_POINTWISE = (
    "aten.gelu.default", "aten.silu.default", "aten.relu.default", "aten.relu_.default", "aten.tanh.default",
    "aten.sigmoid.default", "aten.exp.default", "aten.log.default", "aten.sqrt.default", "aten.rsqrt.default",
    "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.add.Scalar", "aten.add_.Scalar", "aten.sub.Scalar",
    "aten.empty_like.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
    "aten.bernoulli_.float", "aten.bernoulli.default", "aten.native_dropout.default", "aten.where.self",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.masked_fill_.Scalar", "aten.abs.default",
    "aten.maximum.default", "aten.minimum.default", "aten.clamp.default", "aten.gt.Scalar", "aten.lt.Scalar",
    "aten.eq.Scalar", "aten.ne.Scalar", "aten.ge.Scalar", "aten.le.Scalar", "aten.gt.Tensor", "aten.lt.Tensor",
    "aten.eq.Tensor", "aten.logical_not.default", "aten.bitwise_not.default", "aten.fill_.Scalar",
    "aten.sin.default", "aten.cos.default", "aten.erf.default", "aten.reciprocal.default", "aten.square.default",
    "aten.softplus.default", "aten.hardtanh.default", "aten.hardtanh_.default", "aten.leaky_relu.default",
)


@dim_rule(*_SUMS)
def _sum_rule(node: Node) -> OpDims:
    return _aligned(node, linearity=Linearity.ALL)


@dim_rule(*_PRODUCTS)
def _product_rule(node: Node) -> OpDims:
    return _aligned(node, linearity=Linearity.FIRST)


@dim_rule(*_POINTWISE)
def _pointwise_rule(node: Node) -> OpDims:
    return _aligned(node)


# ---- reductions ---------------------------------------------------------------------------------------------------


def _reduced_dims(node: Node, position: int = 1) -> set[int]:
    rank = len(node.inputs[0].shape)
    arg = node.args[position] if len(node.args) > position else None
    if arg is None:
        return set(range(rank))
    if isinstance(arg, int):
        arg = (arg,)
    return {_norm_dim(d, rank) for d in arg if isinstance(d, int)}


def _reduction(node: Node, reduced: set[int], split: Split) -> OpDims:
    shape = node.inputs[0].shape
    keep = len(node.outputs[0].shape) == len(shape)
    dims, o = [], 0
    for i, size in enumerate(shape):
        ins = (i,) + (None,) * (len(node.inputs) - 1)
        if i in reduced:
            outs = (None,) * len(node.outputs)  # a kept dim of size 1 holds the reduced value, not a slice of i
            dims.append(Dim(size, ins, outs, split if size > 1 else Split.FIXED))
        else:
            outs = tuple(o if len(x.shape) > o else None for x in node.outputs)
            dims.append(Dim(size, ins, outs, Split.FREE if size > 1 else Split.FIXED))
        o += 1 if (keep or i not in reduced) else 0
    return OpDims(tuple(dims), Linearity.FIRST if split is Split.PARTIAL else Linearity.NONE)


@dim_rule("aten.sum.dim_IntList", "aten.mean.dim", "aten.sum.default", "aten.mean.default")
def _sum_reduction(node: Node) -> OpDims:
    return _reduction(node, _reduced_dims(node), Split.PARTIAL)


@dim_rule("aten.amax.default", "aten.amin.default", "aten.var_mean.correction", "aten.var.correction",
          "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.topk.default", "aten.sort.default")
def _max_reduction(node: Node) -> OpDims:
    return _reduction(node, _reduced_dims(node), Split.FIXED)


@dim_rule("aten._softmax.default", "aten._safe_softmax.default", "aten._log_softmax.default", "aten.cumsum.default")
def _softmax(node: Node) -> OpDims:
    dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else -1
    return _aligned(node, fixed=frozenset({_norm_dim(dim, len(node.inputs[0].shape))}))


@dim_rule("aten.native_layer_norm.default", "aten._fused_rms_norm.default")
def _layer_norm(node: Node) -> OpDims:
    shape = node.inputs[0].shape
    normalized = len(node.args[1]) if len(node.args) > 1 and isinstance(node.args[1], tuple) else 1
    first = len(shape) - normalized
    dims = []
    for i, size in enumerate(shape):
        ins = (i,) + tuple(i - first if i >= first else None for _ in node.inputs[1:])
        outs = tuple(i if i < len(x.shape) and (i < first or x.shape == shape) else None for x in node.outputs)
        dims.append(Dim(size, ins, outs, Split.FIXED if i >= first or size == 1 else Split.FREE))
    return OpDims(tuple(dims))


@dim_rule("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
def _nll(node: Node) -> OpDims:
    logits = node.inputs[0].shape
    rows = Dim(logits[0], (0, 0) + (None,) * (len(node.inputs) - 2), (None,) * len(node.outputs), Split.PARTIAL, "batch")
    classes = Dim(logits[1], (1,) + (None,) * (len(node.inputs) - 1), (None,) * len(node.outputs), Split.FIXED)
    return OpDims((rows, classes) if len(logits) == 2 else (classes,))


# ---- views ------------------------------------------------------------------------------------------------------


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of source dims with runs of destination dims whose products match (a reshape's merge/split)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        a = b = 1
        while True:
            if a <= b and i < len(src):
                a *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                b *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
            if a == b and (i >= len(src) or src[i] != 1 or j >= len(dst)) and gi and gj:
                break
        if a != b:
            return None
        groups.append((gi, gj))
    return groups


@dim_rule("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.view_copy.default",
          "aten.squeeze.dim", "aten.unsqueeze.default", "aten.squeeze.default", "aten.flatten.using_ints",
          "aten.unflatten.int", "aten.squeeze.dims")
def _view(node: Node) -> OpDims:
    """A reshape's dims, group by group (`_reshape_groups`): one-to-one dims map across; in a merge each source
    dim lands on the merged dim, the inner ones with a stride (the product of the dims outside them: the shards of
    a split sequence dim, flattened with the batch into tokens, are every ``s / n`` tokens of each sample); an
    unmerge is the same read backwards. Other groups let only their outermost dim split."""
    src, dst = node.inputs[0].shape, node.outputs[0].shape
    groups = _reshape_groups(src, dst)
    if groups is None:
        return _opaque(node)
    dims: list[Dim] = []
    for gi, gj in groups:
        big_i = [i for i in gi if src[i] > 1]
        big_j = [j for j in gj if dst[j] > 1]
        if len(big_i) > 1 and len(big_j) == 1:  # merge
            dims += [Dim(src[i], (i,), (big_j[0],), Split.FREE, output_strides=(math.prod(src[k] for k in big_i[:n]),))
                     for n, i in enumerate(big_i)]
            dims += [Dim(src[i], (i,), (None,), Split.FIXED) for i in gi if src[i] == 1]
            continue
        if len(big_i) == 1 and len(big_j) > 1:  # unmerge: one source dim, iterated as the destination's dims
            dims += [Dim(dst[j], (big_i[0],), (j,), Split.FREE, input_strides=(math.prod(dst[k] for k in big_j[:n]),))
                     for n, j in enumerate(big_j)]
            dims += [Dim(src[i], (i,), (None,), Split.FIXED) for i in gi if src[i] == 1]
            continue
        for i in gi:
            # the outermost non-trivial source dim of a merge lands on the outermost non-trivial destination dim
            lead = bool(big_i) and i == big_i[0] and bool(big_j)
            if lead and src[i] % dst[big_j[0]] and dst[big_j[0]] % src[i]:
                lead = False
            out = big_j[0] if lead else (gj[gi.index(i)] if len(gi) == len(gj) else None)
            ok = lead or (len(gi) == len(gj) and src[i] > 1)
            dims.append(Dim(src[i], (i,), (out,), Split.FREE if ok and out is not None else Split.FIXED))
    return OpDims(tuple(dims), Linearity.FIRST)


@dim_rule("aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.numpy_T.default")
def _permute(node: Node) -> OpDims:
    rank = len(node.inputs[0].shape)
    if node.op == "aten.permute.default":
        order = [_norm_dim(d, rank) for d in node.args[1]]
    else:
        a, b = (0, 1) if node.op == "aten.t.default" or rank < 2 else (
            _norm_dim(node.args[1], rank), _norm_dim(node.args[2], rank))
        order = list(range(rank))
        if rank >= 2:
            order[a], order[b] = order[b], order[a]
    where = {src: dst for dst, src in enumerate(order)}
    dims = tuple(
        Dim(size, (i,), (where[i],), Split.FREE if size > 1 else Split.FIXED)
        for i, size in enumerate(node.inputs[0].shape)
    )
    return OpDims(dims, Linearity.FIRST)


@dim_rule("aten.expand.default")
def _expand(node: Node) -> OpDims:
    src, dst = node.inputs[0].shape, node.outputs[0].shape
    offset = len(dst) - len(src)
    dims = []
    for o, size in enumerate(dst):
        i = o - offset
        mapped = i if i >= 0 and src[i] == size else None
        dims.append(Dim(size, (mapped,), (o,), Split.FREE if size > 1 else Split.FIXED))
    return OpDims(tuple(dims), Linearity.FIRST)


def split_axis(node: Node) -> int:
    """The dim a slicing op (`_slice`'s) cuts: ``split``'s and ``chunk``'s third argument, the others' second (0 if
    not given)."""
    rank = len(node.inputs[0].shape)
    # split(self, sizes, dim=0) and chunk(self, chunks, dim=0); slice(self, dim=0, ...), narrow, select, unbind
    position = 2 if _cuts_in_pieces(node) else 1
    return _norm_dim(node.args[position] if len(node.args) > position else 0, rank)


def _cuts_in_pieces(node: Node) -> bool:
    """``split`` and ``chunk``: the whole dim cut into pieces that together hold all of it."""
    return node.op.startswith(("aten.split", "aten.chunk"))


def is_piece(node: Node) -> bool:
    """A piece of a dim cut in pieces: a ``split``'s or ``chunk``'s, or a slice that the tensor's other slices
    along that dim complete (`Node.piece`)."""
    return _cuts_in_pieces(node) or node.piece


@dim_rule("aten.slice.Tensor", "aten.select.int", "aten.split_with_sizes.default", "aten.split.Tensor",
          "aten.chunk.default", "aten.narrow.default", "aten.unbind.int")
def _slice(node: Node) -> OpDims:
    """Slicing along one dim: the others pass through; a split's dim (or that of slices cutting it in pieces, as
    Phi-3 cuts its fused q/k/v) splits freely when every piece divides like the whole (a fused QKV output split
    into Q, K and V is sharded per piece, as Megatron lays out its weights)."""
    shape = node.inputs[0].shape
    rank = len(shape)
    axis = split_axis(node)
    dims = []
    for i, size in enumerate(shape):
        if i == axis:
            outs = tuple(i if len(x.shape) == rank else None for x in node.outputs)
            # pieces of unequal sizes too (grouped-query attention's [q; k; v]): each shard holds its share of
            # every piece, as the runtime lays the fused weight out (`runtime.apply._pieces_order`); every piece must
            # divide (`sharding.apply` checks each output)
            dims.append(Dim(size, (i,), outs, Split.FREE if is_piece(node) else Split.FIXED))
        else:
            o = i if len(node.outputs[0].shape) == rank or i < axis else i - 1
            dims.append(Dim(size, (i,), tuple(o for _ in node.outputs), Split.FREE if size > 1 else Split.FIXED))
    return OpDims(tuple(dims), Linearity.FIRST)


@dim_rule("aten.index.Tensor")
def _index(node: Node) -> OpDims:
    """Indexing by one 1-D tensor of indices in one dim (``x[:, :, [k]]``, as Falcon picks its key and value out of
    each group of heads): the other dims pass through, the indexed one is fixed. Other index patterns (several
    index tensors, whose dims move to the front) are opaque."""
    shape, out = node.inputs[0].shape, node.outputs[0].shape
    indices = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (tuple, list)) else ()
    given = [k for k, x in enumerate(indices) if x is not None]
    if len(given) != 1 or len(node.inputs) != 2 or len(node.inputs[1].shape) != 1 or len(out) != len(shape):
        return _opaque(node)
    axis = given[0]
    dims = [Dim(size, (i, None), (i,), Split.FREE if size > 1 else Split.FIXED)
            for i, size in enumerate(shape) if i != axis]
    dims += [Dim(shape[axis], (axis, None), (None,), Split.FIXED), Dim(out[axis], (None, 0), (axis,), Split.FIXED)]
    return OpDims(tuple(dims), Linearity.FIRST)


@dim_rule("aten.cat.default", "aten.stack.default")
def _cat(node: Node) -> OpDims:
    out = node.outputs[0].shape
    rank = len(out)
    axis = _norm_dim(node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else 0, rank)
    stack = node.op == "aten.stack.default"  # its inputs lack the new ``axis``: output dim o is their o (or o - 1)
    dims = []
    for o, size in enumerate(out):
        if stack:
            at = None if o == axis else o if o < axis else o - 1
            ins = tuple(at if len(t.shape) == rank - 1 else None for t in node.inputs)
        else:
            ins = tuple(o if len(t.shape) == rank else None for t in node.inputs)
        dims.append(Dim(size, ins, (o,), Split.FIXED if o == axis or size == 1 else Split.FREE))
    return OpDims(tuple(dims), Linearity.ALL)


# ---- contractions -------------------------------------------------------------------------------------------------


def _einsum(node: Node, spec: str, names: dict[str, str], offset: int = 0) -> OpDims:
    """Dims from an einsum equation over the tensor inputs from ``offset`` on; letters not in the output contract."""
    lhs, out = spec.split("->")
    operands = lhs.split(",")
    letters = dict.fromkeys("".join(operands) + out)
    dims = []
    n_in = len(node.inputs)
    for letter in letters:
        ins: list[int | None] = [None] * n_in
        size = 0
        for k, term in enumerate(operands):
            if letter in term:
                ins[offset + k] = term.index(letter)
                size = node.inputs[offset + k].shape[term.index(letter)]
        outs = tuple(out.index(letter) if letter in out else None for _ in node.outputs)
        if letter in out and offset:  # a bias added to the output broadcasts along the output's trailing dims
            for b in range(offset):
                bias = node.inputs[b].shape
                d = out.index(letter) - (len(out) - len(bias))
                ins[b] = d if d >= 0 and bias[d] == size else None
        split = Split.FREE if letter in out else Split.PARTIAL
        dims.append(Dim(size, tuple(ins), outs, split if size > 1 else Split.FIXED, names.get(letter, letter)))
    return OpDims(tuple(dims), contraction=True, addends=offset)


# matmul family: einsum equation over the tensor inputs after ``offset`` leading bias operands
_MATMULS = {
    "aten.mm.default": ("mk,kn->mn", 0),
    "aten.addmm.default": ("mk,kn->mn", 1),
    "aten.bmm.default": ("bmk,bkn->bmn", 0),
    "aten.baddbmm.default": ("bmk,bkn->bmn", 1),
}


@dim_rule(*_MATMULS)
def _matmul(node: Node) -> OpDims:
    spec, offset = _MATMULS[node.op]
    return _einsum(node, spec, {}, offset=offset)


@dim_rule("aten._grouped_mm.default")
def _grouped_mm(node: Node) -> OpDims:
    """A mixture of experts' grouped matmul as Hugging Face's experts run it: rows (S, K), sorted by expert, times one
    (K, N) weight per expert (E, K, N), with ``offs`` (E,) ending each expert's rows. The output features split
    freely (each device holds those features of every expert), the contracted features leave partial sums; the rows
    and the experts are fixed, as ``offs`` ties each row to its expert. Other forms (no ``offs``, 3-D rows) are
    opaque."""
    shapes = [t.shape for t in node.inputs]
    if len(shapes) < 3 or len(shapes[0]) != 2 or len(shapes[1]) != 3 or shapes[2] != (shapes[1][0],):
        return _opaque(node)
    (rows, k), (experts, _, n) = shapes[0], shapes[1]
    extra = (None,) * (len(shapes) - 3)
    dims = (
        Dim(rows, (0, None, None, *extra), (0,), Split.FIXED, "m"),
        Dim(k, (1, 1, None, *extra), (None,), Split.PARTIAL if k > 1 else Split.FIXED, "k"),
        Dim(n, (None, 2, None, *extra), (1,), Split.FREE if n > 1 else Split.FIXED, "n"),
        Dim(experts, (None, 0, 0, *extra), (None,), Split.FIXED, "experts"),
    )
    return OpDims(dims, contraction=True)


@dim_rule("aten.embedding.default")
def _embedding(node: Node) -> OpDims:
    weight, index = node.inputs[0].shape, node.inputs[1].shape
    dims = [Dim(weight[0], (0, None), (None,), Split.PARTIAL, "vocab")]
    for i, size in enumerate(index):
        dims.append(Dim(size, (None, i), (i,), Split.FREE if size > 1 else Split.FIXED, "batch" if i == 0 else "seq"))
    dims.append(Dim(weight[1], (1, None), (len(index),), Split.FREE, "n"))
    return OpDims(tuple(dims), contraction=True)


@dim_rule("aten.convolution.default")
def _convolution(node: Node) -> OpDims:
    x, w = node.inputs[0].shape, node.inputs[1].shape
    grouped = w[1] != x[1]
    dims = [
        Dim(x[0], (0, None) + (None,) * (len(node.inputs) - 2), (0,), Split.FREE, "batch"),
        Dim(w[0], (None, 0) + (0,) * (len(node.inputs) - 2), (1,), Split.FIXED if grouped else Split.FREE, "n"),
        Dim(x[1], (1, 1) + (None,) * (len(node.inputs) - 2), (None,), Split.FIXED if grouped else Split.PARTIAL, "k"),
    ]
    for s in range(2, len(x)):  # spatial dims need halo exchange: not split here
        dims.append(Dim(x[s], (s, s) + (None,) * (len(node.inputs) - 2), (s,), Split.FIXED, "spatial"))
    return OpDims(tuple(dims), contraction=True)


def _attention(node: Node) -> OpDims:
    """Scaled dot-product attention on (batch, heads, seq, head_dim) q, k, v; outputs are the attention output and
    per-row statistics. Batch and heads split freely (key/value heads with their query groups), query rows split
    with k and v replicated, the key sequence and head dims do not split (softmax and the dot products need them
    whole)."""
    q, k, v = (t.shape for t in node.inputs[:3])
    extra = (None,) * (len(node.inputs) - 3)

    def outs(dim: int | None) -> tuple[int | None, ...]:
        return tuple(dim if dim is not None and dim < len(x.shape) and x.shape[dim] == q[dim] else None for x in node.outputs)

    # grouped-query attention (``enable_gqa``): query head i reads key/value head i // (heads / kv heads), so a
    # contiguous split of the query heads reads a contiguous split of the key/value heads; `apply` refuses a split
    # the key/value heads do not divide
    grouped = k[1] == v[1] and k[1] > 0 and q[1] % k[1] == 0
    dims = (
        Dim(q[0], (0, 0, 0) + extra, outs(0), Split.FREE if q[0] > 1 else Split.FIXED, "batch"),
        Dim(q[1], (1, 1 if grouped else None, 1 if grouped else None) + extra, outs(1),
            Split.FREE if grouped and q[1] > 1 else Split.FIXED, "heads"),
        Dim(q[2], (2, None, None) + extra, outs(2), Split.FREE if q[2] > 1 else Split.FIXED, "seq"),
        Dim(k[2], (None, 2, 2) + extra, (None,) * len(node.outputs), Split.FIXED, "kv_seq"),
        Dim(q[3], (3, 3, 3) + extra, tuple(3 if len(x.shape) == 4 else None for x in node.outputs), Split.FIXED, "head_dim"),
    )
    return OpDims(dims, contraction=True)


# ---- fallback -----------------------------------------------------------------------------------------------------


def _opaque(node: Node) -> OpDims:
    """Unknown op: a leading dim of one size in every operand may split (batch-like); nothing else."""
    tensors = [*node.inputs, *node.outputs]
    lead = tensors[0].shape[0] if tensors and tensors[0].shape else None
    if lead and lead > 1 and all(t.shape and t.shape[0] == lead for t in tensors):
        return OpDims((Dim(lead, tuple(0 for _ in node.inputs), tuple(0 for _ in node.outputs), Split.FREE, "batch"),))
    return OpDims(())
