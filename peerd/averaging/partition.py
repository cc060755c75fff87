"""Pure layout helpers for the group all-reduce: flatten a gradient list, cut it into one share per member.

A gradient list (one tensor per parameter, any shapes) is averaged as one flat float32
vector of ``numel`` elements. Member ``r`` of a group of ``D`` reduces the contiguous share
``[floor(r·numel/D), floor((r+1)·numel/D))``: shares differ by at most one element, every
member computes the same cut from ``numel`` and ``D`` alone, and each member sends and
receives ``(D−1)/D`` of the vector twice (reduce-scatter, then all-gather) — the cost
model's dp term (scheduler.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peerd.errors import ConfigError


@dataclass(frozen=True)
class FlatLayout:
    """Shapes of the tensors in one gradient list, in list order."""

    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        out = []
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            out.append(n)
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def signature(self) -> str:
        """16 hex digits naming the shapes; members compare it to catch differing parameter lists."""
        text = ";".join(",".join(str(d) for d in s) for s in self.shapes)
        return hashlib.sha256(f"peerd-avg-layout-v1|{text}".encode()).hexdigest()[:16]


def layout_of(tensors: Sequence[torch.Tensor]) -> FlatLayout:
    if not tensors:
        raise ConfigError("tensors", "nothing to average: the gradient list is empty")
    for i, t in enumerate(tensors):
        if not t.dtype.is_floating_point:
            raise ConfigError(f"tensors[{i}]", f"gradients must be floating point, got {t.dtype}")
    return FlatLayout(tuple(tuple(int(d) for d in t.shape) for t in tensors))


def share_bounds(numel: int, members: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every member's share, in rank order; they tile ``[0, numel)``."""
    if members < 1:
        raise ConfigError("group", f"a group needs at least one member, got {members}")
    if numel < 0:
        raise ConfigError("numel", f"must be >= 0, got {numel}")
    cuts = [r * numel // members for r in range(members + 1)]
    return [(cuts[r], cuts[r + 1]) for r in range(members)]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new contiguous float32 CPU vector (numel,) holding every tensor in list order."""
    flat_N = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    offset = 0
    for t in tensors:
        n = t.numel()
        flat_N[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return flat_N


def unflatten(flat_N: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped, typed and placed like ``like``, cut from ``flat_N`` in order.

    Where no conversion is needed they are views of ``flat_N`` (no second copy of a big stage's
    gradients); pass a vector nobody else writes to.
    """
    assert flat_N.numel() == sum(t.numel() for t in like), "flat vector does not match the layout"
    out, offset = [], 0
    for t in like:
        n = t.numel()
        piece = flat_N[offset : offset + n].view(t.shape)
        out.append(piece.to(device=t.device, dtype=t.dtype))
        offset += n
    return out


def group_digest(key: str, members: Sequence[str]) -> str:
    """16 hex digits naming (averaging key, ordered member ids): equal on members that agree on the group."""
    text = "\x00".join([key, *members])
    return hashlib.sha256(f"peerd-avg-group-v1|{text}".encode()).hexdigest()[:16]
