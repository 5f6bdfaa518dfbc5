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

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.capture import _torch_private as tp
from autopar.capture.flops import backward_flops, forward_flops
from autopar.capture.graph import Graph, Node, Ref, RepeatGroup, StateInfo, TensorInfo, dtype_name
from autopar.capture.reuse import find_units, input_signature

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """The model could not be traced symbolically; the message names the module and, when known, the aten op."""


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
    graph = recorder.run(tuple(example_inputs), dict(example_kwargs or {}))
    graph.trace_seconds = time.perf_counter() - start
    log.info("traced %s: %d nodes in %.2f s", type(model).__name__, len(graph.nodes), graph.trace_seconds)
    return graph


# ------------------------------------------------------------------------------------------------------------------
# Live records. A live source is ("out", entry, index) for an op output, ("in", index) for a model input, or None.

_Source = tuple[Any, ...] | None


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


@dataclass(slots=True)
class _Save:
    """One tensor packed for backward: the live entry that saves it (set once known), its storage and size."""

    target: int | None
    key: int
    nbytes: int


@dataclass(slots=True)
class _Template:
    fingerprint: str
    fqn: str
    start: int
    end: int
    input_sources: tuple[_Source, ...]
    output_sources: tuple[_Source, ...]
    output_spec: Any
    output_leaves: tuple[Any, ...]  # non-tensor leaves as they were; tensors as (shape, stride, dtype, grad)
    events: tuple[int, int]  # range of pack events recorded while it ran
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]


@dataclass(slots=True)
class _Replay:
    template: _Template
    fqn: str
    input_sources: tuple[_Source, ...]
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _info(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(t.shape), dtype_name(t.dtype))


class _Recorder(tp.TorchDispatchMode):
    def __init__(self, model: nn.Module, *, reuse: bool) -> None:
        super().__init__()
        self.model = model
        self.fqn_of = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.type_of = {name: type(m).__name__ for name, m in model.named_modules()}
        self.units = find_units(model) if reuse else {}
        self.entries: list[_Draft | _Replay] = []
        self.producer: dict[int, tuple[Any, ...]] = {}
        self.keep: list[torch.Tensor] = []  # holds every traced tensor so ids and storages stay unique
        self.state_storage: dict[int, str] = {}
        self.events: list[_Save | int] = []  # pack events in time order; an int is the entry index of a replay
        self.pending: list[tuple[_Save, str]] = []  # packed before the op that saves them, with the pack's module
        self.last_entry: int | None = None
        self.last_outputs: set[int] = set()
        self.last_in_module: dict[str, int] = {}
        self.module_stack: list[str] = [""]
        self.templates: dict[tuple[str, Any], _Template] = {}
        self.instances: list[tuple[str, str, int]] = []  # (fingerprint, fqn, live entry index), call order
        self.recording = False

    # ---- driving -------------------------------------------------------------------------------------------
    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Graph:
        fake_mode = tp.FakeTensorMode(allow_non_fake_inputs=True)
        hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._exit),
        ]
        patched = self._patch_units()
        try:
            with fake_mode:
                state, state_infos = self._fake_state()
                (fake_args, fake_kwargs), input_infos = self._fake_inputs((args, kwargs))
                with self, torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                    self.recording = True
                    try:
                        torch.func.functional_call(self.model, state, fake_args, fake_kwargs)
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
        self._flush_pending(None)
        return self._build(state_infos, input_infos)

    def _fake_state(self) -> tuple[dict[str, torch.Tensor], dict[str, StateInfo]]:
        tensors: dict[str, torch.Tensor] = {}
        infos: dict[str, StateInfo] = {}
        named = [(n, p, False) for n, p in self.model.named_parameters()]
        named += [(n, b, True) for n, b in self.model.named_buffers()]
        for name, real, is_buffer in named:
            fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="cpu")
            if real.requires_grad and not is_buffer:
                fake.requires_grad_(True)
            tensors[name] = fake
            self.state_storage[_storage_key(fake)] = name
            self.keep.append(fake)
            infos[name] = StateInfo(name, _info(real), bool(real.requires_grad) and not is_buffer, is_buffer)
        return tensors, infos

    def _fake_inputs(self, tree: Any) -> tuple[Any, tuple[TensorInfo, ...]]:
        leaves, spec = tree_flatten(tree)
        infos: list[TensorInfo] = []
        out = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                fake = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="cpu")
                if leaf.requires_grad:
                    fake.requires_grad_(True)
                self.producer[id(fake)] = ("in", len(infos))
                self.keep.append(fake)
                infos.append(_info(leaf))
                leaf = fake
            out.append(leaf)
        return tree_unflatten(out, spec), tuple(infos)

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
            out = func(*args, **kwargs)
        except Exception as exc:
            module = self.module_stack[-1]
            raise CaptureError(
                f"cannot trace module '{module or '<root>'}' ({self.type_of.get(module, '?')}): aten op {func} "
                f"has no symbolic (fake-tensor) implementation for these inputs: {type(exc).__name__}: {exc}. "
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
        is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
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
        )
        index = len(self.entries)
        self.entries.append(draft)
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
            signature = input_signature(args, kwargs)
            inputs = _tensor_leaves((args, kwargs))
            sources = tuple(self.producer.get(id(t)) for t in inputs)
            input_keys = tuple(_storage_key(t) for t in inputs)
            template = self.templates.get((fingerprint, signature))
            if template is not None:
                return self._replay(template, fqn, sources, input_keys)
            start, first_event = len(self.entries), len(self.events)
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
                    (tuple(x.shape), x.stride(), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else x
                    for x in leaves
                ),
                events=(first_event, len(self.events)),
                input_keys=input_keys,
                output_keys=tuple(_storage_key(x) for x in leaves if isinstance(x, torch.Tensor)),
            )
            self.instances.append((fingerprint, fqn, start))
            return out

        return run_unit

    def _replay(
        self, template: _Template, fqn: str, sources: tuple[_Source, ...], input_keys: tuple[int, ...]
    ) -> Any:
        index = len(self.entries)
        self.instances.append((template.fingerprint, fqn, index))
        self.events.append(index)
        leaves, output_keys = [], []
        self.recording = False
        try:
            k = 0
            for leaf in template.output_leaves:
                if isinstance(leaf, tuple) and len(leaf) == 4 and isinstance(leaf[2], torch.dtype):
                    shape, stride, dtype, grad = leaf
                    t = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
                    if grad:
                        t.requires_grad_(True)
                    self.producer[id(t)] = ("out", index, k)
                    self.keep.append(t)
                    output_keys.append(_storage_key(t))
                    k += 1
                    leaf = t
                leaves.append(leaf)
        finally:
            self.recording = True
        self.entries.append(_Replay(template, fqn, sources, input_keys, tuple(output_keys)))
        self.last_entry = None
        self.last_outputs = set()
        return tree_unflatten(leaves, template.output_spec)

    # ---- final graph ----------------------------------------------------------------------------------------
    def _build(self, state_infos: dict[str, StateInfo], input_infos: tuple[TensorInfo, ...]) -> Graph:
        return _GraphBuilder(self, state_infos, input_infos).build()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _GraphBuilder:
    """Turns live entries (drafts and replays) into numbered `Node`s, expanding each replay into a renamed copy."""

    def __init__(self, rec: _Recorder, state: dict[str, StateInfo], inputs: tuple[TensorInfo, ...]) -> None:
        self.rec = rec
        self.state = state
        self.inputs = inputs
        self.nodes: list[Node] = []
        self.live_id: dict[int, int] = {}  # live draft index -> node id
        self.replay_outputs: dict[int, tuple[Ref | None, ...]] = {}  # live replay index -> output refs
        self.spans: dict[int, tuple[int, int]] = {}  # live entry index where a unit instance starts -> node span
        self.copies: dict[int, dict[int, int]] = {}  # live replay index -> template live index -> copy node id

    def build(self) -> Graph:
        rec = self.rec
        position: list[int] = []  # node id at which each live entry starts
        for index, entry in enumerate(rec.entries):
            position.append(len(self.nodes))
            if isinstance(entry, _Draft):
                self.live_id[index] = len(self.nodes)
                self.nodes.append(self._node(entry, self._resolve_all(entry.sources, entry.states)))
            else:
                self._expand(index, entry)
        position.append(len(self.nodes))
        for t in rec.templates.values():
            self.spans[t.start] = (position[t.start], position[t.end])
        saved = self._saved_bytes()
        nodes = [replace(n, saved_bytes=saved[n.id]) if saved[n.id] else n for n in self.nodes]
        return Graph(
            nodes=nodes,
            modules=dict(rec.type_of),
            state=self.state,
            inputs=self.inputs,
            repeats=self._groups(),
        )

    def _node(self, d: _Draft, sources: tuple[Ref, ...], module: str | None = None) -> Node:
        module = d.module if module is None else module
        return Node(
            id=len(self.nodes),
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
            is_view=d.is_view,
        )

    def _resolve(self, source: _Source, state: str | None) -> Ref:
        if source is None:
            return Ref(-1, 0, state)
        if source[0] == "in":
            return Ref(-1, source[1], state)
        _, entry, k = source
        if entry in self.live_id:
            return Ref(self.live_id[entry], k, state)
        ref = self.replay_outputs[entry][k]
        if ref is None:
            return Ref(-1, 0, state)
        return Ref(ref.node, ref.index, state if state is not None else ref.state)

    def _resolve_all(self, sources: Sequence[_Source], states: Sequence[str | None]) -> tuple[Ref, ...]:
        return tuple(self._resolve(s, st) for s, st in zip(sources, states))

    def _expand(self, index: int, replay: _Replay) -> None:
        t = replay.template
        old, new = t.fqn, replay.fqn
        rename = lambda name: new + name[len(old):] if name == old or name.startswith(old + ".") else name  # noqa: E731
        entry_map = self.copies[index] = {}
        outside = {src: i for i, src in enumerate(t.input_sources) if src is not None}
        call_inputs = self._resolve_all(replay.input_sources, [None] * len(replay.input_sources))

        def translate(src: _Source, state: str | None) -> Ref:
            state = rename(state) if state is not None else None
            if src is not None and src[0] == "out" and t.start <= src[1] < t.end:
                return Ref(entry_map[src[1]], src[2], state)
            if src in outside:
                ref = call_inputs[outside[src]]
                return Ref(ref.node, ref.index, state if state is not None else ref.state)
            return self._resolve(src, state)

        first = len(self.nodes)
        for live in range(t.start, t.end):
            d = self.rec.entries[live]
            assert isinstance(d, _Draft)  # units never nest, so a template holds drafts only
            entry_map[live] = len(self.nodes)
            sources = tuple(translate(s, st) for s, st in zip(d.sources, d.states))
            self.nodes.append(self._node(d, sources, rename(d.module)))
        self.spans[index] = (first, len(self.nodes))
        self.replay_outputs[index] = tuple(translate(s, None) for s in t.output_sources)

    def _saved_bytes(self) -> list[int]:
        """Bytes each node saves for backward, each storage counted at its first pack in time order."""
        saved = [0] * len(self.nodes)
        seen: set[Any] = set()
        entries = self.rec.entries
        for event in self.rec.events:
            if isinstance(event, _Save):
                if event.target is not None and event.key not in seen:
                    seen.add(event.key)
                    saved[self.live_id[event.target]] += event.nbytes
                continue
            replay = entries[event]
            assert isinstance(replay, _Replay)
            t = replay.template
            keys: dict[int, Any] = dict(zip(t.output_keys, replay.output_keys))
            keys.update(zip(t.input_keys, replay.input_keys))
            for template_event in self.rec.events[t.events[0] : t.events[1]]:
                assert isinstance(template_event, _Save)  # units never nest: a template holds no replay
                key = keys.get(template_event.key, (event, template_event.key))
                if template_event.target is not None and key not in seen:
                    seen.add(key)
                    copy = self.copies[event]
                    node = copy.get(template_event.target, min(copy.values(), default=None))
                    if node is not None:
                        saved[node] += template_event.nbytes
        return saved

    def _groups(self) -> list[RepeatGroup]:
        by_key: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        for fingerprint, fqn, start in self.rec.instances:
            by_key.setdefault(fingerprint, []).append((fqn, self.spans[start]))
        groups = []
        for fingerprint, members in by_key.items():
            if len(members) < 2:
                continue
            groups.append(
                RepeatGroup(
                    fingerprint=fingerprint,
                    module_type=self.rec.type_of.get(members[0][0], ""),
                    instances=tuple(m[0] for m in members),
                    spans=tuple(m[1] for m in members),
                )
            )
        return groups
