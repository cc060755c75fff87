"""Typed config loading: values are converted, and every mistake names its field."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import pytest

from peerd.errors import ConfigError, ErrorCode
from peerd.loading import ConfigProblems, Range, from_mapping, load_dataclass, load_mapping, to_mapping


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


@dataclass
class Link:
    src: str
    dst: str
    bandwidth_mbps: float

    def validate(self) -> None:
        if self.bandwidth_mbps <= 0:
            raise ConfigError("bandwidth_mbps", f"must be > 0, got {self.bandwidth_mbps}")


@dataclass
class Root:
    name: str
    size: int
    mode: Mode = Mode.FAST
    shape: int | Literal["auto"] = "auto"
    links: list[Link] = field(default_factory=list)
    tags: dict[str, float] = field(default_factory=dict)
    note: str | None = None
    pair: tuple[int, int] = (0, 0)
    ratio: Annotated[float | None, Range(gt=0, le=1)] = None
    path: Path | None = None

    def problems(self) -> list[ConfigError]:
        return [ConfigError("name", "must not be 'bad'")] if self.name == "bad" else []


def test_builds_nested_dataclasses_and_converts_values() -> None:
    root = from_mapping(
        Root,
        {
            "name": "x",
            "size": 3,
            "mode": "exact",
            "shape": 4,
            "links": [{"src": "a", "dst": "b", "bandwidth_mbps": 20}],
            "tags": {"t": 1},
            "pair": [1, 2],
            "path": "a/b",
        },
    )
    assert root.pair == (1, 2) and root.path == Path("a/b")
    assert root.mode is Mode.EXACT
    assert root.shape == 4
    assert root.links == [Link("a", "b", 20.0)]
    assert isinstance(root.links[0].bandwidth_mbps, float)
    assert root.tags == {"t": 1.0}
    assert to_mapping(root)["mode"] == "exact"
    assert from_mapping(Root, to_mapping(root)) == root


@pytest.mark.parametrize(
    ("data", "field_path", "fragment"),
    [
        ({"name": "x"}, "size", "is required"),
        ({"name": "x", "size": 1, "colour": 3}, "colour", "unknown key"),
        ({"name": "x", "size": "3"}, "size", "must be an integer"),
        ({"name": "x", "size": True}, "size", "must be an integer"),
        ({"name": "x", "size": 1, "mode": "slow"}, "mode", "must be one of"),
        ({"name": "x", "size": 1, "shape": "big"}, "shape", "must be an integer or one of 'auto', got 'big'"),
        (
            {"name": "x", "size": 1, "links": [{"src": "a", "dst": "b"}]},
            "links[0].bandwidth_mbps",
            "is required",
        ),
        (
            {"name": "x", "size": 1, "links": [{"src": "a", "dst": "b", "bandwidth_mbps": 0}]},
            "links[0].bandwidth_mbps",
            "must be > 0",
        ),
        ({"name": "x", "size": 1, "links": {"src": "a"}}, "links", "must be a list"),
        ({"name": None, "size": 1}, "name", "must not be null"),
        ({"name": "x", "size": 1.0}, "size", "must be an integer"),
        ({"name": "x", "size": 1, "tags": {"t": True}}, "tags.t", "must be a number"),
        ({"name": "x", "size": 1, "tags": {"t": "1"}}, "tags.t", "must be a number"),
        ({"name": "x", "size": 1, "tags": {"t": float("inf")}}, "tags.t", "finite"),
        ({"name": "x", "size": 1, "pair": [1]}, "pair", "exactly 2 items, got 1"),
        ({"name": "x", "size": 1, "pair": [1, 2, 3]}, "pair", "exactly 2 items, got 3"),
        ({"name": "x", "size": 1, "ratio": 1.5}, "ratio", "must be in (0, 1] or null, got 1.5"),
        ({"name": "x", "size": 1, "ratio": float("nan")}, "ratio", "finite"),
        ({"name": "x", "size": 1, "note": 5}, "note", "must be a string, got 5"),
    ],
)
def test_errors_name_the_field(data: dict, field_path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(Root, data)
    assert info.value.field == field_path
    assert fragment in str(info.value)
    assert info.value.code is ErrorCode.CONFIG_INVALID


def test_every_problem_is_reported_at_once() -> None:
    data = {"size": "3", "colour": 1, "ratio": 0, "links": [{"src": "a", "dst": "b", "bandwidth_mbps": True}]}
    with pytest.raises(ConfigProblems) as info:
        from_mapping(Root, data)
    assert {e.field: e.detail for e in info.value.errors} == {
        "name": "is required",
        "size": "must be an integer, got '3'",
        "colour": "unknown key (allowed: name, size, mode, shape, links, tags, note, pair, ratio, path)",
        "links[0].bandwidth_mbps": "must be a number, got True",
    }
    assert "4 problems in Root [CONFIG_INVALID]" in str(info.value)
    assert info.value.code is ErrorCode.CONFIG_INVALID and isinstance(info.value, ConfigError)


def test_unknown_keys_do_not_stop_the_checks_of_the_values() -> None:
    data = {
        "name": "bad",
        "size": 1,
        "colour": 1,
        "ratio": 0,
        "links": [{"src": "a", "dst": "b", "bandwidth_mbps": 0}],
    }
    with pytest.raises(ConfigProblems) as info:
        from_mapping(Root, data)
    # Round 2 still runs after an unknown key; problems() runs even where a bound failed.
    assert [e.field for e in info.value.errors] == ["colour", "links[0].bandwidth_mbps", "ratio", "name"]


def test_config_error_keeps_field_and_detail_apart() -> None:
    err = ConfigError("a.b", "must be > 0, got 0")
    assert (err.field, err.detail, err.errors) == ("a.b", "must be > 0, got 0", [err])
    assert str(err) == "a.b: must be > 0, got 0 [CONFIG_INVALID]"
    assert str(ConfigError("", "no field")) == "no field [CONFIG_INVALID]"


def test_load_yaml_and_json_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: x\nsize: 2\n")
    (tmp_path / "a.json").write_text('{"name": "y", "size": 5}')
    assert load_dataclass(Root, tmp_path / "a.yaml").size == 2
    assert load_dataclass(Root, tmp_path / "a.json").name == "y"


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("bad.yaml", "a: [1, 2", "not valid YAML"),
        ("list.yaml", "- 1\n- 2\n", "must be a mapping"),
        ("bad.json", "{", "not valid JSON"),
    ],
)
def test_bad_files_are_config_errors(tmp_path: Path, name: str, text: str, fragment: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_mapping(tmp_path / name)


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_mapping(tmp_path / "nope.yaml")


def test_yaml_exponent_floats_without_sign_are_numbers(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("a: 1.3e9\nb: 2E-3\nc: 7\nd: 1.5\ne: 1e+3\nf: '1e9'\n")
    data = load_mapping(tmp_path / "a.yaml")
    assert data == {"a": 1.3e9, "b": 2e-3, "c": 7, "d": 1.5, "e": 1e3, "f": "1e9"}
    assert isinstance(data["c"], int)
