"""The trainer's intake of rollout shards, pure: which shard it takes, which it turns down, which it waits for.

``Intake`` holds the trainer's side of ``rl.rollouts`` between the wire and the training loop:
the iteration awaited, the latest published version, the shards taken per iteration, the
rollout peers not waited for (``absent``: they missed a deadline and have not delivered
since) and the counts of what was turned down. ``take`` checks a shard (``check_rollouts``,
then its sender, version and iteration against the trainer's state): a ``ProtocolError`` for
what no healthy peer sends, an ``Ack`` that says "not taken" for a late, stale or duplicate
shard, an accepting ``Ack`` otherwise. ``RLTrainer`` wraps it with the locking and the waits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.rl.messages import Ack, RolloutBounds, Rollouts, Status, check_rollouts
from peerd.log import get_logger

log = get_logger(__name__)


@dataclass
class Intake:
    """The shards ``peers`` sample for this trainer (shard index -> rollout peer) of a job of ``bounds``."""

    peers: dict[int, str]
    bounds: RolloutBounds
    staleness: int
    iteration: int = 0
    """The iteration whose shards are awaited; shards of earlier ones are late."""
    version: int = -1
    """Latest published policy version (-1: none yet, the warm-up runs)."""
    done: bool = False
    arrived: dict[int, dict[int, Rollouts]] = field(default_factory=lambda: defaultdict(dict))
    absent: set[int] = field(default_factory=set)
    """Shards whose peer missed a deadline and has not delivered since: not waited for."""
    dropped_stale: int = 0
    """Completions turned down: their version was more than ``staleness`` behind their iteration."""
    dropped_late: int = 0
    """Completions turned down: their iteration was trained already."""
    duplicates: int = 0
    missing_shards: int = 0
    """Shards the trainer stopped waiting for."""

    def take(self, peer: str, msg: Rollouts) -> Ack:
        """Keep ``msg`` for its iteration or say why not; ProtocolError for what no healthy peer sends."""
        check_rollouts(msg, self.bounds)
        if self.peers.get(msg.shard) != peer:
            owner = self.peers.get(msg.shard, "another trainer")
            raise ProtocolError(f"shard {msg.shard} belongs to {owner}", code=ErrorCode.NOT_ALLOWED)
        if msg.version > self.version:
            raise ProtocolError(
                f"rollouts of policy version {msg.version}: the trainer published {self.version}",
                code=ErrorCode.FROM_FUTURE,
            )
        k = self.staleness
        if msg.iteration > self.iteration + k:
            raise ProtocolError(
                f"rollouts for iteration {msg.iteration} while iteration {self.iteration} trains (at most {k} ahead)",
                code=ErrorCode.WRONG_STEP,
            )
        completions = sum(len(g.completions) for g in msg.groups)
        reason = ""
        if self.done or msg.iteration < self.iteration:
            reason = f"iteration {msg.iteration} is trained already"
            self.dropped_late += completions
            self.absent.discard(msg.shard)  # late, but alive: waited for again from the next iteration
        elif msg.iteration - msg.version > k:
            reason = f"version {msg.version} is more than {k} behind iteration {msg.iteration}"
            self.dropped_stale += completions
        elif msg.shard in self.arrived[msg.iteration]:
            reason = "duplicate shard"
            self.duplicates += 1
        if reason:
            log.info("shard %d of iteration %d not taken: %s", msg.shard, msg.iteration, reason)
        else:
            self.arrived[msg.iteration][msg.shard] = msg
            self.absent.discard(msg.shard)
        return Ack(
            iteration=msg.iteration,
            shard=msg.shard,
            version=max(self.version, 0),
            accepted=not reason,
            reason=reason[:200],
            done=self.done,
        )

    def status(self) -> Status:
        return Status(version=max(self.version, 0), done=self.done, ready=self.version >= 0)

    def expected(self) -> set[int]:
        """Shards the current iteration waits for: those with problems whose peer is not absent."""
        return {s for s in self.peers if self.bounds.shards[s] and s not in self.absent}

    def complete(self, t: int) -> bool:
        return self.expected() <= set(self.arrived.get(t, {}))

    def give_up(self, t: int, gone: set[str]) -> list[int]:
        """Stop waiting for the shards of ``t`` that peers ``gone`` (no longer in the swarm) owe: they
        become absent, as if they had missed the deadline. Returns them."""
        owed = sorted(s for s in self.expected() - set(self.arrived.get(t, {})) if self.peers[s] in gone)
        self.missing_shards += len(owed)
        self.absent.update(owed)
        return owed

    def close(self, t: int) -> tuple[dict[int, Rollouts], list[int]]:
        """Stop taking shards of ``t``: its shards in shard order, and the expected ones that are
        missing (their peers become absent). Shards of ``t`` arriving from now on are late."""
        missing = sorted(self.expected() - set(self.arrived.get(t, {})))
        self.missing_shards += len(missing)
        self.absent.update(missing)
        self.iteration = t + 1
        return dict(sorted(self.arrived.pop(t, {}).items())), missing
