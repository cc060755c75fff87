"""Per-example AC-SGD buffers m(id) of one boundary side: device memory, then host RAM, then memory-mapped spill files.

Buffers are rows of fixed-shape chunks (``chunk_examples`` examples each): on a GPU (or MPS)
stage, chunks in the stage's device memory until ``device_budget_mb`` is used; then host RAM
chunks until ``ram_budget_mb`` (page-locked when the device is CUDA, so the codec's copies to
and from them are DMA transfers); then chunks backed by files in ``spill_dir`` (a
``torch.from_file`` shared mapping: the OS pages them in and out). A CPU stage has no device
tier: its RAM chunks are the first tier. Rows freed by
invalidation are reused. The store may keep rows at reduced precision (float16 / bfloat16);
the delta codec reads them as float32 and writes its update back, rounding identically on
both sides. ``state_dict`` / ``load_state_dict`` carry the buffered rows (stored precision,
spilled rows included), their example ids and visit counts through a checkpoint, so both
sides of a boundary resume bit-identical.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

import torch

from peerd.compress.device import pinned_empty, to_host
from peerd.compress.wire import DTYPE_NAMES
from peerd.errors import CodecError, ConfigError, ErrorCode
from peerd.log import get_logger

log = get_logger(__name__)

_MB = 1 << 20
STATE_FORMAT = 1


@dataclass
class BufferConfig:
    """Where and how the per-example buffers of one boundary side are kept."""

    device: str = "cpu"
    """The stage's device (``cpu``, ``cuda:N``, ``mps``): the first tier, and where the codec computes."""
    device_budget_mb: float = 1024.0
    """Device memory for buffers when ``device`` is not the CPU; beyond it new buffers go to host RAM."""
    ram_budget_mb: float = 1024.0
    """Host RAM for buffers; beyond it new buffers go to memory-mapped files."""
    disk_budget_mb: float | None = None
    """Spill-file space; None: unbounded. When both budgets are full new examples are not buffered."""
    total_budget_mb: float | None = None
    """All tiers together (device, RAM and spill files); None: only the tiers' own budgets bound
    them. It counts examples, not where they sit, so the two sides of a boundary given the same
    value agree on which examples are buffered even when one has a device tier and the other
    not; beyond it new examples travel unbuffered."""
    spill_dir: str | None = None
    """Directory for spill files (default: a fresh temporary directory, removed on close)."""
    storage: Literal["float32", "float16", "bfloat16"] = "float32"
    """Precision of the stored buffers (16-bit halves their size; the update is still exact-rounded)."""
    chunk_examples: int = 64
    """Examples per allocation chunk (one RAM tensor or one spill file)."""

    def validate(self) -> None:
        if self.ram_budget_mb < 0:
            raise ConfigError("ram_budget_mb", "must be >= 0")
        if self.device_budget_mb < 0:
            raise ConfigError("device_budget_mb", "must be >= 0")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError("device", f"{self.device!r} is not a torch device: {exc}") from None
        for name in ("disk_budget_mb", "total_budget_mb"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0")
        if self.chunk_examples < 1:
            raise ConfigError("chunk_examples", "must be >= 1")


@dataclass
class BufferStats:
    examples: int
    ram_bytes: int
    disk_bytes: int
    spill_files: int
    example_bytes: int
    device_bytes: int = 0  # in the stage's device memory (GPU/MPS stages)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.ram_bytes + self.disk_bytes


@dataclass
class _Chunk:
    rows: torch.Tensor  # (n, *example_shape) in the storage dtype
    path: str | None  # spill file, None for memory (device or host RAM)

    @property
    def on_device(self) -> bool:
        return self.rows.device.type != "cpu"

    @property
    def in_ram(self) -> bool:
        return self.path is None and not self.on_device


class BufferStore:
    """Buffers m(id) for the examples that crossed one boundary; also counts each example's visits."""

    def __init__(self, cfg: BufferConfig | None = None) -> None:
        self.cfg = cfg or BufferConfig()
        self.cfg.validate()
        self.dtype = DTYPE_NAMES[self.cfg.storage]
        self.device = torch.device(self.cfg.device)
        self.example_shape: tuple[int, ...] | None = None
        self._chunks: list[_Chunk] = []
        self._slot: dict[int, tuple[int, int]] = {}  # example id -> (chunk, row)
        self._free: list[tuple[int, int]] = []
        self._visits: dict[int, int] = {}
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    # -- queries --------------------------------------------------------------------------
    def __contains__(self, example_id: int) -> bool:
        return example_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def ids(self) -> list[int]:
        """Ids of the buffered examples."""
        return list(self._slot)

    def visits(self, example_id: int) -> int:
        return self._visits.get(example_id, 0)

    def count_visit(self, example_id: int) -> None:
        self._visits[example_id] = self._visits.get(example_id, 0) + 1

    def get(self, example_id: int) -> torch.Tensor:
        """The stored buffer (a view in the storage dtype); CodecError(UNKNOWN_EXAMPLE) if absent."""
        slot = self._slot.get(example_id)
        if slot is None:
            raise CodecError(f"no buffer for example {example_id}", code=ErrorCode.UNKNOWN_EXAMPLE)
        return self._chunks[slot[0]].rows[slot[1]]

    @property
    def example_numel(self) -> int:
        n = 1
        for d in self.example_shape or ():
            n *= d
        return n

    @property
    def example_bytes(self) -> int:
        return self.example_numel * self.dtype.itemsize

    def stats(self) -> BufferStats:
        def size(c: _Chunk) -> int:
            return c.rows.numel() * c.rows.element_size()

        dev = sum(size(c) for c in self._chunks if c.on_device)
        ram = sum(size(c) for c in self._chunks if c.in_ram)
        disk = sum(size(c) for c in self._chunks if c.path is not None)
        spills = sum(1 for c in self._chunks if c.path is not None)
        return BufferStats(len(self._slot), ram, disk, spills, self.example_bytes, device_bytes=dev)

    # -- admission ------------------------------------------------------------------------
    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Fix the per-example shape on first use; later examples must match it."""
        if self.example_shape is None:
            self.example_shape = tuple(shape)
        elif tuple(shape) != self.example_shape:
            raise CodecError(
                f"example shape {tuple(shape)} differs from the buffered {self.example_shape}",
                code=ErrorCode.SHAPE_MISMATCH,
            )

    def _capacity(self) -> tuple[int, int, int | None]:
        """Most examples in device memory (0 on a CPU stage), in host RAM, and on disk (None: unbounded)."""
        per = max(1, self.example_bytes)
        dev = 0 if self.device.type == "cpu" else int(self.cfg.device_budget_mb * _MB) // per
        ram = int(self.cfg.ram_budget_mb * _MB) // per
        disk = None if self.cfg.disk_budget_mb is None else int(self.cfg.disk_budget_mb * _MB) // per
        return dev, ram, disk

    def room(self) -> int | None:
        """How many more examples fit in the budgets (None: unbounded)."""
        dev, ram, disk = self._capacity()
        caps = [] if disk is None else [dev + ram + disk]
        if self.cfg.total_budget_mb is not None:
            caps.append(int(self.cfg.total_budget_mb * _MB) // max(1, self.example_bytes))
        return max(0, min(caps) - len(self._slot)) if caps else None

    def slot(self, example_id: int) -> torch.Tensor:
        """The buffer of ``example_id``, allocating one (contents undefined) if it has none."""
        if example_id in self._slot:
            return self.get(example_id)
        room = self.room()
        if room is not None and room < 1:
            raise CodecError(
                f"buffer budgets full ({len(self._slot)} examples): example {example_id} cannot be buffered",
                code=ErrorCode.OVERSIZED,
            )
        if not self._free:
            self._grow()
        self._slot[example_id] = self._free.pop()
        return self.get(example_id)

    def _grow(self) -> None:
        assert self.example_shape is not None, "check_shape() before allocating"
        k = self.cfg.chunk_examples
        dev_cap, ram_cap, disk_cap = self._capacity()
        dev_rows = sum(c.rows.shape[0] for c in self._chunks if c.on_device)
        ram_rows = sum(c.rows.shape[0] for c in self._chunks if c.in_ram)
        disk_rows = sum(c.rows.shape[0] for c in self._chunks if c.path is not None)
        index = len(self._chunks)
        path = None
        if dev_rows < dev_cap:
            n = min(k, dev_cap - dev_rows)
            rows = torch.empty((n, *self.example_shape), dtype=self.dtype, device=self.device)
        elif ram_rows < ram_cap:
            n = min(k, ram_cap - ram_rows)
            rows = pinned_empty((n, *self.example_shape), self.dtype, self.device)
        else:
            n = k if disk_cap is None else min(k, disk_cap - disk_rows)
            assert n > 0, "room() before allocating"
            path = self._spill_path(index)
            numel = n * self.example_numel
            with open(path, "wb") as fh:
                fh.truncate(max(1, numel) * self.dtype.itemsize)
            rows = torch.from_file(path, shared=True, size=numel, dtype=self.dtype).view(
                n, *self.example_shape
            )
            log.info("AC-SGD buffers spill to %s (%d examples so far)", path, len(self._slot))
        self._chunks.append(_Chunk(rows, path))
        self._free.extend((index, r) for r in range(n - 1, -1, -1))  # pop() hands out rows in order

    def _spill_path(self, index: int) -> str:
        directory = self.cfg.spill_dir
        if directory is None:
            if self._tmpdir is None:
                self._tmpdir = tempfile.TemporaryDirectory(prefix="peerd-acsgd-")
            directory = self._tmpdir.name
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, f"buffers-{os.getpid()}-{id(self):x}-{index}.bin")

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The buffered rows in their stored precision, their example ids and every visit count.

        Rows go out per chunk: a fully used chunk as the chunk tensor itself (RAM, or the spill
        file's mapping, which ``torch.save`` streams without a gathered copy), a partly used one
        as a copy of its used rows. Ids are uint64 (they may use the whole 64-bit range).
        Full host chunks are views of the live rows: save the state before the store changes again
        (device chunks are copied to host memory).
        """
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        for ex, (c, r) in self._slot.items():
            by_chunk.setdefault(c, []).append((r, ex))
        chunks = []
        for c, pairs in sorted(by_chunk.items()):
            pairs.sort()
            rows = self._chunks[c].rows  # (n, *example_shape)
            used = [r for r, _ in pairs]
            data = (
                rows if used == list(range(rows.shape[0])) else rows[torch.tensor(used, device=rows.device)]
            )
            data = to_host(data)  # checkpoints and peers get host tensors
            chunks.append({"ids": torch.tensor([ex for _, ex in pairs], dtype=torch.uint64), "rows": data})
        return {
            "format": STATE_FORMAT,
            "storage": self.cfg.storage,
            "example_shape": None if self.example_shape is None else list(self.example_shape),
            "chunks": chunks,
            "visit_ids": torch.tensor(list(self._visits), dtype=torch.uint64),
            "visit_counts": torch.tensor(list(self._visits.values()), dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace every buffer by those of ``state`` (from ``state_dict``, maybe of another store).

        Rows saved at another precision are converted (the same rounding on both sides of a
        boundary, so mirrored stores stay identical). CodecError(MALFORMED) for a state that
        does not hold together, ConfigError when this store's budgets cannot hold it; either
        way the store is left empty, never half loaded.
        """
        self.close()
        try:
            self._load(state)
        except Exception:
            self.close()
            raise

    def _load(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise CodecError("not an AC-SGD buffer state of a known format", code=ErrorCode.MALFORMED)
        visit_ids, counts = state["visit_ids"].tolist(), state["visit_counts"].tolist()
        if len(visit_ids) != len(counts):
            raise CodecError("buffer state: visit ids and counts differ in length", code=ErrorCode.MALFORMED)
        shape = state["example_shape"]
        chunks = state["chunks"]
        if shape is None:
            if chunks:
                raise CodecError("buffer state has rows but no example shape", code=ErrorCode.MALFORMED)
        else:
            self.check_shape(tuple(int(d) for d in shape))
            total = sum(int(c["ids"].numel()) for c in chunks)
            room = self.room()
            if room is not None and total > room:
                raise ConfigError(
                    "buffers", f"the checkpoint holds {total} buffered examples, the budgets {room}"
                )
            if state["storage"] != self.cfg.storage:
                log.warning("AC-SGD buffers saved as %s are loaded as %s", state["storage"], self.cfg.storage)
            for chunk in chunks:
                ids, rows = chunk["ids"].tolist(), chunk["rows"]
                if tuple(rows.shape) != (len(ids), *self.example_shape):  # type: ignore[misc]
                    raise CodecError(
                        f"buffer state rows {tuple(rows.shape)} for {len(ids)} examples",
                        code=ErrorCode.MALFORMED,
                    )
                for j, ex in enumerate(ids):
                    if ex in self._slot:
                        raise CodecError(f"buffer state repeats example {ex}", code=ErrorCode.MALFORMED)
                    self.slot(ex).copy_(rows[j])
        self._visits = dict(zip(visit_ids, counts, strict=True))

    # -- invalidation ---------------------------------------------------------------------
    def invalidate(self, ids: list[int] | None = None) -> None:
        """Forget buffers (all, or those of ``ids``): their next visit is a first visit again.

        Forgetting all also releases the memory and spill files and the fixed example shape
        (a re-plan may move the boundary).
        """
        if ids is None:
            self.close()
            return
        for i in ids:
            slot = self._slot.pop(i, None)
            if slot is not None:
                self._free.append(slot)
            self._visits.pop(i, None)

    def close(self) -> None:
        """Drop every buffer and delete the spill files."""
        paths = [c.path for c in self._chunks if c.path]
        self._chunks.clear()
        self._slot.clear()
        self._free.clear()
        self._visits.clear()
        self.example_shape = None
        for p in paths:
            try:
                os.remove(p)
            except OSError as exc:
                log.warning("could not remove spill file %s: %s", p, exc)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
