"""Arguments shared by commands that take a MODEL, and turning them into a traced model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from autopar.capture import Graph, trace
from autopar.zoo import ZooModel, load

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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="zoo name (gpt3-1.3b, llama-7b, ...) or hf:<type>")
    parser.add_argument("--batch", type=int, default=1, help="global batch size (default 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (default bf16)")
    group = parser.add_argument_group("model overrides")
    group.add_argument("--layers", type=int, help="number of layers (Wide-ResNet: depth)")
    group.add_argument("--hidden", type=int, help="hidden size (Wide-ResNet: stem width)")
    group.add_argument("--heads", type=int, help="attention heads")
    group.add_argument("--vocab", type=int, help="vocabulary size (Wide-ResNet: classes)")
    group.add_argument("--ffn", type=int, help="MLP inner size")
    group.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    group.add_argument("--experts", type=int, help="experts per mixture-of-experts layer")


@dataclass(frozen=True, slots=True)
class TracedModel:
    zoo: ZooModel
    graph: Graph
    dtype: str


def load_and_trace(args: argparse.Namespace) -> TracedModel:
    for flag in ("batch", "seq", *MODEL_OVERRIDES):
        value = getattr(args, flag, None)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    overrides = {field: getattr(args, flag) for flag, field in MODEL_OVERRIDES.items()}
    zoo = load(args.model, batch=args.batch, seq=args.seq, dtype=DTYPES[args.dtype], **overrides)
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    return TracedModel(zoo=zoo, graph=graph, dtype=args.dtype)


def mesh_shape(text: str | None, gpus: int | None) -> tuple[int, ...]:
    """``--mesh 2x4`` (or one axis of ``--gpus``) as a tuple, checked against ``--gpus`` when both are given."""
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be positive, got {gpus}")
    if not text:
        if gpus is None:
            raise ValueError("give --gpus N or --mesh AxB")
        return (gpus,)
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh {text!r} is not a shape like 8 or 2x4") from None
    if not shape or any(n < 1 for n in shape) or len(shape) > 3:
        raise ValueError(f"--mesh {text!r} must be one to three positive sizes, like 8 or 2x4")
    total = 1
    for n in shape:
        total *= n
    if gpus is not None and total != gpus:
        raise ValueError(f"--mesh {text} has {total} devices but --gpus is {gpus}")
    return shape
