"""Field types shared by every wire schema: bounded integers, finite reals, ids, hashes, bounded text.

Bounds are part of the type (``msgspec.Meta``), so the decoder enforces them while it
reads and a schema states its limits where its fields are declared.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# Largest finite float64: ``le`` with it rejects +inf, ``ge=0`` rejects -inf and NaN.
_MAX_REAL = 1.7976931348623157e308

Count = Annotated[int, Meta(ge=0)]
"""A non-negative integer (steps, sequence numbers, byte counts); msgpack bounds it to 64 bits."""
PositiveCount = Annotated[int, Meta(ge=1, le=1 << 20)]
"""An integer from 1 to 2^20 (cores, threads)."""
Real = Annotated[float, Meta(ge=0.0, le=_MAX_REAL)]
"""A finite non-negative number; ints are accepted (other encoders may shorten 2.0 to 2)."""
PositiveReal = Annotated[float, Meta(gt=0.0, le=_MAX_REAL)]
"""A finite number > 0."""
AnyReal = Annotated[float, Meta(ge=-_MAX_REAL, le=_MAX_REAL)]
"""A finite number of either sign (losses can be negative)."""
PeerId = Annotated[str, Meta(pattern=r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")]
"""A libp2p peer id in base58."""
JobId = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
"""A job id: 32 lowercase hex digits."""
HostId = Annotated[str, Meta(pattern=r"^[0-9a-f]{16}$")]
"""An opaque machine id: 16 lowercase hex digits (``peerd.swarm.host``)."""
Hash32 = Annotated[bytes, Meta(min_length=32, max_length=32)]
"""A sha256 digest as 32 raw bytes (msgpack ``bin``)."""
Name = Annotated[str, Meta(min_length=1, max_length=256)]
"""A non-empty identifier or label of at most 256 characters."""


def text(max_chars: int, *, min_chars: int = 0) -> object:
    """A str type of ``min_chars``..``max_chars`` characters."""
    return Annotated[str, Meta(min_length=min_chars, max_length=max_chars)]


class WireStruct(msgspec.Struct):
    """Base of every wire schema; unknown fields are ignored on decode.

    Ignoring unknown fields is what "tolerant within a version" means in ``protocols/``:
    a field a schema does not declare is never covered by a hash or a signature.
    Subclasses choose ``kw_only`` / ``frozen``. A field declared ``X | None = None`` is an
    absent optional: the canonical encoder omits it when it is None.
    """


class FrozenWireStruct(msgspec.Struct, frozen=True):
    """``WireStruct``, immutable and hashable (messages whose digest is their identity).

    Subclasses repeat ``frozen=True``: mypy's dataclass_transform otherwise takes them as mutable.
    """


class ElementCosts(FrozenWireStruct, frozen=True, kw_only=True):
    """Cost per unit, beyond launch and memory traffic, of the ops ``peerd.models.launches`` names
    in ``ELEMENT_FAMILIES`` (one field each; the unit of the numbers is the containing field's)."""

    gelu: Real  # per output element of a tanh GELU or its backward
    softmax: Real  # per output element of a softmax, log-softmax or exp
    attention: Real  # per head (batch x heads) of a fused attention forward
    attention_backward: Real  # per head of its backward
