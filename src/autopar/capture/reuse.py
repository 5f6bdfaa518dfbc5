"""Find repeated modules so that a deep model is traced for the cost of a shallow one.

Two module instances are interchangeable for capture when they have the same class, the same parameter and buffer
shapes and dtypes, the same submodule tree, and the same plain configuration attributes (ints, floats, bools,
strings). Attributes that only number the instance in its stack (``layer_idx`` and the like) are ignored: they
change no computation in the models we know and would otherwise make every layer unique. A module is a *unit* when
it repeats among its siblings in a layer container and no ancestor is a unit; at trace time the first call of a unit
with a given input signature is traced, and later calls with that signature replay its nodes (CFP section 4.1,
applied at capture instead of at profiling).

One pre-order pass over the module tree names every module and computes every fingerprint as an interned tuple,
so checking that 1,000 layers are identical costs a few microseconds per module.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.capture.graph import one_key_value_head

# Attributes that number a layer within its stack rather than configure it.
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "block_idx", "idx"})
_PLAIN = (int, float, bool, str, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(slots=True)
class ModuleScan:
    """Names, class names and repeat units of a model's modules, from one pass."""

    fqn_of: dict[int, str] = field(default_factory=dict)  # id(module) -> first FQN (pre-order, like named_modules)
    types: dict[str, str] = field(default_factory=dict)  # FQN -> class name
    units: dict[int, str] = field(default_factory=dict)  # id(unit module) -> fingerprint (hex)
    multi_query: list[str] = field(default_factory=list)  # FQNs of attentions with one key/value head


def scan(model: nn.Module, *, find_repeats: bool = True) -> ModuleScan:
    result = ModuleScan()
    interned: dict[tuple[Any, ...], int] = {}
    keys: list[tuple[Any, ...]] = []
    fingerprint_of: dict[int, int] = {}
    one_kv: list[bool] = []  # per fingerprint: a multi-query attention (`graph.one_key_value_head`)

    fqn_of, types = result.fqn_of, result.types
    attr_keys: dict[type, tuple[int, tuple[str, ...]]] = {}

    def visit(prefix: str, module: nn.Module) -> int:
        known = fingerprint_of.get(id(module))
        if known is not None:  # a module reachable twice (shared layers) is named and fingerprinted once
            return known
        fqn_of[id(module)] = prefix
        types[prefix] = type(module).__name__
        dot = prefix + "." if prefix else ""
        children = tuple([(name, visit(dot + name, child)) for name, child in module._modules.items() if child is not None])
        params = tuple([(n, p.shape, p.dtype, p.requires_grad) for n, p in module._parameters.items() if p is not None])
        buffers = tuple([(n, b.shape, b.dtype) for n, b in module._buffers.items() if b is not None]) if module._buffers else ()
        attrs = _config_attributes(module.__dict__, attr_keys, type(module))
        key = (type(module), module.training, params, buffers, attrs, children)
        fp = interned.get(key)
        if fp is None:
            fp = interned[key] = len(keys)
            keys.append(key)
            one_kv.append(one_key_value_head(module.__dict__))  # alike for modules alike (their counts are attrs)
        if one_kv[fp]:
            result.multi_query.append(prefix)
        fingerprint_of[id(module)] = fp
        return fp

    visit("", model)
    if find_repeats:
        _find_units(model, fingerprint_of, keys, result.units)
    return result


def _config_attributes(
    attributes: dict[str, Any], cache: dict[type, tuple[int, tuple[str, ...]]], cls: type
) -> tuple[tuple[str, Any], ...]:
    """Plain configuration attributes of a module, as ((name, value), ...).

    Instances of one class nearly always carry the same attribute names: the names found on the first instance are
    reused while an instance has as many attributes, so a 1,000-layer model does not filter 20 names per module.
    """
    known = cache.get(cls)
    if known is not None and known[0] == len(attributes):
        values = tuple([(k, attributes.get(k, _MISSING)) for k in known[1]])
        if all(type(v) in _PLAIN_TYPES or _plain_tuple(v) for _, v in values):
            return values
    names = tuple(
        k
        for k, v in attributes.items()
        if k[0] != "_" and (type(v) in _PLAIN_TYPES or _plain_tuple(v)) and k not in INDEX_ATTRIBUTES
    )
    cache[cls] = (len(attributes), names)
    return tuple([(k, attributes[k]) for k in names])


_MISSING = object()


def _plain_tuple(value: Any) -> bool:
    return type(value) is tuple and all(type(v) in _PLAIN_TYPES for v in value)


def _find_units(
    model: nn.Module, fingerprint_of: dict[int, int], keys: list[tuple[Any, ...]], units: dict[int, str]
) -> None:
    """Outermost repeated layers: children of a container that share a class with a sibling and own parameters,
    none of them shared with a module outside the child (nanoGPT keeps its embedding in a ``ModuleDict`` beside
    the position table, its weight tied to the head: such a child is no layer of its own, and FSDP could not make
    it a unit apart from the head).

    Layers live in containers (`nn.ModuleList`, `nn.Sequential`, `nn.ModuleDict`); two look-alike modules in
    unrelated places (an embedding's and a head's LayerNorm) gain nothing from replay. A layer whose configuration
    differs from its siblings' (Gemma 2 alternates sliding-window and full attention) is a unit of its own
    fingerprint, replayed only where that repeats: it is still one of the model's layers, a unit of FSDP and of
    recomputation and a place to cut pipeline stages, as the runtime treats every child of a layer list.
    """
    hex_of: dict[int, str] = {}

    def stable(fp: int) -> str:  # a name that survives across processes (the interned ints do not)
        if fp not in hex_of:
            hex_of[fp] = hashlib.sha1(_describe(fp, keys).encode()).hexdigest()[:16]
        return hex_of[fp]

    holders = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    shared = {key for key, count in holders.items() if count > 1}

    def tied_outside(child: nn.Module) -> bool:
        inside = Counter(id(p) for m in child.modules() for p in m._parameters.values() if p is not None)
        return any(holders[key] > count for key, count in inside.items() if key in shared)

    todo = [model]
    while todo:
        module = todo.pop()
        if isinstance(module, _CONTAINERS):
            counts = Counter(type(c) for c in module._modules.values() if c is not None)
            for child in module._modules.values():
                if child is None:
                    continue
                fp = fingerprint_of[id(child)]
                if counts[type(child)] > 1 and _owns_parameters(keys, fp) and not (shared and tied_outside(child)):
                    units[id(child)] = stable(fp)
        todo.extend(c for c in module._modules.values() if c is not None and id(c) not in units)


def _owns_parameters(keys: list[tuple[Any, ...]], fp: int) -> bool:
    key = keys[fp]
    return bool(key[2]) or any(_owns_parameters(keys, child) for _, child in key[5])


def _describe(fp: int, keys: list[tuple[Any, ...]]) -> str:
    cls, training, params, buffers, attrs, children = keys[fp]
    inner = ",".join(f"{name}={_describe(child, keys)}" for name, child in children)
    return f"{cls.__module__}.{cls.__qualname__}|{training}|{params}|{buffers}|{attrs}|[{inner}]"


def find_units(model: nn.Module) -> dict[int, str]:
    """``id(module) -> fingerprint`` of the model's repeated layers (see module docstring)."""
    return scan(model).units


def input_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """What a replay must match besides the fingerprint (tensor shapes, dtypes, grad flags and plain values), and
    the tensor inputs in flattening order."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):  # the common case, without pytree
        tensors = list(args)
        return (len(args), *[(a.shape, a.dtype, a.requires_grad) for a in args]), tensors
    leaves, spec = tree_flatten((args, kwargs))
    sig: list[Any] = [spec]
    tensors = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((leaf.shape, leaf.dtype, leaf.requires_grad))
            tensors.append(leaf)
        elif type(leaf) in _PLAIN_TYPES:
            sig.append(leaf)
        else:
            sig.append(type(leaf))
    return tuple(sig), tensors
