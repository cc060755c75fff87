"""The training configuration every stage worker of a pipeline job runs with (typed, loadable from YAML/JSON)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from peerd.data.config import DataConfig
from peerd.errors import ConfigError
from peerd.models.gpt import PRESETS, GPTConfig
from peerd.models.registry import GPTFamily, ModelFamily, hf_family, with_weights
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.optim import OptimizerConfig, with_shorthands
from peerd.pipeline.partition import validate_layers_per_stage
from peerd.pipeline.schedule import available_schedules
from peerd.pipeline.streams import StreamConfig

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_JOB_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True)
class ModelBuild:
    """What the stage workers build: a built-in GPT preset (with overrides) or a Hugging Face config,
    the init seed, and optionally the checkpoint every layer starts from instead."""

    preset: str = "tiny"
    """A ``peerd.models.gpt.PRESETS`` name (ignored when ``hf`` is set)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """GPTConfig fields replacing the preset's (e.g. ``{n_layer: 4, d_model: 128}``)."""
    hf: dict[str, Any] | None = None
    """A Hugging Face config mapping (``model_type: gpt2 | llama`` + its fields) instead of a preset."""
    seed: int = 0
    """Initialisation seed (every stage builds its own layers from it)."""
    init_checkpoint: str | None = None
    """Weights every layer loads instead of the seed's init: a ``peerd fetch`` model file, a
    safetensors file or a ``save_pretrained`` directory; read from this path on every peer."""

    def gpt(self) -> GPTConfig:
        if self.hf is not None:
            raise ConfigError("model.hf", "a Hugging Face model has no GPTConfig; use family()")
        unknown = sorted(set(self.overrides) - {f.name for f in dataclasses.fields(GPTConfig)})
        if unknown:
            raise ConfigError(f"model.overrides.{unknown[0]}", "not a GPTConfig field")
        if self.preset not in PRESETS:
            raise ConfigError("model.preset", f"unknown preset {self.preset!r} (known: {', '.join(PRESETS)})")
        return GPTConfig.preset(self.preset, **self.overrides)

    def base(self) -> ModelFamily:
        """The model's shape and seeded init, without opening ``init_checkpoint``."""
        if self.hf is not None:
            if self.overrides:
                raise ConfigError("model.overrides", "only applies to a built-in preset, not to 'hf'")
            return hf_family(self.hf, self.seed)
        return GPTFamily(self.gpt(), self.seed)

    def family(self) -> ModelFamily:
        """The model a stage worker builds its layers from (``peerd.models.registry``); with
        ``init_checkpoint``, each layer loads its slice of it (ConfigError naming the field when the
        file is missing here, unreadable or of another model)."""
        base = self.base()
        return base if self.init_checkpoint is None else with_weights(base, self.init_checkpoint)


@dataclass(frozen=True)
class TrainConfig:
    """A pipeline-parallel training run: model, data, batch geometry, optimizer, compression, checkpoints."""

    job: str = "job"
    """Job id: names the stream protocols and checkpoint files (letters, digits, ``._-``)."""
    model: ModelBuild = field(default_factory=ModelBuild)
    data: DataConfig = field(default_factory=lambda: DataConfig(seq_len=32, max_bytes=256 * 1024))
    layers_per_stage: list[int] = field(default_factory=lambda: [2, 2])
    """Layers of ``GPT.layers`` (embedding + blocks + head) per stage, in order."""
    global_batch: int = 8
    """Examples per optimizer step, over all data-parallel replicas."""
    micro_batch_size: int = 2
    """Examples per micro-batch within a replica."""
    steps: int = 20
    """Optimizer steps to run (from the start or the resumed step)."""
    schedule: str = "1f1b"
    """Micro-batch schedule: ``gpipe`` or ``1f1b``."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer, learning-rate schedule (over ``steps``) and global-norm gradient clipping."""
    lr: float | None = None
    """Shorthand for ``optimizer.lr`` (folded into ``optimizer`` when built, then None)."""
    weight_decay: float | None = None
    """Shorthand for ``optimizer.weight_decay`` (folded into ``optimizer`` when built, then None)."""
    data_seed: int = 0
    """Seed of the (seed, epoch, replica) shuffle."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    streams: StreamConfig = field(default_factory=StreamConfig)
    averaging_timeout_s: float = 120.0
    """Seconds a data-parallel gradient average may go without progress in an epoch's first steps;
    then the limit follows the step times as the neighbours' waits do (``streams.deadlines``)."""
    checkpoint_dir: str | None = None
    """Where stages save checkpoints (one subdirectory per job, stage and replica); None: never."""
    checkpoint_every: int = 0
    """Save every this many steps (0: only on clean shutdown)."""
    keep_checkpoints: int = 2
    """Checkpoints kept per stage replica (older ones are deleted after a save)."""
    retain_checkpoints_s: float = 0.0
    """Older checkpoints are deleted only once they are this many seconds old (churn recovery
    rolls the other stages back to the step of a dead stage's newest checkpoint copy)."""
    rollback: bool = False
    """Keep a host copy of the state from before the last update, so a worker can serve the step
    before its current one too (churn recovery: survivors one update apart resume together)."""
    device: str = "auto"
    """Where the stage computes and keeps its module, optimizer state, AC-SGD codecs and buffers
    and data batches: ``auto`` (the first CUDA device, else MPS, else the CPU), ``cpu``,
    ``cuda``, ``cuda:N`` or ``mps``. Each peer sets its own (the daemon's ``--device``)."""
    precision: Precision = "fp32"
    """Compute precision: ``fp32``, or autocast to ``bf16`` / ``fp16`` (``fp16`` with a dynamic loss
    scale: every stage and replica skips the steps where any gradient overflowed). Master weights, optimizer state, gradients and
    everything on the wire (activations and their gradients as float32) stay fp32."""

    def __post_init__(self) -> None:
        # one source of truth: the shorthands only ever live in ``optimizer``
        if self.lr is not None or self.weight_decay is not None:
            object.__setattr__(self, "optimizer", with_shorthands(self.optimizer, self.lr, self.weight_decay))
            object.__setattr__(self, "lr", None)
            object.__setattr__(self, "weight_decay", None)

    def validate(self) -> None:
        if not self.job or len(self.job) > 64 or not set(self.job) <= _JOB_CHARS:
            raise ConfigError("job", f"{self.job!r}: 1-64 characters from letters, digits and '._-'")
        model = self.model.base()
        validate_layers_per_stage(model.num_layers, self.layers_per_stage)
        if model.tied and len(self.layers_per_stage) > 1:
            raise ConfigError(
                "model",
                "tied embedding/head weights span stages; untie them (tie_weights / tie_word_embeddings)",
            )
        if self.data.seq_len > model.max_seq_len:
            raise ConfigError(
                "data.seq_len", f"{self.data.seq_len} exceeds the model's max_seq_len {model.max_seq_len}"
            )
        for name in ("global_batch", "micro_batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.schedule not in available_schedules():
            raise ConfigError(
                "schedule", f"unknown {self.schedule!r} (known: {', '.join(available_schedules())})"
            )
        if not _DEVICE.match(self.device):
            raise ConfigError("device", f"{self.device!r}: expected auto, cpu, cuda, cuda:N or mps")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", f"{self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError("checkpoint_every", "must be >= 0, and keep_checkpoints >= 1")
        if not self.retain_checkpoints_s >= 0:
            raise ConfigError("retain_checkpoints_s", f"must be >= 0, got {self.retain_checkpoints_s}")
        if not self.averaging_timeout_s > 0:
            raise ConfigError("averaging_timeout_s", f"must be > 0, got {self.averaging_timeout_s}")
        self.optimizer.validate()
        self.compression.validate()
        self.streams.validate()

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    def replica_batch(self, replicas: int) -> int:
        if self.global_batch % replicas:
            raise ConfigError("global_batch", f"{self.global_batch} does not split over {replicas} replicas")
        return self.global_batch // replicas
