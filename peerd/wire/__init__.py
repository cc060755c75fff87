"""peerd's one wire layer: typed schemas, one canonical msgpack encoder, one bounded decoder.

Every record, consensus message, frame header, averaging message and job record is a
``msgspec.Struct`` declared once, next to the code that owns the concept, from the field
types in ``peerd.wire.types``. ``peerd.wire.codec`` turns them into bytes and back.

Why msgspec and not pydantic (which validates peerd's config files): msgspec decodes
msgpack straight into typed objects in one C pass, checks declared container lengths
against the bytes that are actually there before it allocates, rejects ``nil``, ``bool``
for ``int`` and other wrong types without coercion, and names the failing field (``$.a.b``);
its encoder writes struct fields and map keys in sorted order and floats as float64,
which is the canonical form the signatures and the byte-exact vectors in ``protocols/``
are defined on. Config files need every error at once for a human to fix, which is what
pydantic gives; a hostile peer needs the first error, fast, and nothing allocated for it.
"""

from peerd.wire.codec import (
    Schema,
    canonical_pack,
    check_envelope,
    convert,
    decode_map,
    decode_value,
    sha256,
    to_builtin,
)
from peerd.wire.types import FrozenWireStruct, WireStruct

__all__ = [
    "FrozenWireStruct",
    "Schema",
    "WireStruct",
    "canonical_pack",
    "check_envelope",
    "convert",
    "decode_map",
    "decode_value",
    "sha256",
    "to_builtin",
]
