"""Compute precision of a stage: autocast, the fp16 loss scale, and the check that the device can do it.

``fp32`` runs as plain torch (no autocast context at all, so fp32 runs are bit-for-bit what
they were). ``bf16`` / ``fp16`` run the forward pass (and the loss) under ``torch.autocast``:
matmuls in the low precision, reductions and the master weights in fp32; gradients of the
fp32 parameters are fp32 and the optimizer state stays fp32. What a stage sends is cast back
to float32 (the wire format's dtype), so the next stage's input and the reference executor's
(``peerd.pipeline.local``) agree. ``fp16`` adds torch's dynamic loss scale
(``torch.amp.GradScaler``): the loss is scaled before backward, gradients are unscaled before
clipping, and a step whose gradients overflowed is skipped and the scale lowered.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from peerd.errors import ConfigError

# fp16's loss scaling skips a step whose gradients overflowed: every stage and replica must skip
# the same steps, and the pipeline's wire protocol carries no such verdict (bf16 needs no scale).
FP16_PIPELINE = (
    "fp16 (loss-scaled) trains a single stage with one replica only: stages and replicas would "
    "have to agree on every overflowed step; use bf16, or parallel d_pp: 1 and d_dp: 1"
)
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


class StagePrecision:
    """How one stage (or the reference executor) runs its forward pass and takes its optimizer step."""

    def __init__(self, precision: str, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        check_precision(precision, self.device)
        self.name = precision
        self.dtype = DTYPES[precision]
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context forward passes (and the loss) run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (scaled under fp16)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the parameters' gradients by the loss scale (before clipping or averaging them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` (fp16: unless the gradients overflowed; then the scale is updated). Whether it stepped."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before  # a skipped step lowers the scale

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
