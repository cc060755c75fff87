"""Model definitions that know nothing about parallelism."""

from peerd.models.gpt import GPT, GPTConfig, build_layer, lm_loss

__all__ = ["GPT", "GPTConfig", "build_layer", "lm_loss"]
