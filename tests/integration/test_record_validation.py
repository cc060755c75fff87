"""Real hivemind DHTs on loopback: honest peers reject forged, malformed, oversized and future-dated peer records.

Three DHTs: two honest peers (A, B) with peerd's validators, each with its own identity
file, and an attacker M whose only validator signs each record with whatever key the
test assigns to its subkey (or not at all) and accepts everything. M stores every
attack into the swarm; A and B must not keep any of it, and must still serve valid
records afterwards. A valid record pushed by M is the positive control that shows M's
stores do reach A and B.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import msgspec
import pytest
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peerd.swarm.identity import Identity, check_peer_entry, make_record_validators
from peerd.swarm.keys import peers_key
from peerd.swarm.records import (
    MAX_PEER_RECORD_BYTES,
    DeviceKind,
    DeviceProfile,
    PeerRecord,
    PeerState,
    encode_peer_record,
    peer_record_to_wire,
)
from peerd.wire import canonical_pack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SWARM = "it-records"
KEY = peers_key(SWARM)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TTL = 60.0


class ScriptedSigner(RecordValidatorBase):
    """The attacker's validator: signs a record with the key assigned to its subkey (None: unsigned); accepts all."""

    def __init__(self, signer_by_subkey: dict[bytes, RSAPrivateKey | None]) -> None:
        self._signers = signer_by_subkey

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        key = self._signers.get(MSGPackSerializer.loads(record.subkey))
        if key is None:
            return record.value
        # the exact bytes hivemind's RSASignatureValidator signs: msgpack of (key, subkey, value, expiration)
        signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)

    def strip_value(self, record: DHTRecord) -> bytes:
        return RSASignatureValidator._SIGNATURE_RE.sub(b"", record.value)


async def _stored(_dht: DHT, node, key: str) -> dict:
    """Runs inside a DHT process: the raw (signed) entries its local storage holds for ``key``."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None:
        return {}
    return {subkey: (item.value, item.expiration_time) for subkey, item in found.value.items()}


def stored_entries(dht: DHT) -> dict[bytes, bytes]:
    """subkey -> stored value with the signature stripped, deserialized (the bytes encode_peer_record made)."""
    raw = dht.run_coroutine(functools.partial(_stored, key=KEY))
    strip = RSASignatureValidator(RSAPrivateKey.process_wide()).strip_value
    return {
        subkey: MSGPackSerializer.loads(strip(DHTRecord(b"", b"", value, expiration)))
        for subkey, (value, expiration) in raw.items()
    }


def make_record(
    identity: Identity, *, name: str, seq: int = 1, now: float | None = None, **changes
) -> PeerRecord:
    now = get_dht_time() if now is None else now
    rec = PeerRecord(
        peer_id=identity.peer_id,
        name=name,
        state=PeerState.ONLINE,
        maddrs=["/ip4/127.0.0.1/tcp/4001"],
        profile=DeviceProfile(
            name="test cpu",
            kind=DeviceKind.CPU,
            memory_total_bytes=8 << 30,
            memory_free_bytes=4 << 30,
            tflops={"fp32": 0.2},
            measured_at=now,
        ),
        software_version="0.1.0",
        started_at=now,
        updated_at=now,
        seq=seq,
    )
    return msgspec.structs.replace(rec, **changes)


@dataclasses.dataclass
class Swarm:
    a: DHT
    b: DHT
    m: DHT
    id_a: Identity
    id_b: Identity
    attackers: dict[str, Identity]


# Each attack gets its own attacker identity so that its subkey is independent of the others.
ATTACKS = [
    "control",
    "unsigned",
    "no_owner_tag",
    "malformed",
    "oversized",
    "future",
    "far_expiration",
    "peer_id_lie",
]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("identities")
    id_a = Identity.load_or_create(tmp / "a.key")
    id_b = Identity.load_or_create(tmp / "b.key")
    attackers = {name: Identity.generate() for name in ATTACKS}
    forger = Identity.generate()
    signers: dict[bytes, RSAPrivateKey | None] = {
        att.owner_tag: att.private_key for att in attackers.values()
    }
    signers[attackers["unsigned"].owner_tag] = None
    signers[id_b.owner_tag] = forger.private_key  # "signed by another key": forging B's subkey
    dhts: list[DHT] = []
    try:
        a = DHT(
            start=True,
            host_maddrs=LOOPBACK,
            identity_path=str(id_a.path),
            record_validators=make_record_validators(id_a, SWARM),
        )
        dhts.append(a)
        initial = [str(maddr) for maddr in a.get_visible_maddrs()]
        b = DHT(
            initial_peers=initial,
            start=True,
            host_maddrs=LOOPBACK,
            identity_path=str(id_b.path),
            record_validators=make_record_validators(id_b, SWARM),
        )
        dhts.append(b)
        m = DHT(
            initial_peers=initial,
            start=True,
            host_maddrs=LOOPBACK,
            record_validators=[ScriptedSigner(signers)],
        )
        dhts.append(m)
        yield Swarm(a, b, m, id_a, id_b, attackers)
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


def test_identity_file_fixes_the_libp2p_peer_id(swarm: Swarm) -> None:
    # The binding the validator relies on: p2pd started from the identity file announces identity.peer_id.
    assert swarm.a.peer_id.to_base58() == swarm.id_a.peer_id
    assert swarm.b.peer_id.to_base58() == swarm.id_b.peer_id


def test_honest_peers_accept_own_records_and_see_each_other(swarm: Swarm) -> None:
    now = get_dht_time()
    for dht, ident, name in ((swarm.a, swarm.id_a, "a"), (swarm.b, swarm.id_b, "b")):
        raw = encode_peer_record(make_record(ident, name=name, now=now))
        dht.store(KEY, raw, now + TTL, subkey=ident.owner_tag)
    for dht in (swarm.a, swarm.b):
        assert set(stored_entries(dht)) >= {swarm.id_a.owner_tag, swarm.id_b.owner_tag}
    found = swarm.b.get(KEY, latest=True)
    records = {
        subkey: check_peer_entry(subkey, item.value, item.expiration_time, get_dht_time())
        for subkey, item in found.value.items()
    }
    assert records[swarm.id_a.owner_tag].name == "a"
    assert records[swarm.id_b.owner_tag].peer_id == swarm.id_b.peer_id


def test_honest_peer_refuses_to_store_its_own_bad_record(swarm: Swarm) -> None:
    now = get_dht_time()
    genuine = encode_peer_record(make_record(swarm.id_a, name="a", seq=2, now=now))
    swarm.a.store(KEY, genuine, now + TTL, subkey=swarm.id_a.owner_tag)
    assert stored_entries(swarm.b)[swarm.id_a.owner_tag] == genuine
    # store()'s boolean mixes every replica's answer (M says yes to anything), so look at what A and B hold
    swarm.a.store(KEY, b"\xc1 not msgpack", now + 2 * TTL, subkey=swarm.id_a.owner_tag)
    future = encode_peer_record(make_record(swarm.id_a, name="a", seq=3, now=now + 3600))
    swarm.a.store(KEY, future, now + 3600 + TTL, subkey=swarm.id_a.owner_tag)
    for honest in (swarm.a, swarm.b):
        assert stored_entries(honest)[swarm.id_a.owner_tag] == genuine


def _attack_value(swarm: Swarm, attack: str) -> tuple[bytes, object, float]:
    """(subkey, value, expiration_time) that M stores for ``attack``."""
    att = swarm.attackers[attack]
    now = get_dht_time()
    subkey, expiration = att.owner_tag, now + TTL
    value: object = encode_peer_record(make_record(att, name=attack, now=now))
    if attack == "no_owner_tag":
        subkey = b"peer:" + att.peer_id.encode()  # unprotected subkey: the RSA validator would let it through
    elif attack == "malformed":
        value = b"\x85\xa1v\x01\xa4kind\xa4peer\xa7peer_id\xc0"  # a map cut short
    elif attack == "oversized":
        # a well-formed record (unknown fields are tolerated) that is simply too big; kept under
        # 16 KiB so that the attacker's own DHT pipe survives it (see MAX_PEER_RECORD_BYTES)
        wire = peer_record_to_wire(make_record(att, name=attack, now=now))
        value = canonical_pack({**wire, "padding": "x" * MAX_PEER_RECORD_BYTES})
        assert MAX_PEER_RECORD_BYTES < len(value) < MAX_PEER_RECORD_BYTES + 1024
    elif attack == "future":
        value = encode_peer_record(make_record(att, name=attack, now=now + 3600))
        expiration = now + 3600 + TTL
    elif attack == "far_expiration":
        expiration = now + 30 * 24 * 3600  # would keep a dead peer listed for a month
    elif attack == "peer_id_lie":
        value = encode_peer_record(make_record(att, name=attack, now=now, peer_id=swarm.id_a.peer_id))
    return subkey, value, expiration


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacker_records_are_rejected_by_receivers(swarm: Swarm, attack: str) -> None:
    subkey, value, expiration = _attack_value(swarm, attack)
    swarm.m.store(KEY, value, expiration, subkey=subkey)  # returns once A and B have answered
    assert subkey in stored_entries(swarm.m)  # the attacker itself kept it: the bytes did go out
    for honest in (swarm.a, swarm.b):
        held = stored_entries(honest)
        if attack == "control":
            assert held.get(subkey) == value
        else:
            assert subkey not in held, f"{attack} record was stored"


def test_forged_update_of_someone_elses_record_is_rejected(swarm: Swarm) -> None:
    now = get_dht_time()
    genuine = encode_peer_record(make_record(swarm.id_b, name="b", seq=5, now=now))
    swarm.b.store(KEY, genuine, now + TTL, subkey=swarm.id_b.owner_tag)
    assert stored_entries(swarm.a)[swarm.id_b.owner_tag] == genuine
    # M rewrites B's subkey with a later expiration (it would win if accepted), signed by the forger's key
    forged = encode_peer_record(make_record(swarm.id_b, name="evil", seq=6, now=now, state=PeerState.OFFLINE))
    swarm.m.store(KEY, forged, now + 2 * TTL, subkey=swarm.id_b.owner_tag)
    for honest in (swarm.a, swarm.b):
        assert stored_entries(honest)[swarm.id_b.owner_tag] == genuine


def test_peers_still_serve_valid_records_after_attacks(swarm: Swarm) -> None:
    # B's record and every attack are stored here, so this holds alone as well as after the tests above
    now = get_dht_time()
    swarm.b.store(
        KEY,
        encode_peer_record(make_record(swarm.id_b, name="b", now=now)),
        now + TTL,
        subkey=swarm.id_b.owner_tag,
    )
    for attack in ATTACKS:
        subkey, value, expiration = _attack_value(swarm, attack)
        swarm.m.store(KEY, value, expiration, subkey=subkey)
    update = encode_peer_record(make_record(swarm.id_a, name="a-again", seq=9, now=now))
    # not asserting store()'s boolean: M may still hold A's subkey with a later expiration and answer False
    swarm.a.store(KEY, update, now + TTL, subkey=swarm.id_a.owner_tag)
    for honest in (swarm.a, swarm.b):
        assert stored_entries(honest)[swarm.id_a.owner_tag] == update
    found = swarm.b.get(KEY, latest=True)  # the module's 90 s timeout guards against a hang
    records = {}
    for subkey, item in found.value.items():
        records[subkey] = check_peer_entry(subkey, item.value, item.expiration_time, get_dht_time())
    assert records[swarm.id_a.owner_tag].name == "a-again"
    assert records[swarm.id_a.owner_tag].seq == 9
    assert records[swarm.id_b.owner_tag].name == "b"
    # only honest entries and the attacker's valid control record made it through
    assert set(records) == {swarm.id_a.owner_tag, swarm.id_b.owner_tag, swarm.attackers["control"].owner_tag}
