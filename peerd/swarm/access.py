"""Optional swarm access control: a shared swarm secret whose MAC every DHT record of a member carries, or an allowlist of peer ids.

Without either a swarm is open: any peer that can reach one member can join and submit.
With an allowlist (``allowed_peers``), members store and accept only DHT records signed by a
listed peer's key (the owner tag of the record's subkey, whose signature hivemind's RSA
validator checks) and their transport refuses streams of any other peer id.
With one (``swarm_secret_file``), each member's DHT node appends
``[swarm-mac:<hex HMAC-SHA256>]`` to every value it stores, computed with a key derived
from the secret and the swarm name over the record's key, subkey, expiration time and
value (its RSA signature included). Members refuse to store, and ignore when found, any
record without a valid MAC, so a daemon without the secret cannot publish a peer record
(join) or a job record (submit) that members see, nor reuse a member's MAC for another
record; and the transport refuses streams from peers that have no valid record
(protocols/access.md).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Iterable
from pathlib import Path

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.log import get_logger
from peerd.swarm.identity import peer_id_from_owner_tag
from peerd.swarm.rejections import count_dht
from peerd.swarm.secret import SECRET_MIN_BYTES, load_swarm_secret

logger = get_logger(__name__)

MAC_PREFIX = b"[swarm-mac:"
_MAC_SUFFIX = re.compile(rb"\[swarm-mac:([0-9a-f]{64})\]\Z")
_MAC_LEN = len(MAC_PREFIX) + 64 + 1


def _mac_key(secret: bytes, swarm: str) -> bytes:
    # one key per swarm name: the same secret file used by two swarms does not let records cross
    return hmac.new(secret, b"peerd swarm-secret v1\x00" + swarm.encode(), hashlib.sha256).digest()


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class SwarmSecretValidator(RecordValidatorBase):
    """Appends and checks the swarm MAC on every DHT record (outermost: signs last, checks and strips first)."""

    def __init__(self, secret: bytes, swarm: str) -> None:
        if len(secret) < SECRET_MIN_BYTES:
            raise ConfigError("swarm_secret_file", f"a swarm secret needs at least {SECRET_MIN_BYTES} bytes")
        self._key = _mac_key(secret, swarm)
        self.swarm = swarm
        self.rejected = 0

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        message = (
            _field(record.key)
            + _field(record.subkey)
            + struct.pack(">d", record.expiration_time)
            + _field(value)
        )
        return hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + MAC_PREFIX + self._mac(record, record.value) + b"]"

    def validate(self, record: DHTRecord) -> bool:
        match = _MAC_SUFFIX.search(record.value[-_MAC_LEN:])
        if match is None:
            self.rejected += 1
            count_dht(ErrorCode.NOT_ALLOWED)
            logger.debug("rejected a DHT record without the swarm MAC")
            return False
        inner = record.value[:-_MAC_LEN]
        if not hmac.compare_digest(match.group(1), self._mac(record, inner)):
            self.rejected += 1
            count_dht(ErrorCode.NOT_ALLOWED)
            logger.debug("rejected a DHT record with a wrong swarm MAC")
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        if _MAC_SUFFIX.search(record.value[-_MAC_LEN:]) is None:
            return record.value
        return record.value[:-_MAC_LEN]

    @property
    def priority(self) -> int:
        return 20  # above RSASignatureValidator (10): the MAC covers the signed value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # a second validator with the same key adds nothing; one with another key must not be merged away
        return isinstance(other, SwarmSecretValidator) and hmac.compare_digest(other._key, self._key)


# hivemind's owner marker, as it appears inside a serialized key or subkey (RSASignatureValidator)
_OWNER_TAG = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/=]{100,2000})\]")


class PeerAllowlistValidator(RecordValidatorBase):
    """Accepts only DHT records owned by listed peers: every owner tag in the key or subkey names one,
    and there is at least one (a record nobody signed is nobody's on the list)."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = frozenset(allowed)

    def owners(self, record: DHTRecord) -> list[str]:
        """Peer ids of the owner tags in ``record``'s key and subkey (ProtocolError: a tag with no valid key)."""
        tags = _OWNER_TAG.findall(record.key) + _OWNER_TAG.findall(record.subkey or b"")
        return [peer_id_from_owner_tag(b"[owner:" + tag + b"]") for tag in tags]

    def validate(self, record: DHTRecord) -> bool:
        try:
            owners = self.owners(record)
        except ProtocolError:
            owners = []
        if owners and all(owner in self.allowed for owner in owners):
            return True
        count_dht(ErrorCode.NOT_ALLOWED)
        logger.debug("rejected a DHT record of %s: not on the allowlist", owners or "nobody")
        return False

    @property
    def priority(self) -> int:
        return 15  # between the MAC (20) and RSA (10): the key and subkey are the same at every stage

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerAllowlistValidator) and other.allowed == self.allowed


def access_validators(
    secret_file: str | Path | None, swarm: str, allowed_peers: Iterable[str] = ()
) -> list[RecordValidatorBase]:
    """The validators a daemon adds for its access setting: none for an open swarm."""
    out: list[RecordValidatorBase] = []
    if secret_file is not None:
        out.append(SwarmSecretValidator(load_swarm_secret(secret_file), swarm))
    allowed = list(allowed_peers)
    if allowed:
        out.append(PeerAllowlistValidator(allowed))
    return out


def access_mode(secret_file: str | Path | None, allowed_peers: Iterable[str] = ()) -> str:
    """``open``, ``secret``, ``allowlist`` or ``secret+allowlist`` (what ``peerd status`` says)."""
    modes = ["secret"] * (secret_file is not None) + ["allowlist"] * bool(list(allowed_peers))
    return "+".join(modes) or "open"
