"""``peerd bench fuzz`` itself: its mutations are what they say, and a short run over every decoder finds no untyped failure."""

from __future__ import annotations

import random

import pytest
from click.testing import CliRunner

from peerd.bench.fuzz import MUTATIONS, command, fuzz_target, mutate, run
from peerd.bench.fuzz_targets import Target, all_targets
from peerd.errors import ConfigError, ErrorCode, ProtocolError


def test_every_decoder_takes_its_own_seeds():
    for target in all_targets():
        for seed in target.seeds:
            target.decode(seed)  # a valid encoding decodes (the fuzz starts from real bytes)


def test_mutations_cover_every_kind_and_change_the_seed():
    target = next(t for t in all_targets() if t.name == "job.record")
    rng = random.Random(1)
    seen = {}
    for _ in range(600):
        kind, data = mutate(rng, target)
        seen.setdefault(kind, 0)
        seen[kind] += data not in target.seeds
    assert set(seen) <= set(MUTATIONS) and set(MUTATIONS) - {"bitflip"} <= set(seen)
    assert all(n > 0 for n in seen.values())


def test_a_short_run_over_every_decoder_has_no_untyped_failure():
    result = run(inputs=60, seed=11)
    assert set(result["decoders"]) == {t.name for t in all_targets()}
    for name, report in result["decoders"].items():
        assert report["other"] == 0 and report["hangs"] == 0, (name, report["failures"])
        assert report["decoded"] + report["rejected"] == 60


def test_untyped_failures_and_hangs_are_caught_and_reported():
    calls = {"n": 0}

    def fragile(data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise KeyError("a bug")
        if calls["n"] % 3 == 1:
            raise ProtocolError("typed", code=ErrorCode.MALFORMED)
        return len(data)

    target = Target("fragile", fragile, [b"\x81\xa1a\x01"], lambda raw: {"a": 1}, lambda tree, seed: seed)
    report = fuzz_target(target, 30, random.Random(0), hang_s=5.0)
    assert report["other"] == 10 and report["rejected"] == 10 and not report["ok"]
    assert report["failures"][0]["error"] == "KeyError" and "a bug" in report["failures"][0]["traceback"]

    def spin(data: bytes) -> None:
        while True:
            pass

    report = fuzz_target(
        Target("spin", spin, [b"x"], lambda r: r, lambda t, s: s), 1, random.Random(0), hang_s=0.2
    )
    assert report["hangs"] == 1 and not report["ok"]


def test_the_cli_prints_json_and_exits_0_when_clean():
    out = CliRunner().invoke(command, ["--inputs", "20", "--only", "job.votes", "--seed", "3"])
    assert out.exit_code == 0, out.output
    assert '"untyped_failures": 0' in out.output


def test_yaml_targets_get_alias_bombs_and_refuse_them_as_typed_errors():
    target = next(t for t in all_targets() if t.name == "job.spec")
    rng = random.Random(5)
    bombs = [data for kind, data in (mutate(rng, target) for _ in range(3000)) if b"*id" in data]
    assert bombs and all(len(b) < 64 * 1024 for b in bombs)
    for data in bombs:
        with pytest.raises(ConfigError) as info:
            target.decode(data)
        assert "aliases expand" in str(info.value)
