"""A rollout peer of an ``rl`` job: fetch the weights it needs, sample its shard of each iteration, push it.

For ``u = 0, 1, ...``: ask the trainer (``rl.poll``) until it holds a version ``>= u - staleness``
(and is ready: its warm-up may take a while)
(sync mode: exactly ``u``); skip to the trainer's iteration when the trainer has moved past
``u`` (a shard for a trained iteration would only be dropped); fetch the newest version over
state sync when it is newer than the weights held (or take it from the poll's answer, which
carries blobs up to ``inline_weights_bytes``); sample the shard (``sample_shard``, in a
worker thread: the event loop keeps serving); push it as ``rl.rollouts``; stop when the trainer
says it is done. Every remote wait is bounded: a trainer that stays unreachable for
``trainer_timeout_s`` ends the loop with ``PeerUnavailable``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from peerd.errors import ErrorCode, PeerUnavailable, ProtocolError
from peerd.jobs.rl.messages import (
    KIND_ACK,
    KIND_STATUS,
    Ack,
    Poll,
    Rollouts,
    Status,
    header,
    parse,
    rl_protocol,
    to_wire,
    weights_job,
)
from peerd.jobs.rl.shards import RLPlan, Shard, sample_shard
from peerd.jobs.rl.trainer import INLINE_WEIGHTS, WEIGHTS_STAGE
from peerd.log import get_logger
from peerd.models.gpt import GPT
from peerd.pipeline.statesync import StateSyncConfig, fetch_state
from peerd.rl.rollout import RolloutGroup
from peerd.rl.weights import read_weights
from peerd.swarm.framing import FrameLimits
from peerd.swarm.transport import Connection, Transport

log = get_logger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    """Deadlines of a rollout peer."""

    request_timeout_s: float = 60.0
    """Longest wait for one answer of the trainer (a poll is held up to the trainer's poll_hold_s)."""
    trainer_timeout_s: float = 120.0
    """Longest the trainer may stay unreachable before the loop gives up."""
    inline_weights_bytes: int = 16 << 20
    """Weights blobs up to this size (and the job's bound) come inside the poll's answer, in the
    round trip the poll makes anyway; bigger ones are fetched by state sync in chunks."""
    statesync: StateSyncConfig = field(default_factory=StateSyncConfig)


@dataclass
class RolloutStats:
    """What a rollout peer did."""

    shards: int = 0
    accepted: int = 0
    refused: int = 0
    """Shards the trainer answered "not accepted" (late, stale, duplicate)."""
    completions: int = 0
    weight_fetches: int = 0
    weight_bytes: int = 0
    generate_s: float = 0.0
    waited_for_warmup: int = 0
    """Polls answered "not ready" (the trainer was still warming up)."""
    versions: list[int] | None = None
    """The policy version each pushed shard was sampled with, in order."""


class RolloutPeer:
    """Samples ``shard`` (``assign_shards``: this peer's) of every iteration for ``trainer``."""

    def __init__(
        self,
        transport: Transport,
        plan: RLPlan,
        trainer: Hashable,
        shard: Shard,
        *,
        config: RolloutConfig = RolloutConfig(),
        device: torch.device | str = "cpu",
    ) -> None:
        self.transport, self.plan, self.trainer, self.config = transport, plan, trainer, config
        self.device = torch.device(device)
        self.shard = shard.index
        self.indices = shard.problems
        self.inline_bytes = min(config.inline_weights_bytes, plan.weights_bound)
        self.model: GPT | None = None
        self.held = -1
        self.stats = RolloutStats(versions=[])
        self.trainer_version = -1
        """The newest policy version the trainer said it published (checkpoint copies follow it)."""
        self._conn: Connection | None = None

    async def run(self) -> RolloutStats:
        """Until the trainer is done."""
        plan, k = self.plan, self.plan.rl.staleness
        u = 0
        try:
            while True:
                # past the last iteration only "done" is left to hear of: no version satisfies the want
                status, blob = await self._poll(max(0, u - k) if u < plan.iterations else plan.iterations + 1)
                if status.done:
                    return self.stats
                if not status.ready:
                    self.stats.waited_for_warmup += 1
                    continue  # the trainer still warms up
                self.trainer_version = max(self.trainer_version, status.version)
                u = max(u, status.version)  # the trainer is past u: those shards would be dropped
                if u >= plan.iterations:
                    continue  # nothing left to sample: wait for done
                if status.weights:
                    await self._take_weights(blob, status.version)
                elif status.version > self.held:
                    await self._fetch(status.version)
                if not self.indices:
                    u += 1
                    continue
                ack = await self._push(u)
                self.trainer_version = max(self.trainer_version, ack.version)
                if ack.done:
                    return self.stats
                u += 1
        finally:
            if self._conn is not None:
                await self._conn.close(timeout=1.0)

    # ------------------------------------------------------------ weights

    async def _fetch(self, version: int) -> None:
        blob = await fetch_state(
            self.transport,
            [self.trainer],
            weights_job(self.plan.job_id),
            WEIGHTS_STAGE,
            version,
            max_bytes=self.plan.weights_bound,
            config=self.config.statesync,
        )
        await self._take_weights(blob, version)

    async def _take_weights(self, blob: bytes | bytearray, version: int) -> None:
        if len(blob) <= 4 * INLINE_WEIGHTS:  # a small policy loads faster than a thread hand-off
            model = self._load(blob, version)
        else:
            model = await asyncio.to_thread(self._load, blob, version)
        self.model, self.held = model, version
        self.stats.weight_fetches += 1
        self.stats.weight_bytes += len(blob)

    def _load(self, blob: bytes | bytearray, version: int) -> GPT:
        """The held model with ``blob``'s weights (``read_weights`` checks all before it writes: a
        refused blob leaves the held weights as they were)."""
        model = (
            self.model if self.model is not None else self.plan.spec.model.family().build().to(self.device)
        )
        assert isinstance(model, GPT)
        read_weights(blob, model.state_dict(), version)
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    # ------------------------------------------------------------ rollouts

    async def _push(self, u: int) -> Ack:
        assert self.model is not None
        model, version = self.model, self.held
        groups, sampled = await asyncio.to_thread(self._sample, model, u, version)
        self.stats.generate_s += sampled
        msg = Rollouts(
            iteration=u,
            shard=self.shard,
            version=version,
            groups=to_wire(
                [(i, g.completions, g.logprobs) for i, g in zip(self.indices, groups, strict=True)]
            ),
            sample_s=sampled,
        )
        ack: Ack
        ack, payload = await self._request(header(msg), KIND_ACK)
        if payload:
            raise ProtocolError(f"rl ack with a {len(payload)}-byte payload", code=ErrorCode.OVERSIZED)
        self.stats.shards += 1
        self.stats.completions += sum(g.size for g in groups)
        assert self.stats.versions is not None
        self.stats.versions.append(version)
        if ack.accepted:
            self.stats.accepted += 1
        else:
            self.stats.refused += 1
            log.info(
                "rl job %s: shard %d of iteration %d not taken: %s",
                self.plan.job_id,
                self.shard,
                u,
                ack.reason,
            )
        return ack

    def _sample(self, model: GPT, u: int, version: int) -> tuple[list[RolloutGroup], float]:
        """The shard of iteration ``u`` and the seconds its sampling took (timed in the worker thread,
        so the event loop's turns do not count)."""
        started = time.perf_counter()
        groups = sample_shard(model, self.plan, u, self.shard, self.indices, version)
        return groups, time.perf_counter() - started

    async def _poll(self, want: int) -> tuple[Status, bytearray]:
        """The trainer's status and, when it says ``weights``, the packed weights of its version."""
        held = self.held if self.held >= 0 else None
        poll = Poll(want=want, held=held, inline_bytes=self.inline_bytes or None)
        status, blob = await self._request(header(poll), KIND_STATUS)
        if bool(status.weights) != bool(blob):
            raise ProtocolError(
                f"rl status of version {status.version} says weights={status.weights} with a "
                f"{len(blob)}-byte payload",
                code=ErrorCode.MALFORMED,
            )
        return status, blob

    async def _request(self, head: dict[str, Any], reply_kind: str) -> tuple[Any, bytearray]:
        """One request, its answer and the answer's payload, reconnecting while the trainer is
        unreachable (bounded)."""
        deadline = time.monotonic() + self.config.trainer_timeout_s
        while True:
            try:
                conn = await self._connection()
                raw, payload = await conn.request(head, timeout=self.config.request_timeout_s)
                return parse(raw, (reply_kind,)), payload
            except PeerUnavailable as exc:
                if self._conn is not None:
                    await self._conn.close(timeout=1.0)
                self._conn = None
                if time.monotonic() >= deadline:
                    raise PeerUnavailable(
                        f"rl trainer {self.trainer} unreachable: {exc.message}", code=exc.code
                    ) from None
                log.info("rl job %s: trainer %s: %s; retrying", self.plan.job_id, self.trainer, exc)
                await asyncio.sleep(0.5)

    async def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed:
            self._conn = await self.transport.connect(
                self.trainer, rl_protocol(self.plan.job_id), timeout=10.0
            )
            self._conn.limits = FrameLimits(max_header=4096, max_payload=self.inline_bytes)
        return self._conn
