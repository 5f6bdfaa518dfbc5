"""``autopar models``: the built-in model names."""

from __future__ import annotations

import argparse
from typing import Any

from autopar.cli.render import table
from autopar.zoo import get_config, model_names


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("models", help="list the model zoo", description="List the built-in models.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    configs = [get_config(name) for name in model_names()]
    entries = [
        {"name": c.name, "family": c.family, "layers": c.layers, "hidden": c.hidden, "heads": c.heads, "seq": c.seq}
        for c in configs
    ]
    if args.json:
        return {"models": entries}
    rows = [[e["name"], e["family"], str(e["layers"]), str(e["hidden"]), str(e["heads"]), str(e["seq"])] for e in entries]
    note = "\nalso: any moe-<gpt3 size>-e<experts> and wrn-<depth>-<width>; overrides with --layers, --hidden, ..."
    return table(["name", "family", "layers", "hidden", "heads", "seq"], rows, align="llrrrr") + note
