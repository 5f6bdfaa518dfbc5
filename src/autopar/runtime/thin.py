"""One layer of each kind: the model and plan a rehearsal steps so that its cost does not grow with depth.

`autopar.runtime.validate.rehearsal` applies a plan to the user's model on a fake process group and steps it once,
which costs time in proportion to the layers it runs (FSDP's set-up, the weights made, every op of every layer).
A 1,000-layer model's layers are mostly copies of one another, treated alike by the plan: stepping one of each
kind finds what stepping all of them would. `thin` keeps, in each list of the plan's layers, the layers that stand
for all of them, and rewrites the plan to name the layers kept.

Two layers are of one kind when the same modules with the same parameter shapes and settings get the same
treatment from the plan (recomputation, intra-op layouts, parameter placements). A setting that only counts the
layer's place (``layer_idx``) does not tell layers apart; one that changes what the layer runs (a sliding window,
an attention type) does. A layer is kept where the pair (kind of the layer before it, its kind) first occurs,
together with the layer before it, and so is the last layer: every pair of neighbours in the model also meets in
the thinned model. A checkpointed run of layers is one item of its list, thinned the same way inside; its first
and last layers are always kept, so it stays a run. A pipeline's stages are thinned one by one, each keeping its
first and last layers, so the thinned plan has the same stages and the same neighbours across their boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Placement

from autopar.cost.checkpoint import Segment, nest
from autopar.plan import Plan


def thin(model: nn.Module, plan: Plan) -> Plan:
    """Drop from ``model`` (in place; not yet parallelised) the layers that others of their kind stand for, and
    return ``plan`` naming the layers kept under their new places in their lists. Lists of fewer than three
    layers, and models whose plan names no list of layers, are left as they are."""
    return thinned(model, plan)[0]


def thinned(model: nn.Module, plan: Plan) -> tuple[Plan, dict[str, str | None]]:
    """`thin`, also returning what it renamed: each layer of a thinned list to its new name, or None where it
    was dropped (`renamed_plan` renames another plan treating the layers alike the same way)."""
    modules = dict(model.named_modules())
    renamed: dict[str, str | None] = {}  # old layer name -> new, or None when dropped
    for head in _lists(plan, modules):
        container = modules[head]
        layers = list(container._modules.values())
        if list(container._modules) != [str(i) for i in range(len(layers))]:
            continue  # not keyed 0..n-1 as a ModuleList is: left whole
        names = [f"{head}.{i}" for i in range(len(layers))]
        positional, entries = _positional(layers), _entries(plan, set(names))
        kinds = [(_kind(layer, positional), _treatment(plan, name, entries.get(name, [])))
                 for layer, name in zip(layers, names)]
        spans = [(int(first.rpartition(".")[2]), int(last.rpartition(".")[2]) + 1)
                 for stage in plan.stages for first, last in stage.segments if first.rpartition(".")[0] == head]
        kept = []
        for start, end in _ranges(plan, head, len(layers)):  # each pipeline stage's layers thinned apart
            kept += _thin(nest(start, end, [s for s in spans if start <= s[0] < end]), kinds)[0]
        if len(kept) == len(layers):
            continue
        container._modules = {str(j): layers[i] for j, i in enumerate(kept)}
        renamed.update(dict.fromkeys(names))
        renamed.update({names[i]: f"{head}.{j}" for j, i in enumerate(kept)})
    return (_renamed(plan, renamed) if renamed else plan), renamed


def renamed_plan(plan: Plan, renamed: dict[str, str | None]) -> Plan:
    """``plan`` naming the layers as `thinned` renamed them in a model: for a plan of the same model that treats
    every layer as the plan `thinned` was given does (the same kinds, so the same layers kept)."""
    return _renamed(plan, renamed) if renamed else plan


def _lists(plan: Plan, modules: dict[str, nn.Module]) -> list[str]:
    """The lists of three or more layers that the plan's stages hold (a stage's row is the list itself, or one
    of its layers)."""
    found = []
    for stage in plan.stages:
        for name in stage.layers:
            for head in (name, name.rpartition(".")[0]):
                if isinstance(modules.get(head), nn.ModuleList) and len(modules[head]) >= 3 and head not in found:
                    found.append(head)
    return found


def _ranges(plan: Plan, head: str, count: int) -> list[tuple[int, int]]:
    """The runs [start, end) of the list ``head`` (of ``count`` layers) that the plan's stages hold: the whole list
    where one stage holds it, each pipeline stage's own run otherwise, so that every stage keeps its first and
    last layers and each pair of neighbours across a stage boundary stays one."""
    runs = []
    for stage in plan.stages:
        if head in stage.layers:
            return [(0, count)]
        held = [int(index) for above, _, index in (name.rpartition(".") for name in stage.layers)
                if above == head and index.isdigit()]
        if held:
            runs.append((min(held), max(held) + 1))
    return runs if len(runs) > 1 else [(0, count)]


def thins(plan: Plan, model: nn.Module) -> bool:
    """Whether `thin` may drop layers of ``model`` for ``plan``: a stage holds a list of three or more layers."""
    return bool(_lists(plan, dict(model.named_modules())))


def _thin(children: tuple, kinds: list) -> tuple[list[int], list]:
    """The layers kept of ``children`` (layer indices, and checkpointed `Segment`s of them), and the kinds of
    the children kept (a segment's kind is the kinds of what it keeps)."""
    found = []
    for child in children:
        if isinstance(child, Segment):
            inner, inner_kinds = _thin(child.children, kinds)
            found.append((inner, ("run", tuple(inner_kinds))))
        else:
            found.append(([child], kinds[child]))
    keep, seen = set(), set()
    for at, (_, kind) in enumerate(found):
        pair = (found[at - 1][1] if at else None, kind)
        if pair not in seen or at == len(found) - 1:
            seen.add(pair)
            keep.update((at - 1, at) if at else (at,))
    chosen = [found[at] for at in sorted(keep)]
    return [layer for layers, _ in chosen for layer in layers], [kind for _, kind in chosen]


def _renamed(plan: Plan, renamed: dict[str, str | None]) -> Plan:
    """``plan`` naming layers (and the modules and parameters inside them) as ``renamed`` says, without those
    it maps to None."""

    def name(text: str) -> str | None:
        parts = text.split(".")
        for cut in range(1, len(parts) + 1):  # the layer's name is a prefix of the text
            layer = ".".join(parts[:cut])
            if layer in renamed:
                new = renamed[layer]
                return None if new is None else ".".join([new, *parts[cut:]])
        return text

    stages = []
    for stage in plan.stages:
        stages.append(dataclasses.replace(
            stage,
            layers=tuple(n for n in map(name, stage.layers) if n is not None),
            recompute=tuple((name(layer), level) for layer, level in stage.recompute if name(layer) is not None),
            segments=tuple((name(a), name(b)) for a, b in stage.segments if name(a) is not None),
            layouts=tuple((name(layer), split) for layer, split in stage.layouts if name(layer) is not None),
        ))
    modules = []
    for entry in plan.modules:
        fqn = name(entry.fqn)
        if fqn is not None:
            params = tuple(dataclasses.replace(p, name=name(p.name)) for p in entry.params)
            modules.append(dataclasses.replace(entry, fqn=fqn, params=params))
    return dataclasses.replace(plan, stages=tuple(stages), modules=tuple(modules))


def _entries(plan: Plan, layers: set[str]) -> dict[str, list]:
    """The plan's module layouts of each of ``layers`` (those of its modules)."""
    found: dict[str, list] = {}
    for entry in plan.modules:
        parts = entry.fqn.split(".")
        for cut in range(1, len(parts) + 1):
            if ".".join(parts[:cut]) in layers:
                found.setdefault(".".join(parts[:cut]), []).append(entry)
                break
    return found


def _treatment(plan: Plan, layer: str, entries: list) -> tuple:
    """What ``plan`` does to ``layer``: its recomputation, its intra-op layouts, and its modules' (``entries``)
    parameter placements and activation layouts, named relative to the layer."""
    cut = len(layer) + 1
    recompute = tuple(level for stage in plan.stages for name, level in stage.recompute if name == layer)
    layouts = tuple(split for stage in plan.stages for name, split in stage.layouts if name == layer)
    modules = tuple((entry.fqn[cut:], tuple((p.name[cut:], repr(p.placements), p.shape) for p in entry.params),
                     repr(entry.input), repr(entry.output)) for entry in entries)
    return recompute, layouts, modules


def _positional(layers: list[nn.Module]) -> set[tuple[str, str]]:
    """The (submodule, attribute) integer settings that only count a layer's place in its list (``layer_idx``:
    the layer's index plus one constant, in every layer)."""
    values: dict[tuple[str, str], list] = {}
    for layer in layers:
        for name, sub in layer.named_modules():
            for key, value in vars(sub).items():
                if isinstance(value, int) and not isinstance(value, bool):
                    values.setdefault((name, key), []).append(value)
    return {key for key, found in values.items()
            if len(found) == len(layers) and len({v - k for k, v in enumerate(found)}) == 1}


def _kind(layer: nn.Module, positional: set[tuple[str, str]]) -> tuple:
    """What ``layer`` is, as a comparable key: per module its type, its settings (but those in ``positional``),
    its parameters' and buffers' shapes, and its hooks."""
    parts = []
    for name, sub in layer.named_modules():
        settings = tuple(sorted((key, _value(value)) for key, value in vars(sub).items()
                                if not key.startswith("_") and key != "training" and (name, key) not in positional))
        tensors = tuple((key, None if t is None else (tuple(t.shape), str(t.dtype), t.requires_grad))
                        for table in (sub._parameters, sub._buffers) for key, t in table.items())
        hooks = tuple(tuple(_callable(h) for h in table.values()) for table in (
            sub._forward_pre_hooks, sub._forward_hooks, sub._backward_pre_hooks, sub._backward_hooks))
        parts.append((name, type(sub).__module__, type(sub).__qualname__, settings, tensors, hooks))
    return tuple(parts)


def _callable(f: Any, depth: int = 0) -> tuple:
    if isinstance(f, functools.partial):
        return ("partial", _callable(f.func, depth + 1), _value(f.args, depth + 1),
                _value(tuple(sorted(f.keywords.items())), depth + 1))
    func = getattr(f, "__func__", f)
    cells = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            cells.append(_value(cell.cell_contents, depth + 1))
        except ValueError:  # an empty cell
            cells.append(None)
    return (getattr(func, "__module__", None), getattr(func, "__qualname__", type(func).__qualname__), tuple(cells))


def _value(value: Any, depth: int = 0) -> Any:
    """A setting as a comparable key: plain values as they are, containers item by item, callables by what they
    are and hold, anything else by its type (a config object every layer shares, a submodule's own entry)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, Placement):
        return repr(value)
    if depth > 4:
        return type(value).__qualname__
    if isinstance(value, (tuple, list)):
        return tuple(_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _value(v, depth + 1)) for k, v in value.items()))
    if callable(value) and not isinstance(value, nn.Module):
        return _callable(value, depth)
    return type(value).__qualname__
