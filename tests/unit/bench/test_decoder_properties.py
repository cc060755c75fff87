"""Every decoder a peer's bytes reach, by property: a damaged valid encoding or plain noise decodes or is a typed PeerdError.

The decoders and their valid seeds are ``peerd bench fuzz``'s (``peerd.bench.fuzz_targets``);
hypothesis draws the damage (cut, flipped bits, spliced or repeated bytes, a huge length
word) and shrinks whatever escapes to a minimal input.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.bench.fuzz_targets import Target, all_targets
from peerd.errors import PeerdError

TARGETS = {t.name: t for t in all_targets()}
PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def damaged(draw: st.DrawFn, target: Target) -> bytes:
    seed = bytearray(draw(st.sampled_from(target.seeds)))
    how = draw(st.sampled_from(("cut", "flip", "splice", "huge", "noise")))
    if how == "noise":
        return draw(st.binary(max_size=512))
    at = draw(st.integers(0, len(seed)))
    if how == "cut":
        return bytes(seed[:at])
    if how == "flip":
        for bit in draw(st.lists(st.integers(0, len(seed) * 8 - 1), min_size=1, max_size=8)):
            seed[bit // 8] ^= 1 << (bit % 8)
        return bytes(seed)
    if how == "splice":
        return bytes(seed[:at]) + draw(st.binary(max_size=64)) + bytes(seed[at + draw(st.integers(0, 64)) :])
    word = draw(
        st.sampled_from(
            (b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff")
        )
    )
    return bytes(seed[:at]) + word + bytes(seed[at + len(word) :])


@pytest.mark.parametrize("name", sorted(TARGETS))
@PROPERTY
@given(data=st.data())
def test_damaged_input_decodes_or_is_a_typed_error(name: str, data: st.DataObject):
    target = TARGETS[name]
    raw = data.draw(damaged(target))
    with contextlib.suppress(PeerdError):  # a typed rejection: what a peer's garbage must give
        target.decode(raw)
