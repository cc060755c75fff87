"""The swarm-secret MAC on DHT records: members' records pass, everything forged, replayed or keyless fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord

from peerd.config import DaemonConfig
from peerd.errors import ConfigError
from peerd.loading import from_mapping
from peerd.swarm.access import SwarmSecretValidator, access_validators
from peerd.swarm.identity import Identity
from peerd.swarm.secret import load_swarm_secret

SECRET = b"correct horse battery staple 42"
IDENTITY = Identity.generate()


def composite(secret: bytes | None, swarm: str = "s") -> CompositeValidator:
    validators = [RSASignatureValidator(IDENTITY.private_key)]
    if secret is not None:
        validators.append(SwarmSecretValidator(secret, swarm))
    return CompositeValidator(validators)


def signed(by: CompositeValidator, **changes) -> DHTRecord:
    record = DHTRecord(
        key=b"\x01" * 20, subkey=b"\xc4\x03abc", value=b"\x93\x01\x02\x03", expiration_time=1e9 + 5
    )
    record = dataclasses.replace(record, **changes)
    return dataclasses.replace(record, value=by.sign_value(record))


def test_a_members_record_validates_and_strips_back_to_its_value():
    member = composite(SECRET)
    record = signed(member)
    assert record.value.endswith(b"]") and b"[swarm-mac:" in record.value
    assert member.validate(record)
    assert member.strip_value(record) == b"\x93\x01\x02\x03"


def test_records_without_the_secret_or_with_another_are_rejected():
    member = composite(SECRET)
    assert not member.validate(signed(composite(None)))  # a stranger: no MAC at all
    assert not member.validate(signed(composite(b"another secret, also long")))
    assert not member.validate(signed(composite(SECRET, swarm="other")))  # the same secret, another swarm


@pytest.mark.parametrize(
    "change",
    [
        {"key": b"\x02" * 20},  # replayed under another key
        {"subkey": b"\xc4\x03xyz"},  # ... another subkey
        {"expiration_time": 1e9 + 500},  # ... with a later expiration
    ],
)
def test_a_members_mac_does_not_fit_any_other_record(change):
    member = composite(SECRET)
    record = signed(member)
    assert not member.validate(dataclasses.replace(record, **change))


def test_a_tampered_value_is_rejected():
    member = composite(SECRET)
    record = signed(member)
    flipped = bytearray(record.value)
    flipped[1] ^= 1
    assert not member.validate(dataclasses.replace(record, value=bytes(flipped)))
    assert not member.validate(dataclasses.replace(record, value=record.value[:-3]))  # truncated MAC


def test_secret_files_are_checked_naming_the_field(tmp_path: Path):
    good = tmp_path / "swarm.secret"
    good.write_bytes(b"  " + SECRET + b"\n")
    assert load_swarm_secret(good) == SECRET  # whitespace around it is not part of it
    short = tmp_path / "short.secret"
    short.write_text("hunter2")
    for path, words in [(short, "at least 16"), (tmp_path / "missing", "cannot read")]:
        with pytest.raises(ConfigError) as info:
            load_swarm_secret(path)
        assert info.value.field == "swarm_secret_file" and words in str(info.value)
    problems = DaemonConfig(swarm_secret_file=short).problems()
    assert [p.field for p in problems] == ["swarm_secret_file"]
    assert access_validators(None, "s") == []
    assert isinstance(access_validators(good, "s")[0], SwarmSecretValidator)


@pytest.mark.parametrize(("access", "words"), [("open", "open (no swarm secret"), ("secret", "members only")])
def test_status_says_whether_the_swarm_is_open(access, words):
    from rich.console import Console

    from peerd.cli.render import render_status

    me = {"name": "p", "state": "online", "swarm": "s", "peer_id": "Qm", "access": access}
    console = Console(width=200, record=True)
    console.print(render_status({"self": me, "peers": [], "links": []}))
    assert words in console.export_text()


def test_the_allowlist_takes_only_records_owned_by_listed_peers():
    from hivemind.utils import MSGPackSerializer

    from peerd.swarm.access import PeerAllowlistValidator, access_mode

    other = Identity.generate()
    allow = PeerAllowlistValidator([IDENTITY.peer_id])
    member = CompositeValidator([RSASignatureValidator(IDENTITY.private_key), allow])

    def owned_by(identity: Identity) -> DHTRecord:
        subkey = MSGPackSerializer.dumps(identity.owner_tag)
        return DHTRecord(key=b"\x01" * 20, subkey=subkey, value=b"\x01", expiration_time=1e9)

    listed = dataclasses.replace(owned_by(IDENTITY), value=member.sign_value(owned_by(IDENTITY)))
    assert member.validate(listed) and allow.validate(listed)
    assert not allow.validate(owned_by(other))  # a stranger's record, whatever its signature
    assert not allow.validate(dataclasses.replace(listed, subkey=b"\xc4\x03abc"))  # nobody's record
    forged_tag = MSGPackSerializer.dumps(b"[owner:ssh-rsa " + b"A" * 200 + b"]")
    assert not allow.validate(dataclasses.replace(listed, subkey=forged_tag))  # a tag with no valid key
    assert [type(v) for v in access_validators(None, "s", [IDENTITY.peer_id])] == [PeerAllowlistValidator]
    assert access_validators(None, "s", []) == []
    assert [access_mode(None), access_mode(None, ["x"]), access_mode("f"), access_mode("f", ["x"])] == [
        "open",
        "allowlist",
        "secret",
        "secret+allowlist",
    ]


def test_allowed_peers_must_be_peer_ids():
    with pytest.raises(ConfigError) as info:
        from_mapping(DaemonConfig, {"allowed_peers": [IDENTITY.peer_id, "not a peer id"]})
    assert "allowed_peers[1]" in str(info.value)
