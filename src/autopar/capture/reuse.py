"""Find repeated modules so that a deep model is traced for the cost of a shallow one.

Two module instances are interchangeable for capture when they have the same class, the same parameter and buffer
shapes and dtypes, the same submodule tree, and the same plain configuration attributes (ints, floats, bools,
strings). Attributes that only number the instance in its stack (``layer_idx`` and the like) are ignored: they
change no computation in the models we know and would otherwise make every layer unique. A module is a *unit* when
it repeats among its siblings in a layer container and no ancestor is a unit; at trace time the first call of a unit with a given
input signature is traced, and later calls with that signature replay its nodes (CFP section 4.1, applied at
capture instead of at profiling).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

# Attributes that number a layer within its stack rather than configure it.
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "block_idx", "idx"})
_PLAIN = (int, float, bool, str, type(None))


def module_fingerprints(model: nn.Module) -> dict[int, str]:
    """Fingerprint of every module, keyed by ``id(module)``; computed bottom-up in one pass."""
    prints: dict[int, str] = {}

    def visit(module: nn.Module) -> str:
        known = prints.get(id(module))
        if known is not None:
            return known
        parts = [type(module).__module__, type(module).__qualname__, str(module.training)]
        for name, p in module.named_parameters(recurse=False):
            parts.append(f"p:{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}")
        for name, b in module.named_buffers(recurse=False):
            parts.append(f"b:{name}:{tuple(b.shape)}:{b.dtype}")
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or key in INDEX_ATTRIBUTES:
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                parts.append(f"a:{key}={value!r}")
        for name, child in module.named_children():
            parts.append(f"c:{name}:{visit(child)}")
        digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
        prints[id(module)] = digest
        return digest

    visit(model)
    return prints


def find_units(model: nn.Module) -> dict[int, str]:
    """Outermost repeated layers: ``id(module) -> fingerprint``.

    A unit is a child of a container (`nn.ModuleList`, `nn.Sequential`, `nn.ModuleDict`) that shares its
    fingerprint with a sibling and owns parameters; layers live in such containers, and two look-alike modules in
    unrelated places (an embedding's and a head's LayerNorm) gain nothing from replay.
    """
    prints = module_fingerprints(model)
    units: dict[int, str] = {}

    def walk(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            counts = Counter(prints[id(c)] for c in module.children())
            for child in module.children():
                fp = prints[id(child)]
                if counts[fp] > 1 and any(True for _ in child.parameters()):
                    units[id(child)] = fp
        for child in module.children():
            if id(child) not in units:
                walk(child)

    walk(model)
    return units


def input_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a replay must match besides the fingerprint: tensor shapes, dtypes, grad flags and plain values."""
    leaves, spec = tree_flatten((args, kwargs))
    sig: list[Any] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append(("T", tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        elif isinstance(leaf, _PLAIN):
            sig.append(leaf)
        else:
            sig.append(type(leaf).__qualname__)
    return tuple(sig)
