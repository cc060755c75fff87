"""Model families behind one interface, so a stage worker builds its layers without knowing which model it trains.

A ``ModelFamily`` is a model shape plus an init seed: its ``num_layers`` splittable layers
(embedding + blocks + head, the ``LayerStack`` order), ``build_layer(i)`` building layer ``i``
alone with the weights every peer agrees on, the training ``loss``, ``hidden`` (the width of
the activations between layers, which the pipeline streams) and ``layer_costs`` (what the
planner's cost model needs). ``describe()`` is a JSON-able description that ``family_from``
turns back into the same family (model files carry it).

Families, by the name ``build_family`` takes:

- ``gpt``: the built-in GPT (``peerd.models.gpt``); config = ``GPTConfig`` fields.
- ``gpt2``, ``llama``: Hugging Face models (``peerd.models.hf``); config = the HF config
  mapping with its ``model_type``. Each layer is built alone from HF's own submodules and
  initialised HF's way from a generator seeded by ``(seed, layer index)``: like the GPT, a
  stage worker never builds the rest of the model.

``with_weights(family, path)`` wraps a family so that every layer it builds loads its slice of a
checkpoint (a peerd model file, or HF weights mapped by the family's key prefixes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from peerd.errors import ConfigError
from peerd.loading import from_mapping, to_mapping
from peerd.models import costs, hf
from peerd.models.gpt import GPT, GPTConfig, build_layer, layer_seed, lm_loss
from peerd.models.stack import LayerStack
from peerd.models.weights import WeightSource, open_weights


class Stack(LayerStack):
    """A ``LayerStack`` from a list of already built layers."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class ModelFamily(ABC):
    """One model's layers, loss and shape; every peer that builds layer ``i`` gets identical weights."""

    name: str
    seed: int

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Length of the splittable layer list: embedding + blocks + head."""

    @property
    @abstractmethod
    def hidden(self) -> int:
        """Width of the hidden states passed between layers (B, T, hidden)."""

    @property
    @abstractmethod
    def max_seq_len(self) -> int:
        """Longest sequence the model's positions cover."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def tied(self) -> bool:
        """The LM head shares the embedding's weights (the two cannot sit in different stages)."""

    @abstractmethod
    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index`` alone (0 = embedding, ``num_layers - 1`` = head), initialised from the seed."""

    @abstractmethod
    def layer_costs(self, seq_len: int) -> list[costs.LayerCost]:
        """Per-layer parameters, FLOPs and activation sizes (``peerd.models.costs``) for the planner."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The family's config as a JSON-able mapping (``build_family(name, config)`` rebuilds it)."""

    def external_prefixes(self, index: int) -> list[tuple[str, str]] | None:
        """(layer key prefix, key prefix in this family's own checkpoint format); None: no such format."""
        return None

    def external_tied_key(self) -> str | None:
        """Where a tied external checkpoint keeps the LM head's weights (it saves only the embedding)."""
        return None

    def _share_tied(self, index: int, layer: nn.Module, embedding: str) -> None:
        # A tied model's two ends can only live in one process (one stage); the head built after
        # the embedding by this family uses the embedding's table, as the whole model does.
        if not self.tied:
            return
        if index == 0:
            self._tied_table = layer.get_submodule(embedding)
        elif index == self.num_layers - 1 and getattr(self, "_tied_table", None) is not None:
            head = layer.get_submodule("lm_head")
            head.weight = self._tied_table.weight

    def build(self) -> LayerStack:
        """The whole model (a single process: tests, ``peerd fetch``, ``peerd generate``)."""
        return Stack([self.build_layer(i) for i in range(self.num_layers)])

    def loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy (every family here is a causal LM)."""
        return lm_loss(logits_BTV, targets_BT)

    def describe(self) -> dict[str, Any]:
        return {"family": self.name, "config": self.config(), "seed": self.seed}


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

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def tied(self) -> bool:
        return self.cfg.tie_weights

    def build_layer(self, index: int) -> nn.Module:
        layer = build_layer(self.cfg, index, self.seed)
        self._share_tied(index, layer, "tok")
        return layer

    def build(self) -> LayerStack:
        return GPT(self.cfg, self.seed)  # ties the head to the embedding when the config says so

    def layer_costs(self, seq_len: int) -> list[costs.LayerCost]:
        return costs.layer_costs(self.cfg, seq_len)

    def config(self) -> dict[str, Any]:
        return dict(to_mapping(self.cfg))


class HFFamily(ModelFamily):
    """A Hugging Face GPT-2 or Llama built layer by layer from its config (no download, no full model)."""

    def __init__(self, fields: dict[str, Any], seed: int = 0) -> None:
        self.fields = {k: v for k, v in fields.items() if k not in hf.CONFIG_METADATA}
        self.hf_config = hf.hf_config(self.fields)
        self.name = str(self.hf_config.model_type)
        self.seed = seed

    @property
    def num_layers(self) -> int:
        return hf.hf_num_layers(self.hf_config)

    @property
    def hidden(self) -> int:
        return int(self.hf_config.hidden_size)

    @property
    def max_seq_len(self) -> int:
        return int(self.hf_config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def tied(self) -> bool:
        return bool(self.hf_config.tie_word_embeddings)

    def build_layer(self, index: int) -> nn.Module:
        layer = hf.build_hf_layer(self.hf_config, index)
        gen = torch.Generator().manual_seed(layer_seed(self.seed, index))
        hf.init_hf_layer(layer, self.hf_config, gen)
        self._share_tied(index, layer, _EMBEDDING[self.name])
        return layer

    def layer_costs(self, seq_len: int) -> list[costs.LayerCost]:
        c = self.hf_config
        if self.name == "gpt2":
            gpt = GPTConfig(
                n_layer=c.n_layer,
                n_head=c.n_head,
                d_model=c.n_embd,
                vocab_size=c.vocab_size,
                max_seq_len=c.n_positions,
                d_ff=c.n_inner,
                tie_weights=self.tied,
            )
            return costs.layer_costs(gpt, seq_len)  # GPT-2 has the GPT's layout exactly
        shape = costs.LlamaShape(
            n_layer=c.num_hidden_layers,
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads or c.num_attention_heads,
            vocab_size=c.vocab_size,
            tie_weights=self.tied,
        )
        return costs.llama_layer_costs(shape, seq_len)

    def config(self) -> dict[str, Any]:
        return dict(self.fields)

    def external_prefixes(self, index: int) -> list[tuple[str, str]]:
        return hf.hf_prefixes(self.hf_config, index)

    def external_tied_key(self) -> str:
        return hf.tied_source(self.hf_config)

    def hf_state_dict(self, stack_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A ``LayerStack`` state dict (``layers.<i>.*``, e.g. a model file's) under the HF model's names."""
        out = {}
        for key, tensor in stack_state.items():
            _, index, rest = key.split(".", 2)
            for local, ext in self.external_prefixes(int(index)):
                if rest.startswith(local):
                    out[ext + rest[len(local) :]] = tensor
                    break
            else:
                raise ConfigError("checkpoint", f"{key} has no place in a {self.name} model")
        return out

    def to_hf(self, stack: LayerStack) -> nn.Module:
        """HF's own model class (``AutoModelForCausalLM``) holding ``stack``'s weights, e.g. to
        ``save_pretrained`` a fetched job for the HF ecosystem."""
        model = hf._transformers().AutoModelForCausalLM.from_config(self.hf_config)
        model.load_state_dict(self.hf_state_dict(stack.state_dict()), strict=not self.tied)
        return model


_EMBEDDING = {"gpt2": "wte", "llama": "embed_tokens"}


def _gpt(config: dict[str, Any], seed: int) -> ModelFamily:
    return GPTFamily(from_mapping(GPTConfig, config, "model"), seed)


def _hf(name: str) -> Callable[[dict[str, Any], int], ModelFamily]:
    def make(config: dict[str, Any], seed: int) -> ModelFamily:
        if config.get("model_type", name) != name:
            raise ConfigError(
                "model.hf.model_type", f"a {name} family with model_type {config['model_type']!r}"
            )
        return HFFamily({**config, "model_type": name}, seed)

    return make


FAMILIES: dict[str, Callable[[dict[str, Any], int], ModelFamily]] = {
    "gpt": _gpt,
    "gpt2": _hf("gpt2"),
    "llama": _hf("llama"),
}


def build_family(name: str, config: dict[str, Any], seed: int = 0) -> ModelFamily:
    """The family ``name`` (``FAMILIES``) of ``config``; ConfigError for an unknown name or a bad config."""
    if name not in FAMILIES:
        raise ConfigError("model.family", f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name](dict(config), seed)


def hf_family(config: dict[str, Any], seed: int = 0) -> ModelFamily:
    """The Hugging Face family of a ``model.hf`` config mapping (its ``model_type`` picks gpt2 or llama)."""
    model_type = config.get("model_type")
    if model_type not in hf.SUPPORTED:
        raise ConfigError(
            "model.hf.model_type", f"must be one of {', '.join(hf.SUPPORTED)}, got {model_type!r}"
        )
    return build_family(str(model_type), config, seed)


def family_from(description: dict[str, Any]) -> ModelFamily:
    """Inverse of ``ModelFamily.describe``."""
    config, seed = description.get("config"), description.get("seed", 0)
    if not isinstance(config, dict) or not isinstance(seed, int):
        raise ConfigError("model", "a model description needs its config mapping and an integer seed")
    return build_family(str(description.get("family")), config, seed)


# ---------------------------------------------------------------- starting from a checkpoint


class WithWeights(ModelFamily):
    """``base`` whose layers load their weights from a checkpoint instead of the seed's init.

    ``field`` names the spec field the path came from, so every error says what to fix.
    """

    def __init__(self, base: ModelFamily, source: WeightSource, field: str = "init_checkpoint") -> None:
        self.base, self.source, self.field = base, source, field
        self.name, self.seed = base.name, base.seed
        if source.description is not None:
            self._check_description(source.description)
        elif base.external_prefixes(0) is None:
            raise ConfigError(
                field,
                f"{source.path}: HF-format weights only load into a Hugging Face model, not '{base.name}'",
            )

    def _check_description(self, description: dict[str, Any]) -> None:
        # The same family and depth; every tensor's shape is checked as each layer loads. The rest
        # of the config (dropout, norm epsilon, ...) is the job's: a fine-tune may change it.
        try:
            theirs = family_from(description)
        except ConfigError as exc:
            raise ConfigError(
                self.field, f"{self.source.path} describes its model wrongly: {exc.detail}"
            ) from None
        if theirs.name != self.base.name or theirs.num_layers != self.base.num_layers:
            raise ConfigError(
                self.field,
                f"{self.source.path} holds a {theirs.name} model of {theirs.num_layers} layers, "
                f"the job's model is a {self.base.name} of {self.base.num_layers}",
            )

    num_layers = property(lambda self: self.base.num_layers)
    hidden = property(lambda self: self.base.hidden)
    max_seq_len = property(lambda self: self.base.max_seq_len)
    vocab_size = property(lambda self: self.base.vocab_size)
    tied = property(lambda self: self.base.tied)

    def layer_costs(self, seq_len: int) -> list[costs.LayerCost]:
        return self.base.layer_costs(seq_len)

    def config(self) -> dict[str, Any]:
        return self.base.config()

    def loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return self.base.loss(logits_BTV, targets_BT)

    def build_layer(self, index: int) -> nn.Module:
        layer = self.base.build_layer(index)
        load_layer(layer, self.layer_state(index, layer), f"{self.source.path}, layer {index}", self.field)
        return layer

    def build(self) -> LayerStack:
        stack = self.base.build()
        for i, layer in enumerate(stack.layers):
            state = self.layer_state(i, layer)
            load_layer(layer, state, f"{self.source.path}, layer {i}", self.field)
        return stack

    def layer_state(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        """Layer ``index``'s tensors from the source, under the layer's own keys."""
        wanted = list(layer.state_dict())
        if self.source.stack_keys:
            names = {k: f"layers.{index}.{k}" for k in wanted}
        else:
            prefixes = self.base.external_prefixes(index) or []
            names = {}
            for key in wanted:
                for local, ext in prefixes:
                    if key.startswith(local):
                        names[key] = ext + key[len(local) :]
                        break
        have = self.source.keys()
        tied = self.base.external_tied_key()
        out: dict[str, torch.Tensor] = {}
        missing = []
        for key in wanted:
            name = names.get(key)
            if name is not None and name not in have and name == "lm_head.weight" and tied in have:
                name = tied  # a tied checkpoint: the head starts as the embedding (trained untied here)
            if name is None or name not in have:
                missing.append(name or key)
                continue
            out[key] = self.source.tensor(name)
        if missing:
            raise ConfigError(
                self.field,
                f"{self.source.path} has no {', '.join(missing[:4])} (layer {index} of {self.name})",
            )
        return out


def load_layer(layer: nn.Module, state: dict[str, torch.Tensor], where: str, field: str) -> None:
    """``layer.load_state_dict(state)`` with shape and key mismatches as ConfigErrors naming ``field``."""
    own = layer.state_dict()
    for key, tensor in state.items():
        if key not in own:
            raise ConfigError(field, f"{where}: unexpected tensor {key}")
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ConfigError(
                field,
                f"{where}: {key} has shape {tuple(tensor.shape)}, the model needs {tuple(own[key].shape)}",
            )
    with torch.no_grad():
        layer.load_state_dict(state, strict=True)


def with_weights(base: ModelFamily, path: str, field: str = "init_checkpoint") -> ModelFamily:
    """``base`` loading every layer from the checkpoint at ``path`` (see ``peerd.models.weights``)."""
    return WithWeights(base, open_weights(path, field), field)
