"""A job with a validation split on four real daemons on loopback (2 stages x 2 replicas), through ``peerd``.

The job's held-out loss, as ``peerd submit --wait --json`` reports it from the progress records
(the mean of the last stage's replicas after steps 4 and 8), equals the held-out loss of the same
model trained in one process and evaluated there on the same held-out windows, within 1e-4;
``peerd status --json`` and ``/metrics`` show the latest evaluation. A split that leaves no
evaluation batch is refused by ``peerd submit``, naming ``data.validation.batches``; published
anyway (a client that skips the check), it fails the job on the tasklets, naming the field.
A local text directory trains as a job whose record carries its absolute path and the
submitter's digest; when the peers' copy no longer matches it, the job fails naming
``data.expect_digest``.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from peerd.data.config import build_dataset
from peerd.data.sources import text_files_corpus
from peerd.jobs.records import normalized_spec
from peerd.jobs.runner import train_config
from peerd.jobs.spec import JobSpec, load_job_spec, parse_job_spec
from peerd.localswarm import LocalSwarm, converged
from peerd.models.gpt import lm_loss
from peerd.pipeline.local import LocalRunConfig, optimizer_and_scheduler, train_unstaged
from peerd.sched.allocation import Allocation

# a hang guard, not a speed target: under a load of ~18 on two cores one 4-step job took over 300 s
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

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
STEPS = 8
EVALUATED = [4, 8]


def peerd(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*PEERD, *args], capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, profile_cache: Path) -> Iterator[LocalSwarm]:
    root = tmp_path_factory.mktemp("valjobs")
    options = {**SWARM_OPTIONS, "profile_cache": str(profile_cache)}
    peer_options = [{"metrics_port": _free_port()}, {}, {}, {}]
    s = LocalSwarm(4, root / "s", options=options, peer_options=peer_options, ready_timeout=120)
    try:
        s.start()
        names = [p.name for p in s.peers]
        s.wait_until(lambda v: converged(v, names), timeout=90, what="all four daemons to measure each other")
        yield s
    finally:
        s.close()


def _spec(tmp: Path, name: str, validation: dict[str, Any]) -> Path:
    spec = {
        "name": name,
        "kind": "pretrain",
        "model": {"preset": "tiny", "seed": 3},
        "data": {"source": "builtin", "seq_len": 32, "max_bytes": 128 * 1024, "validation": validation},
        "steps": STEPS,
        "global_batch": 8,
        "micro_batch": 2,
        "optimizer": {
            "name": "adamw",
            "lr": 0.003,
            "warmup_steps": 2,
            "schedule": "cosine",
            "grad_clip": 1.0,
        },
        "parallel": {"d_pp": 2, "d_dp": 2},
        # raw activations, gradients and averaging: the pipeline is then exact
        "compression": {
            "forward": "none",
            "forward_bits": None,
            "backward_bits": None,
            "gradient_bits": None,
        },
        "checkpoint_interval": STEPS,
        "min_peers": 4,
        "max_peers": 4,
        "planning": {"time_budget_s": 2, "max_skew_s": 1.0},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(swarm: LocalSwarm, spec_file: Path) -> dict[str, Any]:
    """``peerd submit --wait --json``: the job's final view (every daemon trains it)."""
    try:
        result = peerd(
            "submit", str(spec_file), "--home", str(swarm.peers[0].home), "--wait", "--json", timeout=600
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"peerd submit --wait did not return within 600 s\n{_diagnosis(swarm)}")
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in swarm.peers)
    assert result.stdout.strip(), f"{result.stderr[-3000:]}\n{logs}"
    final = json.loads(result.stdout)
    final["returncode"], final["logs"] = result.returncode, logs
    return final


def _diagnosis(swarm: LocalSwarm) -> str:
    """Each daemon's log tail and the stacks of its tasks: what a stuck job waits on."""
    return "\n".join(f"--- {p.name}\n{p.log_tail(15)}\n{p.stacks()}" for p in swarm.peers)


def _reference(spec: JobSpec) -> list[tuple[int, float]]:
    """The job trained in one process (full batches, same optimizer, schedule and clipping), evaluated
    on the first global batch of held-out windows after each evaluated step."""
    assert spec.data.validation is not None
    model = spec.model.family().build()
    dataset = build_dataset(spec.data)
    held = list(dataset.held_out_ids())[: spec.data.validation.batches * spec.global_batch]
    x, y = dataset.batch(held)
    optimizer_cfg = train_config(
        "reference", spec, Allocation(stages=(("a", "b"), ("c", "d"))), None
    ).optimizer
    local = LocalRunConfig(
        steps=STEPS,
        global_batch=spec.global_batch,
        micro_batch_size=spec.global_batch,
        replicas=2,
        optimizer=optimizer_cfg,
        total_steps=STEPS,
    )
    optimizer, scheduler = optimizer_and_scheduler(list(model.parameters()), local, None, None)
    points, done = [], 0
    for k in EVALUATED:
        train_unstaged(
            model, dataset, dataclasses.replace(local, start_step=done, steps=k - done), optimizer, scheduler
        )
        model.eval()
        with torch.no_grad():
            points.append((k, lm_loss(model(x), y).item()))
        model.train()
        done = k
    return points


def test_a_jobs_held_out_loss_equals_the_one_process_evaluation(swarm: LocalSwarm, tmp_path: Path) -> None:
    spec_file = _spec(tmp_path, "val", {"windows": 64, "interval": 4, "batches": 1})
    final = _submit(swarm, spec_file)
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    got = [(k, v) for k, v in final["progress"]["val_losses"]]
    reference = _reference(load_job_spec(spec_file))
    assert [k for k, _ in got] == EVALUATED, got
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, reference, strict=True)) < 1e-4, (got, reference)
    assert final["progress"]["val_loss"] == pytest.approx(got[-1][1], abs=1e-6)  # the curve is rounded
    # held-out activations are their own byte kind, outside the compression ratio (1.0 uncompressed)
    assert final["progress"]["bytes"]["validation"] > 0
    assert final["progress"]["compression_ratio"] == pytest.approx(1.0, abs=0.02)
    # peerd status --json and /metrics show the latest evaluation too
    # (another daemon reads the final records from the DHT within a few of its polls)
    deadline = time.monotonic() + 60
    while True:
        status = json.loads(peerd("status", "--json", "--home", str(swarm.peers[1].home)).stdout)
        view = next(j for j in status["jobs"] if j["job_id"] == final["job_id"])
        if view["progress"]["val_losses"] == final["progress"]["val_losses"] or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert view["progress"]["val_losses"] == final["progress"]["val_losses"]
    port = swarm.peers[0].options["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {
        (s.name, s.labels.get("job")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("peerd_job_val_loss", final["job_id"])] == pytest.approx(got[-1][1], abs=1e-6)
    assert samples[("peerd_job_val_step", final["job_id"])] == 8


def test_a_split_too_small_for_an_evaluation_is_refused_naming_the_field(
    swarm: LocalSwarm, tmp_path: Path, wait_until: Callable[..., Any]
) -> None:
    # 1 % of the corpus's ~4000 windows is ~40, fewer than the 6 x 8 an evaluation needs
    spec_file = _spec(tmp_path, "tiny-split", {"fraction": 0.01, "interval": 4, "batches": 6})
    home = str(swarm.peers[0].home)
    before = {j["job_id"] for j in swarm.peers[0].control().call("jobs")}
    # peerd submit reads the corpus and refuses it before publishing anything
    refused = peerd("submit", str(spec_file), "--home", home)
    assert refused.returncode == 2 and "data.validation.batches" in refused.stderr, refused.stderr
    assert {j["job_id"] for j in swarm.peers[0].control().call("jobs")} == before
    # a client that skips that check: every tasklet refuses it on its own copy, the job fails
    # naming the field, and the daemons keep running
    spec = normalized_spec(load_mapping_spec(spec_file))
    job = swarm.peers[0].control().call("submit", spec=spec, source="control")["job_id"]
    final = wait_until(
        lambda: _final(swarm, job),
        300,
        "the job to fail on its tasklets",
        interval=0.5,
        detail=lambda: _diagnosis(swarm),
    )
    assert final["state"] == "failed", final
    assert "data.validation.batches" in final["reason"], final["reason"]
    assert all(p.process is not None and p.process.poll() is None for p in swarm.peers)


def load_mapping_spec(path: Path) -> JobSpec:
    """The spec as a file holds it, without what ``peerd submit`` adds (reading the corpus)."""
    return parse_job_spec(yaml.safe_load(path.read_text()))


def _final(swarm: LocalSwarm, job: str) -> dict[str, Any] | None:
    view = swarm.peers[0].control().call("job_status", job_id=job)
    return view if view["state"] in ("done", "failed", "cancelled") else None


def _text_spec(tmp: Path, name: str, corpus: Path) -> Path:
    spec = yaml.safe_load(_spec(tmp, name, {"windows": 16, "interval": 4, "batches": 1}).read_text())
    spec["data"] = {**spec["data"], "source": "text", "paths": [str(corpus)], "max_bytes": 1 << 20}
    spec["steps"] = spec["checkpoint_interval"] = 4
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _corpus(root: Path) -> Path:
    """A directory of text in two levels: read in sorted relative-path order."""
    (root / "books" / "vol2").mkdir(parents=True)
    for i, rel in enumerate(["a.txt", "vol2/b.txt", "c.txt"]):
        (root / "books" / rel).write_text(
            f"part {i}: " + "the quick brown fox jumps over the lazy dog. " * 120
        )
    return root / "books"


def test_a_job_trains_on_a_local_text_directory_pinned_by_its_digest(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    corpus = _corpus(tmp_path)
    final = _submit(swarm, _text_spec(tmp_path, "text", corpus))
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    data = final["spec_mapping"]["data"]  # what the job record carries: absolute paths, the digest
    assert data["paths"] == [str(corpus)]
    assert data["expect_digest"] == text_files_corpus([str(corpus)]).digest
    assert [s for s, _ in final["progress"]["losses"]] == [0, 1, 2, 3]
    assert [k for k, _ in final["progress"]["val_losses"]] == [4]


def test_a_peer_whose_copy_differs_fails_naming_the_digest(
    swarm: LocalSwarm, tmp_path: Path, wait_until: Callable[..., Any]
) -> None:
    corpus = _corpus(tmp_path)
    result = peerd("submit", str(_text_spec(tmp_path, "changed", corpus)), "--home", str(swarm.peers[0].home))
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip()
    # the peers read their copy once the job is planned: this one no longer has the submitted bytes
    (corpus / "a.txt").write_text("something else entirely. " * 200)
    final = wait_until(
        lambda: _final(swarm, job), 300, f"job {job} to end", interval=0.5, detail=lambda: _diagnosis(swarm)
    )
    assert final["state"] == "failed", final
    assert "data.expect_digest" in final["reason"], final["reason"]
