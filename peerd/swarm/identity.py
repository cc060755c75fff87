"""Per-peer RSA identity (one file = libp2p peer id + DHT signing key) and the DHT record validators.

The identity file uses libp2p's private-key protobuf (RSA, DER), the format hivemind's
``P2P.create(identity_path=...)`` reads, so the daemon passes the same file to p2pd and
the peer id that p2pd announces is derived from the key that signs the peer's DHT
records. That lets every receiver check a record's ``peer_id`` against its signer:
``peer_id == base58(multihash_sha256(protobuf(RSA public key)))``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import struct
from collections import OrderedDict
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peerd.durable import remove_leftovers, tmp_prefix
from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.log import get_logger
from peerd.swarm.keys import DEFAULT_SWARM, peers_key
from peerd.swarm.records import PeerRecord, validate_peer_record
from peerd.swarm.rejections import count_dht

logger = get_logger(__name__)

RSA_KEY_BITS = 2048  # what p2pd and hivemind generate; verification cost grows with the size
# hivemind's owner marker; the key inside is OpenSSH "ssh-rsa <base64>" (no ']' can occur in it).
_OWNER_TAG_RE = re.compile(rb"^\[owner:(ssh-rsa [A-Za-z0-9+/=]{100,2000})\]$")
LEFTOVER_AGE_S = 60.0  # a temporary key file this old belongs to no live creation (they take ms)
_SHA2_256_MULTIHASH_PREFIX = bytes([0x12, 0x20])  # multihash code sha2-256, digest length 32


class _LoadedRSAPrivateKey(RSAPrivateKey):
    """hivemind's RSAPrivateKey around an existing key (its constructor always generates a new one)."""

    def __init__(self, key: rsa.RSAPrivateKey) -> None:
        self._private_key = key  # the attribute hivemind's sign()/pickling use (checked by tests)


class Identity:
    """One peer's RSA key: signs its DHT records and (through ``path``) fixes its libp2p peer id."""

    def __init__(self, key: rsa.RSAPrivateKey, path: Path | None = None) -> None:
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ConfigError("identity", f"expected an RSA private key, got {type(key).__name__}")
        self.path = path
        self.private_key: RSAPrivateKey = _LoadedRSAPrivateKey(key)
        self.public_key_bytes: bytes = self.private_key.get_public_key().to_bytes()  # OpenSSH "ssh-rsa ..."
        self.owner_tag: bytes = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(
            b"_key_", self.public_key_bytes
        )
        self.peer_id: str = peer_id_from_public_key(key.public_key())

    @classmethod
    def generate(cls) -> Identity:
        """A fresh in-memory identity (tests, throw-away clients)."""
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=RSA_KEY_BITS))

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load the identity at ``path``, creating it (mode 0600, atomically) if it does not exist."""
        path = Path(path).expanduser()
        # a creation killed before its link left its temporary (another creator's may be live: spare
        # the young ones)
        remove_leftovers(path, older_than_s=LEFTOVER_AGE_S)
        if not path.exists():
            identity = cls.generate()
            try:
                created = _write_new_file(path, identity.to_bytes())
            except OSError as exc:
                raise ConfigError("identity_path", f"cannot create {path}: {exc.strerror or exc}") from None
            if created:
                logger.info("created identity %s (peer id %s)", path, identity.peer_id)
                identity.path = path
                return identity
            # lost a creation race with another process: fall through and load the winner's key
        return cls.load(path)

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        path = Path(path).expanduser()
        try:
            data = path.read_bytes()
            mode = path.stat().st_mode
        except OSError as exc:
            raise ConfigError("identity_path", f"cannot read {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "identity file %s is accessible by other users (mode %o); chmod 600 it", path, mode & 0o777
            )
        try:
            proto = crypto_pb2.PrivateKey.FromString(data)
            if proto.key_type != crypto_pb2.KeyType.RSA:
                raise ValueError(f"key type {crypto_pb2.KeyType.Name(proto.key_type)}, peerd needs RSA")
            key = serialization.load_der_private_key(proto.data, password=None)
        except Exception as exc:  # protobuf DecodeError, ValueError, UnsupportedAlgorithm, ...
            raise ConfigError("identity_path", f"{path} is not a libp2p RSA private key: {exc}") from None
        return cls(key, path)  # type: ignore[arg-type]

    def to_bytes(self) -> bytes:
        """The libp2p private-key protobuf that ``P2P.create(identity_path=...)`` reads."""
        return crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.RSA, data=self.private_key.to_bytes()
        ).SerializeToString()

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id}, path={self.path})"


def _write_new_file(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data``, mode 0600, never exposing a partial file; False if it already exists."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f"{tmp_prefix(path)}{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if another process created the file meanwhile
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create is still race-free
            try:
                with open(path, "xb") as f:
                    os.chmod(path, 0o600)
                    f.write(data)
            except FileExistsError:
                return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def peer_id_from_public_key(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA key: sha2-256 multihash of the protobuf-wrapped DER key."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256_MULTIHASH_PREFIX + hashlib.sha256(proto).digest()).to_base58()


@lru_cache(maxsize=4096)
def peer_id_from_owner_tag(owner_tag: bytes) -> str:
    """The peer id that must appear in records stored under ``owner_tag``; ProtocolError if the tag is not one."""
    match = _OWNER_TAG_RE.fullmatch(owner_tag)
    if match is None:
        raise ProtocolError("subkey is not an owner tag [owner:ssh-rsa ...]", code=ErrorCode.BAD_SIGNATURE)
    try:
        key = serialization.load_ssh_public_key(match.group(1))
    except Exception as exc:
        raise ProtocolError(
            f"owner tag holds no valid public key: {exc}", code=ErrorCode.BAD_SIGNATURE
        ) from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ProtocolError("owner tag holds a non-RSA key", code=ErrorCode.BAD_SIGNATURE)
    return peer_id_from_public_key(key)


def check_peer_entry(subkey: Any, value: Any, expiration_time: float | None, now: float) -> PeerRecord:
    """Validate one (subkey, value) entry of a peers key, as stored in / returned by the DHT (signature stripped).

    The subkey must be an owner tag, the value the bytes of ``encode_peer_record``, fresh
    against ``now``, and its ``peer_id`` derived from the owner key. Membership readers
    call this on every entry of ``dht.get(peers_key(swarm), latest=True)``.
    """
    if not isinstance(subkey, bytes):
        raise ProtocolError("peer entry subkey must be an owner tag (bytes)", code=ErrorCode.BAD_SIGNATURE)
    expected_peer_id = peer_id_from_owner_tag(subkey)
    if not isinstance(value, bytes):
        raise ProtocolError(f"peer entry value must be bytes, got {type(value).__name__}")
    rec = validate_peer_record(value, now, expiration_time=expiration_time)
    if rec.peer_id != expected_peer_id:
        raise ProtocolError(
            f"record claims peer id {rec.peer_id} but its owner key is {expected_peer_id}",
            code=ErrorCode.BAD_SIGNATURE,
        )
    return rec


class PeerRecordValidator(RecordValidatorBase):
    """Schema + freshness + peer-id binding for everything stored under the peers key of the given swarms.

    Runs after hivemind's RSASignatureValidator (lower priority), so it sees the value
    with the signature already verified and stripped. Other keys pass untouched.
    """

    def __init__(self, swarms: Iterable[str] = (DEFAULT_SWARM,)) -> None:
        self._swarm_by_key_id = {DHTID.generate(source=peers_key(s)).to_bytes(): s for s in swarms}

    @property
    def swarms(self) -> list[str]:
        return sorted(self._swarm_by_key_id.values())

    def validate(self, record: DHTRecord) -> bool:
        swarm = self._swarm_by_key_id.get(record.key)
        if swarm is None:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception as exc:
            count_dht(ErrorCode.MALFORMED)
            logger.debug("rejected peer entry in swarm %s: undecodable (%s)", swarm, exc)
            return False
        try:
            check_peer_entry(subkey, value, record.expiration_time, now=get_dht_time())
        except ProtocolError as exc:
            count_dht(exc.code)
            logger.debug("rejected peer entry in swarm %s: %s", swarm, exc)
            return False
        except Exception:  # a bug here must not take the DHT process down; reject and say so
            count_dht(ErrorCode.INTERNAL)
            logger.warning("peer record validator failed unexpectedly", exc_info=True)
            return False
        return True

    @property
    def priority(self) -> int:
        return 0  # RSASignatureValidator is 10: it validates and strips first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, PeerRecordValidator):
            return False
        self._swarm_by_key_id.update(other._swarm_by_key_id)
        return True


VERDICT_CACHE_SIZE = 4096
"""Signature verdicts a DHT process remembers (32-byte digests: ~0.5 MiB at most)."""


def record_digest(record: DHTRecord) -> bytes:
    """A collision-resistant digest of everything a signature verdict depends on."""
    h = hashlib.blake2b(digest_size=32)
    for part in (record.key, record.subkey, record.value):
        if part is None:
            h.update(b"\xff" * 8)  # no subkey differs from an empty one
        else:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    h.update(struct.pack("<d", record.expiration_time))
    return h.digest()


class CountingRSAValidator(RSASignatureValidator):
    """hivemind's signature check, counting the records it rejects (a forged or missing owner
    signature) and remembering its verdicts.

    Every peer re-reads the same signed records every few seconds (peer entries, job progress),
    and each read re-parses the owner's key and re-verifies its RSA signature: ~70 us here, about
    a third of the DHT process's busy time while a job ran on 8 local daemons. A verdict depends
    on the record's bytes alone, so the last ``cache_size`` verdicts are kept under
    ``record_digest``: a record seen before costs a hash (~6 us), a changed byte anywhere is
    verified afresh. Rejections count on every sight.
    """

    def __init__(self, private_key: RSAPrivateKey | None = None, *, cache_size: int = VERDICT_CACHE_SIZE):
        super().__init__(private_key)
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
        self._cache_size = cache_size
        self.verified = 0
        """Signatures actually verified (the rest were remembered)."""

    def validate(self, record: DHTRecord) -> bool:
        if not self._PUBLIC_KEY_RE.search(record.key) and (
            record.subkey is None or not self._PUBLIC_KEY_RE.search(record.subkey)
        ):
            return True  # not a protected record: nothing to verify or remember
        digest = record_digest(record)
        verdict = self._verdicts.get(digest)
        if verdict is None:
            verdict = super().validate(record)
            self.verified += 1
            self._verdicts[digest] = verdict
            if len(self._verdicts) > self._cache_size:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(digest)
        if not verdict:
            count_dht(ErrorCode.BAD_SIGNATURE)
        return verdict


def make_record_validators(
    identity: Identity, swarms: str | Iterable[str] = DEFAULT_SWARM
) -> list[RecordValidatorBase]:
    """The validators every peerd DHT needs: ``DHT(record_validators=make_record_validators(identity, swarm))``.

    The RSA validator signs with *this* identity's key (not hivemind's process-wide one),
    so several peers in one process stay distinct. Pass no other RSASignatureValidator:
    hivemind keeps only the first one it is given.
    """
    swarm_list = [swarms] if isinstance(swarms, str) else list(swarms)
    return [CountingRSAValidator(identity.private_key), PeerRecordValidator(swarm_list)]
