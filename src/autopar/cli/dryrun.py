"""``autopar dryrun PLAN.json``: the ``run --check-comm`` comparison at the plan's full world size, in one process."""

from __future__ import annotations

import argparse
import json
from typing import Any

from autopar.cli.run import comm_table
from autopar.cli.common import add_rebuild_arguments, load_runnable, naming


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dryrun",
        help="apply a plan at its full world size on a fake process group and compare rank 0's collectives "
        "(each pipeline stage's first rank's) with the prediction",
        description="Build the plan's model on the meta device, apply PLAN.json on a fake process group of the "
        "plan's world size (64 ranks and more, one process), run one training step on fake tensors and compare "
        "the collectives rank 0 issues (kind, mesh axis, calls, bytes) with the cost model's prediction for its "
        "stage; for a pipeline, the first rank of each pipeline stage in turn, each running the plan's schedule. "
        "Exits non-zero on a mismatch.",
    )
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by autopar plan --out")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_rebuild_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    from autopar.runtime.dryrun import dryrun

    plan = load_runnable(args.plan, rehearse=False, args=args)  # dryrun's own step is the rehearsal
    with naming(args.plan):
        result = {"plan": args.plan, **dryrun(plan, checked=True)}
    if not result["ok"]:
        if args.json:
            print(json.dumps(result, indent=2))
        raise RuntimeError(result["message"])
    if args.json:
        return result
    ranks = result["ranks"]
    # the model in bf16 where a fake kernel takes no fp32 (MoE's grouped matmul): half the bytes `run` moves
    dtype = " (the model in bf16: a fake kernel it runs takes no fp32)" if result["dtype"] == "bf16" else ""
    if len(ranks) == 1:
        return "\n".join([
            f"{args.plan}: rank 0 of {result['world_size']} on a fake process group ({result['seconds']:.1f} s)"
            + dtype,
            "collectives in one step (counted / predicted)",
            comm_table(result["rows"]),
            f"dryrun: {result['message']}",
        ])
    lines = [f"{args.plan}: ranks {', '.join(str(r['rank']) for r in ranks)} of {result['world_size']} (the first "
             f"of each pipeline stage) on a fake process group ({result['seconds']:.1f} s){dtype}"]
    for entry in ranks:
        lines += ["", f"rank {entry['rank']}: collectives in one step (counted / predicted)", comm_table(entry["rows"])]
    return "\n".join([*lines, "", f"dryrun: {result['message']}"])
