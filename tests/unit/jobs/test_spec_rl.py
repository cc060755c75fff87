"""``kind: rl`` specs: the rl section, and how the rest of the spec is read for an RL job (``peerd.rl.spec``)."""

from __future__ import annotations

import copy

import pytest

from peerd.averaging.aggregate import ClippedMean
from peerd.jobs.spec import JobSpecError, parse_job_spec
from peerd.rl.spec import RLSpec

RL_JOB = {
    "kind": "rl",
    "model": {"preset": "tiny"},
    "steps": 40,
    "global_batch": 64,
    "micro_batch": 32,
    "min_peers": 3,
    "optimizer": {"name": "adamw", "lr": 1e-3, "schedule": "constant"},
    "rl": {
        "task": {"name": "addition", "min_size": 1, "max_size": 1},
        "group_size": 8,
        "staleness": 1,
        "sampling": {"max_new_tokens": 6, "temperature": 1.0},
        "warmup": {"steps": 50, "batch_size": 16},
    },
}


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(data)
    return {e.field: e.detail for e in err.value.errors}


def test_a_good_rl_spec_parses_with_its_section() -> None:
    spec = parse_job_spec(RL_JOB)
    assert spec.kind == "rl"
    rl = spec.rl_settings()
    assert rl.group_size == 8 and rl.staleness == 1 and rl.warmup.steps == 50
    assert rl.task.max_size == 1 and rl.sampling.max_new_tokens == 6


def test_the_rl_section_may_be_left_out() -> None:
    data = copy.deepcopy(RL_JOB)
    del data["rl"]
    spec = parse_job_spec(data)
    assert spec.rl is None and spec.rl_settings() == RLSpec()
    assert spec.rl_settings().warmup.steps == 0  # no warm-up unless asked for


def test_what_an_rl_job_cannot_honour_is_refused_by_name() -> None:
    data = copy.deepcopy(RL_JOB)
    data.update(
        precision="bf16",
        parallel={"d_pp": 2, "d_dp": 1},
        min_peers=1,
        micro_batch=12,
        data={"seq_len": 32},
        compression={"forward": "none", "forward_bits": None},
        planning={"objective": "dtfm"},
        init_checkpoint="model.pt",
        model={"preset": "tiny", "overrides": {"max_seq_len": 8}},
    )
    data["rl"]["sampling"]["temperature"] = 0
    found = problems(data)
    assert "fp32" in found["precision"]
    assert "RL cost model" in found["planning.objective"]
    assert "one stage" in found["parallel.d_pp"] and "parallel.d_dp" not in found
    assert "whole groups" in found["micro_batch"]
    assert "rl.task" in found["data"]
    assert "only compression.gradient_bits" in found["compression"]
    assert (
        "init_checkpoint" not in found
    )  # the policy may start from a checkpoint (tests/unit/jobs/test_rl_learner.py)
    assert "must be > 0" in found["rl.sampling.temperature"]
    assert "max_seq_len 8" in found["rl.sampling.max_new_tokens"]


def test_batch_sizes_are_whole_groups() -> None:
    found = problems({**RL_JOB, "global_batch": 60, "micro_batch": 60})
    assert "rl.group_size=8" in found["global_batch"]


@pytest.mark.parametrize("model", [{"preset": "gpt2"}, {"preset": "tiny", "overrides": {"vocab_size": 512}}])
def test_a_policy_whose_vocabulary_is_not_the_tasks_bytes_is_refused(model: dict) -> None:
    # it would sample tokens no task can decode (the cost model's counting ran into them first)
    found = problems({**RL_JOB, "model": model})
    assert "vocab_size must be 256" in found["model"]


def test_hf_models_and_unknown_tasks_are_refused() -> None:
    data = copy.deepcopy(RL_JOB)
    data["model"] = {"hf": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2}}
    data["rl"]["task"]["name"] = "chess"
    found = problems(data)
    assert "built-in GPT" in found["model.hf"]
    assert "unknown task 'chess'" in found["rl.task.name"]


def test_an_rl_section_on_another_kind_is_refused() -> None:
    assert "only used by kind 'rl'" in problems({**RL_JOB, "kind": "pretrain"})["rl"]


def test_an_rl_job_record_carries_its_spec_and_a_deeper_map_is_malformed() -> None:
    from peerd.errors import ErrorCode, ProtocolError
    from peerd.jobs.records import decode_job, encode_job, new_job_record
    from peerd.wire import canonical_pack

    spec = parse_job_spec(RL_JOB)
    owner = "QmYTJ4YCJcMgEYmsfimctoaJWL2a6WAZN5wht9CVeWDWSz"
    rec = new_job_record(
        owner, "default", spec, bytes(16), now=1e9, epoch0_start=1e9 + 5, timing=spec.planning.timing()
    )
    raw = encode_job(rec)
    back = decode_job(raw)
    assert back.job_spec() == spec and back.spec["rl"]["task"]["reward"]["format_weight"] == 0.1
    import msgpack

    wire = msgpack.unpackb(raw, raw=False)
    wire["spec"]["rl"]["task"]["reward"]["format_weight"] = {"deeper": 1}  # a fifth level: no job spec
    with pytest.raises(ProtocolError) as err:
        decode_job(canonical_pack(wire))
    assert err.value.code == ErrorCode.MALFORMED


def test_data_parallel_trainers_need_an_equal_share_of_every_update() -> None:
    data = copy.deepcopy(RL_JOB)
    g = data["rl"]["group_size"]
    data.update(parallel={"d_pp": 1, "d_dp": 2}, min_peers=2, global_batch=8 * g, micro_batch=4 * g)
    assert parse_job_spec(data).parallel.d_dp == 2
    data.update(micro_batch=g)  # one group per update: not two equal shares
    assert "d_dp=2" in problems(data)["micro_batch"]
    data.update(parallel={"d_pp": 1, "d_dp": 3}, micro_batch=4 * g, min_peers=3)
    assert "multiple of 3" in problems(data)["micro_batch"]
    data.update(min_peers=1, micro_batch=2 * g, parallel={"d_pp": 1, "d_dp": 2})
    assert "min_peers" in problems(data)  # two trainers need two peers at least
    data.update(min_peers=1, parallel={"d_pp": 1, "d_dp": 1})
    assert parse_job_spec(data).min_peers == 1  # a lone trainer samples its own rollouts


def test_data_parallel_trainers_may_compress_their_gradients_and_a_lone_trainer_may_not() -> None:
    data = copy.deepcopy(RL_JOB)
    g = data["rl"]["group_size"]
    data.update(parallel={"d_pp": 1, "d_dp": 2}, global_batch=8 * g, micro_batch=4 * g)
    data.update(compression={"gradient_bits": 8})
    assert parse_job_spec(data).compression.gradient_bits == 8
    data.update(compression={"gradient_bits": 5})
    assert "one of 2, 3, 4, 8" in problems(data)["compression.gradient_bits"]
    data.update(parallel={"d_pp": 1, "d_dp": 1}, compression={"gradient_bits": 4})
    assert "lone trainer" in problems(data)["compression.gradient_bits"]
    # auto may choose 2 or 4 trainers for an update of 4 groups: the setting applies when it does
    data.update(parallel={"d_pp": "auto", "d_dp": "auto"})
    assert parse_job_spec(data).rl_trainer_counts() == (1, 2, 4)
    data.update(micro_batch=g, global_batch=8 * g)  # one group per update: auto runs one trainer
    assert parse_job_spec({**data, "compression": {}}).rl_trainer_counts() == (1,)
    assert "can only run one trainer" in problems(data)["compression.gradient_bits"]
    data.update(micro_batch=4 * g)
    data.update(parallel={"d_pp": 1, "d_dp": 2}, compression={"gradient_bits": 4, "backward_bits": 4})
    assert "only compression.gradient_bits" in problems(data)["compression"]


def test_data_parallel_trainers_may_average_robustly_and_a_lone_trainer_may_not() -> None:
    data = copy.deepcopy(RL_JOB)
    g = data["rl"]["group_size"]
    data.update(parallel={"d_pp": 1, "d_dp": 3}, global_batch=6 * g, micro_batch=3 * g, min_peers=3)
    data.update(averaging={"aggregator": "clipped"})
    spec = parse_job_spec(data)
    assert isinstance(spec.averaging.build(), ClippedMean) and spec.averaging.build().ratio == 2.0
    data.update(parallel={"d_pp": 1, "d_dp": "auto"})  # 3 groups an update: 1 or 3 trainers
    assert parse_job_spec(data).rl_trainer_counts() == (1, 3)
    data.update(parallel={"d_pp": 1, "d_dp": 1})
    assert "lone trainer" in problems(data)["averaging"]
