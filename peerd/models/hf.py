"""Adapter exposing a Hugging Face causal LM (GPT-2 or Llama family) as the same ordered layer list as GPT.

``HFStagedLM(model).layers`` is ``[embedding, block..., head]`` with the interfaces of
``peerd.models.gpt``: tokens (B, T) -> hidden (B, T, C) -> ... -> logits (B, T, V). Each block
wrapper rebuilds what the HF model computes once at the top (position ids, the causal mask, and
for Llama the rotary cos/sin), so any consecutive run of layers can execute on its own. The
wrappers hold the HF submodules themselves, so weights (and GPT-2's tied embedding) are shared,
not copied. Needs the optional ``transformers`` package (``pip install peerd[hf]``); only full
(non-padded) sequences are supported, which is what the windowed datasets produce.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from peerd.errors import ConfigError
from peerd.models.gpt import SIZE_LIMITS
from peerd.models.stack import LayerStack

SUPPORTED = ("gpt2", "llama")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.hf", "Hugging Face models need 'transformers' (pip install peerd[hf])"
        ) from None
    return transformers


def _causal_mask(h_BTC: torch.Tensor) -> torch.Tensor:
    """(1, 1, T, T) additive mask: 0 on and below the diagonal, the dtype's minimum above.

    An explicit mask works for every HF attention backend (eager adds it, sdpa passes it on).
    """
    T = h_BTC.shape[1]
    mask = torch.full((T, T), torch.finfo(h_BTC.dtype).min, dtype=h_BTC.dtype, device=h_BTC.device)
    return torch.triu(mask, diagonal=1)[None, None]


M = TypeVar("M", bound=nn.Module)


def _sub(module: nn.Module, name: str, kind: type[M]) -> M:
    """``module.<name>`` as a submodule of type ``kind`` (torch types attribute access as ``Tensor | Module``)."""
    sub = getattr(module, name, None)
    if not isinstance(sub, kind):
        got = "no such submodule" if sub is None else f"a {type(sub).__name__}"
        raise ConfigError(
            "model.hf",
            f"{type(module).__name__}.{name}: {got}, expected a {kind.__name__} (an unexpected HF layout)",
        )
    return sub


def _first(out: Any) -> torch.Tensor:
    # transformers < 5 returns (hidden_states, ...) from a decoder layer; >= 5 returns the tensor.
    return out[0] if isinstance(out, tuple) else out


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        pos_T = torch.arange(tokens_BT.shape[1], device=tokens_BT.device)
        return self.drop(self.wte(tokens_BT) + self.wpe(pos_T)[None])


class GPT2BlockAdapter(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h_BTC: torch.Tensor) -> torch.Tensor:
        return _first(self.block(h_BTC, attention_mask=_causal_mask(h_BTC)))


class LlamaEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens_BT)


class LlamaBlockAdapter(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # parameter-free (inv_freq buffer); shared by every block

    def forward(self, h_BTC: torch.Tensor) -> torch.Tensor:
        pos_1T = torch.arange(h_BTC.shape[1], device=h_BTC.device)[None]
        cos_sin = self.rotary(h_BTC, pos_1T)
        out = self.layer(
            h_BTC, attention_mask=_causal_mask(h_BTC), position_ids=pos_1T, position_embeddings=cos_sin
        )
        return _first(out)


class NormHead(nn.Module):
    """Final norm then LM head: hidden (B, T, C) -> logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h_BTC: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h_BTC))


class HFStagedLM(LayerStack):
    """A HF causal LM as ``layers`` = [embedding, blocks..., head]; forward runs them in order."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        layers: list[nn.Module]
        if model_type == "gpt2":
            tr = _sub(model, "transformer", nn.Module)
            layers = [
                GPT2Embedding(
                    _sub(tr, "wte", nn.Embedding), _sub(tr, "wpe", nn.Embedding), _sub(tr, "drop", nn.Module)
                ),
                *(GPT2BlockAdapter(b) for b in _sub(tr, "h", nn.ModuleList)),
            ]
            layers.append(NormHead(_sub(tr, "ln_f", nn.Module), _sub(model, "lm_head", nn.Module)))
        elif model_type == "llama":
            core = _sub(model, "model", nn.Module)
            rotary = _sub(core, "rotary_emb", nn.Module)
            layers = [
                LlamaEmbedding(_sub(core, "embed_tokens", nn.Embedding)),
                *(LlamaBlockAdapter(b, rotary) for b in _sub(core, "layers", nn.ModuleList)),
            ]
            layers.append(NormHead(_sub(core, "norm", nn.Module), _sub(model, "lm_head", nn.Module)))
        else:
            raise ConfigError(
                "model.hf", f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"
            )
        self.model_type = model_type
        self.config = config
        self.layers = nn.ModuleList(layers)


def build_hf_model(model_type: str, seed: int = 0, **config: Any) -> nn.Module:
    """A randomly initialised HF causal LM of ``model_type`` built from ``config`` (no download).

    HF initialises from torch's global generator; we seed it inside a forked RNG state so the
    caller's random stream is untouched and the same seed gives the same weights.
    """
    if model_type not in SUPPORTED:
        raise ConfigError(
            "model.hf.model_type", f"{model_type!r} not supported (supported: {', '.join(SUPPORTED)})"
        )
    tf = _transformers()
    try:
        hf_config = tf.AutoConfig.for_model(model_type, **config)
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.hf.config", str(exc)) from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(hf_config)
    return model


# ---------------------------------------------------------------- one layer at a time
#
# A stage worker builds only its own layers: the same adapter classes as ``HFStagedLM`` around
# freshly built HF submodules (``GPT2Block``, ``LlamaDecoderLayer``, ...), so a layer's state-dict
# keys are the same either way and map onto the HF model's names by a fixed prefix per layer.

# Keys of a ``save_pretrained`` config.json that describe the file, not the model.
CONFIG_METADATA = frozenset(
    {"architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"}
)
_RUNTIME_KEYS = frozenset({"attn_implementation"})


def hf_config(fields: dict[str, Any]) -> Any:
    """The HF config of a spec's ``model.hf`` mapping (``model_type`` + config fields).

    Every key must be a field of the model type's config (or one of its aliases): a typo would
    otherwise be stored and ignored by HF. Attention defaults to ``sdpa``.
    """
    fields = {k: v for k, v in fields.items() if k not in CONFIG_METADATA}
    model_type = fields.pop("model_type", None)
    if model_type not in SUPPORTED:
        raise ConfigError("model.hf.model_type", f"must be one of {', '.join(SUPPORTED)}, got {model_type!r}")
    tf = _transformers()
    cls = tf.AutoConfig.for_model(model_type).__class__
    defaults = cls().to_dict()
    aliases: dict[str, str] = dict(getattr(cls, "attribute_map", {}))
    known = set(defaults) | set(aliases) | _RUNTIME_KEYS
    for key in sorted(fields):
        if key not in known:
            raise ConfigError(f"model.hf.{key}", f"not a field of {cls.__name__}")
        want = _kind(defaults.get(aliases.get(key, key)))
        if want is not None and not _is(fields[key], want):
            raise ConfigError(f"model.hf.{key}", f"must be {want}, got {fields[key]!r}")
    fields.setdefault("attn_implementation", "sdpa")
    try:
        config = tf.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.hf", str(exc)) from None

    def name(attr: str) -> str:  # the key the user wrote for a config attribute
        return "model.hf." + next((k for k in fields if aliases.get(k, k) == attr), aliases.get(attr, attr))

    sizes = {  # the GPT's limits (peerd.models.gpt.SIZE_LIMITS) under HF's names
        "num_hidden_layers": SIZE_LIMITS["n_layer"],
        "hidden_size": SIZE_LIMITS["d_model"],
        "vocab_size": SIZE_LIMITS["vocab_size"],
        "max_position_embeddings": SIZE_LIMITS["max_seq_len"],
        "num_attention_heads": SIZE_LIMITS["n_head"],
    }
    for attr, limit in sizes.items():
        value = getattr(config, attr)
        if not _is(value, "an integer") or not 1 <= value <= limit:
            raise ConfigError(name(attr), f"must be an integer in [1, {limit}], got {value!r}")
    ff_attr = "n_inner" if config.model_type == "gpt2" else "intermediate_size"
    ff, ff_limit = getattr(config, ff_attr, None), 4 * SIZE_LIMITS["d_model"]
    if ff is not None and (not _is(ff, "an integer") or not 1 <= ff <= ff_limit):
        raise ConfigError(f"model.hf.{ff_attr}", f"must be an integer in [1, {ff_limit}], got {ff!r}")
    heads = config.num_attention_heads
    if config.hidden_size % heads:
        raise ConfigError(
            name("num_attention_heads"),
            f"hidden size {config.hidden_size} is not a multiple of {heads} heads",
        )
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not _is(kv, "an integer") or kv < 1 or heads % kv:
        raise ConfigError(
            "model.hf.num_key_value_heads", f"must divide the {heads} attention heads, got {kv!r}"
        )
    return config


def _kind(default: Any) -> str | None:
    """What a config field takes, judged by its default (None: anything, e.g. an optional field)."""
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str):
        return "a string"
    return None


def _is(value: Any, kind: str) -> bool:
    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "an integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "a number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def hf_num_layers(config: Any) -> int:
    """Splittable layers of the model: embedding + blocks + head."""
    return int(config.num_hidden_layers) + 2


def build_hf_layer(config: Any, index: int) -> nn.Module:
    """Layer ``index`` of the model alone (0 = embedding, last = final norm + LM head), uninitialised."""
    n = hf_num_layers(config)
    if not 0 <= index < n:
        raise ConfigError("layer", f"index {index} outside 0..{n - 1}")
    C, V = config.hidden_size, config.vocab_size
    if config.model_type == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        if index == 0:
            return GPT2Embedding(
                nn.Embedding(V, C), nn.Embedding(config.n_positions, C), nn.Dropout(config.embd_pdrop)
            )
        if index == n - 1:
            return NormHead(nn.LayerNorm(C, eps=config.layer_norm_epsilon), nn.Linear(C, V, bias=False))
        return GPT2BlockAdapter(GPT2Block(config, layer_idx=index - 1))
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    if index == 0:
        return LlamaEmbedding(nn.Embedding(V, C, config.pad_token_id))
    if index == n - 1:
        return NormHead(LlamaRMSNorm(C, eps=config.rms_norm_eps), nn.Linear(C, V, bias=False))
    return LlamaBlockAdapter(LlamaDecoderLayer(config, index - 1), LlamaRotaryEmbedding(config))


def hf_prefixes(config: Any, index: int) -> list[tuple[str, str]]:
    """(layer key prefix, HF model key prefix) pairs of layer ``index``: how its weights are named in HF files."""
    n = hf_num_layers(config)
    if config.model_type == "gpt2":
        if index == 0:
            return [("wte.", "transformer.wte."), ("wpe.", "transformer.wpe.")]
        if index == n - 1:
            return [("norm.", "transformer.ln_f."), ("lm_head.", "lm_head.")]
        return [("block.", f"transformer.h.{index - 1}.")]
    if index == 0:
        return [("embed_tokens.", "model.embed_tokens.")]
    if index == n - 1:
        return [("norm.", "model.norm."), ("lm_head.", "lm_head.")]
    return [("layer.", f"model.layers.{index - 1}.")]


def tied_source(config: Any) -> str:
    """The HF key a tied checkpoint stores the LM head under (it saves only the embedding)."""
    return "transformer.wte.weight" if config.model_type == "gpt2" else "model.embed_tokens.weight"


def init_hf_layer(layer: nn.Module, config: Any, generator: torch.Generator) -> None:
    """HF's initialisation, drawn from ``generator``: N(0, initializer_range) weights, zero biases,
    unit norms, and GPT-2's residual projections (``c_proj``) scaled by 1/sqrt(2 * n_layer)."""
    std = config.initializer_range
    resid_std = std / (2 * config.num_hidden_layers) ** 0.5
    with torch.no_grad():
        for mod_name, module in layer.named_modules():
            is_norm = isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")
            for name, p in module.named_parameters(recurse=False):
                if is_norm and name == "weight":
                    p.fill_(1.0)
                elif name == "bias" or is_norm:
                    p.zero_()
                else:
                    scaled = config.model_type == "gpt2" and mod_name.endswith("c_proj")
                    p.normal_(0.0, resid_std if scaled else std, generator=generator)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()  # HF keeps the padding row at zero
