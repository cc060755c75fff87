"""A job spec from a peer's record may hold anything: every bad value is a ConfigError, never a crash.

A peer-published spec with ``data.seq_len: null`` once crashed every daemon's jobs loop; so did
most fields set to null or 0. Each field of a valid spec (defaults filled in), and each
``GPTConfig`` override, is set in turn to each hostile value.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from peerd.errors import ConfigError
from peerd.jobs.records import normalized_spec
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.models.gpt import GPTConfig

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
HOSTILE: list[Any] = [None, 0, -1, "x", True, "", 1.5, 10**30, -1e308, [], {}, [None], {"x": 1}]


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    return out


FULL = normalized_spec(parse_job_spec(GOOD))
PATHS = _paths(FULL) + [("model", "overrides", f.name) for f in dataclasses.fields(GPTConfig)]


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(FULL)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def test_the_paths_cover_every_field() -> None:
    assert len(PATHS) > 50 and ("data", "seq_len") in PATHS and ("model", "overrides", "n_head") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=".".join)
def test_each_hostile_value_is_a_config_error_or_a_valid_spec(path: tuple[str, ...]) -> None:
    for value in HOSTILE:
        try:
            spec = parse_job_spec(_with(path, value), source="a peer's record")
        except ConfigError as exc:
            assert exc.errors and all(e.field and e.detail for e in exc.errors), (path, value, exc)
            continue
        # Accepted: then everything the daemon derives from a spec works too.
        assert isinstance(spec, JobSpec)
        spec.planning.timing()
        spec.parallel.known()
        if spec.model.preset is not None:
            spec.model.gpt_config()
        assert parse_job_spec(normalized_spec(spec)) == spec


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_a_hostile_top_level_is_a_config_error(value: Any) -> None:
    with pytest.raises(ConfigError):
        parse_job_spec(value)
