"""Hostile or broken config files are ConfigErrors, found by ``peerd bench fuzz`` (issue 15): never another exception, never slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerd.errors import ConfigError
from peerd.jobs.spec import load_job_spec
from peerd.loading import MAX_FILE_BYTES, MAX_PROBLEMS, MIN_VALUES_ALLOWED, expanded_size, load_mapping
from peerd.sched.scenario import load_scenario


def _file(tmp_path: Path, data: bytes, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "data, says",
    [
        (b"name: \xff\xfe\x00", "not UTF-8"),  # was UnicodeDecodeError
        (b"when: 2001-13-45\n", "not valid YAML"),  # a timestamp the constructor cannot build
        (b"a: " + b"[" * 3000 + b"]" * 3000, "not valid YAML"),  # nesting beyond the parser's depth
    ],
)
def test_undecodable_files_are_config_errors(tmp_path: Path, data: bytes, says: str):
    with pytest.raises(ConfigError) as info:
        load_mapping(_file(tmp_path, data))
    assert says in str(info.value)


def test_a_spec_naming_an_impossible_hf_path_is_a_spec_error(tmp_path: Path):
    text = b"name: x\nmodel: {hf: " + b"x" * 5000 + b"}\n"  # was OSError (file name too long) from is_dir
    with pytest.raises(ConfigError) as info:
        load_job_spec(_file(tmp_path, text))
    assert "model.hf" in str(info.value)


def test_thousands_of_bad_values_are_reported_as_a_bounded_list(tmp_path: Path):
    row = "[" + ", ".join(["0"] * 64) + "]"
    text = (
        "name: big\nregions:\n  names: [" + ", ".join(f"r{i}" for i in range(64)) + "]\n"
        f"  delay_ms: [{', '.join([row] * 64)}]\n  bandwidth_mbps: [{', '.join([row] * 64)}]\n"
        "devices:\n- {id: p0, region: r0, tflops: 0.1, memory_gb: 8.0}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_scenario(_file(tmp_path, text.encode()))
    errors = info.value.errors
    assert len(errors) <= 3 * MAX_PROBLEMS, len(errors)  # 4096 bad bandwidths, listed up to the cap
    assert all(e.field.startswith("regions.") for e in errors)


def test_thousands_of_wrong_types_end_in_a_count_of_the_rest(tmp_path: Path):
    text = "name: big\ndevices: [" + ", ".join(["0"] * 4096) + "]\n"
    with pytest.raises(ConfigError) as info:
        load_scenario(_file(tmp_path, text.encode()))
    details = [e.detail for e in info.value.errors]
    assert len(details) <= 2 * MAX_PROBLEMS + 2 and any("more problems" in d for d in details)


def _laughs(levels: int) -> bytes:
    """Nested YAML anchors: ``levels`` levels of 10 aliases of the level below (10**levels values)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return ("\n".join(lines) + f"\nname: *a{levels - 1}\n").encode()


@pytest.mark.parametrize("levels", [6, 9])
def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path: Path, levels: int):
    """344 bytes for 10**6 values took 6 s of CPU to validate (issue 15); 9 levels would not end."""
    data = _laughs(levels)
    assert len(data) < 600
    for load in (load_mapping, load_job_spec, load_scenario):
        with pytest.raises(ConfigError) as info:
            load(_file(tmp_path, data))
        assert "aliases expand it to over" in str(info.value)


@pytest.mark.parametrize("text", [b"a: &a [*a]\n", b"a: &a {b: *a}\n", b"a: [1, &b [2, *b]]\n"])
def test_a_file_that_contains_itself_is_refused(tmp_path: Path, text: bytes):
    with pytest.raises(ConfigError) as info:
        load_mapping(_file(tmp_path, text))
    assert "contains itself" in str(info.value)


def test_aliases_that_expand_moderately_are_kept(tmp_path: Path):
    text = b"base: &b {lr: 0.1, betas: [0.9, 0.95]}\nx: *b\ny: [*b, *b]\n"
    assert load_mapping(_file(tmp_path, text))["y"][1] == {"lr": 0.1, "betas": [0.9, 0.95]}
    assert (
        _laughs(4).count(b"*") > 10 and load_mapping(_file(tmp_path, _laughs(4)))["name"][9][9][9][9] == "x"
    )


def test_expanded_size_counts_every_occurrence_and_stops_at_the_limit():
    shared = [1, 2, 3]
    assert expanded_size({"a": shared, "b": [shared, shared]}, 100) == 1 + 4 + 1 + 2 * 4
    level: list = [0] * 10
    for _ in range(20):  # 10**21 values, counted in 21 steps
        level = [level] * 10
    assert expanded_size(level, MIN_VALUES_ALLOWED) == MIN_VALUES_ALLOWED + 1
    deep: list = []
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    assert expanded_size(deep, 10**6) == 5001


def test_a_file_larger_than_a_config_file_may_be_is_refused_unread(tmp_path: Path):
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ConfigError) as info:
        load_mapping(path)
    assert "larger than a config file may be" in str(info.value)
