"""The committed roster of a job, rebuilt from a daemon's status so that a bench can score it offline.

A commit names its roster's peers but not what they declared; a daemon's status shows every peer's
profile and probed links. ``committed_roster`` turns them back into the ``Roster`` the cost models
read (``peerd.jobs.service`` builds the real entries the same way), so a bench can break the
committed cost into its parts or price another job on the same peers.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from peerd.pipeline.messaging import measure_messaging
from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink
from peerd.swarm.profiling import profile_device
from peerd.swarm.records import DeviceProfile, scaled


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the block: what each of a local swarm's daemons computes with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def daemon_profile(cache: Path) -> DeviceProfile:
    """This machine's CPU profile as a local swarm's daemons (one thread each) will read it from
    ``cache``: measured here once, so they do not all measure it at once."""
    with one_thread():
        return profile_device("cpu", cache_path=cache, messaging=measure_messaging)


def member_links(status: dict[str, Any], members: set[str]) -> list[dict[str, Any]]:
    """The status's links between ``members`` that the cost model can price: probed ok, with a round
    trip and an upload rate."""
    return [
        x
        for x in status.get("links", [])
        if x["src"] in members
        and x["dst"] in members
        and x["status"] == "ok"
        and x["rtt_ms"] is not None
        and x["bw_up_mbps"]
    ]


def probed_links(status: dict[str, Any], alloc: dict[str, Any]) -> dict[str, Any]:
    """The committed roster's probed links as the cost model reads them: the range and median of the
    round trips and upload rates (loopback probes on a busy machine spread widely)."""
    ok = member_links(status, set(alloc["roster"]))
    out: dict[str, Any] = {"measured": len(ok)}
    for key in ("rtt_ms", "bw_up_mbps"):
        values = sorted(float(x[key]) for x in ok)
        if values:
            out[key] = {"min": values[0], "median": statistics.median(values), "max": values[-1]}
    return out


def committed_roster(
    status: dict[str, Any], alloc: dict[str, Any], measured: RosterDevice | None = None
) -> Roster:
    """The committed roster's peers as the owner's status shows them, in the form the cost models read.

    Each entry as ``peerd.jobs.service`` builds it: fp32 TFLOPS, free memory, measured links (one-way
    delay = RTT / 2, upload bandwidth), each peer's machine, cores and threads; the memory bandwidth,
    seconds per op and element costs of ``measured`` (the shared profile cache's, as a daemon
    declares them: ``peerd.jobs.service.roster_profile``), which price small models' compute; what a
    message and a codec call cost each peer's machine and its idle load, as its row declares them.
    """
    rows = {p["peer_id"]: p for p in status.get("peers", [])}
    members = list(alloc["roster"])
    probed = member_links(status, set(members))
    entries = []
    for peer in members:
        row = rows[peer]
        memory = (
            row["memory_free_bytes"] if row["memory_free_bytes"] is not None else row["memory_total_bytes"]
        )
        device = RosterDevice(
            float(row["tflops"]["fp32"]),
            int(memory),
            "",
            measured.memory_bandwidth if measured else None,
            measured.launch_s if measured else None,
            row.get("host_id"),
            row.get("host_cores"),
            row.get("threads"),
            measured.element_s if measured else None,
            scaled(row.get("message_us"), 1e-6),
            scaled(row.get("wire_byte_ns"), 1e-9),
            row.get("idle_cores"),
            scaled(row.get("codec_us"), 1e-6),
            scaled(row.get("codec_value_ns"), 1e-9),
        )
        links = {
            x["dst"]: RosterLink(x["dst"], x["rtt_ms"] / 2e3, x["bw_up_mbps"] * 1e6)
            for x in probed
            if x["src"] == peer
        }
        entries.append(
            RosterEntry(
                "bench", int(alloc["epoch"]), peer, 0.0, device, tuple(links[p] for p in sorted(links))
            )
        )
    return Roster.of(int(alloc["epoch"]), entries)
