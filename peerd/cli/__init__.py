"""The ``peerd`` command line: a thin click group over peerd's Python API.

Each command lives in its own module under ``peerd/cli/`` and is imported only
when invoked, so ``peerd --help`` stays fast and a broken optional feature
cannot break the others. What they share is in ``options`` (exit codes, the
CLI error, config flags, the daemon client) and ``render`` (tables, progress).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from peerd import __version__
from peerd.cli.options import EXIT_OK, exit_code_of
from peerd.errors import PeerdError

# command name -> "module:attribute"; the modules are imported on first use.
COMMANDS: dict[str, str] = {
    "join": "peerd.cli.swarm:join",
    "status": "peerd.cli.swarm:status",
    "leave": "peerd.cli.swarm:leave",
    "pause": "peerd.cli.swarm:pause",
    "resume": "peerd.cli.swarm:resume",
    "plan": "peerd.cli.plan:plan",
    "bench": "peerd.cli.bench:bench",
    "demo": "peerd.cli.demo:demo",
    "submit": "peerd.cli.jobs:submit",
    "cancel": "peerd.cli.jobs:cancel",
    "jobs": "peerd.cli.jobs:jobs",
    "fetch": "peerd.cli.jobs:fetch",
    "generate": "peerd.cli.generate:generate",
}


# Every command's help shows its options' defaults (those that are not None or empty).
SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "show_default": True}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported when used."""

    def __init__(self, *args, lazy: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self._lazy:
            module_name, attr = self._lazy[name].split(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings=SETTINGS)
@click.version_option(__version__, prog_name="peerd")
@click.option(
    "--log-level",
    default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Verbosity of peerd's log output (stderr).",
)
def cli(log_level: str) -> None:
    """Train foundation models together on volunteer GPUs.

    \b
    Start a swarm:        peerd join
    Join one:             peerd join --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm...
    See who is there:     peerd status
    Need your GPU back:   peerd pause   (then peerd resume), or leave: peerd leave
    Plan an allocation:   peerd plan configs/scenarios/dtfm-case0.yaml
    """
    from peerd.log import setup_logging

    setup_logging(log_level.upper())


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: maps peerd's expected failures to messages and exit codes."""
    try:
        cli.main(args=argv, prog_name="peerd", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("Aborted.", err=True)
        sys.exit(130)  # the shell's convention for SIGINT
    except click.ClickException as exc:  # a UsageError's exit_code is 2, a CliError's its own
        exc.show()
        sys.exit(exc.exit_code)
    except PeerdError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exit_code_of(exc))
    sys.exit(EXIT_OK)
