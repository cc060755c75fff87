"""Shared fixtures: an isolated PEERD_HOME for the whole session, a warm device-profile cache, local swarms, waits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Timers for multi-daemon tests: short enough that expiry and re-announcement happen within
# seconds, long enough that 4 daemons on 2 busy cores keep their records alive.
FAST_SWARM = {
    "record_ttl": 8.0,
    "refresh_interval": 1.5,
    "probe_interval": 3.0,
    "startup_timeout": 30.0,
    "shutdown_timeout": 8.0,
}


@pytest.fixture(scope="session", autouse=True)
def peerd_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point PEERD_HOME at a session temp dir, so no test reads or writes ~/.peerd or talks to a real daemon."""
    home = tmp_path_factory.mktemp("peerd-home")
    previous = os.environ.get("PEERD_HOME")
    os.environ["PEERD_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("PEERD_HOME", None)
    else:
        os.environ["PEERD_HOME"] = previous


@pytest.fixture(scope="session")
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A device-profile cache measured once per session; daemons started with it skip the matmul
    benchmark and the messaging cost's loopback pair."""
    from peerd.pipeline.messaging import measure_messaging
    from peerd.swarm.profiling import profile_device

    path = tmp_path_factory.mktemp("profile") / "device_profiles.json"
    profile_device("cpu", cache_path=path, messaging=measure_messaging)
    return path


@contextlib.contextmanager
def _launching_swarms(root: Path, profile_cache: Path) -> Iterator[Callable[..., Any]]:
    """Yields ``start(n, **options)``; every swarm it started is reaped on exit."""
    from peerd.localswarm import LocalSwarm

    # A short root keeps control-socket paths well under the 108-byte unix-socket limit.
    swarms: list[LocalSwarm] = []

    def start(size: int, *, ready_timeout: float = 90.0, **options: Any) -> LocalSwarm:
        merged = {**FAST_SWARM, "device": "cpu", "profile_cache": str(profile_cache), **options}
        swarm = LocalSwarm(size, root / f"s{len(swarms)}", options=merged, ready_timeout=ready_timeout)
        swarms.append(swarm)
        return swarm.start()

    try:
        yield start
    finally:
        for swarm in swarms:
            swarm.close()


@pytest.fixture
def local_swarm(tmp_path: Path, profile_cache: Path) -> Iterator[Callable[..., Any]]:
    """``local_swarm(n, **options)`` starts n daemons on loopback with fast timers; all are reaped afterwards."""
    with _launching_swarms(tmp_path, profile_cache) as start:
        yield start


@pytest.fixture(scope="module")
def module_local_swarm(
    tmp_path_factory: pytest.TempPathFactory, profile_cache: Path
) -> Iterator[Callable[..., Any]]:
    """``local_swarm`` for one module's tests to share (scenarios that leave each other's peers alone)."""
    with _launching_swarms(tmp_path_factory.mktemp("swarm"), profile_cache) as start:
        yield start


def run_peerd(
    *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the real ``peerd`` CLI in a subprocess (same interpreter); captures text output."""
    return subprocess.run(
        [sys.executable, "-c", "from peerd.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def peerd_cli() -> Callable[..., subprocess.CompletedProcess]:
    """The ``run_peerd`` helper as a fixture (integration tests import nothing from conftest)."""
    return run_peerd


def poll_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    interval: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Call ``predicate`` every ``interval`` s until it returns something truthy, and return that.

    ``timeout`` is a hang guard, not a measurement: after it the test fails naming ``what`` was
    awaited, followed by ``detail()`` (e.g. the last views and the daemons' logs).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(_timed_out(timeout, what, detail), pytrace=False)
        time.sleep(interval)


async def async_poll_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> Any:
    """``poll_until`` inside an event loop: the loop keeps running between the checks."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(_timed_out(timeout, what, detail), pytrace=False)
        await asyncio.sleep(interval)


def _timed_out(timeout: float, what: str, detail: Callable[[], str] | None) -> str:
    message = f"timed out after {timeout:g} s waiting for {what}"
    return f"{message}\n{detail()}" if detail is not None else message


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., Any]:
    """``poll_until`` as a fixture: ``wait_until(predicate, timeout, what, interval=, detail=)``."""
    return poll_until


@pytest.fixture(scope="session")
def async_wait_until() -> Callable[..., Any]:
    """``async_poll_until`` as a fixture, for waits inside a running event loop."""
    return async_poll_until
