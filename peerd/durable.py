"""Crash-safe file replacement: a file is either its old or its new content, never torn.

Write to a temporary file in the same directory, flush and fsync it, rename it over the
final name, then fsync the directory so the rename itself survives a power cut (POSIX; on
systems whose directories cannot be opened the rename must do). Readers skip the
temporaries by their prefix; a crash between the write and the rename leaves one behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_PREFIX = ".tmp-"


def fsync_dir(directory: str | Path) -> None:
    """Make a rename in ``directory`` durable."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_file(path: str | Path, write: Callable[[BinaryIO], object], *, suffix: str = "") -> Path:
    """Replace ``path`` with what ``write(fh)`` writes, atomically and durably; the temporary is removed on error."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path
