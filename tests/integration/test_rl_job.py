"""A ``kind: rl`` job (GRPO) on three real daemons on loopback, through ``peerd submit``.

The peers agree on the roles through the consensus, scored by the RL cost model: the trainers
(the allocation's one stage; ``parallel.d_dp: auto`` lets it choose how many) and the rollout peers
(its spares). The trainer warms the policy
up, then every iteration the rollout peers sample their shards of the prompts with the policy
version they fetched and push them; the trainer scores them itself and updates the policy. A
synchronous job moves the same weights and completions as the single-process sharded reference
(``peerd.jobs.rl.reference_run``), so its loss, reward and pass-rate curves equal the reference's;
``peerd status --json`` on another daemon and ``/metrics`` show GRPO's figures.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from peerd.jobs.rl import RLPlan, reference_run
from peerd.jobs.spec import load_job_spec
from peerd.localswarm import LocalSwarm, converged
from peerd.models import save_checkpoint

pytestmark = pytest.mark.integration

PEERD = [sys.executable, "-c", "from peerd.cli import main; main()"]
SWARM_OPTIONS = {
    "record_ttl": 10.0,
    "refresh_interval": 2.0,
    "probe_interval": 4.0,
    "probe_budget": 5,
    "startup_timeout": 30.0,
    "shutdown_timeout": 10.0,
    "device": "cpu",
}
ITERATIONS = 6


def peerd(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*PEERD, *args], capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, profile_cache: Path) -> Iterator[LocalSwarm]:
    root = tmp_path_factory.mktemp("rljobs")
    options = {**SWARM_OPTIONS, "profile_cache": str(profile_cache)}
    peer_options = [{"metrics_port": _free_port()}, {}, {}]
    s = LocalSwarm(3, root / "s", options=options, peer_options=peer_options, ready_timeout=120)
    try:
        s.start()
        names = [p.name for p in s.peers]
        s.wait_until(
            lambda v: converged(v, names), timeout=90, what="the three daemons to measure each other"
        )
        yield s
    finally:
        s.close()


def _spec(tmp: Path, name: str, top: dict[str, Any] | None = None, **rl: Any) -> Path:
    spec = {
        "name": name,
        "kind": "rl",
        "model": {"preset": "tiny", "seed": 5},
        "steps": ITERATIONS,
        "global_batch": 32,  # 4 prompts x 8 completions
        "micro_batch": 16,  # two updates per iteration
        "optimizer": {"name": "adamw", "lr": 0.002, "schedule": "constant", "grad_clip": 1.0},
        "checkpoint_interval": ITERATIONS,
        "min_peers": 3,
        "max_peers": 3,
        "planning": {"time_budget_s": 2, "max_skew_s": 1.0},
        "rl": {
            "task": {"name": "addition", "min_size": 1, "max_size": 1},
            "group_size": 8,
            "sampling": {"max_new_tokens": 4, "temperature": 1.0},
            "warmup": {"steps": 40, "batch_size": 16, "lr": 0.003},
            "rollout_timeout_s": 60,
            **rl,
        },
        **(top or {}),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(swarm: LocalSwarm, spec_file: Path) -> dict[str, Any]:
    result = peerd(
        "submit", str(spec_file), "--home", str(swarm.peers[0].home), "--wait", "--json", timeout=600
    )
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(20)}" for p in swarm.peers)
    assert result.stdout.strip(), f"{result.stderr[-3000:]}\n{logs}"
    final = json.loads(result.stdout)
    final["returncode"], final["logs"] = result.returncode, logs
    return final


def test_a_sync_grpo_job_equals_the_single_process_reference(swarm: LocalSwarm, tmp_path: Path) -> None:
    """``parallel.d_dp: auto`` (the default): the consensus chooses one trainer or two (an update's
    two groups split either way) and the rollout peers; whichever it chose, the job equals the
    reference of that many trainers and rollout peers."""
    spec_file = _spec(tmp_path, "grpo-sync", min_rollout_peers=1)  # the rollout path (the plan's choice
    final = _submit(swarm, spec_file)  # here could be a lone trainer, the cores being shared)
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    alloc = final["allocation"]
    (trainers,) = alloc["stages"]
    assert len(trainers) in (1, 2), alloc
    rollout_peers = alloc["spares"]
    assert rollout_peers, alloc

    # the daemons compute on one thread each; a matmul's sums depend on the thread count, so the
    # reference does too (two threads move the losses by ~1e-3 after a few iterations)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = reference_run(
            RLPlan(final["job_id"], load_job_spec(spec_file)),
            rollout_peers=len(rollout_peers),
            trainers=len(trainers),
        )
    finally:
        torch.set_num_threads(threads)
    rl = final["progress"]["rl"]
    assert rl["version"] == ITERATIONS and rl["iteration"] == ITERATIONS
    got = rl["rewards"]
    assert [i for i, _, _ in got] == list(range(1, ITERATIONS + 1))  # iterations completed
    for (_, reward, rate), ref in zip(got, reference, strict=True):
        assert reward == pytest.approx(ref.reward_mean, abs=1e-6) and rate == pytest.approx(
            ref.pass_rate, abs=1e-6
        )
    losses = final["progress"]["losses"]
    assert [i for i, _ in losses] == list(range(ITERATIONS))  # by iteration index, as steps are
    # two trainers average their gradients in another order than the reference sums them
    tolerance = 1e-5 if len(trainers) == 1 else 1e-4
    assert max(abs(loss - ref.loss) for (_, loss), ref in zip(losses, reference, strict=True)) < tolerance
    assert rl["staleness"] == [[0, ITERATIONS * 32]]  # synchronous: every completion of the current policy
    assert rl["weight_sync_bytes"] > 0 and rl["shards_missing"] == 0

    # another daemon's status and the metrics endpoint show the same figures, once that daemon has
    # read the trainer's last record (it reads an ended job's records until every tasklet's final
    # one is in: DHT propagation may lag the owner's word by a few reads)
    deadline = time.monotonic() + 30
    while True:
        status = json.loads(peerd("status", "--json", "--home", str(swarm.peers[2].home)).stdout)
        view = next(j for j in status["jobs"] if j["job_id"] == final["job_id"])
        if (view["progress"]["rl"] or {}).get("rewards") == got or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert view["progress"]["rl"]["rewards"] == got
    port = swarm.peers[0].options["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {
        (s.name, s.labels.get("job")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("peerd_job_pass_rate", final["job_id"])] == pytest.approx(got[-1][2], abs=1e-6)
    assert samples[("peerd_job_policy_version", final["job_id"])] == ITERATIONS


def _start_checkpoint(tmp: Path) -> Path:
    """A ``peerd fetch``-format model file of the jobs' model, initialised from another seed."""
    spec = load_job_spec(_spec(tmp, "start"))
    family = dataclasses.replace(spec.model, seed=77).family()
    return save_checkpoint(tmp / "start" / "model.pt", family, family.build().state_dict())


def test_two_data_parallel_trainers_train_as_the_reference_of_two(swarm: LocalSwarm, tmp_path: Path) -> None:
    """``parallel.d_dp: 2``: two trainers each train on their half of the prompts and average every
    update's gradients; a trainer without a rollout peer of its own samples its half itself. Both
    start from ``init_checkpoint`` (then warm up), as the reference does."""
    start = _start_checkpoint(tmp_path)
    spec_file = _spec(
        tmp_path, "grpo-dp", top={"parallel": {"d_pp": 1, "d_dp": 2}, "init_checkpoint": str(start)}
    )
    final = _submit(swarm, spec_file)
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    alloc = final["allocation"]
    assert [len(stage) for stage in alloc["stages"]] == [2], alloc  # two trainers
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = reference_run(
            RLPlan(final["job_id"], load_job_spec(spec_file)),
            rollout_peers=len(alloc["spares"]),
            trainers=2,
        )
        seeded = reference_run(
            RLPlan(final["job_id"], dataclasses.replace(load_job_spec(spec_file), init_checkpoint=None)),
            rollout_peers=len(alloc["spares"]),
            trainers=2,
            iterations=1,
        )
    finally:
        torch.set_num_threads(threads)
    assert seeded[0].loss != reference[0].loss  # the checkpoint, not the seed, is where they started
    rl = final["progress"]["rl"]
    assert rl["version"] == ITERATIONS
    got = rl["rewards"]
    assert [i for i, _, _ in got] == list(range(1, ITERATIONS + 1))
    for (_, reward, rate), ref in zip(got, reference, strict=True):  # pooled over both trainers
        assert reward == pytest.approx(ref.reward_mean, abs=1e-6) and rate == pytest.approx(
            ref.pass_rate, abs=1e-6
        )
    losses = final["progress"]["losses"]
    # the gradients are averaged in another order than the reference sums them: float rounding
    assert max(abs(loss - ref.loss) for (_, loss), ref in zip(losses, reference, strict=True)) < 1e-4
    assert rl["staleness"] == [[0, ITERATIONS * 32]]  # both trainers' completions, all on-policy
    replicas = {t["replica"]: t["state"] for t in final["progress"]["tasklets"] if t["stage"] == 0}
    assert replicas == {0: "done", 1: "done"}, final["progress"]


def test_an_rl_job_whose_init_checkpoint_is_missing_fails_naming_the_field(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    missing = tmp_path / "not-on-these-peers" / "model.pt"
    final = _submit(swarm, _spec(tmp_path, "grpo-missing", top={"init_checkpoint": str(missing)}))
    assert final["returncode"] == 1 and final["state"] == "failed", final["logs"]
    assert "init_checkpoint" in final["reason"] and "no such file" in final["reason"], final["reason"]
