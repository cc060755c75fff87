"""The device ops one GRPO iteration of the runtime dispatches and the bytes they move, counted on its own code (``Launches``).

The RL cost model prices a tiny policy by its ops (``peerd.sched.rl.cost``: each costs the
device's measured seconds per op). The counts come from running the runtime's functions (the
rollout peers' ``rollout``, the trainer's ``pack`` + ``token_logprobs`` of the reference and
``grpo_updates``) on a copy of the job's GPT narrowed to two dims per head: the same ops, no
arithmetic to speak of. Generation is counted at two batch sizes and two lengths, under a policy
whose weights are all zero (uniform sampling, so no batch ends before its last step), and split
into a fixed part, a part per sequence and a part per decode step. The trainer is counted at the
iteration's real batch: the reference pass is an inference task's per-iteration ops; the updates
are counted (after a first step has built the optimizer's state) at one and two epochs, the
difference being the ops of one update (one micro-batch and its optimizer step: the runtime steps
once per micro-batch) and the rest the set-up. Packing builds its rows with numpy and dispatches a
fixed number of ops, so the reference pass's count holds for a data-parallel trainer's share too.

The bytes those ops read and write outside the weights (``OpCounter.bytes``: activations, logits,
KV cache, gradients, optimizer moments) need the real width, so ``count_traffic`` runs the same
functions on zero-weight copies of the GPT at its width and vocabulary with one and two blocks
(bytes grow by the same amount with each block) on one and two groups of the task's longest
prompt: per sequence of a generation (every decode step), of the reference pass and of an update,
and per optimizer step what an update moves whatever its rows (clipping, the step, zeroing).

A weight sync's host work is counted the same way (``count_sync``): the trainer's packing of its
new weights (``peerd.rl.weights``), once per iteration, and a rollout peer's checks and copies
when it loads them, with their bytes scaled to the real state dict.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable

import numpy as np
import torch

from peerd.models.gpt import GPT, GPTConfig
from peerd.models.launches import OpCounter, count_ops
from peerd.rl.loss import GRPOLossConfig
from peerd.rl.rollout import RolloutGroup, SamplingConfig, pack, rollout, token_logprobs
from peerd.rl.tasks import Task
from peerd.rl.update import frozen_copy, grpo_updates
from peerd.rl.weights import pack_weights, policy_weights, read_weights
from peerd.sched.elements import PerFamily
from peerd.sched.rl.workload import Launches

OptimizerFactory = Callable[
    [Iterable[torch.nn.Parameter]], tuple[torch.optim.Optimizer, Callable[[], object] | None]
]
"""The runtime's optimizer over some parameters and what it runs after each step (its LR schedule)."""


@dataclasses.dataclass(frozen=True)
class IterationShape:
    """What the counts depend on: the task, the sampling, the batch and how it is split into updates
    (the epochs only multiply the updates: the cost model counts those as optimizer steps)."""

    task: Task
    sampling: SamplingConfig
    group_size: int
    prompts: int
    """Prompts per iteration (``global_batch / group_size``)."""
    groups_per_update: int
    loss: GRPOLossConfig
    grad_clip: float | None


def narrow(cfg: GPTConfig) -> GPTConfig:
    """``cfg`` at two dims per head: every op of the real model, almost none of its arithmetic."""
    return dataclasses.replace(cfg, d_model=2 * cfg.n_head, d_ff=None)


def _zero_policy(cfg: GPTConfig) -> GPT:
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _generation_ops(model: GPT, shape: IterationShape, prompts: int, steps: int) -> int:
    """Ops of one ``rollout`` of ``prompts`` problems sampled for exactly ``steps`` tokens."""
    sampling = dataclasses.replace(shape.sampling, max_new_tokens=steps, temperature=1.0, top_k=0)
    problems = shape.task.problems(prompts, seed=0)
    for seed in range(8):  # uniform sampling: every row ending early is a 256^-rows event, retried
        gen = torch.Generator().manual_seed(seed)
        with OpCounter() as counter:
            groups = rollout(model, problems, shape.group_size, sampling, gen, 0)
        if max(len(c) for g in groups for c in g.completions) == steps:
            return counter.ops
    raise RuntimeError("every generation ended before its last step under uniform sampling")


def count_launches(cfg: GPTConfig, shape: IterationShape, make_optimizer: OptimizerFactory) -> Launches:
    """The ops of one iteration of a GRPO job of the built-in GPT ``cfg`` (see the module docstring)."""
    model = _zero_policy(narrow(cfg))
    small, steps = max(1, shape.prompts // 4), min(2, shape.sampling.max_new_tokens)
    base = _generation_ops(model, shape, small, 1)
    per_prompt = (_generation_ops(model, shape, 2 * small, 1) - base) / small
    per_step = (_generation_ops(model, shape, small, steps) - base) / (steps - 1) if steps > 1 else 0.0
    per_sequence = per_prompt / shape.group_size
    fixed = base - per_prompt * small - per_step

    gen = torch.Generator().manual_seed(0)
    groups = _scored(
        shape,
        rollout(model, shape.task.problems(shape.prompts, seed=0), shape.group_size, shape.sampling, gen, 0),
    )
    trainer = _Trainer(model, shape, make_optimizer)
    inference = count_ops(lambda: trainer.reference_logprobs(groups))
    per = shape.groups_per_update
    parts = [range(a, min(a + per, len(groups))) for a in range(0, len(groups), per)]
    updates = trainer.updates(groups, parts)
    updates(1)  # the optimizer's first step creates its state: a one-off, not a per-iteration cost
    once = count_ops(lambda: updates(1))
    per_update = (count_ops(lambda: updates(2)) - once) / len(parts)
    traffic = count_traffic(cfg, shape, make_optimizer)
    sync = count_sync(cfg)
    return Launches(
        generate=max(fixed, 0.0),
        generate_per_sequence=per_sequence,
        decode_step=per_step,
        inference=float(inference),
        train=max(once - per_update * len(parts), 0.0),
        train_per_micro_batch=per_update,
        generate_bytes_per_sequence=traffic.generate,
        inference_bytes_per_sequence=traffic.inference,
        train_bytes_per_sequence=traffic.train,
        optimizer_step_bytes=traffic.optimizer_step,
        generate_elements=traffic.generate_elements,
        inference_elements=traffic.inference_elements,
        train_elements=traffic.train_elements,
        publish=sync.publish,
        publish_bytes=sync.publish_bytes,
        load=sync.load,
        load_bytes=sync.load_bytes,
    )


@dataclasses.dataclass(frozen=True)
class SyncWork:
    """The ops and bytes of a weight sync's host work, counted on the runtime's own functions."""

    publish: float
    """Ops of the trainer's packing of the new weights (``policy_weights`` then ``pack_weights``)."""
    publish_bytes: float
    load: float
    """Ops of a rollout peer's checking and loading of them (``read_weights``)."""
    load_bytes: float


def count_sync(cfg: GPTConfig) -> SyncWork:
    """``SyncWork`` of the GPT ``cfg``: ops counted on a narrow copy (one op or a few per tensor,
    whatever the width), bytes scaled from it to the real state dict's values (they move each value
    a fixed number of times)."""
    model = _zero_policy(narrow(cfg))
    with OpCounter() as packed:
        blob = pack_weights(0, policy_weights(model))
    with OpCounter() as loaded:
        read_weights(blob, model.state_dict(), 0)
    with torch.device("meta"):  # sizes without allocating them
        values = sum(t.numel() for t in GPT(cfg).state_dict().values())
    scale = values / sum(t.numel() for t in model.state_dict().values())
    return SyncWork(float(packed.ops), packed.bytes * scale, float(loaded.ops), loaded.bytes * scale)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes the runtime's ops read and write outside the weights (see the module docstring)."""

    generate: float
    """Per sequence of a generation, all its decode steps."""
    inference: float
    """Per sequence of the reference pass (packing included)."""
    train: float
    """Per sequence of an update's forward and backward."""
    optimizer_step: float
    """Per update, whatever its rows: gradient clipping, the optimizer's step, zeroing."""
    generate_elements: PerFamily
    """Units of the element families (``peerd.sched.elements``) per sequence of a generation."""
    inference_elements: PerFamily
    """Those per sequence of the reference pass."""
    train_elements: PerFamily
    """Those per sequence of an update's forward and backward."""


def count_traffic(cfg: GPTConfig, shape: IterationShape, make_optimizer: OptimizerFactory) -> Traffic:
    """The bytes and element units of ``Traffic`` for the GPT ``cfg``: counted with one and two blocks,
    extrapolated to ``cfg.n_layer``."""
    one, two = (_traffic(dataclasses.replace(cfg, n_layer=n), shape, make_optimizer) for n in (1, 2))
    generate, inference, train, step = (
        a + (cfg.n_layer - 1) * (b - a) for a, b in zip(one, two, strict=True)
    )
    return Traffic(
        float(generate[0]),
        float(inference[0]),
        float(train[0]),
        float(step[0]),
        PerFamily(*generate[1:].tolist()),
        PerFamily(*inference[1:].tolist()),
        PerFamily(*train[1:].tolist()),
    )


def _traffic(
    cfg: GPTConfig, shape: IterationShape, make_optimizer: OptimizerFactory
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per sequence of a generation, of the reference pass and of an update, and per optimizer step:
    the bytes moved, then the units of each element family (none for the step's)."""
    model = _zero_policy(cfg)
    problem = max(shape.task.problems(16, seed=0), key=lambda p: len(p.prompt_ids))
    g = shape.group_size
    sampling = dataclasses.replace(shape.sampling, temperature=1.0, top_k=0)  # uniform: full length

    def counted(fn: Callable[[], object], weights: GPT) -> np.ndarray:
        with OpCounter(exclude=weights.parameters()) as counter:
            fn()
        return np.array([counter.bytes, *counter.elements.values()], dtype=float)

    def sample(prompts: int) -> list[RolloutGroup]:
        return rollout(model, [problem] * prompts, g, sampling, torch.Generator().manual_seed(0), 0)

    generate = (counted(lambda: sample(2), model) - counted(lambda: sample(1), model)) / g
    groups = _scored(shape, sample(2))
    trainer = _Trainer(model, shape, make_optimizer)

    def reference_pass(k: int) -> np.ndarray:
        return counted(lambda: trainer.reference_logprobs(groups[:k]), trainer.reference)

    inference = (reference_pass(2) - reference_pass(1)) / g

    def update(k: int) -> np.ndarray:
        run = trainer.updates(groups[:k], [range(k)])
        return counted(lambda: run(1), trainer.policy)

    update(1)  # the optimizer's first step creates its state: a one-off
    once = update(1)
    train = (update(2) - once) / g
    step = np.zeros_like(once)
    step[0] = max(once[0] - train[0] * g, 0.0)
    return generate, inference, train, step


def _scored(shape: IterationShape, groups: list[RolloutGroup]) -> list[RolloutGroup]:
    for group in groups:
        group.scores = [shape.task.score(group.problem, c) for c in group.completions]
    return groups


class _Trainer:
    """The runtime's trainer of ``model``: its frozen reference and an optimized copy of the policy."""

    def __init__(self, model: GPT, shape: IterationShape, make_optimizer: OptimizerFactory) -> None:
        self.shape = shape
        self.reference = frozen_copy(model)
        self.policy = copy.deepcopy(model)
        self.optimizer, self.after_step = make_optimizer(self.policy.parameters())

    def reference_logprobs(self, groups: list[RolloutGroup]) -> torch.Tensor:
        """The trainer's reference pass: packing and the reference's log-probs."""
        return token_logprobs(self.reference, pack(groups).tokens_BT, self.shape.sampling.temperature)

    def updates(self, groups: list[RolloutGroup], parts: list[range]) -> Callable[[int], object]:
        """``run(epochs)``: the GRPO updates of ``groups``, one per part (packing and the reference
        pass done here, outside what ``run`` dispatches)."""
        batch = pack(groups)
        ref_BT = token_logprobs(self.reference, batch.tokens_BT, self.shape.sampling.temperature)
        rewards = [g.rewards for g in groups]

        def run(epochs: int) -> object:
            return grpo_updates(
                self.policy,
                self.optimizer,
                batch,
                ref_BT,
                rewards,
                [[r] for r in parts],
                group_size=self.shape.group_size,
                epochs=epochs,
                temperature=self.shape.sampling.temperature,
                loss=self.shape.loss,
                grad_clip=self.shape.grad_clip,
                after_step=self.after_step,
            )

        return run
