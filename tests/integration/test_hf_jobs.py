"""Hugging Face models as jobs on four real daemons on loopback (2 stages x 2 replicas), through the ``peerd`` CLI.

A tiny randomly initialised GPT-2 (its config as a ``config.json`` path, which ``peerd submit``
inlines) and a tiny Llama (its config inline) each train through ``peerd submit`` and match,
step by step within 1e-4, a single-process run of HF's own model class holding the same
initial weights. The GPT-2 job is fetched (``peerd fetch``) and fine-tuned from that file
(``kind: finetune``): its step-0 loss is the checkpoint's loss on the same batch, its curve the
single-process continuation of the checkpoint, below where pre-training started. A fine-tune
whose ``init_checkpoint`` does not exist on the peers fails, naming the field; one from HF weights
(a ``save_pretrained`` directory) follows HF's own model trained from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="optional extra: transformers is not installed")

from peerd.data.config import build_dataset  # noqa: E402
from peerd.data.sampler import EpochSampler  # noqa: E402
from peerd.jobs.runner import train_config  # noqa: E402
from peerd.jobs.spec import JobSpec, load_job_spec  # noqa: E402
from peerd.localswarm import LocalSwarm, converged  # noqa: E402
from peerd.models import open_checkpoint  # noqa: E402
from peerd.models.hf import HFStagedLM  # noqa: E402
from peerd.models.registry import HFFamily  # noqa: E402
from peerd.pipeline.local import LocalRunConfig, train_unstaged  # noqa: E402
from peerd.sched.allocation import Allocation  # noqa: E402

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
GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 256,
    "n_positions": 64,
    "tie_word_embeddings": False,  # the embedding and the head sit in different stages
    "resid_pdrop": 0.0,  # dropout draws differ between processes: off, for an exact comparison
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
STEPS = 8


def peerd(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*PEERD, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, profile_cache: Path) -> Iterator[LocalSwarm]:
    root = tmp_path_factory.mktemp("hfjobs")
    options = {**SWARM_OPTIONS, "profile_cache": str(profile_cache)}
    s = LocalSwarm(4, root / "s", options=options, ready_timeout=120)
    try:
        s.start()
        names = [p.name for p in s.peers]
        s.wait_until(lambda v: converged(v, names), timeout=90, what="all four daemons to measure each other")
        yield s
    finally:
        s.close()


def _spec(tmp: Path, name: str, model: dict[str, Any], **changes: Any) -> Path:
    spec = {
        "name": name,
        "kind": "pretrain",
        "model": model,
        "data": {"source": "builtin", "seq_len": 32, "max_bytes": 256 * 1024},
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
        # raw activations, gradients and averaging: the pipeline must then be exact
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
        **changes,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(swarm: LocalSwarm, spec_file: Path) -> dict[str, Any]:
    """``peerd submit --wait --json``: the job's final view (every daemon trains it)."""
    home = str(swarm.peers[0].home)
    result = peerd("submit", str(spec_file), "--home", home, "--wait", "--json", timeout=600)
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in swarm.peers)
    assert result.stdout.strip(), f"{result.stderr[-3000:]}\n{logs}"
    final = json.loads(result.stdout)
    final["returncode"] = result.returncode
    final["logs"] = logs
    return final


def _curve(final: dict[str, Any]) -> list[float]:
    losses = final["progress"]["losses"]
    assert [s for s, _ in losses] == list(range(len(losses))), losses
    return [v for _, v in losses]


def _reference(spec: JobSpec, model: torch.nn.Module) -> list[float]:
    """The job trained in one process: same optimizer, schedule, clipping and global batches."""
    cfg = train_config("reference", spec, Allocation(stages=(("a", "b"), ("c", "d"))), None)
    local = LocalRunConfig(
        steps=spec.steps,
        global_batch=spec.global_batch,
        micro_batch_size=spec.micro_batch,
        replicas=2,
        optimizer=cfg.optimizer,
        total_steps=spec.steps,
    )
    return train_unstaged(model, build_dataset(spec.data), local)


def _hf_model(spec: JobSpec) -> torch.nn.Module:
    """HF's own model class (not peerd's per-layer build) holding the job's initial weights."""
    family = spec.model.family()
    assert isinstance(family, HFFamily)
    return HFStagedLM(family.to_hf(family.build()))


def _close(job: list[float], reference: list[float]) -> float:
    assert len(job) == len(reference), (job, reference)
    return max(abs(a - b) for a, b in zip(job, reference, strict=True))


@pytest.fixture(scope="module")
def gpt2_job(swarm: LocalSwarm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("gpt2")
    transformers.AutoConfig.for_model(**GPT2).save_pretrained(tmp / "tiny-gpt2")  # a config.json on disk
    spec_file = _spec(tmp, "hf-gpt2", {"hf": str(tmp / "tiny-gpt2" / "config.json"), "seed": 3})
    final = _submit(swarm, spec_file)
    return {"final": final, "spec": load_job_spec(spec_file), "tmp": tmp}


@pytest.mark.timeout(900)
def test_hf_gpt2_trains_over_two_stages_and_two_replicas_like_one_process(gpt2_job: dict[str, Any]) -> None:
    final, spec = gpt2_job["final"], gpt2_job["spec"]
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    record_model = final["spec_mapping"]["model"]["hf"]  # the record carries the config, not a path
    assert (
        isinstance(record_model, dict)
        and record_model["n_embd"] == 32
        and final["spec"]["model"] == "hf gpt2"
    )
    job = _curve(final)
    reference = _reference(spec, _hf_model(spec))
    assert len(job) == STEPS and job[-1] < job[0] - 0.3
    assert _close(job, reference) < 1e-4, (job, reference)


@pytest.mark.timeout(900)
def test_hf_llama_trains_over_two_stages_and_two_replicas_like_one_process(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    spec_file = _spec(tmp_path, "hf-llama", {"hf": LLAMA, "seed": 4})
    final = _submit(swarm, spec_file)
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    spec = load_job_spec(spec_file)
    job, reference = _curve(final), _reference(spec, _hf_model(spec))
    assert len(job) == STEPS and job[-1] < job[0] - 0.3
    assert _close(job, reference) < 1e-4, (job, reference)


@pytest.mark.timeout(900)
def test_finetune_from_the_fetched_checkpoint_continues_its_curve(
    swarm: LocalSwarm, gpt2_job: dict[str, Any]
) -> None:
    final, tmp = gpt2_job["final"], gpt2_job["tmp"]
    assert final["state"] == "done", final["logs"]
    out = tmp / "fetched"
    extra = [arg for p in swarm.peers[1:] for arg in ("--from", str(p.home / "checkpoints"))]
    home = str(swarm.peers[0].home)
    fetched = peerd("fetch", final["job_id"], "--out", str(out), "--home", home, *extra, timeout=300)
    assert fetched.returncode == 0, fetched.stderr
    ck = open_checkpoint(out / "model.pt")
    assert ck.meta["step"] == STEPS and ck.family.describe()["config"] == gpt2_job["spec"].model.hf

    model = {"hf": gpt2_job["spec"].model.hf, "seed": 3}
    spec_file = _spec(tmp, "hf-gpt2-ft", model, kind="finetune", init_checkpoint=str(out / "model.pt"))
    tuned = _submit(swarm, spec_file)
    assert tuned["returncode"] == 0 and tuned["state"] == "done", tuned["logs"]
    spec = load_job_spec(spec_file)
    job = _curve(tuned)

    # step 0: exactly the checkpoint's loss on step 0's batch
    dataset = build_dataset(spec.data)
    x_BT, y_BT = dataset.batch(EpochSampler(len(dataset), spec.global_batch, 0, 2).batch_ids(0))
    with torch.no_grad():
        at_checkpoint = float(ck.family.loss(ck.model(x_BT), y_BT))
    assert abs(job[0] - at_checkpoint) < 1e-4, (job[0], at_checkpoint)
    # then the single-process continuation of the checkpoint, step by step
    assert _close(job, _reference(spec, open_checkpoint(out / "model.pt").model.train())) < 1e-4
    pretrain = _curve(final)
    assert job[0] < pretrain[0] - 0.3  # it starts where pre-training got to, not from scratch
    assert job[0] < pretrain[-1] + 0.3


@pytest.mark.timeout(600)
def test_a_finetune_whose_checkpoint_is_missing_fails_naming_the_field(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    missing = tmp_path / "not-on-these-peers" / "model.pt"
    spec_file = _spec(
        tmp_path,
        "hf-missing",
        {"hf": GPT2},
        kind="finetune",
        init_checkpoint=str(missing),
        steps=2,
        optimizer={},
    )
    final = _submit(swarm, spec_file)
    assert final["returncode"] == 1 and final["state"] == "failed", final["logs"]
    assert "init_checkpoint" in final["reason"] and "no such file" in final["reason"], final["reason"]


@pytest.mark.timeout(600)
def test_finetune_from_hf_weights_starts_at_the_hf_models_loss(swarm: LocalSwarm, tmp_path: Path) -> None:
    pretrained = HFFamily(GPT2, seed=9)  # "downloaded" weights: another init than the job's seed
    hf_model = pretrained.to_hf(pretrained.build())
    hf_model.save_pretrained(tmp_path / "pretrained")  # config.json + model.safetensors
    model = {"hf": str(tmp_path / "pretrained"), "seed": 0}  # the same directory gives the config
    spec_file = _spec(
        tmp_path,
        "hf-gpt2-from-hf",
        model,
        kind="finetune",
        init_checkpoint=str(tmp_path / "pretrained"),
        steps=3,
    )
    final = _submit(swarm, spec_file)
    assert final["returncode"] == 0 and final["state"] == "done", final["logs"]
    spec = load_job_spec(spec_file)
    job = _curve(final)
    assert _close(job, _reference(spec, HFStagedLM(hf_model))) < 1e-4, job
