"""The op counts of the RL cost model predict what the runtime really dispatches in an iteration."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from peerd.bench.rl_swarm import Settings, job_spec
from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.report import score
from peerd.jobs.rl.shards import RLPlan, sample_shard, shard_ranges
from peerd.jobs.scoring_rl import rl_workload
from peerd.jobs.spec import parse_job_spec
from peerd.models.launches import OpCounter
from peerd.rl.weights import pack_weights, read_weights
from peerd.sched.elements import PerFamily


@pytest.mark.parametrize("task", ["addition", "reversal"])
def test_counted_launches_match_the_rollout_peers_and_the_trainers_ops(task: str):
    spec = parse_job_spec(
        job_spec(
            Settings(task=task, prompts=8, group_size=4, d_model=16), staleness=0, iterations=3, name="c"
        )
    )
    ops = rl_workload(spec).launches
    assert ops.decode_step > 0 and ops.inference > 0 and ops.train_per_micro_batch > 0
    plan = RLPlan("c", spec)
    learner = Learner(plan)  # its own random weights: completions of every length
    groups = []
    for shard, indices in enumerate(shard_ranges(plan.prompts, 2)):
        with OpCounter() as counted:
            part = sample_shard(learner.policy, plan, 0, shard, indices, 0)
        steps = max(len(c) for g in part for c in g.completions)
        sequences = len(indices) * plan.group_size
        predicted = ops.generate + ops.generate_per_sequence * sequences + ops.decode_step * steps
        assert predicted == pytest.approx(counted.ops, rel=0.03)
        groups += part
    score(plan.task, groups)
    learner.train(groups)  # the optimizer's state is built on the first step: not a per-iteration cost
    with OpCounter() as counted:
        figures = learner.train(groups)
    predicted = ops.inference + ops.train + ops.train_per_micro_batch * figures.updates
    # rows shorter than the longest take one slicing op more to pack than the counts' full-length rows
    assert predicted == pytest.approx(counted.ops, rel=0.05)


@pytest.mark.parametrize("d_model", [16, 64])
def test_counted_sync_work_matches_the_trainers_publish_and_a_rollout_peers_load(d_model: int):
    spec = parse_job_spec(job_spec(Settings(d_model=d_model), staleness=0, iterations=3, name="s"))
    ops = rl_workload(spec).launches
    learner = Learner(RLPlan("s", spec))
    with OpCounter() as published:  # what the trainer's _publish runs
        blob = pack_weights(1, learner.weights())
    model = spec.model.family().build()
    with OpCounter() as loaded:  # what a rollout peer's _load dispatches
        read_weights(blob, model.state_dict(), 1)
    assert (ops.publish, ops.load) == (published.ops, loaded.ops)  # per tensor: whatever the width
    assert ops.publish_bytes == pytest.approx(published.bytes, rel=0.01)
    assert ops.load_bytes == pytest.approx(loaded.bytes, rel=0.01)


def test_counted_bytes_match_what_the_runtimes_ops_move_beyond_the_weights():
    """The traffic counts (real width, one and two blocks, extrapolated; two groups of the longest
    prompt) predict the bytes of the runtime's own sampling, reference pass and updates."""
    spec = parse_job_spec(
        job_spec(Settings(prompts=8, group_size=4, d_model=32), staleness=0, iterations=3, name="c")
    )
    ops = rl_workload(spec).launches
    plan = RLPlan("c", spec)
    learner = Learner(plan)
    with torch.no_grad():  # uniform sampling: every completion runs to max_new_tokens, as counted
        for p in learner.policy.parameters():
            p.zero_()
    sequences = plan.prompts * plan.group_size
    with OpCounter(exclude=learner.policy.parameters()) as counted:
        groups = sample_shard(learner.policy, plan, 0, 0, range(plan.prompts), 0)
    assert counted.bytes == pytest.approx(ops.generate_bytes_per_sequence * sequences, rel=0.05)
    assert counted.elements == _units(ops.generate_elements, sequences)
    score(plan.task, groups)
    learner.train(groups)  # builds the optimizer's state
    weights = [*learner.policy.parameters(), *learner.reference.parameters()]
    with OpCounter(exclude=weights) as counted:
        figures = learner.train(groups)
    predicted = (
        ops.inference_bytes_per_sequence + ops.train_bytes_per_sequence
    ) * sequences + ops.optimizer_step_bytes * figures.updates
    assert counted.bytes == pytest.approx(predicted, rel=0.05)
    both = PerFamily(
        *(a + b for a, b in zip(ops.inference_elements.values(), ops.train_elements.values(), strict=True))
    )
    assert counted.elements == _units(both, sequences)
    assert min(ops.train_elements.values()) > 0  # every family runs in an update


def _units(per_sequence: PerFamily, sequences: int) -> dict[str, Any]:
    """The element units of ``sequences`` sequences, as the counter's dict (each within 5 %)."""
    return {
        f.name: pytest.approx(getattr(per_sequence, f.name) * sequences, rel=0.05)
        for f in dataclasses.fields(PerFamily)
    }
