"""Reading and writing plan files.

A plan file is one JSON object: ``plan`` (the `Plan` in its JSON form, see `autopar.plan.plan`) and ``estimate``
(what the cost model predicted for it). Plans are data: `load_plan` reads a bounded regular file, parses strict
JSON (no ``NaN``), validates every field and never imports or executes anything from the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from autopar.files import PLAN_FILE_LIMIT, read_text, write_atomic
from autopar.plan.checks import FieldError
from autopar.plan.plan import Plan


def save_plan(path: str | Path, plan: Plan) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write never leaves half a plan."""
    if not isinstance(plan, Plan):
        raise TypeError(f"save_plan takes a Plan, got {type(plan).__name__}")
    write_atomic(path, json.dumps(plan.to_file_dict(), indent=1, allow_nan=False) + "\n")


def load_plan(path: str | Path) -> Plan:
    """The plan of a plan file, with its estimate, validated; a ValueError naming the file and field otherwise."""
    text = read_text(path, what="plan file", limit=PLAN_FILE_LIMIT)
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a plan file (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a plan file (JSON nested too deeply)") from None
    if not isinstance(data, dict) or not isinstance(data.get("plan"), dict):
        raise ValueError(f"{path}: not a plan file (no 'plan' object)")
    extra = sorted(set(data) - {"plan", "estimate"})
    if extra:
        raise ValueError(f"{path}: unknown top-level field {extra[0]!r} (a plan file holds 'plan' and 'estimate')")
    try:
        return Plan.from_dict(data["plan"], estimate=data.get("estimate"))
    except FieldError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not a number JSON allows", name, 0)
