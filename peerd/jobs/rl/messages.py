"""The rl wire family (protocols/rl.md): rollouts to the trainer and its answers, declared once.

Four frame kinds on ``rl_protocol(job)``, served by the trainer, every header a msgpack map with
``kind`` and ``v`` (= 1) and no payload:

- ``rl.rollouts`` (rollout peer -> trainer): one shard of one iteration: per problem the
  completion token ids and the behaviour log-prob of each token, and the policy version that
  sampled them; answered by ``rl.ack`` (the trainer's latest version, accepted or why not, done);
- ``rl.poll`` (rollout peer -> trainer): "tell me when you hold version ``want`` or are done";
  answered by ``rl.status`` (latest version, done, ready) as soon as that holds, or after a
  bounded wait (also while the trainer still warms up: ``ready`` false).

The schema bounds what any job could send; ``check_rollouts`` then holds a frame to this job's
sizes (``RolloutBounds``): anything a healthy rollout peer never sends is a ``ProtocolError``
with the code protocols/rl.md names, and is never trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta

from peerd.errors import ErrorCode, ProtocolError
from peerd.rl.tasks import END_TOKEN
from peerd.wire import Schema, WireStruct, to_builtin
from peerd.wire.types import Count, Real

VERSION = 1
KIND_ROLLOUTS = "rl.rollouts"
KIND_ACK = "rl.ack"
KIND_POLL = "rl.poll"
KIND_STATUS = "rl.status"
REQUEST_KINDS = (KIND_ROLLOUTS, KIND_POLL)
REPLY_KINDS = (KIND_ACK, KIND_STATUS)

# What any job may send (a job's own, smaller bounds are checked by check_rollouts).
MAX_GROUP = 1024  # rl.group_size's upper bound
MAX_COMPLETION = 4096  # tokens of one completion (the largest preset's context)
MAX_GROUPS = 65536  # problems in one shard
MAX_TOKEN = 2**31 - 1
REPLY_HEADER_BYTES = 4096
POLL_HEADER_BYTES = 1024

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN)]
Reason = Annotated[str, Meta(max_length=200)]


def rl_protocol(job: str) -> str:
    """The protocol an ``rl`` job's trainer serves for rollouts and polls."""
    return f"peerd/{job}/rl/1"


def weights_job(job: str) -> str:
    """The state-sync name the trainer serves policy weights under (``state_protocol`` of it)."""
    return f"{job}/rl-weights"


class RolloutGroupWire(WireStruct, kw_only=True):
    """The completions of one problem."""

    problem: Count
    """The problem's index within its iteration (``RLPlan.problem``)."""
    completions: Annotated[
        list[Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_COMPLETION)]],
        Meta(min_length=1, max_length=MAX_GROUP),
    ]
    logprobs: Annotated[
        list[Annotated[list[float], Meta(max_length=MAX_COMPLETION)]],
        Meta(min_length=1, max_length=MAX_GROUP),
    ]
    """Behaviour log-prob of each completion token (finite, <= 0), shaped like ``completions``."""


class Rollouts(WireStruct, kw_only=True):
    """One shard of one iteration's rollouts."""

    kind: str = KIND_ROLLOUTS
    iteration: Count
    shard: Count
    version: Count
    """Policy version of the weights that sampled every completion here."""
    groups: Annotated[list[RolloutGroupWire], Meta(max_length=MAX_GROUPS)]
    sample_s: Real | None = None
    """Seconds the sender spent sampling this shard (its generation time); absent from older peers."""
    v: int = VERSION


class Ack(WireStruct, kw_only=True):
    """The trainer's answer to ``rl.rollouts``."""

    kind: str = KIND_ACK
    iteration: Count
    shard: Count
    version: Count
    """The trainer's latest published policy version."""
    accepted: bool
    reason: Reason = ""
    """Why not accepted (late, stale, duplicate); empty when accepted."""
    done: bool = False
    v: int = VERSION


class Poll(WireStruct, kw_only=True):
    """Rollout peer -> trainer: answer when you hold version ``want`` (or are done)."""

    kind: str = KIND_POLL
    want: Count
    held: Count | None = None
    """The policy version the poller holds (absent: none)."""
    inline_bytes: Count | None = None
    """Largest weights blob the poller takes inside the answer (absent: none; it fetches by state sync)."""
    v: int = VERSION


class Status(WireStruct, kw_only=True):
    """The trainer's answer to ``rl.poll``."""

    kind: str = KIND_STATUS
    version: Count
    """Latest published policy version (fetch it as state-sync stage 0, step ``version``)."""
    done: bool
    ready: bool = True
    """False while the trainer has published no version yet (its warm-up runs): ``version`` means
    nothing then, poll again."""
    weights: bool | None = None
    """True: the frame's payload is the packed weights of ``version`` (the poller held an older one
    and takes a blob that size inline); absent: no payload."""
    v: int = VERSION


def _shape_rules(msg: Rollouts) -> None:
    """Checks across fields that need no job: shapes agree, log-probs are finite and <= 0."""
    for gi, g in enumerate(msg.groups):
        if len(g.logprobs) != len(g.completions):
            raise ProtocolError(
                f"rl.rollouts: groups[{gi}]: {len(g.completions)} completions, {len(g.logprobs)} log-prob lists",
                code=ErrorCode.MALFORMED,
            )
        for ci, (toks, lps) in enumerate(zip(g.completions, g.logprobs, strict=True)):
            if len(toks) != len(lps):
                raise ProtocolError(
                    f"rl.rollouts: groups[{gi}].logprobs[{ci}]: {len(lps)} values for {len(toks)} tokens",
                    code=ErrorCode.MALFORMED,
                )
            for lp in lps:
                if not math.isfinite(lp):
                    raise ProtocolError(
                        f"rl.rollouts: groups[{gi}].logprobs[{ci}]: {lp} is not finite",
                        code=ErrorCode.NON_FINITE,
                    )
                if lp > 0:
                    raise ProtocolError(
                        f"rl.rollouts: groups[{gi}].logprobs[{ci}]: log-prob {lp} > 0",
                        code=ErrorCode.OUT_OF_RANGE,
                    )


# Rollouts' size limit here is what any job may send; the trainer's frame limit is the job's own.
SCHEMAS: dict[str, Schema[Any]] = {
    KIND_ROLLOUTS: Schema(
        Rollouts, "rl.rollouts header", 1 << 30, VERSION, KIND_ROLLOUTS, rules=_shape_rules
    ),
    KIND_ACK: Schema(Ack, "rl.ack header", REPLY_HEADER_BYTES, VERSION, KIND_ACK),
    KIND_POLL: Schema(Poll, "rl.poll header", POLL_HEADER_BYTES, VERSION, KIND_POLL),
    KIND_STATUS: Schema(Status, "rl.status header", REPLY_HEADER_BYTES, VERSION, KIND_STATUS),
}


def header(msg: Rollouts | Ack | Poll | Status) -> dict[str, Any]:
    """The frame header of ``msg``, after the checks a receiver runs (a bug must not reach the wire)."""
    return to_builtin(SCHEMAS[msg.kind].check(to_builtin(msg)))


def parse(raw: dict[str, Any], kinds: tuple[str, ...]) -> Any:
    """The typed message of a frame header whose kind is one of ``kinds``; ProtocolError otherwise."""
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise ProtocolError(f"rl: unexpected message kind {str(kind)[:32]!r}", code=ErrorCode.UNKNOWN_KIND)
    return SCHEMAS[kind].check(raw)


@dataclass(frozen=True)
class RolloutBounds:
    """What one job's ``rl.rollouts`` may hold: checked before a frame is used."""

    iterations: int
    shards: list[range]
    """Problem indices of each shard (``shard_ranges``)."""
    group_size: int
    max_new_tokens: int
    vocab_size: int

    def frame_bytes(self) -> int:
        """Largest header an honest shard needs: per token a uint32 and a float64 at most, plus framing."""
        widest = max((len(r) for r in self.shards), default=0)
        per_completion = self.max_new_tokens * (5 + 9) + 16
        return 4096 + widest * (64 + self.group_size * 2 * per_completion)


def check_rollouts(msg: Rollouts, bounds: RolloutBounds) -> None:
    """``msg`` against the job's sizes: ProtocolError (WRONG_STEP, NOT_ALLOWED, MALFORMED, OVERSIZED,
    OUT_OF_RANGE) for the first thing no healthy rollout peer sends."""
    if msg.iteration >= bounds.iterations:
        raise ProtocolError(
            f"rl.rollouts of iteration {msg.iteration}: the job has {bounds.iterations}",
            code=ErrorCode.WRONG_STEP,
        )
    if msg.shard >= len(bounds.shards):
        raise ProtocolError(
            f"rl.rollouts of shard {msg.shard}: the job has {len(bounds.shards)}", code=ErrorCode.NOT_ALLOWED
        )
    owned = bounds.shards[msg.shard]
    seen = set()
    for gi, g in enumerate(msg.groups):
        where = f"rl.rollouts: groups[{gi}]"
        if g.problem not in owned or g.problem in seen:
            raise ProtocolError(
                f"{where}: problem {g.problem} is not one of shard {msg.shard}'s "
                f"[{owned.start}, {owned.stop}) or comes twice",
                code=ErrorCode.MALFORMED,
            )
        seen.add(g.problem)
        if len(g.completions) != bounds.group_size:
            raise ProtocolError(
                f"{where}: {len(g.completions)} completions, the group size is {bounds.group_size}",
                code=ErrorCode.MALFORMED,
            )
        for ci, toks in enumerate(g.completions):
            if len(toks) > bounds.max_new_tokens:
                raise ProtocolError(
                    f"{where}.completions[{ci}]: {len(toks)} tokens > max_new_tokens {bounds.max_new_tokens}",
                    code=ErrorCode.OVERSIZED,
                )
            if max(toks) >= bounds.vocab_size:
                raise ProtocolError(
                    f"{where}.completions[{ci}]: token {max(toks)} outside the vocabulary of {bounds.vocab_size}",
                    code=ErrorCode.OUT_OF_RANGE,
                )
            ends = [i for i, tok in enumerate(toks) if tok == END_TOKEN]
            if ends not in ([], [len(toks) - 1]) or (not ends and len(toks) != bounds.max_new_tokens):
                raise ProtocolError(
                    f"{where}.completions[{ci}]: a completion stops at its one end marker or at "
                    f"max_new_tokens {bounds.max_new_tokens}",
                    code=ErrorCode.MALFORMED,
                )


def to_wire(groups_tokens: list[tuple[int, list[list[int]], list[list[float]]]]) -> list[RolloutGroupWire]:
    """``(problem, completions, logprobs)`` triples as wire groups."""
    return [RolloutGroupWire(problem=p, completions=c, logprobs=lp) for p, c, lp in groups_tokens]


__all__ = [
    "KIND_ACK",
    "KIND_POLL",
    "KIND_ROLLOUTS",
    "KIND_STATUS",
    "Ack",
    "Poll",
    "RolloutBounds",
    "RolloutGroupWire",
    "Rollouts",
    "Status",
    "check_rollouts",
    "header",
    "parse",
    "rl_protocol",
    "weights_job",
]
