"""Churn on real daemons on loopback: peers SIGKILLed, leaving, or all gone from one stage mid-training.

Eight daemons train one small job of 3 stages x 2 replicas (six tasklets, two spares),
uncompressed, so every recovery can be checked against a single-process run of the same
model: the final weights, assembled from the survivors' stage checkpoints, must equal the
uninterrupted run's (no step lost, skipped or applied twice), and so must the loss of every
step the last allocation ran.

- A non-bootstrap peer of stage 1 is SIGKILLed mid-step: its partners suspect it, its
  heartbeat stops, every survivor re-plans, the consensus commits the repair (a spare in its
  slot), the spare takes stage 1's state from the surviving replica over the p2p state-sync
  protocol, and all tasklets resume from one common step. Then a peer of stage 2 leaves
  gracefully (SIGTERM): the same, without waiting for its heartbeat to go silent.
- Both peers of a stage die at once: no replica is left, so the job rolls back to the newest
  checkpoint every stage has, whose copies live on peers outside that stage. Then more peers
  die than 3 x 2 can run on, the bootstrap peer (the job's owner) among them: the job waits,
  saying so, until new daemons join through a survivor and fill the holes, and finishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.bench.churn import CHURN_SPEC, SwarmJob, join_through_survivor, start_swarm
from peerd.data.config import build_dataset
from peerd.jobs.fetch import assemble, load_model
from peerd.jobs.runner import train_config
from peerd.jobs.spec import parse_job_spec
from peerd.localswarm import LocalSwarm
from peerd.models.gpt import GPT
from peerd.pipeline.local import LocalRunConfig, train_pipelined
from peerd.sched.allocation import Allocation

# Each test trains a job through several failures on eight daemons: minutes, not the suite's 300 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The tiny job trains fast once nothing fails (test_partition's job once ran 60 steps in 3.5 s): at
# CHURN_SPEC's 80 steps it finished in CI between a recovery and the next strike, the views lagging by
# a publish interval, so these jobs run long enough to outlast both.
SPEC = {**CHURN_SPEC, "steps": 300, "checkpoint_interval": 20}
STEPS = SPEC["steps"]
RECOVERY_BOUND_S = 60.0  # the bound for one failure (aim: 15 s)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, profile_cache: Path) -> Iterator[LocalSwarm]:
    local = start_swarm(tmp_path_factory.mktemp("churn"), 8, {"profile_cache": str(profile_cache)})
    try:
        yield local
    finally:
        local.close()


def reference_run(job_id: str, spec: dict[str, Any]) -> tuple[GPT, list[float]]:
    """The same job trained uninterrupted in one process: the model after the last step, each step's loss."""
    parsed = parse_job_spec(spec)
    d_pp, d_dp = spec["parallel"]["d_pp"], spec["parallel"]["d_dp"]
    alloc = Allocation.from_plain([[f"p{k}{j}" for j in range(d_dp)] for k in range(d_pp)])
    cfg = train_config(job_id, parsed, alloc, None)
    local = LocalRunConfig(
        steps=cfg.steps,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.micro_batch_size,
        layers_per_stage=cfg.layers_per_stage,
        replicas=d_dp,
        schedule=cfg.schedule,
        optimizer=cfg.optimizer,
        total_steps=cfg.steps,
    )
    model = GPT(cfg.model.gpt(), seed=cfg.model.seed)
    # on the daemons' one thread: float sums round by the thread count (test_growth.reference_losses)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return model, train_pipelined(model, build_dataset(cfg.data), local)
    finally:
        torch.set_num_threads(before)


def submit(swarm: LocalSwarm, spec: dict[str, Any]) -> SwarmJob:
    owner = next(p for p in swarm.live_peers())
    job = SwarmJob(swarm, owner.control().call("submit", spec=spec)["job_id"])
    job.wait(
        lambda vs: (
            len(vs) >= 6 and all(v["state"] == "running" and v["progress"]["step"] >= 6 for v in vs.values())
        ),
        180,
        "the job to commit and train a few steps",
    )
    return job


def assert_uninterrupted_weights(swarm: LocalSwarm, job: SwarmJob, spec: dict[str, Any], out: str) -> GPT:
    """The survivors' stage checkpoints of the last step assemble into the uninterrupted run's model."""
    model, _ = reference_run(job.job, spec)
    fetched = assemble(
        job.job, parse_job_spec(spec), [p.home / "checkpoints" for p in swarm.peers], swarm.root / out
    )
    assert fetched.step == STEPS
    trained, _ = load_model(fetched.path)
    diff = max((trained.state_dict()[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert diff < 1e-4, f"final weights differ from the uninterrupted run by {diff:.2e}"
    return trained


def test_a_killed_peer_and_a_leaving_peer_are_replaced_without_losing_a_step(swarm: LocalSwarm) -> None:
    job = submit(swarm, SPEC)
    killed = job.strike("replica", 1)
    left = job.strike("leave", 2)
    for event in (killed, left):
        assert event["recovery_s"] < RECOVERY_BOUND_S, event
        assert event["steps_lost"] == 0, event  # a replica of the stage survived: nothing rolled back
    done = job.wait(
        lambda vs: len(vs) >= 6 and all(v["state"] == "done" for v in vs.values()), 240, "the end"
    )
    view = next(iter(done.values()))
    _, reference = reference_run(job.job, SPEC)
    losses = {int(s): float(v) for s, v in view["progress"]["losses"]}
    # the record carries a downsampled curve: it reaches the end, and every listed step matches
    assert max(losses) == STEPS - 1 and any(s > left["resumed_at"] for s in losses), sorted(losses)
    off = [(s, losses[s], reference[s]) for s in sorted(losses) if abs(losses[s] / reference[s] - 1) > 1e-4]
    assert not off, f"(step, got, expected) off the uninterrupted run: {off}; failures {killed}, {left}"
    trained = assert_uninterrupted_weights(swarm, job, SPEC, "fetched")
    churn = view["churn"]
    assert len(churn["replans"]) >= 2 and {"stopped answering", "left the swarm"} <= {
        why for r in churn["replans"] for why in ("stopped answering", "left the swarm") if why in r["cause"]
    }
    # peerd fetch over p2p, from a daemon holding at most one stage itself: the same model
    asker = next(p for p in swarm.live_peers() if p.index != 0)
    got = asker.control(timeout=120).call("fetch", job_id=job.job, out=str(swarm.root / "p2p"))
    assert (got["step"], got["stages"]) == (STEPS, SPEC["parallel"]["d_pp"])
    gathered, _ = load_model(got["path"])
    assert all(torch.equal(gathered.state_dict()[k], v) for k, v in trained.state_dict().items())


def test_a_whole_stage_lost_resumes_from_checkpoint_copies_and_a_short_job_waits_for_peers(
    swarm: LocalSwarm,
) -> None:
    join_through_survivor(swarm, 8)  # the first test's victims are replaced by newcomers
    spec = {**SPEC, "name": "churn-2"}
    job = submit(swarm, spec)
    stage = job.strike("stage", 1)
    every = spec["checkpoint_interval"]
    assert stage["recovery_s"] < 2 * RECOVERY_BOUND_S, stage
    assert stage["resumed_at"] % every == 0 and stage["steps_lost"] <= every, stage
    # two more die, the bootstrap peer (the job's owner, the address every first daemon was
    # started with) among them: four peers cannot run 3 x 2; the job waits and says why
    epoch = max(v["allocation"]["epoch"] for v in job.views().values())
    bootstrap = swarm.peers[0]  # unless it held stage 1 and died in the strike above
    others = [p for p in swarm.live_peers() if p.index != 0]
    for peer in [bootstrap, *others[:1]] if bootstrap.alive else others[:2]:
        swarm.kill_peer(peer)
    assert not bootstrap.alive
    waiting = job.wait(
        lambda vs: (
            len(vs) >= 3 and all(v["state"] == "recovering" and "waiting" in v["reason"] for v in vs.values())
        ),
        120,
        "the job to wait for peers, saying so",
    )
    assert all(v["allocation"]["epoch"] == epoch for v in waiting.values())
    join_through_survivor(swarm, len(swarm.live_peers()) + 2)  # through survivors: no bootstrap
    done = job.wait(
        lambda vs: len(vs) >= 6 and all(v["state"] == "done" for v in vs.values()), 300, "the job to finish"
    )
    assert all(v["allocation"]["epoch"] > epoch for v in done.values())
    assert_uninterrupted_weights(swarm, job, spec, "fetched-2")
