"""Entry point: ``autopar <command> ...``. Library code never prints; commands return data and this renders it.

Ctrl-C at any point, imports included, ends with one line and status 130; SIGTERM with one line and status 143.
The command modules (and torch with them) are imported inside `main`, under those handlers (`cli/signals.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from autopar import __version__
from autopar.cli.signals import SignalHandling


def commands() -> tuple[ModuleType, ...]:
    from autopar.cli import analyze, calibrate, dryrun, estimate, models, plan, profile, run

    return (profile, estimate, analyze, plan, run, dryrun, calibrate, models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Plan and run parallel training of large PyTorch models."
    )
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands():
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with SignalHandling() as signals:
        try:
            commands()  # imports every command, torch with them: a signal meanwhile ends the process at once
            signals.importing = False
            return _main(argv)
        except BaseException as exc:
            outcome = signals.after(exc)
            if outcome is None:
                raise
            print(outcome[1], file=sys.stderr)
            return outcome[0]


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        result: Any = args.handler(args)
    except (ValueError, KeyError, ImportError, RuntimeError, OSError, NotImplementedError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"autopar {args.command}: error: {message}", file=sys.stderr)
        return 2
    try:
        if isinstance(result, str):
            print(result)
        else:
            json.dump(result, sys.stdout, indent=2)
            sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `autopar ... | head`: the reader left, which is fine
        sys.stdout = None  # type: ignore[assignment]  # no flush at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
