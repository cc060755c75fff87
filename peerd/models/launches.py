"""Counting the device ops (kernel launches) a piece of torch code dispatches, and timing one.

A model too small to fill its device runs at the cost of dispatching its ops, not of their
arithmetic: each op pays the framework's Python-to-kernel path and, on a GPU, a launch. The cost
models price that as ``ops x seconds per op``: ``count_ops`` counts the ops of real code (every
ATen op that reaches a backend kernel, autograd's backward ops included), and ``launch_seconds``
measures the seconds per op of a toy-width GPT's training steps on a device.

Beyond its launch, an op that is not a matmul's arithmetic costs the memory traffic of its tensors
(a softmax over a batch's logits, a layer norm, an optimizer's update of the moments): the
counter also adds up the bytes each op reads and writes (``OpCounter.bytes``: its tensor inputs
and outputs; a view moves none), leaving out the tensors of ``exclude`` (a model's weights, whose
reads the cost models price with the matmuls' arithmetic).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from peerd.models.gpt import GPT, GPTConfig


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active and the bytes they read and write
    (``with OpCounter() as c: ...; c.ops, c.bytes``); tensors sharing storage with one of
    ``exclude`` count no bytes."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not getattr(func, "is_view", False):  # a view aliases its input: nothing is read or written
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._excluded:
                    self.bytes += t.numel() * t.element_size()
        return out


def count_ops(fn: Callable[[], object]) -> int:
    """Ops ``fn()`` dispatches (run once, for real, under the counter)."""
    with OpCounter() as counter:
        fn()
    return counter.ops


def _synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def launch_seconds(dev: torch.device, *, budget_s: float = 0.3, windows: int = 5) -> float:
    """Median seconds per dispatched op of training steps of a toy-width built-in GPT on ``dev``.

    Forward, loss, backward and an AdamW step at width 16, so every op's arithmetic is negligible
    and what is timed is the path each op takes: module calls, autograd, the optimizer's loop.
    Timed without the counter (which adds its own overhead), counted once with it.
    """
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=256, max_seq_len=16)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens_BT = torch.randint(0, 256, (4, 8), device=dev)

    def step() -> None:
        loss = F.cross_entropy(model(tokens_BT).flatten(0, 1), tokens_BT.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()  # warm-up: allocator, kernel selection, the optimizer's state
    ops = count_ops(step)
    _synchronize(dev)
    start = time.perf_counter()
    step()
    _synchronize(dev)
    reps = max(1, int(budget_s / windows / max(time.perf_counter() - start, 1e-7)))
    per_op = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(reps):
            step()
        _synchronize(dev)
        per_op.append((time.perf_counter() - start) / (reps * ops))
    return statistics.median(per_op)
