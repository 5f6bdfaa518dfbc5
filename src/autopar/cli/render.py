"""Plain-text rendering helpers for the CLI: units and aligned tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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


def estimate_text(e: dict[str, Any]) -> str:
    """An Estimate (its JSON form): time split, memory per device and collectives."""
    mem = e["memory"]
    it = e["iteration_seconds"]
    time_rows = [
        [name, f"{e[key]:.3f} s", f"{e[key] / it:.0%}"]
        for name, key in (
            ("compute", "compute_seconds"), ("exposed comm", "exposed_comm_seconds"), ("bubble", "bubble_seconds")
        )
    ]
    mem_rows = [[k, binary_bytes(mem[k])] for k in ("parameters", "gradients", "optimizer", "activations", "other")]
    if "reserve" in mem:
        mem_rows.append(["reserve", binary_bytes(mem["reserve"])])
    fits = "" if mem["fits"] else "  DOES NOT FIT"
    mem_rows.append(["total", f"{binary_bytes(mem['total'])} of {binary_bytes(mem['budget'])}{fits}"])
    coll_rows = [[c["axis"], c["kind"], binary_bytes(c["bytes"]), str(c["count"])] for c in e["collectives"]]
    return "\n".join(
        [
            f"iteration {it:.3f} s, {e['throughput_samples_per_second']:.1f} samples/s, "
            f"{e['tflops_per_device']:.0f} TFLOP/s per device, MFU {e['mfu']:.1%}",
            *([f"MFU above 100%: the cluster's peak is below what was measured on this device; measure its compute "
               f"(autopar calibrate --nproc N --out FILE) and pass --cluster FILE"] if e["mfu"] > 1 else []),
            table(["time", "seconds", "share"], time_rows),
            "",
            "memory per device (busiest stage)",
            table(["", "bytes"], mem_rows),
            "",
            "collectives per iteration, per device",
            table(["axis", "kind", "size", "count"], coll_rows, align="llrr") if coll_rows else "(none)",
        ]
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a command returns when its exit status is not 0: the result it prints (text or JSON data) all the
    same, the status (3: no configuration fits the devices) and an optional line for stderr."""

    result: Any
    status: int = 0
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in (0, 3):
            raise ValueError(f"status must be 0 or 3, got {self.status!r}")


def profile_line(data: dict[str, Any]) -> list[str]:
    """One line saying how much of the layers' time a profile database measured (``--profile-db``), or none."""
    profile = data.get("profile")
    if not profile:
        return []
    units = profile.get("root_units_measured", 0)
    roots = "; the root FSDP unit's gathers and reduce-scatters measured too" if units else ""
    kinds = profile.get("collectives") or []
    timed = f"; {', '.join(kinds)} (kind/group) priced by its collective times" if kinds else ""
    return [f"measured: {profile['measured_share']:.1%} of the layers' time from {profile['db']} "
            f"({profile['device']}){roots}{timed}; the rest priced by the roofline"]
