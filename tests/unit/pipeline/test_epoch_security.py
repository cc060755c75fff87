"""Epoch admission of pipeline streams, pure part: ``check_epoch`` and the ``pp.hello`` schema."""

from __future__ import annotations

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.pipeline.frames import KIND_HELLO, Hello, check_epoch, control_header, parse_control


def test_only_the_receivers_own_epoch_passes():
    check_epoch(4, 4)
    with pytest.raises(ProtocolError) as old:
        check_epoch(3, 4)
    with pytest.raises(ProtocolError) as new:
        check_epoch(5, 4)
    assert old.value.code == ErrorCode.STALE and "epoch 3" in old.value.message
    assert new.value.code == ErrorCode.FROM_FUTURE


def test_hello_round_trips_and_bad_epochs_are_malformed():
    assert parse_control(control_header(Hello(9))) == Hello(9)
    for epoch in (-1, "3", None, True, 1.5):
        with pytest.raises(ProtocolError) as info:
            parse_control({"kind": KIND_HELLO, "v": 1, "epoch": epoch})
        assert info.value.code == ErrorCode.MALFORMED, epoch
    with pytest.raises(ProtocolError) as info:
        parse_control({"kind": KIND_HELLO, "v": 1})
    assert info.value.code == ErrorCode.MALFORMED
