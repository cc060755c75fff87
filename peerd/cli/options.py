"""What every command shares: exit codes, the one CLI error, config flags, and the local daemon's client.

Exit codes: 0 ok, 1 the operation or job failed, 2 usage or configuration error, 3 startup
failure (no daemon, no bootstrap peer answered). Importing this module is cheap: peerd's
config and control modules are imported only when a command uses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable

if TYPE_CHECKING:
    from peerd.config import DaemonConfig, OptionSpec

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STARTUP = 0, 1, 2, 3

# The flags of commands that only talk to the local daemon.
DAEMON = ("home", "control_socket")


class CliError(click.ClickException):
    """An expected failure: its message is shown without a traceback and the process exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        # click types exit_code as a class variable (one subclass per code); one class carries it per instance
        vars(self)["exit_code"] = exit_code


def command(examples: str, **kwargs: Any) -> Callable[[Callable[..., Any]], click.Command]:
    """``click.command`` whose help ends in "Examples:" and ``examples``, its lines as written."""
    return click.command(epilog="\b\nExamples:\n" + examples.strip("\n"), **kwargs)


def exit_code_of(exc: PeerdError) -> int:
    """A PeerdError that reaches ``main``: 2 bad input, 3 a peer needed to start did not answer, else 1."""
    if exc.code == ErrorCode.CONFIG_INVALID:
        return EXIT_USAGE
    return EXIT_STARTUP if isinstance(exc, PeerUnavailable) else EXIT_FAILED


def no_daemon(
    exc: Exception, hint: str = "or point --home at a running daemon's state directory"
) -> CliError:
    """No daemon answers on the control socket: say how to start one (exit code 3)."""
    return CliError(f"{exc}.\nStart one with `peerd join`, {hint}.", EXIT_STARTUP)


# -- flags generated from DaemonConfig ----------------------------------------------------------


def _click_option(spec: OptionSpec) -> Callable[[Callable], Callable]:
    help_text = spec.doc
    if spec.default not in (None, "", []):
        shown = " ".join(spec.default) if isinstance(spec.default, list) else spec.default
        help_text += f"  [default: {shown}]"
    kwargs: dict[str, Any] = {"help": help_text, "metavar": spec.metavar}
    if spec.kind == "list":
        kwargs["multiple"] = True
    elif spec.kind in ("int", "float"):
        kwargs["type"] = int if spec.kind == "int" else float
    elif spec.kind == "path":
        kwargs["type"] = click.Path(dir_okay=spec.name == "home", file_okay=spec.name != "home")
    return click.option(spec.flag, spec.name, **kwargs)


def config_options(only: tuple[str, ...] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a command with ``--config FILE`` plus one flag per DaemonConfig field (or just ``only``)."""
    from peerd.config import DaemonConfig, option_specs

    specs = [s for s in option_specs(DaemonConfig) if only is None or s.name in only]

    def decorate(fn: Callable) -> Callable:
        for spec in reversed(specs):
            fn = _click_option(spec)(fn)
        return click.option(
            "--config",
            "config_file",
            type=click.Path(exists=True, dir_okay=False),
            help="YAML or JSON file with any of these options (keys = flag names with _); flags override it.",
        )(fn)

    return decorate


# -- the local daemon ---------------------------------------------------------------------------


def client(config_file: str | None, overrides: dict[str, Any], timeout: float = 30.0) -> Any:
    """A ControlClient for the daemon that ``--config``/``--home``/``--control-socket`` name."""
    from peerd.config import load_config

    return client_of(load_config(config_file, overrides).resolved(), timeout)


def client_of(config: DaemonConfig, timeout: float = 30.0) -> Any:
    """A ControlClient for the daemon of a resolved ``config``."""
    from peerd.control import ControlClient

    return ControlClient(config.control_socket, timeout=timeout)  # type: ignore[arg-type]


def call(daemon: Any, method: str, **params: Any) -> Any:
    """One control call with peerd's exit codes: 3 no daemon, 2 bad input, 1 anything else refused."""
    from peerd.control import DaemonNotRunning

    try:
        return daemon.call(method, **params)
    except DaemonNotRunning as exc:
        raise no_daemon(exc) from None
    except PeerdError as exc:
        code = EXIT_USAGE if exc.code == ErrorCode.CONFIG_INVALID else EXIT_FAILED
        raise CliError(str(exc), code) from None
