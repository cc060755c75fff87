"""Fault injection for chaos tests and drills: cut this peer off from chosen peers for a while.

A cut drops what this peer exchanges with the cut peers, both ways: the DHT's RPCs (in the
DHT process: requests from them are refused, requests to them fail as if unanswered) and
peerd's own streams (``Transport``: open ones are aborted, new ones neither opened nor
accepted). Cutting the two halves of a swarm from each other, on every peer of both
halves, is a network partition; it heals when the cuts end. libp2p's connections
themselves stay up, so the peers find each other again as soon as they try
(``reconnect_missing``).

Only a daemon started with ``PEERD_FAULT_INJECTION=1`` in its environment accepts a cut:
it is a tool for testing a swarm, never something a stranger may ask for.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

FAULT_INJECTION_ENV = "PEERD_FAULT_INJECTION"


def fault_injection_enabled() -> bool:
    return os.environ.get(FAULT_INJECTION_ENV, "") == "1"


@dataclass(frozen=True)
class Cut:
    """Peers (base58 ids) this peer does not talk to until ``until`` (Unix time: the DHT process shares it)."""

    peers: frozenset[str] = frozenset()
    until: float = 0.0

    def blocks(self, peer: str, now: float | None = None) -> bool:
        return peer in self.peers and (time.time() if now is None else now) < self.until

    def active(self, now: float | None = None) -> bool:
        return bool(self.peers) and (time.time() if now is None else now) < self.until


class CutError(ConnectionError):
    """What a cut RPC raises: to hivemind's callers, a peer that does not answer."""


# -- in the DHT process (``DHT.run_coroutine`` targets are module-level: they are pickled) ----------

_dht_cut = Cut()


class _CutServicer:
    """The DHT protocol's handlers, refusing requests from cut peers."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self._inner, name)

        async def guarded(request: Any, context: Any) -> Any:
            if _dht_cut.blocks(context.remote_id.to_base58()):
                raise CutError("cut by fault injection")
            return await handler(request, context)

        return guarded


async def install_dht_cut(peers: tuple[str, ...], until: float, _dht: Any, node: Any) -> bool:
    """Set the DHT process's cut; the first call re-registers the protocol's handlers behind the guard."""
    global _dht_cut
    _dht_cut = Cut(frozenset(peers), until)
    protocol = node.protocol
    if getattr(protocol, "_peerd_cut_guarded", False) or protocol.client_mode:
        return True
    protocol._peerd_cut_guarded = True
    await protocol.remove_p2p_handlers(protocol.p2p)
    servicer = AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer)
    await protocol.add_p2p_handlers(protocol.p2p, _CutServicer(servicer))
    plain = protocol.get_stub

    def get_stub(peer: PeerID) -> Any:
        if _dht_cut.blocks(peer.to_base58()):
            raise CutError("cut by fault injection")  # call_* catch it: the peer did not answer
        return plain(peer)

    protocol.get_stub = get_stub
    return True


async def reconnect_missing(peers: tuple[str, ...], _dht: Any, node: Any) -> int:
    """Ping those of ``peers`` missing from the routing table (a healed partition, a peer back from
    a long outage): each that answers is added again. Returns how many answered."""
    protocol = node.protocol
    missing = [PeerID.from_base58(p) for p in peers]
    missing = [p for p in missing if p != node.peer_id and protocol.routing_table.get(peer_id=p) is None]
    answers = await asyncio.gather(*(protocol.call_ping(p) for p in missing), return_exceptions=True)
    return sum(1 for a in answers if a is not None and not isinstance(a, BaseException))
