"""Entry point: ``autopar <command> ...``. Library code never prints; commands return data and this renders it.

Ctrl-C at any point, imports included, ends with one line and status 130; SIGTERM with one line and status 143.
The command modules (and torch with them) are imported inside `main`, under those handlers (`cli/signals.py`).
The `autopar` command is `entry`: `main`, then an exit that skips the interpreter's teardown.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from autopar import __version__
from autopar.cli.render import Outcome
from autopar.cli.signals import SignalHandling


def commands() -> tuple[ModuleType, ...]:
    from autopar.cli import (
        analyze, calibrate, dryrun, estimate, export, models, plan, profile, profile_ops, profile_segments, run,
    )

    return (profile, profile_ops, profile_segments, estimate, analyze, plan, export, run, dryrun, calibrate, models)


class Parser(argparse.ArgumentParser):
    """An argument parser that reports a bad value in one line naming the flag (no usage block), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {_one_line(message)}", file=sys.stderr)
        raise SystemExit(2)


def _one_line(message: str) -> str:
    """argparse's ``argument --x: ...`` as ``--x ...``: the flag first, then what would be valid."""
    found = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.S)
    if not found:
        return message.splitlines()[0]
    flag, rest = found.groups()
    choice = re.match(r"invalid choice: (.*?) \(choose from (.*)\)$", rest)
    if choice:
        return f"{flag} must be one of {choice.group(2).replace(chr(39), '')}, got {choice.group(1)}"
    wrong = re.match(r"invalid (\w+) value: (.*)$", rest)
    if wrong:
        kind = {"int": "an integer", "float": "a number"}.get(wrong.group(1), f"a valid {wrong.group(1)}")
        return f"{flag} must be {kind}, got {wrong.group(2)}"
    return f"{flag} {rest}" if rest.startswith("must") else f"{flag}: {rest}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="autopar", description="Plan and run parallel training of large PyTorch models."
    )
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands():
        command.register(subparsers)
    return parser


# Commands that do their work in this process and end: the garbage collector is paused while they run
# (`autopar.search.heap.gc_paused`). The others start ranks and may run for hours.
_IN_PROCESS = frozenset({"profile", "estimate", "analyze", "plan", "export", "dryrun", "models"})


def main(argv: Sequence[str] | None = None, *, ending: bool = False) -> int:
    """Run one command and return its exit status. ``ending``: the process ends right after (`entry`), so the
    garbage collector paused for an in-process command need not resume."""
    with SignalHandling() as signals:
        try:
            commands()  # imports every command, torch with them: a signal meanwhile ends the process at once
            signals.importing = False
            return _main(argv, ending=ending)
        except BaseException as exc:
            outcome = signals.after(exc)
            if outcome is None:
                raise
            print(outcome[1], file=sys.stderr)
            return outcome[0]


def _main(argv: Sequence[str] | None, *, ending: bool = False) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a bad argument (2, reported in one line)
        return exc.code if isinstance(exc.code, int) else 2
    if extra:  # named by the command they were given to, as every other error is
        print(f"autopar {args.command}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.command in _IN_PROCESS:  # allocations that all stay alive until the output is printed
        from autopar.search.heap import gc_paused

        with gc_paused(resume=not ending):
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        result: Any = args.handler(args)
    except (ValueError, KeyError, ImportError, RuntimeError, OSError, NotImplementedError) as exc:
        from autopar.cluster.ranks import RankError

        print(f"autopar {args.command}: error: {_message(exc, getattr(args, 'plan', None))}", file=sys.stderr)
        return 1 if isinstance(exc, RankError) else 2  # a rank's failure is not the input's
    outcome = result if isinstance(result, Outcome) else Outcome(result)
    try:  # strict JSON: a NaN or an infinity is refused rather than printed as invalid JSON
        text = outcome.result if isinstance(outcome.result, str) else json.dumps(outcome.result, indent=2,
                                                                                 allow_nan=False)
    except ValueError as exc:
        print(f"autopar {args.command}: error: the result holds a value JSON cannot carry ({exc})", file=sys.stderr)
        return 2
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `autopar ... | head`: the reader left, which is fine
        sys.stdout = None  # type: ignore[assignment]  # no flush at exit
    if outcome.message:
        print(f"autopar {args.command}: {outcome.message}", file=sys.stderr)
    return outcome.status


def _message(exc: BaseException, source: str | None) -> str:
    """One line naming the input: a KeyError's text is only the missing key, so say what it is and where (the
    command's input file, where it reads one)."""
    if isinstance(exc, KeyError):
        key = f"missing field {exc.args[0]!r}" if exc.args else "missing field"
        return f"{source}: {key}" if source else key
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def entry() -> None:
    """The ``autopar`` command: `main`, then exit. Tearing the interpreter down frees every object one at a time,
    the searches' caches of millions of prices among them: 1.6 s after planning gpt3-175b, 2.4 s after the
    1,000-layer GPT, for nothing. So where no other thread is left, what was registered to run at exit runs (log
    handlers, temporary files), the output is flushed, and the process ends at once."""
    code = main(ending=True)
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # let go after a closed pipe (`main`)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more can be said on it
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
