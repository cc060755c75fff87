"""What the CLI commands share: one error class with its exit code, job-id prefixes, help examples."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from peerd.cli import cli
from peerd.cli.options import (
    EXIT_FAILED,
    EXIT_STARTUP,
    EXIT_USAGE,
    JOB_ID_MIN_PREFIX,
    CliError,
    exit_code_of,
    resolve_job,
)
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable

JOBS = ["3f9a1c2e" + "0" * 24, "3f9a7d00" + "1" * 24, "77aa5500" + "2" * 24]


class FakeDaemon:
    """Answers ``jobs`` like a daemon that knows JOBS."""

    def call(self, method: str, **params: Any) -> Any:
        assert method == "jobs"
        return [{"job_id": job_id} for job_id in JOBS]


def test_one_error_class_carries_each_exit_code() -> None:
    assert CliError("x").exit_code == EXIT_FAILED
    assert CliError("x", EXIT_STARTUP).exit_code == EXIT_STARTUP
    assert CliError.exit_code == EXIT_FAILED  # the instance's code does not leak into the class
    assert exit_code_of(ConfigError("seed", "must be an integer")) == EXIT_USAGE
    assert exit_code_of(PeerUnavailable("none of the initial peers answered")) == EXIT_STARTUP
    assert exit_code_of(PeerdError("timed out", code=ErrorCode.TIMEOUT)) == EXIT_FAILED


def test_a_unique_prefix_resolves_and_an_unknown_one_goes_to_the_daemon() -> None:
    assert resolve_job(FakeDaemon(), "77aa") == JOBS[2]
    assert resolve_job(FakeDaemon(), "3f9a1") == JOBS[0]
    assert resolve_job(FakeDaemon(), JOBS[1]) == JOBS[1]
    assert resolve_job(FakeDaemon(), "beef") == "beef"  # the daemon reads the DHT again, then says


def test_an_ambiguous_prefix_names_the_candidates() -> None:
    with pytest.raises(CliError) as info:
        resolve_job(FakeDaemon(), "3f9a")
    assert info.value.exit_code == EXIT_USAGE
    assert "ambiguous" in str(info.value) and JOBS[0] in str(info.value) and JOBS[1] in str(info.value)


def test_a_too_short_prefix_is_a_usage_error_before_any_daemon_is_asked(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["cancel", "3f9", "--home", str(tmp_path / "nobody")])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "too short" in result.output and f"at least {JOB_ID_MIN_PREFIX} characters" in result.output


@pytest.mark.parametrize("command", ["jobs", "cancel", "fetch", "plan", "bench", "submit", "status", "demo"])
def test_every_command_has_help_examples(command: str) -> None:
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output and f"peerd {command} " in result.output
