"""Local ranks: start N processes, meet on a loopback rendezvous, and supervise them until every one has ended.

The launcher opens the rendezvous itself (a TCP store on a socket bound to 127.0.0.1 before any rank starts: no
port to pick, so no race) and each rank's gloo sockets bind to the loopback interface unless GLOO_SOCKET_IFNAME
names another. A rank that dies or raises ends every rank within a second and raises one `RankError` naming the
rank and the cause (``rank 1 was killed by SIGKILL``, ``rank 0 failed: ValueError: ...``); the rank's traceback
is logged at INFO. Ranks start with SIGINT ignored, so Ctrl-C in a terminal reaches the launcher alone; any
exception in the launcher (KeyboardInterrupt included) stops the ranks (SIGTERM, then SIGKILL after a grace period),
and on Linux a rank dies with its launcher.

Ranks start from a fork server (`multiprocessing`'s forkserver) that has imported torch and autopar's runtime once
(and transformers, where the ranks build a Hugging Face model), so a rank begins its work at once rather than after
seconds of imports; the server starts when a launcher first needs it (`prestart` starts it early, beside the
launcher's own checks) and lives as long as the launcher. A rank takes the launcher's standard output and error and
its environment as they are when the rank starts, as a spawned process would. ``AUTOPAR_RANK_START=spawn`` spawns
every rank afresh instead. torch is imported inside the functions that use it: a rank ties its life to the
launcher's before anything else.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import multiprocessing
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
GRACE_SECONDS = 2.0  # from SIGTERM to SIGKILL when stopping ranks
POLL_SECONDS = 0.2  # a signal taken by another thread is seen by the main thread within this
RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
_IFF_LOOPBACK = 0x8
_PR_SET_PDEATHSIG = 1


class RankError(RuntimeError):
    """A rank died or raised; the message is one line naming the rank and the cause."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(f"rank {rank} {cause}")
        self.rank = rank


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks meet: the launcher's TCP store."""

    host: str
    port: int
    world: int

    def join(self, rank: int, *, backend: str) -> None:
        """In a rank: the default process group over the launcher's store."""
        import torch.distributed as dist

        if backend == "gloo" and self.host == LOOPBACK and not os.environ.get("GLOO_SOCKET_IFNAME"):
            interface = loopback_interface()
            if interface:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        if backend == "nccl":  # one GPU per rank, as NCCL requires; rank 0 of one rank takes the first
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=self.world)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux), or None where it cannot be told."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & _IFF_LOOPBACK:
            return name
    return None


def run_ranks(target: Callable[..., Any], world: int, *, args: Sequence[Any] = (), host: str = LOOPBACK) -> list[Any]:
    """Run ``target(rank, rendezvous, *args)`` on ``world`` new ranks; each rank's return value, in rank order.

    ``target`` must be importable by name (ranks unpickle it). Raises `RankError` for the first rank that
    dies or raises, after every rank has been stopped."""
    with _rendezvous(host, world) as rendezvous, _Ranks() as ranks:
        ranks.start(target, rendezvous, tuple(args))
        return ranks.wait()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit(143)`` in the main thread (where it would otherwise end the
    process at once), so that clean-up code runs; a handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _rendezvous(host: str, world: int) -> Iterator[Rendezvous]:
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(max(world, 16))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                          timeout=RENDEZVOUS_TIMEOUT)
    log.info("rendezvous on %s:%d for %d ranks", host, port, world)
    try:
        yield Rendezvous(host, port, world)
    finally:
        del store


# what every rank imports before its work: the fork server imports it once (an import that fails is left to ranks)
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "autopar.runtime.launch", "autopar.profiling.segments", "autopar.cluster.detect"]
# and what ranks building a Hugging Face model import: 2 s a rank here, but as long again before the first rank of a
# model that needs none of it can start, so preloaded only where the model is one (`prestart`)
_HUGGING_FACE = ["transformers.modeling_utils"]


def _start_method() -> str:
    """``forkserver`` where this platform has it, unless ``AUTOPAR_RANK_START`` says ``spawn``."""
    chosen = os.environ.get("AUTOPAR_RANK_START", "").strip() or "forkserver"
    if chosen not in ("forkserver", "spawn"):
        raise ValueError(f"AUTOPAR_RANK_START must be forkserver or spawn, got {chosen!r}")
    return chosen if chosen in multiprocessing.get_all_start_methods() else "spawn"


def _context(*, hugging_face: bool = False) -> Any:
    context = multiprocessing.get_context(_start_method())
    if context.get_start_method() == "forkserver":
        extra = _HUGGING_FACE if hugging_face or "transformers" in sys.modules else []
        context.set_forkserver_preload(_PRELOAD + extra)
    return context


def prestart(*, hugging_face: bool = False) -> None:
    """Start the fork server ranks start from, if it is not running: its imports then overlap with what the
    launcher does before it starts ranks (checking the plan). It imports transformers too where ranks will build
    a Hugging Face model (``hugging_face``, or transformers imported here already). SIGINT is ignored in it and so
    in the ranks it starts: Ctrl-C in a terminal reaches the launcher alone."""
    if _context(hugging_face=hugging_face).get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    with _sigint_ignored():
        forkserver.ensure_running()


class _Stdio:
    """The launcher's standard output and error, handed to a rank as it starts (a fork server's own are those of
    the launcher that started it, which may since have redirected them)."""

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as the rank starts: its file descriptors go with it
        from multiprocessing.reduction import DupFd

        return _Stdio._adopt, tuple(DupFd(fd) if _is_open(fd) else None for fd in (1, 2))

    @staticmethod
    def _adopt(out: Any, err: Any) -> None:
        for fd, passed in ((1, out), (2, err)):
            given = passed.detach() if passed is not None else fd
            if given != fd:  # a spawned rank inherits the launcher's as they are
                os.dup2(given, fd)
                os.close(given)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class _Ranks:
    """Rank processes, each with a pipe that carries its result or its error to the launcher."""

    def __init__(self) -> None:
        self.context = _context()
        self.processes: list[Any] = []
        self.pipes: list[Connection] = []
        self.messages: dict[int, tuple[Any, ...]] = {}

    def __enter__(self) -> _Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        with _signals_deferred():
            self.stop()

    def start(self, target: Callable[..., Any], rendezvous: Rendezvous, args: tuple[Any, ...]) -> None:
        with _sigint_ignored():  # inherited: Ctrl-C in a terminal reaches the launcher alone, which stops the ranks
            for rank in range(rendezvous.world):
                mine, theirs = self.context.Pipe()
                process = self.context.Process(target=_rank_entry, args=(rank, theirs, os.getpid(), _Stdio()),
                                               name=f"autopar-rank-{rank}")
                self.processes.append(process)
                self.pipes.append(mine)
                process.start()
                theirs.close()
        # the work goes through the pipe once SIGINT is heard again: a large plan blocks this send until the rank
        # has read it, seconds into the rank's imports
        for pipe in self.pipes:
            with suppress(BrokenPipeError, ConnectionResetError):  # a rank already gone: wait() names it
                pipe.send(dict(os.environ))  # first: the work's own modules may read it as they are imported
                pipe.send((target, rendezvous, args))

    def wait(self) -> list[Any]:
        live = dict(enumerate(self.processes))
        pipes = dict(enumerate(self.pipes))
        while live:
            ready = set(wait([*pipes.values(), *(p.sentinel for p in live.values())], timeout=POLL_SECONDS))
            for rank in [r for r, pipe in pipes.items() if pipe in ready]:
                self._receive(rank, pipes)
            ended = [rank for rank, p in live.items() if p.sentinel in ready]
            for rank in ended:
                live.pop(rank).join()
                while rank in pipes and pipes[rank].poll():
                    self._receive(rank, pipes)
            failed = [rank for rank in ended if self.processes[rank].exitcode != 0]
            if failed:
                raise self._error(failed)
        silent = [rank for rank in range(len(self.processes)) if rank not in self.messages]
        if silent:
            raise RankError(silent[0], "ended without reporting its result")
        return [self.messages[rank][1] for rank in range(len(self.processes))]

    def _receive(self, rank: int, pipes: dict[int, Connection]) -> None:
        try:
            data = pipes[rank].recv_bytes()
        except (EOFError, OSError):
            del pipes[rank]
            return
        try:
            self.messages[rank] = pickle.loads(data)  # `_report`
        except Exception as exc:  # noqa: BLE001 - whatever unpickling raised: the result cannot be had here
            raise RankError(rank, f"sent a result this process cannot read: {_one_line(exc)}") from None

    def _error(self, failed: list[int]) -> RankError:
        """The cause among ranks that ended together: a signal first, then the error raised earliest (a peer of a
        failed rank raises too, later: gloo's "Connection closed by peer")."""
        causes = []
        for rank in failed:
            code, message = self.processes[rank].exitcode, self.messages.get(rank)
            if code < 0:
                causes.append((0, 0.0, rank, f"was killed by {_signal_name(-code)}"))
            elif message and message[0] == "error":
                log.info("rank %d traceback:\n%s", rank, message[2])
                causes.append((1, message[3], rank, f"failed: {message[1]}"))
            else:
                causes.append((2, 0.0, rank, f"exited with status {code}"))
        *_, rank, text = min(causes)
        return RankError(rank, text)

    def stop(self) -> None:
        alive = [p for p in self.processes if p.pid is not None and p.exitcode is None]
        for process in alive:
            process.terminate()
        deadline = time.monotonic() + GRACE_SECONDS
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in alive:
            if process.exitcode is None:
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()


def _rank_entry(rank: int, pipe: Connection, launcher: int, stdio: None = None) -> None:
    """``stdio``: unpickling `_Stdio` has already made the launcher's standard output and error this rank's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the launcher starts ranks; a fork server's may differ
    _die_with_launcher(launcher)
    with suppress(RuntimeError, ValueError, OSError):  # no usable stderr: nowhere to print it
        faulthandler.enable()  # a rank killed by a fatal signal prints where each of its threads was
    try:
        environment = pipe.recv()
        if os.environ != environment:  # a fork server's is the launcher's when the server started
            os.environ.clear()
            os.environ.update(environment)
        target, rendezvous, args = pipe.recv()
        _watch_launcher(pipe)
        value = target(rank, rendezvous, *args)
        _FINISHING.set()
        _report(pipe, ("ok", value))  # a value that cannot be pickled is an error, reported below
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the launcher, in one line
        _FINISHING.set()
        with suppress(OSError):
            _report(pipe, ("error", _one_line(exc), traceback.format_exc(), time.monotonic()))  # one clock machine-wide
            pipe.close()
        _exit(1)  # a process group torn down mid-collective aborts noisily
    pipe.close()
    _exit(0)


def _report(pipe: Connection, message: tuple[Any, ...]) -> None:
    """Send ``message`` by value. multiprocessing's own pickler sends a tensor as a handle to this process's shared
    memory, which is gone once the rank has exited: the launcher would get nothing back."""
    pipe.send_bytes(pickle.dumps(message))


def _exit(code: int) -> None:
    """End the rank without Python's finalization. torch's worker threads (autograd's, gloo's) still hold Python
    objects at exit, and finalizing the interpreter under them can abort the process (pytorch/pytorch#190489): a
    rank that had finished its work would be reported killed by SIGABRT."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


_FINISHING = threading.Event()  # set once this rank reports its result: the launcher may close its pipe from then on


def _watch_launcher(pipe: Connection) -> None:
    """Kill this rank once the launcher's end of ``pipe`` closes before the rank has reported: the launcher is gone,
    or stopped the ranks. A rank started by a fork server is not the launcher's child, and the server outlives a
    killed launcher while its children hold the server's lifeline (every child inherits it), so the parent-death
    signal cannot end such a rank. The watch reads a copy of the pipe's descriptor, which closing ``pipe`` leaves."""
    watched = os.dup(pipe.fileno())

    def watch() -> None:
        with suppress(OSError, ValueError):
            select.select([watched], [], [])  # the launcher sends nothing after the work: readable at end of file
        if not _FINISHING.is_set():
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="autopar-launcher-watch", daemon=True).start()


def _die_with_launcher(launcher: int) -> None:
    """Die with the parent: the launcher, or the fork server, which ends when its launcher does."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable; a rank may outlive a killed launcher")
    # the launcher died while this rank started (the signal covers a parent that dies from now on): this rank's
    # parent is no longer the launcher, nor the fork server the launcher started
    parent = os.getppid()
    if parent != launcher and _parent_of(parent) not in (launcher, -1):
        os._exit(1)


def _parent_of(pid: int) -> int:
    """The parent of process ``pid``; -1 where this system cannot tell (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:  # "pid (name) state ppid ...", the name may hold spaces
            return int(stat.read().rpartition(b")")[2].split()[1])
    except FileNotFoundError:
        return -1 if not os.path.isdir("/proc/self") else 0
    except (OSError, ValueError, IndexError):
        return -1


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while ranks (or their fork server) start: an ignored signal stays ignored across exec, and
    Python installs no KeyboardInterrupt handler where it finds SIGINT ignored. (A Ctrl-C in these few milliseconds
    is lost.)"""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait while the ranks are stopped, then take their usual course."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield  # not ours to change (another thread, or a handler installed outside Python)
        return
    pending: list[int] = []
    for signum in previous:
        signal.signal(signum, lambda number, frame: pending.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)
