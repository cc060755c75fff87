"""The all-reduce arithmetic run through ``simulate``: exact means, identical members, bounded compressed error."""

from __future__ import annotations

import pytest
import torch

from peerd.averaging.codec import (
    GradientCompression,
    build_codec,
    decode_share,
    finite,
    parse_compressor,
)
from peerd.averaging.core import MemberMath, simulate
from peerd.compress.codecs import make_codec
from peerd.errors import CodecError, ConfigError, ErrorCode


def group(members: int, compressor: str | None) -> list[MemberMath]:
    return [MemberMath(r, members, parse_compressor(compressor)) for r in range(members)]


def inputs(members: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * (r + 1) for r in range(members)]


def rank_order_mean(flats: list[torch.Tensor]) -> torch.Tensor:
    acc = flats[0].clone()
    for f in flats[1:]:
        acc += f
    return acc / len(flats)


@pytest.mark.parametrize("members", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 5, 4099])
def test_uncompressed_result_is_the_exact_mean_on_every_member(members: int, numel: int):
    flats = inputs(members, numel)
    out = simulate(group(members, None), flats)
    expect = rank_order_mean(flats)
    for o in out:
        assert torch.equal(o, expect)  # bit for bit: fixed summation order, no compression
    torch.testing.assert_close(out[0], torch.stack(flats).mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("members", [2, 3, 4])
def test_compressed_step_is_within_the_quantizer_bound(bits: int, members: int):
    flats = inputs(members, 10_000, seed=bits)
    out = simulate(group(members, f"q{bits}"), flats)
    assert all(torch.equal(o, out[0]) for o in out)
    # absmax grid: each quantization errs by at most absmax / 2**bits (+ bf16 scale rounding);
    # a share is quantized once by each sender and once by its reducer
    peak = max(float(f.abs().max()) for f in flats)
    bound = 1.02 * 2 * peak / 2**bits
    err = float((out[0] - torch.stack(flats).mean(0)).abs().max())
    assert 0 < err <= bound


@pytest.mark.parametrize("bits", [4, 8])
def test_error_feedback_mean_over_steps_converges_to_the_true_mean(bits: int):
    members = 3
    maths = group(members, f"q{bits}")
    flats = inputs(members, 6000, seed=7)
    true = torch.stack(flats).mean(0)
    total = torch.zeros_like(true)
    errors = {}
    for t in range(1, 101):
        total += simulate(maths, flats)[0]
        errors[t] = float((total / t - true).abs().max())
    assert errors[100] < errors[1] / 30  # residuals carry the loss: error of the average ~ 1/T
    assert errors[100] < errors[10]


def test_without_feedback_the_error_does_not_average_out():
    """Control for the test above: fresh residuals every step repeat the same bias."""
    flats = inputs(3, 6000, seed=7)
    true = torch.stack(flats).mean(0)
    total = torch.zeros_like(true)
    for _ in range(100):
        total += simulate(group(3, "q4"), flats)[0]
    single = float((simulate(group(3, "q4"), flats)[0] - true).abs().max())
    assert float((total / 100 - true).abs().max()) > single / 2


def test_reducer_result_is_what_the_bytes_decode_to():
    maths = group(3, "q4")
    flats = inputs(3, 3001)
    own, frames = maths[0].contributions(flats[0])
    assert set(frames) == {1, 2} and own.numel() == 1000
    enc = maths[1].reduce([decode_share(frames[1], 1000), flats[1][1000:2000], flats[2][1000:2000]])
    assert torch.equal(enc.decoded, decode_share(enc.payload, 1000))


def test_non_finite_gradients_are_refused():
    maths = group(2, None)
    bad = torch.zeros(10)
    bad[3] = float("nan")
    with pytest.raises(CodecError) as info:
        maths[0].contributions(bad)
    assert info.value.code == ErrorCode.NON_FINITE
    with pytest.raises(CodecError):
        maths[1].reduce([bad[:5], torch.zeros(5)])


def test_decode_share_rejects_wrong_size_truncation_and_other_codecs():
    payload = build_codec(None).encode(torch.randn(10))[0]
    with pytest.raises(CodecError) as info:
        decode_share(payload, 11)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    with pytest.raises(CodecError) as info:
        decode_share(payload[:-3], 10)
    assert info.value.code == ErrorCode.TRUNCATED
    half = build_codec(None).encode(torch.randn(10).half())[0]
    with pytest.raises(CodecError) as info:
        decode_share(half, 10)
    assert info.value.code == ErrorCode.DTYPE_MISMATCH
    with pytest.raises(CodecError) as info:
        decode_share(build_codec(None).encode(torch.randn(2, 5))[0], 10)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH


@pytest.mark.parametrize(
    ("spec", "bits"),
    [(None, None), ("none", None), ("fp32", None), ("q8", 8), ("uniform4", 4), ("Q2", 2), ("int3", 3)],
)
def test_compressor_names(spec, bits):
    cfg = parse_compressor(spec)
    assert (cfg.bits if cfg else None) == bits


@pytest.mark.parametrize("spec", ["q5", "zip", "q", 8])
def test_bad_compressor_names_are_config_errors(spec):
    with pytest.raises(ConfigError):
        parse_compressor(spec)


def test_compression_config_validates():
    with pytest.raises(ConfigError):
        parse_compressor(GradientCompression(bits=8, group_size=0))


def test_raw_shares_are_the_fp32_codec_and_refuse_non_finite_values():
    x = torch.randn(1001)
    fp32 = make_codec("fp32")
    assert build_codec(None).encode(x)[0] == fp32.encode(x)[0]
    assert torch.equal(decode_share(fp32.encode(x)[0], 1001), x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[500] = bad
        assert not finite(y)
        with pytest.raises(CodecError) as info:
            fp32.encode(y)
        assert info.value.code == ErrorCode.NON_FINITE
    assert finite(x) and finite(torch.empty(0))
