"""One peer's presence on the network: the hivemind DHT (with the p2pd it owns) plus a P2P handle for peerd's protocols.

The DHT runs in a forked process that starts p2pd; peerd's own stream handlers
share that p2pd through ``dht.replicate_p2p()`` (one daemon per peer). The DHT
process is moved into its own process group, so a terminal's Ctrl-C reaches only
the peerd process (which then shuts everything down in order instead of p2pd
dying first), and it kills its group (itself and p2pd) if the peerd process
dies without a shutdown, e.g. on SIGKILL: no orphaned p2pd either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable
from peerd.log import get_logger
from peerd.swarm.faults import install_dht_cut, reconnect_missing
from peerd.swarm.rejections import dht_rejections
from peerd.tasks import within

T = TypeVar("T")

logger = get_logger(__name__)

PARENT_POLL_S = 0.5  # how quickly an orphaned DHT process notices that peerd is gone


@dataclass
class NodeSettings:
    """How to start the node; filled by the daemon from its config (or by a short-lived client)."""

    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: Path | None = None  # libp2p RSA key file; None: a random, throw-away peer id
    startup_timeout: float = 30.0
    client_mode: bool = False  # a client stores and reads but serves no DHT requests (status queries)


class _GroupedDHT(DHT):
    """A hivemind DHT whose process leads its own process group and dies with the process that created it."""

    def run(self) -> None:
        _lead_group_and_watch_parent(self._parent_pid)
        super().run()


def _lead_group_and_watch_parent(parent_pid: int) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # p2pd, started later by this process, inherits the group

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        # peerd died without shutting us down: take p2pd and ourselves away
        group = os.getpgid(0)
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGTERM)
        time.sleep(2.0)
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)

    threading.Thread(target=watch, name="peerd-parent-watch", daemon=True).start()


class SwarmNode:
    """A started DHT plus a P2P replica on its p2pd; create with ``await SwarmNode.start(...)``."""

    def __init__(self, dht: DHT, p2p: P2P, maddrs: list[str]) -> None:
        self.dht = dht
        self.p2p = p2p
        self.maddrs = maddrs
        self.peer_id: str = p2p.peer_id.to_base58()
        self._closed = False

    @classmethod
    async def start(cls, settings: NodeSettings, record_validators: list[Any]) -> SwarmNode:
        """Start p2pd and the DHT, bootstrap from ``settings.initial_peers``; typed errors on failure.

        Raises ``PeerUnavailable`` when no initial peer answers or p2pd does not come up in time,
        ``ConfigError`` for addresses p2pd rejects or an identity another peer already uses.
        """
        kwargs: dict[str, Any] = dict(
            initial_peers=list(settings.initial_peers) or None,
            host_maddrs=list(settings.host_maddrs),
            startup_timeout=settings.startup_timeout,
            client_mode=settings.client_mode,
        )
        if settings.announce_maddrs:
            kwargs["announce_maddrs"] = list(settings.announce_maddrs)
        if settings.identity_path is not None:
            kwargs["identity_path"] = str(settings.identity_path)
        try:
            dht = _GroupedDHT(start=False, record_validators=record_validators, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError("initial_peers", str(exc)) from None
        loop = asyncio.get_running_loop()
        dht.start()
        # p2pd start, the identity-collision check (a second p2pd) and the bootstrap pings each
        # have their own deadline inside hivemind; this is the outer bound on all of them.
        deadline = 2 * settings.startup_timeout + 10
        try:
            await loop.run_in_executor(None, dht.wait_until_ready, deadline)
        except BaseException as exc:
            await loop.run_in_executor(None, _stop_dht, dht, 3.0)
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
                raise
            raise _startup_error(exc, settings, deadline) from None
        try:
            p2p = await dht.replicate_p2p()
            maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
        except BaseException:
            await loop.run_in_executor(None, _stop_dht, dht, 3.0)
            raise
        node = cls(dht, p2p, maddrs)
        log = logger.debug if settings.client_mode else logger.info
        log("swarm node %s up; reachable at %s", node.peer_id, ", ".join(maddrs))
        return node

    @property
    def alive(self) -> bool:
        """False once the DHT process has exited (p2pd goes with it)."""
        return not self._closed and self.dht.is_alive()

    @staticmethod
    def now() -> float:
        """DHT time (seconds); peers assume their clocks agree within a few seconds."""
        return get_dht_time()

    async def dht_rejections(self, timeout: float = 5.0) -> dict[str, int]:
        """DHT records this node's validators rejected, by error code (counted in the DHT process)."""
        return await self._in_dht_process(dht_rejections, timeout)

    async def cut(self, peers: tuple[str, ...], until: float, timeout: float = 10.0) -> None:
        """Fault injection: the DHT refuses and drops RPCs with ``peers`` until ``until`` (Unix time)."""
        await self._in_dht_process(functools.partial(install_dht_cut, peers, until), timeout)

    async def reconnect(self, peers: tuple[str, ...], timeout: float = 30.0) -> int:
        """Ping those of ``peers`` missing from the DHT's routing table; how many answered."""
        return await self._in_dht_process(functools.partial(reconnect_missing, peers), timeout)

    async def _in_dht_process(self, fn: Callable[[Any, Any], Awaitable[T]], timeout: float) -> T:
        """``fn(dht, node)`` run in the DHT process (``fn`` is pickled: module-level, or a partial of one)."""
        if not self.alive:
            raise PeerUnavailable("the DHT process has exited", code=ErrorCode.PEER_UNAVAILABLE)
        future = self.dht.run_coroutine(fn, return_future=True)
        try:
            return await within(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            future.cancel()
            raise PeerUnavailable(
                f"the DHT process did not answer within {timeout:g} s", code=ErrorCode.TIMEOUT
            ) from None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Close the P2P replica, then the DHT (which stops p2pd); kills what is left after ``timeout``."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await within(self.p2p.shutdown(), min(2.0, timeout))
        await asyncio.get_running_loop().run_in_executor(None, _stop_dht, self.dht, timeout)
        logger.debug("swarm node %s stopped", self.peer_id)

    def kill(self) -> None:
        """Blocking and immediate: SIGKILL the DHT process and p2pd (when a graceful shutdown ran out of time)."""
        self._closed = True
        pid = self.dht.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.dht.join(2.0)
        logger.warning("swarm node %s killed", self.peer_id)


def _stop_dht(dht: DHT, timeout: float) -> None:
    """Graceful DHT shutdown (it stops p2pd), then SIGKILL to its process group for whatever remains."""
    dht.shutdown_timeout = max(0.5, timeout)
    with contextlib.suppress(Exception):
        dht.shutdown()
    pid = dht.pid
    if pid is None:
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.05)
    else:
        logger.warning("DHT process group %d outlived its shutdown; killing it", pid)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        dht.join(1.0)


def _startup_error(exc: BaseException, settings: NodeSettings, deadline: float) -> Exception:
    text = str(exc)
    lowered = text.lower()
    if isinstance(exc, TimeoutError) or "failed to start in" in lowered:
        return PeerUnavailable(
            f"the p2p daemon did not come up within {deadline:.0f} s; raise --startup-timeout on a slow machine",
            code=ErrorCode.TIMEOUT,
        )
    if "bootstrap" in lowered or "initial_peers" in lowered:
        return PeerUnavailable(
            f"none of the initial peers answered ({_some(settings.initial_peers)}); "
            "check the address and that the peer is running",
        )
    if "already taken" in lowered:
        return ConfigError(
            "identity",
            f"another running peer uses the identity {settings.identity_path}; "
            "give each daemon its own --home (or --identity)",
        )
    if "multiaddr" in lowered or "failed to parse" in lowered:
        return ConfigError("initial_peers", f"p2pd rejected an address: {text}")
    if "listen" in lowered or "address already in use" in lowered:
        return ConfigError("host_maddrs", f"cannot listen on {settings.host_maddrs}: {text}")
    return PeerUnavailable(f"the swarm node failed to start: {type(exc).__name__}: {text}")


def _some(items: list[str], shown: int = 3) -> str:
    """The first ``shown`` items and how many more: a message stays readable with dozens of remembered peers."""
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")


def parse_peer_id(peer_id: str) -> PeerID:
    """A base58 peer id string as hivemind's ``PeerID`` (layers above swarm never import hivemind)."""
    return PeerID.from_base58(peer_id)


async def dht_get_many_latest(dht: Any, keys: Sequence[str], *, timeout: float, what: str) -> dict[str, Any]:
    """The latest value (or None) of each of ``keys``, found by one traversal of the DHT.

    ``dht.get(key, latest=True)`` crawls the key's whole neighbourhood, one request to each
    node near it; one traversal for several keys asks each node for all of them at once, so a
    daemon's reads of one round cost the requests of one read. ``PeerdError(TIMEOUT)`` naming
    ``what`` if the DHT is silent.
    """
    keys = tuple(dict.fromkeys(keys))
    if not keys:
        return {}
    future = dht.run_coroutine(functools.partial(_get_many_latest, keys=keys), return_future=True)
    found = await _answer(future, timeout=timeout, what=what)
    return {key: found.get(key) for key in keys}


async def _get_many_latest(_dht: Any, node: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """Runs in the DHT process (``DHT.run_coroutine`` pickles it there)."""
    return dict(await node.get_many(keys, sufficient_expiration_time=float("inf")))


async def dht_get_latest(dht: Any, key: str, *, timeout: float, what: str) -> Any:
    """``dht.get(key, latest=True)`` awaited from asyncio; ``PeerdError(TIMEOUT)`` naming ``what`` if the DHT is silent."""
    return await _answer(dht.get(key, latest=True, return_future=True), timeout=timeout, what=what)


async def _answer(future: Any, *, timeout: float, what: str) -> Any:
    """A DHT call's future awaited from asyncio; cancelled and ``PeerdError(TIMEOUT)`` naming ``what`` if silent."""
    try:
        return await within(future, timeout)
    except TimeoutError:
        future.cancel()
        raise PeerdError(f"reading {what} timed out after {timeout:.0f} s", code=ErrorCode.TIMEOUT) from None
