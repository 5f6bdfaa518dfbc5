"""The records a plan is made of: workload, mesh, parameter layouts, stages and intra-op block choices.

Each validates itself on construction (`autopar.plan.checks`) and has a ``from_dict`` that reads its JSON form,
refusing unknown fields, and (where the plan writes it) a ``to_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Placement, Shard

from autopar.plan.checks import (
    FieldError,
    at,
    choice,
    finite,
    flag,
    integer,
    mapping,
    quote,
    sequence,
    strings,
    text,
    unknown_fields,
)
from autopar.plan.estimate import MemoryBreakdown
from autopar.sharding import parse, short

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RECOMPUTE = ("none", "selective", "full")
KERNELS = ("eager", "compiled")  # memory-bound ops one kernel each, or fused between contractions (torch.compile)
DTYPES = ("bf16", "fp16", "fp32")

# Bounds of plan fields and of the CLI's flags alike: generous for real models and clusters, finite so that no
# command hangs, runs out of memory or overflows on a mistyped value (README.md, "Bounds").
MAX_DEVICES = 131_072
MAX_BATCH = 16_777_216
MAX_SEQ = 1_048_576
MAX_CHUNKS = 1_024
MAX_DIM = 1 << 40
# model overrides, with the largest value any real model needs (and that builds in bounded time)
OVERRIDE_LIMITS = {"layers": 2_048, "hidden": 131_072, "heads": 1_024, "vocab": 4_194_304, "ffn": 1_048_576,
                   "kv_heads": 1_024, "experts": 4_096}


def expert_parallel_limits(ep: int, grids: list[tuple[int, int]]) -> str | None:
    """Why expert parallelism over ``ep`` ranks cannot run on stages of ``grids`` ((dp, tp) each) so far, or None:
    the experts split over each stage's whole data-parallel group (every stage's dp is ep), without tensor
    parallelism, under any ZeRO stage. The one rule the cost model's configurations, the command line and the
    runtime all apply (a plan file's ``ep`` must also equal its stages' dp: `Plan`)."""
    if ep == 1:
        return None
    dps, tps = sorted({dp for dp, _ in grids}), sorted({tp for _, tp in grids})
    if dps == [ep] and tps == [1]:
        return None
    return (f"expert parallelism splits the experts over each stage's whole data-parallel group, without tensor "
            f"parallelism, so far: ep {ep} needs dp {ep} and tp 1 (got dp {'/'.join(map(str, dps))}, tp "
            f"{'/'.join(map(str, tps))})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """How to rebuild the model and its batches: a model name with its overrides, sequence, global batch, dtype.

    ``model`` is what `autopar.zoo` builds: a zoo name, ``hf:<model_type>``, ``hf:<absolute path>.json``, or a
    function that builds the model, ``<absolute path>.py:function`` or ``package.module:function`` (loading a plan
    runs nothing; `autopar run` imports the file, which is the user's code)."""

    model: str
    overrides: tuple[tuple[str, int], ...] = ()
    seq: int
    batch: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        text("model", self.model, limit=1024)
        integer("seq", self.seq, high=MAX_SEQ)
        integer("batch", self.batch, high=MAX_BATCH)
        choice("dtype", self.dtype, DTYPES)
        if not isinstance(self.overrides, tuple):
            raise FieldError("overrides", f"must be a tuple of (name, value) pairs, got {quote(self.overrides)}")
        for pair in self.overrides:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise FieldError("overrides", f"must hold (name, value) pairs, got {quote(pair)}")
            name, value = pair
            choice("overrides key", name, tuple(OVERRIDE_LIMITS))
            integer(f"overrides.{name}", value, high=OVERRIDE_LIMITS[name])

    @property
    def override_map(self) -> dict[str, int]:
        return dict(self.overrides)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "overrides": dict(self.overrides), "seq": self.seq, "batch": self.batch,
                "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Any) -> Workload:
        data = mapping("", data)
        unknown_fields("", data, ("model", "overrides", "seq", "batch", "dtype"))
        overrides = mapping("overrides", data.get("overrides", {}))
        return cls(model=data.get("model"), overrides=tuple(sorted(overrides.items())), seq=data.get("seq"),
                   batch=data.get("batch"), dtype=data.get("dtype", "bf16"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    """Device mesh sizes and axis names, outermost first (a pipeline plan: ``pp`` x the devices of a stage)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not isinstance(self.axes, tuple):
            raise FieldError("mesh", "needs shape and axes as tuples")
        if not 1 <= len(self.shape) <= 4 or len(self.axes) != len(self.shape):
            raise FieldError("mesh", f"needs 1 to 4 axes with one name each, got shape {quote(self.shape)} and "
                             f"axes {quote(self.axes)}")
        for k, size in enumerate(self.shape):
            integer(f"shape[{k}]", size, high=MAX_DEVICES)
        for k, name in enumerate(self.axes):
            text(f"axes[{k}]", name, limit=32)
        if len(set(self.axes)) != len(self.axes):
            raise FieldError("axes", f"must be distinct, got {quote(self.axes)}")
        if math.prod(self.shape) > MAX_DEVICES:
            raise FieldError("shape", f"holds {math.prod(self.shape):,} devices, more than {MAX_DEVICES:,}")

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_dict(cls, data: Any) -> Mesh:
        data = mapping("", data)
        unknown_fields("", data, ("shape", "axes"))
        return cls(shape=tuple(sequence("shape", data.get("shape"))), axes=tuple(sequence("axes", data.get("axes"))))


def _layout(name: str, value: Any) -> tuple[Placement, ...]:
    """``"[R, S(0)]"`` (one placement per mesh axis) or ``"S(0)"`` on a one-axis mesh, as DTensor placements."""
    if not isinstance(value, str) or len(value) > 256:
        raise FieldError(name, f"must be a layout like [R, S(0)], got {quote(value)}")
    parts = value[1:-1].split(",") if value.startswith("[") and value.endswith("]") else [value]
    try:
        return tuple(parse(part) for part in parts)
    except ValueError as exc:
        raise FieldError(name, f"is not a layout like [R, S(0)]: {exc}") from None


def layout_text(placements: tuple[Placement, ...]) -> str:
    return short(placements[0]) if len(placements) == 1 else "[" + ", ".join(short(p) for p in placements) + "]"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """One parameter's DTensor placements, one per mesh axis, and the shape it was planned for. ``summed``: tp keeps
    it whole but applies it to the activations it splits (a q or k norm per head), so each tp rank computes its
    gradient from its own heads and the gradients are summed over tp after the backward. ``reduced`` (intra-op
    plans): the mesh axes that hold it whole while the plan splits the work there, so that its gradient is a sum
    over them (its data-parallel axes); ZeRO 3 keeps it in slices over them between its uses."""

    name: str
    placements: tuple[Placement, ...]
    shape: tuple[int, ...] | None = None
    summed: bool = False
    reduced: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        text("name", self.name, limit=1024)
        flag(f"{self.name} summed", self.summed)
        if not isinstance(self.placements, tuple) or not all(isinstance(p, Placement) for p in self.placements):
            raise FieldError(self.name, f"placements must be DTensor placements, got {quote(self.placements)}")
        if not isinstance(self.reduced, tuple):
            raise FieldError(f"{self.name} reduced", f"must be a list of mesh axes, got {quote(self.reduced)}")
        for axis in self.reduced:
            integer(f"{self.name} reduced", axis, low=0, high=len(self.placements) - 1)
        if list(self.reduced) != sorted(set(self.reduced)):
            raise FieldError(f"{self.name} reduced", f"must be mesh axes in increasing order, each once, got "
                                                     f"{quote(list(self.reduced))}")
        for axis in self.reduced:
            if not self.placements[axis].is_replicate():
                raise FieldError(f"{self.name} reduced", f"names mesh axis {axis}, where the parameter is split "
                                                         f"({short(self.placements[axis])}); a gradient is summed "
                                                         "only over axes that hold the parameter whole")
        if self.shape is not None:
            if not isinstance(self.shape, tuple) or len(self.shape) > 8:
                raise FieldError(f"{self.name} shape", f"must be a list of at most 8 sizes, got {quote(self.shape)}")
            for k, size in enumerate(self.shape):
                integer(f"{self.name} shape[{k}]", size, low=0, high=MAX_DIM)
            for p in self.placements:
                if isinstance(p, Shard) and p.dim >= len(self.shape):
                    raise FieldError(self.name, f"is split on dim {p.dim} but has only {len(self.shape)} dims")

    def on(self, axis: int) -> Placement:
        return self.placements[axis]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleLayout:
    """A module's parameters' layouts, and (an intra-op plan's leading modules, and those of layers a pipeline
    stage lays out by the intra-op planner) the layouts its input and output take: a pipeline plan's on (dp, tp),
    dp splitting the batch, the runtime converting them on tp."""

    fqn: str
    params: tuple[ParamLayout, ...] = ()
    input: tuple[Placement, ...] | None = None
    output: tuple[Placement, ...] | None = None
    # weights another module holds that this module's leading op reads in another layout (a head tied to the
    # embedding reads the table whole where the embedding keeps it split): (name, layout)
    reads: tuple[tuple[str, tuple[Placement, ...]], ...] = ()

    def __post_init__(self) -> None:
        text("fqn", self.fqn, limit=1024, empty=True)
        if not isinstance(self.params, tuple) or not all(isinstance(p, ParamLayout) for p in self.params):
            raise FieldError("params", "must be a tuple of ParamLayout")

    def axes(self) -> set[int]:
        """How many placements each layout has (one per mesh axis): a set, so inconsistent modules show."""
        counts = {len(p.placements) for p in self.params}
        counts |= {len(x) for x in (self.input, self.output) if x is not None}
        counts |= {len(layout) for _, layout in self.reads}
        return counts

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"params": {p.name: layout_text(p.placements) for p in self.params}}
        shapes = {p.name: list(p.shape) for p in self.params if p.shape is not None}
        if shapes:
            entry["shapes"] = shapes
        summed = [p.name for p in self.params if p.summed]
        if summed:
            entry["summed"] = summed
        reduced = {p.name: list(p.reduced) for p in self.params if p.reduced}
        if reduced:
            entry["reduced"] = reduced
        for key in ("input", "output"):
            value = getattr(self, key)
            if value is not None:
                entry[key] = layout_text(value)
        if self.reads:
            entry["reads"] = {name: layout_text(layout) for name, layout in self.reads}
        return entry

    @classmethod
    def from_dict(cls, fqn: str, data: Any) -> ModuleLayout:
        data = mapping("", data)
        unknown_fields("", data, ("params", "shapes", "summed", "reduced", "input", "output", "reads"))
        shapes = mapping("shapes", data.get("shapes", {}))
        layouts = mapping("params", data.get("params", {}))
        summed = strings("summed", data.get("summed", []))
        for name in summed:
            if name not in layouts:
                raise FieldError("summed", f"names {quote(name)}, which is not one of the module's params")
        reduced = mapping("reduced", data.get("reduced", {}))
        for name in reduced:
            if name not in layouts:
                raise FieldError("reduced", f"names {quote(name)}, which is not one of the module's params")
        params = []
        for name, layout in layouts.items():
            shape = shapes.get(name)
            params.append(ParamLayout(name=name, placements=_layout(f"params[{name!r}]", layout),
                                      shape=None if shape is None else tuple(sequence(f"shapes[{name!r}]", shape)),
                                      summed=name in summed,
                                      reduced=tuple(sequence(f"reduced[{name!r}]", reduced.get(name, [])))))
        reads = tuple((name, _layout(f"reads[{name!r}]", layout))
                      for name, layout in mapping("reads", data.get("reads", {})).items())
        return cls(fqn=fqn, params=tuple(params), reads=reads,
                   **{key: _layout(key, data[key]) for key in ("input", "output") if key in data})


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage: its layers (names in the model's chain, in order), dp x tp devices, recomputed layers,
    checkpointed runs and, where the intra-op planner lays its layers out, per layer the split of each block."""

    layers: tuple[str, ...]
    dp: int
    tp: int
    recompute: tuple[tuple[str, str], ...] = ()  # (layer, selective | full); layers not named keep everything
    segments: tuple[tuple[str, str], ...] = ()  # (first layer, last layer) of each run checkpointed together
    intra: bool = False
    layouts: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # layer -> (module in the layer, split)
    seconds_per_micro_batch: float | None = None
    memory: MemoryBreakdown | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple) or not self.layers:
            raise FieldError("layers", f"must name at least one layer, got {quote(self.layers)}")
        strings("layers", list(self.layers))
        if len(set(self.layers)) != len(self.layers):
            twice = next(name for name in self.layers if self.layers.count(name) > 1)
            raise FieldError("layers", f"names {twice!r} twice")
        integer("dp", self.dp, high=MAX_DEVICES)
        integer("tp", self.tp, high=MAX_DEVICES)
        position = {name: k for k, name in enumerate(self.layers)}
        for name, mode in self.recompute:
            if name not in position:
                raise FieldError("recompute", f"names {quote(name)}, which is not one of the stage's layers")
            choice(f"recompute[{name!r}]", mode, RECOMPUTE)
        for first, last in self.segments:
            if first not in position or last not in position or position[first] > position[last]:
                raise FieldError("segments", f"holds the run {quote(first)}..{quote(last)}, which is not a run of the "
                                 "stage's layers in order")
        flag("intra", self.intra)
        if self.intra and self.tp < 2:
            raise FieldError("intra", "needs tp 2 or more (the intra-op planner lays layers out over tp)")
        for name, _ in self.layouts:
            if name not in position:
                raise FieldError("layouts", f"names {quote(name)}, which is not one of the stage's layers")
        if self.seconds_per_micro_batch is not None:
            finite("seconds_per_micro_batch", self.seconds_per_micro_batch, low=0.0)

    def recompute_of(self, layer: str) -> str:
        return dict(self.recompute).get(layer, "none")

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "layers": list(self.layers), "dp": self.dp, "tp": self.tp, "recompute": dict(self.recompute),
            "segments": [list(s) for s in self.segments], "intra": self.intra,
            "layouts": {layer: dict(splits) for layer, splits in self.layouts},
        }
        if self.seconds_per_micro_batch is not None:
            entry["seconds_per_micro_batch"] = self.seconds_per_micro_batch
        if self.memory is not None:
            entry["memory"] = self.memory.to_dict()
        return entry

    @classmethod
    def from_dict(cls, data: Any) -> Stage:
        data = mapping("", data)
        unknown_fields("", data, ("layers", "dp", "tp", "recompute", "segments", "intra", "layouts",
                                       "seconds_per_micro_batch", "memory"))
        segments = []
        for k, pair in enumerate(sequence("segments", data.get("segments", []))):
            pair = strings(f"segments[{k}]", pair)
            if len(pair) != 2:
                raise FieldError(f"segments[{k}]", f"must be [first layer, last layer], got {quote(pair)}")
            segments.append(pair)
        layouts = []
        for layer, splits in mapping("layouts", data.get("layouts", {})).items():
            splits = mapping(f"layouts[{layer!r}]", splits)
            for module, split in splits.items():
                text(f"layouts[{layer!r}][{module!r}]", split, limit=16)
            layouts.append((layer, tuple(splits.items())))
        memory = data.get("memory")
        if memory is not None:
            with at("memory"):
                memory = MemoryBreakdown.from_dict({k: v for k, v in mapping("memory", memory).items()
                                                    if k not in ("total", "fits")})
        return cls(
            layers=strings("layers", data.get("layers")), dp=data.get("dp"), tp=data.get("tp"),
            recompute=tuple(mapping("recompute", data.get("recompute", {})).items()), segments=tuple(segments),
            intra=data.get("intra", False), layouts=tuple(layouts),
            seconds_per_micro_batch=data.get("seconds_per_micro_batch"), memory=memory,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """An intra-op plan's choice for one ParallelBlock: which dims its leading op splits over the mesh."""

    id: int
    layer: str  # the profile row (layer) of its leading op: a repeated layer's name, "embed", "head", ...
    module: str
    split: str

    def __post_init__(self) -> None:
        integer("id", self.id, low=0)
        text("layer", self.layer, limit=1024, empty=True)
        text("module", self.module, limit=1024, empty=True)
        text("split", self.split, limit=64)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "layer": self.layer, "module": self.module, "split": self.split}

    @classmethod
    def from_dict(cls, data: Any) -> Block:
        data = mapping("", data)
        unknown_fields("", data, ("id", "layer", "module", "split"))
        return cls(id=data.get("id"), layer=data.get("layer"), module=data.get("module"), split=data.get("split"))
