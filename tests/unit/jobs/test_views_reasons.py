"""Why a job does not start, why a tasklet stopped, and one view of a job from public records."""

from __future__ import annotations

import os
from typing import Any

from peerd.errors import ErrorCode, PeerUnavailable
from peerd.jobs.catalog import commit_of
from peerd.jobs.records import JobState, Progress, TaskState, new_job_record
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.jobs.views import JobEntry, describe_failure, job_view, start_warnings, waiting_reason
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Candidate, CommitRecord, Roster, RosterDevice, RosterEntry, Vote

PEERS = [f"12D3KooW{c * 12}" for c in "ABCDEFG"]
T0 = 1_000.0
ALLOC = Allocation(((PEERS[1], PEERS[2]), (PEERS[3], PEERS[4]), (PEERS[5], PEERS[6])), (PEERS[0],))


def spec(**extra: Any) -> JobSpec:
    mapping: dict[str, Any] = {
        "name": "demo",
        "kind": "pretrain",
        "model": {"preset": "tiny"},
        "steps": 120,
        "global_batch": 16,
        "micro_batch": 4,
        "data": {"seq_len": 32},
        "parallel": {"d_pp": 3, "d_dp": 2},
        "min_peers": 6,
        "max_peers": 7,
    }
    mapping.update(extra)
    return parse_job_spec(mapping)


def progress(peer: str, state: TaskState, reason: str = "", step: int = 37, **kw: Any) -> Progress:
    stage, replica = next((s, st.index(peer)) for s, st in enumerate(ALLOC.stages) if peer in st)
    return Progress(
        job_id="ab" * 16,
        peer=peer,
        epoch=2,
        stage=stage,
        replica=replica,
        step=step,
        steps=120,
        state=state,
        tokens_per_s=0.0,
        updated_at=T0,
        started_at=T0,
        reason=reason,
        **kw,
    )


def test_submit_warns_when_the_swarm_is_too_small() -> None:
    (warning,) = start_warnings(spec(), PEERS[:3])
    assert "3 peers online" in warning and "min_peers 6" in warning and "3 more peers join" in warning
    assert start_warnings(spec(), PEERS[:6]) == []
    assert start_warnings(spec(), [*PEERS[:6], PEERS[0]]) == []  # a peer seen twice counts once
    dtfm = spec(planning={"objective": "dtfm"}, parallel={"d_pp": 2, "d_dp": 2}, min_peers=4, max_peers=None)
    (warning,) = start_warnings(dtfm, PEERS[:5])
    assert "set max_peers: 4" in warning
    assert start_warnings(spec(planning={"objective": "dtfm"}, max_peers=6), PEERS) == []


def test_a_waiting_job_says_how_many_peers_it_waits_for() -> None:
    s = spec()
    assert (
        waiting_reason(s, online=PEERS[:3], planning=None)
        == "waiting for 3 more peers: 3 of min_peers 6 are online"
    )
    assert waiting_reason(s, online=PEERS[:5], planning=None).startswith("waiting for 1 more peer:")
    # enough peers online, but the last frozen roster view was short of them
    view = {"epoch": 4, "roster": {"epoch": 3, "peers": 4}, "islands": []}
    assert (
        waiting_reason(s, online=PEERS, planning=view)
        == "waiting for 2 more peers: the roster of planning epoch 3 had 4 of min_peers 6"
    )
    broken = {
        "epoch": 2,
        "islands": [{"epoch": 1, "error": ""}, {"epoch": 2, "error": "ConfigError: x [CONFIG_INVALID]"}],
    }
    assert waiting_reason(s, online=PEERS, planning=broken) == (
        "this peer's search in planning epoch 2 failed: ConfigError: x"
    )
    healed = {"epoch": 3, "islands": [*broken["islands"], {"epoch": 3, "error": ""}]}
    assert waiting_reason(s, online=PEERS, planning=healed) == ""
    assert waiting_reason(s, online=None, planning=None, opens_in=5.2) == "planning opens in 5 s"
    assert waiting_reason(s, online=PEERS, planning={"epoch": 0, "islands": []}) == ""


def test_a_dial_error_becomes_a_sentence_naming_peer_stage_and_partner() -> None:
    raw = str(
        PeerUnavailable(
            f"stream to {PEERS[5]} broke: failed to dial {PEERS[5]}: all dials failed\n"
            f"  * [/ip4/127.0.0.1/tcp/40121/p2p/{PEERS[5]}] dial tcp4 127.0.0.1:40121: connect: connection refused"
        )
    )
    said = describe_failure(progress(PEERS[3], TaskState.FAILED, raw), ALLOC)
    assert said == (
        f"stage 1 replica 0 (peer …{PEERS[3][-8:]}) lost its connection to its next stage's "
        f"peer …{PEERS[5][-8:]} (stage 2) at step 37"
    )
    assert "/ip4" not in said and "dial" not in said and "[PEER_UNAVAILABLE]" not in said


def test_timeouts_name_the_suspect_and_other_reasons_read_as_sentences() -> None:
    frame = str(PeerUnavailable("no frame header within 180 s", code=ErrorCode.TIMEOUT))
    p = progress(PEERS[4], TaskState.FAILED, frame, suspects=(PEERS[3],))
    assert describe_failure(p, ALLOC).endswith(
        f"heard nothing from its replica partner …{PEERS[3][-8:]} in stage 1 in time at step 37"
    )
    averaging = str(
        PeerUnavailable("step 3: no contribution from rank(s) [1] within 180 s", code=ErrorCode.TIMEOUT)
    )
    assert "heard nothing from a partner in time" in describe_failure(
        progress(PEERS[1], TaskState.FAILED, averaging), ALLOC
    )
    stopped = progress(PEERS[1], TaskState.FAILED, "stopped (job cancelled or daemon shutting down)")
    assert "was stopped: the job was cancelled or its daemon shut down" in describe_failure(stopped, ALLOC)
    recovering = progress(PEERS[2], TaskState.RECOVERING, frame, suspects=(PEERS[1],))
    assert describe_failure(recovering, ALLOC).startswith("stage 0 replica 1")
    assert "is recovering after step 37" in describe_failure(recovering, ALLOC)
    ready = str(
        PeerUnavailable(
            f"tasklet partners {sorted(PEERS[1:3])} did not start within 300 s", code=ErrorCode.TIMEOUT
        )
    )
    assert describe_failure(progress(PEERS[3], TaskState.FAILED, ready, step=0), ALLOC).endswith(
        f"waited in vain for its previous stage's peer …{PEERS[1][-8:]} (stage 0) to start its tasklet at step 0"
    )
    nan = progress(PEERS[6], TaskState.FAILED, "loss is nan at step 9 [NON_FINITE]")
    assert "training diverged" in describe_failure(nan, ALLOC)
    assert describe_failure(progress(PEERS[6], TaskState.DONE, step=120)).endswith("finished all 120 steps")


def commit_for(job: str) -> Any:
    device = RosterDevice(0.1, 8 << 30, "eu")
    roster = Roster.of(2, [RosterEntry(job, 2, p, T0, device, ()) for p in PEERS])
    cand = Candidate(job, 2, PEERS[1], T0, ALLOC, 0.25, roster.peers, roster.digest)
    votes = tuple(Vote(job, 2, 0, p, T0, cand.id, 0.25, roster.digest) for p in PEERS[:4])
    return commit_of(CommitRecord(job, 2, 0, PEERS[1], T0, cand, roster.refs, votes))


def test_a_daemon_that_joined_late_reports_what_the_records_say() -> None:
    s = spec()
    rec = new_job_record(
        PEERS[1], "default", s, os.urandom(16), now=T0, epoch0_start=T0 + 6, timing=s.planning.timing()
    )
    rec = rec.with_state(JobState.DONE, T0 + 500)
    commit = commit_for(rec.job_id)
    done = {p: progress(p, TaskState.DONE, step=120) for p in ALLOC.devices}
    # the daemon planned nothing and ran nothing: only the records
    view = job_view(JobEntry(rec, s, commit=commit, progress=done), PEERS[0], T0 + 600, detail=True)
    assert view["state"] == "done" and view["progress"]["step"] == 120
    assert view["allocation"]["allocation_hash"] == commit.allocation_hash
    assert view["allocation"]["spares"] == [PEERS[0]]
    # without any tasklet record left the step is unknown, not 0
    bare = job_view(JobEntry(rec, s, commit=commit), PEERS[0], T0 + 600, detail=False)
    assert bare["state"] == "done" and bare["progress"]["step"] is None
    # a failed tasklet: the view's reason is the sentence, not the raw error
    raw = str(PeerUnavailable(f"stream to {PEERS[5]} broke: failed to dial {PEERS[5]}: all dials failed"))
    failed = {**done, PEERS[3]: progress(PEERS[3], TaskState.FAILED, raw)}
    running = rec.with_state(JobState.RUNNING, T0 + 100)
    view = job_view(JobEntry(running, s, commit=commit, progress=failed), PEERS[0], T0 + 600, detail=False)
    assert view["state"] == "failed"
    assert view["reason"].startswith("stage 1 replica 0") and "dial" not in view["reason"]
    # planning on a swarm too small for the job
    pending = new_job_record(
        PEERS[1], "default", s, os.urandom(16), now=T0, epoch0_start=T0 + 6, timing=s.planning.timing()
    )
    view = job_view(JobEntry(pending, s), PEERS[0], T0 + 60, detail=False, online=PEERS[:3])
    assert view["state"] == "planning"
    assert view["reason"] == "waiting for 3 more peers: 3 of min_peers 6 are online"
