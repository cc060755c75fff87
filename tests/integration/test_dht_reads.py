"""Batched DHT reads on real hivemind DHTs (with p2pd) on loopback.

A daemon's job loop and planner read several keys each round; ``DhtStore.read_many`` finds
them all in one traversal of the DHT. It must answer exactly what one ``read`` per key
answers: every author's live entry, nothing for a key nobody wrote.
"""

from __future__ import annotations

import asyncio

import pytest

from peerd.jobs.store import DhtStore
from peerd.swarm.identity import Identity, make_record_validators
from peerd.swarm.node import NodeSettings, SwarmNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SWARM = "it-reads"


def test_one_traversal_reads_what_a_read_per_key_reads() -> None:
    async def scenario() -> None:
        ids = [Identity.generate() for _ in range(3)]
        first = await SwarmNode.start(NodeSettings(), make_record_validators(ids[0], SWARM))
        nodes = [first]
        try:
            for identity in ids[1:]:
                nodes.append(
                    await SwarmNode.start(
                        NodeSettings(initial_peers=first.maddrs), make_record_validators(identity, SWARM)
                    )
                )
            stores = [DhtStore(n.dht, i.owner_tag, i.peer_id, n.now) for n, i in zip(nodes, ids, strict=True)]
            expires = first.now() + 600
            written = {
                "peerd/v1/it/a": [0, 1, 2],  # every author
                "peerd/v1/it/b": [1],
                "peerd/v1/it/c": [0, 2],
            }
            for key, authors in written.items():
                for k in authors:
                    assert await stores[k].put(key, f"{key} by {k}".encode(), expires)
            keys = [*written, "peerd/v1/it/nobody"]
            for reader in stores:
                many = await reader.read_many(keys)
                assert list(many) == keys, "one answer per key, in the order asked"
                for key in keys:
                    single = await reader.read(key)
                    got = sorted((e.author, e.value) for e in many[key])
                    assert got == sorted((e.author, e.value) for e in single)
                    want = sorted((ids[k].peer_id, f"{key} by {k}".encode()) for k in written.get(key, []))
                    assert got == want, f"{key}: {got} != {want}"
            assert await stores[0].read_many([]) == {}
        finally:
            for node in reversed(nodes):
                await node.shutdown(timeout=5.0)

    asyncio.run(scenario())
