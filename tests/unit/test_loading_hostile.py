"""Hostile or broken config files are ConfigErrors, found by ``peerd bench fuzz`` (issue 15): never another exception, never slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerd.errors import ConfigError
from peerd.jobs.spec import load_job_spec
from peerd.loading import MAX_PROBLEMS, load_mapping
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
