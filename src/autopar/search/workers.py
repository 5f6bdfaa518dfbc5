"""Searching parts of a space in forked worker processes, where the machine has the cores for it.

The pipeline searches price each depth independently of the others (the Megatron grid's points, Aceso's climbs),
so their depths can be priced side by side. A worker is a `os.fork` of the searching process: it starts with
the traced model and every price cached so far, and needs nothing pickled to begin. What comes back is pickled
through a pipe: a few configurations and counts, never prices (a price holds closures over the model), so the
caller prices again the handful it keeps, in its own process, with its own caches; prices are deterministic, so
the result is what one process would have found.

The calling process works too; only where fork exists, more than one core is free and no other thread runs are
there workers, else every item is done here in turn. Each process takes the next item when it is free, so a slow
depth does not hold up the others. Stopping: the ``should_stop`` the caller passes is asked here, and a stop it
reports reaches the workers through a flag in shared memory (Ctrl-C reaches them anyway: it goes to the whole
process group, and they inherit the search's handler). A worker that raises raises here; one that dies, or an
interrupt here, takes every worker down with it.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import select
import signal
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")
Stop = Callable[[], bool]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """How many processes a search uses: ``AUTOPAR_WORKERS`` where set (1 keeps every search in this process), else
    one per core; 1 where this platform cannot fork."""
    if not hasattr(os, "fork"):
        return 1
    text = os.environ.get("AUTOPAR_WORKERS", "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"AUTOPAR_WORKERS must be a whole number of processes, got {text!r}") from None
        if value < 1:
            raise ValueError(f"AUTOPAR_WORKERS must be at least 1, got {value}")
        return value
    return cores()


def in_worker() -> bool:
    """Whether this process is a search's worker (its progress is not shown: the caller's is)."""
    return _WORKER


_WORKER = False


class _Queue:
    """The next item to take, shared by the processes forked after it was made."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = mmap.mmap(-1, 8)
        self._lock = multiprocessing.get_context("fork").Lock()

    def take(self) -> tuple[int, int] | None:
        """The index of the next item and how many were left before it was taken, or None when none is left."""
        with self._lock:
            index = struct.unpack("q", self._next[:8])[0]
            if index >= self.size:
                return None
            self._next[:8] = struct.pack("q", index + 1)
        return index, self.size - index


def share_out(
    items: Sequence[T], work: Callable[[T, Stop, int], R], *, should_stop: Stop = lambda: False,
    finish: Callable[[], Any] = lambda: None, order: Sequence[int] | None = None,
) -> tuple[list[R | None], list[Any]]:
    """``work(item, stop, left)`` for each item, ``left`` counting the items not yet started (this one included),
    here and in forked workers (`default_workers` permitting), each process taking the next item as it is free,
    in ``order`` (indices into ``items``; default: as given). A stop ends every process after its current item;
    each does one at least, so that a search stopped at once still has a best so far. Returns the results in the
    items' order (None where a stop left an item undone) and what ``finish`` returned in each worker (not here)
    once it had no more to do."""
    results: list[R | None] = [None] * len(items)
    queue = _Queue(len(items))
    order = list(order) if order is not None else list(range(len(items)))
    if sorted(order) != list(range(len(items))):
        raise ValueError(f"order must list each of the {len(items)} items' indices once, got {order}")

    def drain(stop: Stop) -> list[tuple[int, R]]:
        done = []
        while (taken := queue.take()) is not None:
            at, left = taken
            index = order[at]
            done.append((index, work(items[index], stop, left)))
            if stop():  # each process ends on what it has: at least one item, its best so far
                break
        return done

    # a fork copies only the calling thread: with others running (a notebook's, a server's), a lock one of them
    # holds would stay held in the worker for ever, so then everything is done here
    count = min(default_workers(), len(items)) if not _other_threads() else 1
    if count < 2:
        finished = []
        done = drain(should_stop)
    else:
        flag = mmap.mmap(-1, 1)  # shared with the workers: 1 once this process was asked to stop
        children: list[tuple[int, int]] = []
        finished = []
        try:
            for _ in range(count - 1):
                children.append(_fork(lambda stop: (drain(stop), finish()), flag, should_stop))
            done = drain(should_stop)
            while children:
                pid, fd = children.pop(0)
                theirs, extra = _collect(pid, fd, flag, should_stop)
                done += theirs
                finished.append(extra)
        finally:
            for pid, fd in children:  # an error or an interrupt here: no worker outlives the search
                _end(pid, fd)
            flag.close()
    for index, result in done:
        results[index] = result
    return results, finished


class Beside:
    """A job started by `beside`: ``result()`` waits for it and returns what it returned (or raises what it raised);
    ``cancel()`` ends it unfinished. One of the two must be called."""

    def __init__(self, job: Callable[[], R]) -> None:
        self._job: Callable[[], R] | None = job
        self._child: tuple[int, int] | None = None
        self._flag: mmap.mmap | None = None

    def result(self) -> R:
        if self._child is None:  # not forked: done here, now
            job, self._job = self._job, None
            if job is None:
                raise RuntimeError("this job's result was already taken")
            return job()
        (pid, fd), self._child = self._child, None
        try:
            return _collect(pid, fd, self._flag, lambda: False)
        finally:
            self._flag.close()

    def cancel(self) -> None:
        self._job = None
        if self._child is None:
            return
        (pid, fd), self._child = self._child, None
        _end(pid, fd)
        self._flag.close()


def _end(pid: int, fd: int) -> None:
    """Kill a worker unfinished, reap it and close its pipe."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    os.close(fd)


def beside(job: Callable[[], R]) -> Beside:
    """``job()`` started in a forked process while this one goes on, where `share_out` would fork (more than one
    core, no other thread); else it runs here when its result is asked for. Its result comes back pickled. Used to
    do work that is likely, though not certain, to be needed (checking the plan most likely to be chosen while the
    finalists are simulated): the caller takes the result where it turns out to apply and cancels it otherwise."""
    handle = Beside(job)
    if default_workers() < 2 or _other_threads():
        return handle
    handle._flag = mmap.mmap(-1, 1)
    handle._child = _fork(lambda _stop: job(), handle._flag, lambda: False)
    handle._job = None
    return handle


def _other_threads() -> list[str]:
    """The names of this process's other live threads (torch.compile leaves a ``tqdm_monitor``, say)."""
    return [t.name for t in threading.enumerate() if t is not threading.current_thread()]


def _fork(job: Callable[[Stop], Any], flag: mmap.mmap, should_stop: Stop) -> tuple[int, int]:
    global _WORKER
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    # the worker: never returns into the caller's code
    _WORKER = True
    status = 0
    torch = sys.modules.get("torch")
    if torch is not None:
        # one thread: the OpenMP pool of a parent that ran a parallel op does not survive the fork, and the child's
        # first parallel op (filling a tensor of 64k elements, say) would wait for its threads forever
        torch.set_num_threads(1)
    try:
        os.close(read)
        try:
            outcome: tuple[str, Any] = ("ok", job(lambda: flag[0] == 1 or should_stop()))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller, which raises it
            outcome = ("error", _portable(exc))
        data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(write, "wb") as pipe:
            pipe.write(data)
    except BaseException:  # noqa: BLE001 - the pipe closes with nothing in it: the caller reports a lost worker
        status = 1
    finally:
        os._exit(status)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError carrying its traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        text = "".join(traceback.format_exception(exc)).rstrip()
        return RuntimeError(f"a search worker failed:\n{text}")


def _collect(pid: int, fd: int, flag: mmap.mmap, should_stop: Stop) -> Any:
    """The worker's result, read while passing on a stop the caller asks for."""
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                if flag[0] != 1 and should_stop():
                    flag[0] = 1
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"a search worker (process {pid}) ended without a result (wait status {status})")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "error":
        raise value
    return value
