"""A rollout peer, or a data-parallel trainer, of an ``rl`` job SIGKILLed mid-job on four real daemons:
the job goes on without it.

One trainer and the rollout peers the consensus picks run a synchronous GRPO job. After a few
iterations one rollout peer is killed like a crash. The trainer waits ``rl.rollout_timeout_s`` for
its shard once, drops it (counted: ``shards_missing``), names the peer a suspect and samples its
prompts itself meanwhile; once the swarm no longer lists the dead peer, every daemon re-plans
(a suspected spare that left the membership is gone) and the next epoch runs without it. The
job ends done with every iteration trained, and only the dead peer's in-flight rollouts lost.

With two data-parallel trainers (``parallel.d_dp: 2``, averaging 8-bit gradients) the killed peer is
a trainer: the other's average fails, it stops, and the re-plan makes two of the survivors the trainers; they resume from
the newest version one of them declares and finish the job.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from peerd.localswarm import LocalSwarm, converged

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ITERATIONS = 1000  # long enough that the re-plan after the kill lands mid-job (an iteration: 20-100 ms here)
KILL_AFTER = 5  # iterations trained before the kill


@pytest.fixture
def swarm(local_swarm: Callable[..., LocalSwarm]) -> LocalSwarm:
    s = local_swarm(4, ready_timeout=120)
    names = [p.name for p in s.peers]
    s.wait_until(lambda v: converged(v, names), timeout=90, what="the four daemons to measure each other")
    return s


def _spec(tmp: Path, **top: Any) -> Path:
    spec = {
        "name": "grpo-churn",
        "kind": "rl",
        "model": {"preset": "tiny", "seed": 7},
        "steps": ITERATIONS,
        "global_batch": 48,  # 6 prompts x 8: two per rollout peer
        "micro_batch": 48,
        "optimizer": {"name": "adamw", "lr": 0.002, "schedule": "constant"},
        "checkpoint_interval": ITERATIONS,
        "min_peers": 2,  # a trainer and one rollout peer: the job runs on after the kill
        "parallel": {"d_pp": 1, "d_dp": 1},  # one trainer (the second test runs two)
        "max_peers": 4,
        "planning": {"time_budget_s": 2, "max_skew_s": 1.0},
        "rl": {
            "task": {"name": "addition", "min_size": 1, "max_size": 1},
            "group_size": 8,
            "sampling": {"max_new_tokens": 4, "temperature": 1.0},
            "warmup": {"steps": 60, "batch_size": 16, "lr": 0.003},
            "rollout_timeout_s": 10,
            # rollout peers to kill (on one machine's cores the plan may be a lone trainer)
            "min_rollout_peers": 1,
        },
    }
    path = tmp / "grpo-churn.yaml"
    path.write_text(yaml.safe_dump({**spec, **top}))
    return path


def _job(views: dict[str, dict[str, Any]], job_id: str) -> dict[str, Any] | None:
    for view in views.values():
        for job in view.get("jobs", []):
            if job["job_id"] == job_id and job.get("progress", {}).get("rl"):
                return job
    return None


def _causes(views: dict[str, dict[str, Any]], job_id: str) -> list[str]:
    """The re-plan causes of every daemon: each lists only the re-plans it entered itself, so one
    that followed the others' epochs, or came to the job late, may list none."""
    return [
        r["cause"]
        for view in views.values()
        for job in view.get("jobs", [])
        if job["job_id"] == job_id
        for r in job.get("churn", {}).get("replans", [])
    ]


def _submit_and_train(
    swarm: LocalSwarm, spec: Path, peerd_cli: Callable[..., subprocess.CompletedProcess]
) -> tuple[str, dict[str, dict[str, Any]]]:
    """Submit ``spec`` through peer 0 and wait for ``KILL_AFTER`` iterations: (job id, the views then)."""
    submitted = peerd_cli("submit", str(spec), "--home", str(swarm.peers[0].home), "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]

    def trained(views: dict[str, dict[str, Any]]) -> bool:
        job = _job(views, job_id)
        return job is not None and job["progress"]["rl"]["iteration"] >= KILL_AFTER

    return job_id, swarm.wait_until(trained, timeout=300, what=f"{KILL_AFTER} GRPO iterations")


def test_a_killed_rollout_peer_costs_only_its_rollouts(
    swarm: LocalSwarm, tmp_path: Path, peerd_cli: Callable[..., subprocess.CompletedProcess]
) -> None:
    job_id, views = _submit_and_train(swarm, _spec(tmp_path), peerd_cli)
    job = _job(views, job_id)
    assert job is not None
    alloc = job["allocation"]
    trainer, rollouts = alloc["stages"][0][0], alloc["spares"]
    # the cost model picks how many peers roll out (one to three here: the spec keeps one); with the
    # only one killed, the trainer samples every prompt itself from then on
    assert rollouts, alloc
    # any rollout peer, the owner's daemon included: the job lives in public records, read by every peer
    victim = next(p for p in swarm.peers if p.info is not None and p.info.peer_id in rollouts)
    swarm.kill_peer(victim)
    killed_at = time.monotonic()

    def replanned(views: dict[str, dict[str, Any]]) -> bool:
        j = _job(views, job_id)
        return j is not None and (
            any(victim.info.peer_id in c for c in _causes(views, job_id)) or j["state"] != "running"
        )

    # the trainer's shard deadline, then the dead peer's record expiring, then one health check
    swarm.wait_until(replanned, timeout=180, what="a re-plan without the killed rollout peer")

    def finished(views: dict[str, dict[str, Any]]) -> bool:
        j = _job(views, job_id)
        return j is not None and j["state"] in ("done", "failed")

    views = swarm.wait_until(finished, timeout=400, what="the job to end after the kill")
    job = _job(views, job_id)
    assert job is not None and job["state"] == "done", (job, [p.log_tail(20) for p in swarm.live_peers()])
    rl = job["progress"]["rl"]
    assert rl["iteration"] == ITERATIONS and rl["version"] == ITERATIONS
    lost = f"{rl}, churn {job.get('churn')}"
    # the figures are the current trainer's: the re-plan may hand the trainer role to another peer
    same_trainer = job["allocation"]["stages"][0][0] == trainer
    assert not same_trainer or rl["shards_missing"] >= 1, lost  # the dead peer's in-flight shard
    # the trainer named it, the swarm dropped it, and the job re-planned without it
    assert any(victim.info.peer_id in c for c in _causes(views, job_id)), lost
    final = job["allocation"]
    assert victim.info.peer_id not in (*final["stages"][0], *final["spares"]), final
    completions = sum(n for _, n in rl["staleness"])
    if same_trainer:
        assert ITERATIONS * 48 - 3 * 48 <= completions < ITERATIONS * 48, lost
    assert rl["rewards"][-1][0] == ITERATIONS, lost
    assert time.monotonic() - killed_at < 400


DP_ITERATIONS = 120  # an iteration averages twice between the trainers: slower than one trainer's


def test_a_killed_data_parallel_trainer_is_replaced_and_the_job_finishes(
    swarm: LocalSwarm, tmp_path: Path, peerd_cli: Callable[..., subprocess.CompletedProcess]
) -> None:
    spec = _spec(
        tmp_path,
        parallel={"d_pp": 1, "d_dp": 2},
        steps=DP_ITERATIONS,
        checkpoint_interval=DP_ITERATIONS,
        global_batch=64,  # 8 prompts x 8: two updates of 4 groups, 2 per trainer each
        micro_batch=32,
        compression={"gradient_bits": 8},  # the trainers' groups of every epoch average 8-bit gradients
    )
    job_id, views = _submit_and_train(swarm, spec, peerd_cli)
    job = _job(views, job_id)
    assert job is not None
    trainers = job["allocation"]["stages"][0]
    assert len(trainers) == 2, job["allocation"]
    assert job["progress"]["rl"]["iteration"] < DP_ITERATIONS - 20  # the kill lands mid-job
    # the second trainer, whichever daemon it is (the owner's included)
    victim = next(p for p in swarm.peers if p.info is not None and p.info.peer_id == trainers[1])
    swarm.kill_peer(victim)

    def finished(views: dict[str, dict[str, Any]]) -> bool:
        j = _job(views, job_id)
        return j is not None and j["state"] in ("done", "failed")

    views = swarm.wait_until(finished, timeout=450, what="the job to end after a trainer's kill")
    job = _job(views, job_id)
    tails = [p.log_tail(20) for p in swarm.live_peers()]
    assert job is not None and job["state"] == "done", (job, tails)
    rl = job["progress"]["rl"]
    assert rl["iteration"] == DP_ITERATIONS and rl["version"] == DP_ITERATIONS, rl
    assert rl["rewards"][-1][0] == DP_ITERATIONS
    # the trainers' records count their averaging: 8-bit gradients, exact counts and start weights
    sent = job["progress"]["bytes"]
    assert sent["averaging"] > 0 and 3 < job["progress"]["compression_ratio"] < 4, sent
    final = job["allocation"]
    assert len(final["stages"][0]) == 2 and victim.info.peer_id not in (*final["stages"][0], *final["spares"])
    assert any(victim.info.peer_id in c for c in _causes(views, job_id)), job.get("churn")
