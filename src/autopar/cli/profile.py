"""``autopar profile MODEL``: per-layer parameters, FLOPs and saved activations from a symbolic trace."""

from __future__ import annotations

import argparse
from typing import Any

from autopar.capture import Graph
from autopar.cli.common import TracedModel, add_model_arguments, load_and_trace
from autopar.cli.render import binary_bytes, si, table
from autopar.zoo import describe


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="trace a model on fake tensors: per-layer params, FLOPs, saved activations",
        description="Trace MODEL on fake tensors (no memory, no GPU) and report the configuration it built, "
        "per-layer parameters, forward and backward FLOPs (model FLOPs: matmul, convolution, attention) and bytes "
        "saved for backward.",
    )
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def report(traced: TracedModel) -> dict[str, Any]:
    graph, zoo = traced.graph, traced.zoo
    return {
        "model": zoo.config.name,
        "config": {**zoo.config.summary(), "seq": zoo.seq, "batch": zoo.batch},
        "built": describe(zoo),
        "dtype": traced.dtype,
        "params": graph.num_params,
        "flops": {"forward": graph.flops_forward, "backward": graph.flops_backward},
        "saved_bytes": graph.saved_bytes,
        "layers": [
            {
                "name": row.name or "<root>",
                "type": row.module_type,
                "params": row.params,
                "flops_forward": row.flops_forward,
                "flops_backward": row.flops_backward,
                "saved_bytes": row.saved_bytes,
            }
            for row in graph.layers()
        ],
        "repeats": [
            {"type": g.module_type, "count": len(g.instances), "fingerprint": g.fingerprint} for g in graph.repeats
        ],
        "nodes": len(graph.nodes),
        "trace_seconds": round(graph.trace_seconds, 4),
        **({"note": traced.note} if traced.note else {}),  # traced in fp32, and why
    }


def _collapsed_rows(graph: Graph, layers: list[dict[str, Any]]) -> list[list[str]]:
    """Table rows; consecutive identical repeated layers print once as ``name..last (xN)``."""
    group_of = {fqn: g.fingerprint for g in graph.repeats for fqn in g.instances}
    rows: list[list[str]] = []
    run: list[dict[str, Any]] = []

    def key(layer: dict[str, Any]) -> tuple[Any, ...]:
        return (group_of.get(layer["name"]), layer["params"], layer["flops_forward"], layer["saved_bytes"])

    def flush() -> None:
        if not run:
            return
        first = run[0]
        name = first["name"] if len(run) == 1 else f"{first['name']}..{run[-1]['name']} (x{len(run)})"
        rows.append(
            [
                name,
                first["type"],
                si(first["params"]),
                si(first["flops_forward"], "F"),
                si(first["flops_backward"], "F"),
                binary_bytes(first["saved_bytes"]),
            ]
        )
        run.clear()

    for layer in layers:
        if run and (group_of.get(layer["name"]) is None or key(layer) != key(run[0])):
            flush()
        run.append(layer)
    flush()
    return rows


# how `describe`'s keys read in the configuration lines, in order
_SHOWN = {"layers": "layers", "decoder_layers": "decoder layers", "hidden": "hidden", "heads": "heads",
          "kv_heads": "kv heads", "head_dim": "head dim", "ffn": "ffn", "vocab": "vocab", "positions": "positions",
          "sliding_window": "sliding window", "layer_types": "layer types", "experts": "experts",
          "top_k": "experts per token", "dropout": "dropout", "depth": "depth", "width": "width", "stem": "stem",
          "classes": "classes", "image": "image side"}


def _configuration(data: dict[str, Any]) -> list[str]:
    """The configuration lines: what was built, its shape options, the config fields set, its inputs."""
    built = data["built"]
    what = f"built {built['class']}" + (f" from {built['config_class']}" if "config_class" in built else "")
    if "built_by" in built:
        what += f" by {built['built_by']}"
    options = []
    for key, label in _SHOWN.items():
        value = built.get(key, "absent")
        if isinstance(value, dict):
            value = " + ".join(f"{n} {kind}" for kind, n in value.items())
        if value != "absent":
            options.append(f"{label} {'none' if value is None else value}")
    lines = [f"{what}: {', '.join(options)}" if options else what]
    if built.get("set"):
        shown = ", ".join(f"{k}={v}" for k, v in built["set"].items())
        lines.append(f"set on {built['config_class']}: {shown}")
    inputs = ", ".join(f"{k} [{', '.join(map(str, v['shape']))}] {v['dtype']}" for k, v in built["inputs"].items())
    return [*lines, f"inputs: {inputs}"]


def render(traced: TracedModel, data: dict[str, Any]) -> str:
    cfg = data["config"]
    head = f"{data['model']}: batch {cfg['batch']} x seq {cfg['seq']}, {data['dtype']}"
    if cfg["layers"]:
        head = (f"{data['model']}: {cfg['layers']} layers, hidden {cfg['hidden']}, heads {cfg['heads']}, vocab "
                f"{cfg['vocab']}; batch {cfg['batch']} x seq {cfg['seq']}, {data['dtype']}")
    rows = _collapsed_rows(traced.graph, data["layers"])
    body = table(["layer", "type", "params", "fwd FLOPs", "bwd FLOPs", "saved"], rows, align="llrrrr")
    total = data["flops"]["forward"] + data["flops"]["backward"]
    foot = (
        f"total: {si(data['params'])} params ({data['params']:,}), {si(data['flops']['forward'], 'FLOP')} forward + "
        f"{si(data['flops']['backward'], 'FLOP')} backward = {si(total, 'FLOP')} per step, "
        f"{binary_bytes(data['saved_bytes'])} saved for backward\n"
        f"traced {data['nodes']} aten ops in {data['trace_seconds']:.2f} s"
    )
    note = [f"note: {data['note']}"] if data.get("note") else []
    return "\n".join([head, *_configuration(data), *note, "", body, "", foot])


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    traced = load_and_trace(args)
    data = report(traced)
    return data if args.json else render(traced, data)
