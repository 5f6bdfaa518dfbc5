"""Running autopar commands on fuzzed inputs and judging each outcome against the command-line contract.

The contract (shared/CLI.md, README "Command line"): every command, on any input, ends in exactly one of

- exit 0 with a correct result (under ``--json``: one strict JSON object on stdout, no NaN or Infinity);
- exit 2 (bad input) or 3 (no plan fits, or the configuration does not fit device memory) with exactly one line
  on stderr, ``autopar <command>: error: ...`` (stdout, under ``--json``, empty or one strict JSON object);

never a Python traceback, never a hang, and files are data (never executed).

`run_main` calls ``autopar.cli.main.main`` in this process (no torch import per case) under a time limit (SIGALRM
raises `Hang` wherever the command is) and an address-space limit; `run_subprocess` runs the console entry point in a
child for inputs that could block inside C (named pipes, endless devices). `judge` turns an outcome into
`Failure`s; `Report` collects them per family and renders every failing case, grouped by cause.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import autopar

# a case that runs longer than this is stopped and reported as a hang (the contract's hard bound is 60 s; a valid
# small case takes well under 2 s, so 10 s keeps the suite short without hiding anything that really hangs)
CASE_SECONDS = float(os.environ.get("AUTOPAR_FUZZ_CASE_SECONDS", "10"))
# extra address space one in-process case may take (a case that would allocate more gets MemoryError: reported)
CASE_MEMORY = int(float(os.environ.get("AUTOPAR_FUZZ_CASE_GIB", "6")) * 2**30)
SUBPROCESS_SECONDS = float(os.environ.get("AUTOPAR_FUZZ_SUBPROCESS_SECONDS", "20"))
SUBPROCESS_MEMORY = 4 * 2**30
PACKAGE_DIR = str(Path(autopar.__file__).resolve().parent)
SRC_DIR = str(Path(PACKAGE_DIR).parent)
ERROR_LINE = re.compile(r"^autopar (?P<command>[a-z]+): error: \S")


class Hang(BaseException):
    """Raised by the time limit inside the running command (a BaseException: no ``except Exception`` keeps it)."""


class RankStarted(BaseException):
    """Raised where ``autopar run`` starts a process: the plan passed every check made before ranks start."""


@dataclass
class Outcome:
    argv: list[str]
    code: int | None = None  # exit status; None where an exception escaped or the case hung
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    exception: str | None = None  # "TypeError: message"
    where: str | None = None  # innermost autopar frame "autopar/plan/io.py:92 in _check_layout"
    innermost: str | None = None  # innermost frame of all (may be inside torch, json, yaml, ...)
    trace: str = ""
    hang: bool = False
    rank_started: bool = False


@dataclass
class Failure:
    category: str  # traceback, hang, exit code, stderr, json, result, run --check, run vs dryrun
    group: str  # what the cases of one cause share (exception type and raising frame, ...)
    detail: str
    case: str  # how the input was made
    argv: list[str]
    content: str = ""  # the input file, shortened
    code: int | None = None
    stderr: str = ""
    saved: str | None = None  # where the input was kept (AUTOPAR_FUZZ_REPORT)


def _frame(fs: traceback.FrameSummary) -> str:
    name = fs.filename
    if name.startswith(SRC_DIR):
        name = os.path.relpath(name, SRC_DIR)
    else:
        for marker in ("site-packages/", "lib/python3"):
            if marker in name:
                name = name.split(marker, 1)[1]
                break
    return f"{name}:{fs.lineno} in {fs.name}"


def _locate(exc: BaseException) -> tuple[str | None, str | None, str]:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    ours = [f for f in frames if f.filename.startswith(PACKAGE_DIR)]
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (_frame(ours[-1]) if ours else None), (_frame(frames[-1]) if frames else None), text


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Alarm:
    fired: float | None = None  # when the time limit first fired


@contextlib.contextmanager
def limits(seconds: float = CASE_SECONDS, memory: int = CASE_MEMORY):
    """SIGALRM raises `Hang` after ``seconds`` and again every second after that (code that swallows one, a C
    callback or a ``__del__``, meets the next); the address space may grow by ``memory`` bytes. A case still
    running two minutes after its limit ends the whole process with every thread's stack (faulthandler): the
    suite fails instead of hanging CI."""
    import faulthandler

    alarm = Alarm()

    def handler(signum, frame):  # noqa: ANN001, ARG001
        if alarm.fired is None:
            alarm.fired = time.perf_counter()
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, handler)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + memory
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    faulthandler.dump_traceback_later(seconds + 120, exit=True, file=sys.__stderr__)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield alarm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def stop_at_rank_start():
    """Make every process start raise `RankStarted` (``autopar run`` validates a plan before it spawns ranks)."""
    import multiprocessing.process
    from unittest import mock

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RankStarted("a process was about to start")

    with mock.patch.object(multiprocessing.process.BaseProcess, "start", refuse), \
            mock.patch.object(subprocess.Popen, "__init__", refuse), mock.patch.object(os, "fork", refuse):
        yield


def _cleanup_process_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort after a case that was stopped half-way
        pass


def run_main(argv: Sequence[str], *, seconds: float = CASE_SECONDS, intercept_ranks: bool = False) -> Outcome:
    """``autopar ARGV`` in this process: exit status, stdout, stderr, and any exception that escaped ``main``."""
    from autopar.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    outcome = Outcome(list(argv))
    start = time.perf_counter()
    guard = stop_at_rank_start() if intercept_ranks else contextlib.nullcontext()
    alarm = Alarm()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), guard, limits(seconds) as alarm:
            code = main(list(argv))
        outcome.code = code if isinstance(code, int) else 1
    except SystemExit as exc:
        outcome.code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except RankStarted:
        outcome.rank_started = True
    except Hang as exc:
        outcome.hang = True
        outcome.where, outcome.innermost, outcome.trace = _locate(exc)
        outcome.exception = f"Hang: {exc}"
    except BaseException as exc:  # noqa: BLE001 - anything else escaping main() is a traceback
        if isinstance(exc, KeyboardInterrupt):
            raise
        outcome.exception = f"{type(exc).__name__}: {str(exc)[:300]}"
        outcome.where, outcome.innermost, outcome.trace = _locate(exc)
    finally:
        _cleanup_process_group()
    if alarm.fired is not None and not outcome.hang:  # the first Hang was swallowed (or became another error)
        outcome.hang = True
        outcome.exception = (f"Hang: still running after {seconds:g} s; the time limit's exception was lost "
                             f"in the product's code and the case ended {time.perf_counter() - alarm.fired:.0f} s "
                             f"later with {outcome.exception or f'exit {outcome.code}'}")
    outcome.seconds = time.perf_counter() - start
    outcome.stdout, outcome.stderr = out.getvalue(), err.getvalue()
    return outcome


def _child_limits() -> None:
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (SUBPROCESS_MEMORY, SUBPROCESS_MEMORY))


def start_subprocess(argv: Sequence[str], *, cwd: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1"}
    code = "import sys; from autopar.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", env=env, cwd=cwd,
                            preexec_fn=_child_limits)


def finish_subprocess(proc: subprocess.Popen, argv: Sequence[str], *, seconds: float = SUBPROCESS_SECONDS,
                      start: float | None = None) -> Outcome:
    outcome = Outcome(list(argv))
    start = time.perf_counter() if start is None else start
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, seconds - (time.perf_counter() - start)))
        outcome.code = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: its ranks go with it
        stdout, stderr = proc.communicate()
        outcome.hang = True
        outcome.exception = f"Hang: still running after {seconds:g} s (killed)"
        outcome.where = "a child process, killed at the time limit"
    outcome.seconds = time.perf_counter() - start
    outcome.stdout, outcome.stderr = stdout, stderr
    if outcome.code is not None and outcome.code < 0:
        outcome.exception = f"killed by signal {-outcome.code}"
    if "Traceback (most recent call last)" in stderr:
        outcome.exception = stderr.strip().splitlines()[-1][:300]
        files = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stderr)
        ours = [f for f in files if f[0].startswith(PACKAGE_DIR)]
        if ours:
            outcome.where = f"{os.path.relpath(ours[-1][0], SRC_DIR)}:{ours[-1][1]} in {ours[-1][2]}"
        if files:
            outcome.innermost = f"{files[-1][0]}:{files[-1][1]} in {files[-1][2]}"
        outcome.trace = stderr
    return outcome


def run_subprocess(argv: Sequence[str], *, seconds: float = SUBPROCESS_SECONDS, cwd: str | None = None) -> Outcome:
    start = time.perf_counter()
    return finish_subprocess(start_subprocess(argv, cwd=cwd), argv, seconds=seconds, start=start)


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (Python's json writes them; JSON has no such tokens)."""

    def refuse(token: str) -> Any:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def _finite_tree(value: Any, path: str = "") -> str | None:
    """The first non-finite number in a JSON value, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path or '<root>'} = {value}"
    if isinstance(value, dict):
        for k, v in value.items():
            if (bad := _finite_tree(v, f"{path}.{k}")) is not None:
                return bad
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (bad := _finite_tree(v, f"{path}[{i}]")) is not None:
                return bad
    return None


def _flag(argv: Sequence[str], name: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _check_result(command: str, data: Any, argv: Sequence[str]) -> list[tuple[str, str, str]]:
    """(category, group, detail) for an exit-0 JSON result that is not a correct result."""
    problems: list[tuple[str, str, str]] = []
    if not isinstance(data, dict):
        return [("json", f"{command}: stdout is not a JSON object", f"got {type(data).__name__}")]
    if (bad := _finite_tree(data)) is not None:
        problems.append(("result", f"{command}: non-finite number in the result", bad))
    estimate = data.get("estimate") if command in ("estimate", "plan") else None
    if command in ("estimate", "plan"):
        if not isinstance(estimate, dict):
            problems.append(("result", f"{command}: no 'estimate' object", repr(estimate)[:200]))
        else:
            for key in ("iteration_seconds", "compute_seconds", "exposed_comm_seconds", "bubble_seconds",
                        "throughput_samples_per_second", "tflops_per_device", "mfu"):
                v = estimate.get(key)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    problems.append(("result", f"{command}: estimate.{key} is not a finite number >= 0",
                                     f"{key} = {v!r}"))
            if not (isinstance(estimate.get("iteration_seconds"), (int, float)) and estimate["iteration_seconds"] > 0):
                problems.append(("result", f"{command}: iteration_seconds is not positive",
                                 f"iteration_seconds = {estimate.get('iteration_seconds')!r}"))
            memory = estimate.get("memory")
            if isinstance(memory, dict) and memory.get("fits") is False:
                problems.append(("result", f"{command}: exit 0 on a configuration that does not fit device memory "
                                 "(the contract's exit 3)",
                                 f"memory total {memory.get('total')!r} > budget {memory.get('budget')!r}"))
    if command == "profile":
        config = data.get("config")
        if not isinstance(config, dict) or any(
                not isinstance(config.get(k), int) or config[k] <= 0 for k in ("layers", "hidden", "heads", "vocab",
                                                                               "seq", "batch")):
            problems.append(("result", "profile: config fields are not positive integers", repr(config)[:200]))
    if command == "dryrun" and data.get("ok") is not True:
        problems.append(("result", "dryrun: exit 0 without ok: true", repr(data.get("ok"))))
    out = _flag(argv, "--out")
    if out is not None and command in ("estimate", "plan"):
        path = Path(out)
        if not path.is_file():
            problems.append(("result", f"{command}: exit 0 but --out {out!r} was not written", f"--out {out!r}"))
        else:
            try:
                written = strict_json(path.read_text())
                if not isinstance(written, dict) or not isinstance(written.get("plan"), dict):
                    raise ValueError("no 'plan' object")
            except ValueError as exc:
                problems.append(("result", f"{command}: --out wrote a file that is not a strict JSON plan", str(exc)))
    return problems


def judge(outcome: Outcome, *, json_mode: bool | None = None) -> list[tuple[str, str, str]]:
    """Every way ``outcome`` breaks the contract, as (category, group, detail)."""
    argv = outcome.argv
    command = argv[0] if argv else "?"
    json_mode = ("--json" in argv) if json_mode is None else json_mode
    if outcome.hang:
        return [("hang", f"{command}: {outcome.where or outcome.innermost or 'no autopar frame'}",
                 f"{outcome.exception}; stopped in {outcome.innermost}")]
    if outcome.exception is not None:
        kind = outcome.exception.split(":", 1)[0]
        return [("traceback", f"{kind} at {outcome.where or outcome.innermost}",
                 f"{outcome.exception} (innermost frame {outcome.innermost})")]
    problems: list[tuple[str, str, str]] = []
    if "Traceback (most recent call last)" in outcome.stderr:
        last = outcome.stderr.strip().splitlines()[-1]
        problems.append(("traceback", f"traceback printed on stderr by {command}", last[:300]))
    if outcome.code not in (0, 2, 3):
        problems.append(("exit code", f"{command}: exit {outcome.code}", f"exit {outcome.code}"))
    if outcome.code in (2, 3):
        lines = outcome.stderr.rstrip("\n").split("\n") if outcome.stderr.strip() else []
        if len(lines) != 1 or not ERROR_LINE.match(lines[0]) or ERROR_LINE.match(lines[0])["command"] != command:
            if lines and lines[0].startswith("usage:"):
                group = f"{command}: argparse usage + error ({'multi-line' if len(lines) > 1 else 'one line'})"
            elif not lines:
                group = f"{command}: exit {outcome.code} with nothing on stderr"
            elif len(lines) > 1:
                group = f"{command}: error of {len(lines)} lines"
            else:
                group = f"{command}: error line not 'autopar {command}: error: ...'"
            problems.append(("stderr", group, " | ".join(lines)[:400]))
    if json_mode and outcome.code in (0, 2, 3):
        text = outcome.stdout.strip()
        if outcome.code == 0 or text:
            try:
                data = strict_json(outcome.stdout)
            except ValueError as exc:
                problems.append(("json", f"{command}: stdout is not strict JSON under --json (exit {outcome.code})",
                                 f"{exc}: {text[:200]!r}"))
            else:
                if outcome.code == 0:
                    problems += _check_result(command, data, argv)
    elif outcome.code == 0 and not json_mode:
        out = _flag(argv, "--out")
        if out is not None and command in ("estimate", "plan") and not Path(out).is_file():
            problems.append(("result", f"{command}: exit 0 but --out {out!r} was not written", f"--out {out!r}"))
    return problems


def shorten(text: str | bytes, limit: int = 240) -> str:
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError:
            text = repr(text)
    text = text.replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return f"{text[: limit - 60]} ... {text[-40:]} ({len(text)} chars)"


@dataclass
class Report:
    """Failures of one family, rendered together (every case, grouped by category and cause)."""

    family: str
    cases: int = 0  # commands judged
    generated: int = 0  # distinct inputs hypothesis generated
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    save_dir: Path | None = None
    timings: list[tuple[float, str]] = field(default_factory=list)  # (seconds, case) of every command run
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        root = os.environ.get("AUTOPAR_FUZZ_REPORT")
        if root:
            self.save_dir = Path(root) / self.family
            self.save_dir.mkdir(parents=True, exist_ok=True)

    def add(self, outcome: Outcome, case: str, content: str | bytes = "", problems=None,  # noqa: ANN001
            input_path: str | None = None) -> list[Failure]:
        if problems is None:
            self.timings.append((outcome.seconds, f"{case} [{' '.join(outcome.argv[:1])}]"))
        problems = judge(outcome) if problems is None else problems
        added = []
        for category, group, detail in problems:
            saved = None
            if self.save_dir is not None and input_path and Path(input_path).is_file():
                saved = str(self.save_dir / f"case{len(self.failures):04d}{Path(input_path).suffix}")
                with contextlib.suppress(OSError):
                    Path(saved).write_bytes(Path(input_path).read_bytes())
            failure = Failure(category, group, detail, case, list(outcome.argv), shorten(content), outcome.code,
                              outcome.stderr.strip()[-600:], saved)
            self.failures.append(failure)
            added.append(failure)
        return added

    def render(self, examples: int | None = None) -> str:
        groups: dict[tuple[str, str], list[Failure]] = defaultdict(list)
        for f in self.failures:
            groups[(f.category, f.group)].append(f)
        lines = [f"{self.family}: {len(self.failures)} contract violations in {self.cases} cases "
                 f"({self.generated} generated), {len(groups)} causes"]
        lines += [f"  note: {n}" for n in self.notes]
        slow = sorted(self.timings, reverse=True)[:5]
        lines.append(f"  note: {time.perf_counter() - self.started:.0f} s in all; slowest commands: "
                     + "; ".join(f"{sec:.1f} s {shorten(case, 120)}" for sec, case in slow))
        for (category, group), items in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]), kv[0][1])):
            lines.append(f"\n[{category}] {group}  ({len(items)} cases)")
            for f in items[: examples or len(items)]:
                lines.append(f"  - {f.detail}")
                lines.append(f"    input: {f.case}")
                lines.append(f"    argv: autopar {' '.join(_quote(a) for a in f.argv)}")
                if f.content:
                    lines.append(f"    content: {f.content}")
                if f.saved:
                    lines.append(f"    saved: {f.saved}")
                lines.append(f"    exit: {f.code}; stderr: {shorten(f.stderr, 300)!s}")
            if examples and len(items) > examples:
                lines.append(f"  ... and {len(items) - examples} more")
        return "\n".join(lines)

    def dump(self) -> None:
        if self.save_dir is not None:
            (self.save_dir / "report.txt").write_text(self.render() + "\n")
            (self.save_dir / "failures.json").write_text(json.dumps(
                [f.__dict__ for f in self.failures], indent=1, default=str))


def _quote(arg: str) -> str:
    return arg if arg and re.fullmatch(r"[\w@%+=:,./-]+", arg) else repr(arg)


# ---------------------------------------------------------------------------------------------------------------
# Mutations of valid inputs (hypothesis strategies)
# ---------------------------------------------------------------------------------------------------------------

import copy  # noqa: E402

from hypothesis import strategies as st  # noqa: E402

NAN, INF = float("nan"), float("inf")
EDGE_VALUES: list[Any] = [
    0, -1, -3, 1, 2, 7, 10**12, 2**63, -(2**63), 10**30, 0.5, 2.0, -0.0, 1e-300, 1e308, NAN, INF, -INF,
    "", "0", "2", "x", "garbage \x00 \u2603", "A" * 100_000, [], [1], [None], {}, {"a": 1}, None, True, False,
]
NUMBER_EDGES: list[Any] = [0, -1, -3, 10**12, 2**64, 10**30, 1e-9, NAN, INF, -INF]
LAYOUT_EDGES: list[Any] = [
    "S(9)", "[R]", "X", 7, "[S(9), R]", "[R, S(-1)]", "[P, P]", "", "[", "[R,R]", "[S(0),R]", "[ R, R ]",
    "[S(1.5), R]", "[S(), R]", "[S(99999999999999999999), R]", "[R, R, R]", None, ["R", "R"], "[S(0), S(0)]",
    "[R, P]", "[r, s(0)]",
]
STRING_EDGES: list[Any] = ["", " ", "garbage \x00 \u2603", "A" * 100_000, "../../etc/passwd", "\ud800", "%s%n"]
_LAYOUT = re.compile(r"^\[?(S\(\d+\)|R|P)")


def describe(path: Sequence[Any]) -> str:
    text = ""
    for p in path:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if re.fullmatch(r"[A-Za-z_][\w]*", str(p)) else f"[{p!r}]")
    return text.lstrip(".") or "<root>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} chars)"


def all_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every node below the root, parents before children."""
    out: list[tuple] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out += all_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((*prefix, i))
            out += all_paths(v, (*prefix, i))
    return out


def get_at(doc: Any, path: Sequence[Any]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def set_at(doc: Any, path: Sequence[Any], value: Any) -> Any:
    if not path:
        return value
    get_at(doc, path[:-1])[path[-1]] = value
    return doc


def _retype(draw: Callable, value: Any) -> Any:
    """The same value in another JSON type."""
    if isinstance(value, bool):
        return draw(st.sampled_from([int(value), str(value).lower(), None, [value]]))
    if isinstance(value, int):
        return draw(st.sampled_from([float(value), value + 0.5, str(value), [value], None, bool(value),
                                     {"value": value}]))
    if isinstance(value, float):
        return draw(st.sampled_from([int(value) if math.isfinite(value) else 0, str(value), [value], None]))
    if isinstance(value, str):
        return draw(st.sampled_from([7, [value], None, {value: value}, True, value.upper()]))
    if isinstance(value, list):
        return draw(st.sampled_from([{str(i): v for i, v in enumerate(value)}, str(value), None, 0, tuple_free(value)]))
    if isinstance(value, dict):
        return draw(st.sampled_from([[[k, v] for k, v in value.items()], list(value), str(value)[:200], None, 0, ""]))
    return draw(st.sampled_from(["null", 0, [], {}]))


def tuple_free(value: list) -> Any:
    return [value]  # one more level of nesting


def mutate_tree(draw: Callable, doc: Any, paths: Sequence[tuple]) -> tuple[Any, str]:
    """One mutation at a drawn path of ``doc`` (a deep copy is changed and returned), and what it did."""
    if not paths:
        return doc, "no paths"
    path = draw(st.sampled_from(list(paths)))
    node = get_at(doc, path)
    parent = get_at(doc, path[:-1])
    where = describe(path)
    ops = ["replace", "retype", "delete"]
    if isinstance(node, dict):
        ops += ["add_unknown", "clear"] + (["rename_key", "swap_values"] if node else [])
    if isinstance(node, list):
        ops += ["clear", "append"] + (["drop", "duplicate", "reverse", "permute"] if node else [])
    if isinstance(node, str):
        ops += ["string"] + (["layout", "layout", "layout"] if _LAYOUT.match(node) else [])
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        ops += ["number", "number"]
    op = draw(st.sampled_from(ops))
    if op == "replace":
        value = copy.deepcopy(draw(st.sampled_from(EDGE_VALUES)))  # never the shared constant
        set_at(doc, path, value)
        return doc, f"{where} = {_short(value)}"
    if op == "retype":
        value = _retype(draw, node)
        set_at(doc, path, value)
        return doc, f"{where} retyped {_short(node)} -> {_short(value)}"
    if op == "delete":
        del parent[path[-1]]
        return doc, f"del {where}"
    if op == "add_unknown":
        key = draw(st.sampled_from(["unknown_field", "__class__", "", "device", "import"]))
        value = copy.deepcopy(draw(st.sampled_from(EDGE_VALUES)))  # never the shared constant
        node[key] = value
        return doc, f"{where}[{key!r}] = {_short(value)} (unknown field)"
    if op == "clear":
        node.clear()
        return doc, f"{where} emptied"
    if op == "rename_key":
        key = draw(st.sampled_from(sorted(node, key=str)))
        new = draw(st.sampled_from([f"{key}_x", "nonexistent.module", key.upper() if isinstance(key, str) else "K",
                                    "layers.99." + str(key)]))
        node[new] = node.pop(key)
        return doc, f"{where}: key {key!r} renamed {new!r}"
    if op == "swap_values":
        keys = sorted(node, key=str)
        a, b = draw(st.sampled_from(keys)), draw(st.sampled_from(keys))
        node[a], node[b] = node[b], node[a]
        return doc, f"{where}: values of {a!r} and {b!r} swapped"
    if op == "append":
        value = copy.deepcopy(draw(st.sampled_from(EDGE_VALUES)))  # never the shared constant
        node.append(value)
        return doc, f"{where} += [{_short(value)}]"
    if op == "drop":
        i = draw(st.integers(0, len(node) - 1))
        del node[i]
        return doc, f"{where}[{i}] dropped"
    if op == "duplicate":
        i = draw(st.integers(0, len(node) - 1))
        node.insert(i, copy.deepcopy(node[i]))
        return doc, f"{where}[{i}] duplicated"
    if op == "reverse":
        node.reverse()
        return doc, f"{where} reversed"
    if op == "permute":
        order = draw(st.permutations(range(len(node)))) if len(node) <= 30 else list(range(len(node)))[::-1]
        node[:] = [node[i] for i in order]
        return doc, f"{where} reordered {list(order)[:10]}"
    if op == "string":
        value = draw(st.sampled_from([*STRING_EDGES, node * 1000, node + "x", node.upper(), node[: len(node) // 2]]))
        set_at(doc, path, value)
        return doc, f"{where} = {_short(value)} (was {_short(node)})"
    if op == "layout":
        value = draw(st.sampled_from(LAYOUT_EDGES))
        set_at(doc, path, value)
        return doc, f"{where} = {_short(value)} (layout was {node!r})"
    # number
    value = draw(st.sampled_from([*NUMBER_EDGES, -node, node + 1, node * 2, float(node) + 0.5]))
    set_at(doc, path, value)
    return doc, f"{where} = {_short(value)} (was {_short(node)})"


def corrupt_bytes(draw: Callable, data: bytes) -> tuple[bytes, str]:
    """File-level damage: truncation, bytes that are not UTF-8, empty files, odd encodings, extreme nesting."""
    kind = draw(st.sampled_from(["truncate", "non-utf8", "empty", "whitespace", "bom", "utf16", "nested",
                                 "trailing", "null-bytes", "comment", "long-number"]))
    if kind == "truncate":
        cut = draw(st.integers(0, max(0, len(data) - 1)))
        return data[:cut], f"truncated to {cut} of {len(data)} bytes"
    if kind == "non-utf8":
        at = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\x80", b"\xed\xa0\x80"]))
        return data[:at] + junk + data[at:], f"bytes {junk!r} inserted at {at}"
    if kind == "empty":
        return b"", "empty file"
    if kind == "whitespace":
        return b" \n\t\n", "whitespace only"
    if kind == "bom":
        return b"\xef\xbb\xbf" + data, "UTF-8 byte-order mark prepended"
    if kind == "utf16":
        return data.decode("utf-8", "replace").encode("utf-16"), "re-encoded as UTF-16"
    if kind == "nested":
        depth = draw(st.sampled_from([1000, 100_000]))
        return b"[" * depth + b"]" * depth, f"{depth} nested empty lists"
    if kind == "trailing":
        return data + b"\n}}garbage", "garbage after the document"
    if kind == "null-bytes":
        return b"\x00" * 64, "64 NUL bytes"
    if kind == "comment":
        return b"// a comment\n# another\n" + data, "comment lines prepended"
    return re.sub(rb"\b(\d+)\b", lambda m: m.group(1) + b"0" * 5000, data, count=1), "first number given 5,000 more digits"


# ---- plans ------------------------------------------------------------------------------------------------------


def plan_hot_paths(doc: dict) -> list[tuple]:
    """Paths the runtime reads first: top-level plan fields, mesh, workload, stages (not their cost figures), and a
    few module layouts."""
    plan = doc.get("plan", {})
    hot: list[tuple] = [("plan",), ("estimate",)]
    for key, value in plan.items():
        hot.append(("plan", key))
        if key in ("mesh", "workload"):
            hot += [("plan", key, *p) for p in all_paths(value)]
        if key == "stages":
            for i, stage in enumerate(value):
                hot += [("plan", "stages", i, k) for k in stage if k not in ("memory", "seconds_per_micro_batch")]
                hot += [("plan", "stages", i, "layers", j) for j in range(len(stage.get("layers", [])))]
        if key == "modules":
            names = list(value)
            picked = names[:3] + [n for n in names if n.endswith(("qkv", "fc1", "fc2", "proj", "down", "up"))][:4]
            for name in picked:
                hot.append(("plan", "modules", name))
                hot += [("plan", "modules", name, *p) for p in all_paths(value[name])]
    return hot


def _stages(plan: dict) -> list[dict]:
    stages = plan.get("stages")
    return stages if isinstance(stages, list) and all(isinstance(s, dict) for s in stages) else []


def plan_recipe(draw: Callable, doc: dict) -> tuple[Any, str]:
    """A targeted change of a plan's meaning (the cases a schema check most easily misses)."""
    plan = doc["plan"]
    stages = _stages(plan)
    work = plan.get("workload", {})
    modules = plan.get("modules", {})
    recipes = ["mesh", "schedule", "chunks", "zero", "micro_batches", "micro_batch_size", "batch", "seq", "model",
               "overrides", "plan", "schema", "kind", "top", "sp"]
    if stages:
        recipes += ["dp_tp", "dp_tp", "stages", "stages", "recompute", "segments", "intra", "delete_stages"]
    if modules:
        recipes += ["module_name", "param_shape", "swap_layouts"]
    recipe = draw(st.sampled_from(recipes))
    if recipe == "dp_tp":
        how = draw(st.sampled_from(["negate", "swap", "all_dp", "all_tp", "half"]))
        for s in stages:
            n = s["dp"] * s["tp"]
            s["dp"], s["tp"] = {"negate": (-s["dp"], -s["tp"]), "swap": (s["tp"], s["dp"]), "all_dp": (n, 1),
                                "all_tp": (1, n), "half": (0.5, 2 * n)}[how]
        return doc, f"every stage's dp x tp {how}: {[(s['dp'], s['tp']) for s in stages]} (product kept)"
    if recipe == "mesh":
        shape = plan["mesh"]["shape"]
        value = draw(st.sampled_from([shape[::-1], [0, *shape[1:]], [-1, -2], [*shape, 1], shape[:1], [],
                                      [shape[0], 10**12], [1.0 * n for n in shape], [str(n) for n in shape]]))
        plan["mesh"]["shape"] = value
        if draw(st.booleans()) and isinstance(value, list):
            plan["mesh"]["axes"] = [f"a{i}" for i in range(len(value))]
        return doc, f"mesh = {plan['mesh']!r}"
    if recipe in ("schedule", "chunks", "zero", "micro_batches", "micro_batch_size", "sp", "schema", "kind"):
        values = {
            "schedule": ["zigzag", "", "GPIPE", "interleaved", "1f1b", "gpipe", None, 1],
            "chunks": [0, -1, 2, 10**12, 1.5, "2"],
            "zero": [7, -1, 1, 2, 3, True, 1.0, "0"],
            "micro_batches": [0, -3, 10**12, 1, 3, 2.0],
            "micro_batch_size": [0, -2, 10**12, 1, 3, 8],
            "sp": [True, "yes", 1, None],
            "schema": [2, 0, "1", None, 1.0],
            "kind": ["ilp", "megatron", 7, ""],
        }[recipe]
        value = draw(st.sampled_from(values))
        plan[recipe] = value
        return doc, f"plan.{recipe} = {_short(value)}"
    if recipe in ("batch", "seq"):
        value = draw(st.sampled_from({"batch": [9, 7, 0, -8, 10**12, 1], "seq": [0, -1, 1, 10**9, 33, 4096]}[recipe]))
        if not isinstance(work, dict):
            return doc, "no workload"
        work[recipe] = value
        return doc, f"plan.workload.{recipe} = {value!r}"
    if recipe == "model":
        value = draw(st.sampled_from(["nonexistent", "", "hf:bogus", "llama-7b", "bert-base", "t5-base", "wrn-50-2",
                                      "moe-125m-e8", "hf:gpt2-tiny", "../gpt3-125m", "os.system"]))
        target = draw(st.sampled_from(["workload", "plan", "both"]))
        if target in ("workload", "both") and isinstance(work, dict):
            work["model"] = value
        if target in ("plan", "both"):
            plan["model"] = value
        return doc, f"model of {target} = {value!r}"
    if recipe == "overrides":
        base = dict(work.get("overrides", {})) if isinstance(work, dict) else {}
        value = draw(st.sampled_from([
            [], list(base.items()), {**base, "device": "cuda"}, {**base, "hidden": 63}, {**base, "heads": 0},
            {**base, "layers": -2}, {**base, "dropout": 0.5}, {**base, "vocab": 10**12}, {**base, "layers": "2"},
            {**base, "layers": 2.5}, {**base, "layers": 3}, {**base, "layers": 1}, None, "layers=2",
            {**base, "layers": 10**6}, {**base, "dtype": "torch.float64"}, {"__class__": 1},
        ]))
        if not isinstance(work, dict):
            return doc, "no workload"
        if value is None:
            work.pop("overrides", None)
            return doc, "plan.workload.overrides deleted (the zoo's full-size model)"
        work["overrides"] = value
        return doc, f"plan.workload.overrides = {_short(value)}"
    if recipe == "plan":
        value = draw(st.sampled_from([None, [], "plan", 0, {}, "delete"]))
        if value == "delete":
            del doc["plan"]
        else:
            doc["plan"] = value
        return doc, f"plan = {value!r}"
    if recipe == "top":
        value = draw(st.sampled_from([[doc], "plan", None, 3, []]))
        return value, f"the whole document = {_short(value)}"
    if recipe == "stages":
        how = draw(st.sampled_from(["reverse", "duplicate", "drop", "empty", "swap_layers", "empty_layers",
                                    "unknown_layer", "layer_twice", "drop_head", "null_stage", "dict"]))
        layers = [s.get("layers", []) for s in stages]
        if how == "reverse":
            stages.reverse()
        elif how == "duplicate":
            stages.append(copy.deepcopy(stages[0]))
        elif how == "drop":
            stages.pop()
        elif how == "empty":
            stages.clear()
        elif how == "swap_layers" and len(stages) > 1:
            stages[0]["layers"], stages[-1]["layers"] = layers[-1], layers[0]
        elif how == "swap_layers":
            stages[0]["layers"] = layers[0][::-1]
        elif how == "empty_layers":
            stages[0]["layers"] = []
        elif how == "unknown_layer":
            stages[0]["layers"] = [*layers[0], "layers.99"]
        elif how == "layer_twice":
            stages[-1]["layers"] = [*layers[-1], layers[0][-1]]
        elif how == "drop_head":
            stages[-1]["layers"] = layers[-1][:-1]
        elif how == "null_stage":
            stages[0] = None
        else:
            plan["stages"] = {str(i): s for i, s in enumerate(stages)}
        return doc, f"stages {how}"
    if recipe == "recompute":
        value = draw(st.sampled_from([{"layers.0": "full"}, {"layers.0": "selective", "layers.1": "full"},
                                      {"layers.0": "bogus"}, {"nope": "full"}, ["layers.0"], {"layers.0": None},
                                      {"head": "full"}, {"embed": "selective"}]))
        stages[0]["recompute"] = value
        return doc, f"stages[0].recompute = {value!r}"
    if recipe == "segments":
        value = draw(st.sampled_from([[["layers.0", "layers.1"]], [["layers.1", "layers.0"]], [["x"]], "x", [[]],
                                      [["layers.0", "layers.0"]], [["embed", "head"]], [[0, 1]]]))
        stages[0]["segments"] = value
        return doc, f"stages[0].segments = {value!r}"
    if recipe == "intra":
        value = draw(st.sampled_from([True, "yes", 1]))
        stages[0]["intra"] = value
        return doc, f"stages[0].intra = {value!r}"
    if recipe == "delete_stages":
        del plan["stages"]
        return doc, "plan.stages deleted (reads as an intra-op plan)"
    names = list(modules)
    name = draw(st.sampled_from(names))
    if recipe == "module_name":
        new = draw(st.sampled_from(["nonexistent", "layers.9.attn.qkv", name + ".inner", "", name.upper()]))
        modules[new] = modules.pop(name)
        return doc, f"module {name!r} renamed {new!r}"
    if recipe == "param_shape":
        entry = modules[name]
        shapes = entry.get("shapes") if isinstance(entry, dict) else None
        if not shapes:
            return doc, f"module {name!r} has no shapes"
        param = draw(st.sampled_from(sorted(shapes)))
        value = draw(st.sampled_from([shapes[param][::-1], [], [-1], [10**12], [n * 2 for n in shapes[param]]]))
        shapes[param] = value
        return doc, f"shape of {param} = {value!r}"
    # swap the layouts of a column-parallel and a row-parallel module (each still well-formed)
    pairs = [(a, b) for a in names for b in names if a < b and isinstance(modules[a], dict)
             and isinstance(modules[b], dict) and modules[a].get("params") and modules[b].get("params")
             and list(modules[a]["params"].values()) != list(modules[b]["params"].values())]
    if not pairs:
        return doc, "no layouts to swap"
    a, b = draw(st.sampled_from(pairs[:40]))
    pa, pb = modules[a]["params"], modules[b]["params"]
    va, vb = list(pa.values()), list(pb.values())
    for k, v in zip(list(pa), vb + va[len(vb):]):
        pa[k] = v
    for k, v in zip(list(pb), va + vb[len(va):]):
        pb[k] = v
    return doc, f"parameter layouts of {a!r} and {b!r} swapped"


@st.composite
def plan_cases(draw: Callable, seeds: dict[str, dict]) -> tuple[str, bytes, str]:
    """(seed name, file content, how it was made) from a valid plan."""
    name = draw(st.sampled_from(sorted(seeds)))
    doc = copy.deepcopy(seeds[name])
    hot = plan_hot_paths(doc)
    steps: list[str] = []
    kind = draw(st.sampled_from(["tree", "tree", "tree", "recipe", "recipe", "recipe", "both", "file"]))
    if kind in ("recipe", "both"):
        backup = copy.deepcopy(doc)
        try:
            doc, what = plan_recipe(draw, doc)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:  # the plan format moved on: no such field
            doc, what = backup, f"(targeted change not applicable: {type(exc).__name__} {exc})"
        steps.append(what)
    if kind in ("tree", "both"):
        for _ in range(draw(st.integers(1, 2))):
            paths = hot if draw(st.booleans()) else all_paths(doc)
            paths = [p for p in paths if _exists(doc, p)]
            doc, what = mutate_tree(draw, doc, paths)
            steps.append(what)
    data = json.dumps(doc, indent=1).encode()  # NaN and Infinity written as such
    if kind == "file" or draw(st.integers(0, 19)) == 0:
        data, what = corrupt_bytes(draw, data)
        steps.append(what)
    return name, data, "; ".join(steps) or "unchanged"


def _exists(doc: Any, path: Sequence[Any]) -> bool:
    """Whether ``path`` leads to a node of ``doc`` through dicts and lists alone (an earlier mutation may have
    turned a list into a string, which indexes too but cannot be written into)."""
    for p in path:
        if not isinstance(doc, (dict, list)):
            return False
        try:
            doc = doc[p]
        except (KeyError, IndexError, TypeError):
            return False
    return True


# ---- cluster files ----------------------------------------------------------------------------------------------

RAW_YAML = [
    ("python object tag", "!!python/object/apply:os.system ['touch {marker}']\n"),
    ("python tag in a field", "name: !!python/object/apply:os.system ['touch {marker}']\ndevices_per_node: 8\n"),
    ("python name tag", "device: !!python/name:os.system\n"),
    ("python module tag", "links: !!python/module:os\n"),
    ("list document", "- name: x\n- devices_per_node: 8\n"),
    ("scalar document", "a100\n"),
    ("number document", "42\n"),
    ("null document", "~\n"),
    ("empty document", ""),
    ("comment only", "# nothing\n"),
    ("tabs", "name:\tx\n\tdevices_per_node: 8\n"),
    ("unclosed flow", "device: {memory_gib: 80, peak_tflops: {bf16: 312}\n"),
    ("binary tag", "device: !!binary aGVsbG8=\n"),
    ("set tag", "device: !!set {memory_gib, hbm_gbps}\n"),
    ("timestamp", "devices_per_node: 2001-12-14t21:59:43.10-05:00\n"),
    ("multi documents", "name: a\n---\nname: b\n"),
    ("deep nesting", "[" * 5000 + "]" * 5000 + "\n"),
    ("deep mapping", "a: " * 2000 + "1\n"),
    ("non-utf8", "name: \udcff\n"),
]


def cluster_paths(doc: Any) -> list[tuple]:
    return all_paths(doc)


def cluster_recipe(draw: Callable, doc: dict) -> tuple[Any, str]:
    """Targeted changes: measured tables, link and device figures, node counts."""
    links = doc.get("links", {})
    device = doc.get("device", {})
    recipe = draw(st.sampled_from(["measured", "measured", "devices", "device", "links", "efficiency", "peak"]))
    if recipe == "measured":
        tier = draw(st.sampled_from(["intra", "inter"]))
        m = links[tier].get("measured") or {"ranks": 2, "bytes": [1024, 4194304], "seconds": [1e-4, 1e-2]}
        how = draw(st.sampled_from(["zero sizes", "descending", "zero seconds", "negative seconds", "ranks", "huge",
                                    "mismatch", "strings", "list", "one point", "nan seconds", "equal sizes"]))
        m = dict(m)
        if how == "zero sizes":
            m["bytes"], m["seconds"] = [0, 0], m["seconds"][:2]
        elif how == "descending":
            m["bytes"] = m["bytes"][::-1]
        elif how == "zero seconds":
            m["seconds"] = [0.0 for _ in m["seconds"]]
        elif how == "negative seconds":
            m["seconds"] = [-s for s in m["seconds"]]
        elif how == "ranks":
            m["ranks"] = draw(st.sampled_from([1, 0, -2, 10**12, 2.5, "2", INF]))
        elif how == "huge":
            m["bytes"] = [10**30, 10**31]
            m["seconds"] = m["seconds"][:2]
        elif how == "mismatch":
            m["seconds"] = m["seconds"][:-1]
        elif how == "strings":
            m["bytes"] = [str(b) for b in m["bytes"]]
        elif how == "list":
            m = [m["ranks"], m["bytes"], m["seconds"]]
        elif how == "one point":
            m["bytes"], m["seconds"] = m["bytes"][:1], m["seconds"][:1]
        elif how == "nan seconds":
            m["seconds"] = [NAN for _ in m["seconds"]]
        else:
            m["bytes"] = [m["bytes"][0]] * len(m["bytes"])
        links[tier]["measured"] = m
        return doc, f"links.{tier}.measured: {how}"
    if recipe == "devices":
        key = draw(st.sampled_from(["devices_per_node", "nodes"]))
        value = draw(st.sampled_from([0, -1, 1, 3, 10**12, INF, NAN, 2.5, "8", None, 1e300]))
        doc[key] = value
        return doc, f"{key} = {value!r}"
    if recipe == "device":
        key = draw(st.sampled_from(["memory_gib", "hbm_gbps", "kernel_overhead_us", "reserved_gib"]))
        value = draw(st.sampled_from([0, -1, 1e-9, 1e-300, 10**12, 1e308, INF, NAN, "80", None, [80]]))
        device[key] = value
        return doc, f"device.{key} = {value!r}"
    if recipe == "links":
        tier = draw(st.sampled_from(["intra", "inter"]))
        key = draw(st.sampled_from(["bandwidth_gbps", "latency_us"]))
        value = draw(st.sampled_from([0, -1, 1e-300, 1e308, INF, NAN, "fast", None]))
        links[tier][key] = value
        return doc, f"links.{tier}.{key} = {value!r}"
    if recipe == "efficiency":
        key = draw(st.sampled_from(["matmul", "attention", "memory"]))
        value = draw(st.sampled_from([0, 1.5, -0.5, NAN, INF, "0.5", None]))
        device.setdefault("efficiency", {})[key] = value
        return doc, f"device.efficiency.{key} = {value!r}"
    value = draw(st.sampled_from([{}, {"int8": 1000}, {"bf16": 0}, {"bf16": NAN}, {"fp32": 1e-300}, [312], 312]))
    device["peak_tflops"] = value
    return doc, f"device.peak_tflops = {value!r}"


def to_toml(doc: dict) -> str:
    """A small TOML writer (tables, inline lists, nan and inf as TOML spells them); None values are left out."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            return "nan" if math.isnan(v) else ("inf" if v == INF else "-inf" if v == -INF else repr(v))
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v if x is not None) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{key(k)} = {scalar(x)}" for k, x in v.items() if x is not None) + "}"
        return '""'

    def key(k: Any) -> str:
        return str(k) if re.fullmatch(r"[A-Za-z0-9_-]+", str(k)) else json.dumps(str(k))

    lines: list[str] = []

    def table(prefix: str, d: dict) -> None:
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in d.items():
            if v is not None and not isinstance(v, dict):
                lines.append(f"{key(k)} = {scalar(v)}")
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{prefix}.{key(k)}" if prefix else key(k), v)

    table("", doc)
    return "\n".join(lines) + "\n"


@st.composite
def cluster_cases(draw: Callable, seeds: dict[str, dict]) -> tuple[str, bytes, str, str]:
    """(seed name, file content, suffix, how it was made) from a valid cluster description."""
    import yaml

    kind = draw(st.sampled_from(["tree", "tree", "tree", "recipe", "recipe", "recipe", "both", "raw", "file",
                                 "toml"]))
    name = draw(st.sampled_from(sorted(seeds)))
    if kind == "raw":
        what, text = draw(st.sampled_from(RAW_YAML))
        return "raw", text.encode("utf-8", "surrogateescape"), ".yaml", what
    doc = copy.deepcopy(seeds[name])
    steps: list[str] = []
    if kind in ("recipe", "both", "toml") and (kind != "toml" or draw(st.booleans())):
        backup = copy.deepcopy(doc)
        try:
            doc, what = cluster_recipe(draw, doc)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:  # the file format moved on
            doc, what = backup, f"(targeted change not applicable: {type(exc).__name__} {exc})"
        steps.append(what)
    if kind in ("tree", "both") or (kind == "toml" and not steps):
        for _ in range(draw(st.integers(1, 2))):
            doc, what = mutate_tree(draw, doc, [p for p in cluster_paths(doc) if _exists(doc, p)])
            steps.append(what)
    if kind == "toml":
        if not isinstance(doc, dict):
            return name, b"= broken", ".toml", "; ".join([*steps, "TOML without a table"])
        return name, to_toml(doc).encode("utf-8", "surrogatepass"), ".toml", "; ".join([*steps, "as TOML"])
    data = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode("utf-8", "surrogatepass")
    if kind == "file":
        data, what = corrupt_bytes(draw, data)
        steps.append(what)
    suffix = draw(st.sampled_from([".yaml", ".yaml", ".yml", ""]))
    return name, data, suffix, "; ".join(steps) or "unchanged"


# ---- command-line flags -----------------------------------------------------------------------------------------

MODEL_FLAGS = ["--batch", "--seq", "--layers", "--hidden", "--heads", "--vocab", "--ffn", "--kv-heads", "--experts"]
VALUE_FLAGS = {
    "profile": MODEL_FLAGS + ["--dtype"],
    "estimate": MODEL_FLAGS + ["--dtype", "--cluster", "--gpus", "--tp", "--pp", "--dp", "--mbs", "--recompute",
                               "--zero", "--schedule", "--chunks", "--out"],
    "analyze": MODEL_FLAGS + ["--dtype", "--gpus", "--mesh", "--cluster"],
    "plan": MODEL_FLAGS + ["--dtype", "--cluster", "--gpus", "--mesh", "--search", "--budget-s", "--out"],
    "models": [],
}
SWITCHES = {"profile": ["--json"], "estimate": ["--sp", "--json"], "analyze": ["--all", "--json"],
            "plan": ["--runnable", "--json"], "models": ["--json"]}
NUMBER_TEXT = ["0", "-1", "-8", "1000000000000", "99999999999999999999999999", "abc", "nan", "inf", "-inf", "1e3",
               "2.5", "", " 2", "0x10", "\u0661\u0662", "2_0", "+3", "-0", "3"]
CHOICE_TEXT = {
    "--dtype": ["bogus", "", "BF16", "fp64", "fp32"],
    "--recompute": ["bogus", "", "FULL", "selective", "full"],
    "--schedule": ["bogus", "", "interleaved", "gpipe", "1F1B"],
    "--zero": ["7", "-1", "3", "1", "x"],
    "--search": ["bogus", "", "ilp", "megatron", "dp", "fsdp", "aceso", "exhaustive"],
    "--cluster": ["bogus", "", "cpu", "h100-80g-sxm", "v100-32g-nvlink", "{tmp}", "/nonexistent/cluster.yaml"],
    "--mesh": ["2x", "0x4", "-1x-2", "x", "2x2x2x2", "2\u00d72", "nan", "1x1x1", "4x1", "8", "", "2x2", "3x3"],
    "--out": ["", "/nonexistent/dir/p.json", "{tmp}", "{tmp}/out.json", "{tmp}/missing/out.json"],
    "--budget-s": ["0", "-1", "nan", "inf", "1e-9", "abc", "0.5", ""],
}
MODEL_NAMES = ["", "gpt3-", "hf:", "hf:bogus", "moe-125m-e0", "wrn-0-0", "t5-base", "bert-base", "hf:gpt2-tiny",
               "llama3-8b", "GPT3-125M", "../etc/passwd", "-", "--json", "moe-125m-e8", "wrn-16-1"]
TINY = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "32", "--vocab", "128"]
LLAMA = ["llama-7b", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--vocab", "128", "--seq", "32"]
FLAG_SEEDS: list[list[str]] = [
    ["profile", *TINY, "--batch", "2", "--json"],
    ["profile", *LLAMA, "--dtype", "fp32", "--json"],
    ["estimate", *TINY, "--cluster", "cpu", "--gpus", "4", "--batch", "8", "--tp", "2", "--pp", "2", "--mbs", "1",
     "--json"],
    ["estimate", *LLAMA, "--cluster", "cpu", "--gpus", "4", "--batch", "8", "--tp", "2", "--pp", "1", "--mbs", "2",
     "--zero", "1", "--recompute", "selective", "--out", "{tmp}/e.json", "--json"],
    ["estimate", *TINY[:1], "--layers", "4", *TINY[3:], "--cluster", "a100-80g-sxm", "--gpus", "4", "--batch", "16",
     "--tp", "1", "--pp", "2",
     "--mbs", "2", "--schedule", "interleaved", "--chunks", "2", "--json"],
    ["analyze", *TINY, "--gpus", "4", "--mesh", "2x2", "--json"],
    ["plan", *TINY, "--cluster", "cpu", "--gpus", "4", "--batch", "8", "--budget-s", "2", "--json"],
    ["plan", *TINY, "--cluster", "cpu", "--gpus", "4", "--batch", "8", "--budget-s", "20", "--search", "ilp",
     "--mesh", "2x2", "--out", "{tmp}/p.json", "--json"],
    ["plan", *TINY, "--cluster", "cpu", "--gpus", "2", "--batch", "8", "--budget-s", "2", "--search", "megatron",
     "--json"],
    ["models", "--json"],
]


def _value_positions(argv: list[str]) -> list[int]:
    return [i for i in range(1, len(argv) - 1) if argv[i].startswith("--") and argv[i] not in SWITCHES.get(argv[0], [])
            and argv[i] != "--json"]


def mutate_flags(draw: Callable, argv: list[str]) -> tuple[list[str], str]:
    command = argv[0]
    positions = _value_positions(argv)
    ops = ["add", "add", "drop_json"]
    if positions:
        ops += ["value", "value", "value", "drop", "duplicate"]
    if command != "models":
        ops += ["model", "drop_model"]
    else:
        ops += ["positional"]
    op = draw(st.sampled_from(ops))
    if op == "value":
        i = draw(st.sampled_from(positions))
        flag = argv[i]
        value = draw(st.sampled_from(CHOICE_TEXT.get(flag, NUMBER_TEXT)))
        return [*argv[: i + 1], value, *argv[i + 2:]], f"{flag} {value!r}"
    if op == "drop":
        i = draw(st.sampled_from(positions))
        return argv[:i] + argv[i + 2:], f"{argv[i]} removed"
    if op == "duplicate":
        i = draw(st.sampled_from(positions))
        flag = argv[i]
        value = draw(st.sampled_from(CHOICE_TEXT.get(flag, NUMBER_TEXT)))
        return [*argv, flag, value], f"{flag} given again as {value!r}"
    if op == "add":
        flag = draw(st.sampled_from(VALUE_FLAGS[command] + SWITCHES[command] + ["--bogus"]))
        if flag in SWITCHES[command]:
            return [*argv, flag], f"{flag} added"
        if flag == "--bogus":
            return [*argv, "--bogus", "1"], "unknown flag --bogus"
        value = draw(st.sampled_from(CHOICE_TEXT.get(flag, NUMBER_TEXT)))
        return [*argv, flag, value], f"{flag} {value!r} added"
    if op == "drop_json":
        return [a for a in argv if a != "--json"], "without --json"
    if op == "model":
        value = draw(st.sampled_from(MODEL_NAMES))
        return [command, value, *argv[2:]], f"MODEL {value!r}"
    if op == "drop_model":
        return [command, *argv[2:]], "MODEL missing"
    value = draw(st.sampled_from(["gpt3-125m", "", "--", "extra"]))
    return [*argv, value], f"extra argument {value!r}"


@st.composite
def flag_cases(draw: Callable) -> tuple[list[str], str]:
    argv = list(draw(st.sampled_from(FLAG_SEEDS)))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        argv, what = mutate_flags(draw, argv)
        steps.append(what)
    if draw(st.integers(0, 9)) == 0:  # contradictory devices: the classic --tp 3 --gpus 8
        argv = [*argv, "--tp", "3", "--gpus", "8"] if argv[0] == "estimate" else argv
        steps.append("--tp 3 --gpus 8" if argv[0] == "estimate" else "")
    return argv, "; ".join(s for s in steps if s)
