"""Uniform quantizers: error at each width, tiny and huge magnitudes, grids, rounding, layouts, registry, bad input."""

from __future__ import annotations

import pytest
import torch

from peerd.compress import QuantConfig, TensorCodec, codec_names, make_codec, register_codec
from peerd.compress.codecs import UniformCodec
from peerd.compress.quant import dequantize_into, levels
from peerd.errors import CodecError, ConfigError, ErrorCode
from peerd.loading import from_mapping

# The reference implementation's measured relative L2 errors (direct, 1024 rows, Gaussian).
REFERENCE_ERROR = {2: 0.50, 3: 0.25, 4: 0.125}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def gauss() -> torch.Tensor:
    return torch.randn(1024, 512, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_error_below_reference(gauss: torch.Tensor, bits: int):
    codec = make_codec(f"q{bits}")
    data, recon = codec.encode(gauss, reconstruct=True)
    err = _rel(codec.decode(data), gauss)
    assert err <= REFERENCE_ERROR[bits] * 0.9, err  # rms clipping: 0.35 / 0.19 / 0.11
    assert err >= REFERENCE_ERROR[bits] * 0.6  # and not a fluke of the measurement
    assert torch.equal(recon, codec.decode(data))
    wire_bits = 8 * len(data) / gauss.numel()
    assert bits < wire_bits < bits + 0.04  # bf16 scale per channel: 16 / 1024 rows


def test_eight_bit_and_absmax_bound(gauss: torch.Tensor):
    for bits in (2, 3, 4, 8):
        codec = make_codec("uniform", QuantConfig(bits=bits, scale="absmax"))
        data, _ = codec.encode(gauss)
        frame_scales = codec.quantize(gauss).scales  # s = step / 2 on the symmetric grid
        err = (codec.decode(data) - gauss).abs()
        assert bool((err <= frame_scales.view(1, -1) * 1.0001).all())  # |error| <= step / 2, nothing clipped
    assert _rel(make_codec("q8").decode(make_codec("q8").encode(gauss)[0]), gauss) < 0.01


@pytest.mark.parametrize("magnitude", [1e-33, 1e-20, 1e-8, 1.0, 1e8, 1e20, 1e37])
@pytest.mark.parametrize("layout", ["channel", "group"])
def test_relative_error_is_flat_over_magnitudes(gauss: torch.Tensor, magnitude: float, layout: str):
    """The reference's absolute epsilon destroys tensors below ~1e-5; relative scales must not."""
    x = gauss[:256] * magnitude
    codec = make_codec("q4", QuantConfig(layout=layout))
    assert 0.08 < _rel(codec.decode(codec.encode(x)[0]), x) < 0.13


def test_below_tiny_is_exact_zero():
    x = torch.tensor([[1e-36, 0.0], [-1e-36, 0.0]])
    codec = make_codec("q4")
    assert torch.equal(codec.decode(codec.encode(x)[0]), torch.zeros(2, 2))


def test_zero_grid_keeps_zeros_symmetric_grid_has_no_zero():
    x = torch.zeros(8, 4)
    x[0] = 1.0
    zero = make_codec("q2", QuantConfig(symmetric=False, scale="absmax"))
    assert torch.equal(zero.decode(zero.encode(x)[0])[1:], torch.zeros(7, 4))
    sym = make_codec("q2", QuantConfig(symmetric=True, scale="absmax"))
    assert bool((sym.decode(sym.encode(x)[0])[1:].abs() > 0).all())


def test_stochastic_rounding_is_unbiased_nearest_is_not():
    x = torch.linspace(-1, 1, 64).repeat(16, 1)  # (16, 64): every column has the same values
    gen = torch.Generator().manual_seed(1)
    sto = UniformCodec(
        QuantConfig(bits=2, scale="absmax", rounding="stochastic", layout="group", group_size=64), gen
    )
    near = make_codec("q2", QuantConfig(scale="absmax", layout="group", group_size=64))
    mean = torch.zeros_like(x)
    for _ in range(400):
        mean += sto.decode(sto.encode(x)[0]) / 400
    bias_sto = float((mean - x).abs().mean())
    bias_near = float((near.decode(near.encode(x)[0]) - x).abs().mean())
    assert bias_sto < 0.03 < bias_near


def test_group_layout_with_short_last_group():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    x[960:] *= 1000  # the short last group (40 elements) gets its own scale
    codec = make_codec("q4", QuantConfig(layout="group", group_size=64))
    y = codec.decode(codec.encode(x)[0])
    assert _rel(y[:960], x[:960]) < 0.13 and _rel(y[960:], x[960:]) < 0.16  # 40 values: noisier


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_decode_to_their_dtype(dtype: torch.dtype):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    for name in ("q4", "fp16", "bf16", "fp32"):
        codec = make_codec(name)
        y = codec.decode(codec.encode(x)[0])
        assert y.dtype == dtype and y.shape == x.shape
        assert _rel(y, x) < 0.13


def test_reconstruction_is_one_rounding_of_an_exact_product():
    """m + k*s must equal the correctly rounded sum: no double rounding, so every device agrees."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, 64, generator=gen) * 3
    for scale_dtype in ("bfloat16", "float32"):
        cfg = QuantConfig(bits=8, scale_dtype=scale_dtype)
        q = UniformCodec(cfg).quantize(x)
        k = levels(q.codes, 8, True)
        exact = k.double().view(256, 64) * q.scales.double().view(1, 64)
        assert torch.equal(exact.float().double(), exact)  # every product exact in float32
        m = torch.randn(256, 64, generator=gen)
        want = (m.double() + exact).float()
        got = dequantize_into(m.clone(), k, q.scales, cfg, add=1.0)
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["q2", "q8", "fp32", "bf16"])
def test_non_finite_input_is_refused(bad: float, name: str):
    x = torch.ones(4, 4)
    x[2, 1] = bad
    with pytest.raises(CodecError) as info:
        make_codec(name).encode(x)
    assert info.value.code == ErrorCode.NON_FINITE


def test_float16_overflow_is_refused_not_sent_as_inf():
    with pytest.raises(CodecError) as info:
        make_codec("fp16").encode(torch.tensor([1e6]))
    assert info.value.code == ErrorCode.NON_FINITE


def test_bad_bits_names_and_dtypes():
    with pytest.raises(CodecError) as info:
        make_codec("uniform", QuantConfig(bits=5))
    assert info.value.code == ErrorCode.UNSUPPORTED_BITS
    with pytest.raises(ConfigError) as cinfo:
        from_mapping(QuantConfig, {"bits": 6})
    assert cinfo.value.field == "bits"
    with pytest.raises(CodecError) as info:
        make_codec("q5")
    assert info.value.code == ErrorCode.UNKNOWN_CODEC
    with pytest.raises(CodecError) as info:
        make_codec("q4").encode(torch.ones(3, dtype=torch.int64))
    assert info.value.code == ErrorCode.DTYPE_MISMATCH
    with pytest.raises(CodecError) as info:
        make_codec("q4").encode(torch.ones(3, 2), ids=[1, 2])
    assert info.value.code == ErrorCode.SHAPE_MISMATCH


def test_registry_by_name():
    assert {"fp32", "fp16", "bf16", "uniform", "q2", "q3", "q4", "q8"} <= set(codec_names())
    assert make_codec("q3", QuantConfig(bits=8)).cfg.bits == 3  # the name fixes the width

    class Halver(TensorCodec):
        def encode(self, x, *, ids=(), seed=False, reconstruct=False):
            return make_codec("fp32").encode(x / 2, ids=ids, seed=seed, reconstruct=reconstruct)

    register_codec("test-halver")(lambda q: Halver())
    codec = make_codec("test-halver")
    assert codec.name == "test-halver"
    assert torch.equal(codec.decode(codec.encode(torch.tensor([2.0]))[0]), torch.tensor([1.0]))
    with pytest.raises(ValueError):
        register_codec("test-halver")(lambda q: Halver())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_encode_matches_cpu_decode():
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(5))
    for name in ("q2", "q3", "q4", "q8"):
        codec = make_codec(name)
        data_gpu, recon_gpu = codec.encode(x.cuda(), reconstruct=True)
        y_cpu = codec.decode(data_gpu)
        assert torch.equal(recon_gpu.cpu(), y_cpu)
        assert torch.equal(codec.decode(data_gpu, device="cuda").cpu(), y_cpu)
