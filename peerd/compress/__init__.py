"""Quantizers, the AC-SGD activation-delta codec and gradient compression with error feedback (pure torch).

- ``make_codec(name, QuantConfig)``: stateless codecs by name (``fp32``/``fp16``/``bf16`` raw,
  ``q2``/``q3``/``q4``/``q8``/``uniform`` quantized); backward gradients use one directly.
- ``DeltaEncoder`` / ``DeltaDecoder``: the two ends of one AC-SGD boundary (per-example buffers,
  ``state_dict``/``load_state_dict`` for checkpoints).
- ``ErrorFeedbackCompressor``: ``compress(key, tensor) -> bytes`` / ``encode`` (bytes + what receivers
  decode) with per-key residuals, applied at once or staged (``stage=True``, then ``commit``/``discard``:
  the averaging layer's group steps).
- ``LoopbackHook``: a boundary hook for in-process pipelines that goes through real bytes.
Wire format: protocols/compressed-tensor.md.
"""

from peerd.compress.buffers import BufferConfig, BufferStats, BufferStore
from peerd.compress.codecs import (
    RawCodec,
    TensorCodec,
    UniformCodec,
    codec_names,
    decode_frame,
    make_codec,
    register_codec,
)
from peerd.compress.delta import DeltaConfig, DeltaDecoder, DeltaEncoder
from peerd.compress.gradient import ErrorFeedbackCompressor, GradCompressionConfig
from peerd.compress.loopback import BoundaryStats, LoopbackHook
from peerd.compress.quant import QuantConfig
from peerd.compress.wire import parse_frame, parse_packet

__all__ = [
    "BoundaryStats",
    "BufferConfig",
    "BufferStats",
    "BufferStore",
    "DeltaConfig",
    "DeltaDecoder",
    "DeltaEncoder",
    "ErrorFeedbackCompressor",
    "GradCompressionConfig",
    "LoopbackHook",
    "QuantConfig",
    "RawCodec",
    "TensorCodec",
    "UniformCodec",
    "codec_names",
    "decode_frame",
    "make_codec",
    "parse_frame",
    "parse_packet",
    "register_codec",
]
