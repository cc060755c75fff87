"""Planning consensus as a sans-IO state machine: events in, typed actions out; no clock, no I/O.

One machine per (job, peer) drives epochs ``e = 0, 1, ...``. Every deadline derives from
``ConsensusConfig.epoch0_start`` and ``ConsensusTiming`` on DHT time, so peers agree on
them up to clock skew. Phases of an epoch (``now`` is this peer's DHT time)::

    roster    publish own RosterEntry; take others' issued before the roster closes
    freeze    (after settle_s) the view is frozen -> StartSearch(roster, seed)
    search    propose() publishes the island's improvements; valid foreign candidates
              -> Migrate
    stop      StopSearch; the final best is published and has exchange_s to propagate
    decide    re-score every valid candidate; vote (round 0) for the cheapest, ties by id
    adopt     no commit yet: round-1 vote by the adoption rule (``tally``)
    end       still no commit: NextEpoch(e + 1) and a new roster entry

After a commit the machine rests until the driver calls ``replan(now)`` (a tasklet's peer
is gone, see ``peerd.jobs.health``): it then joins the next epoch whose roster is still
open (``ConsensusConfig.replan_epoch``) with an entry that also lists the stage state this
peer holds (``set_held``), and runs the same phases. In such a re-plan epoch, round 0 votes
by hysteresis over the running allocation (``tally.replan_choice``): only candidates that
keep its depth and layer split count, and a repair that moves no surviving tasklet beats a
reshuffle unless the reshuffle is cheaper by ``replan_margin``. A re-plan epoch commits only
with voters holding a majority of the running commit's roster as well (for ``anchor_epochs``
epochs; ``tally.anchored``): views split by a partition cannot both commit. Every commit of a
newer epoch is announced, even of the same allocation: the tasklets resume from one common step.

A commit happens whenever a quorum of this peer's roster view votes for one candidate in
one round, or a verified ``CommitRecord`` arrives (also late: an older epoch's record is
adopted while a newer epoch runs). A record from a newer epoch supersedes an older
commit. Authenticity is the driver's job (signed DHT records); the machine rejects wrong
job or epoch, authors off the roster, duplicates, equivocation (neither vote counts) and
candidates whose claimed cost is not what the shared cost model says.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable

from peerd.errors import PeerdError
from peerd.log import get_logger
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import (
    Action,
    Commit,
    Migrate,
    Misbehaviour,
    NextEpoch,
    Publish,
    StartSearch,
    StopSearch,
)
from peerd.sched.consensus.config import ConsensusConfig, ConsensusTiming
from peerd.sched.consensus.epoch import EpochState
from peerd.sched.consensus.messages import (
    Candidate,
    CommitRecord,
    HeldState,
    Message,
    Roster,
    RosterDevice,
    RosterEntry,
    RosterLink,
    Vote,
    allocation_hash,
)
from peerd.sched.consensus.tally import adoption_choice, replan_choice, verify_record

__all__ = ["ConsensusConfig", "ConsensusMachine", "ConsensusTiming", "ScoreFn"]

log = get_logger(__name__)

# Messages held until they can be checked (before start() / before the view freezes). Enough for
# hundreds of peers' entries, candidates and votes; beyond it a flood is dropped, not stored.
MAX_HELD = 4096

ScoreFn = Callable[[Roster, Allocation], float]
"""The shared cost model: lower is better; may raise ``PeerdError`` (e.g. InfeasibleError)."""


class ConsensusMachine:
    """One peer's side of the planning protocol for one job (see the module docstring)."""

    def __init__(
        self,
        job: str,
        me: str,
        config: ConsensusConfig,
        score: ScoreFn,
        profile: RosterDevice,
        links: tuple[RosterLink, ...] = (),
        seed: int = 0,
    ) -> None:
        self.job, self.me, self.config, self.score, self.seed = job, me, config, score, seed
        self.profile, self.links = profile, links
        self.epoch = -1  # the epoch this peer plans in; -1 until start()
        self.committed: Commit | None = None
        self.replanning: Commit | None = None  # the running commit a re-plan repairs; None: not re-planning
        self.held: tuple[HeldState, ...] = ()  # stage state this peer can serve (goes into roster entries)
        self.stats: Counter[str] = Counter()  # rejections and notable events, by reason
        self._epochs: dict[int, EpochState] = {}
        self._early: list[Message] = []  # arrived before start()
        self._ahead: list[Message] = []  # of an epoch after the commit, arrived before this peer re-plans

    # --- driver API ----------------------------------------------------------------------

    def set_local(self, profile: RosterDevice, links: tuple[RosterLink, ...]) -> None:
        """Fresh measurements for the next roster entry this peer publishes."""
        self.profile, self.links = profile, links

    def set_held(self, held: tuple[HeldState, ...]) -> None:
        """The stage state this peer holds, for the roster entries it publishes from now on."""
        self.held = tuple(sorted(held, key=lambda h: (h.stage, h.layers)))

    def ahead_peers(self) -> frozenset[str]:
        """Peers whose roster entries of an epoch after the commit wait here: they re-plan already."""
        return frozenset(m.peer for m in self._ahead if isinstance(m, RosterEntry))

    def replan(self, now: float) -> list[Action]:
        """Re-plan a committed job: join the next open epoch (no-op before a commit or while re-planning)."""
        if self.committed is None or self.replanning is not None:
            return []
        self.replanning = self.committed
        self.epoch = self._replan_epoch(now)
        self.stats["replan"] += 1
        log.info(
            "job %s: re-planning the allocation of epoch %d in epoch %d",
            self.job,
            self.committed.epoch,
            self.epoch,
        )
        out = self._enter(self.epoch, now)
        ahead, self._ahead = self._ahead, []
        for msg in ahead:
            out += self.on_message(msg, now)
        return out + self.on_tick(now)

    def _replan_epoch(self, now: float) -> int:
        """The open epoch after the commit (``ConsensusConfig.replan_epoch``), or the one before it
        when others' entries for that one wait here and this peer's entry, issued now, still counts
        (up to ``roster_s + max_skew_s`` into the epoch): a peer whose cause came a moment after the
        others' joins their epoch instead of going on alone."""
        assert self.committed is not None
        epoch = self.config.replan_epoch(now, self.committed.epoch)
        t = self.config.timing
        joined = {m.epoch for m in self._ahead if isinstance(m, RosterEntry)}
        late = epoch - 1
        if (
            late > self.committed.epoch
            and late in joined
            and now - self.config.start(late) <= t.roster_s + t.max_skew_s
        ):
            return late
        return epoch

    def start(self, now: float) -> list[Action]:
        """Join the epoch running at ``now`` (as an observer if its roster has closed)."""
        assert self.epoch < 0, "start() called twice"
        self.epoch = self.config.epoch_at(now)
        out = self._enter(self.epoch, now)
        early, self._early = self._early, []
        for msg in early:
            out += self.on_message(msg, now)
        return out + self.on_tick(now)

    def on_message(self, msg: Message, now: float) -> list[Action]:
        """Dispatch any decoded consensus message."""
        if isinstance(msg, RosterEntry):
            return self.on_roster_entry(msg, now)
        if isinstance(msg, Candidate):
            return self.on_candidate(msg, now)
        if isinstance(msg, Vote):
            return self.on_vote(msg, now)
        return self.on_commit_record(msg, now)

    def on_roster_entry(self, entry: RosterEntry, now: float) -> list[Action]:
        es = self._epoch_for(entry, entry.job, entry.epoch)
        if es is None:
            return []
        t = self.config.timing
        result = es.add_entry(entry, latest_issue=es.start + t.roster_s + t.max_skew_s)
        if result == "conflict":
            return self._misbehaved(es.epoch, entry.peer, "two different roster entries")
        return [] if result == "new" else self._reject(result)

    def on_candidate(self, cand: Candidate, now: float) -> list[Action]:
        es = self._epoch_for(cand, cand.job, cand.epoch)
        if es is None:
            return []
        if es.roster is None:
            return self._hold(es.pending, cand)
        return self._take_candidate(es, cand, now)

    def on_vote(self, vote: Vote, now: float) -> list[Action]:
        es = self._epoch_for(vote, vote.job, vote.epoch)
        if es is None:
            return []
        if es.roster is None:
            return self._hold(es.pending, vote)
        if vote.voter not in es.members:
            return self._reject("not_on_roster")
        return self._take_vote(es, vote, now)

    def on_commit_record(self, record: CommitRecord, now: float) -> list[Action]:
        if self.epoch < 0:
            return self._hold(self._early, record)
        if record.job != self.job:
            return self._reject("other_job")
        if self.committed is not None and record.epoch <= self.committed.epoch:
            return self._reject("after_commit")
        es = self._epochs.get(record.epoch)
        out: list[Action] = []
        if es is not None:  # the proof's votes also feed this peer's ballots (and expose equivocators)
            for v in record.votes:
                if es.add_vote(v) == "equivocation":
                    out += self._misbehaved(es.epoch, v.voter, f"two different votes in round {v.round}")
        equivocators = es.ballots[record.round].equivocators if es else set()
        running = self.committed.record if self.committed is not None else None
        why = verify_record(
            record, self.config.faulty, equivocators, self.config.anchor(running, record.epoch)
        )
        if why is not None:
            log.warning("job %s: commit record from %s rejected: %s", self.job, record.author, why)
            return out + self._reject("bad_commit_record")
        return out + self._commit(record, now)

    def propose(self, allocation: Allocation, now: float) -> list[Action]:
        """The local island's current best; published when it improves (rate-limited)."""
        es = self._epochs.get(self.epoch)
        if es is None or es.roster is None or not es.participant or "stop" in es.done or not self.planning:
            return []
        allocation = allocation.canonical()
        if not set(allocation.devices) | set(allocation.spares) <= es.members:
            log.warning("job %s: island proposed an allocation with peers off the roster", self.job)
            return self._reject("bad_proposal")
        cost = self._score(es.roster, allocation)
        if cost is None:
            return self._reject("bad_proposal")
        if es.best is None or cost < es.best[0]:
            es.best = (cost, allocation)
        if now - es.last_publish >= self.config.timing.publish_interval_s:
            return self._publish_best(es, now, final=False)
        return []

    def on_tick(self, now: float) -> list[Action]:
        """Take every phase transition whose deadline has passed on this peer's clock."""
        out: list[Action] = []
        t = self.config.timing
        while self.epoch >= 0 and self.planning:
            es = self._epochs[self.epoch]
            at = now - es.start
            if at >= t.freeze and self._once(es, "freeze"):
                out += self._freeze(es, now)
            if at >= t.stop and self._once(es, "stop"):
                out.append(StopSearch(es.epoch))
                if es.participant:
                    out += self._publish_best(es, now, final=True)
            elif (
                "freeze" in es.done
                and "stop" not in es.done
                and now - es.last_publish >= t.publish_interval_s
            ):
                out += self._publish_best(es, now, final=False)
            if at >= t.decide and self._once(es, "decide") and es.participant and es.valid:
                cid = self._round0_choice(es)
                if cid is not None:
                    out += self._cast(es, 0, cid, now)
            if at >= t.adopt and self._once(es, "adopt") and es.participant:
                out += self._adopt(es, now)
            if at < t.period or not self.planning:
                break
            self.epoch += 1
            log.info(
                "job %s: epoch %d ended without a commit; epoch %d starts", self.job, es.epoch, self.epoch
            )
            out.append(NextEpoch(self.epoch))
            out += self._enter(self.epoch, now)
        return out

    # --- phases --------------------------------------------------------------------------

    def _enter(self, epoch: int, now: float) -> list[Action]:
        es = self._state(epoch)
        for old in [e for e in self._epochs if e < epoch - 1]:
            del self._epochs[old]  # one older epoch stays, for late votes and candidates
        if now - es.start >= self.config.timing.roster_s:
            log.info("job %s: joined epoch %d after its roster closed; observing", self.job, epoch)
            return []
        if self.me in es.entries:
            # entered twice (a newcomer that started in this epoch, adopted the running commit
            # and re-plans into the same epoch): a second, different entry would be equivocation
            return []
        links = tuple(sorted(self.links, key=lambda x: x.peer))
        entry = RosterEntry(self.job, epoch, self.me, now, self.profile, links, self.held)
        es.entries[self.me] = entry
        es.participant = True
        return [Publish("roster", entry)]

    def _freeze(self, es: EpochState, now: float) -> list[Action]:
        roster = es.freeze()
        es.participant = es.participant and self.me in es.members
        out: list[Action] = []
        if len(es.members) < self.config.min_peers:
            log.info(
                "job %s epoch %d: %d peers < min_peers %d",
                self.job,
                es.epoch,
                len(es.members),
                self.config.min_peers,
            )
            es.participant = False
        elif es.participant:
            out.append(StartSearch(es.epoch, roster, self._island_seed(es.epoch)))
        pending, es.pending = es.pending, []
        for msg in pending:
            out += self.on_message(msg, now)
        return out

    def _adopt(self, es: EpochState, now: float) -> list[Action]:
        assert es.roster is not None
        cid = adoption_choice(es.ballots[0], es.roster.digest, es.members, es.quorum, es.valid)
        if cid is None:
            self.stats["abstain"] += 1
            return []
        return self._cast(es, 1, cid, now)

    def _cast(
        self, es: EpochState, rnd: int, cid: bytes, now: float, cost: float | None = None
    ) -> list[Action]:
        assert es.roster is not None and not es.voted[rnd]
        es.voted[rnd] = True
        cost = es.vote_cost(cid) if cost is None else cost
        vote = Vote(self.job, es.epoch, rnd, self.me, now, cid, cost, es.roster.digest)
        return [Publish("vote", vote), *self._take_vote(es, vote, now)]

    def _publish_best(self, es: EpochState, now: float, final: bool) -> list[Action]:
        # One slot is kept back for the final publication when the search stops.
        limit = self.config.max_candidates_per_author - (0 if final else 1)
        if es.best is None or es.best[0] >= es.published_cost or es.published_n >= limit:
            return []
        assert es.roster is not None
        cost, allocation = es.best
        cand = Candidate(
            self.job, es.epoch, self.me, now, allocation, cost, es.roster.peers, es.roster.digest
        )
        es.published_cost, es.published_n, es.last_publish = cost, es.published_n + 1, now
        return [Publish("candidate", cand), *self._take_candidate(es, cand, now)]

    # --- ingestion and commits -----------------------------------------------------------

    def _take_candidate(self, es: EpochState, cand: Candidate, now: float) -> list[Action]:
        c = self.config
        result, cost = es.add_candidate(
            cand,
            self._score,
            rtol=c.cost_rtol,
            max_per_author=c.max_candidates_per_author,
            vote_by=es.start + c.timing.decide + c.timing.max_skew_s,
        )
        out = self._check_commit(es, now)  # a quorum may have been waiting for this candidate
        if result == "false_cost":
            return out + self._misbehaved(
                es.epoch, cand.author, f"claimed cost {cand.cost!r}, re-scored {cost!r}"
            )
        if result not in ("valid", "known"):
            return out + self._reject(result)
        searching = "freeze" in es.done and "stop" not in es.done and es.participant
        if result == "valid" and cand.author != self.me and searching and cost is not None:
            out.append(Migrate(es.epoch, cand.allocation, cost, cand.author))
        return out

    def _take_vote(self, es: EpochState, vote: Vote, now: float) -> list[Action]:
        result = es.add_vote(vote)
        if result == "equivocation":
            return self._misbehaved(es.epoch, vote.voter, f"two different votes in round {vote.round}")
        if result != "new":
            return self._reject(result)
        return self._check_commit(es, now)

    def _check_commit(self, es: EpochState, now: float) -> list[Action]:
        if self.committed is not None and self.committed.epoch >= es.epoch:
            return []
        proof = es.quorum_proof(self.job, self.me, now)
        return self._commit(proof, now) if proof is not None else []

    def _commit(self, proof: CommitRecord, now: float) -> list[Action]:
        old, cand, epoch = self.committed, proof.candidate, proof.epoch
        self.replanning = None
        es = self._epochs.get(epoch)
        score = es.scores.get(cand.id) if es else None
        cost = score if score is not None else cand.cost  # a record from another view: the quorum's word
        self.committed = Commit(
            epoch,
            proof.round,
            cand.allocation,
            allocation_hash(cand.allocation).hex(),
            cand.id.hex(),
            cost,
            proof,
        )
        log.info(
            "job %s: commit epoch %d round %d: %s",
            self.job,
            epoch,
            proof.round,
            self.committed.allocation_hash[:12],
        )
        out: list[Action] = []
        cur = self._epochs.get(self.epoch)
        if cur is not None and "freeze" in cur.done and "stop" not in cur.done and cur.participant:
            cur.done.add("stop")
            out.append(StopSearch(self.epoch))
        if old is None or old.epoch != epoch or old.allocation_hash != self.committed.allocation_hash:
            out.append(self.committed)
        if proof.author != self.me:  # re-published under our name too: it heals DHT loss
            proof = CommitRecord(self.job, epoch, proof.round, self.me, now, cand, proof.roster, proof.votes)
        out.append(Publish("commit", proof))
        if es is not None and es.roster is not None and es.participant and not es.voted[1]:
            out += self._cast(es, 1, cand.id, now, cost)  # helps peers still waiting in round 1
        return out

    # --- helpers -------------------------------------------------------------------------

    @property
    def last_roster(self) -> tuple[int, int] | None:
        """(epoch, members) of the newest epoch whose view froze; None before any froze."""
        frozen = [es for es in self._epochs.values() if es.roster is not None]
        if not frozen:
            return None
        es = max(frozen, key=lambda e: e.epoch)
        return es.epoch, len(es.members)

    @property
    def planning(self) -> bool:
        """Whether epochs run: before the first commit, and during a re-plan."""
        return self.committed is None or self.replanning is not None

    def _round0_choice(self, es: EpochState) -> bytes | None:
        if self.replanning is None:
            return min(es.valid, key=lambda c: (es.valid[c], c))
        allocations = {c: es.seen[c].allocation for c in es.valid}
        cid = replan_choice(es.valid, allocations, self.replanning.allocation, self.config.replan_margin)
        if cid is None:
            self.stats["no_repair"] += 1
            log.info(
                "job %s epoch %d: no candidate keeps the running pipeline's shape; not voting",
                self.job,
                es.epoch,
            )
        return cid

    def _score(self, roster: Roster, allocation: Allocation) -> float | None:
        try:
            cost = float(self.score(roster, allocation))
        except PeerdError as exc:
            log.debug("job %s: allocation not scorable: %s", self.job, exc)
            return None
        return cost if math.isfinite(cost) else None

    def _epoch_for(self, msg: Message, job: str, epoch: int) -> EpochState | None:
        if self.epoch < 0:
            self._hold(self._early, msg)  # the current epoch is unknown until start(now)
            return None
        if job != self.job:
            self._reject("other_job")
            return None
        if self.committed is not None and epoch <= self.committed.epoch:
            self._reject("after_commit")  # only commit records of newer epochs matter now
            return None
        if self.committed is not None and self.replanning is None:
            self._hold(self._ahead, msg)  # others re-plan already: this peer will follow
            return None
        if not self.epoch - 1 <= epoch <= self.epoch + 1:
            self._reject("other_epoch")
            return None
        return self._state(epoch)

    def _state(self, epoch: int) -> EpochState:
        if epoch not in self._epochs:
            running = self.replanning.record if self.replanning is not None else None
            self._epochs[epoch] = EpochState(
                epoch,
                self.config.start(epoch),
                faulty=self.config.faulty,
                anchor=self.config.anchor(running, epoch),
            )
        return self._epochs[epoch]

    def _island_seed(self, epoch: int) -> int:
        return island_seed(self.job, epoch, self.me, self.seed)

    def _hold(self, held: list[Message], msg: Message) -> list[Action]:
        if len(held) >= MAX_HELD:
            return self._reject("held_full")
        held.append(msg)
        return []

    @staticmethod
    def _once(es: EpochState, phase: str) -> bool:
        if phase in es.done:
            return False
        es.done.add(phase)
        return True

    def _reject(self, reason: str) -> list[Action]:
        self.stats[reason] += 1
        return []

    def _misbehaved(self, epoch: int, peer: str, what: str) -> list[Action]:
        self.stats["misbehaviour"] += 1
        log.warning("job %s epoch %d: peer %s: %s", self.job, epoch, peer, what)
        return [Misbehaviour(epoch, peer, what)]


def island_seed(job: str, epoch: int, peer: str, seed: int = 0) -> int:
    """The seed of ``peer``'s island in ``epoch``: distinct per peer, reproducible by anyone (benchmarks)."""
    digest = hashlib.sha256(f"{job}|{epoch}|{peer}|{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big")
