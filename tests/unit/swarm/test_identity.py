"""Identity files, peer-id derivation, and the validator chain (signature + peer record schema) without a network."""

from __future__ import annotations

import dataclasses
import os
import pickle
import stat
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.swarm.identity import (
    Identity,
    PeerRecordValidator,
    check_peer_entry,
    make_record_validators,
    peer_id_from_owner_tag,
)
from peerd.swarm.keys import peers_key
from peerd.swarm.records import PeerRecord, PeerState, encode_peer_record


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.generate()


def test_created_file_is_private_and_reloads_to_the_same_peer(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [p for p in path.parent.iterdir() if p.name != "identity.key"]  # no temp file left behind
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id and again.owner_tag == first.owner_tag
    assert again.path == path


def test_peer_id_is_the_one_libp2p_derives_from_the_file(tmp_path):
    ident = Identity.load_or_create(tmp_path / "id.key")
    assert PeerID.from_identity((tmp_path / "id.key").read_bytes()).to_base58() == ident.peer_id
    assert peer_id_from_owner_tag(ident.owner_tag) == ident.peer_id


def test_loads_a_file_hivemind_generated(tmp_path):
    path = tmp_path / "hivemind.key"
    P2P.generate_identity(str(path))  # hivemind writes it read-only (0400): still private, still loads
    ident = Identity.load(path)
    assert ident.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()


def test_loose_permissions_are_warned_about(tmp_path, caplog):
    path = tmp_path / "id.key"
    Identity.load_or_create(path)
    path.chmod(0o644)
    Identity.load(path)
    assert "accessible by other users" in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        b"",
        crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.Ed25519, data=ed25519.Ed25519PrivateKey.generate().private_bytes_raw()
        ).SerializeToString(),
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=b"not DER").SerializeToString(),
    ],
)
def test_bad_identity_files_are_config_errors(tmp_path, content):
    path = tmp_path / "id.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ConfigError) as info:
        Identity.load_or_create(path)
    assert info.value.field == "identity_path"


def test_unreadable_or_uncreatable_path_is_config_error(tmp_path):
    with pytest.raises(ConfigError):
        Identity.load(tmp_path / "nope.key")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError):
        Identity.load_or_create(tmp_path / "file" / "id.key")  # parent is a regular file


def test_concurrent_creation_agrees_on_one_key(tmp_path):
    path = tmp_path / "id.key"
    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(lambda _: Identity.load_or_create(path).peer_id, range(4)))
    assert len(set(ids)) == 1
    assert ids[0] == Identity.load(path).peer_id
    assert [p.name for p in tmp_path.iterdir()] == ["id.key"]


def test_owner_tag_is_hivemind_format(alice):
    assert alice.owner_tag.startswith(b"[owner:ssh-rsa ") and alice.owner_tag.endswith(b"]")
    validator = make_record_validators(alice)[0]
    assert validator.local_public_key == alice.owner_tag


@pytest.mark.parametrize(
    "tag",
    [
        b"",
        b"[owner:]",
        b"[owner:ssh-rsa AAAA]",
        b"[owner:ssh-ed25519 " + b"A" * 120 + b"]",
        b"x[owner:ssh-rsa AAAA]",
    ],
)
def test_non_owner_tags_are_bad_signature(tag):
    with pytest.raises(ProtocolError) as info:
        peer_id_from_owner_tag(tag)
    assert info.value.code == ErrorCode.BAD_SIGNATURE


# ---------------------------------------------------------------- the validator chain

SWARM = "unit"
KEY_ID = DHTID.generate(source=peers_key(SWARM)).to_bytes()


def record_of(ident: Identity, **changes) -> PeerRecord:
    now = get_dht_time()
    rec = PeerRecord(
        peer_id=ident.peer_id,
        name="n",
        state=PeerState.ONLINE,
        software_version="0.1.0",
        started_at=now,
        updated_at=now,
        seq=1,
    )
    return msgspec.structs.replace(rec, **changes)


def dht_record(subkey: object, value: object, *, key: bytes = KEY_ID, ttl: float = 30.0) -> DHTRecord:
    """What the DHT hands validators: msgpack-serialized subkey and value."""
    return DHTRecord(
        key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), get_dht_time() + ttl
    )


def signed(chain: CompositeValidator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=chain.sign_value(record))


def test_own_record_is_signed_validated_and_stripped(alice):
    chain = CompositeValidator(make_record_validators(alice, SWARM))
    plain = dht_record(alice.owner_tag, encode_peer_record(record_of(alice)))
    rec = signed(chain, plain)
    assert rec.value != plain.value and b"[signature:" in rec.value
    assert chain.validate(rec)
    assert chain.strip_value(rec) == plain.value


def test_a_receiver_with_another_identity_accepts_it(alice, bob):
    sender = CompositeValidator(make_record_validators(alice, SWARM))
    receiver = CompositeValidator(make_record_validators(bob, SWARM))
    assert receiver.validate(
        signed(sender, dht_record(alice.owner_tag, encode_peer_record(record_of(alice))))
    )


def test_validators_of_two_identities_sign_with_their_own_keys(alice, bob):
    # hivemind's default would share one process-wide key; here bob cannot sign under alice's tag
    forger = CompositeValidator(make_record_validators(bob, SWARM))
    receiver = CompositeValidator(make_record_validators(alice, SWARM))
    forged = signed(forger, dht_record(alice.owner_tag, encode_peer_record(record_of(alice))))
    assert b"[signature:" not in forged.value  # bob's validator only signs bob's subkeys
    assert not receiver.validate(forged)


def test_signature_by_another_key_is_rejected(alice, bob):
    receiver = CompositeValidator(make_record_validators(alice, SWARM))
    plain = dht_record(alice.owner_tag, encode_peer_record(record_of(alice)))
    bob_sig = bob.private_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(plain)))
    assert not receiver.validate(
        dataclasses.replace(plain, value=plain.value + b"[signature:" + bob_sig + b"]")
    )


def test_tampering_after_signing_is_rejected(alice):
    chain = CompositeValidator(make_record_validators(alice, SWARM))
    rec = signed(chain, dht_record(alice.owner_tag, encode_peer_record(record_of(alice, name="a"))))
    tampered = rec.value.replace(b"\xa4name\xa1a", b"\xa4name\xa1b")
    assert tampered != rec.value
    assert not chain.validate(dataclasses.replace(rec, value=tampered))
    assert not chain.validate(dataclasses.replace(rec, expiration_time=rec.expiration_time + 100))


@pytest.mark.parametrize(
    "case",
    [
        "malformed",
        "future",
        "peer_id_of_someone_else",
        "value_not_bytes",
        "far_expiration",
        "no_owner_tag",
        "no_subkey",
    ],
)
def test_properly_signed_but_invalid_peer_entries_are_rejected(alice, bob, case):
    chain = CompositeValidator(make_record_validators(alice, SWARM))
    subkey: object = alice.owner_tag
    value: object = encode_peer_record(record_of(alice))
    ttl = 30.0
    if case == "malformed":
        value = b"\x81\xa1v\x01"
    elif case == "future":
        value = encode_peer_record(
            record_of(alice, updated_at=get_dht_time() + 3600, started_at=get_dht_time())
        )
    elif case == "peer_id_of_someone_else":
        value = encode_peer_record(record_of(alice, peer_id=bob.peer_id))
    elif case == "value_not_bytes":
        value = {"v": 1, "kind": "peer"}
    elif case == "far_expiration":
        ttl = 86_400.0
    elif case == "no_owner_tag":
        subkey = alice.peer_id.encode()
    rec = signed(chain, dht_record(subkey, value, ttl=ttl))
    if case == "no_subkey":
        rec = dataclasses.replace(rec, subkey=b"")  # hivemind's marker for a plain (non-dictionary) value
    assert not chain.validate(rec)


def test_other_keys_are_not_the_peer_validators_business(alice):
    chain = CompositeValidator(make_record_validators(alice, SWARM))
    other = dht_record(b"whatever", b"\xc1 anything", key=DHTID.generate(source="some/other/key").to_bytes())
    assert chain.validate(other)
    other_swarm = DHTID.generate(source=peers_key("elsewhere")).to_bytes()
    assert chain.validate(dht_record(b"whatever", b"\xc1", key=other_swarm))


def test_peer_validators_merge_their_swarms(alice):
    chain = CompositeValidator(make_record_validators(alice, "s1"))
    chain.extend(make_record_validators(alice, ["s2"]))
    assert len(chain._validators) == 2  # one RSA validator, one merged peer validator
    merged = next(v for v in chain._validators if isinstance(v, PeerRecordValidator))
    assert merged.swarms == ["s1", "s2"]
    for swarm in ("s1", "s2"):
        bad = dht_record(alice.owner_tag, b"\xc1", key=DHTID.generate(source=peers_key(swarm)).to_bytes())
        assert not chain.validate(signed(chain, bad))


def test_validators_survive_pickling(alice):
    chain = CompositeValidator(make_record_validators(alice, SWARM))
    copy = pickle.loads(pickle.dumps(chain))
    rec = signed(copy, dht_record(alice.owner_tag, encode_peer_record(record_of(alice))))
    assert chain.validate(rec) and copy.validate(rec)


def test_check_peer_entry_is_what_readers_use(alice, bob):
    now = get_dht_time()
    raw = encode_peer_record(record_of(alice))
    assert check_peer_entry(alice.owner_tag, raw, now + 30, now).peer_id == alice.peer_id
    with pytest.raises(ProtocolError) as info:
        check_peer_entry(bob.owner_tag, raw, now + 30, now)
    assert info.value.code == ErrorCode.BAD_SIGNATURE
    with pytest.raises(ProtocolError) as info:
        check_peer_entry(alice.owner_tag.decode(), raw, now + 30, now)
    assert info.value.code == ErrorCode.BAD_SIGNATURE


# ---------------------------------------------------------------- remembered signature verdicts


def signed_record(ident: Identity, value: bytes = b"payload", expiration: float = 1e9) -> DHTRecord:
    validator = make_record_validators(ident)[0]
    record = DHTRecord(key=b"k" + ident.owner_tag, subkey=b"s", value=value, expiration_time=expiration)
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_a_signature_seen_before_is_not_verified_again(alice):
    from peerd.swarm.rejections import DHT_REJECTED

    validator = make_record_validators(alice)[0]
    genuine = signed_record(alice)
    assert validator.validate(genuine) and validator.validate(genuine)
    assert validator.verified == 1
    # the remembered verdict is for those bytes only: any change is verified afresh, and rejected
    signature = genuine.value[len(b"payload") :]
    for forged in (
        dataclasses.replace(genuine, value=b"payloaX" + signature),
        dataclasses.replace(genuine, expiration_time=genuine.expiration_time + 1),
        dataclasses.replace(genuine, subkey=b"t"),
        dataclasses.replace(genuine, subkey=None),
    ):
        assert not validator.validate(forged)
    assert validator.verified == 5
    before = DHT_REJECTED["BAD_SIGNATURE"]
    forged = dataclasses.replace(genuine, value=b"payloaX" + signature)
    assert not validator.validate(forged) and not validator.validate(forged)
    assert validator.verified == 5  # a replayed forgery costs a hash, and still counts each time
    assert DHT_REJECTED["BAD_SIGNATURE"] == before + 2


def test_remembered_verdicts_are_bounded_oldest_out(alice):
    from peerd.swarm.identity import CountingRSAValidator

    validator = CountingRSAValidator(alice.private_key, cache_size=2)
    first, second, third = (signed_record(alice, value=v) for v in (b"1", b"2", b"3"))
    for record in (first, second, first, third):  # first was used again: second is the oldest
        assert validator.validate(record)
    assert validator.verified == 3
    assert validator.validate(first) and validator.verified == 3
    assert validator.validate(second) and validator.verified == 4
    unprotected = DHTRecord(key=b"k", subkey=b"s", value=b"v", expiration_time=1e9)
    assert validator.validate(unprotected) and validator.verified == 4
