"""The Graph IR: an aten-level forward graph with per-node costs.

Every later stage reads this: analysis groups nodes into blocks, the cost model prices them, the memory model sums
what they save for backward. Nodes are kept in execution order; a value is named by the node that produced it and
the output index (`Ref`), and model state (parameters, buffers) is named by its FQN.

FLOP convention: ``flops_forward`` and ``flops_backward`` are *model* FLOPs of contractions (matmul, convolution,
attention), the convention behind MFU: a contraction's backward costs one forward-sized product per input that needs
a gradient. Kernel-level recomputation (flash attention re-forming the score matrix) is not counted. Elementwise
and data-movement ops carry 0 FLOPs; their cost is in ``bytes_read`` / ``bytes_written``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

_ITEMSIZE: dict[str, int] = {}
TENSOR_ARG = "<tensor>"  # stands for a tensor among a node's recorded positional arguments


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> ``"bfloat16"``; the IR stores dtypes as names so it pickles and prints plainly."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = getattr(torch, dtype).itemsize
    return size


class NodeSource(Protocol):
    """Builds a graph's nodes: all of them, or one by id."""

    def nodes(self) -> list[Node]: ...

    def node(self, node_id: int) -> Node: ...


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class Ref:
    """Where a node input comes from: ``node`` >= 0 is a producing node and ``index`` its output; ``node == -1``
    is a model input (``index`` its position among the flattened example inputs) or, with ``state`` set, a
    parameter or buffer named by FQN."""

    node: int
    index: int = 0
    state: str | None = None

    @property
    def is_model_state(self) -> bool:
        return self.state is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    id: int
    op: str  # "aten.mm.default"
    module: str  # FQN of the innermost module whose forward ran the op ("" is the root)
    module_type: str  # that module's class name
    inputs: tuple[TensorInfo, ...]
    sources: tuple[Ref, ...]  # one per input
    outputs: tuple[TensorInfo, ...]
    flops_forward: int = 0
    flops_backward: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    saved_bytes: int = 0  # activation bytes this node saves for backward, counted once per storage in the trace
    is_view: bool = False
    args: tuple = ()  # positional arguments, tensors as TENSOR_ARG (dims of a transpose, sizes of a view, ...)
    # a slice that, with the other slices of the same tensor along the same dim, cuts it into pieces that hold all of
    # it, as ``split`` does (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``)
    piece: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        """FQNs of the parameters and buffers this node reads."""
        return tuple(s.state for s in self.sources if s.state is not None)

    @property
    def reads_params(self) -> bool:
        return any(s.state is not None for s in self.sources)

    @property
    def output_bytes(self) -> int:
        return 0 if self.is_view else sum(t.nbytes for t in self.outputs)


@dataclass(frozen=True, slots=True)
class StateInfo:
    """A parameter or buffer of the model."""

    fqn: str
    tensor: TensorInfo
    requires_grad: bool
    is_buffer: bool = False


@dataclass(frozen=True, slots=True)
class RepeatGroup:
    """Module instances that share one fingerprint and input signature: the first was traced, the rest reuse its
    nodes. ``spans[i]`` is the half-open node-id range of ``instances[i]``."""

    fingerprint: str
    module_type: str
    instances: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ModuleMemory:
    """MAP's memory categories (section 4.1) of one module, in bytes, for one forward/backward of the traced batch.

    fwd_in: activations saved for backward (model state excluded); fwd_tmp: outputs of its ops that are neither
    saved nor module outputs (freed when its forward ends); fwd_out: module outputs; bwd_out: gradients of its
    floating-point inputs; bwd_tmp: upper bound on backward temporaries, taken as the largest op's output gradient.
    """

    fwd_in: int
    fwd_tmp: int
    fwd_out: int
    bwd_tmp: int
    bwd_out: int


KV_HEAD_COUNTS = ("kv_heads", "num_key_value_heads", "num_kv_heads")
HEAD_COUNTS = ("heads", "num_heads", "num_attention_heads")


def multi_query_attentions(model: Any) -> frozenset[str]:  # noqa: ANN401
    """FQNs of the attention modules of ``model`` (an ``nn.Module``) with one key/value head for several query
    heads (multi-query attention: Falcon's default, GPTBigCode's, the zoo's ``kv_heads=1``), read from the module's
    head counts or, for Hugging Face attentions that keep only ``num_key_value_groups``, its config's. No tp degree
    divides one key/value head, so tensor parallelism keeps these attentions whole (`cost.layers.kept_whole`), on
    every rank, instead of splitting their heads; latent attentions are kept whole too (`one_key_value_head`).
    Counts are read from each module's own attributes (its ``__dict__``: a lookup that misses costs an exception on
    an ``nn.Module``, 0.24 s over a 1,000-layer model); the tracer finds them in its one pass over the modules
    (`capture.reuse.scan`)."""
    return frozenset(name for name, module in model.named_modules() if one_key_value_head(vars(module)))


def one_key_value_head(own: dict[str, Any]) -> bool:
    """Whether a module whose own attributes are ``own`` is a multi-query attention (`multi_query_attentions`), or
    a latent attention (DeepSeek-V2's and V3's, and the types that reuse it, with a ``kv_lora_rank``): its keys and
    values are projected down to one latent that every head shares, and the model cuts that latent from the
    rotary key with ``split_with_sizes``, so tp keeps it whole as it keeps one key/value head."""
    if positive_count(own.get("kv_lora_rank")):
        return True
    kv = next((own[a] for a in KV_HEAD_COUNTS if positive_count(own.get(a))), None)
    heads = next((own[a] for a in HEAD_COUNTS if positive_count(own.get(a))), None)
    if kv is None and positive_count(own.get("num_key_value_groups")):
        config = own.get("config")
        kv, heads = getattr(config, "num_key_value_heads", None), getattr(config, "num_attention_heads", None)
    return kv == 1 and positive_count(heads) and heads > 1


def positive_count(value: Any) -> bool:  # noqa: ANN401
    """Whether ``value`` is a count: an int above 0, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class Graph:
    """The traced forward graph of one training step.

    Totals (``num_nodes``, FLOPs, ``saved_bytes``) and the repeat groups are available at once; the full node
    list is built from the traced templates the first time `nodes` is read, so tracing a 1,000-layer model costs
    about what a 10-layer one does until someone asks for all 1,000 layers' nodes.
    """

    def __init__(
        self,
        *,
        modules: dict[str, str],
        state: dict[str, StateInfo] | Callable[[], dict[str, StateInfo]],
        inputs: tuple[TensorInfo, ...],
        repeats: list[RepeatGroup],
        num_nodes: int,
        flops_forward: int,
        flops_backward: int,
        saved_bytes: int,
        expansion: NodeSource,
        trace_seconds: float = 0.0,
        multi_query: frozenset[str] = frozenset(),
    ) -> None:
        self.modules = modules  # FQN -> class name, for every module in the model
        self.multi_query = multi_query  # attentions with one key/value head (`multi_query_attentions`)
        self._state = state
        self.inputs = inputs  # flattened tensor leaves of the example inputs
        self.repeats = repeats
        self.num_nodes = num_nodes
        self.flops_forward = flops_forward  # model FLOPs of one forward pass
        self.flops_backward = flops_backward
        self.saved_bytes = saved_bytes  # activation bytes kept for backward
        self.trace_seconds = trace_seconds
        self._expansion: NodeSource | None = expansion
        self._nodes: list[Node] | None = None
        self._some: dict[int, Node] = {}

    @property
    def state(self) -> dict[str, StateInfo]:
        """Parameters (deduplicated and named as `named_parameters` does) and buffers, by FQN."""
        if callable(self._state):
            self._state = self._state()
        return self._state

    @property
    def nodes(self) -> list[Node]:
        """Every aten op in execution order (built on first access)."""
        if self._nodes is None:
            assert self._expansion is not None
            self._nodes = self._expansion.nodes()
            self._expansion = None
            self._some.clear()
        return self._nodes

    def node(self, node_id: int) -> Node:
        """One node, without building the whole list when it is not built yet (a few layers of a deep model)."""
        if self._nodes is not None:
            return self._nodes[node_id]
        found = self._some.get(node_id)
        if found is None:
            assert self._expansion is not None
            found = self._some[node_id] = self._expansion.node(node_id)
        return found

    def __repr__(self) -> str:
        return (
            f"Graph({self.num_nodes} nodes, {self.num_params:,} params, {len(self.repeats)} repeat groups, "
            f"{self.flops_forward:.3g} fwd FLOPs)"
        )

    def multi_query_of(self, module: str) -> str | None:
        """The multi-query attention (`multi_query`) holding ``module`` (or being it), None if none does: its name
        and each of its ancestors looked up, not every attention compared."""
        if not self.multi_query:
            return None
        while module:
            if module in self.multi_query:
                return module
            module = module.rpartition(".")[0]
        return None

    # ---- totals -------------------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(s.tensor.numel for s in self.state.values() if not s.is_buffer)

    # ---- module views -------------------------------------------------------------------------------------
    def module_nodes(self, fqn: str) -> list[Node]:
        """Nodes run inside module ``fqn`` (itself or a descendant)."""
        return [n for n in self.nodes if _within(n.module, fqn)]

    def module_params(self, fqn: str) -> int:
        return sum(
            s.tensor.numel for s in self.state.values() if not s.is_buffer and _within(_owner(s.fqn), fqn)
        )

    @cached_property
    def params_read_above(self) -> frozenset[str]:
        """Parameters some op reads in the forward of a module above the one holding them (``self.pos.weight[:n]``
        in the model's own forward; a head tied to an embedding is read by a module holding it too, so is not one)."""
        found = set()
        for node in self.nodes:
            for source in node.sources:
                state = self.state.get(source.state) if source.state is not None else None
                if state is not None and not state.is_buffer:
                    holder = _owner(state.fqn)
                    if holder != node.module and _within(holder, node.module):
                        found.add(state.fqn)
        return frozenset(found)

    @cached_property
    def _unit_index(self) -> tuple[frozenset[str], frozenset[str]]:
        units = frozenset(fqn for g in self.repeats for fqn in g.instances)
        ancestors = frozenset(".".join(u.split(".")[:d]) for u in units for d in range(u.count(".") + 1))
        return units, ancestors

    def layer_of(self, module: str) -> str:
        """The profile row a module belongs to: its shallowest ancestor that is a repeated unit or contains none.

        Repeated units (transformer blocks) become one row each; the rest (embeddings, final norm, head) groups
        under the outermost module that holds no repeated block, and ops run directly by an ancestor of the blocks
        (the loss, say) stay with that ancestor. Without repeats the rows are the root's children.
        """
        units, ancestors = self._unit_index
        parts = module.split(".") if module else []
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix in units or prefix not in ancestors:
                return prefix
        return module

    def layers(self) -> list[LayerSummary]:
        """Per-layer totals in first-execution order (what ``autopar profile`` prints). A module that runs no op of
        its own (a position table its parent slices) takes its place where its parameters are first read."""
        rows: dict[str, LayerSummary] = {}
        for n in self.nodes:
            for source in n.sources:
                info = self.state.get(source.state) if source.state else None
                if info is not None and not info.is_buffer:
                    owner = self.layer_of(_owner(info.fqn))
                    if owner not in rows:
                        rows[owner] = LayerSummary(name=owner, module_type=self.modules.get(owner, ""))
            name = self.layer_of(n.module)
            row = rows.get(name)
            if row is None:
                row = rows[name] = LayerSummary(name=name, module_type=self.modules.get(name, ""))
            row.flops_forward += n.flops_forward
            row.flops_backward += n.flops_backward
            row.saved_bytes += n.saved_bytes
            row.nodes += 1
        for s in self.state.values():
            if s.is_buffer:
                continue
            name = self.layer_of(_owner(s.fqn))
            if name not in rows:
                rows[name] = LayerSummary(name=name, module_type=self.modules.get(name, ""))
            rows[name].params += s.tensor.numel
        return list(rows.values())

    def module_memory(self, fqn: str) -> ModuleMemory:
        """MAP memory categories of module ``fqn``; see `ModuleMemory`."""
        inside = self.module_nodes(fqn)
        ids = {n.id for n in inside}
        consumed_outside: set[tuple[int, int]] = set()
        for n in self.nodes:
            if n.id in ids:
                continue
            for s in n.sources:
                if s.node in ids:
                    consumed_outside.add((s.node, s.index))
        fwd_out = sum(
            inside_node.outputs[i].nbytes
            for inside_node in inside
            for i in range(len(inside_node.outputs))
            if (inside_node.id, i) in consumed_outside
        )
        fwd_in = sum(n.saved_bytes for n in inside)
        produced = sum(n.output_bytes for n in inside)
        fwd_tmp = max(0, produced - fwd_in - fwd_out)
        external = {
            (s.node, s.index): t.nbytes
            for n in inside
            for t, s in zip(n.inputs, n.sources)
            if s.node not in ids and s.state is None and t.dtype.startswith(("float", "bfloat"))
        }
        bwd_out = sum(external.values())
        bwd_tmp = max((n.output_bytes for n in inside), default=0)
        return ModuleMemory(fwd_in=fwd_in, fwd_tmp=fwd_tmp, fwd_out=fwd_out, bwd_tmp=bwd_tmp, bwd_out=bwd_out)


@dataclass(slots=True)
class LayerSummary:
    name: str
    module_type: str
    params: int = 0
    flops_forward: int = 0
    flops_backward: int = 0
    saved_bytes: int = 0
    nodes: int = 0


def _owner(state_fqn: str) -> str:
    return state_fqn.rpartition(".")[0]


def _within(module: str, ancestor: str) -> bool:
    return not ancestor or module == ancestor or module.startswith(ancestor + ".")
