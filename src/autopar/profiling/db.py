"""The profile database: measured seconds of layers under layouts, on one kind of device, kept as JSON.

One file holds the measurements of one device (``device``: the host's processor or the CUDA device's name, and
the threads per rank) under one torch version, in the layout version `VERSION` of this module. Each entry is one
layer kind run under one layout for one micro-batch on one device:

    {"layer": "<fingerprint>", "name": "layers.0", "tp": 2, "sp": false, "recompute": "none", "zero": 0,
     "samples": 1, "ranks": 2, "dtype": "fp32", "forward": 0.0123, "backward": 0.0251, "repeats": 5}

``layer`` is `fingerprint` of the traced layer: what it computes (its ops in order, its parameters' shapes, its
model FLOPs per sample, which fix the sequence length), not where it sits, so a 1,000-layer model's layers share
one entry with a 10-layer one's of the same width (CFP's depth independence). ``ranks`` is how many ranks ran at
once on the host while it was measured: on a CPU they share cores and memory bandwidth, so a figure taken beside
one peer holds for plans of that many ranks only. ``zero`` is 0, or 1 or 3 where the layer was its own FSDP unit
over the data-parallel ranks: under 3 its weights' gathers and its gradients' reduce-scatter are inside its
times; under 1 FSDP's work around a micro-batch that synchronises nothing, and (``step_forward``,
``step_backward``, where measured) the layer's forward in a step's first micro-batch, its weights gathered first, and
its backward in the step's last, its gradients reduce-scattered: the once-a-step work of its unit.

Beside the layers, ``units`` holds FSDP units measured apart: under ZeRO 1 and 3 the root unit (the parameters
outside the repeated layers: embeddings, final norm, head) is gathered and reduce-scattered by FSDP2 around the
whole model, so no layer's run holds its collectives. A unit is keyed by `unit_fingerprint` of its parameters'
shapes, the data-parallel ranks it is sharded over, the ranks on the host and the dtype:

    {"unit": "<fingerprint>", "name": "root", "dp": 2, "ranks": 2, "dtype": "fp32", "gather": 0.004,
     "reduce_scatter": 0.006, "repeats": 5}

``gather`` is one all-gather of the unit's weights and ``reduce_scatter`` one reduce-scatter of its gradients, each
with FSDP's copies around it (seconds).

Beside them, ``ops`` holds single aten ops timed on one rank's share of the host (`autopar.profiling.ops`, Aceso's
op database): an op is keyed by its name, its inputs' shapes for one sample and its dtype, with the ranks that ran
at once, and holds its (work, forward, backward) seconds at each amount of work measured (samples per device over
tensor-parallel ways):

    {"op": "aten.addmm.default", "inputs": [[64], [32, 64], [64, 64]], "dtype": "fp32", "ranks": 2,
     "name": "layers.0.attn.proj", "points": [[0.5, 1.1e-05, 2.3e-05], [1, 1.9e-05, 4.1e-05]], "repeats": 9}

and ``dispatch`` what DTensor's dispatch adds to one op with that many ranks on the host (seconds, the median over
the model's ops), which intra-op plans, run op by op through DTensor, pay on every op:

    {"ranks": 2, "dtype": "fp32", "forward": 6.1e-05, "backward": 9.8e-05, "repeats": 9}

and ``collectives`` each collective kind timed on the live process group (`autopar.profiling.collectives`): on
groups of ``group`` ranks, ``ranks`` ranks on the host all timing at once (``ranks / group`` groups side by side, as
a plan's axis groups run), seconds by message size (bytes of the whole buffer, as `autopar.cluster.collectives`
counts them):

    {"kind": "all_gather", "group": 2, "ranks": 2, "points": [[4096, 0.0004], [1048576, 0.0016]], "repeats": 9}

Files are read with every field checked: a truncated, corrupt or foreign file (another device, another torch,
another layout version) is refused with one error naming the file and what is wrong, never used in part. Nothing
is pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.files import read_text, write_atomic

VERSION = 1
MAX_BYTES = 64 << 20
RECOMPUTE_LEVELS = ("none", "selective", "full")


class ProfileError(ValueError):
    """A profile database that cannot be used; the message names the file."""


def this_device(device: torch.device | None = None, *, threads: int | None = None) -> str:
    """What measures: the CUDA device's name, or the host's processor and the threads one rank uses (``threads``,
    default this process's)."""
    if device is not None and device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {_processor()}, {threads or torch.get_num_threads()} thread(s) per rank"


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"


def fingerprint(ops: Iterable[str], params: Iterable[tuple[int, ...]], flops_per_sample: float) -> str:
    """A layer's identity as the database keys it: its ops in order, its parameters' shapes, its model FLOPs per
    sample (rounded to whole FLOPs). Equal for copies of one layer; independent of the layer's place and of the
    batch it was traced at."""
    text = json.dumps([list(ops), [list(p) for p in params], round(flops_per_sample)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    layer: str
    name: str  # a layer it was measured on (for people reading the file)
    tp: int
    sp: bool
    recompute: str
    zero: int  # 0, or 1 or 3: the layer its own FSDP unit (`Entry` in the module's docstring)
    samples: float  # samples of a micro-batch one device runs
    ranks: int  # ranks running at once on the host while measured
    dtype: str
    forward: float  # seconds, collectives inside the layer included
    backward: float  # seconds, recomputation and collectives inside the layer included (0: no backward)
    repeats: int
    # ZeRO 1 only, where measured: the forward that gathers the unit's weights (a step's first micro-batch) and the
    # backward that reduce-scatters its gradients (the step's last), seconds, FSDP's work around them included
    step_forward: float | None = None
    step_backward: float | None = None

    @property
    def key(self) -> tuple:
        return (self.layer, self.tp, self.sp, self.recompute, self.zero, float(self.samples), self.ranks, self.dtype)


def unit_fingerprint(shapes: Iterable[tuple[int, ...]]) -> str:
    """An FSDP unit's identity as the database keys it: its parameters' shapes, in any order."""
    text = json.dumps(sorted(list(shape) for shape in shapes))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitEntry:
    unit: str  # `unit_fingerprint` of its parameters' shapes
    name: str  # which unit it was measured as (for people reading the file): "root"
    dp: int  # ranks it is sharded over
    ranks: int  # ranks running at once on the host while measured
    dtype: str
    gather: float  # seconds of one all-gather of its weights, FSDP's copies included
    reduce_scatter: float  # seconds of one reduce-scatter of its gradients, FSDP's copies included
    repeats: int

    @property
    def key(self) -> tuple:
        return (self.unit, self.dp, self.ranks, self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpEntry:
    op: str  # "aten.addmm.default"
    inputs: tuple[tuple[int, ...], ...]  # input shapes for one sample (`autopar.profiling.ops.op_key`)
    dtype: str
    ranks: int  # ranks timing ops at once on the host
    name: str  # a module it was seen in (for people reading the file)
    points: tuple[tuple[float, float, float], ...]  # (work, forward seconds, backward seconds), work ascending
    repeats: int

    @property
    def key(self) -> tuple:
        return (self.op, json.dumps([list(s) for s in self.inputs]), self.dtype, self.ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchEntry:
    ranks: int
    dtype: str
    forward: float  # seconds DTensor adds to one op's forward
    backward: float  # and to its backward
    repeats: int

    @property
    def key(self) -> tuple:
        return (self.ranks, self.dtype)


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True, slots=True)
class CollectiveEntry:
    kind: str  # one of COLLECTIVE_KINDS
    group: int  # ranks in each group
    ranks: int  # ranks on the host timing at once
    points: tuple[tuple[int, float], ...]  # (bytes, seconds), bytes ascending
    repeats: int

    @property
    def key(self) -> tuple:
        return (self.kind, self.group, self.ranks)


@dataclass(slots=True)
class ProfileDB:
    device: str
    torch: str = field(default_factory=lambda: torch.__version__)
    entries: dict[tuple, Entry] = field(default_factory=dict)
    path: str | None = None
    units: dict[tuple, UnitEntry] = field(default_factory=dict)
    ops: dict[tuple, OpEntry] = field(default_factory=dict)
    dispatch: dict[tuple, DispatchEntry] = field(default_factory=dict)
    collectives: dict[tuple, CollectiveEntry] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``cpu`` or ``cuda``."""
        return self.device.partition(":")[0]

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry

    def get(self, layer: str, *, tp: int, sp: bool, recompute: str, samples: float, ranks: int, dtype: str,
            zero: int = 0) -> Entry | None:
        """The measurement of ``layer`` under that layout, if there is one. On a GPU the ranks beside it do not
        slow a device down, so an entry measured with any number of ranks will do."""
        found = self.entries.get((layer, tp, sp, recompute, zero, float(samples), ranks, dtype))
        if found is None and self.kind == "cuda":
            found = next((e for e in self.entries.values()
                          if e.key[:6] == (layer, tp, sp, recompute, zero, float(samples)) and e.dtype == dtype),
                         None)
        return found

    def pace(self, busy: int, ranks: int, *, dtype: str) -> float | None:
        """How long layers take with ``busy`` ranks running on the host, as a share of their time with ``ranks``:
        the summed times of every layer measured both ways under one layout, or None where none was (on a GPU,
        where ranks do not share a device, 1)."""
        if self.kind == "cuda":
            return 1.0
        both: dict[tuple, dict[int, float]] = {}
        for e in self.entries.values():
            if e.dtype == dtype and e.ranks in (busy, ranks):
                both.setdefault(e.key[:6], {})[e.ranks] = e.forward + e.backward
        few = sum(t[busy] for t in both.values() if len(t) == 2)
        many = sum(t[ranks] for t in both.values() if len(t) == 2)
        return few / many if many > 0 else None

    def add_unit(self, entry: UnitEntry) -> None:
        self.units[entry.key] = entry

    def unit(self, unit: str, *, dp: int, ranks: int, dtype: str) -> UnitEntry | None:
        """The measurement of the FSDP unit ``unit`` sharded over ``dp`` ranks, if there is one (on a GPU, measured
        with any number of ranks on the host)."""
        found = self.units.get((unit, dp, ranks, dtype))
        if found is None and self.kind == "cuda":
            found = next((e for e in self.units.values() if (e.unit, e.dp, e.dtype) == (unit, dp, dtype)), None)
        return found

    def add_op(self, entry: OpEntry) -> None:
        """Add an op's times; points at a work already held for it are replaced, the others kept."""
        old = self.ops.get(entry.key)
        if old is not None:
            works = {p[0] for p in entry.points}
            points = tuple(sorted([p for p in old.points if p[0] not in works] + list(entry.points)))
            entry = OpEntry(op=entry.op, inputs=entry.inputs, dtype=entry.dtype, ranks=entry.ranks, name=entry.name,
                            points=points, repeats=entry.repeats)
        self.ops[entry.key] = entry

    def op_times(self, *, ranks: int, dtype: str) -> Any:
        """The ops measured in ``dtype`` with ``ranks`` ranks on the host (on a GPU, with any number), as the cost
        model reads them (`autopar.profiling.ops.OpTimes`)."""
        from autopar.profiling.ops import OpTimes

        curves: dict[tuple, list] = {}
        for e in self.ops.values():
            if e.dtype == dtype and (e.ranks == ranks or self.kind == "cuda"):
                curves.setdefault((e.op, e.key[1], e.dtype), []).extend(e.points)
        found = self.dispatch.get((ranks, dtype))
        if found is None and self.kind == "cuda":
            found = next((d for d in self.dispatch.values() if d.dtype == dtype), None)
        return OpTimes(curves, None if found is None else (found.forward, found.backward))

    def add_collective(self, entry: CollectiveEntry) -> None:
        """Add ``entry``'s points to what is known of its kind and group; a size measured again is replaced."""
        old = self.collectives.get(entry.key)
        points = dict(old.points) if old is not None else {}
        points.update(dict(entry.points))
        self.collectives[entry.key] = CollectiveEntry(entry.kind, entry.group, entry.ranks,
                                                      tuple(sorted(points.items())), entry.repeats)

    def links(self, cluster: Any) -> Any:
        """``cluster`` with the collectives this database measured with as many ranks on the host as
        ``cluster`` has per node as tables of its links within a node (`autopar.cluster.spec.Link.tables`; the
        cost model then prices those collectives by them), or ``cluster`` itself where none was."""
        from dataclasses import replace

        from autopar.cluster.spec import Measured

        host = cluster.devices_per_node
        tables = tuple(Measured(ranks=e.group, bytes=tuple(b for b, _ in e.points),
                                seconds=tuple(t for _, t in e.points), kind=e.kind)
                       for e in sorted(self.collectives.values(), key=lambda e: e.key)
                       if (e.ranks == host or self.kind == "cuda") and len(e.points) >= 2)
        if not tables:
            return cluster
        return replace(cluster, intra=replace(cluster.intra, tables=tables))

    def to_json(self) -> str:
        entries = sorted(self.entries.values(),
                         key=lambda e: (e.name, e.tp, e.sp, e.recompute, e.zero, e.samples, e.ranks))
        data = {"autopar_profile": VERSION, "device": self.device, "torch": self.torch,
                "entries": [_entry_json(e) for e in entries]}
        if self.units:  # files before unit measurements have none
            data["units"] = [asdict(u) for u in sorted(self.units.values(), key=lambda u: (u.name, u.dp, u.ranks))]
        if self.dispatch:
            data["dispatch"] = [asdict(d) for d in sorted(self.dispatch.values(), key=lambda d: d.key)]
        if self.collectives:
            data["collectives"] = [{**asdict(c), "points": [list(p) for p in c.points]}
                                   for c in sorted(self.collectives.values(), key=lambda c: c.key)]
        if self.ops:  # files before op measurements have none
            data["ops"] = [{**asdict(o), "inputs": [list(s) for s in o.inputs], "points": [list(p) for p in o.points]}
                           for o in sorted(self.ops.values(), key=lambda o: o.key)]
        return json.dumps(data, indent=1) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomic(path, self.to_json())
        self.path = str(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, device: str | None = None) -> ProfileDB:
        """Read ``path``, refusing it (`ProfileError`, naming the file) when it is not a complete profile
        database of this layout version and torch, or (``device`` given) was measured on another device."""
        shown = str(path)
        try:
            text = read_text(path, what="profile database", limit=MAX_BYTES)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{shown}: not a profile database: not JSON ({exc.msg} at line {exc.lineno}; "
                               "a truncated or corrupt file): profile again with autopar profile-segments") from None
        if not isinstance(data, dict) or "autopar_profile" not in data:
            raise ProfileError(f"{shown}: not a profile database (no autopar_profile field): write one with "
                               "autopar profile-segments --db FILE")
        if data["autopar_profile"] != VERSION:
            raise ProfileError(f"{shown}: profile database version {data['autopar_profile']!r}; this autopar reads "
                               f"version {VERSION}: profile again into a new file")
        db = cls(device=_text(shown, data, "device"), torch=_text(shown, data, "torch"), path=shown)
        if db.torch != torch.__version__:
            raise ProfileError(f"{shown}: measured under torch {db.torch}, this is torch {torch.__version__}: its "
                               "times may not hold; profile again into a new file")
        if device is not None and db.device != device:
            raise ProfileError(f"{shown}: measured on {db.device!r}, this is {device!r}: profile on this device "
                               "into another file")
        if not isinstance(data.get("entries"), list):
            raise ProfileError(f"{shown}: entries must be a list")
        for i, raw in _listed(shown, data, "entries"):
            db.add(_entry(shown, i, raw))
        for i, raw in _listed(shown, data, "units"):
            db.add_unit(_unit(shown, i, raw))
        for i, raw in _listed(shown, data, "ops"):
            db.add_op(_op(shown, i, raw))
        for i, raw in _listed(shown, data, "dispatch"):
            _fields(f"{shown}: dispatch[{i}]", raw, set(DispatchEntry.__dataclass_fields__), checks={
                "ranks": _positive_int, "repeats": _positive_int, "dtype": lambda v: v in ("fp32", "bf16", "fp16"),
                "forward": _non_negative, "backward": _non_negative})
            entry = DispatchEntry(**raw)
            db.dispatch[entry.key] = entry
        for i, raw in _listed(shown, data, "collectives"):
            db.add_collective(_collective(shown, i, raw))
        return db


def _collective(shown: str, i: int, raw: Any) -> CollectiveEntry:
    where = f"{shown}: collectives[{i}]"
    _fields(where, raw, set(CollectiveEntry.__dataclass_fields__), checks={
        "kind": lambda v: v in COLLECTIVE_KINDS, "group": lambda v: _positive_int(v) and v >= 2,
        "ranks": _positive_int, "repeats": _positive_int, "points": lambda v: isinstance(v, list) and len(v) >= 1})
    points = []
    for point in raw["points"]:
        if not (isinstance(point, list) and len(point) == 2 and _positive_int(point[0]) and _positive(point[1])):
            raise ProfileError(f"{where}: points must be [bytes, seconds] pairs of a positive whole number of bytes "
                               f"and positive seconds, got {point!r}")
        points.append((point[0], float(point[1])))
    if any(a[0] >= b[0] for a, b in zip(points, points[1:])):
        raise ProfileError(f"{where}: points must be in ascending bytes, each size once")
    if raw["ranks"] % raw["group"]:
        raise ProfileError(f"{where}: group {raw['group']} does not divide the {raw['ranks']} ranks")
    return CollectiveEntry(raw["kind"], raw["group"], raw["ranks"], tuple(points), raw["repeats"])


def _listed(shown: str, data: dict, name: str) -> Iterable[tuple[int, Any]]:
    """The items of the file's list ``name`` (absent: none, as in files before it existed), numbered."""
    items = data.get(name, [])
    if not isinstance(items, list):
        raise ProfileError(f"{shown}: {name} must be a list")
    return enumerate(items)


def _entry_json(entry: Entry) -> dict:
    """An entry as written: its step times only where it has them (files of earlier versions have none)."""
    out = asdict(entry)
    for name in _OPTIONAL:
        if out[name] is None:
            del out[name]
    return out


_OPTIONAL = ("step_forward", "step_backward")


def _text(shown: str, data: dict, name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{shown}: {name} must be a non-empty string, got {value!r}")
    return value


def _entry(shown: str, i: int, raw: Any) -> Entry:
    where = f"{shown}: entries[{i}]"
    _fields(where, raw, set(Entry.__dataclass_fields__), optional=set(_OPTIONAL), checks={
        "layer": lambda v: isinstance(v, str) and v != "", "name": lambda v: isinstance(v, str),
        "tp": _positive_int, "ranks": _positive_int, "repeats": _positive_int,
        "sp": lambda v: isinstance(v, bool), "recompute": lambda v: v in RECOMPUTE_LEVELS,
        "zero": lambda v: v in (0, 1, 3) and not isinstance(v, bool),
        "dtype": lambda v: v in ("fp32", "bf16", "fp16"),
        "samples": _positive, "forward": _positive, "backward": _non_negative,
    })
    steps = [raw.get(name) for name in _OPTIONAL]
    if any(v is not None for v in steps):
        if raw["zero"] != 1:
            raise ProfileError(f"{where}: step_forward and step_backward belong to ZeRO 1 entries, this one is ZeRO "
                               f"{raw['zero']}")
        for name, value in zip(_OPTIONAL, steps):
            if not _non_negative(value):
                raise ProfileError(f"{where}.{name}: invalid value {value!r}")
    return Entry(**raw)


def _fields(where: str, raw: Any, names: set[str], *, checks: dict[str, Any],
            optional: set[str] = frozenset()) -> None:
    """Refuse ``raw`` unless it is an object with exactly the fields ``names`` (those in ``optional`` may be
    absent), each value passing its check in ``checks``."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be an object, got {type(raw).__name__}")
    missing, unknown = names - set(raw) - optional, set(raw) - names
    if missing or unknown:
        raise ProfileError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(sorted(missing))}"] if missing else [])
            + ([f"unknown {', '.join(sorted(unknown))}"] if unknown else [])))
    for name, ok in checks.items():
        if not ok(raw[name]):
            raise ProfileError(f"{where}.{name}: invalid value {raw[name]!r}")


def _unit(shown: str, i: int, raw: Any) -> UnitEntry:
    where = f"{shown}: units[{i}]"
    _fields(where, raw, set(UnitEntry.__dataclass_fields__), checks={
        "unit": lambda v: isinstance(v, str) and v != "", "name": lambda v: isinstance(v, str),
        "dp": lambda v: _positive_int(v) and v > 1, "ranks": _positive_int, "repeats": _positive_int,
        "dtype": lambda v: v in ("fp32", "bf16", "fp16"), "gather": _non_negative, "reduce_scatter": _non_negative,
    })
    return UnitEntry(**raw)


def _op(shown: str, i: int, raw: Any) -> OpEntry:
    where = f"{shown}: ops[{i}]"
    _fields(where, raw, set(OpEntry.__dataclass_fields__), checks={
        "op": lambda v: isinstance(v, str) and v.count(".") == 2, "name": lambda v: isinstance(v, str),
        "inputs": lambda v: isinstance(v, list) and all(
            isinstance(s, list) and all(_positive_int(d) or d == 0 for d in s) for s in v),
        "dtype": lambda v: v in ("fp32", "bf16", "fp16"), "ranks": _positive_int, "repeats": _positive_int,
        "points": lambda v: isinstance(v, list) and len(v) > 0 and all(
            isinstance(p, list) and len(p) == 3 and _positive(p[0]) and _non_negative(p[1]) and _non_negative(p[2])
            for p in v),
    })
    return OpEntry(op=raw["op"], inputs=tuple(tuple(s) for s in raw["inputs"]), dtype=raw["dtype"],
                   ranks=raw["ranks"], name=raw["name"], points=tuple(sorted(tuple(p) for p in raw["points"])),
                   repeats=raw["repeats"])


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive(value: Any) -> bool:
    return _non_negative(value) and value > 0


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
