"""Model definitions that know nothing about parallelism, their registry, and the model file ``peerd fetch`` writes."""

from peerd.models.checkpoint import load_checkpoint, open_checkpoint, save_checkpoint
from peerd.models.gpt import GPT, GPTConfig, build_layer, lm_loss
from peerd.models.registry import ModelFamily, build_family, family_from, with_weights

__all__ = [
    "GPT",
    "GPTConfig",
    "ModelFamily",
    "build_family",
    "build_layer",
    "family_from",
    "lm_loss",
    "load_checkpoint",
    "open_checkpoint",
    "save_checkpoint",
    "with_weights",
]
