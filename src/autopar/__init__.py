"""autopar: plan and run parallel training of large PyTorch models.

From Python (README, "Python API"): ``autopar.plan(model, example_inputs, cluster=..., gpus=..., batch=...)``
returns a `Plan` (``plan.explain()``, ``plan.save(path)``, ``Plan.load(path)``); in a ``torchrun`` script,
``autopar.plan_once`` plans on one rank and shares the plan, ``autopar.parallelize(model, plan)`` applies it, and
``parallel.step(batch)`` trains one step's micro-batches.

The public names load on first use (PEP 562), so that ``import autopar`` and the command line start without torch.

``autopar.plan`` is the planning function, although the subpackage `autopar.plan` (the plan's records) has the same
name: the package's module class answers ``plan`` with the function whether or not the subpackage has been imported
(importing a subpackage binds its name on the parent; here that binding is set aside). Import the records with
``from autopar.plan import ...`` (or use ``autopar.Plan``), not ``import autopar.plan as ...``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CaptureError": "autopar.capture",
    "Graph": "autopar.capture",
    "trace": "autopar.capture",
    "ModelConfig": "autopar.zoo",
    "load": "autopar.zoo",
    "parallelize": "autopar.runtime.apply",
    "ParallelModel": "autopar.runtime.apply",
    "Plan": "autopar.plan.plan",
    "LocalBatch": "autopar.plan.batch",
    "plan_once": "autopar.api.planning",
}

__all__ = ["CaptureError", "Graph", "LocalBatch", "ModelConfig", "ParallelModel", "Plan", "__version__", "load",
           "parallelize", "plan", "plan_once", "trace"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "plan"})


class _Package(types.ModuleType):
    """The ``autopar`` module's class: ``autopar.plan`` is `autopar.api.planning.plan` (see the module docstring)."""

    @property
    def plan(self) -> Any:
        return importlib.import_module("autopar.api.planning").plan

    @plan.setter
    def plan(self, value: Any) -> None:
        # the import system binds the subpackage here when it is first imported; it stays in sys.modules, where
        # ``from autopar.plan import Plan`` finds it
        if not (isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.plan"):
            raise AttributeError("autopar.plan is the planning function and cannot be replaced")


sys.modules[__name__].__class__ = _Package
