"""Every Hugging Face model type autopar lists (`autopar models --hf`), through `autopar profile` and `autopar plan`.

Run: python bench/hf_types.py [--types gemma,qwen3,...] [--budget-s 3] [--timeout 180] [--json out.json]

Each type is built from its default config at ``--layers 2 --hidden 64`` with 4 heads (2 key/value heads where the
default uses grouped-query attention), or without the options its config does not have (a convolutional network
has no heads), and goes through the two commands' own handlers in this process, as the CLI runs them:
``profile`` (trace on fake tensors) and ``plan --cluster a100-80g-sxm --gpus 4 --batch 8`` (pipeline search, then
the runtime's checks on a fake process group). A type passes a command when the command returns a result; a plan
that fits but that `autopar run` would refuse still counts as planned, and its reason is listed. Prints one row per
type (type, head, profile ok, plan ok, why not) and the totals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from typing import Any

SIZE = {"layers": 2, "hidden": 64, "heads": 4}


class Timeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):  # noqa: ANN201
    def expire(signum: int, frame: Any) -> None:
        raise Timeout(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def size_flags(model_type: str) -> list[str]:
    """``--layers 2 --hidden 64 --heads 4`` (and ``--kv-heads 2`` under grouped-query attention), each only where
    the type's config has the field."""
    from autopar.zoo import get_config

    cfg = get_config(f"hf:{model_type}")
    flags: list[str] = []
    for option, value in SIZE.items():
        if getattr(cfg, option):
            flags += [f"--{option}", str(value)]
    if cfg.kv_heads and cfg.heads:
        flags += ["--kv-heads", "2"]
    return flags


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:220]}"


def attempt(parser: argparse.ArgumentParser, argv: list[str], timeout: int) -> tuple[Any, str | None]:
    try:
        with deadline(timeout):
            args = parser.parse_args(argv)
            return args.handler(args), None
    except (Exception, Timeout) as exc:  # noqa: BLE001 - the reason is the result
        return None, one_line(exc)


def check(model_type: str, *, budget: float, timeout: int) -> dict[str, Any]:
    from autopar.cli.main import build_parser
    from autopar.cli.render import Outcome
    from autopar.zoo.hf_tasks import head_of

    head = head_of(model_type)
    row: dict[str, Any] = {"type": model_type, "head": head.class_name if head else "?", "profile": False,
                           "plan": False, "why": None, "not_runnable": None}
    start = time.perf_counter()
    try:
        flags = size_flags(model_type)
    except Exception as exc:  # noqa: BLE001
        row["why"] = "config: " + one_line(exc)
        return row
    parser = build_parser()
    model = [f"hf:{model_type}", *flags]
    profile, why = attempt(parser, ["profile", *model, "--json"], timeout)
    row["profile"] = profile is not None
    if why:
        row["why"] = "profile: " + why
        return row
    plan, why = attempt(parser, ["plan", *model, "--cluster", "a100-80g-sxm", "--gpus", "4", "--batch", "8",
                                 "--budget-s", str(budget), "--json"], timeout)
    data = plan.result if isinstance(plan, Outcome) else plan
    row["plan"] = data is not None
    row["why"] = "plan: " + why if why else None
    if data is not None:
        row["not_runnable"] = data.get("not_runnable")
        row["fits"] = data.get("fits")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every listed type)")
    parser.add_argument("--budget-s", type=float, default=3.0, help="plan search budget per type (default 3)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per command before it counts as failed")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    import logging

    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # transformers' warnings about untrained heads and the like
    from autopar.zoo.hf_tasks import heads

    types = args.types.split(",") if args.types else list(heads())
    rows = []
    for model_type in types:
        row = check(model_type, budget=args.budget_s, timeout=args.timeout)
        rows.append(row)
        mark = {True: "ok", False: "--"}
        print(f"{row['type']:28s} {row['head']:46s} {mark[row['profile']]:7s} {mark[row['plan']]:4s} "
              f"{row['why'] or ''}", flush=True)
    profiled = sum(r["profile"] for r in rows)
    planned = sum(r["plan"] for r in rows)
    print(f"\n{len(rows)} types: {profiled} profile, {planned} plan; "
          f"{sum(1 for r in rows if r['plan'] and r['not_runnable'])} of the plans `autopar run` would refuse")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    sys.exit(main())
