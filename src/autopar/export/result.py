"""What an export gives: the target's arguments, the settings they make, the parallel degrees they multiply to, and
every plan feature the target could not express (`Approximation`), each with the closest setting written instead."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

# one setting's value: a number, a word, a flag, or (torchtitan's module_fqns_per_model_part) lists of names
Value = int | str | bool | tuple[tuple[str, ...], ...]


class Target(str, Enum):
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


@dataclass(frozen=True, slots=True, kw_only=True)
class Approximation:
    """A plan feature the target cannot express: what the plan asks and the closest setting written instead, with
    what that changes (time, memory)."""

    feature: str  # "grid", "intra", "recompute", "zero", "schedule", "stages", "dtype", "model", ...
    plan: str
    closest: str

    def to_dict(self) -> dict[str, str]:
        return {"feature": self.feature, "plan": self.plan, "closest": self.closest}


@dataclass(frozen=True, slots=True, kw_only=True)
class Export:
    """A plan as one target takes it. ``arguments`` is the command line, token by token; ``settings`` the values
    those tokens set, by the target's own names (torchtitan's dotted config fields, Megatron-LM's flags);
    ``degrees`` the parallel degrees, outermost first, whose product is the world size the plan was made for."""

    target: Target
    arguments: tuple[str, ...]
    settings: tuple[tuple[str, Value], ...]
    degrees: tuple[tuple[str, int], ...]
    warnings: tuple[Approximation, ...] = ()
    notes: tuple[str, ...] = ()  # remarks that change no number: versions needed, what the user supplies

    def __post_init__(self) -> None:
        if not isinstance(self.target, Target):
            raise ValueError(f"target must be a Target, got {self.target!r}")
        if not all(isinstance(a, str) for a in self.arguments):
            raise ValueError("arguments must be strings")
        for name, degree in self.degrees:
            if type(degree) is not int or degree < 1:
                raise ValueError(f"degree {name} must be a positive integer, got {degree!r}")
        if not all(isinstance(w, Approximation) for w in self.warnings):
            raise ValueError("warnings must be Approximation records")

    @property
    def world_size(self) -> int:
        return math.prod(d for _, d in self.degrees)

    def setting(self, name: str) -> Value | None:
        return dict(self.settings).get(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.value,
            "world_size": self.world_size,
            "degrees": dict(self.degrees),
            "arguments": list(self.arguments),
            "settings": {k: _plain(v) for k, v in self.settings},
            "warnings": [w.to_dict() for w in self.warnings],
            "notes": list(self.notes),
        }


def _plain(value: Value) -> Any:
    return [list(part) for part in value] if isinstance(value, tuple) else value
