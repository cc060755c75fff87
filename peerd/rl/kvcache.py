"""A key/value-cached forward pass over the built-in GPT's layers, for batched generation.

``peerd.models.gpt`` has one forward (the whole sequence, positions ``0..T-1``, causal), which is
what training and reference scoring run. Generation needs two things that forward lacks, so they
are written here against the same layer objects (same weights, same maths):

- a cache: each decode step feeds one new token per row and attends to the keys and values of
  every earlier token, kept per block in preallocated ``(B, H, S, D)`` tensors;
- ragged prompts: prompts are left-padded to a common length; each row has its own positions
  (its first real token is position 0) and a key mask hides its pad slots from every query.

A pad query attends to itself only (it must attend to something, or softmax over nothing gives
NaN, and that NaN would reach later layers' values); its output is never read.
Dropout is not applied: generation runs the model in eval mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peerd.errors import ConfigError
from peerd.models.gpt import GPT, Block, CausalSelfAttention, Embedding, Head


def gpt_parts(model: nn.Module) -> tuple[Embedding, list[Block], Head]:
    """The embedding, blocks and head of a built-in GPT; ``ConfigError`` for any other model."""
    if not isinstance(model, GPT):
        raise ConfigError("model", f"cached generation supports the built-in GPT, got {type(model).__name__}")
    layers = list(model.layers)
    first, blocks, last = layers[0], layers[1:-1], layers[-1]
    assert isinstance(first, Embedding) and isinstance(last, Head)  # GPT's layer order
    assert all(isinstance(b, Block) for b in blocks)
    return first, blocks, last  # type: ignore[return-value]


class KVCache:
    """Keys and values of every block for ``batch`` rows and up to ``capacity`` positions."""

    def __init__(self, model: GPT, batch: int, capacity: int) -> None:
        cfg = model.cfg
        if capacity > cfg.max_seq_len:
            raise ConfigError(
                "max_new_tokens",
                f"prompt + completion of {capacity} tokens exceeds max_seq_len={cfg.max_seq_len}",
            )
        p = next(model.parameters())
        shape = (batch, cfg.n_head, capacity, cfg.d_model // cfg.n_head)
        self.keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        self.values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        self.capacity = capacity
        self.length = 0
        """Slots filled so far (the same for every row: rows advance in lockstep)."""


def _attend(
    attn: CausalSelfAttention, x_BTC: torch.Tensor, cache: KVCache, layer: int, mask_B1TS: torch.Tensor
) -> torch.Tensor:
    B, T, C = x_BTC.shape
    q, k, v = attn.qkv(x_BTC).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    start, end = cache.length, cache.length + T
    cache.keys[layer][:, :, start:end] = k
    cache.values[layer][:, :, start:end] = v
    y_BHTD = F.scaled_dot_product_attention(
        q, cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end], attn_mask=mask_B1TS
    )
    return attn.proj(y_BHTD.transpose(1, 2).contiguous().view(B, T, C))


def cached_forward(
    model: GPT, tokens_BT: torch.Tensor, positions_BT: torch.Tensor, key_mask_BS: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Logits (B, T, V) of ``tokens_BT`` placed at cache slots ``cache.length ..``; appends their keys/values.

    ``positions_BT``: each token's position in its own row (what the position table is indexed by).
    ``key_mask_BS``: for the ``S = cache.length + T`` slots, True where a real token sits.
    """
    embedding, blocks, head = gpt_parts(model)
    B, T = tokens_BT.shape
    start, end = cache.length, cache.length + T
    if end > cache.capacity:
        raise ConfigError("max_new_tokens", f"cache of {cache.capacity} slots cannot take slot {end - 1}")
    assert key_mask_BS.shape == (B, end), (key_mask_BS.shape, (B, end))
    # query slot start+i sees key slot j <= start+i where a real token sits, and always itself
    slots_S = torch.arange(end, device=tokens_BT.device)
    query_T = slots_S[start:]
    causal_TS = slots_S[None, :] <= query_T[:, None]
    mask_BTS = causal_TS[None] & key_mask_BS[:, None, :]
    mask_BTS |= slots_S[None, None, :] == query_T[None, :, None]
    x_BTC = embedding.tok(tokens_BT) + embedding.pos(positions_BT)
    for i, block in enumerate(blocks):
        x_BTC = x_BTC + _attend(block.attn, block.ln1(x_BTC), cache, i, mask_BTS[:, None])
        x_BTC = x_BTC + block.mlp(block.ln2(x_BTC))
    cache.length = end
    return head(x_BTC)
