"""A model your own code builds: ``path/to/file.py:function`` or ``package.module:function``.

``function(batch: int)`` returns ``(model, inputs)``: an ``nn.Module`` (built on any device) and a dict of keyword
tensors holding ``batch`` samples (the first dim of each is the batch), such that ``model(**inputs)`` returns the
training loss, a scalar tensor or an object with a ``.loss``. The file is your code and runs as a training script
does: it is imported (its directory first on ``sys.path``), so what it does at import time happens in autopar.

- Planning calls ``function(batch)`` under ``torch.device("meta")`` (what is built without an explicit device
  costs no memory), and again as plain Python if that fails; the model then moves to the meta device.
- `autopar run` calls it on CPU for the model (under one seed on every rank, so all start from the same weights)
  and, for each step, under that step's seed for the step's batch, whose inputs are the step's data: draw them at
  random in ``function`` (``torch.randint``) for a fresh batch each step.

A plan records the absolute path of the file (a module name as given) and the function's name.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_user_name(name: str) -> bool:
    """Whether ``name`` has the form ``target:function`` (and is not an ``hf:`` name)."""
    target, sep, function = name.rpartition(":")
    return bool(sep and target and function.isidentifier() and not name.startswith("hf:")
                and (target.endswith(".py") or _MODULE.fullmatch(target)))


def canonical(name: str) -> str:
    """The name a plan records: a file's path made absolute, a module name as given."""
    target, _, function = name.rpartition(":")
    if target.endswith(".py"):
        target = os.path.abspath(os.path.expanduser(target))
    return f"{target}:{function}"


def resolve(name: str) -> Callable[..., Any]:
    """The function ``name`` points at; ValueError naming the file, module or function and how to fix it."""
    target, _, function = name.rpartition(":")
    module = _import_file(name, target) if target.endswith(".py") else _import_module(name, target)
    found = getattr(module, function, None)
    if found is None:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(function, defined, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; it defines {', '.join(defined[:8]) or 'none'}"
        raise ValueError(f"{name}: {target} has no function {function!r}{hint}")
    if not callable(found):
        raise ValueError(f"{name}: {function!r} in {target} is a {type(found).__name__}, not a function")
    return found


def _import_file(name: str, path: str) -> Any:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no such file {path}; give path/to/file.py:function")
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", os.path.basename(path)[:-3])
    key = f"autopar_user_{stem}_{digest}"
    if key in sys.modules:
        return sys.modules[key]
    folder = os.path.dirname(path)
    if folder not in sys.path:  # as `python file.py` does: the file's own imports find its neighbours
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{name}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[key]
        if not isinstance(exc, Exception):
            raise
        log.debug("importing %s failed", path, exc_info=True)
        raise ValueError(f"{name}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str, target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target.startswith(exc.name):
            raise ValueError(f"{name}: no module named {exc.name!r} (give path/to/file.py:function, or install or "
                             "put the package on PYTHONPATH)") from None
        raise ValueError(f"{name}: importing {target} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        log.debug("importing %s failed", target, exc_info=True)
        raise ValueError(f"{name}: importing {target} failed: {type(exc).__name__}: {exc}") from exc


def build(name: str, *, batch: int, device: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``function(batch)``'s model on ``device`` (meta: built under the meta device where the function allows) and
    its inputs, checked; the model's first forward checks that it returns a loss."""
    function = resolve(name)
    if device == "meta":
        try:
            with torch.device("meta"):
                result = function(batch)
        except Exception:  # noqa: BLE001 - the function needs real tensors to build: run it as written
            log.debug("%s(%d) failed under the meta device; calling it as written", name, batch, exc_info=True)
            result = _call(name, function, batch)
    else:
        result = _call(name, function, batch)
    module, inputs = checked(name, result, batch=batch)
    target = torch.device(device).type
    if any(t.device.type != target for t in (*module.parameters(), *module.buffers())):
        module.to(device)  # (not otherwise: under a fake-tensor mode, moving tied weights fails)
    inputs = {key: value.to(device) for key, value in inputs.items()}
    _watch_loss(name, module)
    return module, inputs


def _call(name: str, function: Callable[..., Any], batch: int) -> Any:
    try:
        return function(batch)
    except Exception as exc:  # noqa: BLE001 - the user's function raised
        log.debug("%s(%d) raised", name, batch, exc_info=True)
        raise ValueError(f"{name}({batch}) raised {type(exc).__name__}: {exc}") from exc


def checked(name: str, result: Any, *, batch: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``result`` as (model, inputs), or ValueError saying what ``function(batch)`` must return instead."""
    shape = "(model, inputs): an nn.Module and a dict of keyword tensors"
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise ValueError(f"{name}({batch}) must return {shape}; it returned {got}")
    module, inputs = result
    if not isinstance(module, nn.Module):
        raise ValueError(f"{name}({batch}) must return {shape}; its first item is a {type(module).__name__}")
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(f"{name}({batch}) must return {shape}; its second item is a {type(inputs).__name__}"
                         + (" that is empty" if isinstance(inputs, dict) else ""))
    for key, value in inputs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{name}({batch}): input name {key!r} is not a keyword argument name")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}({batch}): input {key!r} is a {type(value).__name__}; every input must be a "
                             "tensor (fix other arguments inside the model)")
        if value.dim() == 0 or value.shape[0] != batch:
            raise ValueError(f"{name}({batch}): input {key!r} has shape {list(value.shape)}, but its first dim must be "
                             f"the batch ({batch}): autopar splits inputs along it into micro-batches and ranks")
    return module, dict(inputs)


def _watch_loss(name: str, module: nn.Module) -> None:
    """A forward hook on ``module`` that refuses an output that is not a loss, and removes itself once satisfied."""

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = (f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else f"a {type(output).__name__}")
            raise ValueError(f"{name}: the model's forward returned {got}; it must return the training loss, a "
                             "scalar tensor or an object with .loss (wrap a model that returns (logits, loss))")
        handle.remove()

    handle = module.register_forward_hook(hook)


def sequence(inputs: dict[str, torch.Tensor]) -> int:
    """The sequence length of a user model's inputs: dim 1 of the first integer input with two or more dims (token
    ids), else 1."""
    for value in inputs.values():
        if value.dim() >= 2 and not value.is_floating_point():
            return int(value.shape[1])
    return 1
