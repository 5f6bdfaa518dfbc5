"""Symbolic profiler (MAP section 4.1): run a model's forward on fake CPU tensors and record every aten op.

How it works:
- Parameters, buffers and example inputs are replaced by fake CPU tensors (`FakeTensorMode`): no memory is
  allocated, and kernels are chosen as on a real CPU, so SDPA lowers to the CPU flash kernel and saves what a real
  run saves (the meta device would take the math path and save the full score matrix).
- A `TorchDispatchMode` above the fake mode sees each aten op once autograd has decomposed it, and records shapes,
  dtypes, FLOPs, bytes and where each input came from. Global module hooks keep the stack of running modules, so
  every node knows its owning module.
- `saved_tensors_hooks` observe exactly what autograd keeps for backward. Autograd packs an op's inputs just before
  the op reaches the dispatch mode and its outputs just after, so a packed tensor that is an output of the op just
  recorded (in the same module) belongs to it, and any other belongs to the next op in the module it was packed
  in. Each storage is counted once, by the first op that saves it; parameters and buffers are model state, not
  activations.
- Repeated modules (see `reuse`) are traced on first call and replayed afterwards: the replay returns fresh fake
  outputs of the recorded shapes and the graph gets a renamed copy of the first instance's nodes. Pack events are
  replayed too, with the template's input and output storages mapped to the replay's, so a tensor shared by all
  layers (an encoder output, rotary tables) is still counted once.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.capture import _hf_compat
from autopar.capture import _torch_private as tp
from autopar.capture.flops import backward_flops, forward_flops
from autopar.capture.graph import TENSOR_ARG, Graph, Node, Ref, RepeatGroup, StateInfo, TensorInfo, dtype_name
from autopar.capture.reuse import input_signature, scan

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """The model could not be traced symbolically; the message names the module and, when known, the aten op."""


def _fake_only(exc: BaseException) -> bool:
    """Whether ``exc`` is fake tensors' own limit (an op with no fake kernel, a shape that depends on values), not
    the op refusing its inputs' shapes as the real op would."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    limits = (fake_tensor.DynamicOutputShapeException, fake_tensor.DataDependentOutputException,
              fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException,
              GuardOnDataDependentSymNode, NotImplementedError)
    return isinstance(exc, limits)


@contextlib.contextmanager
def quiet_log(name: str) -> Iterator[None]:
    """Inside, the logger ``name`` logs only what is critical: errors the caller reports in its own words."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def fake_errors_quiet() -> contextlib.AbstractContextManager[None]:
    """Inside, PyTorch's fake-tensor mode does not log the whole traceback of an op it cannot run ("failed while
    attempting to run meta for ...") before raising it: `trace` names the module and the op in one line itself
    (`CaptureError`), and a rehearsal on fake tensors reports its own failure."""
    return quiet_log("torch._subclasses.fake_tensor")


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    reuse: bool = True,
) -> Graph:
    """Trace ``model(*example_inputs, **example_kwargs)`` on fake tensors and return its forward `Graph`.

    The model may live on the meta device, on CPU or on an accelerator: only shapes, dtypes and ``requires_grad``
    of its parameters and of the example inputs are used, and the model object is left unchanged. With ``reuse``
    (the default) repeated modules are traced once; pass ``reuse=False`` to trace every instance.
    """
    start = time.perf_counter()
    recorder = _Recorder(model, reuse=reuse)
    with fake_errors_quiet():
        graph = recorder.run(tuple(example_inputs), dict(example_kwargs or {}))
    graph.trace_seconds = time.perf_counter() - start
    log.info("traced %s: %d nodes in %.2f s", type(model).__name__, graph.num_nodes, graph.trace_seconds)
    return graph


# ------------------------------------------------------------------------------------------------------------------
# Live records. A live source is ("out", entry, index) for an op output, ("in", index) for a model input, or None.

_Source = tuple[Any, ...] | None
# ops whose schema declares a new tensor but which return a view of their input (no copy, no kernel): `matmul`
# reshapes its 2-D product back to 3-D with `_unsafe_view`
_VIEWS_IN_EFFECT = frozenset({torch.ops.aten._unsafe_view.default})


@dataclass(slots=True)
class _Draft:
    op: str
    module: str
    inputs: tuple[TensorInfo, ...]
    sources: tuple[_Source, ...]
    states: tuple[str | None, ...]
    outputs: tuple[TensorInfo, ...]
    flops_forward: int
    flops_backward: int
    bytes_read: int
    bytes_written: int
    is_view: bool
    args: tuple[Any, ...]
    piece: bool = False  # `Node.piece`


@dataclass(slots=True)
class _Save:
    """One tensor packed for backward: the live entry that saves it (set once known), its storage and size."""

    target: int | None
    key: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(slots=True)
class _Template:
    fingerprint: str
    fqn: str
    start: int
    end: int
    input_sources: tuple[_Source, ...]
    output_sources: tuple[_Source, ...]
    output_spec: Any
    output_leaves: tuple[Any, ...]  # non-tensor leaves as they were, tensors as _TensorSpec
    events: tuple[int, int]  # range of pack events recorded while it ran
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]


@dataclass(slots=True)
class _Replay:
    template: _Template
    fqn: str
    input_sources: tuple[_Source, ...]
    storage_sizes: dict[int, int]  # template storage key -> size of the replay's storage in its place
    storage_keys: dict[int, int]  # template storage key -> the replay's storage key (inputs and outputs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# ops whose fake-tensor kernel on CPU takes bf16 inputs only, where the real op takes fp32 too (grouped matmul:
# Hugging Face's MoE experts); their output shapes do not depend on the dtype
_BF16_ONLY_FAKE = frozenset({"aten::_grouped_mm"})


def _shapes_in_bf16(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The outputs of ``func`` for fp32 inputs its fake kernel refuses, where it takes bf16 only: run in bf16 and
    cast back, which gives the fp32 op's shapes (and bytes, the outputs being fp32 again). None for any other op
    or inputs, and where the bf16 op fails too (the fp32 op then raises its own error)."""
    if func._schema.name not in _BF16_ONLY_FAKE:
        return None
    leaves, spec = tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in leaves):
        return None
    cast = [t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in leaves]
    args16, kwargs16 = tree_unflatten(cast, spec)
    try:
        out = func(*args16, **kwargs16)
    except Exception:  # noqa: BLE001 - not the dtype after all: the caller reports the first error
        return None
    flat, out_spec = tree_flatten(out)
    return tree_unflatten([t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
                           for t in flat], out_spec)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _plain_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Positional arguments as plain hashable values: a tensor becomes ``TENSOR_ARG``, a sequence a tuple, another
    object its string (dims, sizes and scalars are what later stages read)."""

    def plain(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return TENSOR_ARG
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        return str(a)

    return tuple(tuple(plain(x) for x in a) if isinstance(a, (list, tuple)) else plain(a) for a in args)


def _info(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(t.shape), dtype_name(t.dtype))


class _Recorder(tp.TorchDispatchMode):
    def __init__(self, model: nn.Module, *, reuse: bool) -> None:
        super().__init__()
        self.model = model
        modules = scan(model, find_repeats=reuse)
        self.fqn_of, self.type_of, self.units = modules.fqn_of, modules.types, modules.units
        self.multi_query = frozenset(modules.multi_query)
        self.fake_mode = tp.FakeTensorMode(allow_non_fake_inputs=True)
        self.entries: list[_Draft | _Replay] = []
        self.producer: dict[int, tuple[Any, ...]] = {}
        self.keep: list[torch.Tensor] = []  # holds every traced tensor so ids and storages stay unique
        self.state_storage: dict[int, str] = {}
        self.fakes: dict[int, torch.Tensor] = {}  # id(real parameter or buffer) -> its fake
        # id(real parameter or buffer) -> its name as `named_parameters` gives it: a tensor two modules share (a tied
        # head) is named so whichever module is swapped in first (a repeated unit's, when it is called)
        self.canonical = {id(t): name for name, t in (*model.named_parameters(), *model.named_buffers())}
        self.swapped: list[tuple[dict[str, Any], str, Any]] = []  # (module._parameters or _buffers, name, real)
        self.events: list[_Save | int] = []  # pack events in time order; an int is the entry index of a replay
        self.pending: list[tuple[_Save, str]] = []  # packed before the op that saves them, with the pack's module
        self.last_entry: int | None = None
        self.last_outputs: set[int] = set()
        self.last_in_module: dict[str, int] = {}
        # (producer of the sliced tensor, dim) -> [(entry, start, stop)] of its unit-step slices (`_note_slice`)
        self.slices: dict[tuple[Any, int], list[tuple[int, int, int]]] = {}
        self.module_stack: list[str] = [""]
        self.templates: dict[tuple[str, Any], _Template] = {}
        # (fingerprint, fqn, the template it ran as, or the entry index of its replay), in call order
        self.instances: list[tuple[str, str, _Template | int]] = []
        self.recording = False

    # ---- driving -------------------------------------------------------------------------------------------
    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Graph:
        hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._exit),
        ]
        patched = self._patch_units()
        try:
            with self.fake_mode, _hf_compat.real_execution_paths():
                # Repeated layers get fake state only when they run as a template: replays never touch theirs.
                self._swap_in(self._modules_outside_units())
                (fake_args, fake_kwargs), input_infos = self._fake_inputs((args, kwargs))
                with self, torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                    self.recording = True
                    try:
                        self.model(*fake_args, **fake_kwargs)
                    except CaptureError:
                        raise
                    except Exception as exc:
                        module = self.module_stack[-1]
                        raise CaptureError(
                            f"cannot trace module '{module or '<root>'}' ({self.type_of.get(module, '?')}): "
                            f"{type(exc).__name__}: {exc}"
                        ) from exc
                    finally:
                        self.recording = False
        finally:
            for h in hooks:
                h.remove()
            for module, had_own in patched:
                if had_own is None:
                    del module.forward
                else:
                    module.forward = had_own
            for table, name, real in reversed(self.swapped):
                table[name] = real
        self._flush_pending(None)
        self.keep.clear()
        self.producer.clear()
        self.slices.clear()
        return _GraphBuilder(self, input_infos).build()

    def _modules_outside_units(self) -> list[nn.Module]:
        """Pre-order, like `named_modules`, so a shared tensor is named where `named_parameters` names it."""
        found, todo = [], [self.model]
        while todo:
            module = todo.pop()
            if id(module) in self.units:
                continue
            found.append(module)
            todo.extend(reversed([c for c in module._modules.values() if c is not None]))
        return found

    def _swap_in(self, modules: Sequence[nn.Module] | Any) -> None:
        """Put fake tensors in place of the modules' own parameters and buffers (undone when the trace ends)."""
        for module in modules:
            for table, is_buffer in ((module._parameters, False), (module._buffers, True)):
                for name, real in table.items():
                    if real is None or isinstance(real, tp.FakeTensor):
                        continue
                    fake = self.fakes.get(id(real))
                    if fake is None:
                        grad = bool(real.requires_grad) and not is_buffer
                        fake = self._new_fake(tuple(real.shape), real.stride(), real.dtype, grad)
                        self.fakes[id(real)] = fake
                        prefix = self.fqn_of.get(id(module), "?")
                        self.state_storage[_storage_key(fake)] = self.canonical.get(
                            id(real), f"{prefix}.{name}" if prefix else name)
                    self.swapped.append((table, name, real))
                    table[name] = fake

    def _new_fake(
        self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool
    ) -> torch.Tensor:
        return tp.new_fake(self.fake_mode, shape, stride, dtype, requires_grad)  # dispatch modes are off inside

    def state_infos(self) -> dict[str, StateInfo]:
        """Parameters (as `named_parameters` names them) and buffers; read only when someone asks."""
        infos = {
            name: StateInfo(name, _info(p), bool(p.requires_grad)) for name, p in self.model.named_parameters()
        }
        for name, b in self.model.named_buffers():
            infos[name] = StateInfo(name, _info(b), False, is_buffer=True)
        return infos

    def _fake_inputs(self, tree: Any) -> tuple[Any, tuple[TensorInfo, ...]]:
        leaves, spec = tree_flatten(tree)
        infos: list[TensorInfo] = []
        out = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                fake = self._new_fake(tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.requires_grad)
                self.producer[id(fake)] = ("in", len(infos))
                self.keep.append(fake)
                infos.append(_info(leaf))
                leaf = fake
            out.append(leaf)
        return tree_unflatten(out, spec), tuple(infos)

    def _note_slice(self, index: int, draft: _Draft) -> None:
        """Mark slices of one tensor along one dim (step 1, in one module) as pieces (`Node.piece`) once together
        they cover the dim exactly, each part once: the cost model then splits that dim freely as it does a
        ``split``'s, each rank holding its share of every piece (as the runtime lays a fused projection out)."""
        args = draft.args
        size = draft.inputs[0].shape
        if len(args) < 2 or not isinstance(args[1], int) or not size or draft.sources[0] is None:
            return
        dim = args[1] % len(size)
        start, stop, step = (list(args[2:5]) + [None, None, None])[:3]
        if step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (start, stop)):
            return
        width = size[dim]
        start = 0 if start is None else max(0, min(width, start + width if start < 0 else start))
        stop = width if stop is None else max(0, min(width, stop + width if stop < 0 else stop))
        key = (draft.sources[0], dim)
        seen = self.slices.setdefault(key, [])
        if seen and self.entries[seen[0][0]].module != draft.module:
            return
        seen.append((index, start, stop))
        spans = sorted((a, b) for _, a, b in seen)
        if len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == width and all(
                a < b and b == c for (a, b), (c, _) in zip(spans, spans[1:])) and spans[-1][0] < spans[-1][1]:
            for entry, _, _ in seen:
                marked = self.entries[entry]
                if isinstance(marked, _Draft):
                    marked.piece = True

    def _enter(self, module: nn.Module, _args: Any) -> None:
        self.module_stack.append(self.fqn_of.get(id(module), self.module_stack[-1]))

    def _exit(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if len(self.module_stack) > 1:
            self.module_stack.pop()

    # ---- the dispatch mode ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if not self.recording or func.namespace == "prim":
            return func(*args, **kwargs)
        try:
            out = _shapes_in_bf16(func, args, kwargs)
            if out is None:
                out = func(*args, **kwargs)
        except Exception as exc:
            module = self.module_stack[-1]
            where = f"cannot trace module '{module or '<root>'}' ({self.type_of.get(module, '?')}): aten op {func}"
            if not _fake_only(exc):  # the op refuses these shapes, as it would on real tensors
                raise CaptureError(
                    f"{where} fails on the shapes the model gives it ({type(exc).__name__}: {exc}); a real forward "
                    "would fail the same way: check that the model's sizes fit together (its config, or the "
                    "--hidden, --heads, --ffn and similar overrides)") from exc
            raise CaptureError(
                f"{where} has no symbolic (fake-tensor) implementation for these inputs: {type(exc).__name__}: {exc}. "
                "Data-dependent shapes (nonzero, masked_select, .item() in control flow) cannot be planned; "
                "rewrite the module with static shapes."
            ) from exc
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        module = self.module_stack[-1]
        ins = _tensor_leaves((args, kwargs))
        outs = _tensor_leaves(out)
        returns = func._schema.returns
        is_view = func in _VIEWS_IN_EFFECT or (
            bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))
        fwd = forward_flops(func, args, kwargs, out)
        seen: set[int] = set()
        read = 0
        if not is_view:
            for t in ins:
                if id(t) not in seen:
                    seen.add(id(t))
                    read += t.numel() * t.element_size()
        draft = _Draft(
            op=str(func),
            module=module,
            inputs=tuple(_info(t) for t in ins),
            sources=tuple(self.producer.get(id(t)) for t in ins),
            states=tuple(self.state_storage.get(_storage_key(t)) for t in ins),
            outputs=tuple(_info(t) for t in outs),
            flops_forward=fwd,
            flops_backward=backward_flops(func, args, fwd),
            bytes_read=read,
            bytes_written=0 if is_view else sum(t.numel() * t.element_size() for t in outs),
            is_view=is_view,
            args=_plain_args(args),
        )
        index = len(self.entries)
        self.entries.append(draft)
        if func is torch.ops.aten.slice.Tensor and ins:
            self._note_slice(index, draft)
        for k, t in enumerate(outs):
            self.producer[id(t)] = ("out", index, k)
            self.keep.append(t)
        self._flush_pending(index)
        self.last_entry = None if is_view else index
        self.last_outputs = {id(t) for t in outs}
        self.last_in_module[module] = index

    # ---- saved tensors --------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.recording:
            return t
        key = _storage_key(t)
        if key in self.state_storage:
            return t
        self.keep.append(t)
        event = _Save(None, key, t.untyped_storage().nbytes())
        self.events.append(event)
        module = self.module_stack[-1]
        last = self.last_entry
        if last is not None and id(t) in self.last_outputs and self.entries[last].module == module:
            event.target = last
        else:
            self.pending.append((event, module))
        return t

    def _flush_pending(self, index: int | None) -> None:
        """Give tensors packed before op ``index`` to it, or to the last op of the module they were packed in."""
        for event, module in self.pending:
            target = index
            if target is None or self.entries[target].module != module:
                target = self.last_in_module.get(module, target)
            event.target = target
        self.pending.clear()

    # ---- repeated units -------------------------------------------------------------------------------------
    def _patch_units(self) -> list[tuple[nn.Module, Callable[..., Any] | None]]:
        patched = []
        for module in self.model.modules():
            fingerprint = self.units.get(id(module))
            if fingerprint is None:
                continue
            own = module.__dict__.get("forward")
            module.forward = self._unit_forward(module, fingerprint, module.forward)
            patched.append((module, own))
        return patched

    def _unit_forward(self, module: nn.Module, fingerprint: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        fqn = self.fqn_of[id(module)]

        def run_unit(*args: Any, **kwargs: Any) -> Any:
            signature, inputs = input_signature(args, kwargs)
            sources = tuple(self.producer.get(id(t)) for t in inputs)
            template = self.templates.get((fingerprint, signature))
            if template is not None:
                return self._replay(template, fqn, sources, inputs)
            input_keys = tuple(_storage_key(t) for t in inputs)
            start, first_event = len(self.entries), len(self.events)
            self._swap_in(module.modules())
            out = forward(*args, **kwargs)
            self._flush_pending(None)
            leaves, spec = tree_flatten(out)
            self.templates[(fingerprint, signature)] = _Template(
                fingerprint=fingerprint,
                fqn=fqn,
                start=start,
                end=len(self.entries),
                input_sources=sources,
                output_sources=tuple(self.producer.get(id(x)) for x in leaves if isinstance(x, torch.Tensor)),
                output_spec=spec,
                output_leaves=tuple(
                    _TensorSpec(tuple(x.shape), x.stride(), x.dtype, x.requires_grad)
                    if isinstance(x, torch.Tensor)
                    else x
                    for x in leaves
                ),
                events=(first_event, len(self.events)),
                input_keys=input_keys,
                output_keys=tuple(_storage_key(x) for x in leaves if isinstance(x, torch.Tensor)),
            )
            self.instances.append((fingerprint, fqn, self.templates[(fingerprint, signature)]))
            return out

        return run_unit

    def _replay(
        self, template: _Template, fqn: str, sources: tuple[_Source, ...], inputs: list[torch.Tensor]
    ) -> Any:
        index = len(self.entries)
        self.instances.append((template.fingerprint, fqn, index))
        self.events.append(index)
        leaves, outputs = [], []
        for leaf in template.output_leaves:
            if isinstance(leaf, _TensorSpec):
                t = self._new_fake(leaf.shape, leaf.stride, leaf.dtype, leaf.requires_grad)
                self.producer[id(t)] = ("out", index, len(outputs))
                self.keep.append(t)
                outputs.append(t)
                leaf = t
            leaves.append(leaf)
        # Template storages map to the replay's own: outputs first, so an input passed through maps to the input.
        storage_keys, storage_sizes = {}, {}
        for theirs, ours in [*zip(template.output_keys, outputs), *zip(template.input_keys, inputs)]:
            storage_keys[theirs] = _storage_key(ours)
            storage_sizes[theirs] = ours.untyped_storage().nbytes()
        self.entries.append(_Replay(template, fqn, sources, storage_sizes, storage_keys))
        self.last_entry = None
        self.last_outputs = set()
        return tree_unflatten(leaves, template.output_spec)

def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _GraphBuilder:
    """Turns live entries (drafts and replays) into a `Graph`.

    Everything a graph reports in total (node count, FLOPs, saved bytes, repeat spans) is computed here from the
    templates, in time proportional to the distinct layers plus one step per replay. The node list itself, with
    each replay expanded into a renamed copy of its template, is built only when first read (`Graph.nodes`).
    """

    def __init__(self, rec: _Recorder, inputs: tuple[TensorInfo, ...]) -> None:
        self.rec = rec
        self.inputs = inputs
        self._saves_cache: dict[int, list[tuple[int, int, int]]] = {}
        self.position: list[int] = []  # node id at which each live entry starts; one extra entry: the total
        count = 0
        for entry in rec.entries:
            self.position.append(count)
            count += 1 if isinstance(entry, _Draft) else entry.template.end - entry.template.start
        self.position.append(count)

    def node_id(self, entry: int, live: int | None = None) -> int:
        """Node id of live draft ``entry``, or of the copy of template draft ``live`` made by replay ``entry``."""
        if live is None:
            return self.position[entry]
        replay = self.rec.entries[entry]
        assert isinstance(replay, _Replay)
        return self.position[entry] + live - replay.template.start

    def build(self) -> Graph:
        rec = self.rec
        forward = backward = 0
        for entry in rec.entries:
            drafts = [entry] if isinstance(entry, _Draft) else rec.entries[entry.template.start : entry.template.end]
            for d in drafts:
                assert isinstance(d, _Draft)
                forward += d.flops_forward
                backward += d.flops_backward
        saved = self._saved_bytes()
        return Graph(
            modules=dict(rec.type_of),
            state=rec.state_infos,
            inputs=self.inputs,
            repeats=self._groups(),
            num_nodes=self.position[-1],
            flops_forward=forward,
            flops_backward=backward,
            saved_bytes=sum(saved.values()),
            expansion=_Expansion(self, saved),
            multi_query=rec.multi_query,
        )

    def _saved_bytes(self) -> dict[int, int]:
        """Bytes each node saves for backward (node id -> bytes), each storage counted at its first pack in time."""
        saved: dict[int, int] = {}
        seen: set[Any] = set()
        for event in self.rec.events:
            if isinstance(event, _Save):
                if event.target is not None and event.key not in seen:
                    seen.add(event.key)
                    node = self.node_id(event.target)
                    saved[node] = saved.get(node, 0) + event.nbytes
                continue
            replay = self.rec.entries[event]
            assert isinstance(replay, _Replay)
            base, keys, sizes = self.position[event], replay.storage_keys, replay.storage_sizes
            for offset, template_key, nbytes in self._template_saves(replay.template):
                key = keys.get(template_key)
                if key is None:
                    key = (event, template_key)  # a storage made inside the layer: new for every replay
                if key not in seen:
                    seen.add(key)
                    saved[base + offset] = saved.get(base + offset, 0) + sizes.get(template_key, nbytes)
        return saved

    def _template_saves(self, t: _Template) -> list[tuple[int, int, int]]:
        """(node offset within the template, storage key, bytes) of each tensor packed while it ran; cached."""
        cached = self._saves_cache.get(id(t))
        if cached is None:
            cached = []
            for event in self.rec.events[t.events[0] : t.events[1]]:
                assert isinstance(event, _Save)  # units never nest: a template holds no replay
                if event.target is not None and t.start < t.end:
                    live = event.target if t.start <= event.target < t.end else t.start
                    cached.append((live - t.start, event.key, event.nbytes))
            self._saves_cache[id(t)] = cached
        return cached

    def _groups(self) -> list[RepeatGroup]:
        by_key: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        for fingerprint, fqn, run in self.rec.instances:
            if isinstance(run, _Template):
                span = (self.position[run.start], self.position[run.end])
            else:
                span = (self.position[run], self.position[run + 1])
            by_key.setdefault(fingerprint, []).append((fqn, span))
        return [
            RepeatGroup(
                fingerprint=fingerprint,
                module_type=self.rec.type_of.get(members[0][0], ""),
                instances=tuple(m[0] for m in members),
                spans=tuple(m[1] for m in members),
            )
            for fingerprint, members in by_key.items()
        ]


class _Expansion:
    """The node list: live drafts as they are, each replay as a renamed copy of its template's drafts. Built whole
    (`nodes`) or one node at a time (`node`, for planners that read a few layers of a deep model)."""

    def __init__(self, builder: _GraphBuilder, saved: dict[int, int]) -> None:
        self.b = builder
        self.rec = builder.rec
        self.saved = saved
        self.replay_outputs: dict[int, tuple[Ref, ...]] = {}  # live replay index -> its output refs
        self._contexts: dict[int, Callable[[_Source, str | None], Ref]] = {}
        self._renames: dict[int, Callable[[str], str]] = {}
        self._resolved_upto = 0  # replays before this entry index have their outputs in replay_outputs

    def nodes(self) -> list[Node]:
        out: list[Node] = []
        for index, entry in enumerate(self.rec.entries):
            if isinstance(entry, _Draft):
                sources = tuple(self._resolve(s, st) for s, st in zip(entry.sources, entry.states))
                out.append(self._node(entry, sources, entry.module, len(out)))
            else:
                translate, rename = self._context(index), self._renames[index]
                for live in range(entry.template.start, entry.template.end):
                    d = self.rec.entries[live]
                    assert isinstance(d, _Draft)  # units never nest, so a template holds drafts only
                    sources = tuple(translate(s, st) for s, st in zip(d.sources, d.states))
                    out.append(self._node(d, sources, rename(d.module), len(out)))
                self._outputs(index)
        return out

    def node(self, node_id: int) -> Node:
        if not 0 <= node_id < self.b.position[-1]:
            raise IndexError(f"node {node_id} out of range")
        index = bisect.bisect_right(self.b.position, node_id) - 1
        entry = self.rec.entries[index]
        self._outputs_before(index)
        if isinstance(entry, _Draft):
            sources = tuple(self._resolve(s, st) for s, st in zip(entry.sources, entry.states))
            return self._node(entry, sources, entry.module, node_id)
        d = self.rec.entries[entry.template.start + node_id - self.b.position[index]]
        assert isinstance(d, _Draft)
        translate = self._context(index)
        sources = tuple(translate(s, st) for s, st in zip(d.sources, d.states))
        return self._node(d, sources, self._renames[index](d.module), node_id)

    def _node(self, d: _Draft, sources: tuple[Ref, ...], module: str, node_id: int) -> Node:
        return Node(
            id=node_id,
            op=d.op,
            module=module,
            module_type=self.rec.type_of.get(module, ""),
            inputs=d.inputs,
            sources=sources,
            outputs=d.outputs,
            flops_forward=d.flops_forward,
            flops_backward=d.flops_backward,
            bytes_read=d.bytes_read,
            bytes_written=d.bytes_written,
            saved_bytes=self.saved.get(node_id, 0),
            is_view=d.is_view,
            args=d.args,
            piece=d.piece,
        )

    def _resolve(self, source: _Source, state: str | None) -> Ref:
        if source is None:
            return Ref(-1, 0, state)
        if source[0] == "in":
            return Ref(-1, source[1], state)
        _, entry, k = source
        if isinstance(self.rec.entries[entry], _Draft):
            return Ref(self.b.node_id(entry), k, state)
        ref = self._outputs(entry)[k]
        return Ref(ref.node, ref.index, state if state is not None else ref.state)

    def _outputs_before(self, index: int) -> None:
        """Resolve every earlier replay's outputs in order (a loop, not a recursion 1,000 layers deep)."""
        for earlier in range(self._resolved_upto, index):
            if isinstance(self.rec.entries[earlier], _Replay):
                self._outputs(earlier)
        self._resolved_upto = max(self._resolved_upto, index)

    def _outputs(self, index: int) -> tuple[Ref, ...]:
        outputs = self.replay_outputs.get(index)
        if outputs is None:
            t = self.rec.entries[index].template
            translate = self._context(index)
            outputs = self.replay_outputs[index] = tuple(translate(s, None) for s in t.output_sources)
        return outputs

    def _context(self, index: int) -> Callable[[_Source, str | None], Ref]:
        """How replay ``index`` names things: its template's sources translated to node ids, FQNs renamed."""
        cached = self._contexts.get(index)
        if cached is not None:
            return cached
        replay = self.rec.entries[index]
        assert isinstance(replay, _Replay)
        t = replay.template
        old, new = t.fqn, replay.fqn
        cut = len(old)

        def rename(name: str) -> str:
            return new + name[cut:] if name == old or name.startswith(old + ".") else name

        outside = {src: i for i, src in enumerate(t.input_sources) if src is not None}
        call_inputs = [self._resolve(s, None) for s in replay.input_sources]
        base = self.b.position[index] - t.start

        def translate(src: _Source, state: str | None) -> Ref:
            state = rename(state) if state is not None else None
            if src is not None and src[0] == "out" and t.start <= src[1] < t.end:
                return Ref(base + src[1], src[2], state)
            if src in outside:
                ref = call_inputs[outside[src]]
                return Ref(ref.node, ref.index, state if state is not None else ref.state)
            return self._resolve(src, state)

        self._contexts[index] = translate
        self._renames[index] = rename
        return translate
