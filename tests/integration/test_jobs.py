"""Jobs end to end on six real daemons on loopback (3 stages x 2 replicas), through the real ``peerd`` CLI.

One swarm for the module, and one training run of the demo job shared by the tests that look at
it (a module fixture): a bad spec is refused at submit naming each field; the demo job is
submitted, every daemon commits the same allocation hash whose cost is no worse than the best
island's, the job trains to completion and ``peerd status --json`` shows it done with a falling
loss; ``peerd jobs`` lists it, the metrics endpoint exports it, ``peerd fetch`` assembles a model
that loads; a non-owner's cancel is refused at the CLI and a forged cancel record stored in the
DHT is ignored by every daemon, while the owner's cancel stops the job everywhere.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from peerd.control import ControlError
from peerd.errors import ErrorCode
from peerd.localswarm import LocalSwarm, converged

pytestmark = pytest.mark.integration

PEERD = [sys.executable, "-c", "from peerd.cli import main; main()"]
STEPS = 30
SWARM_OPTIONS = {
    "record_ttl": 10.0,
    "refresh_interval": 2.0,
    "probe_interval": 4.0,
    "probe_budget": 5,
    "startup_timeout": 30.0,
    "shutdown_timeout": 10.0,
    "device": "cpu",
    "max_jobs": 1,  # the cancel test: a daemon running a job applies to no other
}


def peerd(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*PEERD, *args], capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo_spec(tmp: Path, **changes: Any) -> Path:
    spec = yaml.safe_load(Path("configs/jobs/gpt-tiny-demo.yaml").read_text())
    spec["planning"]["max_skew_s"] = 1.0  # all daemons share this machine's clock: short windows
    spec["steps"] = STEPS
    spec["checkpoint_interval"] = 10
    spec.update(changes)
    path = tmp / f"job-{len(list(tmp.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class Ctx:
    def __init__(
        self, swarm: LocalSwarm, tmp: Path, metrics_port: int, wait_until: Callable[..., Any]
    ) -> None:
        self.swarm, self.tmp, self.metrics_port, self.wait_until = swarm, tmp, metrics_port, wait_until

    def home(self, i: int) -> str:
        return str(self.swarm.peers[i].home)

    def job_views(self, job: str) -> dict[str, dict[str, Any]]:
        return {p.name: p.control().call("job_status", job_id=job) for p in self.swarm.live_peers()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in self.swarm.peers)

    def wait(self, job: str, predicate: Any, timeout: float, what: str) -> dict[str, dict[str, Any]]:
        """Poll every daemon's view of ``job`` until ``predicate(views)``; ``timeout`` is a hang guard."""
        last: dict[str, Any] = {}

        def check() -> dict[str, dict[str, Any]] | None:
            try:
                views = self.job_views(job)
            except ControlError as exc:  # a daemon whose DHT read has not found the new job yet
                assert exc.code is ErrorCode.CONFIG_INVALID, exc
                last["views"] = f"not yet known to every daemon ({exc})"
                return None
            last["views"] = {n: (v["state"], v["progress"]["step"]) for n, v in views.items()}
            return views if predicate(views) else None

        return self.wait_until(
            check,
            timeout,
            what,
            interval=0.25,
            detail=lambda: f"last views: {last.get('views')}\n{self.logs()}",
        )


@pytest.fixture(scope="module")
def ctx(
    tmp_path_factory: pytest.TempPathFactory, profile_cache: Path, wait_until: Callable[..., Any]
) -> Iterator[Ctx]:
    root = tmp_path_factory.mktemp("jobs")
    port = _free_port()
    regions = ["eu", "eu", "eu", "us", "us", "us"]
    options = {**SWARM_OPTIONS, "profile_cache": str(profile_cache)}
    peer_options = [
        {"region": r, **({"metrics_port": port} if i == 0 else {})} for i, r in enumerate(regions)
    ]
    swarm = LocalSwarm(6, root / "s", options=options, peer_options=peer_options, ready_timeout=120)
    try:
        swarm.start()
        names = [p.name for p in swarm.peers]
        swarm.wait_until(
            lambda v: converged(v, names), timeout=90, what="all six daemons to measure each other"
        )
        yield Ctx(swarm, root, port, wait_until)
    finally:
        swarm.close()


@dataclass
class Training:
    """The demo job submitted with ``peerd submit --wait --json`` and followed on every daemon to its end."""

    job: str
    committed: dict[str, dict[str, Any]]  # every daemon's view once all had committed
    returncode: int
    out: str
    err: str


@pytest.fixture(scope="module")
def training(ctx: Ctx) -> Training:
    # --wait follows the job to its end; meanwhile this fixture watches every daemon
    waiter = subprocess.Popen(
        [*PEERD, "submit", str(_demo_spec(ctx.tmp)), "--home", ctx.home(0), "--wait", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job = _wait_for_job_id(ctx, waiter)

        def all_committed(views: dict) -> bool:
            return len(views) == 6 and all("allocation" in v for v in views.values())

        committed = ctx.wait(job, all_committed, timeout=90, what="every daemon to commit")
        ctx.wait(
            job,
            lambda vs: all(v["state"] == "done" for v in vs.values()),
            timeout=150,
            what="training to finish",
        )
        out, err = waiter.communicate(timeout=60)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
    return Training(job, committed, waiter.returncode, out, err)


def _wait_for_job_id(ctx: Ctx, waiter: subprocess.Popen) -> str:
    def published() -> str | None:
        listed = ctx.swarm.peers[0].control().call("jobs")
        if listed:
            return listed[0]["job_id"]
        assert waiter.poll() is None, waiter.communicate()
        return None

    return ctx.wait_until(published, 30, "submit --wait to publish the job", interval=0.1)


def test_a_spec_with_errors_is_refused_at_submit_naming_each_field(ctx: Ctx) -> None:
    before = {j["job_id"] for j in ctx.swarm.peers[0].control().call("jobs")}
    result = peerd("submit", "tests/unit/jobs/invalid-spec.yaml", "--home", ctx.home(0))
    assert result.returncode == 2, result.stderr
    for field in (
        "model.overrides.n_head",
        "learning_rate",
        "optimizer.lr",
        "parallel.d_dp",
        "compression.forward_bits",
    ):
        assert field in result.stderr
    assert "Traceback" not in result.stderr
    after = {j["job_id"] for j in ctx.swarm.peers[0].control().call("jobs")}
    assert after == before  # nothing was published


def test_six_peers_commit_one_allocation_and_train_it_to_the_end(ctx: Ctx, training: Training) -> None:
    job = training.job
    assert len(job) == 32
    assert training.returncode == 0, training.err
    final = json.loads(training.out)
    assert final["job_id"] == job and final["state"] == "done"
    assert "step" in training.err and "loss" in training.err  # the progress bar went to stderr

    views = training.committed
    hashes = {v["allocation"]["allocation_hash"] for v in views.values()}
    assert len(hashes) == 1, f"daemons committed different allocations: {hashes}"
    alloc = views["peer0"]["allocation"]
    assert [len(s) for s in alloc["stages"]] == [2, 2, 2]
    assert sorted(p for s in alloc["stages"] for p in s) == sorted(p.info.peer_id for p in ctx.swarm.peers)
    # the committed cost is no worse than the best result any single island published
    islands = [
        r["best_cost"]
        for v in views.values()
        for r in v["planning"]["islands"]
        if r["epoch"] == alloc["epoch"] and r["best_cost"] is not None
    ]
    assert len(islands) >= 4
    assert alloc["cost"] <= min(islands) * (1 + 1e-9)
    assert set(alloc["regions"].values()) == {"eu", "us"}
    for peer in ctx.swarm.peers:  # --device cpu reached every tasklet's worker (issue 11)
        assert f"job {job} stage " in peer.log_path.read_text(errors="replace")
        assert " computes on cpu in fp32" in peer.log_path.read_text(errors="replace")

    status = peerd("status", "--json", "--home", ctx.home(3))
    assert status.returncode == 0, status.stderr
    jobs = json.loads(status.stdout)["jobs"]
    mine = next(j for j in jobs if j["job_id"] == job)
    assert mine["state"] == "done" and mine["allocation"]["allocation_hash"] in hashes
    progress = mine["progress"]
    assert progress["step"] == STEPS
    losses = [loss for _, loss in progress["losses"]]
    assert len(losses) >= STEPS // 2
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, f"loss did not fall: {losses}"
    assert progress["bytes"]["activations"] > 0 and progress["bytes"]["averaging"] > 0
    assert progress["compression_ratio"] > 2  # fw 4-bit / bw 8-bit / grad 8-bit vs fp32
    # 30 steps x 16 examples over the demo corpus's 255 windows: ~1.9 visits each, so about half the
    # activations go as 4-bit deltas and the rest as 8-bit first visits (fp32 first visits: 1.7x)
    by_kind = progress["compression_by_kind"]
    assert by_kind["activations"] > 3.5 and by_kind["gradients"] > 3 and by_kind["averaging"] > 3, by_kind
    assert mine["spec"]["examples"] == 255 and "examples repeat (1.9 visits each)" in training.err

    listed = peerd("jobs", "--json", "--home", ctx.home(5))
    assert listed.returncode == 0, listed.stderr
    assert any(j["job_id"] == job and j["state"] == "done" for j in json.loads(listed.stdout))
    table = peerd("status", "--home", ctx.home(0))
    assert "replica 0: s0:" in table.stdout and "→" in table.stdout and "loss" in table.stdout

    with urllib.request.urlopen(f"http://127.0.0.1:{ctx.metrics_port}/metrics", timeout=10) as reply:
        samples = [s for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples]
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert value[("peerd_peers_online", ())] == 6
    assert value[("peerd_job_step", (("job", job),))] == STEPS
    assert value[("peerd_job_wire_bytes_total", (("job", job), ("kind", "activations")))] > 0
    assert any(s.name == "peerd_link_rtt_seconds" for s in samples)


def test_fetch_assembles_a_model_that_loads(ctx: Ctx, training: Training) -> None:
    out = ctx.tmp / "fetched"
    extra = [arg for p in ctx.swarm.peers[1:] for arg in ("--from", str(p.home / "checkpoints"))]
    result = peerd("fetch", training.job, "--out", str(out), "--home", ctx.home(0), *extra)
    assert result.returncode == 0, result.stderr
    from peerd.jobs.fetch import load_model

    model, meta = load_model(out / "model.pt")
    assert meta["step"] == STEPS and meta["job"] == training.job
    assert model.num_parameters() > 0


def test_cancel_is_for_the_owner_only_and_forged_cancels_are_ignored(ctx: Ctx) -> None:
    # min_peers 7 > 6 daemons: the job plans forever (cheaply) until cancelled
    result = peerd("submit", str(_demo_spec(ctx.tmp, min_peers=7, max_peers=7)), "--home", ctx.home(1))
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip()
    ctx.wait(
        job, lambda vs: len(vs) == 6 and all(v["state"] == "planning" for v in vs.values()), 60, "planning"
    )

    refused = peerd("cancel", job, "--home", ctx.home(4))
    assert refused.returncode == 1
    assert "NOT_OWNER" in refused.stderr and "only its owner may cancel" in refused.stderr

    stranger = _store_forged_cancel(ctx.swarm.bootstrap_maddrs, job)
    # every daemon logs each record it ignores: once all six have read (and dropped) the forged
    # one, their views are what the forgery left them with
    ignored = f"job {job}: ignoring a record stored by {stranger}"
    ctx.wait_until(
        lambda: all(ignored in p.log_path.read_text(errors="replace") for p in ctx.swarm.peers),
        60,
        "every daemon to read and ignore the forged cancel",
        interval=0.25,
        detail=ctx.logs,
    )
    views = ctx.job_views(job)
    assert len(views) == 6
    assert all(v["state"] == "planning" and v["record_state"] != "cancelled" for v in views.values())

    _max_jobs_holds_runners_not_plans(ctx)

    done = peerd("cancel", job[:10], "--home", ctx.home(1))
    assert done.returncode == 0, done.stderr
    assert "cancelled" in done.stdout
    ctx.wait(job, lambda vs: all(v["state"] == "cancelled" for v in vs.values()), 30, "the owner's cancel")


def _max_jobs_holds_runners_not_plans(ctx: Ctx) -> None:
    """max_jobs 1: the job planning forever takes no slot; a job that runs takes one on the peers running it,
    which then apply to no other job until it ends."""
    spec = _demo_spec(ctx.tmp, steps=100_000, min_peers=2, max_peers=2, parallel={"d_pp": 2, "d_dp": 1})
    runs = peerd("submit", str(spec), "--home", ctx.home(2))
    assert runs.returncode == 0, runs.stderr
    running = runs.stdout.strip()
    views = ctx.wait(
        running,
        lambda vs: len(vs) == 6 and sum("tasklet" in v for v in vs.values()) == 2,
        90,
        "two daemons to run the long job",
    )
    runners = {n for n, v in views.items() if "tasklet" in v}
    _working_peers_leave_their_measured_links_alone(ctx, runners)
    late = peerd("submit", str(_demo_spec(ctx.tmp, min_peers=7, max_peers=7)), "--home", ctx.home(2))
    assert late.returncode == 0, late.stderr
    job = late.stdout.strip()
    views = ctx.wait(
        job,
        lambda vs: len(vs) == 6 and all("planning" in v for v in vs.values()),
        60,
        "every daemon to start planning the late job",
    )
    for name, v in views.items():
        applies = name not in runners
        assert v["planning"]["participant"] is applies and ("not_applying" not in v) is applies, (name, v)
    runner_home = next(str(p.home) for p in ctx.swarm.peers if p.name in runners)
    listed = peerd("jobs", "--home", runner_home)
    assert "not applying here" in listed.stdout, listed.stdout
    assert peerd("cancel", running, "--home", ctx.home(2)).returncode == 0
    ctx.wait(
        job,
        lambda vs: all(v["planning"]["participant"] and "not_applying" not in v for v in vs.values()),
        60,
        "the long job's daemons to apply to the late job once it ended",
    )
    assert peerd("cancel", job, "--home", ctx.home(2)).returncode == 0


def _own_links(swarm: LocalSwarm) -> dict[str, dict[str, tuple[float, str]]]:
    """name -> (peer -> when it last measured its link to that peer, and that probe's status), from
    each daemon's published record."""
    out = {}
    for name, view in swarm.statuses().items():
        me = view["self"]["peer_id"]
        out[name] = {
            link["dst"]: (link["measured_at"], link["status"]) for link in view["links"] if link["src"] == me
        }
    return out


def _working_peers_leave_their_measured_links_alone(ctx: Ctx, runners: set[str]) -> None:
    """A daemon running a tasklet does not re-probe links it measured (a bulk probe would compete with the
    job's traffic), and refuses the probes of idle daemons that hold good figures for their link to
    it (they keep them); idle daemons keep re-probing each other every round (probe_interval 4 s)."""
    time.sleep(8)  # a probe round begun before the job committed ends, and its records are republished
    before = _own_links(ctx.swarm)
    time.sleep(10)
    after = _own_links(ctx.swarm)
    for name in runners:
        assert after[name] == before[name], (name, before[name], after[name])
    idle = [n for n in after if n not in runners and n in before]
    assert idle and all(after[n] != before[n] for n in idle), (before, after)
    # an idle daemon's good figures for its links to the runners stand: the runners refused its
    # probes (one whose last probe of such a link had failed would be served)
    ids = {name: view["self"]["peer_id"] for name, view in ctx.swarm.statuses().items()}
    working = {ids[name] for name in runners}
    for name in idle:
        held = {p: link for p, link in before[name].items() if p in working and link[1] == "ok"}
        assert held and all(after[name].get(p) == link for p, link in held.items()), (name, held, after[name])


def _store_forged_cancel(bootstrap: list[str], job: str) -> str:
    """A stranger (a short-lived DHT client with its own key) stores a CANCELLED copy of the job record.

    Returns the stranger's peer id, once a read of the job key finds the forged entry in the DHT.
    """
    from peerd.jobs.catalog import read_job
    from peerd.jobs.records import JobState, encode_job
    from peerd.jobs.store import DhtStore
    from peerd.swarm.identity import Identity, make_record_validators
    from peerd.swarm.keys import job_key
    from peerd.swarm.node import NodeSettings, SwarmNode

    identity = Identity.generate()

    async def forge() -> None:
        node = await SwarmNode.start(
            NodeSettings(initial_peers=bootstrap, client_mode=True),
            make_record_validators(identity, "default"),
        )
        try:
            store = DhtStore(node.dht, identity.owner_tag, identity.peer_id, node.now)
            record = await read_job(store, job)
            assert record is not None and record.state != JobState.CANCELLED
            forged = record.with_state(JobState.CANCELLED, node.now(), "forged by a stranger")
            assert await store.put(job_key(job), encode_job(forged), node.now() + 3600)
            stored = await store.read(job_key(job))
            assert any(e.author == identity.peer_id for e in stored), "the forged record is not readable"
        finally:
            await node.shutdown(timeout=5.0)

    asyncio.run(forge())
    return identity.peer_id
