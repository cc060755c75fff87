"""Compute precision of a stage: autocast, the fp16 loss scale, and the check that the device can do it.

``fp32`` runs as plain torch (no autocast context at all, so fp32 runs are bit-for-bit what
they were). ``bf16`` / ``fp16`` run the forward pass (and the loss) under ``torch.autocast``:
matmuls in the low precision, reductions and the master weights in fp32; gradients of the
fp32 parameters are fp32 and the optimizer state stays fp32. What a stage sends is cast back
to float32 (the wire format's dtype), so the next stage's input and the reference executor's
(``peerd.pipeline.local``) agree. ``fp16`` adds a dynamic loss scale (``LossScale``, the
arithmetic of torch's ``GradScaler`` with its defaults): the loss is scaled before backward,
gradients are unscaled before clipping, and a step whose gradients overflowed is skipped and
the scale lowered. torch's scaler decides the skip from the gradients it holds; a pipeline's
stages and a stage's replicas must skip the *same* steps, so here the caller decides: a
stage's replicas share their overflow flags through the gradient averaging (``overflow`` in
protocols/averaging.md), the stages share one verdict through the norm exchange
(``peerd.pipeline.optim``), and each stage passes it to ``StagePrecision.step``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from peerd.errors import ConfigError

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> None:
    """ConfigError naming ``precision`` unless torch can autocast to it on ``device`` (a tiny probe runs)."""
    if precision not in DTYPES:
        raise ConfigError("precision", f"{precision!r}: expected one of {', '.join(DTYPES)}")
    dtype = DTYPES[precision]
    if dtype is None:
        return
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError("precision", f"{precision}: torch has no autocast on {device.type}")
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", f"bf16: {torch.cuda.get_device_name(device)} has no bf16 support")
    try:  # forward and backward of a matmul: what every stage does
        w = torch.ones(8, 8, device=device, requires_grad=True)
        with torch.autocast(device.type, dtype=dtype):
            y = w @ torch.ones(8, 8, device=device)
        y.float().sum().backward()
        ok = y.dtype == dtype and w.grad is not None and bool(torch.isfinite(w.grad).all())
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("precision", f"{precision} on {device}: torch cannot autocast: {exc}") from None
    if not ok:
        raise ConfigError("precision", f"{precision} on {device}: autocast does not compute in {dtype}")


class LossScale:
    """fp16's dynamic loss scale: torch ``GradScaler``'s arithmetic, with the skip decided by the caller.

    The scale starts at 2**16; a step whose gradients overflowed halves it, 2000 steps in a row
    without overflow double it. Scales are powers of two, so scaling and unscaling are exact.
    """

    INITIAL = 2.0**16
    GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2000

    def __init__(self, initial: float | None = None) -> None:
        self.value = float(initial if initial is not None else self.INITIAL)
        self.growth_tracker = 0  # steps in a row without overflow since the last change

    def unscale(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale, in place; whether all of them are finite."""
        inverse = 1.0 / self.value
        finite = True
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inverse)
                finite = finite and bool(torch.isfinite(p.grad).all())
        return finite

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.value *= self.BACKOFF
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.INTERVAL:
            grown = self.value * self.GROWTH
            if grown != float("inf"):
                self.value = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """The keys of torch's ``GradScaler.state_dict`` (checkpoints written by it load here)."""
        return {
            "scale": self.value,
            "growth_factor": self.GROWTH,
            "backoff_factor": self.BACKOFF,
            "growth_interval": self.INTERVAL,
            "_growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["scale"])
        self.growth_tracker = int(state.get("_growth_tracker", 0))


class StagePrecision:
    """How one stage (or the reference executor) runs its forward pass and takes its optimizer step."""

    def __init__(self, precision: str, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        check_precision(precision, self.device)
        self.name = precision
        self.dtype = DTYPES[precision]
        self.loss_scale = LossScale() if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context forward passes (and the loss) run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (scaled under fp16)."""
        return loss if self.loss_scale is None else loss * self.loss_scale.value

    def unscale(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the loss scale (fp16; before clipping or averaging). Whether all are finite."""
        return True if self.loss_scale is None else self.loss_scale.unscale(params)

    def step(self, optimizer: torch.optim.Optimizer, overflowed: bool = False) -> bool:
        """Step ``optimizer`` unless ``overflowed`` (fp16 only: then the scale is lowered). Whether it stepped."""
        if self.loss_scale is None:
            optimizer.step()
            return True
        if not overflowed:
            optimizer.step()
        self.loss_scale.update(overflowed)
        return not overflowed

    @staticmethod
    def step_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Advance the LR schedule; a step that overflow skipped still counts (as with torch's scaler),
        so torch's warning about a schedule stepping ahead of its optimizer is expected there."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            scheduler.step()

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.loss_scale is None else self.loss_scale.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.loss_scale is not None and state:
            self.loss_scale.load_state_dict(state)
