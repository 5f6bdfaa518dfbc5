"""Files the commands write: an output path checked before any work, and written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def output_path(text: str, *, flag: str = "--out") -> Path:
    """``text`` as a file the command can write, checked before the command does any work: not empty, not a
    directory, in an existing folder this user may write to. Errors name the path as the user gave it."""
    if not text.strip():
        raise ValueError(f"{flag} is empty; give a file path")
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"{flag} {text} is a directory; give a file path")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {text}: folder {folder} is not writable")
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place, so that an interrupted write
    never leaves half a file. A device or pipe (``/dev/null``) is written in place."""
    target = path.resolve() if path.is_symlink() else path
    try:
        if target.exists() and not target.is_file():
            target.write_text(text)
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None
