"""Devices that compute on one machine's shared CPU cores: how much each slows the others.

A CPU device's measured rates (TFLOPS, memory bandwidth, seconds per op) were measured with its
own compute threads while the machine's other work was idle. Peers on one machine (several
daemons on one volunteer's box, or a local test swarm) share its cores: when more threads
compute at once than the machine has cores, each runs at ``cores / threads`` of its measured
speed. Accelerators (a GPU each) do not share their compute this way and carry no ``HostShare``.

The cost models ask this module which devices compute at the same time in a phase of their
schedule (``slowdowns``) and divide those devices' rates by the answer; idle devices, and devices
whose host is unknown, keep their measured rates.

A link between two devices of one machine is a loopback: its bytes and every message's hops (the
daemons' framing, p2pd) run on that machine's cores, not on a wire, and its probed delay and
bandwidth were measured with those cores to spare. While they are oversubscribed, the link slows
with them (``loopback_factors``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Annotated

from peerd.errors import ConfigError
from peerd.loading import Range


@dataclass(frozen=True)
class HostShare:
    """Which machine a CPU device computes on and how many of its cores it uses."""

    host: str
    """An opaque id of the machine (peers on one machine declare the same one)."""
    cores: Annotated[int, Range(ge=1)]
    """Cores available to the device's process on that machine."""
    threads: Annotated[int, Range(ge=1)] = 1
    """Compute threads the device's rates were measured with (what it keeps busy while computing)."""

    def problems(self) -> list[ConfigError]:
        return [] if self.host else [ConfigError("host", "must be a non-empty string")]


def slowdowns(shares: Sequence[HostShare | None], busy: Collection[int]) -> list[float]:
    """Per device, the factor its compute slows by while the devices ``busy`` (indices) compute at once.

    On each host: the busy devices' threads over the host's cores (the most any of its devices
    declares), at least 1. A device that is not busy, or has no ``HostShare``, gets 1.
    """
    threads: dict[str, int] = {}
    cores: dict[str, int] = {}
    for i, share in enumerate(shares):
        if share is None:
            continue
        cores[share.host] = max(cores.get(share.host, 1), share.cores)
        if i in busy:
            threads[share.host] = threads.get(share.host, 0) + share.threads
    return [
        max(1.0, threads[s.host] / cores[s.host]) if s is not None and i in busy else 1.0
        for i, s in enumerate(shares)
    ]


def loopback_factors(shares: Sequence[HostShare | None], factors: Sequence[float]) -> list[list[float]]:
    """Per ordered pair of devices, the factor their link slows by (delay up, bandwidth down) given
    each device's compute slowdown ``factors`` (``slowdowns``): the larger of the two for a pair on
    one machine, 1 for a pair on two machines or with an unknown host."""
    hosts = [s.host if s is not None else None for s in shares]
    return [
        [
            max(factors[i], factors[j]) if i != j and a is not None and a == b else 1.0
            for j, b in enumerate(hosts)
        ]
        for i, a in enumerate(hosts)
    ]
