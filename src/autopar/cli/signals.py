"""Ctrl-C and SIGTERM on the command line: one line and status 130 / 143, whatever the moment.

While the commands are imported there is nothing to clean up, and an import cut short by KeyboardInterrupt can
fail later in its own way (a half-initialised numpy raising AttributeError): a signal then ends the process at
once. Afterwards a signal raises in the main thread (KeyboardInterrupt, `Terminated`) so that every clean-up runs
(ranks, temporary folders), and whatever exception reaches `main` after a signal is reported as that signal.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

MESSAGES = {signal.SIGINT: "autopar: interrupted", signal.SIGTERM: "autopar: terminated"}


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every clean-up runs."""


class SignalHandling:
    """Installs the handlers for SIGINT and SIGTERM while inside (main thread only) and restores the previous."""

    def __init__(self) -> None:
        self.importing = True
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalHandling:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in MESSAGES}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signum
        if self.importing:
            os.write(2, f"{MESSAGES[signum]}\n".encode())
            os._exit(128 + signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    def after(self, exc: BaseException) -> tuple[int, str] | None:
        """(exit status, line) for an exception that reached `main` after a signal, or None if no signal came."""
        if self.received is None and isinstance(exc, KeyboardInterrupt):  # raised by a handler not ours
            self.received = signal.SIGINT
        if self.received is None:
            return None
        return 128 + self.received, MESSAGES[signal.Signals(self.received)]
