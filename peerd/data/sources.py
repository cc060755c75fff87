"""Byte-level text sources: the built-in corpus (Python's own stdlib), local text files, HF ``datasets``.

Every source yields a ``Corpus``: one flat uint8 array of byte tokens (vocabulary 256) plus a
SHA-256 digest of those bytes. Peers that must agree on the data (stage 0 reads inputs, the last
stage reads labels by example id) compare digests instead of trusting that their files match.

Built-in corpus: the text that every Python installation already has, so a demo needs no download.
Selection, in this order, until ``max_bytes`` is reached (the last file is cut):

1. ``LICENSE.txt`` from the stdlib directory (``sysconfig.get_paths()["stdlib"]``), if present;
2. every ``*.py`` file below that directory, walked in sorted order of its relative POSIX path,
   skipping the directories ``site-packages``, ``test``, ``tests``, ``idle_test``, ``__pycache__``.

Files are joined with one ``\\n``. The result depends on the Python version (different stdlibs),
hence the digest: two peers on different Pythons see different digests and must not share a job.

Local text (``source: text``): ``paths`` lists files, directories and glob patterns, read in the
given order. A glob expands to its matches in sorted order; a directory to every regular file
below it, in sorted order of the path relative to it (POSIX separators), skipping hidden names
(starting with ``.``) at any depth. The bytes are the tokens (no decoding), files joined with
one ``\\n``, so example ``i`` is the same window wherever the same files are read. Every peer
reads its own copy at the same path (there is no file transfer; ``peerd submit`` pins the
digest of the submitter's copy, so a peer whose copy differs fails instead of training on
other bytes: ``peerd.data.config.pin_local_source``).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peerd.errors import ConfigError
from peerd.log import get_logger

log = get_logger(__name__)

DEFAULT_MAX_BYTES = 4 * 1024 * 1024  # 4 MiB: ~32k windows of 128 bytes, plenty for the small demos
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
_SEPARATOR = b"\n"


@dataclass(frozen=True)
class Corpus:
    """A flat byte-token stream and where it came from."""

    name: str
    tokens: np.ndarray  # (N,) uint8, read-only
    digest: str  # sha256 hex of the bytes

    @property
    def vocab_size(self) -> int:
        return 256

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def corpus_from_bytes(name: str, data: bytes) -> Corpus:
    tokens = np.frombuffer(data, dtype=np.uint8)  # frombuffer over bytes is already read-only
    return Corpus(name=name, tokens=tokens, digest=hashlib.sha256(data).hexdigest())


def _check_cap(max_bytes: int) -> None:
    if max_bytes < 1:
        raise ConfigError("data.max_bytes", f"must be >= 1, got {max_bytes}")


def _concat_capped(chunks: list[bytes], max_bytes: int) -> bytes:
    out = bytearray()
    for chunk in chunks:
        if out:
            out += _SEPARATOR
        out += chunk
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def builtin_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    """The built-in corpus's files in corpus order (see the module docstring)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    if (root / "LICENSE.txt").is_file():
        files.append(root / "LICENSE.txt")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fname in filenames:
            if fname.endswith(".py"):
                path = Path(dirpath) / fname
                found.append((path.relative_to(root).as_posix(), path))
    files.extend(path for _, path in sorted(found))
    return files


@functools.lru_cache(maxsize=4)
def builtin_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The built-in byte corpus made from this interpreter's stdlib, capped at ``max_bytes``."""
    _check_cap(max_bytes)
    chunks: list[bytes] = []
    total = 0
    for path in builtin_files():
        try:
            data = path.read_bytes()
        except OSError as exc:  # an unreadable stdlib file is skipped, not fatal, but said
            log.warning("builtin corpus: skipping %s: %s", path, exc)
            continue
        chunks.append(data)
        total += len(data) + len(_SEPARATOR)
        if total >= max_bytes:
            break
    if not chunks:
        raise ConfigError("data.source", "no stdlib text found for the built-in corpus")
    return corpus_from_bytes(
        f"builtin:python{sysconfig.get_python_version()}", _concat_capped(chunks, max_bytes)
    )


def directory_files(root: Path) -> Iterator[Path]:
    """Every regular file below ``root`` in sorted order of its relative POSIX path, hidden names
    skipped, symlinked directories not entered; lazily, so a capped corpus stops early in a big tree."""
    entries = []
    with os.scandir(root) as it:
        for entry in it:
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                entries.append((entry.name + "/", Path(entry.path), True))  # "a/x" sorts as its path does
            elif entry.is_file():
                entries.append((entry.name, Path(entry.path), False))
    for _, path, is_dir in sorted(entries):
        if is_dir:
            yield from directory_files(path)
        else:
            yield path


def _files_of(i: int, entry: str) -> Iterator[Path]:
    """The files one ``data.paths`` entry names, in corpus order (see the module docstring)."""
    where = f"data.paths[{i}]"
    matches = [Path(m) for m in sorted(glob.glob(entry))] if glob.has_magic(entry) else [Path(entry)]
    if not matches:
        raise ConfigError(where, f"no file matches {entry!r}")
    for match in matches:
        try:
            if not match.is_dir():
                yield match
                continue
            found = False
            for path in directory_files(match):
                found = True
                yield path
        except OSError as exc:  # an unlistable directory, a name the OS refuses: the spec's error
            raise ConfigError(where, f"cannot read {match}: {exc.strerror or exc}") from None
        if not found:
            raise ConfigError(where, f"directory {match} holds no files")


def text_files_corpus(paths: list[str], max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Local text files, directories and glob patterns, read as bytes in the given order (module docstring)."""
    _check_cap(max_bytes)
    if not paths:
        raise ConfigError("data.paths", "at least one file, directory or glob pattern is required")
    chunks: list[bytes] = []
    total = 0
    for i, entry in enumerate(paths):
        for match in _files_of(i, entry):
            try:
                data = Path(match).read_bytes()
            except OSError as exc:
                why = (
                    "no such file or directory" if isinstance(exc, FileNotFoundError) else exc.strerror or exc
                )
                raise ConfigError(f"data.paths[{i}]", f"cannot read {match}: {why}") from None
            chunks.append(data)
            total += len(data) + len(_SEPARATOR)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    data = _concat_capped(chunks, max_bytes)
    if not data:
        raise ConfigError("data.paths", "the files are empty")
    return corpus_from_bytes("text:" + ",".join(paths), data)


def hf_corpus(
    name: str,
    *,
    split: str = "train",
    text_field: str = "text",
    config_name: str | None = None,
    data_files: list[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Corpus:
    """Rows of a Hugging Face ``datasets`` split, field ``text_field`` UTF-8 encoded, in row order.

    ``name`` is a hub id or a builder such as ``"text"`` / ``"json"`` used with ``data_files``.
    Needs the optional ``datasets`` package; offline use works with local ``data_files``.
    """
    _check_cap(max_bytes)
    try:
        import datasets  # optional extra, imported only when this source is used
    except ImportError:
        raise ConfigError(
            "data.source", "source 'hf' needs the 'datasets' package (pip install datasets)"
        ) from None
    try:
        ds = datasets.load_dataset(name, config_name, split=split, data_files=data_files)
    except Exception as exc:  # datasets raises many unrelated types for a bad name/split/file
        raise ConfigError("data.hf_name", f"cannot load dataset {name!r} split {split!r}: {exc}") from None
    if text_field not in ds.column_names:
        raise ConfigError("data.text_field", f"{text_field!r} not in columns {ds.column_names}")
    chunks: list[bytes] = []
    total = 0
    for row in ds:
        text = row[text_field]
        if not isinstance(text, str) or not text:
            continue
        data = text.encode("utf-8")
        chunks.append(data)
        total += len(data) + len(_SEPARATOR)
        if total >= max_bytes:
            break
    data = _concat_capped(chunks, max_bytes)
    if not data:
        raise ConfigError("data.hf_name", f"dataset {name!r} has no text in field {text_field!r}")
    return corpus_from_bytes(f"hf:{name}/{split}", data)
