"""A network partition on real daemons on loopback: two halves of a training swarm cut off for 45 s.

Six daemons train a 2-stage job on two of them (four spares). Then every peer of a minority
(one stage's peer and a spare) and every peer of the majority (the other stage's peer and
three spares) cut each other off (``peerd.swarm.faults``: the DHT's RPCs and peerd's streams,
both ways, as a dead network between the halves would) for 45 s. Each half sees the other's
records expire and its pipeline stream break, and both re-plan, each with enough peers for
the job; only the half holding a majority of the running roster may commit (the minority's
two peers are a quorum of their own roster, not of the running one). When the cut ends, the
halves find each other again through the peers they remember, and the job finishes. Across
all six daemons' logs, no epoch ever committed two different allocations, and the minority
committed nothing while cut off.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from peerd.bench.churn import CHURN_SPEC, SwarmJob, allocation_of, start_swarm
from peerd.localswarm import LocalSwarm, converged
from peerd.swarm.faults import FAULT_INJECTION_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# the minority notices only by its partner's silence (30 s: its pipeline waits >= 60 s for a
# message), so the cut outlasts that by 15 s: both halves re-plan while cut off
CUT_S = 45.0
SPEC: dict[str, Any] = {
    **CHURN_SPEC,
    "name": "partition",
    # long enough to be running when the cut lands: 60 steps took 3.5 s once the training peers
    # stopped re-probing their links, and ended 1 s before the cut
    "steps": 300,
    "checkpoint_interval": 25,
    "parallel": {"d_pp": 2, "d_dp": 1},
    # two peers could run it as 2 x 1: only the majority rule keeps the minority from committing
    "min_peers": 2,
    "max_peers": 6,
}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, profile_cache: Path) -> Iterator[LocalSwarm]:
    local = start_swarm(
        tmp_path_factory.mktemp("partition"),
        6,
        {"profile_cache": str(profile_cache)},
        env={FAULT_INJECTION_ENV: "1"},
    )
    try:
        yield local
    finally:
        local.close()


def logged(swarm: LocalSwarm, pattern: str) -> list[tuple[Any, ...]]:
    """(peer, when, *groups) of every line of every daemon's log that ``pattern`` matches after its time."""
    line = re.compile(rf"^(\S+ \S+) {pattern}", re.MULTILINE)
    return [
        (peer.name, datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f"), *rest)
        for peer in swarm.peers
        for when, *rest in line.findall(peer.log_path.read_text(errors="replace"))
    ]


def commits(swarm: LocalSwarm, job: str) -> list[tuple[Any, ...]]:
    """(peer, when, epoch, allocation hash) of every commit any daemon adopted (each one is logged)."""
    found = logged(swarm, rf"INFO +\S+ job {job}: committed allocation ([0-9a-f]+) \(epoch (\d+), round \d+")
    return [(name, when, int(epoch), allocation) for name, when, allocation, epoch in found]


def replans(swarm: LocalSwarm) -> list[tuple[Any, ...]]:
    """(peer, when, line) of every re-plan a daemon entered."""
    return logged(swarm, r"WARN +\S+ (job \S+: re-planning .*)$")


def test_a_partition_heals_without_two_commits_for_one_epoch(swarm: LocalSwarm) -> None:
    owner = swarm.peers[0]
    job = SwarmJob(swarm, owner.control().call("submit", spec=SPEC)["job_id"], min_views=6)
    views = job.wait(
        lambda vs: (
            len(vs) == 6 and all(v["state"] == "running" and v["progress"]["step"] >= 4 for v in vs.values())
        ),
        180,
        "the job to commit and train a few steps",
    )
    view = next(iter(views.values()))
    epoch, alloc = view["allocation"]["epoch"], allocation_of(view)
    # the minority: one stage's peer and a spare (not the owner); each half holds one stage and
    # could run the job on its own, so each re-plans and only the majority rule tells them apart
    me = owner.info.peer_id
    worker = next(stage[0] for stage in alloc.stages if stage[0] != me)
    minority = {worker, next(p for p in alloc.spares if p != me)}
    ids = {p.info.peer_id: p for p in swarm.peers if p.info is not None}
    majority = set(ids) - minority
    other_half = {peer.name: majority if pid in minority else minority for pid, peer in ids.items()}
    at = min(v["progress"]["step"] for v in views.values())
    healed_at = 0.0
    for peer in ids.values():
        others = other_half[peer.name]
        reply = peer.control().call("partition", peers=sorted(others), seconds=CUT_S)
        assert set(reply["cut"]) == others
        healed_at = max(healed_at, reply["until"])
    cut_at = time.monotonic()

    # while cut: each half sees only itself (the other half's records expire)
    def halves_apart(vs: dict[str, dict[str, Any]]) -> bool:
        online = {
            name: {p["peer_id"] for p in v["peers"] if p["state"] == "online"} for name, v in vs.items()
        }
        return len(online) == 6 and all(not seen & other_half[name] for name, seen in online.items())

    swarm.wait_until(halves_apart, timeout=CUT_S, what="each half to lose sight of the other", interval=1.0)
    assert time.monotonic() - cut_at < CUT_S, "the cut ended before the halves lost sight of each other"

    # healed: one swarm again, and the job finishes on every daemon
    names = [p.name for p in swarm.peers]
    swarm.wait_until(
        lambda v: converged(v, names, links=False), timeout=180, what="the halves to find each other again"
    )
    done = job.wait(
        lambda vs: len(vs) == 6 and all(v["state"] == "done" for v in vs.values()), 300, "the job to finish"
    )
    final = next(iter(done.values()))
    assert final["progress"]["step"] == SPEC["steps"]
    assert final["allocation"]["epoch"] > epoch, f"no re-plan after the cut at step {at}"
    committed = commits(swarm, job.job)
    per_epoch: dict[int, set[str]] = defaultdict(set)
    for _, _, e, allocation in committed:
        per_epoch[e].add(allocation)
    assert all(len(hashes) == 1 for hashes in per_epoch.values()), committed
    # both halves re-planned while cut off; the minority committed nothing (the majority's commit
    # may come a little after the heal: the half that learns of the cut only from silence needs 30 s)
    minority_names = {ids[p].name for p in minority}
    healed = datetime.fromtimestamp(healed_at)
    early = [r for r in replans(swarm) if r[1] < healed]
    assert {r[0] for r in early} & minority_names and {r[0] for r in early} - minority_names, replans(swarm)
    assert not [c for c in committed if c[0] in minority_names and c[2] > epoch and c[1] < healed], committed
    assert all(p.alive for p in swarm.peers)
