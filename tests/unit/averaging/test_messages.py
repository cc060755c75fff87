"""Averaging headers: tolerant parsing within a version, typed errors, checks against what the receiver knows."""

from __future__ import annotations

import pytest

from peerd.averaging.messages import KIND_PART, KIND_SHARE, AvgMessage, Expect, check, parse
from peerd.errors import ErrorCode, ProtocolError

PART = AvgMessage(KIND_PART, "00112233aabbccdd", 7, 1, 0, 1000, "ffeeddccbbaa9988")


def test_round_trip_and_unknown_fields_are_ignored():
    assert PART.header() == {
        "kind": KIND_PART, "v": 1, "group": PART.group, "step": 7, "src": 1, "share": 0, "total": 1000,
        "layout": PART.layout,
    }  # fmt: skip
    header = PART.header() | {"future_field": [1, 2]}
    assert parse(header, KIND_PART) == PART


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"kind": "avg.nope"}, ErrorCode.UNKNOWN_KIND),
        ({"v": 2}, ErrorCode.UNSUPPORTED_VERSION),
        ({"v": "1"}, ErrorCode.MALFORMED),
        ({"kind": KIND_SHARE}, ErrorCode.MALFORMED),
        ({"step": "7"}, ErrorCode.MALFORMED),
        ({"step": True}, ErrorCode.MALFORMED),
        ({"step": -1}, ErrorCode.MALFORMED),
        ({"group": 5}, ErrorCode.MALFORMED),
        ({"total": None}, ErrorCode.MALFORMED),
        ({"src": 1.0}, ErrorCode.MALFORMED),
        ({"group": ""}, ErrorCode.MALFORMED),
        ({"layout": "x" * 300}, ErrorCode.MALFORMED),
    ],
)
def test_bad_headers_raise_their_code(change, code):
    with pytest.raises(ProtocolError) as info:
        parse(PART.header() | change, KIND_PART)
    assert info.value.code == code


def test_missing_field_is_malformed():
    header = PART.header()
    del header["layout"]
    with pytest.raises(ProtocolError) as info:
        parse(header, KIND_PART)
    assert info.value.code == ErrorCode.MALFORMED


def test_share_answer_must_come_from_its_reducer():
    share = AvgMessage(KIND_SHARE, PART.group, 7, 2, 2, 1000, PART.layout)
    assert parse(share.header(), KIND_SHARE) == share
    with pytest.raises(ProtocolError):
        parse(share.header() | {"src": 1}, KIND_SHARE)


@pytest.mark.parametrize(
    ("expect", "code"),
    [
        (Expect("0000000000000000"), ErrorCode.NOT_ALLOWED),
        (Expect(PART.group, src=2), ErrorCode.NOT_ALLOWED),
        (Expect(PART.group, share=1), ErrorCode.MALFORMED),
        (Expect(PART.group, step=8), ErrorCode.WRONG_STEP),
        (Expect(PART.group, total=999), ErrorCode.SHAPE_MISMATCH),
        (Expect(PART.group, layout="0" * 16), ErrorCode.SHAPE_MISMATCH),
    ],
)
def test_check_names_the_first_differing_field(expect, code):
    with pytest.raises(ProtocolError) as info:
        check(PART, expect)
    assert info.value.code == code


def test_check_passes_matching_fields():
    check(PART, Expect(PART.group, src=1, share=0, step=7, total=1000, layout=PART.layout))


def test_the_stream_hello_names_group_and_epoch():
    from peerd.averaging.messages import KIND_HELLO, hello, parse_hello

    assert parse_hello(hello("g" * 16, 4).header(), "g" * 16, 4).epoch == 4
    cases = {
        "another group": (hello("h" * 16, 4).header(), ErrorCode.NOT_ALLOWED),
        "older epoch": (hello("g" * 16, 3).header(), ErrorCode.STALE),
        "newer epoch": (hello("g" * 16, 5).header(), ErrorCode.FROM_FUTURE),
        "no hello": ({"kind": "avg.part", "v": 1}, ErrorCode.NOT_ALLOWED),
        "bad epoch": ({"kind": KIND_HELLO, "v": 1, "group": "g" * 16, "epoch": -2}, ErrorCode.MALFORMED),
    }
    for name, (header, code) in cases.items():
        with pytest.raises(ProtocolError) as info:
            parse_hello(header, "g" * 16, 4)
        assert info.value.code == code, name
