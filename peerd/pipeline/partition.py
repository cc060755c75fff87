"""Split a model's ordered layer list into pipeline stages (uneven allowed) and wrap each as a module.

A model is splittable when it exposes ``layers``: an ordered ``nn.ModuleList`` whose first entry
takes token ids (B, T), whose middle entries map hidden states (B, T, C) to (B, T, C) and whose
last entry produces logits (B, T, V) (``peerd.models.gpt.GPT`` and ``peerd.models.hf.HFStagedLM``).
Stage ``s`` holds layers ``[start_s, end_s)``; stage 0 takes tokens, the last stage emits logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from peerd.errors import ConfigError


@dataclass(frozen=True)
class StageSpec:
    """Which layers stage ``index`` of ``num_stages`` holds: ``[start, end)`` of ``num_layers``."""

    index: int
    num_stages: int
    start: int
    end: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def validate_layers_per_stage(num_layers: int, layers_per_stage: Sequence[int]) -> tuple[int, ...]:
    """Check that ``layers_per_stage`` is a list of positive counts summing to ``num_layers``."""
    counts = tuple(layers_per_stage)
    if not counts:
        raise ConfigError("layers_per_stage", "needs at least one stage")
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"layers_per_stage[{i}]", f"must be a positive integer, got {n!r}")
    if sum(counts) != num_layers:
        raise ConfigError(
            "layers_per_stage", f"{list(counts)} sums to {sum(counts)}, but the model has {num_layers} layers"
        )
    return counts


def balanced_layers_per_stage(num_layers: int, num_stages: int) -> list[int]:
    """As even a split as possible; the first ``num_layers % num_stages`` stages get one layer more."""
    if not 1 <= num_stages <= num_layers:
        raise ConfigError("num_stages", f"must be in 1..{num_layers}, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def stage_specs(num_layers: int, layers_per_stage: Sequence[int]) -> list[StageSpec]:
    counts = validate_layers_per_stage(num_layers, layers_per_stage)
    specs, start = [], 0
    for s, n in enumerate(counts):
        specs.append(StageSpec(s, len(counts), start, start + n, num_layers))
        start += n
    return specs


class StageModule(nn.Module):
    """Consecutive layers of a model: tokens or hidden states in, hidden states or logits out."""

    def __init__(self, spec: StageSpec, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        assert len(layers) == spec.end - spec.start, "layer count must match the spec"
        self.spec = spec
        self.layers = nn.ModuleList(layers)

    @property
    def is_first(self) -> bool:
        return self.spec.is_first

    @property
    def is_last(self) -> bool:
        return self.spec.is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: tokens (B, T) int64 on the first stage, else hidden states (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return x  # logits (B, T, V) on the last stage, else hidden states (B, T, C)


def model_layers(model: nn.Module) -> nn.ModuleList:
    """The ordered layer list of a splittable model."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 2:
        raise ConfigError("model", f"{type(model).__name__} exposes no ordered 'layers' list to split")
    return layers


def partition(model: nn.Module, layers_per_stage: Sequence[int]) -> list[StageModule]:
    """All stages of ``model``; they share the model's layer objects (no copies)."""
    layers = model_layers(model)
    return [
        StageModule(spec, list(layers[spec.start : spec.end]))
        for spec in stage_specs(len(layers), layers_per_stage)
    ]


def build_stage(
    build_layer: Callable[[int], nn.Module], num_layers: int, layers_per_stage: Sequence[int], stage: int
) -> StageModule:
    """Only stage ``stage``, building just its layers with ``build_layer(index)`` (a stage worker's path)."""
    specs = stage_specs(num_layers, layers_per_stage)
    if not 0 <= stage < len(specs):
        raise ConfigError("stage", f"must be in 0..{len(specs) - 1}, got {stage}")
    spec = specs[stage]
    return StageModule(spec, [build_layer(i) for i in range(spec.start, spec.end)])


def shared_parameters(stages: Sequence[nn.Module]) -> list[tuple[int, ...]]:
    """Stage indices that share a parameter object (e.g. tied embedding and LM head), one tuple per tensor.

    In one process sharing is harmless; across peers each side holds its own copy and the
    copies' gradients must be summed, so a distributed runner has to handle (or refuse) these.
    """
    owners: dict[int, list[int]] = {}
    for s, stage in enumerate(stages):
        for p in stage.parameters():  # parameters() already yields a shared tensor once per module
            owners.setdefault(id(p), []).append(s)
    return [tuple(v) for v in owners.values() if len(v) > 1]
