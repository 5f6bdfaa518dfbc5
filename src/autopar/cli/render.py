"""Plain-text rendering helpers for the CLI: units and aligned tables."""

from __future__ import annotations

from collections.abc import Sequence


def si(value: float, unit: str = "") -> str:
    """1.3e9 -> '1.30 G'; keeps three significant figures."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def binary_bytes(value: float) -> str:
    for factor, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{int(value)} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, align: str = "") -> str:
    """Aligned columns; ``align`` has one character per column, 'l' or 'r' (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)
