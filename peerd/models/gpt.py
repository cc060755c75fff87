"""A compact nanoGPT-style GPT whose ordered layer list can be split into pipeline stages from outside.

The model is ``[Embedding, Block x n_layer, Head]`` held in ``GPT.layers``; ``forward`` just runs them
in order. Nothing here knows about stages, devices or compression: ``peerd.pipeline.partition``
slices ``layers``. Every layer is initialised from its own generator seeded by ``(seed, layer index)``,
so a stage worker that builds only its own layers (``build_layer``) gets exactly the weights the full
model would have.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peerd.errors import ConfigError
from peerd.models.stack import LayerStack

# Far above any real model (Llama 3 405B: 126 layers, width 16384, 128256 tokens) and low enough
# that a hostile spec cannot make a peer allocate per-layer tables or tensors it cannot hold.
SIZE_LIMITS = {
    "n_layer": 1024,
    "n_head": 1024,
    "d_model": 1 << 16,
    "vocab_size": 1 << 20,
    "max_seq_len": 1 << 20,
}


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. Field docs say what each controls."""

    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Hidden size (width of the residual stream)."""
    vocab_size: int = 256
    """Token vocabulary; 256 means byte-level."""
    max_seq_len: int = 128
    """Longest sequence the position table covers."""
    d_ff: int | None = None
    """MLP hidden width; ``None`` means ``4 * d_model``."""
    dropout: float = 0.0
    """Dropout on embeddings, attention output and MLP output (0 keeps runs bit-reproducible)."""
    bias: bool = True
    """Bias terms in linear layers and layer norms (GPT-2 style)."""
    tie_weights: bool = False
    """Share the token-embedding table with the LM head. Off by default: tied weights span the
    first and last pipeline stage, which then need an extra gradient exchange."""

    @property
    def ff(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def num_layers(self) -> int:
        """Length of the splittable layer list: embedding + blocks + head."""
        return self.n_layer + 2

    def validate(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
            if getattr(self, name) > SIZE_LIMITS[name]:
                raise ConfigError(name, f"must be <= {SIZE_LIMITS[name]}, got {getattr(self, name)}")
        if self.d_ff is not None and not 1 <= self.d_ff <= 4 * SIZE_LIMITS["d_model"]:
            raise ConfigError("d_ff", f"must be in [1, {4 * SIZE_LIMITS['d_model']}], got {self.d_ff}")
        if self.d_model % self.n_head:
            raise ConfigError("n_head", f"must divide d_model={self.d_model}, got {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named size (see ``PRESETS``), optionally with fields overridden."""
        if name not in PRESETS:
            raise ConfigError("model.preset", f"unknown GPT preset {name!r} (known: {', '.join(PRESETS)})")
        fields = {**PRESETS[name], **overrides}
        cfg = cls(**fields)  # type: ignore[arg-type]
        cfg.validate()
        return cfg


GPT2_VOCAB = 50257
# Sizes from the GPT-2 release and the GPT-3 paper (Table 2.1). GPT-3 XL lists 24 heads of 128 dims
# with d_model 2048, which does not multiply out; we use 16 heads of 128 like most re-implementations.
PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64, vocab_size=256, max_seq_len=128),
    "tiny-4": dict(n_layer=4, n_head=4, d_model=128, vocab_size=256, max_seq_len=256),
    "mini": dict(n_layer=6, n_head=6, d_model=384, vocab_size=256, max_seq_len=256),
    "gpt2": dict(
        n_layer=12, n_head=12, d_model=768, vocab_size=GPT2_VOCAB, max_seq_len=1024, tie_weights=True
    ),
    "gpt2-medium": dict(
        n_layer=24, n_head=16, d_model=1024, vocab_size=GPT2_VOCAB, max_seq_len=1024, tie_weights=True
    ),
    "gpt2-large": dict(
        n_layer=36, n_head=20, d_model=1280, vocab_size=GPT2_VOCAB, max_seq_len=1024, tie_weights=True
    ),
    "gpt2-xl": dict(
        n_layer=48, n_head=25, d_model=1600, vocab_size=GPT2_VOCAB, max_seq_len=1024, tie_weights=True
    ),
    "gpt3-xl": dict(
        n_layer=24, n_head=16, d_model=2048, vocab_size=GPT2_VOCAB, max_seq_len=2048, tie_weights=True
    ),
}


class Embedding(nn.Module):
    """Layer 0: token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        seq_len = tokens_BT.shape[1]
        if seq_len > self.pos.num_embeddings:
            raise ConfigError(
                "seq_len", f"sequence of {seq_len} tokens exceeds max_seq_len={self.pos.num_embeddings}"
            )
        pos_T = torch.arange(seq_len, device=tokens_BT.device)
        return self.drop(self.tok(tokens_BT) + self.pos(pos_T))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q, k, v = self.qkv(x_BTC).split(C, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y_BHTD = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y_BTC = y_BHTD.transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.proj(y_BTC))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x_BTC), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln1(x_BTC))
        return x_BTC + self.mlp(self.ln2(x_BTC))


class Head(nn.Module):
    """Last layer: hidden states (B, T, C) -> logits (B, T, V) through the final layer norm."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x_BTC))


def layer_seed(seed: int, index: int) -> int:
    """The init seed of layer ``index``: independent of which other layers a process builds."""
    digest = hashlib.sha256(f"peerd.gpt/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _init_layer(layer: nn.Module, cfg: GPTConfig, seed: int, index: int) -> None:
    # GPT-2 init: N(0, 0.02) weights, zero biases, unit norms, and the two residual projections
    # scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
    gen = torch.Generator().manual_seed(layer_seed(seed, index))
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, m in layer.named_modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 0.02, generator=gen)
            elif isinstance(m, nn.Linear):
                if name == "lm_head" and cfg.tie_weights:
                    continue  # the embedding table's init is the head's
                std = resid_std if name.endswith("proj") else 0.02
                nn.init.normal_(m.weight, 0.0, std, generator=gen)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


def build_layer(cfg: GPTConfig, index: int, seed: int = 0) -> nn.Module:
    """Build and initialise layer ``index`` of ``cfg`` alone (0 = embedding, last = head)."""
    if not 0 <= index < cfg.num_layers:
        raise ConfigError("layer", f"index {index} outside 0..{cfg.num_layers - 1}")
    if index == 0:
        layer: nn.Module = Embedding(cfg)
    elif index == cfg.num_layers - 1:
        layer = Head(cfg)
    else:
        layer = Block(cfg)
    _init_layer(layer, cfg, seed, index)
    return layer


class GPT(LayerStack):
    """The full model: ``layers`` = [Embedding, Block..., Head]; tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.seed = seed
        layers = [build_layer(cfg, i, seed) for i in range(cfg.num_layers)]
        if cfg.tie_weights:
            head, embedding = layers[-1], layers[0]
            assert isinstance(head, Head) and isinstance(embedding, Embedding)  # build_layer's order
            head.lm_head.weight = embedding.tok.weight
        self.layers = nn.ModuleList(layers)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch."""
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), targets_BT.reshape(-1))
