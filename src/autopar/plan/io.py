"""Reading and writing plan files.

A plan file is one JSON object: ``plan`` (schema version, model, mesh shape and axis names, micro-batch size and
count, ZeRO stage, the split each block chose, and per module FQN its parameters' layouts and its input and output
layouts, written `S(0)`, `R`, `P` per mesh axis) and ``estimate`` (what the cost model predicted for it). Plans
are data: `load_plan` validates fields and never imports or executes anything from the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from autopar.sharding import parse

SCHEMA_VERSION = 1
_REQUIRED = {"schema": int, "model": str, "mesh": dict, "micro_batch_size": int, "micro_batches": int, "zero": int,
             "modules": dict}


def save_plan(path: str | Path, plan: dict[str, Any], estimate: dict[str, Any]) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write never leaves half a plan."""
    validate(plan)
    path = Path(path)
    text = json.dumps({"plan": plan, "estimate": estimate}, indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_plan(path: str | Path) -> dict[str, Any]:
    """The ``{"plan": ..., "estimate": ...}`` object of a plan file, validated."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a plan file (invalid JSON at line {exc.lineno})") from None
    if not isinstance(data, dict) or "plan" not in data:
        raise ValueError(f"{path}: not a plan file (no 'plan' object)")
    validate(data["plan"], source=str(path))
    return data


def validate(plan: dict[str, Any], *, source: str = "plan") -> None:
    for key, kind in _REQUIRED.items():
        if key not in plan:
            raise ValueError(f"{source}: missing field {key!r}")
        if not isinstance(plan[key], kind) or isinstance(plan[key], bool):
            raise ValueError(f"{source}: field {key!r} must be {kind.__name__}, got {plan[key]!r}")
    if plan["schema"] != SCHEMA_VERSION:
        raise ValueError(f"{source}: plan schema {plan['schema']} is not supported (this autopar reads {SCHEMA_VERSION})")
    shape, axes = plan["mesh"].get("shape"), plan["mesh"].get("axes")
    if not (isinstance(shape, list) and isinstance(axes, list) and len(shape) == len(axes) and shape):
        raise ValueError(f"{source}: mesh needs 'shape' and 'axes' lists of one length, got {plan['mesh']!r}")
    if any(not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"{source}: mesh shape must hold positive integers, got {shape!r}")
    # a pipeline plan gives layouts over each stage's (dp, tp) devices; an intra-op plan over the whole mesh
    axes_per_layout = 2 if "stages" in plan else len(shape)
    if "stages" in plan:
        _check_stages(plan, source)
    for fqn, entry in plan["modules"].items():
        layouts = [*entry.get("params", {}).values(), *(entry[k] for k in ("input", "output") if k in entry)]
        for text in layouts:
            _check_layout(text, axes_per_layout, f"{source}: module {fqn!r}")


def _check_stages(plan: dict[str, Any], source: str) -> None:
    stages = plan["stages"]
    pp, per_stage = plan["mesh"]["shape"][0], plan["mesh"]["shape"][-1]
    chunks = plan.get("chunks", 1)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{source}: 'chunks' must be a positive integer, got {chunks!r}")
    if not isinstance(stages, list) or len(stages) != pp * chunks:
        raise ValueError(f"{source}: {pp} pipeline stages in the mesh (x {chunks} chunks) but {len(stages)} in "
                         "'stages'")
    for k, stage in enumerate(stages):
        for key in ("layers", "dp", "tp"):
            if key not in stage:
                raise ValueError(f"{source}: stage {k} is missing {key!r}")
        if stage["dp"] * stage["tp"] != per_stage:
            raise ValueError(f"{source}: stage {k} has dp {stage['dp']} x tp {stage['tp']}, not {per_stage} devices")


def _check_layout(text: str, axes: int, where: str) -> None:
    parts = text[1:-1].split(", ") if text.startswith("[") else [text]
    if len(parts) != axes:
        raise ValueError(f"{where}: layout {text!r} has {len(parts)} placements for a {axes}-axis mesh")
    for part in parts:
        try:
            parse(part)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
