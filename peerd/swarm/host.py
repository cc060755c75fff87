"""This machine as the cost models see it: an opaque id that peers on one machine share, and its cores.

Daemons on one machine compute on the same cores (``peerd.sched.hosts``), so a CPU device's
profile says which machine it is on. The id is a salted digest of the kernel's boot id, which
every process, container or not, on one running kernel reads alike and no other machine has; it
reveals nothing about the machine. Where there is no boot id (not Linux) it digests the host name
and a hardware address instead.
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
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
