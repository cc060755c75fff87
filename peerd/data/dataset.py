"""Fixed-length training windows over a token stream, each with a stable integer example id.

Example ``i`` is the ``seq_len + 1`` tokens starting at offset ``i * stride``; its id is ``i``.
Inputs are the first ``seq_len`` tokens, targets the last ``seq_len`` (shifted by one). The id is
what AC-SGD keys its per-example activation buffers by and what the last pipeline stage uses to
look up labels, so it must mean the same window on every peer: same corpus digest, same
``seq_len`` and ``stride`` give the same windows.

With ``held_out`` windows (the validation split, ``peerd.data.validation``) the last
``held_out`` windows keep their ids but are no training examples: ``len()`` counts only the
training windows ``0 .. len - 1``, which end before the first held-out window starts (the
windows in between, which would share bytes with both, belong to neither).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from peerd.data.sources import Corpus
from peerd.errors import ConfigError, ErrorCode, ProtocolError


class WindowDataset:
    """Windows of ``seq_len + 1`` tokens at offsets ``i * stride`` (stride defaults to ``seq_len``)."""

    def __init__(self, corpus: Corpus, seq_len: int, stride: int | None = None, held_out: int = 0) -> None:
        if seq_len < 1:
            raise ConfigError("data.seq_len", f"must be >= 1, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise ConfigError("data.stride", f"must be >= 1, got {stride}")
        n = (len(corpus) - seq_len - 1) // stride + 1 if len(corpus) > seq_len else 0
        if n < 1:
            raise ConfigError(
                "data.seq_len",
                f"corpus {corpus.name} has {len(corpus)} tokens, too few for seq_len={seq_len}",
            )
        if held_out < 0:
            raise ConfigError("data.validation.windows", f"must be >= 0, got {held_out}")
        first_held = n - held_out
        # training window i ends at byte i * stride + seq_len, before the first held-out one starts
        train = first_held - -(-(seq_len + 1) // stride) + 1 if held_out else n
        if train < 1:
            raise ConfigError(
                "data.validation",
                f"holding out {held_out} of the {n} windows of corpus {corpus.name} leaves none to train on",
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.stride = stride
        self.held_out = held_out
        self._n = train
        self._all = n

    def __len__(self) -> int:
        return self._n

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    @property
    def digest(self) -> str:
        """Identifies the windows: corpus bytes plus the windowing (and the split, when there is one)."""
        split = f":v{self.held_out}" if self.held_out else ""
        return f"{self.corpus.digest}:{self.seq_len}:{self.stride}{split}"

    def held_out_ids(self) -> range:
        """The ids of the held-out windows, ascending (empty without a validation split)."""
        return range(self._all - self.held_out, self._all)

    def check_ids(self, ids: Sequence[int]) -> None:
        """Reject ids that name no example (e.g. from a remote frame) with ``UNKNOWN_EXAMPLE``."""
        held = self.held_out_ids()
        for i in ids:
            if not isinstance(i, int | np.integer) or not (0 <= int(i) < self._n or int(i) in held):
                where = f"0..{self._n - 1}" + (f" and {held.start}..{held.stop - 1}" if held else "")
                raise ProtocolError(f"example id {i!r} outside {where}", code=ErrorCode.UNKNOWN_EXAMPLE)

    def window(self, idx: int) -> np.ndarray:
        """(seq_len + 1,) uint8 tokens of example ``idx``."""
        self.check_ids([idx])
        start = int(idx) * self.stride
        return self.corpus.tokens[start : start + self.seq_len + 1]

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.from_numpy(self.window(idx).astype(np.int64))

    def batch(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (B, T) and targets (B, T) as int64 for the examples ``ids``, in that order."""
        self.check_ids(ids)
        if not len(ids):
            raise ConfigError("ids", "a batch needs at least one example id")
        offsets_B1 = np.asarray(ids, dtype=np.int64)[:, None] * self.stride
        windows_BW = self.corpus.tokens[offsets_B1 + np.arange(self.seq_len + 1)[None, :]].astype(np.int64)
        t = torch.from_numpy(windows_BW)
        return t[:, :-1], t[:, 1:]

    def inputs(self, ids: Sequence[int]) -> torch.Tensor:
        return self.batch(ids)[0]

    def targets(self, ids: Sequence[int]) -> torch.Tensor:
        return self.batch(ids)[1]
