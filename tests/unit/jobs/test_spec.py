"""Job specs: the example configs load; a bad spec is refused with every problem named by its field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from peerd.averaging.aggregate import ClippedMean, Mean
from peerd.errors import ConfigError, ErrorCode
from peerd.jobs.spec import JobSpec, JobSpecError, load_job_spec, parse_job_spec
from peerd.loading import from_mapping, to_mapping

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "configs" / "jobs").glob("*.yaml"))

GOOD = {
    "kind": "pretrain",
    "model": {"preset": "tiny"},
    "steps": 100,
    "global_batch": 16,
    "micro_batch": 4,
    "data": {"seq_len": 64},
    "parallel": {"d_pp": 3, "d_dp": 2},
    "min_peers": 6,
}


def spec_with(**changes) -> dict:
    data = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is ...:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(data)
    assert err.value.code == ErrorCode.CONFIG_INVALID
    return {e.field: str(e) for e in err.value.errors}


def test_examples_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = {p.name for p in EXAMPLES}
    assert {"gpt-tiny-demo.yaml", "gpt-small.yaml"} <= names
    # an example's local text corpus is the owner's, not shipped: submit reads it, so give it one
    monkeypatch.chdir(tmp_path)
    for path in EXAMPLES:
        data = yaml.safe_load(path.read_text()).get("data") or {}
        for pattern in data.get("paths") or [] if data.get("source") == "text" else []:
            sample = tmp_path / pattern.replace("*", "sample")
            sample.parent.mkdir(parents=True, exist_ok=True)
            sample.write_bytes(b"an owner's own text. " * 400)
        spec = load_job_spec(path)
        assert spec.kind in ("pretrain", "finetune", "rl") and spec.steps > 0
        assert (spec.kind == "finetune") == (spec.init_checkpoint is not None)
    assert "grpo-addition.yaml" in names  # the rl example


def test_the_demo_spec_fits_six_peers_on_a_laptop() -> None:
    spec = load_job_spec(ROOT / "configs" / "jobs" / "gpt-tiny-demo.yaml")
    assert (spec.parallel.d_pp, spec.parallel.d_dp) == (3, 2) and spec.min_peers == spec.max_peers == 6
    assert spec.model.gpt_config().num_layers >= 3
    assert spec.planning.timing().search_s == spec.planning.time_budget_s


def test_defaults_and_round_trip_through_a_plain_mapping() -> None:
    spec = parse_job_spec(GOOD)
    assert spec.optimizer.name == "adamw" and spec.compression.forward == "acsgd"
    assert spec.compression.forward_bits == 4 and spec.compression.gradient_bits is None
    assert spec.data.source == "builtin" and spec.checkpoint_interval == 100
    again = parse_job_spec(yaml.safe_load(yaml.safe_dump(to_mapping(spec))))
    assert again == spec  # what a job record carries rebuilds the same spec on every peer


def test_auto_shape_skips_the_checks_that_need_it() -> None:
    spec = parse_job_spec(spec_with(parallel={"d_pp": "auto", "d_dp": "auto"}, global_batch=12, min_peers=1))
    assert spec.parallel.known() == {}


def test_the_invalid_example_lists_every_problem() -> None:
    with pytest.raises(JobSpecError) as err:
        load_job_spec(Path(__file__).parent / "invalid-spec.yaml")
    fields = [e.field for e in err.value.errors]
    assert set(fields) == {
        "learning_rate",
        "model.overrides.n_head",
        "optimizer.lr",
        "optimizer.betas",
        "parallel.d_dp",
        "compression.forward_bits",
        "compression.gradient_bits",
        "planning.time_budget_s",
    }
    text = str(err.value)
    assert "invalid-spec.yaml: 8 problems" in text and "learning_rate: unknown key" in text
    assert all(f"- {f}:" in text for f in fields)  # one line per problem, for `peerd submit`
    # Once every field converts, the cross-field problems join the list.
    data = yaml.safe_load((Path(__file__).parent / "invalid-spec.yaml").read_text())
    data["parallel"]["d_dp"] = 2
    found = problems(data)
    assert {"kind", "global_batch", "optimizer.warmup_steps", "max_peers"} <= set(found)
    assert "optimizer.lr" in found and "learning_rate" in found


def test_cross_field_problems_are_all_reported_together() -> None:
    found = problems(
        spec_with(kind="train", global_batch=20, max_peers=2, optimizer__warmup_steps=100, data__seq_len=512)
    )
    assert "'pretrain', 'finetune' or 'rl'" in found["kind"]
    assert "micro_batch × d_dp" in found["global_batch"]
    assert "min_peers" in found["max_peers"]
    assert "< steps" in found["optimizer.warmup_steps"]
    assert "max_seq_len 128" in found["data.seq_len"]


@pytest.mark.parametrize(
    ("changes", "field", "needle"),
    [
        ({"kind": "train"}, "kind", "'pretrain', 'finetune' or 'rl'"),
        ({"kind": "finetune"}, "init_checkpoint", "needs a checkpoint"),
        ({"init_checkpoint": "ckpt/"}, "init_checkpoint", "only used by finetune"),
        ({"model": {"preset": "tiny", "hf": "x"}}, "model.preset", "exactly one"),
        ({"model": {}}, "model.preset", "exactly one"),
        ({"model": {"preset": "huge"}}, "model.preset", "known: tiny"),
        ({"model": {"hf": "/no/such/config.json"}}, "model.hf", "means nothing on another peer"),
        ({"model": {"preset": "tiny", "overrides": {"n_layer": 2.5}}}, "model.overrides.n_layer", "integer"),
        ({"model": {"preset": "tiny", "overrides": {"vocab_size": 100}}}, "model", "vocab_size >= 256"),
        ({"steps": 0}, "steps", ">= 1"),
        ({"micro_batch": 0}, "micro_batch", ">= 1"),
        ({"checkpoint_interval": 0}, "checkpoint_interval", ">= 1"),
        ({"steps": "many"}, "steps", "integer"),
        ({"global_batch": 18}, "global_batch", "multiple of"),
        ({"min_peers": 5}, "min_peers", "need min_peers >= 6"),
        ({"min_peers": 0, "parallel": {}}, "min_peers", ">= 1"),
        ({"parallel": {"d_pp": 0, "d_dp": 2}}, "parallel.d_pp", ">= 1 or 'auto'"),
        ({"parallel": {"d_pp": 5, "d_dp": 1}, "min_peers": 5}, "parallel.d_pp", "4 layers"),
        ({"optimizer": {"name": "adamw", "momentum": 0.9}}, "optimizer.momentum", "only used by sgd"),
        ({"optimizer": {"name": "sgd", "momentum": 1.5}}, "optimizer.momentum", "[0, 1)"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1]", "[0, 1)"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas", "exactly 2"),
        ({"optimizer": {"schedule": "step"}}, "optimizer.schedule", "'cosine'"),
        ({"optimizer": {"weight_decay": -0.1}}, "optimizer.weight_decay", ">= 0"),
        ({"optimizer": {"grad_clip": 0}}, "optimizer.grad_clip", "> 0 or null"),
        ({"optimizer": {"min_lr_ratio": 2}}, "optimizer.min_lr_ratio", "[0, 1]"),
        ({"compression": {"forward": "none"}}, "compression.forward_bits", "null when forward is 'none'"),
        (
            {"compression": {"forward": "direct", "forward_bits": None}},
            "compression.forward_bits",
            "needs a bit width",
        ),
        ({"compression": {"backward_bits": 1}}, "compression.backward_bits", "2, 3, 4, 8"),
        ({"compression": {"forward": "zip"}}, "compression.forward", "'acsgd'"),
        ({"data": {"source": "text"}}, "data.paths", "at least one path"),
        ({"data": {"seq_len": 64, "colour": 1}}, "data.colour", "unknown key"),
        ({"planning": {"time_budget_s": 7200}}, "planning.time_budget_s", "(0, 3600]"),
        ({"planning": {"objective": "fast"}}, "planning.objective", "'peerd'"),
    ],
)
def test_each_bad_value_names_its_field(changes: dict, field: str, needle: str) -> None:
    data = copy.deepcopy(GOOD)
    data.update(changes)
    found = problems(data)
    assert field in found, found
    assert needle in found[field]


def test_missing_required_fields_and_wrong_top_level() -> None:
    found = problems({"kind": "pretrain"})
    assert {"model", "steps", "global_batch", "micro_batch"} <= set(found)
    assert all("is required" in found[f] for f in ("model", "steps"))
    with pytest.raises(JobSpecError, match="must be a mapping"):
        parse_job_spec(["kind", "pretrain"])


def test_from_mapping_users_get_the_first_problem_as_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(JobSpec, spec_with(kind="train"))
    assert err.value.field == "kind"


def test_a_yaml_syntax_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("kind: [pretrain\n")
    with pytest.raises(ConfigError) as err:
        load_job_spec(bad)
    assert str(bad) in str(err.value)


def test_a_validation_split_is_part_of_the_data_section() -> None:
    spec = parse_job_spec(spec_with(data__validation={"fraction": 0.05, "interval": 25}))
    assert spec.data.validation is not None and spec.data.validation.fraction == 0.05
    assert spec.data.validation.batches == 1
    assert to_mapping(spec)["data"]["validation"] == {
        "windows": None,
        "fraction": 0.05,
        "interval": 25,
        "batches": 1,
    }
    assert parse_job_spec(spec_with()).data.validation is None  # no split unless asked for
    # an evaluation must fit the held-out windows: 2 x global_batch 16 > 20
    found = problems(spec_with(data__validation={"windows": 20, "batches": 2}))
    assert "more than the 20 held out" in found["data.validation.batches"]
    assert "exactly one" in problems(spec_with(data__validation={"interval": 5}))["data.validation.windows"]


def test_submit_reads_a_local_text_corpus_and_pins_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(b"some text to train on. " * 50)
    monkeypatch.chdir(tmp_path)
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(spec_with(data={"source": "text", "paths": ["corpus"], "seq_len": 16})))
    spec = load_job_spec(file)
    assert spec.data.paths == [str(tmp_path / "corpus")] and spec.data.expect_digest is not None
    missing = tmp_path / "missing.yaml"
    missing.write_text(
        yaml.safe_dump(spec_with(data={"source": "text", "paths": ["nowhere"], "seq_len": 16}))
    )
    with pytest.raises(JobSpecError) as err:
        load_job_spec(missing)
    assert [e.field for e in err.value.errors] == ["data.paths[0]"]
    assert "no such file or directory" in str(err.value)


def test_submit_checks_a_validation_split_against_the_corpus_read_here(tmp_path: Path) -> None:
    def spec_file(validation: dict) -> Path:
        data = {"source": "builtin", "seq_len": 32, "max_bytes": 64 * 1024, "validation": validation}
        file = tmp_path / f"job-{len(list(tmp_path.iterdir()))}.yaml"
        file.write_text(yaml.safe_dump(spec_with(data=data)))
        return file

    # 64 KiB of 33-byte windows: 1 % holds out 20 windows, one global batch of 16 fits
    assert load_job_spec(spec_file({"fraction": 0.01, "batches": 1})).data.validation is not None
    with pytest.raises(JobSpecError) as err:
        load_job_spec(spec_file({"fraction": 0.01, "batches": 2}))  # 32 windows > 20
    assert [e.field for e in err.value.errors] == ["data.validation.batches"]
    with pytest.raises(JobSpecError) as err:
        load_job_spec(spec_file({"windows": 5000}))  # more than the corpus has
    assert [e.field for e in err.value.errors] == ["data.validation"]


def test_the_averaging_section_picks_the_reducers_aggregator() -> None:
    assert isinstance(parse_job_spec(spec_with()).averaging.build(), Mean)  # the default: the plain mean
    clipped = parse_job_spec(spec_with(averaging={"aggregator": "clipped", "clip_ratio": 3.0}))
    built = clipped.averaging.build()
    assert isinstance(built, ClippedMean) and built.ratio == 3.0
    assert "clipped only" in problems(spec_with(averaging={"clip_ratio": 3.0}))["averaging.clip_ratio"]
    assert "averaging.clip_ratio" in problems(
        spec_with(averaging={"aggregator": "clipped", "clip_ratio": 0.5})
    )
    assert "averaging.aggregator" in problems(spec_with(averaging={"aggregator": "median"}))
    lone = spec_with(averaging={"aggregator": "clipped"}, parallel={"d_pp": 3, "d_dp": 1}, min_peers=3)
    assert "averages no gradients" in problems(lone)["averaging"]
