"""``autopar analyze MODEL``: ParallelBlocks, their candidate splits, unique segments and the size of the space."""

from __future__ import annotations

import argparse
import math
from typing import Any

from autopar.analysis import op_dims
from autopar.cli.common import MAX_DEVICES, add_model_arguments, bounded_int, load_and_trace, mesh_shape
from autopar.cli.render import table
from autopar.cluster import build_mesh, load_cluster
from autopar.search import build_space
from autopar.sharding import count


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="ParallelBlocks, candidate splits and unique segments of a model",
        description="Group MODEL's ops into ParallelBlocks (the search unit), list each block's candidate splits "
        "on the mesh, find the unique segments (repeated layers), and compare the size of the reduced search "
        "space with the per-op one.",
    )
    add_model_arguments(parser)
    parser.add_argument("--gpus", type=bounded_int(MAX_DEVICES), default=8, help="devices (default 8)")
    parser.add_argument("--mesh", help="mesh shape, e.g. 2x4 (default: one axis of --gpus)")
    parser.add_argument("--cluster", default="a100-80g-sxm", help="preset name or cluster file (default a100-80g-sxm)")
    parser.add_argument("--all", action="store_true", help="list every block, not one instance per segment")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def _layer_index(layer: str) -> int | None:
    last = layer.rpartition(".")[2]
    return int(last) if last.isdigit() else None


def _instance(segment, block_id: int) -> int:  # noqa: ANN001
    return (block_id - segment.start) // segment.length


def report(args: argparse.Namespace) -> dict[str, Any]:
    traced = load_and_trace(args)
    shape = mesh_shape(args.mesh, args.gpus)
    cluster = load_cluster(args.cluster).with_devices(math.prod(shape))
    space = build_space(traced.graph, build_mesh(cluster, {f"x{i}": n for i, n in enumerate(shape)}), cluster)
    nodes = traced.graph.nodes
    blocks = []
    for block in space.blocks.blocks:
        v = space.var_of[block.id]
        leader = nodes[block.leader]
        blocks.append(
            {
                "id": block.id,
                "layer": _layer_index(block.layer),
                "layer_name": block.layer,
                "module": leader.module,
                "ops": len(block.nodes),
                "leading_op": leader.op,
                "fingerprint": block.fingerprint,
                "candidates": [space.cost.describe(block, c) for c in space.candidates[v]],
            }
        )
    segment_of = {}
    for index, seg in enumerate(space.segments):
        for b in seg.blocks:
            segment_of[b] = index
    pairs: dict[tuple[str, str], int] = {}
    for cls in space.classes:  # values read across segments (or from one instance of a segment to the next)
        for _, producer in cls.inputs:
            src, dst = space.segments[segment_of[producer.id]], space.segments[segment_of[cls.block.id]]
            crosses = src is not dst or _instance(src, producer.id) != _instance(dst, cls.block.id)
            if crosses:
                key = (src.fingerprint, dst.fingerprint)
                pairs[key] = pairs.get(key, 0) + cls.count
    per_op_log10 = sum(math.log10(count(op_dims(n), shape)) for n in nodes)
    blocks_log10 = sum(math.log10(len(space.candidates[space.var_of[b.id]])) for b in space.blocks.blocks)
    reduced = math.prod(len(c) for c in space.candidates)
    return {
        "model": traced.zoo.config.name,
        "config": {**traced.zoo.config.summary(), "seq": traced.zoo.seq, "batch": traced.zoo.batch},
        "mesh": shape,
        "nodes": len(nodes),
        "blocks": blocks,
        "segments": [
            {"fingerprint": s.fingerprint, "count": s.count, "blocks": list(s.instance(0)), "start": s.start,
             "length": s.length}
            for s in space.segments
        ],
        "resharding": [{"from": a, "to": b, "values": n} for (a, b), n in pairs.items()],
        "space": {
            "per_op": f"1e{per_op_log10:.1f}",
            "per_op_log10": per_op_log10,
            "blocks_log10": blocks_log10,
            "reduced": reduced,
            "reduced_log10": math.log10(reduced),
        },
        "unique_segments": len({s.fingerprint for s in space.segments}),
    }


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    data = report(args)
    return data if args.json else render(data, every=args.all)


def render(data: dict[str, Any], *, every: bool = False) -> str:
    shown = set()
    for s in data["segments"]:
        shown.update(s["blocks"] if not every else range(s["start"], s["start"] + s["length"] * s["count"]))
    seg_rows = [
        [s["fingerprint"], f"{s['blocks'][0]}-{s['blocks'][-1]}" if len(s["blocks"]) > 1 else str(s["blocks"][0]),
         str(s["count"]), data["blocks"][s["blocks"][0]]["layer_name"]]
        for s in data["segments"]
    ]
    block_rows = [
        [str(b["id"]), b["layer_name"], b["module"], b["leading_op"].removeprefix("aten."), str(b["ops"]),
         " ".join(b["candidates"])]
        for b in data["blocks"]
        if b["id"] in shown
    ]
    sp = data["space"]
    mesh = "x".join(map(str, data["mesh"]))
    return "\n".join(
        [
            f"{data['model']}: {data['nodes']} ops in {len(data['blocks'])} ParallelBlocks, "
            f"{data['unique_segments']} unique segments; mesh {mesh}",
            "",
            "segments (blocks of the first instance, instances back to back)",
            table(["fingerprint", "blocks", "count", "starts at"], seg_rows, align="lrrl"),
            "",
            "values crossing segments (priced as resharding between the two blocks' layouts): "
            + ", ".join(f"{a[:6]}->{b[:6]} x{n}" for a, b, n in ((r["from"], r["to"], r["values"]) for r in data["resharding"])),
            "",
            "blocks" + ("" if every else " (first instance of each segment; --all lists every block)"),
            table(["id", "layer", "leading module", "op", "ops", "candidates"], block_rows, align="rlllrl"),
            "",
            f"search space: per op 10^{sp['per_op_log10']:.0f}, per block 10^{sp['blocks_log10']:.0f}, "
            f"with repeated segments tied {sp['reduced']:,}",
        ]
    )
