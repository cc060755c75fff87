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

import numpy as np

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
    (``HostLoad`` does this for many sets of busy devices at once.)
    """
    out = np.ones(len(shares))
    load = HostLoad.of(shares)
    if load is not None and busy:
        idx = np.array(sorted(busy), dtype=np.intp)
        out[idx] = load.factors(idx[None])[0]
    return out.tolist()


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


class HostLoad:
    """``slowdowns`` for many layouts at once: the devices (indices) each layout keeps busy.

    Built once per roster from the devices' shares; ``factors(busy)`` takes the busy devices of P
    layouts as a (P, K) index array and gives each one's compute slowdown, (P, K).
    """

    def __init__(self, shares: Sequence[HostShare | None], idle: Sequence[float] = ()) -> None:
        names = sorted({s.host for s in shares if s is not None})
        where = {h: k for k, h in enumerate(names)}
        self.host = np.array([where[s.host] if s is not None else -1 for s in shares], dtype=np.intp)
        self.cores = np.ones(len(names))  # the most cores any device of the host declares
        for s in shares:
            if s is not None:
                self.cores[where[s.host]] = max(self.cores[where[s.host]], s.cores)
        # what the daemons of a host keep busy without a job (``idle``, per device) is not the
        # layouts' to use; at least a tenth of the cores is left, whatever they declare
        taken = np.zeros(len(names))
        for s, busy in zip(shares, idle, strict=False):
            if s is not None:
                taken[where[s.host]] += busy
        self.spare_cores = np.maximum(self.cores - taken, 0.1 * self.cores)
        # (N, H + 1): a device's threads in its host's column; the last column collects the unknown
        self._load = np.zeros((len(shares), len(names) + 1))
        self._load[np.arange(len(shares)), self.host] = [s.threads if s is not None else 0 for s in shares]

    @classmethod
    def of(cls, shares: Sequence[HostShare | None], idle: Sequence[float] = ()) -> HostLoad | None:
        """None when no device shares a machine's cores (every factor would be 1)."""
        return cls(shares, idle) if any(s is not None for s in shares) else None

    def busiest(self, devices: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """(P,) for P layouts, the most CPU seconds any machine has to spend per core: ``seconds``
        (P, K) of work of each of the layouts' devices ``devices`` (P, K) summed per machine, over
        the cores its daemons leave (``idle``); devices whose machine is unknown count nowhere."""
        columns = len(self.cores) + 1  # the last collects the unknown machines
        host = np.where(self.host[devices] >= 0, self.host[devices], columns - 1)
        cells = np.arange(len(devices))[:, None] * columns + host  # (P, K): (layout, machine) cell
        per_host = np.bincount(cells.ravel(), weights=seconds.ravel(), minlength=len(devices) * columns)
        return (per_host.reshape(len(devices), columns)[:, :-1] / self.spare_cores).max(axis=1, initial=0.0)

    def factors(self, busy: np.ndarray) -> np.ndarray:
        """(P, K) slowdowns of the busy devices ``busy`` (P, K) of P layouts, each device once per layout."""
        threads = self._load[busy].sum(axis=1)[:, :-1]  # (P, H) busy threads per host
        ratio = np.maximum(1.0, threads / self.cores)  # (P, H)
        host = self.host[busy]
        picked = (
            np.take_along_axis(ratio, np.maximum(host, 0), axis=1) if ratio.shape[1] else np.ones(busy.shape)
        )
        return np.where(host >= 0, picked, 1.0)
