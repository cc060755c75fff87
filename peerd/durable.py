"""Crash-safe file replacement: a file is either its old or its new content, never torn.

Write to a temporary file in the same directory, flush and fsync it, rename it over the
final name, then fsync the directory so the rename itself survives a power cut (POSIX; on
systems whose directories cannot be opened the rename must do). Readers skip the
temporaries by their prefix; a crash between the write and the rename leaves one behind,
named after the file it was for (``.tmp-<name>-<random>``), which ``remove_leftovers`` deletes
when the owner of that file starts again.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import time
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


def tmp_prefix(path: str | Path) -> str:
    """The name every temporary for ``path`` starts with (in ``path``'s directory)."""
    return f"{TMP_PREFIX}{Path(path).name}-"


def remove_leftovers(path: str | Path, *, older_than_s: float = 0.0) -> int:
    """Delete the temporaries a killed writer of ``path`` left behind; how many were deleted.

    Call it when nothing else writes ``path`` (its owner starting); ``older_than_s`` spares the
    temporaries of a writer that may still be running (another process creating the same file).
    """
    path = Path(path)
    removed, now = 0, time.time()
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f"{glob.escape(tmp_prefix(path))}*"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime >= older_than_s:
                    tmp.unlink()
                    removed += 1
    return removed


def replace_file(path: str | Path, write: Callable[[BinaryIO], object], *, suffix: str = "") -> Path:
    """Replace ``path`` with what ``write(fh)`` writes, atomically and durably; the temporary is removed on error."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path), suffix=suffix, dir=path.parent)
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
