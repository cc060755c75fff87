"""A model as an ordered list of layers, which is all pipeline partitioning needs to know of it."""

from __future__ import annotations

import torch
from torch import nn


class LayerStack(nn.Module):
    """``layers`` run in order: tokens (B, T) -> logits (B, T, V); subclasses fill ``self.layers``."""

    layers: nn.ModuleList

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        x = tokens_BT
        for layer in self.layers:
            x = layer(x)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
