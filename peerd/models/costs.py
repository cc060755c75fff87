"""Analytic per-layer sizes of a GPT (parameters, FLOPs, activation bytes) for the scheduler's cost model.

Everything is computed from the ``GPTConfig`` alone, so the cost of a GPT-3 XL stage can be
estimated without building it. Layer indices follow ``GPT.layers``: 0 = embedding,
1..n_layer = blocks, n_layer + 1 = head.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerd.errors import ConfigError
from peerd.models.gpt import GPTConfig


@dataclass(frozen=True)
class LayerCost:
    """Sizes of one layer for sequences of ``seq_len`` tokens."""

    params: int
    """Trainable parameters the layer owns (a tied head owns none)."""
    fwd_flops_per_token: float
    """Forward FLOPs per token (multiply-add = 2 FLOPs); backward is about twice this."""
    out_elems_per_token: int
    """Elements of the layer's output per token: what crosses a stage boundary after it."""
    saved_elems_per_token: int
    """Elements autograd keeps per token for the backward pass (estimate; assumes a fused
    attention kernel, so no T x T score matrix is stored)."""


def _ln_params(cfg: GPTConfig) -> int:
    return cfg.d_model * (2 if cfg.bias else 1)


def _linear_params(cfg: GPTConfig, n_in: int, n_out: int) -> int:
    return n_in * n_out + (n_out if cfg.bias else 0)


def embedding_params(cfg: GPTConfig) -> int:
    return (cfg.vocab_size + cfg.max_seq_len) * cfg.d_model


def block_params(cfg: GPTConfig) -> int:
    C, ff = cfg.d_model, cfg.ff
    attn = _linear_params(cfg, C, 3 * C) + _linear_params(cfg, C, C)
    mlp = _linear_params(cfg, C, ff) + _linear_params(cfg, ff, C)
    return 2 * _ln_params(cfg) + attn + mlp


def head_params(cfg: GPTConfig) -> int:
    return _ln_params(cfg) + (0 if cfg.tie_weights else cfg.d_model * cfg.vocab_size)


def _block_matmul_weights(cfg: GPTConfig) -> int:
    """Weights of one block's linear layers (qkv, proj, fc, fc proj), biases aside."""
    C, ff = cfg.d_model, cfg.ff
    return 4 * C * C + 2 * C * ff


def matmul_params(cfg: GPTConfig) -> int:
    """Weights each token's forward multiplies: every block's linear layers and the head's projection
    (also when tied to the embedding); the embeddings' lookups and the norms aside."""
    return cfg.n_layer * _block_matmul_weights(cfg) + cfg.d_model * cfg.vocab_size


def param_count(cfg: GPTConfig) -> int:
    """Total trainable parameters of ``GPT(cfg)`` (tied weights counted once)."""
    return embedding_params(cfg) + cfg.n_layer * block_params(cfg) + head_params(cfg)


def layer_costs(cfg: GPTConfig, seq_len: int | None = None) -> list[LayerCost]:
    """One ``LayerCost`` per entry of ``GPT.layers``; ``seq_len`` defaults to ``max_seq_len``."""
    T = seq_len or cfg.max_seq_len
    C, ff, V = cfg.d_model, cfg.ff, cfg.vocab_size
    # Matmul FLOPs: 2 per weight per token; attention adds QK^T and AV, 2 * T * C each per token
    # (counted over the full T x T square as is customary, although the causal half is masked).
    block_flops = 2.0 * _block_matmul_weights(cfg) + 4.0 * T * C
    # Saved by autograd per token: ln1 in, qkv out (3C), attention out, proj in, ln2 in, fc in,
    # fc out, gelu out (ff each), plus the two residual adds' inputs are the same tensors.
    block_saved = 8 * C + 2 * ff
    costs = [LayerCost(embedding_params(cfg), 0.0, C, 0)]
    costs += [LayerCost(block_params(cfg), block_flops, C, block_saved)] * cfg.n_layer
    costs.append(LayerCost(head_params(cfg), 2.0 * C * V, V, C + V))
    return costs


def stage_costs(cfg: GPTConfig, layers_per_stage: list[int], seq_len: int | None = None) -> list[LayerCost]:
    """Sum ``layer_costs`` over consecutive stages; ``out_elems_per_token`` is the stage's last layer's."""
    return sum_stages(layer_costs(cfg, seq_len), layers_per_stage)


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama-family model that its costs depend on (RMSNorm, gated MLP, grouped KV heads)."""

    n_layer: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab_size: int
    tie_weights: bool = False


def llama_layer_costs(shape: LlamaShape, seq_len: int) -> list[LayerCost]:
    """``layer_costs`` for a Llama: embedding, ``n_layer`` decoder layers, final norm + LM head."""
    T, C, ff, V = seq_len, shape.hidden, shape.intermediate, shape.vocab_size
    kv = C // shape.heads * shape.kv_heads  # width of K and V each
    attn = 2 * C * C + 2 * C * kv  # q, o; k, v
    mlp = 3 * C * ff  # gate, up, down
    block_params = attn + mlp + 2 * C  # + the two RMSNorm weights
    block_flops = 2.0 * (attn + mlp) + 4.0 * T * C
    # saved per token: norm in (x2), q, k, v (+ rotated q, k), attention out, o in, gate, up, act, product
    block_saved = 6 * C + 4 * kv + 4 * ff
    head_params = C + (0 if shape.tie_weights else C * V)
    costs = [LayerCost(V * C, 0.0, C, 0)]
    costs += [LayerCost(block_params, block_flops, C, block_saved)] * shape.n_layer
    costs.append(LayerCost(head_params, 2.0 * C * V, V, C + V))
    return costs


def sum_stages(costs: list[LayerCost], layers_per_stage: list[int]) -> list[LayerCost]:
    """``costs`` summed over consecutive stages (see ``stage_costs``)."""
    if sum(layers_per_stage) != len(costs) or min(layers_per_stage, default=0) < 1:
        raise ConfigError("layers_per_stage", f"{layers_per_stage} does not cover {len(costs)} layers")
    out: list[LayerCost] = []
    start = 0
    for n in layers_per_stage:
        part = costs[start : start + n]
        start += n
        out.append(
            LayerCost(
                params=sum(c.params for c in part),
                fwd_flops_per_token=sum(c.fwd_flops_per_token for c in part),
                out_elems_per_token=part[-1].out_elems_per_token,
                saved_elems_per_token=sum(c.saved_elems_per_token for c in part),
            )
        )
    return out
