"""This machine as the cost models see it: an opaque id that peers on one machine share, its cores,
and what processes on it spend of them (``cpu_seconds``, ``tree_cpu_seconds``: what measuring a
message's cost and a daemon's idle load, ``IdleLoad``, read).

Daemons on one machine compute on the same cores (``peerd.sched.hosts``), so a CPU device's
profile says which machine it is on. The id is a salted digest of the kernel's boot id, which
every process, container or not, on one running kernel reads alike and no other machine has; it
reveals nothing about the machine. Where there is no boot id (not Linux) it digests the host name
and a hardware address instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_SALT = b"peerd-host-v1\0"


@cache
def host_id(machine: str = "") -> str:
    """16 hex digits naming this machine (until it reboots), or the machine ``machine`` names when
    given (a daemon's ``machine`` setting: daemons that name one machine share its cores)."""
    if machine:
        seed = b"named\0" + machine.encode()
    else:
        try:
            seed = BOOT_ID.read_bytes().strip()
        except OSError:
            seed = b""
        if not seed:
            seed = f"{socket.gethostname()}/{uuid.getnode():012x}".encode()
    return hashlib.sha256(_SALT + seed).hexdigest()[:16]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):  # Linux; macOS and Windows lack it
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def children(pid: int | None = None) -> set[int]:
    """Process ids whose parent is ``pid`` (this process by default); empty where ``/proc`` is missing."""
    return _descendants(os.getpid() if pid is None else pid, depth=1)


def tree_cpu_seconds(pid: int | None = None) -> float | None:
    """CPU seconds of process ``pid`` (this one by default) and all its descendants (a daemon's DHT
    process and p2pd), those that ended not counted; None where ``/proc`` cannot be read."""
    root = os.getpid() if pid is None else pid
    own = cpu_seconds(root)
    if own is None:
        return None
    return own + sum(cpu_seconds(p) or 0.0 for p in _descendants(root, depth=8))


def _descendants(root: int, *, depth: int) -> set[int]:
    parents: dict[int, set[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None:
            parents.setdefault(int(fields[1]), set()).add(int(stat.parent.name))
    found: set[int] = set()
    level = {root}
    for _ in range(depth):
        level = set().union(*(parents.get(p, set()) for p in level)) - found
        found |= level
    return found


class IdleLoad:
    """The cores a daemon's process tree keeps busy while it works for no job (its DHT's upkeep,
    heartbeats, records), from samples of its CPU time: what it keeps taking from a shared machine
    while the jobs work (``peerd.sched.hosts``). Only spans between two idle samples count, at
    least ``min_span_s`` long (CPU time moves in clock ticks); work a daemon stops while it works
    for a job (bulk link probes, sent or answered) runs ``excluding`` and is cut out of the spans.
    The answer is the lower quartile of the spans' CPU per second over the last ``window_s``
    seconds of them: the upkeep goes on in every span, other work (answering a status poll, a
    swarm's records arriving in a burst as it forms) in some, and moves the mean, not the quartile."""

    def __init__(
        self,
        window_s: float = 120.0,
        read: Callable[[], float | None] = tree_cpu_seconds,
        *,
        min_span_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._read = read
        self._clock = clock
        self._last: tuple[float, float] | None = None  # (time, CPU seconds) where the open idle span began
        self._spans: deque[tuple[float, float]] = deque()  # (seconds, CPU seconds) of idle spans
        self._excluded = 0  # ``excluding`` blocks running now

    def sample(self, now: float, *, working: bool) -> None:
        """Close the open span at ``now`` (if it was idle and long enough) and open the next."""
        if working or self._excluded:
            self._last = None  # a span that includes work is not idle; not read: /proc scans cost
            return
        cpu = self._read()
        if cpu is None:
            self._last = None
            return
        last = self._last
        if last is not None and now - last[0] < self.min_span_s:
            return  # too short to tell from clock ticks: the span goes on
        if last is not None:
            self._spans.append((now - last[0], max(0.0, cpu - last[1])))
            while sum(s for s, _ in self._spans) - self._spans[0][0] >= self.window_s:
                self._spans.popleft()
        self._last = (now, cpu)

    @contextlib.contextmanager
    def excluding(self, *, working: bool) -> Iterator[None]:
        """Run work that is not upkeep: the open span closes where it begins (``working`` as in
        ``sample``), the next opens where the last such block ends."""
        if not self._excluded:
            self.sample(self._clock(), working=working)
            self._last = None
        self._excluded += 1
        try:
            yield
        finally:
            self._excluded -= 1
            if not self._excluded and not working and (cpu := self._read()) is not None:
                self._last = (self._clock(), cpu)

    @property
    def cores(self) -> float | None:
        """Busy cores while idle, None before one idle span was seen."""
        rates = sorted(c / s for s, c in self._spans)
        return rates[(len(rates) - 1) // 4] if rates else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has run (clock-tick resolution), None if it cannot be read."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces): field 3 (state) first."""
    try:
        text = path.read_text()
    except OSError:
        return None
    _, _, rest = text.rpartition(") ")
    fields = rest.split()
    return fields if len(fields) > 12 else None
