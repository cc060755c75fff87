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

A few kinds of op cost more than their traffic on some devices: on a CPU the tanh GELU, the
exponentials of a softmax and the per-head set-up of a fused attention kernel run at a fraction
of the memory bandwidth (a width-32 GPT's reference pass spends more on them than on its
matmuls). ``ELEMENT_FAMILIES`` names them; the counter adds up their units (``OpCounter.elements``:
output elements, or attention heads), and ``element_seconds`` measures what one unit costs on a
device beyond its launch and its traffic, so the cost models add ``units x seconds`` to the rest.
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

ELEMENT_FAMILIES = ("gelu", "softmax", "attention", "attention_backward")
"""Ops that cost more than their traffic on some devices, by the unit they are counted in:
``gelu`` the tanh GELU and its backward (output elements), ``softmax`` softmax, log-softmax and
exp forwards (output elements), ``attention`` and ``attention_backward`` a fused scaled-dot-product
attention kernel (heads: batch x heads of its query)."""

_SOFTMAX_OPS = {"_softmax", "_log_softmax", "exp"}


def element_family(func: Any, args: Any, kwargs: Any, out: Any) -> tuple[str, int] | None:
    """(family, units) of one dispatched op, or None when its launch and traffic price it."""
    name = func.overloadpacket.__name__
    if name.startswith("_scaled_dot_product") and isinstance(args[0], torch.Tensor):
        heads = args[0].numel() // max(1, args[0].shape[-1] * args[0].shape[-2])
        return ("attention_backward" if "backward" in name else "attention"), heads
    first = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(first, torch.Tensor):
        return None
    if name in ("gelu", "gelu_backward") and (kwargs or {}).get("approximate", "none") == "tanh":
        return "gelu", first.numel()
    if name in _SOFTMAX_OPS:
        return "softmax", first.numel()
    return None


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, the bytes they read and write and the units of the
    ``ELEMENT_FAMILIES`` ops (``with OpCounter() as c: ...; c.ops, c.bytes, c.elements``); tensors
    sharing storage with one of ``exclude`` count no bytes."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.elements = dict.fromkeys(ELEMENT_FAMILIES, 0)
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        family = element_family(func, args, kwargs, out)
        if family is not None:
            self.elements[family[0]] += family[1]
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
    return _seconds_per_call(step, dev, budget_s, windows) / ops


def _seconds_per_call(
    fn: Callable[[], object], dev: torch.device, budget_s: float, windows: int = 5
) -> float:
    """Median seconds per ``fn()`` call over ``windows`` timed windows of about ``budget_s`` in all."""
    fn()  # warm-up (again)
    _synchronize(dev)
    start = time.perf_counter()
    fn()
    _synchronize(dev)
    reps = max(1, int(budget_s / windows / max(time.perf_counter() - start, 1e-7)))
    per_call = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _synchronize(dev)
        per_call.append((time.perf_counter() - start) / reps)
    return statistics.median(per_call)


def _family_workloads(dev: torch.device) -> dict[str, Callable[[], object]]:
    """One workload per family (in ``ELEMENT_FAMILIES`` order, each using only families before it
    besides its own), shaped like a small GPT's: 2^18 activations, rows of 256 logits, 256 heads of
    8 tokens x 16 dims."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=gen).to(dev).requires_grad_(True)
    grad = torch.randn(1 << 18, generator=gen).to(dev)
    logits = torch.randn(1024, 256, generator=gen).to(dev)
    q = torch.randn(128, 2, 8, 16, generator=gen).to(dev).requires_grad_(True)

    def gelu() -> object:
        return torch.autograd.grad(F.gelu(x, approximate="tanh"), x, grad)

    def softmax() -> object:
        return F.log_softmax(logits, dim=-1), torch.softmax(logits, dim=-1), logits.exp()

    def attention() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def attention_backward() -> object:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return torch.autograd.grad(out, q, torch.ones_like(out))

    return {
        "gelu": gelu,
        "softmax": softmax,
        "attention": attention,
        "attention_backward": attention_backward,
    }


def element_seconds(
    dev: torch.device, launch_s: float, memory_bytes_per_s: float, *, budget_s: float = 0.4
) -> dict[str, float]:
    """Seconds per unit of each of ``ELEMENT_FAMILIES`` on ``dev`` beyond what its ops' launches
    (``launch_s`` each) and traffic (at ``memory_bytes_per_s``) already price: each family's
    workload timed, minus those, minus the units of the families measured before it, over its own
    units; 0 where the rest prices it fully (a GPU's bandwidth-bound GELU)."""
    found: dict[str, float] = {}
    for family, fn in _family_workloads(dev).items():
        with OpCounter() as counter:
            fn()
        seconds = _seconds_per_call(fn, dev, budget_s / len(ELEMENT_FAMILIES))
        seconds -= counter.ops * launch_s + counter.bytes / memory_bytes_per_s
        seconds -= sum(counter.elements[f] * s for f, s in found.items())
        found[family] = max(0.0, seconds / counter.elements[family])
    return found
