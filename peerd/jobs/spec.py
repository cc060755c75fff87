"""The job spec: YAML -> typed, validated dataclasses, reporting every bad field at once.

A spec names what to train (``model``, ``data``), how (batch sizes, ``steps``,
``optimizer``, ``parallel`` shape, ``compression``, ``averaging``), how often to checkpoint, how many
peers may take part and how long planning may search. ``load_job_spec(path)`` and
``parse_job_spec(mapping)`` (also what decodes the spec inside a peer's job record) raise
``JobSpecError`` (a ``ConfigError``) whose ``errors`` lists every problem found, each naming
its dotted field, so ``peerd submit`` can print them all (``peerd.loading`` finds them).
Example specs: ``configs/jobs/``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from peerd.averaging.aggregate import Aggregator, ClippedMean, Mean
from peerd.compress.packing import SUPPORTED_BITS
from peerd.data.config import DataConfig, build_dataset, check_split, pin_local_source
from peerd.errors import ConfigError
from peerd.loading import ConfigProblems, Range, collect, from_mapping, load_mapping, prefixed
from peerd.models.gpt import PRESETS, GPTConfig
from peerd.models.hf import CONFIG_METADATA
from peerd.models.registry import GPTFamily, ModelFamily, hf_family
from peerd.rl.spec import RLSpec
from peerd.rl.tasks import VOCAB_SIZE, make_task
from peerd.sched.consensus.config import ConsensusTiming

Auto = Literal["auto"]
# first-visit codecs (peerd.compress.codecs registry names) and the bits a value costs on the wire
FIRST_VISIT_BITS = {"q8": 8, "q4": 4, "q3": 3, "q2": 2, "fp16": 16, "bf16": 16, "fp32": 32}
DEFAULT_FIRST_VISIT = "q8"
Count = Annotated[int, Range(ge=1)]
INT32_MAX = 2**31 - 1  # counts must fit the int32 indices and schedules that hold them


@dataclass(frozen=True)
class ModelChoice:
    """The model a job asks for: exactly one of ``preset`` and ``hf``."""

    preset: str | None = None
    """A built-in GPT size (``peerd.models.gpt.PRESETS``: tiny, tiny-4, mini, gpt2, ...)."""
    overrides: dict[str, int | float | bool | None] = field(default_factory=dict)
    """``GPTConfig`` fields replacing the preset's (e.g. ``n_layer: 12``); presets only."""
    hf: str | dict[str, Any] | None = None
    """A Hugging Face causal LM (needs ``transformers``): a config mapping (``model_type: gpt2`` or
    ``llama`` plus that config's fields, e.g. ``n_layer``, ``n_embd``), or the path of a
    ``config.json`` or ``save_pretrained`` directory, which ``load_job_spec`` (``peerd submit``)
    reads into the mapping, so the published job carries the config itself. The embedding and
    LM head must be untied (``tie_word_embeddings: false``) unless the job runs one stage."""
    seed: Annotated[int, Range(ge=0, lt=2**63)] = 0  # torch.manual_seed takes 64 bits
    """Initial-weight seed: every peer builds identical layers from it."""

    def problems(self) -> list[ConfigError]:
        if (self.preset is None) == (self.hf is None):
            return [
                ConfigError(
                    "preset", "give exactly one of 'preset' (built-in GPT) and 'hf' (Hugging Face config)"
                )
            ]
        if self.hf is not None:
            out = []
            if isinstance(self.hf, str):
                out.append(
                    ConfigError(
                        "hf",
                        f"{self.hf!r} is a path, which means nothing on another peer: a published job "
                        "carries its config inline (load_job_spec / peerd submit read the file into it)",
                    )
                )
            else:
                try:
                    self.family()
                except ConfigError as exc:
                    out += [ConfigError(e.field.removeprefix("model."), e.detail) for e in exc.errors]
            if self.overrides:
                out.append(ConfigError("overrides", "only applies to a built-in preset, not to 'hf'"))
            return out
        if self.preset not in PRESETS:
            return [
                ConfigError("preset", f"unknown GPT preset {self.preset!r} (known: {', '.join(PRESETS)})")
            ]
        return [
            prefixed("overrides", e)
            for e in collect(GPTConfig, {**PRESETS[self.preset], **self.overrides})[1]
        ]

    def gpt_config(self) -> GPTConfig:
        """The preset with ``overrides`` applied, type-checked and validated like any config."""
        assert self.preset is not None
        return from_mapping(GPTConfig, {**PRESETS[self.preset], **self.overrides})

    def family(self) -> ModelFamily:
        """The model (``peerd.models.registry``): its layers, shape and costs, from the seed's init."""
        if self.hf is not None:
            assert isinstance(self.hf, dict), "an hf path is inlined by load_job_spec"
            return hf_family(self.hf, self.seed)
        return GPTFamily(self.gpt_config(), self.seed)


@dataclass(frozen=True)
class OptimizerSpec:
    """What every stage worker trains with (``peerd.pipeline.optim``); every field here is run, none ignored."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    """``adamw`` (decoupled weight decay), ``adam`` (L2 decay in the gradient) or ``sgd``."""
    lr: Annotated[float, Range(gt=0, lt=10)] = 3e-4
    """Peak learning rate."""
    betas: Annotated[tuple[float, float] | None, Range(ge=0, lt=1)] = None
    """Adam/AdamW only; default (0.9, 0.95)."""
    momentum: Annotated[float | None, Range(ge=0, lt=1)] = None
    """SGD only; default 0."""
    weight_decay: Annotated[float, Range(ge=0)] = 0.0
    warmup_steps: Annotated[int, Range(ge=0)] = 0
    """Linear warm-up to ``lr``: step ``s`` below it runs at ``lr × (s + 1) / warmup_steps``."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warm-up: cosine or linear decay to ``min_lr_ratio × lr`` at the last step, or constant."""
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    grad_clip: Annotated[float | None, Range(gt=0)] = 1.0
    """Clip to this L2 norm of the whole model's gradient (all stages of a replica); null disables it."""

    def problems(self) -> list[ConfigError]:
        used = [("betas", ("adamw", "adam")), ("momentum", ("sgd",))]
        return [
            ConfigError(key, f"only used by {' or '.join(by)}, not {self.name}")
            for key, by in used
            if getattr(self, key) is not None and self.name not in by
        ]


@dataclass(frozen=True)
class ParallelSpec:
    d_pp: Annotated[int | Auto, Range(ge=1)] = "auto"
    """Pipeline stages, or ``auto``: the planner picks the shape."""
    d_dp: Annotated[int | Auto, Range(ge=1)] = "auto"
    """Data-parallel replicas per stage, or ``auto``."""

    def known(self) -> dict[str, int]:
        """The fixed dimensions (those that are valid)."""
        return {n: v for n, v in (("d_pp", self.d_pp), ("d_dp", self.d_dp)) if isinstance(v, int) and v >= 1}


@dataclass(frozen=True)
class CompressionSpec:
    """What crosses the network, and at how many bits (``SUPPORTED_BITS``; null = uncompressed)."""

    forward: Literal["acsgd", "direct", "none"] = "acsgd"
    """Activations: AC-SGD deltas against per-example buffers, direct quantization, or raw."""
    forward_bits: int | None = 4
    backward_bits: int | None = 8
    """Activation gradients sent back up the pipeline."""
    gradient_bits: int | None = None
    """Data-parallel gradient averaging (with error feedback)."""
    first_visit: str | None = None
    """``acsgd`` only: the codec of an example's first visit, which has no buffered activation to
    send a delta against (and of examples beyond the buffers' room): ``q8`` (the default), ``q4``,
    ``q3``, ``q2`` (direct quantization at that width), ``fp16``, ``bf16`` or ``fp32`` (raw). In a
    single pass over the data every activation is a first visit: see ``peerd.jobs.regime``."""

    def problems(self) -> list[ConfigError]:
        allowed = ", ".join(map(str, SUPPORTED_BITS))
        out = [
            ConfigError(name, f"must be one of {allowed} or null, got {bits}")
            for name in ("forward_bits", "backward_bits", "gradient_bits")
            if (bits := getattr(self, name)) is not None and bits not in SUPPORTED_BITS
        ]
        if self.forward == "none" and self.forward_bits is not None:
            out.append(ConfigError("forward_bits", "must be null when forward is 'none'"))
        if self.forward != "none" and self.forward_bits is None:
            out.append(ConfigError("forward_bits", f"forward '{self.forward}' needs a bit width"))
        if self.first_visit is not None and self.forward != "acsgd":
            out.append(ConfigError("first_visit", f"applies to forward: acsgd only, not {self.forward!r}"))
        elif self.first_visit is not None and self.first_visit not in FIRST_VISIT_BITS:
            known = ", ".join(FIRST_VISIT_BITS)
            out.append(ConfigError("first_visit", f"must be one of {known}, got {self.first_visit!r}"))
        return out

    @property
    def first_visit_codec(self) -> str | None:
        """The codec first visits go through (None unless ``forward`` is ``acsgd``)."""
        if self.forward != "acsgd":
            return None
        return self.first_visit or DEFAULT_FIRST_VISIT


@dataclass(frozen=True)
class AveragingSpec:
    """How data-parallel replicas combine their gradients."""

    aggregator: Literal["mean", "clipped"] = "mean"
    """``mean``: the plain mean, the same bits on every replica as one process computing the whole
    batch. ``clipped``: a robust mean for replicas that may be hostile: each replica's contribution
    to a share of the gradients is first cut to ``clip_ratio`` x the median contribution norm, so one
    replica sending huge gradients moves the mean by at most ``clip_ratio x median / d_dp`` instead
    of arbitrarily. It bounds one outlier among 3 or more replicas (with 2 the median is their mean)."""
    clip_ratio: Annotated[float | None, Range(ge=1, le=1e6)] = None
    """``clipped`` only: the bound over the median norm (default 2)."""

    def problems(self) -> list[ConfigError]:
        if self.aggregator == "mean" and self.clip_ratio is not None:
            return [ConfigError("clip_ratio", "applies to aggregator: clipped only")]
        return []

    def build(self) -> Aggregator:
        """The aggregator every reducer of the job's averaging groups combines contributions with."""
        if self.aggregator == "clipped":
            return ClippedMean(2.0 if self.clip_ratio is None else self.clip_ratio)
        return Mean()


@dataclass(frozen=True)
class PlanningSpec:
    time_budget_s: Annotated[float, Range(gt=0, le=3600)] = 30.0
    """Seconds each peer's search island runs per planning epoch."""
    examples: Annotated[int | None, Range(ge=1, le=2**62)] = None
    """Training examples (windows) the data holds: with ``steps x global_batch`` it gives the visits
    per example, which decide how much AC-SGD compresses (``peerd.jobs.regime``; refused where
    activations do not go as AC-SGD deltas). ``peerd submit`` fills it in from the corpus as read
    where the job is submitted; null (an ``hf`` source): priced as a single pass, every activation
    a first visit."""
    objective: Literal["peerd", "dtfm"] = "peerd"
    """Cost model every peer scores candidates with (``peerd`` includes compute and memory)."""
    max_skew_s: Annotated[float, Range(ge=0, le=60)] = 3.0
    """Clock disagreement between peers that planning tolerates (hivemind assumes ~3 s). Every
    protocol window lasts 10/3 of it (at least 1 s), so the default gives 10 s windows; peers
    sharing one machine's clock (``peerd demo``, tests) can use 0.5-1."""
    placement: Literal["search", "random"] = "search"
    """``search``: the evolutionary search picks the allocation; ``random``: the Megatron-like
    baseline (``peerd.sched.placement``), ranks in a seeded random order of the roster that every
    peer derives from the job id and ``placement_seed``. ``random`` needs fixed parallel d_pp and d_dp."""
    placement_seed: Annotated[int, Range(ge=0, lt=2**63)] = 0
    """Seed of the ``random`` placement (change it to draw another order)."""

    def timing(self) -> ConsensusTiming:
        window = max(1.0, round(self.max_skew_s * 10 / 3, 3))
        return ConsensusTiming(
            roster_s=window,
            settle_s=window,
            search_s=self.time_budget_s,
            exchange_s=window,
            vote_s=window,
            adopt_s=window,
            max_skew_s=self.max_skew_s,
            publish_interval_s=min(2.0, max(0.5, round(window / 5, 3))),
        )


@dataclass(frozen=True)
class JobSpec:
    """One training job, as its owner submits it."""

    kind: str
    """``pretrain`` from fresh weights, ``finetune`` from ``init_checkpoint``, or ``rl``: GRPO
    post-training on a verifiable task (the ``rl`` section; how it reads the other fields:
    ``peerd.rl.spec``)."""
    model: ModelChoice
    steps: Count
    """Optimizer steps to run."""
    global_batch: Count
    """Examples per optimizer step, over all replicas."""
    micro_batch: Count
    """Examples per pipeline micro-batch."""
    name: str = ""
    """Free-form label shown by ``peerd jobs`` / ``peerd status``."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training text and the sequence length (``data.seq_len``)."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    compression: CompressionSpec = field(default_factory=CompressionSpec)
    averaging: AveragingSpec = field(default_factory=AveragingSpec)
    """How the data-parallel replicas (an rl job's trainers) combine their gradients."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision of every stage: fp32, or bf16 / fp16 autocast (master weights, optimizer
    state and the wire stay fp32). fp16 uses a dynamic loss scale; a step that overflows anywhere is
    skipped by every stage and replica."""
    checkpoint_interval: Count = 100
    """Steps between checkpoints (every stage, atomically); the last step always checkpoints."""
    init_checkpoint: str | None = None
    """``finetune`` (required) and ``rl`` (optional): the weights every stage (an rl job's policy,
    before ``rl.warmup``) starts from instead of the seed's init: a ``peerd fetch`` output
    (``model.pt`` or its directory) of the same model, or Hugging Face weights of the ``model.hf``
    model (a ``.safetensors`` file or a ``save_pretrained`` directory; not for rl). There is no file
    transfer for it: it must be readable at this same path on every peer that gets a tasklet (an rl
    job's trainers; rollout peers take the policy from them), and a tasklet that cannot read it
    fails naming this field."""
    min_peers: Count = 1
    """Planning waits for at least this many peers."""
    max_peers: Annotated[int | None, Range(ge=1)] = None
    """At most this many peers take part (null: no limit)."""
    planning: PlanningSpec = field(default_factory=PlanningSpec)
    rl: RLSpec | None = None
    """``kind: rl`` only: the task, group size, sampling, loss and warm-up (defaults if left out)."""

    def rl_settings(self) -> RLSpec:
        """The ``rl`` section with its defaults (an ``rl`` job may leave it out)."""
        return self.rl if self.rl is not None else RLSpec()

    def rl_trainer_counts(self) -> tuple[int, ...]:
        """How many data-parallel trainers an ``rl`` job may run: ``parallel.d_dp``, or with ``auto``
        every count that splits an update's groups equally (the consensus chooses among them)."""
        if isinstance(self.parallel.d_dp, int):
            return (self.parallel.d_dp,)
        # sizes out of range are reported by the checks; here they count as one group
        groups = max(1, self.micro_batch // max(1, self.rl_settings().group_size))
        return tuple(r for r in range(1, groups + 1) if groups % r == 0)

    def problems(self) -> list[ConfigError]:
        """The checks between fields and sections (each section checked itself already)."""
        out = self._kind_problems() + self._size_problems() + self._batch_problems() + self._peer_problems()
        out += self._validation_problems() + self._averaging_problems()
        if self.planning.examples is not None and not self.prices_visits:
            out.append(
                ConfigError(
                    "planning.examples",
                    "prices AC-SGD's regime: applies to a pipeline job with compression.forward: acsgd only",
                )
            )
        if self.planning.placement == "random" and len(self.parallel.known()) < 2:
            out.append(
                ConfigError("planning.placement", "random needs fixed parallel d_pp and d_dp, not auto")
            )
        if not self.model.problems():
            out += self._model_fit(self.model.family())
        return out

    @property
    def prices_visits(self) -> bool:
        """Whether the visits per example decide what its activations cost (``peerd.jobs.regime``)."""
        return self.kind != "rl" and self.compression.forward == "acsgd"

    def _kind_problems(self) -> list[ConfigError]:
        if self.kind not in ("pretrain", "finetune", "rl"):
            return [ConfigError("kind", f"must be 'pretrain', 'finetune' or 'rl', got {self.kind!r}")]
        if self.kind == "rl":
            return self._rl_problems()
        if self.rl is not None:
            return [ConfigError("rl", f"only used by kind 'rl', not {self.kind!r}")]
        if self.kind == "finetune" and self.init_checkpoint is None:
            return [ConfigError("init_checkpoint", "finetune needs a checkpoint to start from")]
        if self.kind == "pretrain" and self.init_checkpoint is not None:
            return [
                ConfigError("init_checkpoint", "only used by finetune (pretrain starts from fresh weights)")
            ]
        return []

    def _rl_problems(self) -> list[ConfigError]:
        """What an ``rl`` job's runtime can honour (see ``peerd.rl.spec``); the rest is refused by name."""
        rl, out = self.rl_settings(), []
        if self.model.hf is not None:
            out.append(
                ConfigError("model.hf", "rl jobs sample with the built-in GPT's KV cache: use model.preset")
            )
        if self.precision != "fp32":
            out.append(ConfigError("precision", f"rl jobs train in fp32, got {self.precision}"))
        if self.planning.objective != "peerd":
            out.append(
                ConfigError(
                    "planning.objective", "rl jobs are scored by the RL cost model: leave it at peerd"
                )
            )
        if self.data != DataConfig():
            out.append(ConfigError("data", "rl jobs take their problems from rl.task: leave data out"))
        # the fewest trainers it may run (``auto``: one) and the most (what averaging settings need)
        trainers = self.parallel.d_dp if isinstance(self.parallel.d_dp, int) else 1
        most = max(self.rl_trainer_counts())
        if dataclasses.replace(self.compression, gradient_bits=None) != CompressionSpec():
            out.append(
                ConfigError(
                    "compression",
                    "rl jobs have no pipeline streams: only compression.gradient_bits applies",
                )
            )
        for name, default in (
            ("compression.gradient_bits", self.compression.gradient_bits is None),
            ("averaging", self.averaging == AveragingSpec()),
        ):
            if not default and most < 2:
                why = (
                    "a lone trainer averages no gradients: set parallel.d_dp >= 2 or leave it out"
                    if isinstance(self.parallel.d_dp, int)
                    else f"an update of {self.micro_batch} completions is one group: parallel.d_dp auto "
                    "can only run one trainer, which averages no gradients; leave it out"
                )
                out.append(ConfigError(name, why))
        if self.parallel.d_pp not in ("auto", 1):
            out.append(
                ConfigError(
                    "parallel.d_pp",
                    f"rl jobs run one stage (data-parallel trainers: d_dp): must be 1 or auto, got {self.parallel.d_pp}",
                )
            )
        if self.max_peers is not None and self.max_peers < trainers + rl.min_rollout_peers:
            out.append(
                ConfigError(
                    "rl.min_rollout_peers",
                    f"{rl.min_rollout_peers} rollout peers beside {trainers} trainer(s) need max_peers >= "
                    f"{trainers + rl.min_rollout_peers}, got {self.max_peers}",
                )
            )
        g = rl.group_size
        if min(g, self.global_batch, self.micro_batch) < 1:
            pass  # their bounds are reported already
        elif self.global_batch % g:
            out.append(
                ConfigError(
                    "global_batch",
                    f"completions per iteration: a multiple of rl.group_size={g}, got {self.global_batch}",
                )
            )
        elif self.micro_batch % g or self.global_batch % self.micro_batch:
            out.append(
                ConfigError(
                    "micro_batch",
                    f"completions per update: whole groups of rl.group_size={g} dividing "
                    f"global_batch={self.global_batch}, got {self.micro_batch}",
                )
            )
        elif (self.micro_batch // g) % trainers:
            out.append(
                ConfigError(
                    "micro_batch",
                    f"each of parallel.d_dp={trainers} trainers takes an equal share of an update's "
                    f"{self.micro_batch // g} groups: must be a multiple of {trainers} groups of {g}, "
                    f"got {self.micro_batch}",
                )
            )
        if self.model.preset is not None and not self.model.problems():
            try:
                need = make_task(rl.task).max_prompt_len + rl.sampling.max_new_tokens
            except ConfigError:  # the task section's own problems are reported field by field already
                return out
            cfg = self.model.gpt_config()
            if cfg.vocab_size != VOCAB_SIZE:  # a wider vocabulary samples tokens no task can decode
                out.append(
                    ConfigError(
                        "model",
                        f"rl tasks speak bytes: the model's vocab_size must be {VOCAB_SIZE}, got {cfg.vocab_size}",
                    )
                )
            room = cfg.max_seq_len
            if need > room:
                out.append(
                    ConfigError(
                        "rl.sampling.max_new_tokens",
                        f"the longest prompt plus the completion ({need} tokens) exceeds max_seq_len {room}",
                    )
                )
        return out

    def _size_problems(self) -> list[ConfigError]:
        """Numbers no run can use (a peer's record may carry anything): above int32, or a decay >= 10."""
        out = [
            ConfigError(name, f"must be <= {INT32_MAX}, got {getattr(self, name)}")
            for name in ("steps", "global_batch", "micro_batch", "checkpoint_interval", "min_peers")
            if getattr(self, name) > INT32_MAX
        ]
        if self.optimizer.weight_decay >= 10:
            decay = self.optimizer.weight_decay
            out.append(ConfigError("optimizer.weight_decay", f"must be < 10, got {decay}"))
        return out

    def _batch_problems(self) -> list[ConfigError]:
        out: list[ConfigError] = []
        if min(self.steps, self.global_batch, self.micro_batch) < 1:
            return out  # their bounds are reported already
        # an rl job's micro_batch is a whole update's completions, shared by its d_dp trainers
        d_dp = self.parallel.known().get("d_dp", 1) if self.kind != "rl" else 1
        if self.global_batch % (self.micro_batch * d_dp):
            what = f"micro_batch × d_dp = {self.micro_batch} × {d_dp}" if d_dp > 1 else "micro_batch"
            out.append(ConfigError("global_batch", f"must be a multiple of {what}, got {self.global_batch}"))
        if self.optimizer.warmup_steps >= self.steps:
            out.append(
                ConfigError(
                    "optimizer.warmup_steps",
                    f"must be < steps ({self.steps}), got {self.optimizer.warmup_steps}",
                )
            )
        return out

    def _validation_problems(self) -> list[ConfigError]:
        """An evaluation must fit the held-out windows (a ``fraction`` is checked once the corpus is read)."""
        val = self.data.validation
        if val is None or val.windows is None or min(val.batches, self.global_batch) < 1:
            return []
        need = val.batches * self.global_batch
        if need > val.windows:
            return [
                ConfigError(
                    "data.validation.batches",
                    f"{val.batches} x global_batch {self.global_batch} = {need} windows per evaluation, "
                    f"more than the {val.windows} held out",
                )
            ]
        return []

    def _averaging_problems(self) -> list[ConfigError]:
        if self.kind == "rl" or self.averaging == AveragingSpec():
            return []  # an rl job's trainers: _rl_problems
        if self.parallel.known().get("d_dp") == 1:
            return [ConfigError("averaging", "d_dp 1 averages no gradients: leave averaging out")]
        return []

    def _peer_problems(self) -> list[ConfigError]:
        if self.max_peers is not None and self.max_peers < self.min_peers:
            return [
                ConfigError("max_peers", f"must be >= min_peers ({self.min_peers}), got {self.max_peers}")
            ]
        shape = self.parallel.known()
        if len(shape) < 2:
            return []
        need = shape["d_pp"] * shape["d_dp"]
        if self.min_peers < need:
            return [
                ConfigError(
                    "min_peers",
                    f"d_pp × d_dp = {need} tasklets need min_peers >= {need}, got {self.min_peers}",
                )
            ]
        return []

    def _model_fit(self, model: ModelFamily) -> list[ConfigError]:
        out = []
        d_pp = self.parallel.known().get("d_pp")
        if d_pp is not None and d_pp > model.num_layers:
            out.append(
                ConfigError(
                    "parallel.d_pp", f"the model has {model.num_layers} layers to split, got {d_pp} stages"
                )
            )
        if self.data.seq_len > model.max_seq_len:
            out.append(
                ConfigError(
                    "data.seq_len",
                    f"exceeds the model's max_seq_len {model.max_seq_len}, got {self.data.seq_len}",
                )
            )
        if model.vocab_size < 256:
            out.append(
                ConfigError(
                    "model", f"byte-level data needs vocab_size >= 256, the model has {model.vocab_size}"
                )
            )
        return out


class JobSpecError(ConfigProblems):
    """A job spec with one or more problems; ``errors`` holds each (dotted ``field`` and ``detail``)."""

    def __init__(self, errors: list[ConfigError], source: str = "") -> None:
        super().__init__(errors, "the job spec", source)


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file (YAML or JSON); a ``model.hf`` path is read into its mapping,
    a local text corpus's paths are made absolute and its digest pinned (``pin_local_source``), a
    validation split is checked against the corpus as read here (``check_split``) and its training
    examples counted (``pin_examples``)."""
    spec = parse_job_spec(inline_hf_config(load_mapping(path), source=str(path)), source=str(path))
    try:
        data = pin_local_source(spec.data)
        check_split(data, spec.global_batch)
        return pin_examples(dataclasses.replace(spec, data=data))
    except ConfigError as exc:
        raise JobSpecError(exc.errors, str(path)) from None


def pin_examples(spec: JobSpec) -> JobSpec:
    """``spec`` with ``planning.examples`` counted on its corpus as read here (what the planner's
    visits per example need); returned unchanged when it states them, for an ``hf`` source (not
    read at submit) and where they price nothing (an rl job, activations not sent as AC-SGD
    deltas). ConfigError if the corpus cannot be read or cut into windows."""
    if not spec.prices_visits or spec.planning.examples is not None or spec.data.source == "hf":
        return spec
    examples = len(build_dataset(spec.data))
    return dataclasses.replace(spec, planning=dataclasses.replace(spec.planning, examples=examples))


def inline_hf_config(data: Any, source: str = "") -> Any:
    """``data`` with a ``model.hf`` path (a ``config.json`` or a directory holding one) replaced by the
    config mapping it holds, so the spec means the same on every peer."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return data
    path = data["model"].get("hf")
    if not isinstance(path, str):
        return data
    file = Path(path)
    try:
        if file.is_dir():  # inside the try: a path the OS refuses (too long, NUL) is the spec's error too
            file = file / "config.json"
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        why = "no such file or directory" if isinstance(exc, FileNotFoundError) else str(exc)
        raise JobSpecError([ConfigError("model.hf", f"{path}: {why}")], source) from None
    if not isinstance(config, dict):
        raise JobSpecError([ConfigError("model.hf", f"{file}: not a config mapping")], source)
    config = {k: v for k, v in config.items() if k not in CONFIG_METADATA}
    return {**data, "model": {**data["model"], "hf": config}}


def parse_job_spec(data: Any, source: str = "") -> JobSpec:
    """Validate a mapping (a parsed file, or the spec inside a peer's job record) into a ``JobSpec``."""
    spec, errors = collect(JobSpec, data)
    if errors:
        raise JobSpecError(errors, source)
    assert spec is not None
    return spec
