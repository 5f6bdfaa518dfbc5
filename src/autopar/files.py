"""Reading and writing the files users name: bounded reads of regular files, atomic writes, early checks.

Every error is a ValueError that names the path the user gave (never a temporary file) and says what would be
valid. This module imports nothing from autopar, so any layer can use it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

KIB = 1024
MIB = 1024 * KIB

CLUSTER_FILE_LIMIT = 1 * MIB
PLAN_FILE_LIMIT = 64 * MIB


def _size(limit: int) -> str:
    return f"{limit // MIB} MiB" if limit >= MIB and limit % MIB == 0 else f"{limit:,} bytes"


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def read_text(path: str | os.PathLike[str], *, what: str, limit: int) -> str:
    """The UTF-8 text of ``path``, a regular file of at most ``limit`` bytes (checked before reading).

    ``what`` names the kind of file in messages ("cluster file", "plan file"). Devices, pipes and folders are
    refused before they are opened for reading, so ``/dev/zero`` or a FIFO never hangs the caller."""
    shown = os.fspath(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"{shown}: no such {what}") from None
    except OSError as exc:
        raise ValueError(f"{shown}: cannot read {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{shown}: {what} must be a regular file, got {_kind(info.st_mode)}")
    if info.st_size > limit:
        raise ValueError(f"{shown}: {what} must be at most {_size(limit)}, got {info.st_size:,} bytes")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{shown}: cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > limit:  # it grew between stat and read
        raise ValueError(f"{shown}: {what} must be at most {_size(limit)}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{shown}: {what} must be UTF-8 text, got byte 0x{data[exc.start]:02x} at offset "
                         f"{exc.start}") from None


def check_writable(path: str | os.PathLike[str], *, flag: str) -> None:
    """Refuse, before any work starts, an output path that cannot be written: empty, a folder, or in a folder that
    does not exist or is not writable. ``flag`` names the option in messages (``--out``)."""
    shown = os.fspath(path)
    if not shown:
        raise ValueError(f"{flag} must name a file, got ''")
    target = Path(shown)
    if target.is_dir():
        raise ValueError(f"{flag} {shown}: is a folder; give a file path")
    if shown.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {shown}: ends with a separator; give a file path")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {shown}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {shown}: folder {str(parent)!r} is not writable")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {shown}: exists and is not a regular file")


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write ``text`` (UTF-8) or bytes to ``path`` through a temporary file in the same folder renamed into place,
    so a reader or an interrupted write never sees half a file. Errors name ``path``, not the temporary file."""
    shown = os.fspath(path)
    target = Path(shown)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise ValueError(f"{shown}: cannot write: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, _mode_for(target))  # mkstemp makes 0600; a written file gets the usual permissions
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ValueError(f"{shown}: cannot write: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_for(target: Path) -> int:
    """The permissions of the file being replaced, or those a plain ``open`` would give (0666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask
