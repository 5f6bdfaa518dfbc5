"""Reading and writing plan files.

A plan file is one JSON object: ``plan`` (the `Plan` in its JSON form, see `autopar.plan.plan`) and ``estimate``
(what the cost model predicted for it). Plans are data: `load_plan` reads a bounded regular file, parses strict
JSON (no ``NaN``), validates every field and never imports or executes anything from the file.
"""

from __future__ import annotations

from pathlib import Path

from autopar.plan.plan import Plan


def save_plan(path: str | Path, plan: Plan) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write never leaves half a plan."""
    if not isinstance(plan, Plan):
        raise TypeError(f"save_plan takes a Plan, got {type(plan).__name__}")
    plan.save(path)


def load_plan(path: str | Path) -> Plan:
    """The plan of a plan file, with its estimate, validated; a ValueError naming the file and field otherwise."""
    return Plan.load(path)
