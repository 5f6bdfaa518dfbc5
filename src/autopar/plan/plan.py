"""The plan: frozen, validated records of what to run, and their JSON form.

A `Plan` says how to rebuild the model and its batches (`Workload`), the device `Mesh`, the pipeline `Stage`\\ s
(or, for an intra-op plan, the `Block` choices), micro-batching, ZeRO and the schedule, per module the DTensor
placements of its parameters (`ModuleLayout`), and what the cost model predicted (`Estimate`). Every record checks
itself on construction, so a plan that exists is one whose numbers are in range and consistent:

- integers are integers (not ``2.0`` or ``true``) within stated bounds; floats are finite;
- ``micro_batch_size x micro_batches = workload.batch``, and every stage's dp divides the micro-batch (each
  data-parallel rank trains ``micro_batch_size / dp`` samples of each micro-batch);
- a pipeline has ``pp x chunks`` stages, each of ``dp x tp`` = the devices per stage; no layer sits in two stages,
  no stage is empty; recomputed layers and checkpointed runs belong to their stage; an intra-op plan's recomputed
  layers (``recompute``) are layers its blocks lie in, each named once;
- placements are ``S(d)``, ``R`` or ``P``, one per mesh axis, ``d`` within the parameter's shape;
- expert parallelism (``ep`` > 1) is a pipeline plan's, every stage's dp being ``ep``.

What needs the model itself (that the stages cover its chain in order, that split widths and heads divide by tp)
is checked by the runtime before any rank starts (`autopar.runtime.validate`).

JSON: ``{"plan": {...}, "estimate": {...}}``, the plan with ``schema`` 2. Schema 1 files (autopar 0.1) read the
same, and files without ``kernels`` (written before it existed) read as ``eager``. A plan without a ``workload``
(one made from Python by `autopar.plan`, or by an older autopar) cannot be run by ``autopar run``, which rebuilds
the model from it; ``autopar.parallelize(model, plan)`` runs it on the model it was made for. Unknown fields are
refused. `Plan.save` writes a plan file atomically and `Plan.load` reads one: loading parses strict JSON from a
bounded regular file, validates every field and never imports or executes anything from the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.tensor import Shard

from autopar.files import PLAN_FILE_LIMIT, read_text, write_atomic
from autopar.plan.batch import LocalBatch, dp_rank, split_batch
from autopar.plan.checks import FieldError, at, choice, flag, integer, mapping, quote, sequence, text, unknown_fields
from autopar.plan.estimate import Estimate
from autopar.plan.records import (
    KERNELS,
    MAX_BATCH,
    MAX_DEVICES,
    MAX_CHUNKS,
    SCHEDULES,
    Block,
    Mesh,
    ModuleLayout,
    Stage,
    Workload,
)

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
_FIELDS = ("schema", "model", "kind", "mesh", "schedule", "chunks", "micro_batch_size", "micro_batches", "zero", "sp",
           "ep", "kernels", "stages", "blocks", "recompute", "modules", "workload")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    model: str  # the model's display name
    kind: str  # what made it: a search (auto, aceso, ilp, ...), a baseline (dp, fsdp, megatron) or estimate
    mesh: Mesh
    micro_batch_size: int  # samples per micro-batch, across the data-parallel ranks
    micro_batches: int
    zero: int = 0
    sp: bool = False
    # expert parallelism: each mixture's experts split over ``ep`` data-parallel ranks (their parameters ``S(0)``
    # on dp), tokens sent to the rank holding their expert by all-to-alls; 1: experts are laid out as the rest of
    # the model
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per device under the interleaved schedule
    # how the memory-bound ops between contractions run: "eager", one kernel per op, or "compiled", fused by
    # torch.compile (each repeated layer compiled); the estimate prices them so and the runtime runs them so
    kernels: str = "eager"
    stages: tuple[Stage, ...] = ()  # a pipeline plan (one stage: no pipelining)
    blocks: tuple[Block, ...] = ()  # an intra-op plan
    # an intra-op plan's layers recomputed in full in the backward (only each one's input kept), in chain order; a
    # pipeline plan's stages name their own (`Stage.recompute`)
    recompute: tuple[str, ...] = ()
    modules: tuple[ModuleLayout, ...] = ()
    workload: Workload | None = None  # how to rebuild the model; without it `autopar run` cannot run the plan
    estimate: Estimate | None = None
    # the planner's text report (the search, runners-up and baselines beside the plan), as `autopar plan` prints it;
    # kept in memory only: a plan file holds the plan and its estimate, so a loaded plan explains those alone (a
    # plan changed with dataclasses.replace keeps the report of the plan it came from: pass report=None)
    report: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        text("model", self.model, limit=1024)
        text("kind", self.kind, limit=64)
        _typed(self)
        integer("micro_batch_size", self.micro_batch_size, high=MAX_BATCH)
        integer("micro_batches", self.micro_batches, high=MAX_BATCH)
        integer("zero", self.zero, low=0, high=3)
        flag("sp", self.sp)
        integer("ep", self.ep, high=MAX_DEVICES)
        choice("schedule", self.schedule, SCHEDULES)
        integer("chunks", self.chunks, high=MAX_CHUNKS)
        choice("kernels", self.kernels, KERNELS)
        if self.workload is not None and self.micro_batch_size * self.micro_batches != self.workload.batch:
            raise FieldError("micro_batches", f"x micro_batch_size is {self.micro_batches} x {self.micro_batch_size} = "
                             f"{self.micro_batches * self.micro_batch_size} samples, but workload.batch is "
                             f"{self.workload.batch}")
        if bool(self.stages) == bool(self.blocks):
            raise FieldError("stages", "or blocks: a plan has pipeline stages or intra-op blocks, exactly one of them")
        if self.stages:
            _check_pipeline(self)
        elif self.schedule != "1f1b" or self.chunks != 1:
            raise FieldError("schedule", "applies to pipeline plans only; an intra-op plan has no stages")
        elif self.ep != 1:
            raise FieldError("ep", "(expert parallelism) applies to pipeline plans only; an intra-op plan's layouts "
                             "say how its experts split")
        _check_recompute(self)
        _check_modules(self)
        if self.report is not None and not isinstance(self.report, str):
            raise FieldError("report", f"must be text or None, got {quote(self.report)}")

    @property
    def is_pipeline(self) -> bool:
        return bool(self.stages)

    @property
    def pp(self) -> int:
        return len(self.stages) // self.chunks if self.stages else 1

    @property
    def devices(self) -> int:
        return self.mesh.devices

    @property
    def grid(self) -> tuple[int, int]:
        """The (dp, tp) of the first stage."""
        return (self.stages[0].dp, self.stages[0].tp)

    def with_workload(self, workload: Workload) -> Plan:
        return replace(self, workload=workload)

    def local_batch(self, batch: Mapping[str, torch.Tensor], rank: int) -> LocalBatch:
        """The rows of the global ``batch`` (every tensor holds its ``micro_batch_size x micro_batches`` rows along
        dim 0) that ``rank`` trains, micro-batch by micro-batch (`autopar.plan.batch`: data-parallel rank
        ``(rank // tp) % dp`` takes its ``micro_batch_size / dp`` rows of each micro-batch). A data loader that
        reads only its own rows reads ``local_batch(...).rows``."""
        if not self.stages:
            raise FieldError("stages", "are missing: an intra-op plan cannot be run yet, so it has no local batches")
        integer("rank", rank, low=0, high=self.devices - 1)
        dp, tp = self.grid
        return split_batch(batch, micro_batch_size=self.micro_batch_size, micro_batches=self.micro_batches, dp=dp,
                           dp_rank=dp_rank(rank, dp=dp, tp=tp))

    def explain(self) -> str:
        """The text report `autopar plan` prints: for a plan `autopar.plan` made, the search, its runners-up and
        the baselines beside the plan; for a loaded plan, its stages and estimate (the comparison is not saved)."""
        if self.report is not None:
            return self.report
        from autopar.api.report import plan_text  # the report layer sits above the plan in the data flow

        return plan_text(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan and its estimate to ``path`` as a plan file, atomically (a temporary file renamed into
        place), so an interrupted write never leaves half a plan. The in-memory report is not saved."""
        write_atomic(path, json.dumps(self.to_file_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan of a plan file, with its estimate, validated; a ValueError naming the file and field otherwise."""
        raw = read_text(path, what="plan file", limit=PLAN_FILE_LIMIT)
        try:
            data = json.loads(raw, parse_constant=_no_constant)
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
            return cls.from_dict(data["plan"], estimate=data.get("estimate"))
        except FieldError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The ``plan`` object of a plan file (its estimate goes beside it)."""
        data: dict[str, Any] = {"schema": SCHEMA_VERSION, "model": self.model, "kind": self.kind,
                                "mesh": {"shape": list(self.mesh.shape), "axes": list(self.mesh.axes)}}
        if self.stages:
            data.update(schedule=self.schedule, chunks=self.chunks)
        data.update(micro_batch_size=self.micro_batch_size, micro_batches=self.micro_batches, zero=self.zero,
                    sp=self.sp, ep=self.ep, kernels=self.kernels)
        if self.stages:
            data["stages"] = [s.to_dict() for s in self.stages]
        else:
            data["blocks"] = [b.to_dict() for b in self.blocks]
            if self.recompute:
                data["recompute"] = list(self.recompute)
        data["modules"] = {m.fqn: m.to_dict() for m in self.modules}
        if self.workload is not None:
            data["workload"] = self.workload.to_dict()
        return data

    def to_file_dict(self) -> dict[str, Any]:
        return {"plan": self.to_dict(), "estimate": None if self.estimate is None else self.estimate.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, *, estimate: Any = None) -> Plan:
        """A plan from its JSON object (schema 1 or 2); errors name the field (`FieldError`)."""
        data = mapping("plan", data)
        schema = data.get("schema")
        if schema not in READABLE_SCHEMAS or type(schema) is not int:
            raise FieldError("schema", f"is {quote(schema)}; this autopar reads plan schemas "
                             f"{', '.join(map(str, READABLE_SCHEMAS))}")
        unknown_fields("plan", data, _FIELDS)
        for key in ("model", "mesh", "micro_batch_size", "micro_batches", "modules"):
            if key not in data:
                raise FieldError(key, "is missing")
        with at("mesh"):
            mesh = Mesh.from_dict(data["mesh"])
        stages = tuple(_each("stages", data.get("stages", []), Stage.from_dict))
        blocks = tuple(_each("blocks", data.get("blocks", []), Block.from_dict))
        recompute = tuple(sequence("recompute", data.get("recompute", [])))
        modules = []
        for fqn, entry in mapping("modules", data["modules"]).items():
            with at(f"modules[{fqn!r}]"):
                modules.append(ModuleLayout.from_dict(fqn, entry))
        workload = None
        if "workload" in data:
            with at("workload"):
                workload = Workload.from_dict(data["workload"])
        if estimate is not None:
            with at("estimate"):
                estimate = Estimate.from_dict(estimate)
        return cls(model=data["model"], kind=data.get("kind", "unknown"), mesh=mesh,
                   micro_batch_size=data["micro_batch_size"], micro_batches=data["micro_batches"],
                   zero=data.get("zero", 0), sp=data.get("sp", False), ep=data.get("ep", 1),
                   schedule=data.get("schedule", "1f1b"),
                   chunks=data.get("chunks", 1), kernels=data.get("kernels", "eager"), stages=stages, blocks=blocks,
                   recompute=recompute, modules=tuple(modules), workload=workload, estimate=estimate)


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not a number JSON allows", name, 0)


def _each(name: str, value: Any, read) -> list:  # noqa: ANN001
    out = []
    for k, entry in enumerate(sequence(name, value)):
        with at(f"{name}[{k}]"):
            out.append(read(entry))
    return out


def _typed(plan: Plan) -> None:
    """The nested records are records (a plan built in Python gets the same checks as one read from a file)."""
    kinds = {"mesh": Mesh, "workload": (Workload, type(None)), "estimate": (Estimate, type(None))}
    for name, kind in kinds.items():
        if not isinstance(getattr(plan, name), kind):
            raise FieldError(name, f"must be a {name} record, got {type(getattr(plan, name)).__name__}")
    for name, kind in (("stages", Stage), ("blocks", Block), ("modules", ModuleLayout)):
        value = getattr(plan, name)
        if not isinstance(value, tuple) or not all(isinstance(v, kind) for v in value):
            raise FieldError(name, f"must be a tuple of {kind.__name__}")


def _check_pipeline(plan: Plan) -> None:
    """Stage counts and grids agree with the mesh; no layer in two stages; micro-batches split over each dp."""
    if len(plan.mesh.shape) != 2:
        raise FieldError("mesh", f"of a pipeline plan is (pp, devices per stage), got shape {list(plan.mesh.shape)}")
    pp, per_stage = plan.mesh.shape
    if len(plan.stages) != pp * plan.chunks:
        raise FieldError("stages", f"holds {len(plan.stages)} stages; the mesh has {pp} pipeline devices x "
                         f"{plan.chunks} chunks = {pp * plan.chunks}")
    if (plan.schedule == "interleaved") != (plan.chunks > 1) or (plan.chunks > 1 and pp < 2):
        raise FieldError("schedule", f"{plan.schedule!r} with chunks {plan.chunks} and pp {pp}: the interleaved "
                         "schedule needs chunks 2 or more and pp 2 or more, the others chunks 1")
    owner: dict[str, int] = {}
    for k, stage in enumerate(plan.stages):
        if stage.dp * stage.tp != per_stage:
            raise FieldError(f"stages[{k}]", f"has dp {stage.dp} x tp {stage.tp} = {stage.dp * stage.tp} devices; "
                             f"the mesh gives each stage {per_stage}")
        if plan.micro_batch_size % stage.dp:
            raise FieldError("micro_batch_size", f"{plan.micro_batch_size} does not split over stage {k}'s dp "
                             f"{stage.dp}: each data-parallel rank would train a different number of samples")
        for name in stage.layers:
            if name in owner:
                raise FieldError(f"stages[{k}].layers", f"holds {name!r}, which stage {owner[name]} holds too")
            owner[name] = k
    if plan.sp and max(s.tp for s in plan.stages) < 2:
        raise FieldError("sp", "(sequence parallelism) needs tp 2 or more")
    if plan.ep > 1 and any(s.dp != plan.ep for s in plan.stages):
        raise FieldError("ep", f"{plan.ep} splits the experts over each stage's whole data-parallel group, their "
                         f"parameters S(0) on dp: it needs every stage's dp to be {plan.ep}")


def _check_recompute(plan: Plan) -> None:
    """An intra-op plan's recomputed layers: names of layers its blocks lie in, each once."""
    if not isinstance(plan.recompute, tuple):
        raise FieldError("recompute", f"must be a tuple of layer names, got {type(plan.recompute).__name__}")
    if plan.recompute and plan.stages:
        raise FieldError("recompute", "lists an intra-op plan's recomputed layers; a pipeline plan's stages name "
                         "their own (stages[k].recompute)")
    layers = {b.layer for b in plan.blocks}
    for k, name in enumerate(plan.recompute):
        text(f"recompute[{k}]", name, limit=1024)
        if name not in layers:
            raise FieldError(f"recompute[{k}]", f"names {quote(name)}, which none of the plan's blocks lies in")
        if name in plan.recompute[:k]:
            raise FieldError(f"recompute[{k}]", f"names {quote(name)} twice")


def _check_modules(plan: Plan) -> None:
    """One placement per mesh axis (a pipeline stage's layouts are over its (dp, tp) devices); a stage with tp > 1
    and Megatron layouts must split some parameter over tp, or every tp rank would only repeat the others' work."""
    width = 2 if plan.stages else len(plan.mesh.shape)
    split_on_tp = False
    for module in plan.modules:
        counts = module.axes()
        if counts - {width}:
            raise FieldError(f"modules[{module.fqn!r}]", f"has layouts with {sorted(counts)} placements; the plan's "
                             f"layouts have {width}, one per mesh axis")
        if plan.stages and module.reads:
            raise FieldError(f"modules[{module.fqn!r}].reads", "applies to intra-op plans only; a pipeline plan's "
                             "tied weights are read as their holder keeps them")
        split_on_tp = split_on_tp or bool(plan.stages) and any(isinstance(p.on(1), Shard) for p in module.params)
    megatron_tp = [k for k, s in enumerate(plan.stages) if s.tp > 1 and not s.intra]
    if megatron_tp and not split_on_tp:
        raise FieldError("modules", f"split no parameter over tp, but stage {megatron_tp[0]} has tp "
                         f"{plan.stages[megatron_tp[0]].tp}: each tp rank would only repeat the others' work")
