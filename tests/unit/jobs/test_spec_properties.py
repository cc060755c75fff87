"""The whole job-spec schema, by property: a field set to null, 0, a negative, a huge number or the wrong type
is refused with a ConfigError naming it, or is one of the few values that field legitimately takes.

Issue 15: a peer's job record with ``data.seq_len: null`` crashed every daemon's job loop with
a TypeError. Every leaf of ``JobSpec`` (found by walking its dataclasses, so new fields are
covered without touching this test) is set in turn to each bad value in an otherwise valid
spec; nothing but a ``ConfigError`` may come out, and it must name the field (or, for a
cross-field rule, mention it).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.errors import ConfigError
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.loading import to_mapping

SPEC = """\
name: props
kind: pretrain
model: {preset: tiny, seed: 0}
data: {source: builtin, seq_len: 64, max_bytes: 1048576, validation: {windows: 64, interval: 20, batches: 2}}
steps: 120
global_batch: 16
micro_batch: 4
optimizer: {name: adamw, lr: 0.003, betas: [0.9, 0.95], weight_decay: 0.01, warmup_steps: 10}
parallel: {d_pp: 3, d_dp: 2}
compression: {forward: acsgd, forward_bits: 4, backward_bits: 8, gradient_bits: 8}
checkpoint_interval: 40
min_peers: 6
max_peers: 6
planning: {time_budget_s: 5}
"""
RL_SPEC = """\
name: props-rl
kind: rl
model: {preset: tiny, seed: 0}
steps: 50
global_batch: 32
micro_batch: 16
min_peers: 3
rl:
  task: {name: addition, min_size: 1, max_size: 2, reward: {correct_weight: 1.0, format_weight: 0.1}}
  group_size: 8
  epochs: 2
  staleness: 1
  sampling: {max_new_tokens: 6, temperature: 1.0, top_k: 5}
  loss: {clip_low: 0.2, clip_high: 0.3, kl_coef: 0.05}
  warmup: {steps: 20, batch_size: 16, lr: 0.003, seed: 3}
  rollout_timeout_s: 30
"""
BASE = to_mapping(parse_job_spec(yaml.safe_load(SPEC)))  # every field written out
RL_BASE = to_mapping(parse_job_spec(yaml.safe_load(RL_SPEC)))  # the rl section's leaves are tested on it
BAD: dict[str, Any] = {
    "null": None,
    "zero": 0,
    "negative": -1,
    "huge": 10**30,
    "wrong_type": {"x": [1]},
    "text": "forty-two",
}
# Values a field legitimately takes although they look bad:
ZERO_OK = {  # a 0 that means something
    "model.seed",
    "optimizer.weight_decay",
    "optimizer.warmup_steps",
    "optimizer.min_lr_ratio",
    "planning.max_skew_s",
    "planning.placement_seed",
    "rl.staleness",  # synchronous
    "rl.min_rollout_peers",  # the consensus chooses freely
    "rl.sampling.top_k",  # no top-k
    "rl.loss.kl_coef",  # no KL term
    "rl.task.reward.correct_weight",  # only one of the two weights may be 0
    "rl.task.reward.format_weight",
    "rl.warmup.steps",  # no warm-up
    "rl.warmup.seed",
}
HUGE_OK = {"optimizer.grad_clip", "max_peers"}  # a bound so high it is no bound: "unlimited"
TEXT_FIELDS_OK = {"name"}  # str-typed fields are found from the schema too; "name" is a plain str


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = _hints(cls)[f.name]
        sub = [m for m in _members(tp) if dataclasses.is_dataclass(m)]
        path = f"{prefix}{f.name}"
        if sub:
            yield from leaves(sub[0], f"{path}.")
        else:
            yield path, tp


LEAVES = dict(leaves(JobSpec))


def acceptable(path: str, kind: str) -> bool:
    """Whether ``BAD[kind]`` is a value field ``path`` legitimately takes."""
    members = _members(LEAVES[path])
    if kind == "null":
        return type(None) in members
    if kind == "zero":
        return path in ZERO_OK
    if kind == "huge":
        return path in HUGE_OK
    if kind == "text":
        return path in TEXT_FIELDS_OK or str in members
    return False


def with_value(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(RL_BASE if path.startswith("rl.") else BASE)
    if path == "model.hf":  # exactly one of preset and hf: test hf on its own
        spec["model"]["preset"] = None
    node = spec
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    return spec


def verdict(path: str, value: Any) -> str:
    """``accepted``, ``named`` (refused naming the field) or a description of what went wrong."""
    try:
        parse_job_spec(with_value(path, value))
    except ConfigError as exc:
        leaf = path.rsplit(".", 1)[-1]
        for e in exc.errors:
            if e.field == path or e.field.startswith((f"{path}.", f"{path}[")):
                return "named"
            if leaf in e.detail:  # a rule across fields (e.g. d_dp x micro_batch vs global_batch)
                return "named"
        return f"refused, but naming {[e.field for e in exc.errors]}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_the_walk_finds_the_whole_schema():
    assert {"data.seq_len", "optimizer.lr", "parallel.d_dp", "planning.time_budget_s", "model.seed"} <= set(
        LEAVES
    )
    assert len(LEAVES) >= 40


@pytest.mark.parametrize("kind", sorted(BAD))
def test_every_field_refuses_each_bad_value_naming_itself(kind: str):
    wrong = {}
    for path in LEAVES:
        got = verdict(path, BAD[kind])
        want = "accepted" if acceptable(path, kind) else "named"
        if got != want and not (want == "accepted" and got == "named"):  # stricter than needed is fine
            wrong[path] = got
    assert not wrong, wrong


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(LEAVES)), value=junk)
def test_any_junk_in_any_field_is_a_config_error_or_accepted(path: str, value: Any):
    got = verdict(path, value)
    assert got in ("accepted", "named"), (path, value, got)
