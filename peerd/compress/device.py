"""Where tensors live: host copies for the wire (pinned, non-blocking on CUDA) and pinned host allocation.

Compute, codecs and AC-SGD buffers stay on the stage's device; a tensor leaves it only to be
put on the wire (or into a checkpoint). On CUDA the copy goes into page-locked memory with
``non_blocking=True`` and the caller waits on an event recorded right after it, which waits
for that copy only (not for work queued later on other streams). Pinned blocks come from
torch's caching host allocator, so a copy per message costs no ``cudaHostAlloc`` once warm,
and a block returns to the cache when the last view of it (e.g. a payload memoryview) dies.
"""

from __future__ import annotations

from typing import Any

import torch


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor, page-locked when ``device`` is a CUDA device (fast, asynchronous copies to/from it)."""
    pin = device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: itself when already there, else a (pinned, on CUDA) copy, complete on return.

    Blocks the calling thread (a compute thread, never the event loop) until the copy has landed.
    """
    if t.device.type == "cpu":
        return t
    if t.device.type != "cuda":
        return t.detach().cpu()
    out = pinned_empty(tuple(t.shape), t.dtype, t.device)
    with torch.cuda.device(t.device):
        out.copy_(t.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return out


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor moved to host memory (nested dicts, lists, tuples; the rest as is).

    Host tensors are returned as they are (no copy): callers that need a snapshot detached from
    live state copy themselves.
    """
    if isinstance(obj, torch.Tensor):
        return to_host(obj)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(host_copy(v) for v in obj)
    return obj
