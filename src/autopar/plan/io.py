"""Reading and writing plan files.

A plan file is one JSON object: ``plan`` (the `Plan` in its JSON form, see `autopar.plan.plan`) and ``estimate``
(what the cost model predicted for it). Plans are data: `load_plan` reads a bounded regular file, parses strict
JSON (no ``NaN``), validates every field and never imports or executes anything from the file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from autopar.plan.checks import FieldError
from autopar.plan.plan import Plan

MAX_PLAN_BYTES = 64 << 20


def save_plan(path: str | Path, plan: Plan) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write never leaves half a plan."""
    if not isinstance(plan, Plan):
        raise TypeError(f"save_plan takes a Plan, got {type(plan).__name__}")
    text = json.dumps(plan.to_file_dict(), indent=1, allow_nan=False) + "\n"
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_plan(path: str | Path) -> Plan:
    """The plan of a plan file, with its estimate, validated; a ValueError naming the file and field otherwise."""
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("plan"), dict):
        raise ValueError(f"{path}: not a plan file (no 'plan' object)")
    extra = sorted(set(data) - {"plan", "estimate"})
    if extra:
        raise ValueError(f"{path}: unknown top-level field {extra[0]!r} (a plan file holds 'plan' and 'estimate')")
    try:
        return Plan.from_dict(data["plan"], estimate=data.get("estimate"))
    except FieldError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_json(path: str | Path) -> Any:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the plan file ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a plan file is a JSON file)")
    if info.st_size > MAX_PLAN_BYTES:
        raise ValueError(f"{path}: {info.st_size:,} bytes, more than a plan file's {MAX_PLAN_BYTES:,}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the plan file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a plan file (not UTF-8 text at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a plan file (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a plan file (JSON nested too deeply)") from None


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not a number JSON allows", name, 0)
