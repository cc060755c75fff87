"""Error feedback as the averaging group uses it (peerd.compress's compressor on the share codecs, staged):
the residual is exactly what was lost, staged until commit, and time averages converge."""

from __future__ import annotations

import pytest
import torch

from peerd.averaging.codec import build_codec, decode_share, parse_compressor
from peerd.compress.gradient import ErrorFeedbackCompressor


class Staged(ErrorFeedbackCompressor):
    """The averaging members' configuration: share codecs, staged residuals, reshaped keys start over."""

    def encode(self, key, x, *, stage=True):
        return super().encode(key, x, stage=stage)


def feedback(name: str | None) -> ErrorFeedbackCompressor:
    return Staged(codec=build_codec(parse_compressor(name)), on_reshape="reset")


@pytest.mark.parametrize("name", ["q2", "q3", "q4", "q8"])
def test_residual_carries_exactly_what_was_lost(name: str):
    ef = feedback(name)
    g = torch.Generator().manual_seed(0)
    residual = torch.zeros(5000)
    for _ in range(5):
        x = torch.randn(5000, generator=g)
        enc = ef.encode("k", x)
        ef.commit()
        assert torch.equal(enc.decoded, decode_share(enc.payload, 5000))  # what receivers see
        new = ef.residual("k")
        assert new is not None
        # decoded + new residual == x + old residual (one rounding of the subtraction at most)
        torch.testing.assert_close(enc.decoded + new, x + residual, rtol=0, atol=1e-6)
        assert new.abs().max() > 0  # lossy codecs do lose something
        residual = new


@pytest.mark.parametrize("name", ["q4", "q8"])
def test_time_average_of_decoded_values_converges_to_the_input(name: str):
    ef = feedback(name)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    total = torch.zeros_like(x)
    errors = {}
    for t in range(1, 201):
        total += ef.encode("k", x).decoded
        ef.commit()
        if t in (1, 10, 200):
            errors[t] = float((total / t - x).abs().max())
    # sum of decoded = T*x - e_T, so the error of the average is |e_T| / T
    assert errors[10] < errors[1] / 5
    assert errors[200] < errors[1] / 100


def test_discard_keeps_residuals_and_a_retry_sends_the_same_bytes():
    ef = feedback("q4")
    g = torch.Generator().manual_seed(5)
    ef.encode("k", torch.randn(1000, generator=g))
    ef.commit()
    before = ef.residual("k").clone()
    x = torch.randn(1000, generator=g)
    first = ef.encode("k", x).payload
    ef.discard()
    assert torch.equal(ef.residual("k"), before)
    assert ef.encode("k", x).payload == first


def test_keys_are_independent_and_shape_changes_reset():
    ef = feedback("q4")
    ef.encode("a", torch.randn(100))
    ef.encode("b", torch.randn(50))
    ef.commit()
    assert ef.residual("a").shape == (100,) and ef.residual("b").shape == (50,)
    enc = ef.encode("a", torch.ones(30))  # a new layout: the old residual cannot apply
    ef.commit()
    assert ef.residual("a").shape == (30,)
    assert enc.decoded.shape == (30,)


def test_lossless_codec_keeps_no_residual_and_returns_the_input():
    ef = feedback(None)
    x = torch.randn(777)
    enc = ef.encode("k", x)
    ef.commit()
    assert torch.equal(enc.decoded, x)
    assert torch.equal(decode_share(enc.payload, 777), x)
    assert ef.residual("k") is None and ef.residual_bytes == 0


def test_state_dict_round_trip():
    ef = feedback("q8")
    ef.encode("k", torch.randn(64))
    ef.commit()
    other = feedback("q8")
    other.load_state_dict(ef.state_dict())
    x = torch.randn(64)
    assert other.encode("k", x).payload == ef.encode("k", x).payload
