"""Faults end cleanly: a rank's death or error, Ctrl-C and SIGTERM give one line, a known exit status, no hang,
no rank left running and no temporary folder left behind. The slow tests drive the real command line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from autopar.cli.main import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "32", "--vocab", "128"]
EXIT_SECONDS = 5.0


# ---- helpers: the command line as a real process, its ranks found as its children ----------------------------------

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # as /proc/net/tcp*


class Command:
    """``autopar ...`` as a real process, its temporary folders in ``tmp_path``; the `cli` fixture kills whatever
    of it a failing test leaves running."""

    def __init__(self, tmp_path: Path, argv: tuple[str, ...]) -> None:
        env = dict(os.environ, PYTHONPATH=SRC, TMPDIR=str(tmp_path))
        self.tmp_path = tmp_path
        self.process = subprocess.Popen([sys.executable, "-m", "autopar.cli.main", *argv], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.ranks: list[int] = []
        self.servers: list[int] = []  # the fork server the ranks start from, where they do

    def wait_for_ranks(self, count: int, timeout: float = 120.0) -> list[int]:
        """The launcher's ranks, once ``count`` of them run (pids rise with the rank: started in order)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            self.ranks = _ranks_of(self.process.pid)
            self.servers = [c for c in _children(self.process.pid) if b"forkserver" in _cmdline(c)]
            if len(self.ranks) >= count:
                return self.ranks
            time.sleep(0.05)
        raise AssertionError(f"no {count} ranks started under pid {self.process.pid}")

    def end(self, since: float, limit: float = EXIT_SECONDS) -> tuple[int, list[str], float]:
        """Exit status, stderr lines and seconds since ``since`` once the command has ended and closed its pipes
        (ranks that outlive it hold them)."""
        try:
            _, err = self.process.communicate(timeout=limit + 30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the command or its ranks ran {limit + 30:.0f} s after the fault") from None
        return self.process.returncode, err.splitlines(), time.monotonic() - since

    def assert_clean(self) -> None:
        time.sleep(0.2)
        left = [r for r in self.ranks + self.servers if _running(r)]
        self.kill()
        assert left == [], "ranks outlived the launcher"
        assert list(self.tmp_path.glob("autopar-run-*")) == [], "the run's temporary folder was left behind"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.ranks += [c for c in _children(self.process.pid) if c not in self.ranks]
            self.process.kill()
        for pid in self.ranks:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.communicate(timeout=30)


@pytest.fixture
def cli(tmp_path):
    started: list[Command] = []

    def start(*argv: str) -> Command:
        started.append(Command(tmp_path, argv))
        return started[-1]

    yield start
    for command in started:
        command.kill()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _ranks_of(launcher: int) -> list[int]:
    """The launcher's ranks: spawned children, or children of the fork server it started."""
    found = []
    for child in _children(launcher):
        line = _cmdline(child)
        if b"spawn_main" in line:
            found.append(child)
        elif b"forkserver" in line:
            found += _children(child)
    return sorted(found)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening(pids: list[int]) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) on which these processes listen."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:["):-1])
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.add(fields[1].rsplit(":", 1)[0])
    return addresses


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["estimate", *TINY, "--cluster", "cpu", "--gpus", "2", "--batch", "4", "--tp", "1", "--pp", "1",
                 "--mbs", "2", "--out", str(path)]) == 0
    return path


# ---- autopar run --------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill rank 0", "kill rank 1", "SIGINT", "SIGTERM", "Ctrl-C"])
def test_a_fault_during_run_ends_every_rank_with_one_line(cli, plan_file, fault) -> None:
    run = cli("run", str(plan_file), "--nproc", "2", "--steps", "100000")
    ranks = run.wait_for_ranks(2)
    time.sleep(3.0)  # into set-up or training: either way every rank must end
    assert run.process.poll() is None
    since = time.monotonic()
    if fault.startswith("kill rank"):
        os.kill(ranks[int(fault[-1])], signal.SIGKILL)
    elif fault == "Ctrl-C":  # a terminal sends SIGINT to the whole foreground group: launcher and ranks
        os.killpg(run.process.pid, signal.SIGINT)
    else:
        os.kill(run.process.pid, getattr(signal, fault))
    code, err, seconds = run.end(since)
    expected = {
        "kill rank 0": (1, "autopar run: error: rank 0 was killed by SIGKILL"),
        "kill rank 1": (1, "autopar run: error: rank 1 was killed by SIGKILL"),
        "SIGINT": (130, "autopar: interrupted"),
        "Ctrl-C": (130, "autopar: interrupted"),
        "SIGTERM": (143, "autopar: terminated"),
    }[fault]
    assert (code, err) == (expected[0], [expected[1]])
    assert seconds < EXIT_SECONDS
    run.assert_clean()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "calibrate"])
def test_ranks_meet_and_listen_on_loopback_only(cli, plan_file, command) -> None:
    argv = ("run", str(plan_file), "--nproc", "2", "--steps", "100000") if command == "run" else (
        "calibrate", "--nproc", "2", "--json")
    launched = cli(*argv)
    ranks = launched.wait_for_ranks(2)
    time.sleep(3.0)  # the launcher's store listens from the start, the ranks' gloo sockets once they have met
    listening = _listening([launched.process.pid, *ranks])
    assert launched.process.poll() is None and _listening([launched.process.pid]), "the launcher holds no rendezvous"
    assert listening <= LOOPBACK, f"listening beyond loopback: {listening - LOOPBACK}"


@pytest.mark.slow
def test_ranks_die_with_a_killed_launcher(cli, plan_file) -> None:
    run = cli("run", str(plan_file), "--nproc", "2", "--steps", "100000")
    ranks = run.wait_for_ranks(2)
    time.sleep(3.0)
    run.process.kill()
    deadline = time.monotonic() + EXIT_SECONDS
    while any(_running(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r for r in ranks if _running(r)] == [], "ranks outlived a killed launcher"


@pytest.mark.slow
def test_an_error_inside_the_ranks_is_one_error_naming_a_rank(plan_file, tmp_path) -> None:
    """The checks before launch would refuse this plan; past them (``checked``), each rank fails to build the
    model, and the launcher names one rank and its error."""
    import dataclasses

    from autopar.cluster.ranks import RankError
    from autopar.plan import load_plan
    from autopar.runtime import run_plan

    plan = dataclasses.replace(load_plan(plan_file), workload=None)
    before = set(Path(tempfile.gettempdir()).glob("autopar-run-*"))
    with pytest.raises(RankError) as caught:
        run_plan(plan, nproc=2, steps=3, checked=True)
    assert str(caught.value).startswith("rank ") and "failed: ValueError: the plan has no workload" in str(caught.value)
    assert set(Path(tempfile.gettempdir()).glob("autopar-run-*")) == before


def _raise_on_rank_one(rank: int, rendezvous, message: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="gloo")
    if rank == 1:
        raise ValueError(message)
    dist.all_reduce(torch.ones(1))  # rank 0 waits on its peer, which is gone


@pytest.mark.slow
def test_the_rank_that_raised_is_named_not_the_peer_left_waiting() -> None:
    from autopar.cluster.ranks import RankError, run_ranks

    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(_raise_on_rank_one, 2, args=("bad value 7",))
    assert str(caught.value) == "rank 1 failed: ValueError: bad value 7" and caught.value.rank == 1
    assert time.monotonic() - start < 60


def _abort_at_finalization(rank: int, rendezvous) -> int:
    import atexit

    atexit.register(os.abort)  # as torch's worker threads can, when Python finalizes under them
    return rank * 10


def _abort_in_work(rank: int, rendezvous) -> None:
    if rank == 1:
        os.abort()


def test_a_rank_that_finished_its_work_ends_without_python_finalization() -> None:
    from autopar.cluster.ranks import run_ranks

    assert run_ranks(_abort_at_finalization, 2) == [0, 10]


def test_a_rank_killed_by_a_signal_is_named_and_prints_where_it_was(capfd) -> None:
    from autopar.cluster.ranks import RankError, run_ranks

    with pytest.raises(RankError) as caught:
        run_ranks(_abort_in_work, 2)
    assert str(caught.value) == "rank 1 was killed by SIGABRT"
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "_abort_in_work" in err


def _say(rank: int, rendezvous) -> str | None:
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):  # one write each: ranks write at once
        stream.write(f"rank {rank} says {name}\n")
        stream.flush()
    return os.environ.get("AUTOPAR_TEST_MARK")


@pytest.mark.parametrize("start", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_ranks_take_the_launchers_environment_and_output_as_they_are_when_they_start(
        start, monkeypatch, tmp_path) -> None:
    """A fork server started for earlier ranks holds the environment and output it had then; ranks started later
    must still see the launcher's own."""
    from autopar.cluster.ranks import run_ranks

    monkeypatch.setenv("AUTOPAR_RANK_START", start)
    monkeypatch.delenv("AUTOPAR_TEST_MARK", raising=False)
    assert run_ranks(_say, 2) == [None, None]  # the server (where ranks start from one) runs from here on
    monkeypatch.setenv("AUTOPAR_TEST_MARK", "set since")
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, name in ((1, "out"), (2, "err")):
            with open(tmp_path / name, "w") as file:
                os.dup2(file.fileno(), fd)
        assert run_ranks(_say, 2) == ["set since", "set since"]
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    for name in ("out", "err"):
        assert sorted((tmp_path / name).read_text().splitlines()) == [f"rank 0 says {name}", f"rank 1 says {name}"]


def _tensor(rank: int, rendezvous):
    import torch

    return {"weights": torch.full((3,), float(rank))}


def _unpicklable(rank: int, rendezvous):
    return lambda: rank


def test_a_rank_returns_tensors_by_value() -> None:
    """multiprocessing's own pickler would send a tensor as a handle to the rank's shared memory, gone once the rank
    has exited: the launcher got None back."""
    import torch

    from autopar.cluster.ranks import run_ranks

    results = run_ranks(_tensor, 2)
    assert [r["weights"].tolist() for r in results] == [[0.0] * 3, [1.0] * 3]
    assert isinstance(results[0]["weights"], torch.Tensor)


def test_a_result_that_cannot_be_sent_is_an_error_naming_the_rank() -> None:
    from autopar.cluster.ranks import RankError, run_ranks

    with pytest.raises(RankError, match=r"^rank [01] failed: .*(Pickl|pickle|local object)"):
        run_ranks(_unpicklable, 2)


def test_a_bad_rank_start_method_is_named(monkeypatch) -> None:
    from autopar.cluster.ranks import run_ranks

    monkeypatch.setenv("AUTOPAR_RANK_START", "fork")
    with pytest.raises(ValueError, match="AUTOPAR_RANK_START must be forkserver or spawn, got 'fork'"):
        run_ranks(_say, 2)


def test_ranks_of_a_hugging_face_model_start_from_a_server_that_imported_transformers(monkeypatch) -> None:
    """A rank that builds a Hugging Face model imports transformers (2 s here, 4 ranks on 2 cores: 4 s before the
    first step); the fork server imports it once instead, where the plan's model is one. A zoo model's ranks do not
    wait for it: the server's imports come before the first rank can start."""
    import multiprocessing
    from types import SimpleNamespace

    from autopar.cluster import ranks
    from autopar.runtime import launch

    chosen = []
    monkeypatch.setattr(multiprocessing.context.ForkServerContext, "set_forkserver_preload",
                        lambda _self, modules: chosen.append(list(modules)), raising=False)
    monkeypatch.delitem(sys.modules, "transformers", raising=False)  # as in a fresh `autopar run`
    ranks._context(hugging_face=True)
    ranks._context()
    assert "transformers.modeling_utils" in chosen[0] and "transformers.modeling_utils" not in chosen[1]
    assert chosen[1] == ranks._PRELOAD
    asked = []
    monkeypatch.setattr(launch, "prestart", lambda *, hugging_face: asked.append(hugging_face))
    for model, expected in (("hf:qwen3", True), ("llama-7b", False), ("examples/model.py:build", False)):
        launch.prestart_for(SimpleNamespace(workload=SimpleNamespace(model=model)))
        assert asked.pop() is expected
    launch.prestart_for(SimpleNamespace(workload=None))  # a plan made from Python, before --model names its model
    assert asked.pop() is False


def test_the_first_failure_is_named_when_ranks_end_together() -> None:
    from types import SimpleNamespace

    from autopar.cluster.ranks import _Ranks

    ranks = _Ranks()
    ranks.processes = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=3)]
    ranks.messages = {0: ("error", "RuntimeError: Connection closed by peer", "", 12.5),  # the peer, later
                      1: ("error", "ValueError: bad value", "", 12.0)}
    assert str(ranks._error([0, 1, 2])) == "rank 1 failed: ValueError: bad value"
    assert str(ranks._error([2])) == "rank 2 exited with status 3"
    ranks.processes[2] = SimpleNamespace(exitcode=-signal.SIGKILL)
    assert str(ranks._error([0, 1, 2])) == "rank 2 was killed by SIGKILL"


# ---- autopar calibrate --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_calibrate_ends_when_a_rank_dies_in_its_first_seconds(cli) -> None:
    calibrate = cli("calibrate", "--nproc", "2", "--json")
    ranks = calibrate.wait_for_ranks(2)
    since = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    code, err, seconds = calibrate.end(since)
    assert (code, err) == (1, ["autopar calibrate: error: rank 1 was killed by SIGKILL"])
    assert seconds < EXIT_SECONDS
    calibrate.assert_clean()


@pytest.fixture
def no_measuring(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("calibrate measured before checking --out")

    monkeypatch.setattr("autopar.cli.calibrate.calibrate", fail)


@pytest.mark.parametrize("kind", ["missing folder", "directory", "empty"])
def test_calibrate_checks_out_before_measuring(tmp_path, capsys, no_measuring, kind) -> None:
    out = {"missing folder": str(tmp_path / "nowhere" / "c.yaml"), "directory": str(tmp_path), "empty": ""}[kind]
    start = time.monotonic()
    assert main(["calibrate", "--nproc", "2", "--out", out]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("autopar calibrate: error: --out ")
    assert out in err[0] and time.monotonic() - start < 5


def _fake_calibration():
    from autopar.cluster import PRESETS
    from autopar.cluster.detect import Calibration

    sizes = (1024, 4 * 2**20, 8 * 2**20)
    return Calibration(PRESETS["cpu"], 2, sizes, (1e-4, 4e-3, 8e-3), 1e9, 1e-5, 0.01, 0.1)


def test_calibrate_writes_out_atomically_and_names_the_given_path(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("autopar.cli.calibrate.calibrate", lambda *a, **k: _fake_calibration())
    out = tmp_path / "cluster.yaml"
    out.write_text("old\n")
    assert main(["calibrate", "--nproc", "2", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    assert out.read_text().startswith("name: cpu") and [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(os, "replace", refuse)
    assert main(["calibrate", "--nproc", "2", "--out", str(out), "--json"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"autopar calibrate: error: {out}: cannot write: Permission denied"]
    assert out.read_text().startswith("name: cpu") and [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]


# ---- any command: Ctrl-C and SIGTERM from the first moment ----------------------------------------------------------

def test_the_command_line_module_starts_without_torch() -> None:
    code = "import sys, autopar, autopar.cli.main; assert 'torch' not in sys.modules, 'torch imported at start'"
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=SRC), check=True)


def _torch_loading(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("after", [0.0, 0.5])  # as torch starts loading, and amid the imports that follow
@pytest.mark.parametrize(("number", "code", "line"), [(signal.SIGINT, 130, "autopar: interrupted"),
                                                      (signal.SIGTERM, 143, "autopar: terminated")])
def test_a_signal_while_importing_gives_one_line(cli, number, code, line, after) -> None:
    profile = cli("profile", *TINY)
    deadline = time.monotonic() + 60
    while not _torch_loading(profile.process.pid) and profile.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(after)
    assert profile.process.poll() is None, "finished before the signal"
    os.kill(profile.process.pid, number)
    assert profile.end(time.monotonic())[:2] == (code, [line])
