"""The RL post-training workload: the models, the rollout batch, and the constants of the cost model.

All sizes are plain counts or bytes; the YAML gives the same names. ``Workload`` is the
``workload:`` section of an RL scenario file (see ``peerd.sched.rl.scenario``)::

    workload:
      name: qwen-8b
      algo: grpo                 # or ppo (adds the critic)
      actor: {params: 8.2e+9, layers: 36, hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128}
      reward: {...}              # optional: a reward model; omitted = rule-based (no model)
      prompts: 1024
      responses_per_prompt: 8
      prompt_len: 1024
      response_len: 1024
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from peerd.errors import ConfigError
from peerd.loading import Range
from peerd.sched.elements import PerFamily

Algo = Literal["grpo", "ppo"]
WeightSync = Literal["relay", "star"]
Count = Annotated[int, Range(ge=1)]
Fraction = Annotated[float, Range(gt=0, le=1)]
Bytes = Annotated[float, Range(gt=0)]


@dataclass
class ModelSize:
    """One transformer of the workflow, as far as its cost and memory go."""

    params: Annotated[float, Range(gt=0)]
    """Total parameters (embeddings included)."""
    layers: Count
    """Transformer blocks (the unit a pipeline stage holds)."""
    hidden: Count
    """Hidden size (activations per token are ``hidden`` values)."""
    heads: Count
    """Attention (query) heads."""
    kv_heads: Annotated[int | None, Range(ge=1)] = None
    """Key/value heads (grouped-query attention); default ``heads``."""
    head_dim: Annotated[int | None, Range(ge=1)] = None
    """Size of one head; default ``hidden // heads``."""
    vocab: Count = 151_936
    """Vocabulary size (the logits of the last stage); Qwen's by default."""
    name: str = ""
    matmul_params: Annotated[float | None, Range(gt=0)] = None
    """Weights a token's forward multiplies (2 FLOPs each; read once per decode step); default
    ``params``. Embedding lookups touch a row each: for a tiny model they are a large share of its
    parameters and none of its arithmetic."""

    @property
    def flop_params(self) -> float:
        return self.params if self.matmul_params is None else self.matmul_params

    def problems(self) -> list[ConfigError]:
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            return [ConfigError("kv_heads", f"must divide heads ({self.heads}), got {kv}")]
        return []

    def kv_bytes_per_token(self, element_bytes: float) -> float:
        """KV-cache bytes one token holds over all layers: 2 (K and V) x layers x kv_heads x head_dim."""
        kv = self.kv_heads or self.heads
        dim = self.head_dim or self.hidden // self.heads
        return 2.0 * self.layers * kv * dim * element_bytes


@dataclass
class CostConstants:
    """Efficiencies and element sizes of the cost model (defaults: bf16 mixed precision with Adam)."""

    compute_efficiency: Fraction = 0.4
    """Achieved / peak FLOP/s of dense matmuls (model FLOPs utilisation)."""
    memory_efficiency: Fraction = 0.8
    """Achieved / peak memory bandwidth while decoding."""
    memory_usable: Fraction = 0.9
    """Share of device memory a plan may fill (the rest: CUDA context, fragmentation)."""
    weight_bytes: Bytes = 2.0
    """Bytes per parameter of weights in use and on the wire (bf16)."""
    grad_bytes: Bytes = 2.0
    """Bytes per parameter of gradients, held and all-reduced (bf16)."""
    grad_wire_bytes: Annotated[float | None, Range(gt=0)] = None
    """Bytes per parameter of gradients on the data-parallel all-reduce's wire, when the runtime
    compresses them (None: ``grad_bytes``)."""
    fsdp_reduce_bytes: Bytes = 4.0
    """Bytes per parameter of gradients reduce-scattered under FSDP (the verl-like baseline): verl's
    FSDP workers reduce in fp32 unless configured otherwise."""
    optimizer_bytes: Bytes = 12.0
    """Bytes per parameter of fp32 master weights + Adam moments, sharded over data-parallel replicas."""
    kv_bytes: Bytes = 2.0
    """Bytes per KV-cache element (bf16)."""
    activation_bytes: Bytes = 2.0
    """Bytes per activation element on the wire and in checkpoints (bf16)."""
    logit_bytes: Bytes = 4.0
    """Bytes per logit held for log-probabilities (fp32)."""
    layer_work_bytes_per_token: Annotated[float, Range(gt=0)] = 34.0
    """Working-set bytes per token per hidden unit of one layer's forward+backward (34 s b h; Korthikanti et al. 2022)."""
    recompute: bool = True
    """Activation checkpointing in training: keep one input per layer, redo the forward (4x forward FLOPs, not 3x)."""
    token_id_bytes: Bytes = 4.0
    """Bytes per token of a rollout sent between groups (int32 ids)."""
    score_bytes: Bytes = 4.0
    """Bytes per scored token (log-prob, value) sent to the trainers (fp32)."""

    def allreduce_grad_bytes(self) -> float:
        """Bytes per parameter of gradients a data-parallel all-reduce moves."""
        return self.grad_bytes if self.grad_wire_bytes is None else self.grad_wire_bytes


@dataclass
class Launches:
    """Device ops the runtime dispatches per unit of work, counted on its own code (default: none).

    Each op costs a device's ``launch_us`` on top of its arithmetic: negligible for large models,
    the whole cost of tiny ones (a 2-layer GPT of width 32 dispatches ~500 ops to sample a batch of
    three tokens, each ~6 µs on a CPU, against microseconds of FLOPs). Counts per replica; a
    pipeline stage of pp takes 1/pp of the per-micro-batch and per-step counts. The ``*_bytes*``
    fields are the memory traffic of those ops beyond the weights the arithmetic reads (softmaxes,
    norms, the KV cache, gradients, optimizer moments), each byte costing 1 / the device's memory
    bandwidth.
    """

    generate: Annotated[float, Range(ge=0)] = 0.0
    """Per generation wave: prompt set-up, prefill and the result's gathering."""
    generate_per_sequence: Annotated[float, Range(ge=0)] = 0.0
    """Per sequence of a wave (per-row set-up the runtime does in a loop)."""
    decode_step: Annotated[float, Range(ge=0)] = 0.0
    """Per decode step of a wave: one token's forward with the KV cache and its sampling."""
    inference: Annotated[float, Range(ge=0)] = 0.0
    """Per iteration of an inference task (reference, reward, critic log-probs): its set-up and passes."""
    inference_per_micro_batch: Annotated[float, Range(ge=0)] = 0.0
    """Per micro-batch forward of an inference task."""
    train: Annotated[float, Range(ge=0)] = 0.0
    """Per iteration of a training task: its set-up (advantages, packing)."""
    train_per_micro_batch: Annotated[float, Range(ge=0)] = 0.0
    """Per micro-batch forward + backward."""
    optimizer_step: Annotated[float, Range(ge=0)] = 0.0
    """Per optimizer step: gradient clipping, the update, zeroing."""
    generate_bytes_per_sequence: Annotated[float, Range(ge=0)] = 0.0
    """Bytes the ops of a generation read and write per sequence (all its decode steps), weights aside."""
    inference_bytes_per_sequence: Annotated[float, Range(ge=0)] = 0.0
    """Bytes per sequence of an inference task's forward, weights aside."""
    train_bytes_per_sequence: Annotated[float, Range(ge=0)] = 0.0
    """Bytes per sequence of a training micro-batch's forward and backward, weights aside."""
    optimizer_step_bytes: Annotated[float, Range(ge=0)] = 0.0
    """Bytes per optimizer step whatever the rows (clipping, the moments' update, zeroing), weights aside."""
    generate_elements: PerFamily = field(default_factory=PerFamily)
    """Units per sequence of a generation of the ops that cost more than launch and traffic
    (``peerd.sched.elements``), each costing a device's ``element_ns``."""
    inference_elements: PerFamily = field(default_factory=PerFamily)
    """Those units per sequence of an inference task's forward."""
    train_elements: PerFamily = field(default_factory=PerFamily)
    """Those units per sequence of a training micro-batch's forward and backward."""
    publish: Annotated[float, Range(ge=0)] = 0.0
    """Per iteration of the actor's training: packing the new weights for the generators."""
    publish_bytes: Annotated[float, Range(ge=0)] = 0.0
    """Bytes those ops read and write."""
    load: Annotated[float, Range(ge=0)] = 0.0
    """Per weight sync, on every generator: checking the weights it received and loading them."""
    load_bytes: Annotated[float, Range(ge=0)] = 0.0
    """Bytes those ops read and write."""

    def without_traffic(self) -> Launches:
        """The op counts alone (the bytes they move and the element work at zero)."""
        return replace(
            self.without_elements(),
            generate_bytes_per_sequence=0.0,
            inference_bytes_per_sequence=0.0,
            train_bytes_per_sequence=0.0,
            optimizer_step_bytes=0.0,
            publish_bytes=0.0,
            load_bytes=0.0,
        )

    def without_elements(self) -> Launches:
        """The op counts and their traffic (the element work at zero)."""
        none = PerFamily()
        return replace(self, generate_elements=none, inference_elements=none, train_elements=none)


@dataclass
class Workload:
    """One RL post-training job: its models and the size of one iteration."""

    actor: ModelSize
    """The policy: generates, is trained, and is synced to the generators."""
    algo: Algo = "grpo"
    """``grpo`` (group-relative advantages, no critic) or ``ppo`` (adds a critic)."""
    reference: ModelSize | None = None
    """The frozen reference for the KL term; default the actor's size."""
    reward: ModelSize | None = None
    """A learned reward model; omitted = a rule-based (verifiable) reward with no model to place."""
    critic: ModelSize | None = None
    """PPO's value model; default the actor's size. Ignored under GRPO."""
    prompts: Count = 1024
    """Prompts per iteration."""
    responses_per_prompt: Count = 8
    """Sampled responses per prompt (GRPO's group size)."""
    prompt_len: Count = 1024
    """Prompt tokens per sequence."""
    response_len: Count = 1024
    """Generated tokens per sequence (the number of decode steps)."""
    micro_batch: Count = 2
    """Sequences per micro-batch in inference and training."""
    optimizer_steps: Count = 1
    """Optimizer steps (mini-batches) per iteration; each ends in a gradient all-reduce."""
    staleness: Annotated[int, Range(ge=0)] = 0
    """Async depth k: generation may run k iterations ahead of training (0 = synchronous, on-policy)."""
    weight_sync: WeightSync = "relay"
    """How new weights reach the generators: ``relay`` (over the best link into their group, then
    along their widest spanning tree, chunks pipelined) or ``star`` (every generator receives them
    from one trainer, whose uplink carries the copies one after another: peerd's rl runtime)."""
    name: str = ""
    constants: CostConstants = field(default_factory=CostConstants)
    launches: Launches = field(default_factory=Launches)
    """Device ops per unit of work, each costing the device's ``launch_us`` (none by default)."""

    @property
    def sequences(self) -> int:
        return self.prompts * self.responses_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def forward_len(self) -> int:
        """Positions an inference or training forward runs: every token of a sequence but its last,
        whose next-token logits no log-prob needs."""
        return self.seq_len - 1

    def model(self, role: str) -> ModelSize:
        """The model of ``role``: actor, reference, reward or critic (defaults filled in)."""
        if role == "actor":
            return self.actor
        if role == "reference":
            return self.reference or self.actor
        if role == "critic":
            return self.critic or self.actor
        if role == "reward" and self.reward is not None:
            return self.reward
        raise ConfigError("workload", f"no {role} model in this workload")
