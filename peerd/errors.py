"""Error policy: one error-code enum shared by the wire protocol and every exception peerd raises.

- ``ConfigError`` — bad user input (job spec, scenario, CLI values); names the offending field.
- ``ProtocolError`` — a remote message or record that is malformed, forged, stale or not allowed.
- ``PeerUnavailable`` — a remote peer did not answer within its deadline.
- ``CodecError`` — a compressed tensor that cannot be decoded faithfully.
- ``InfeasibleError`` — no allocation satisfies the constraints (e.g. memory).
``assert`` is reserved for internal invariants. Codes are part of the wire protocol
(``protocols/error-codes.md``): never renumber, only add.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    # 1xx: the bytes themselves
    MALFORMED = 100  # not decodable: bad msgpack, wrong types, missing required fields
    UNSUPPORTED_VERSION = 101  # a protocol version this peer does not speak
    UNKNOWN_KIND = 102  # message kind not defined in this version
    OVERSIZED = 103  # larger than the limit for its kind
    TRUNCATED = 104  # payload shorter than its header announces
    # 2xx: authenticity and freshness
    BAD_SIGNATURE = 200  # missing signature, or signed by a key other than the claimed owner
    NOT_OWNER = 201  # the caller may not modify this object (e.g. cancel someone else's job)
    STALE = 202  # older than allowed (expired TTL, superseded sequence number)
    FROM_FUTURE = 203  # timestamp further ahead than the allowed clock skew
    NOT_ALLOWED = 204  # caller is authenticated but not permitted here (not an allocated neighbour)
    # 3xx: peers and time
    PEER_UNAVAILABLE = 300  # peer unreachable or did not answer
    TIMEOUT = 301  # a deadline passed while waiting
    BUSY = 302  # peer is up but refuses new work right now (probe budget, overload)
    RATE_LIMITED = 303  # this caller used up its own share (streams, bytes per second); retry later
    BANNED = 304  # this caller is banned for a while after garbage or exceeded limits; retry after the ban
    # 4xx: configuration
    CONFIG_INVALID = 400  # user-supplied configuration failed validation
    # 5xx: tensors and codecs
    SHAPE_MISMATCH = 500  # tensor shape differs from what the header or the stage expects
    UNKNOWN_CODEC = 501  # codec id not in the registry
    NON_FINITE = 502  # NaN or Inf where finite values are required
    UNSUPPORTED_BITS = 503  # bit width outside the codec's supported set
    DTYPE_MISMATCH = 504  # tensor dtype differs from what was announced
    OUT_OF_RANGE = 505  # finite values beyond any sane magnitude (an absurd norm from a peer)
    # 6xx: pipeline training
    WRONG_STEP = 600  # frame belongs to another training step or micro-batch
    UNKNOWN_EXAMPLE = 601  # example id not in this step's micro-batch
    # 7xx: scheduling
    INFEASIBLE = 700  # no allocation satisfies the constraints
    # 9xx: catch-all
    INTERNAL = 900  # a bug on the answering side; the message says what


class PeerdError(Exception):
    """Base of every error peerd raises on purpose; carries a wire error code."""

    code: ErrorCode = ErrorCode.INTERNAL
    from_remote: bool = False  # True: stands for an error frame the remote sent (not our verdict on it)

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{super().__str__()} [{self.code.name}]"

    @property
    def message(self) -> str:
        """The text without the ``[CODE]`` suffix, for wire fields that carry the code beside it."""
        return super().__str__()


class ConfigError(PeerdError, ValueError):
    """Invalid user input: ``field`` is the dotted path of the offending field, ``detail`` what is wrong.

    ``errors`` lists the single problems this error stands for: itself, or each one of an error
    that reports several at once (``peerd.loading.ConfigProblems``).
    """

    code = ErrorCode.CONFIG_INVALID

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}" if field else detail)

    @property
    def errors(self) -> list[ConfigError]:
        return [self]


class ProtocolError(PeerdError):
    """A message or record from the network that must be rejected."""

    code = ErrorCode.MALFORMED


class PeerMisbehaved(ProtocolError):
    """A peer sent what no healthy peer sends (NaN/Inf, absurd norms): ``peer`` names it for suspicion."""

    def __init__(self, message: str, *, peer: str, code: ErrorCode | None = None) -> None:
        super().__init__(message, code=code)
        self.peer = peer


class PeerUnavailable(PeerdError):
    """A remote peer did not answer in time or refused the connection."""

    code = ErrorCode.PEER_UNAVAILABLE


class CodecError(PeerdError):
    """A tensor could not be encoded or decoded faithfully."""

    code = ErrorCode.MALFORMED


class InfeasibleError(PeerdError):
    """No allocation satisfies the job's constraints."""

    code = ErrorCode.INFEASIBLE
