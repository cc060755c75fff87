"""The v1 DHT key layout: every DHT key peerd reads or writes is built here (spec: protocols/dht-keys.md).

Keys are plain strings; hivemind hashes them (SHA-1 DHTID) before routing, so their
length does not matter on the wire but their spelling is the protocol. Records owned
by one peer live under a *subkey* that carries the owner's RSA public key
(``[owner:<ssh-rsa ...>]``, see ``peerd.swarm.identity``), so only that peer can write
them. Names below that take a job id or an epoch exist now so later layers share one
layout; what is stored under them is specified when those layers land.
"""

from __future__ import annotations

import re

from peerd.errors import ConfigError

KEY_PREFIX = "peerd/v1"
DEFAULT_SWARM = "default"

# Lowercase so that "Lab" and "lab" cannot become two swarms by accident.
_SWARM_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# Job ids are content hashes (hex) today; allow any short token so ids can evolve within v1.
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_EPOCH = 2**31 - 1


def check_swarm_name(swarm: str) -> str:
    """Return ``swarm`` if it is a valid swarm name, else raise ``ConfigError``."""
    if not isinstance(swarm, str) or not _SWARM_RE.fullmatch(swarm):
        raise ConfigError(
            "swarm", f"{swarm!r} is not a valid swarm name (1-64 chars of a-z 0-9 . _ -, starting alnum)"
        )
    return swarm


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a valid job id token, else raise ``ConfigError``."""
    if not isinstance(job_id, str) or not _JOB_RE.fullmatch(job_id):
        raise ConfigError("job_id", f"{job_id!r} is not a valid job id (1-128 chars of A-Z a-z 0-9 . _ -)")
    return job_id


def _check_epoch(epoch: int) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= _MAX_EPOCH:
        raise ConfigError("epoch", f"{epoch!r} is not a valid epoch (integer 0..{_MAX_EPOCH})")
    return epoch


def peers_key(swarm: str = DEFAULT_SWARM) -> str:
    """Membership: one key per swarm; subkey = the peer's owner tag, value = an encoded PeerRecord.

    Every peer re-stores its own subkey with a short expiration (soft state); a peer that
    stops refreshing disappears when its subkey expires.
    """
    return f"{KEY_PREFIX}/{check_swarm_name(swarm)}/peers"


def jobs_key(swarm: str = DEFAULT_SWARM) -> str:
    """Job discovery: one key per swarm; subkeys = job owners' tags, values list the job ids they publish."""
    return f"{KEY_PREFIX}/{check_swarm_name(swarm)}/jobs"


def job_key(job_id: str) -> str:
    """The job record itself (spec, owner, state); subkey = the job owner's tag, so only the owner can edit it."""
    return f"{KEY_PREFIX}/job/{check_job_id(job_id)}"


def roster_key(job_id: str, epoch: int) -> str:
    """Planning epoch ``epoch`` of a job: subkey per roster peer (owner tag), value = its roster entry."""
    return f"{KEY_PREFIX}/job/{check_job_id(job_id)}/epoch/{_check_epoch(epoch)}/roster"


def candidates_key(job_id: str, epoch: int) -> str:
    """Allocation candidates exchanged during the search (island migration); subkey per publishing peer."""
    return f"{KEY_PREFIX}/job/{check_job_id(job_id)}/epoch/{_check_epoch(epoch)}/candidates"


def votes_key(job_id: str, epoch: int) -> str:
    """Votes for the winning candidate of an epoch; subkey per voting roster peer."""
    return f"{KEY_PREFIX}/job/{check_job_id(job_id)}/epoch/{_check_epoch(epoch)}/votes"


def commit_key(job_id: str) -> str:
    """The committed allocation (latest epoch that reached quorum); subkey per peer that saw the quorum."""
    return f"{KEY_PREFIX}/job/{check_job_id(job_id)}/commit"


def progress_key(job_id: str) -> str:
    """Training progress (step, loss, throughput, bytes on the wire); subkey per stage worker."""
    return f"{KEY_PREFIX}/job/{check_job_id(job_id)}/progress"
