"""Model families behind one interface, so a stage worker builds its layers without knowing which model it trains.

A ``ModelFamily`` is a model shape plus an init seed: its ``num_layers`` splittable layers
(embedding + blocks + head, the ``LayerStack`` order), ``build_layer(i)`` building layer ``i``
alone with the weights every peer agrees on, the training ``loss``, and ``hidden`` (the width of
the activations between layers, which the pipeline streams).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from peerd.models.gpt import GPTConfig, build_layer, lm_loss


class ModelFamily(ABC):
    """One model's layers, loss and shape; every peer that builds layer ``i`` gets identical weights."""

    name: str

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Length of the splittable layer list: embedding + blocks + head."""

    @property
    @abstractmethod
    def hidden(self) -> int:
        """Width of the hidden states passed between layers (B, T, hidden)."""

    @abstractmethod
    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index`` alone (0 = embedding, ``num_layers - 1`` = head)."""

    def loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy (every family here is a causal LM)."""
        return lm_loss(logits_BTV, targets_BT)


class GPTFamily(ModelFamily):
    """The built-in GPT (``peerd.models.gpt``): each layer is built and initialised on its own."""

    name = "gpt"

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        cfg.validate()
        self.cfg, self.seed = cfg, seed

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def hidden(self) -> int:
        return self.cfg.d_model

    def build_layer(self, index: int) -> nn.Module:
        return build_layer(self.cfg, index, self.seed)
