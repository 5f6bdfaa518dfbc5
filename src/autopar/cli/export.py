"""``autopar export PLAN.json --to torchtitan|megatron``: a plan as the arguments of the stack you train with.

The text output is a shell fragment: comment lines (``#``) saying the target, the world size and its degrees, the
arguments one option a line (shell-quoted, joined by ``\\``), then every plan feature the target cannot express
with the closest setting written instead. ``--json`` gives the same as one object (`autopar.export.Export`).
"""

from __future__ import annotations

import argparse
import shlex
import textwrap
from typing import Any

from autopar.cli.common import naming
from autopar.cli.render import Outcome
from autopar.export import Export, Target, to_megatron, to_torchtitan
from autopar.plan import Plan, load_plan
from autopar.zoo import ModelConfig, config_for

_NAMES = {Target.TORCHTITAN: "torchtitan", Target.MEGATRON: "Megatron-LM"}
_HEADS = {
    Target.TORCHTITAN: "torchtitan 0.3: overrides of its Trainer.Config (torchrun ... -m torchtitan.train ARGUMENTS)",
    Target.MEGATRON: "Megatron-LM: arguments of pretrain_gpt.py (it derives dp = world size / (tp x pp))",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="write a plan as torchtitan's config overrides or Megatron-LM's arguments",
        description="Translate a pipeline plan file (autopar plan --out, autopar estimate --out) into the "
        "command-line arguments of torchtitan 0.3 or Megatron-LM. What the target cannot express (per-stage grids, "
        "per-layer recomputation, intra-op layouts, ...) is listed with the closest setting written instead.")
    parser.add_argument("plan", metavar="PLAN.json", help="a plan file")
    parser.add_argument("--to", required=True, choices=[t.value for t in Target], help="torchtitan or megatron")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> Outcome:
    plan = load_plan(args.plan)
    with naming(args.plan):
        model = plan_model(plan)
        export = (to_torchtitan if args.to == Target.TORCHTITAN.value else to_megatron)(plan, model=model)
    count = len(export.warnings)
    message = (f"{count} plan feature{'s' if count != 1 else ''} approximated (listed "
               f"{'under warnings' if args.json else 'above'})") if count else ""
    if args.json:
        return Outcome({"plan_file": args.plan, "model": plan.model, "kind": plan.kind, **export.to_dict()}, 0,
                       message)
    return Outcome(render(export, plan=plan, source=args.plan), 0, message)


def plan_model(plan: Plan) -> ModelConfig | None:
    """The plan's model as its workload names it (no module is built), or None for a plan without a workload."""
    if plan.workload is None:
        return None
    w = plan.workload
    return config_for(w.model, seq=w.seq, **w.override_map)


def render(export: Export, *, plan: Plan, source: str) -> str:
    degrees = " x ".join(f"{name} {n}" for name, n in export.degrees if n > 1 or name in ("pp", "tp"))
    lines = [f"# {_HEADS[export.target]}",
             f"# {source}: {plan.model}, {plan.kind} plan; {export.world_size} ranks = {degrees}"]
    groups: list[list[str]] = []
    for token in export.arguments:  # an option and its values a line; torchtitan's subcommand on its own
        if token.startswith("--") or not groups or token.startswith("activation-checkpoint:"):
            groups.append([token])
        else:
            groups[-1].append(token)
    if len(groups) > 1 and groups[0][0] == "--module":  # --module llama3 --config llama3_70b
        groups[:2] = [groups[0] + groups[1]]
    lines.append(" \\\n  ".join(" ".join(shlex.quote(t) for t in group) for group in groups))
    if export.warnings:
        lines += ["#", f"# {len(export.warnings)} approximated: the plan asks what {_NAMES[export.target]} cannot "
                  "express; the closest setting is written above"]
        for w in export.warnings:
            lines += _wrapped(f"{w.feature}: {w.plan}", "# - ") + _wrapped(f"-> {w.closest}", "#   ")
    if export.notes:
        lines += ["#", "# notes"] + [line for note in export.notes for line in _wrapped(note, "# - ")]
    return "\n".join(lines)


def _wrapped(text: str, first: str) -> list[str]:
    return textwrap.wrap(text, width=116, initial_indent=first, subsequent_indent="#" + " " * (len(first) + 1))
