"""Sampling text from a causal LM: temperature and top-k, reproducible through a seeded ``torch.Generator``.

peerd's data is byte-level (``peerd.data``: token = byte), so prompts are UTF-8 bytes and
sampling draws among the first 256 logits only; a model with a larger vocabulary (an HF
GPT-2 config keeps 50257) never produces an id that is not a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from peerd.errors import ConfigError

BYTE_VOCAB = 256


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 200
    """Tokens (bytes) to generate after the prompt."""
    temperature: float = 1.0
    """Logits are divided by it before the softmax; 0 picks the most likely token (greedy)."""
    top_k: int | None = None
    """Draw only among the ``top_k`` most likely tokens; None: among all."""
    seed: int = 0
    """Seed of the generator the draws come from: same seed, same text."""

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("top_k", f"must be >= 1, got {self.top_k}")


def next_token_distribution(logits_V: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Probabilities (V,) of the next token from its logits, after temperature and top-k."""
    logits_V = logits_V.float()
    if temperature == 0:
        probs = torch.zeros_like(logits_V)
        probs[int(torch.argmax(logits_V))] = 1.0
        return probs
    logits_V = logits_V / temperature
    if top_k is not None and top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    return torch.softmax(logits_V, dim=-1)


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], config: SamplingConfig, context: int) -> list[int]:
    """``prompt`` followed by ``config.max_new_tokens`` sampled tokens; the model sees the last ``context``."""
    config.validate()
    if not prompt:
        raise ConfigError("prompt", "must not be empty (the model needs a token to continue)")
    if context < 1:
        raise ConfigError("context", f"must be >= 1, got {context}")
    gen = torch.Generator().manual_seed(config.seed)
    was_training = model.training
    model.eval()
    ids = list(prompt)
    try:
        for _ in range(config.max_new_tokens):
            window_1T = torch.tensor([ids[-context:]], dtype=torch.long)
            logits_V = model(window_1T)[0, -1, :BYTE_VOCAB]
            probs_V = next_token_distribution(logits_V, config.temperature, config.top_k)
            ids.append(int(torch.multinomial(probs_V, 1, generator=gen)))
    finally:
        model.train(was_training)
    return ids


def encode(text: str) -> list[int]:
    """Byte-level tokens of ``text`` (UTF-8)."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Text of byte-level tokens; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")
