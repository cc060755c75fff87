"""`peerd bench grpo` runs end to end at a toy size and reports what issue 13 asks for."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from peerd.bench.grpo import command
from peerd.errors import ConfigError
from peerd.rl.trainer import PHASES

TOY = ["--steps", "3", "--warmup-steps", "4", "--eval-problems", "4", "--prompts", "2", "--group-size", "2"]


def _invoke(args: list[str]):
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(command, args)
    finally:
        torch.set_num_threads(threads)


def test_bench_reports_pass_rates_kl_rollouts_and_phase_times(tmp_path):
    out = tmp_path / "grpo.json"
    result = _invoke([*TOY, "--d-model", "16", "--task", "reversal", "--max-size", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data == json.loads(result.output)
    assert len(data["iterations"]) == 3
    for it in data["iterations"]:
        assert {"pass_rate", "reward_mean", "kl", "response_len", "rollouts", "seconds"} <= set(it)
        assert set(it["seconds"]) == set(PHASES) and it["rollouts"] == 4
    s = data["summary"]
    assert set(s["phase_seconds_mean"]) == set(PHASES)
    assert abs(sum(s["phase_share"].values()) - 1) < 1e-9
    assert s["rollouts_per_s"] > 0 and s["kl_max"] >= 0
    assert s["target_pass_rate"] == min(3 * s["pass_rate_start"], 0.6)
    met = s["pass_rate_end"] >= s["target_pass_rate"] and s["pass_rate_end"] > s["pass_rate_start"]
    assert s["target_met"] == met
    assert data["start"]["pass_rate"] == s["pass_rate_start"]
    assert data["warmup"]["steps"] == 4 and data["config"]["task"]["name"] == "reversal"


def test_bench_refuses_bad_input():
    assert _invoke([*TOY, "--steps", "0"]).exit_code == 2
    bad = _invoke([*TOY, "--min-size", "3", "--max-size", "2"])
    assert isinstance(bad.exception, ConfigError) and bad.exception.field == "task.min_size"
