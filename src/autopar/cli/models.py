"""``autopar models``: the built-in model names; ``--hf``: every Hugging Face type and the head it is built with."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autopar.cli.render import table
from autopar.zoo import get_config, model_names


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "models", help="list the model zoo, or (--hf) every Hugging Face type", description="List the built-in "
        "models; with --hf, every model type the installed transformers can build as a causal LM, masked LM, "
        "seq2seq LM, speech-to-text or image classifier (hf:<type>), the head each is built with, and, building "
        "each at its default config on the meta device (a minute or two), which fail and why.")
    parser.add_argument("--hf", action="store_true", help="list the hf:<type> names (builds each to check it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    if args.hf:
        return _hf(args)
    configs = [get_config(name) for name in model_names()]
    entries = [
        {"name": c.name, "family": c.family, "layers": c.layers, "hidden": c.hidden, "heads": c.heads, "seq": c.seq}
        for c in configs
    ]
    if args.json:
        return {"models": entries}
    rows = [[e["name"], e["family"], str(e["layers"]), str(e["hidden"]), str(e["heads"]), str(e["seq"])] for e in entries]
    note = ("\nalso: any moe-<gpt3 size>-e<experts> and wrn-<depth>-<width>; hf:<model_type> for every type "
            "`autopar models --hf` lists, hf:path/to/config.json, path/to/file.py:function; overrides with --layers, "
            "--hidden, ...")
    return table(["name", "family", "layers", "hidden", "heads", "seq"], rows, align="llrrrr") + note


def _hf(args: argparse.Namespace) -> dict[str, Any] | str:
    from autopar.zoo.hf_auto import build_failure
    from autopar.zoo.hf_tasks import heads

    show = sys.stderr.isatty() and not args.json
    entries = []
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # its notes on untrained heads and the like, per type
    found = heads()
    for k, head in enumerate(found.values()):
        if show:
            print(f"\r\033[Kbuilding hf:{head.model_type} ({k + 1}/{len(found)})", end="", file=sys.stderr, flush=True)
        entries.append({"name": f"hf:{head.model_type}", "task": head.task, "class": head.class_name,
                        "fails": build_failure(head.model_type)})
    if show:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.json:
        return {"types": entries}
    rows = [[e["name"], e["task"], e["class"], e["fails"] or "builds"] for e in entries]
    failed = sum(1 for e in entries if e["fails"])
    return (table(["name", "task", "built as", "default config"], rows, align="llll")
            + f"\n{len(entries)} types, {len(entries) - failed} build at their default config, {failed} fail "
            "(why: last column); hf:<type>-tiny: the seven hand-written specs only (autopar models)")
