"""The plan: typed, validated records of what to run (`Plan`), and plan files (versioned JSON; loading never runs
code)."""

from autopar.plan.checks import FieldError
from autopar.plan.estimate import CollectiveUse, Estimate, MemoryBreakdown
from autopar.plan.io import load_plan, save_plan
from autopar.plan.plan import READABLE_SCHEMAS, SCHEMA_VERSION, Plan
from autopar.plan.records import Block, Mesh, ModuleLayout, ParamLayout, Stage, Workload

__all__ = [
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "Block",
    "CollectiveUse",
    "Estimate",
    "FieldError",
    "MemoryBreakdown",
    "Mesh",
    "ModuleLayout",
    "ParamLayout",
    "Plan",
    "Stage",
    "Workload",
    "load_plan",
    "save_plan",
]
