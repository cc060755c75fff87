"""Gradient compression with error feedback: the error does not accumulate; residuals per key, staged or not; bad input."""

from __future__ import annotations

import pytest
import torch

from peerd.compress import DeltaEncoder, ErrorFeedbackCompressor, GradCompressionConfig, QuantConfig
from peerd.errors import CodecError, ErrorCode

Q2 = QuantConfig(bits=2, layout="group", group_size=64, scale="absmax")


def test_sum_of_sent_is_sum_of_inputs_minus_last_residual():
    gen = torch.Generator().manual_seed(0)
    comp = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2))
    sent = torch.zeros(1000, dtype=torch.float64)
    true = torch.zeros(1000, dtype=torch.float64)
    for _ in range(50):
        g = torch.randn(1000, generator=gen)
        sent += comp.decompress(comp.compress("w", g)).double()
        true += g.double()
    residual = comp.residual("w")
    assert residual is not None
    assert torch.allclose(sent + residual.double(), true, atol=1e-4)
    assert float(residual.norm()) < 0.5 * float(torch.randn(1000, generator=gen).norm())  # bounded


def test_time_averaged_error_vanishes_only_with_feedback():
    g = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    errs = {}
    for feedback in (True, False):
        comp = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2, error_feedback=feedback))
        mean = torch.zeros_like(g)
        for _ in range(100):
            mean += comp.decompress(comp.compress("w", g)) / 100
        errs[feedback] = float((mean - g).norm() / g.norm())
    assert errs[True] < 0.02 < 0.3 < errs[False]


def test_residuals_are_per_key_and_checkpointable():
    comp = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2))
    a, b = torch.randn(300), torch.randn(7, 9)
    a_before = a.clone()
    comp.compress("a", a)
    comp.compress("b", b)
    comp.compress("a", a)
    assert torch.equal(a, a_before)  # inputs are never written
    assert comp.residual("a").shape == a.shape and comp.residual("b").shape == b.shape
    assert comp.residual_bytes == 4 * (300 + 63)
    other = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2))
    other.load_state_dict(comp.state_dict())
    assert comp.compress("a", a) == other.compress("a", a)  # same residual -> same bytes
    with pytest.raises(CodecError) as info:
        comp.compress("a", torch.randn(301))
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    comp.reset("a")
    comp.compress("a", torch.randn(301))
    comp.reset()
    assert comp.residual("b") is None


def test_non_finite_gradient_is_refused_and_residual_kept():
    comp = ErrorFeedbackCompressor()
    comp.compress("w", torch.randn(512))
    before = comp.residual("w").clone()
    bad = torch.randn(512)
    bad[5] = float("inf")
    with pytest.raises(CodecError) as info:
        comp.compress("w", bad)
    assert info.value.code == ErrorCode.NON_FINITE
    assert torch.equal(comp.residual("w"), before)


def test_decompress_refuses_delta_frames():
    packet = DeltaEncoder().encode(torch.randn(1, 4, 8), [0])
    delta_frame = ErrorFeedbackCompressor().compress("w", torch.randn(3))  # a plain frame decodes
    assert ErrorFeedbackCompressor.decompress(delta_frame).shape == (3,)
    with pytest.raises(CodecError):
        ErrorFeedbackCompressor.decompress(packet)  # a packet is not a frame


def test_default_is_8_bit_groups_with_tiny_gradients():
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(2)) * 1e-12
    comp = ErrorFeedbackCompressor()
    data = comp.compress("w", g)
    assert 8 < 8 * len(data) / g.numel() < 8.1
    assert float((comp.decompress(data) - g).norm() / g.norm()) < 0.01


def test_staged_residuals_wait_for_commit_and_discard_keeps_the_old_ones():
    gen = torch.Generator().manual_seed(4)
    staged = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2))
    direct = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2))
    for _ in range(3):
        g = torch.randn(500, generator=gen)
        first = staged.encode("w", g, stage=True)
        before = None if staged.residual("w") is None else staged.residual("w").clone()
        staged.discard()  # the group step failed: the retry sends the same bytes
        assert (staged.residual("w") is None) == (before is None)
        retry = staged.encode("w", g, stage=True)
        assert retry.payload == first.payload and torch.equal(retry.decoded, first.decoded)
        staged.commit()
        # staging changes when a residual counts, never its value
        assert direct.compress("w", g) == first.payload
        assert torch.equal(staged.residual("w"), direct.residual("w"))
        assert torch.equal(direct.decompress(first.payload), first.decoded)


def test_reshape_policy_and_the_announced_dtype():
    comp = ErrorFeedbackCompressor(GradCompressionConfig(quant=Q2), on_reshape="reset")
    comp.compress("w", torch.randn(100))
    comp.compress("w", torch.randn(60))  # a new layout: the old residual is dropped, not an error
    assert comp.residual("w").shape == (60,)
    g = torch.randn(256).to(torch.bfloat16)
    assert comp.decompress(comp.compress("b", g)).dtype == torch.bfloat16  # the frame says what came in
    assert comp.residual("b").dtype == torch.float32
