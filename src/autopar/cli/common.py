"""Arguments shared by commands that take a MODEL, and turning them into a traced model."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autopar.capture import CaptureError, Graph, trace
from autopar.files import check_writable
from autopar.plan import Plan, Workload, load_plan
from autopar.plan.records import KERNELS, MAX_BATCH, MAX_DEVICES, MAX_SEQ, OVERRIDE_LIMITS
from autopar.zoo import ZooModel, load

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# CLI flag -> ModelConfig field
MODEL_OVERRIDES = {
    "layers": "layers",
    "hidden": "hidden",
    "heads": "heads",
    "vocab": "vocab",
    "ffn": "ffn",
    "kv_heads": "kv_heads",
    "experts": "experts",
}


# Upper bounds of numeric flags: those of plan files (README.md, "Bounds")
MAX_LAYERS = OVERRIDE_LIMITS["layers"]
MAX_HIDDEN = OVERRIDE_LIMITS["hidden"]
MAX_HEADS = OVERRIDE_LIMITS["heads"]
MAX_VOCAB = OVERRIDE_LIMITS["vocab"]
MAX_FFN = OVERRIDE_LIMITS["ffn"]
MAX_EXPERTS = OVERRIDE_LIMITS["experts"]
MAX_TOKENS = 2**32  # --batch x --seq
MAX_BUDGET_S = 86_400.0


def bounded_int(most: int, *, least: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [least, most]; the message says the range (the parser adds the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or not least <= value <= most:
            kind = "a positive integer" if least == 1 else f"an integer from {least:,}"
            raise argparse.ArgumentTypeError(f"must be {kind} up to {most:,}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def bounded_seconds(most: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds in (0, most]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= most):
            raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds up to {most:,.0f}, "
                                             f"got {text!r}")
        return value

    parse.__name__ = "seconds"
    return parse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODEL",
        help="zoo name (gpt3-1.3b, llama-7b, ...; autopar models); hf:<model_type> (any type autopar models --hf "
        "lists: hf:gemma, hf:qwen3, hf:t5, hf:vit, hf:whisper, ...); hf:path/to/config.json; or "
        "path/to/file.py:function (package.module:function), where function(batch) returns (model, inputs) and "
        "model(**inputs) returns the loss: your file runs as a training script does")
    parser.add_argument("--batch", type=bounded_int(MAX_BATCH), default=1, help="global batch size (default 1)")
    parser.add_argument("--seq", type=bounded_int(MAX_SEQ), default=None,
                        help="sequence length (default: the model's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (default bf16)")
    _add_overrides(parser)


MODEL_HELP = ("the model the plan is for, named as autopar plan names it (zoo name, hf:<model_type>, "
              "hf:path/to/config.json, path/to/file.py:function), with --seq and the model overrides it was planned "
              "with: for a plan made from Python (autopar.plan), which does not name its model")


def add_rebuild_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` (with ``--seq`` and the model overrides): how to rebuild the model of a plan that names none."""
    parser.add_argument("--model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--seq", type=bounded_int(MAX_SEQ), default=None,
                        help="with --model: sequence length (default: the model's)")
    _add_overrides(parser)


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The model overrides given on the command line (--layers, --hidden, ...), by their ModelConfig field."""
    return {field: getattr(args, flag) for flag, field in MODEL_OVERRIDES.items() if getattr(args, flag) is not None}


def rebuild_workload(args: argparse.Namespace, path: str, plan: Plan) -> Workload | None:
    """The workload ``--model`` names for ``plan`` (read from ``path``; None without --model): its model as
    `autopar plan` would record it (a file's path made absolute), its sequence, and the plan's own global batch;
    the plan then checks against that model as against its own."""
    overrides = model_overrides(args)
    if args.model is None:
        if overrides or args.seq is not None:
            raise ValueError("--seq and the model overrides go with --model (for a plan made from Python); a plan "
                             "written by autopar plan rebuilds its model as it was planned")
        return None
    if plan.workload is not None:
        raise ValueError(f"{path} names its model ({plan.workload.model}); --model is for a plan made from Python, "
                         "which names none: leave --model out")
    zoo = load(args.model, batch=1, seq=args.seq, dtype=torch.float32, **overrides)
    return Workload(model=zoo.config.name, overrides=tuple(sorted(overrides.items())), seq=zoo.seq,
                    batch=plan.micro_batch_size * plan.micro_batches, dtype="fp32")


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model overrides")
    group.add_argument("--layers", type=bounded_int(MAX_LAYERS), help="number of layers (Wide-ResNet: depth)")
    group.add_argument("--hidden", type=bounded_int(MAX_HIDDEN), help="hidden size (Wide-ResNet: stem width)")
    group.add_argument("--heads", type=bounded_int(MAX_HEADS), help="attention heads")
    group.add_argument("--vocab", type=bounded_int(MAX_VOCAB), help="vocabulary size (Wide-ResNet: classes)")
    group.add_argument("--ffn", type=bounded_int(MAX_FFN), help="MLP inner size")
    group.add_argument("--kv-heads", type=bounded_int(MAX_HEADS), help="key/value heads (grouped-query attention)")
    group.add_argument("--experts", type=bounded_int(MAX_EXPERTS), help="experts per mixture-of-experts layer")


def add_kernels_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kernels", choices=KERNELS, default="eager",
        help="how the memory-bound ops between matmuls run: eager (default), one kernel per op as PyTorch runs them, "
        "or compiled, fused by torch.compile (autopar run compiles each repeated layer); priced and recorded in the "
        "plan so")


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile-db", metavar="FILE",
        help="price the layers (autopar profile-segments) and ops (autopar profile-ops) this profile database "
        "measured by their measured times; the rest by the roofline. The output says which share of the layer "
        "time was measured")


def load_profile(args: argparse.Namespace, cluster: Any) -> tuple[Any, Any]:
    """The --profile-db database, or None, and ``cluster`` with the collectives it timed on this many ranks per
    host as its links' tables (`ProfileDB.links`); refused (naming the file) where it was measured on another kind
    of device than the cluster's: a CPU process's times say nothing of a GPU, nor the reverse."""
    path = getattr(args, "profile_db", None)
    if path is None:
        return None, cluster
    from autopar.profiling import ProfileDB

    db = ProfileDB.load(path)
    if (db.kind == "cpu") != cluster.device.is_cpu:
        raise ValueError(f"{path}: measured on {db.device!r}, but --cluster {cluster.name} is of "
                         f"{cluster.device.name} devices: profile on the cluster's kind of device, or leave "
                         "--profile-db out")
    return db, db.links(cluster)


def profile_data(db: Any, model: Any, config: Any, *, global_batch: int) -> dict[str, Any] | None:
    """What the output says of --profile-db: the file, its device, the measured share of ``config``'s layer time
    (`PipelineModel.measured_share`) and how many of its stages' root FSDP units were measured."""
    if db is None:
        return None
    return {"db": db.path, "device": db.device,
            "measured_share": model.measured_share(config, global_batch=global_batch),
            "root_units_measured": model.root_units_measured(config),
            # the collectives priced by the database's times on groups of that size: "all_gather/2", ...
            "collectives": [f"{t.kind}/{t.ranks}" for t in model.cluster.intra.tables]}


def check_out(args: argparse.Namespace) -> None:
    """Refuse an ``--out`` path that cannot be written before any trace or search starts."""
    if getattr(args, "out", None) is not None:
        check_writable(args.out, flag="--out")


def check_workload(args: argparse.Namespace, *, seq: int) -> None:
    """Bounds that involve two flags: the tokens of one global batch (``seq``: the model's, when --seq is not
    given)."""
    if args.batch * seq > MAX_TOKENS:
        raise ValueError(f"--batch {args.batch} x --seq {seq} = {args.batch * seq:,} tokens per batch; at most "
                         f"{MAX_TOKENS:,} (2^32) are supported")


@dataclass(frozen=True, slots=True)
class TracedModel:
    zoo: ZooModel
    graph: Graph
    dtype: str
    note: str | None = None  # why the trace is not at --dtype


def load_and_trace(args: argparse.Namespace, *, batch: int | None = None) -> TracedModel:
    """MODEL built at --dtype and traced at ``batch`` samples (default --batch). Where the trace fails at bf16 or
    fp16 (a kernel whose fake-tensor implementation takes fp32 only: FNet's FFT) the model is built and traced again
    in fp32, and ``note`` says so (logged as a warning too): its bytes are then fp32's, an over-estimate."""
    overrides = {field: getattr(args, flag) for flag, field in MODEL_OVERRIDES.items()}
    batch = args.batch if batch is None else batch
    zoo = load(args.model, batch=batch, seq=args.seq, dtype=DTYPES[args.dtype], **overrides)
    check_workload(args, seq=zoo.seq)
    try:
        return TracedModel(zoo=zoo, graph=trace(zoo.module, example_kwargs=zoo.inputs), dtype=args.dtype)
    except CaptureError as exc:
        if args.dtype == "fp32":
            raise
        failed = exc
    zoo = load(args.model, batch=batch, seq=args.seq, dtype=torch.float32, **overrides)
    try:
        graph = trace(zoo.module, example_kwargs=zoo.inputs)
    except CaptureError:
        raise failed from None
    reason = " ".join(str(failed).split())[:200]
    note = f"traced in fp32, with fp32's bytes: the {args.dtype} trace failed ({reason})"
    log.warning("%s", note)
    return TracedModel(zoo=zoo, graph=graph, dtype=args.dtype, note=note)


def load_runnable(path: str, *, rehearse: bool = True, args: argparse.Namespace | None = None,
                  before_check: Callable[[Plan], None] | None = None) -> Plan:
    """A plan file that `run` and `dryrun` can apply: read, validated, and checked against its model (and, with
    ``rehearse``, applied on a fake process group) before any rank starts; every error names the file.
    ``args``: the command's --model and model overrides, the model of a plan that names none
    (`rebuild_workload`). ``before_check`` is called with the plan once it is read, before the check (`run`
    starts its ranks' fork server there, its imports beside the check)."""
    from autopar.runtime import check_runnable

    plan = load_plan(path)
    workload = rebuild_workload(args, path, plan) if args is not None else None
    if workload is not None:
        plan = plan.with_workload(workload)
    if before_check is not None:
        before_check(plan)
    with naming(path):
        check_runnable(plan, rehearse=rehearse)
    return plan


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Errors raised inside are prefixed with ``path``, the file they are about."""
    try:
        yield
    except (ValueError, NotImplementedError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


def mesh_shape(text: str | None, gpus: int | None) -> tuple[int, ...]:
    """``--mesh 2x4`` (or one axis of ``--gpus``) as a tuple, checked against ``--gpus`` when both are given."""
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be positive, got {gpus}")
    if not text:
        if gpus is None:
            raise ValueError("give --gpus N or --mesh AxB")
        return (gpus,)
    parts = text.lower().split("x")
    if not all(p.isascii() and p.isdigit() and len(p) <= 7 for p in parts):
        raise ValueError(f"--mesh {text!r} is not a shape like 8 or 2x4")
    shape = tuple(int(p) for p in parts)
    if len(shape) > 3 or any(n < 1 for n in shape):
        raise ValueError(f"--mesh {text!r} must be one to three positive sizes, like 8 or 2x4")
    total = math.prod(shape)
    if total > MAX_DEVICES:
        raise ValueError(f"--mesh {text} has {total:,} devices; at most {MAX_DEVICES:,} are supported")
    if gpus is not None and total != gpus:
        raise ValueError(f"--mesh {text} has {total} devices but --gpus is {gpus}")
    return shape
