"""Job specs of Hugging Face models: a config path is read into the spec (the published record carries
the config itself), each bad field is named, the planner sizes the model, and the runner's
``TrainConfig`` builds it (with the fine-tune checkpoint it names)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="optional extra: transformers is not installed")

from peerd.errors import ConfigError  # noqa: E402
from peerd.jobs.records import normalized_spec  # noqa: E402
from peerd.jobs.runner import state_bound, train_config  # noqa: E402
from peerd.jobs.scoring import job_model  # noqa: E402
from peerd.jobs.spec import JobSpecError, load_job_spec, parse_job_spec  # noqa: E402
from peerd.models.registry import build_family  # noqa: E402
from peerd.sched.allocation import Allocation  # noqa: E402

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 64}
BASE = {
    "kind": "pretrain",
    "steps": 4,
    "global_batch": 8,
    "micro_batch": 2,
    "data": {"source": "builtin", "seq_len": 32},
    "parallel": {"d_pp": 2, "d_dp": 2},
    "min_peers": 4,
}


def _write(tmp: Path, spec: dict) -> Path:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_config_path_is_inlined_so_the_record_means_the_same_on_every_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{**GPT2, "tie_word_embeddings": False})
    )
    model.save_pretrained(tmp_path / "pretrained")  # config.json with HF's metadata keys
    for where in ("pretrained", "pretrained/config.json"):  # relative to where peerd submit runs
        monkeypatch.chdir(tmp_path)
        spec = load_job_spec(_write(tmp_path, {**BASE, "model": {"hf": where, "seed": 1}}))
        assert isinstance(spec.model.hf, dict) and spec.model.hf["n_layer"] == 2
        assert "transformers_version" not in spec.model.hf
        record = json.loads(json.dumps(normalized_spec(spec)))  # what another peer decodes
        (tmp_path / "elsewhere").mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / "elsewhere")  # a peer where the path does not exist
        again = parse_job_spec(record, source="job abc")
        assert again.model.family().describe() == spec.model.family().describe()
    with pytest.raises(JobSpecError) as err:
        load_job_spec(_write(tmp_path, {**BASE, "model": {"hf": "nope.json"}}))
    assert [(e.field, "no such file" in e.detail) for e in err.value.errors] == [("model.hf", True)]


def test_each_bad_hf_field_is_named() -> None:
    cases = [
        ({"hf": {**GPT2, "n_layers": 3}}, "model.hf.n_layers", "not a field"),
        ({"hf": {**GPT2, "model_type": "t5"}}, "model.hf.model_type", "must be one of"),
        ({"hf": {**GPT2, "vocab_size": 100}}, "model", "vocab_size >= 256"),
        ({"hf": GPT2, "overrides": {"n_layer": 2}}, "model.overrides", "only applies"),
        ({"hf": {**GPT2, "n_positions": 16}}, "data.seq_len", "max_seq_len 16"),
    ]
    for model, field, needle in cases:
        with pytest.raises(JobSpecError) as err:
            parse_job_spec({**BASE, "model": model})
        found = {e.field: e.detail for e in err.value.errors}
        assert field in found and needle in found[field], (model, found)


def test_the_planner_sizes_hf_models_and_refuses_a_tied_split() -> None:
    for config in (
        {**GPT2, "tie_word_embeddings": False},
        {
            "model_type": "llama",
            "num_hidden_layers": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 64,
        },
    ):
        spec = parse_job_spec({**BASE, "model": {"hf": config}})
        jm = job_model(spec)
        family = build_family(config["model_type"], config)
        assert jm.model.layers == family.num_layers and jm.model.hidden == 32 and not jm.single_stage
        assert jm.model.layer_params == [float(c.params) for c in family.layer_costs(32)]
        assert state_bound(spec) > 16 * sum(jm.model.layer_params)
    tied = parse_job_spec({**BASE, "model": {"hf": GPT2}})  # GPT-2 ties by default
    with pytest.raises(ConfigError, match="tie_word_embeddings: false or d_pp: 1"):
        job_model(tied)
    assert job_model(parse_job_spec({**tied_spec(), "model": {"hf": GPT2}})).single_stage


def tied_spec() -> dict:
    return {**BASE, "parallel": {"d_pp": "auto", "d_dp": "auto"}}


def test_the_runner_builds_the_hf_model_with_its_finetune_checkpoint(tmp_path: Path) -> None:
    config = {**GPT2, "tie_word_embeddings": False}
    spec = parse_job_spec(
        {
            **BASE,
            "kind": "finetune",
            "init_checkpoint": str(tmp_path / "ck"),
            "model": {"hf": config, "seed": 2},
        }
    )
    cfg = train_config("job1", spec, Allocation(stages=(("a", "b"), ("c", "d"))), None)
    cfg.validate()  # the shape is checked without the checkpoint
    assert cfg.layers_per_stage == [2, 2] and cfg.model.init_checkpoint == str(tmp_path / "ck")
    assert cfg.model.base().describe() == build_family("gpt2", config, seed=2).describe()
    with pytest.raises(ConfigError, match="no such file") as err:
        cfg.model.family()  # what each tasklet's worker does first: the path must exist on its disk
    assert err.value.field == "init_checkpoint"


@pytest.mark.parametrize("path", ["configs/jobs/hf-llama-tiny.yaml", "configs/jobs/hf-llama-finetune.yaml"])
def test_the_shipped_hf_examples_load_and_plan(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec_file = Path(path).resolve()
    # the fine-tune's corpus (my-corpus/*.txt) is the owner's: submit reads it, so give it one
    (tmp_path / "my-corpus").mkdir()
    (tmp_path / "my-corpus" / "sample.txt").write_bytes(b"an owner's own text. " * 400)
    monkeypatch.chdir(tmp_path)
    spec = load_job_spec(spec_file)
    assert spec.model.family().name == "llama" and job_model(spec).model.layers == 6
