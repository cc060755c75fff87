"""Real hivemind DHTs on loopback: honest peers reject forged, malformed, oversized and future-dated peer records.

The last test does the same against running daemons (``peerd join``): an attacker DHT writes
forged, replayed, stale and future-dated peer and job records into their swarm with the
DHT API; none of them reaches a daemon's tables, and every daemon counts them
(``peerd status``: ``refusals``).

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
from pathlib import Path

import msgspec
import pytest
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peerd.jobs.records import JobIndex, decode_job, encode_index, encode_job, new_job_record
from peerd.jobs.spec import load_job_spec
from peerd.swarm.identity import Identity, check_peer_entry, make_record_validators
from peerd.swarm.keys import job_key, jobs_key, peers_key
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

    def __init__(self, signer_by_subkey: dict[bytes, RSAPrivateKey | bytes | None]) -> None:
        self._signers = signer_by_subkey  # bytes: a captured "[signature:...]" appended as it is (a replay)

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        key = self._signers.get(MSGPackSerializer.loads(record.subkey))
        if key is None:
            return record.value
        if isinstance(key, bytes):
            return record.value + key
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


# ---------------------------------------------------------------- against running daemons

ROUNDS = 5  # records of each kind the attacker writes
SPEC = Path(__file__).resolve().parents[2] / "configs" / "jobs" / "gpt-tiny-demo.yaml"


def _job(owner: str, swarm_name: str, nonce: int, now: float, **changes) -> bytes:
    spec = load_job_spec(SPEC)
    rec = new_job_record(
        owner,
        swarm_name,
        spec,
        nonce.to_bytes(16, "big"),
        now=now,
        epoch0_start=now + 3600,  # never planned while the test runs
        timing=spec.planning.timing(),
    )
    return encode_job(msgspec.structs.replace(rec, **changes))


@pytest.mark.timeout(300)
def test_forged_replayed_stale_and_future_records_never_reach_running_daemons(
    local_swarm, wait_until
) -> None:
    swarm = local_swarm(2)
    m0, m1 = swarm.peers
    swarm_name = m0.status()["self"]["swarm"]
    key = peers_key(swarm_name)
    wait_until(lambda: m1.info.peer_id in _names(m0), 60, "the daemons to list each other")
    id0, id1 = (Identity.load_or_create(p.home / "identity.key") for p in (m0, m1))
    assert (id0.peer_id, id1.peer_id) == (m0.info.peer_id, m1.info.peer_id)
    stale, future, jobbers = ([Identity.generate() for _ in range(ROUNDS)] for _ in range(3))
    control, forger = Identity.generate(), Identity.generate()
    signers: dict[bytes, RSAPrivateKey | bytes | None] = {
        i.owner_tag: i.private_key for i in (*stale, *future, *jobbers, control)
    }
    signers[id1.owner_tag] = forger.private_key  # peer1's subkey, signed by another key
    before = {p.name: p.status()["refusals"] for p in (m0, m1)}
    attacker = DHT(
        initial_peers=list(m0.info.maddrs),
        start=True,
        host_maddrs=LOOPBACK,
        record_validators=[ScriptedSigner(signers)],
    )
    try:
        now = get_dht_time()
        # the positive control: a valid record of a fresh identity does reach the daemons
        attacker.store(
            key,
            encode_peer_record(make_record(control, name="control", now=now)),
            now + 60,
            subkey=control.owner_tag,
        )
        wait_until(lambda: control.peer_id in _names(m0), 30, "the attacker's valid record to be listed")
        # replay: peer0's own signed record as the attacker holds it, re-stored with a later expiration
        held = wait_until(
            lambda: attacker.run_coroutine(functools.partial(_stored, key=key)).get(id0.owner_tag),
            30,
            "peer0's record to be replicated to the attacker",
        )
        value, expiration = held
        signers[id0.owner_tag] = RSASignatureValidator._SIGNATURE_RE.search(value).group(0)
        genuine = MSGPackSerializer.loads(RSASignatureValidator._SIGNATURE_RE.sub(b"", value))
        job_ids = []
        for i in range(ROUNDS):
            now = get_dht_time()
            forged = make_record(id1, name=f"evil{i}", seq=10**6 + i, now=now, state=PeerState.OFFLINE)
            attacker.store(key, encode_peer_record(forged), now + 60 + i, subkey=id1.owner_tag)
            attacker.store(key, genuine, expiration + 60 + i, subkey=id0.owner_tag)
            old = make_record(stale[i], name=f"stale{i}", now=now - 3600)
            attacker.store(key, encode_peer_record(old), now + 60, subkey=stale[i].owner_tag)
            ahead = make_record(future[i], name=f"future{i}", now=now + 3600)
            attacker.store(key, encode_peer_record(ahead), now + 3660, subkey=future[i].owner_tag)
            # jobs: one claiming to be peer0's, one dated an hour ahead, both listed in the attacker's index
            j = jobbers[i]
            not_mine = _job(id0.peer_id, swarm_name, i, now)
            ahead_job = _job(j.peer_id, swarm_name, i, now, updated_at=now + 3600)
            ids = [decode_job(not_mine).job_id, decode_job(ahead_job).job_id]
            for job_id, raw in zip(ids, (not_mine, ahead_job), strict=True):
                attacker.store(job_key(job_id), raw, now + 60, subkey=j.owner_tag)
            index = encode_index(JobIndex(j.peer_id, tuple(ids), now))
            attacker.store(jobs_key(swarm_name), index, now + 60, subkey=j.owner_tag)
            job_ids += ids

        def moved(peer) -> dict[str, int]:
            now_, then = peer.status()["refusals"], before[peer.name]
            return {
                f"{layer}.{code}": n - then[layer].get(code, 0)
                for layer in ("dht_records", "job_records")
                for code, n in now_[layer].items()
            }

        expected = {
            "dht_records.BAD_SIGNATURE": 2 * ROUNDS,  # forged and replayed
            "dht_records.STALE": ROUNDS,
            "dht_records.FROM_FUTURE": ROUNDS,
            "job_records.NOT_OWNER": ROUNDS,
            "job_records.FROM_FUTURE": ROUNDS,
        }
        for peer in (m0, m1):
            wait_until(
                lambda p=peer: all(moved(p).get(k, 0) >= n for k, n in expected.items()),
                60,
                f"{peer.name} to count every kind of record it refused",
                detail=lambda p=peer: str(moved(p)),
            )
        views = {p.name: p.status() for p in (m0, m1)}
        jobs = {p.name: {j["job_id"] for j in p.control().call("jobs")} for p in (m0, m1)}
    finally:
        attacker.shutdown()
    attackers = {i.peer_id for i in (*stale, *future, *jobbers)}
    for name, view in views.items():
        table = {p["peer_id"]: p for p in view["peers"]}
        assert not attackers & set(table), (name, table.keys())
        assert table[id1.peer_id]["name"] == "peer1" and table[id1.peer_id]["state"] == "online"
        assert table[id0.peer_id]["name"] == "peer0"
        assert not set(job_ids) & jobs[name], name
    print(f"RECORDS refused per daemon: { {p.name: moved(p) for p in (m0, m1)} }")


def _names(peer) -> set[str]:
    return {p["peer_id"] for p in peer.status()["peers"]}
