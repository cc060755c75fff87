"""What the CLI commands share: one error class with its exit code, job-id prefixes, help examples."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from peerd.cli import cli
from peerd.cli.options import (
    EXIT_FAILED,
    EXIT_STARTUP,
    EXIT_USAGE,
    CliError,
    exit_code_of,
)
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable


def test_one_error_class_carries_each_exit_code() -> None:
    assert CliError("x").exit_code == EXIT_FAILED
    assert CliError("x", EXIT_STARTUP).exit_code == EXIT_STARTUP
    assert CliError.exit_code == EXIT_FAILED  # the instance's code does not leak into the class
    assert exit_code_of(ConfigError("seed", "must be an integer")) == EXIT_USAGE
    assert exit_code_of(PeerUnavailable("none of the initial peers answered")) == EXIT_STARTUP
    assert exit_code_of(PeerdError("timed out", code=ErrorCode.TIMEOUT)) == EXIT_FAILED


@pytest.mark.parametrize("command", ["jobs", "cancel", "fetch", "plan", "bench", "submit", "status", "demo"])
def test_every_command_has_help_examples(command: str) -> None:
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output and f"peerd {command} " in result.output
