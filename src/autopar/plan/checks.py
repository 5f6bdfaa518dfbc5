"""Field checks for the plan's records: each raises `FieldError` naming the field and what would be valid.

`at` prefixes the path of a nested record (``stages[1].dp``), so an error from deep inside a plan file still says
where it is. Values are quoted shortened: a plan file may hold a megabyte of garbage in one field.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Iterator
from typing import Any


class FieldError(ValueError):
    """A field of a plan (or of something it holds) is wrong: ``field`` names it, ``problem`` says why."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}" if field else problem)
        self.field, self.problem = field, problem


def quote(value: Any) -> str:
    """The value as an error shows it: bounded in length and in work, however large the value."""
    return reprlib.repr(value)


@contextlib.contextmanager
def at(path: str) -> Iterator[None]:
    """Errors raised inside name the field under ``path`` (``stages[1]`` + ``dp`` -> ``stages[1].dp``)."""
    try:
        yield
    except FieldError as exc:
        raise FieldError(f"{path}.{exc.field}" if exc.field else path, exc.problem) from None
    except ValueError as exc:
        raise FieldError(path, f"is invalid: {exc}") from None


def integer(name: str, value: Any, *, low: int = 1, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"from {low:,} to {high:,}" if high is not None else f"of at least {low:,}"
        raise FieldError(name, f"must be an integer {bound}, got {quote(value)}")
    return value


def finite(name: str, value: Any, *, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
        low is not None and value < low
    ):
        bound = f" of at least {low:g}" if low is not None else ""
        raise FieldError(name, f"must be a finite number{bound}, got {quote(value)}")
    return value


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldError(name, f"must be true or false, got {quote(value)}")
    return value


def text(name: str, value: Any, *, limit: int = 256, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (not value and not empty):
        what = "a string" if empty else "a non-empty string"
        raise FieldError(name, f"must be {what} of at most {limit} characters, got {quote(value)}")
    return value


def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    if value not in options or not isinstance(value, str):
        raise FieldError(name, f"must be one of {', '.join(options)}, got {quote(value)}")
    return value


def mapping(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise FieldError(name, f"must be an object, got {quote(value)}")
    return value


def sequence(name: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise FieldError(name, f"must be a list, got {quote(value)}")
    return list(value)


def strings(name: str, value: Any, *, limit: int = 512) -> tuple[str, ...]:
    """A list of strings, as a tuple (the empty string is the root module's name, so it is allowed)."""
    items = sequence(name, value)
    for k, item in enumerate(items):
        text(f"{name}[{k}]", item, limit=limit, empty=True)
    return tuple(items)


def unknown_fields(name: str, data: dict, known: tuple[str, ...]) -> None:
    """Refuse fields this version does not know: a misspelt field must not be ignored in silence."""
    extra = sorted(set(data) - set(known))
    if extra:
        raise FieldError(name, f"has unknown field {quote(extra[0])} (known: {', '.join(known)})")
