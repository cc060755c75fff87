"""CLI rendering off a terminal: tables at full width, a progress line per change, the loss plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from peerd.cli.plot import write_loss_plot
from peerd.cli.render import console, follow_job, job_line, job_panel, jobs_table, render_status

DEVICE = "NVIDIA GeForce RTX 4090 Laptop GPU (cuda:0, driver 550.54.14)"


def _peer(name: str, peer_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "peer_id": peer_id,
        "short_id": peer_id[-8:],
        "name": name,
        "state": "online",
        "device": DEVICE,
        "tflops": {"fp32": 0.41, "bf16": 1.6},
        "memory_free_bytes": 7 * 2**30,
        "memory_total_bytes": 8 * 2**30,
        "last_seen_s": 2.0,
        **extra,
    }


def test_tables_off_a_terminal_are_not_cut(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")  # what rich would otherwise fit a pipe's output into
    a, b = "Qm" + "a" * 44, "Qm" + "b" * 44
    link = {"src": a, "dst": b, "status": "ok", "rtt_ms": 0.4, "bw_up_mbps": 1000.0, "bw_down_mbps": 987.0}
    view = {"peers": [_peer("alpha", a, self=True), _peer("beta", b)], "links": [link]}
    console().print(render_status(view))
    out = capsys.readouterr().out
    assert "…" not in out
    assert DEVICE in out and "0.4 / 1000" in out and "0.4 / 987" in out
    assert "mem: free/total GiB" in out  # the caption too


def _job(state: str, step: int = 0, loss: float | None = None, tps: float | None = None) -> dict[str, Any]:
    progress = {"step": step, "steps": 3, "loss": loss, "tokens_per_s": tps, "losses": []}
    return {"job_id": "ab" * 16, "name": "demo", "state": state, "progress": progress, "planning": {}}


def test_follow_job_off_a_terminal_prints_a_line_each_time_the_job_changes(capsys) -> None:
    views = iter(
        [
            _job("pending"),
            _job("planning"),
            _job("running", 1, 5.5, 900.0),
            _job("running", 1, 5.5, 900.0),  # nothing new: no line
            _job("running", 2, 4.25, 1200.0),
            _job("done", 3, 3.0, 1250.0),
        ]
    )
    final = follow_job(lambda: next(views), console(), interval=0.0)
    assert final["state"] == "done"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "pending epoch 0: roster open",
        "planning epoch 0: roster open",
        "running step 1/3 loss 5.5000 900 tok/s",
        "running step 2/3 loss 4.2500 1,200 tok/s",
        "done step 3/3 loss 3.0000 1,250 tok/s",
    ]
    assert all(line.startswith("[") and " s] " in line for line in lines)


def test_job_line_while_planning_names_the_islands() -> None:
    view = {
        **_job("planning"),
        "planning": {"epoch": 2, "islands": [{"best_cost": 0.25}, {"best_cost": None}]},
    }
    assert job_line(view) == "planning epoch 2: 2 island(s) searched, this island's best 0.25 s/step"


def test_loss_plot(tmp_path: Path) -> None:
    view = {
        "job_id": "ab" * 16,
        "name": "demo",
        "progress": {"losses": [[0, 5.5], [1, 4.0], [2, 3.0]]},
        "allocation": {"stages": [["a"], ["b"]]},
    }
    path = write_loss_plot(view, tmp_path / "plot" / "loss.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_loss_plot({**view, "progress": {}}, tmp_path / "none.png") is None
    held_out = {**view, "progress": {**view["progress"], "val_losses": [[1, 5.0], [2, 4.5]]}}
    path = write_loss_plot(held_out, tmp_path / "held-out.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("state", ["failed", "cancelled"])
def test_follow_job_returns_on_any_final_state(state: str, capsys) -> None:
    assert follow_job(lambda: _job(state), console())["state"] == state


def test_the_held_out_loss_shows_in_the_line_and_the_panel(capsys) -> None:
    view = _job("running", 2, 4.25, 1200.0)
    assert job_line(view) == "running step 2/3 loss 4.2500 1,200 tok/s"
    view["progress"].update(val_loss=4.5, val_losses=[[1, 5.0], [2, 4.5]])
    assert job_line(view) == "running step 2/3 loss 4.2500 held-out 4.5000 1,200 tok/s"
    console().print(job_panel(view, {}))
    assert "held-out loss 5.000" in capsys.readouterr().out


def test_a_waiting_or_failed_job_shows_its_reason(capsys) -> None:
    waiting = {**_job("planning"), "reason": "waiting for 3 more peers: 3 of min_peers 6 are online"}
    assert job_line(waiting) == (
        "planning epoch 0: roster open (waiting for 3 more peers: 3 of min_peers 6 are online)"
    )
    failed = {**_job("failed", 2), "reason": "stage 1 replica 0 (peer …abcdefgh) lost its connection"}
    assert job_line(failed).endswith("(stage 1 replica 0 (peer …abcdefgh) lost its connection)")
    late = {**_job("done"), "short_id": "abababab", "progress": {"step": None, "steps": 120}}
    assert job_line(late).startswith("done step ?/120")
    alloc = {
        "allocation_hash": "f" * 64,
        "epoch": 1,
        "cost": 0.5,
        "stages": [["QmA"], ["QmB"]],
        "pipelines": [["QmA", "QmB"]],
        "spares": ["QmC"],
    }
    view = {**failed, "short_id": "abababab", "allocation": alloc}
    console().print(render_status({"peers": [], "jobs": [view, waiting | {"short_id": "cdcdcdcd"}]}))
    out = capsys.readouterr().out
    assert "spares: QmC" in out
    assert "reason: stage 1 replica 0 (peer …abcdefgh) lost its connection" in out
    assert "waiting for 3 more peers" in out  # the jobs table's reason column


def test_a_recovering_job_shows_its_re_plans_suspects_and_this_tasklets_recovery(capsys) -> None:
    alloc = {
        "allocation_hash": "e" * 64,
        "epoch": 4,
        "cost": 0.5,
        "stages": [["QmA"], ["QmB"]],
        "pipelines": [["QmA", "QmB"]],
        "spares": [],
    }
    view = {
        **_job("recovering", 7),
        "short_id": "efefefef",
        "reason": "re-planning after: peer QmD stopped answering",
        "allocation": alloc,
        "churn": {"replans": [{"epoch": 4, "cause": "peer QmD stopped answering"}], "suspects": ["QmD"]},
        "tasklet": {
            "recoveries": [
                {"resume_step": 0, "seconds": 0.1, "source": "init", "steps_redone": 0},
                {"resume_step": 7, "seconds": 3.2, "source": "peer QmB", "steps_redone": 1},
            ]
        },
    }
    console().print(render_status({"peers": [], "jobs": [view]}))
    out = capsys.readouterr().out
    assert "RECOVERING" in out and "re-plans: 1 (latest in epoch 4: peer QmD stopped answering)" in out
    assert "suspected: QmD" in out
    assert "resumed at step 7 in 3.2 s (state from peer QmB, 1 step(s) redone)" in out


def test_status_says_what_this_peer_refused_by_layer_and_code(capsys) -> None:
    me = {"name": "alpha", "state": "online", "swarm": "default", "peer_id": "Qm" + "a" * 44}
    refusals = {
        "streams": {"BANNED": 2},
        "handlers": {"MALFORMED": 3},
        "dht_records": {},
        "job_records": {"NOT_OWNER": 1},
        "bans": 1,
        "total": 6,
    }
    view = {"peers": [], "self": {**me, "access": "open", "banned": {"QmX": 3.0}}, "refusals": refusals}
    console().print(render_status(view))
    out = capsys.readouterr().out
    line = "refused:   6 (streams: BANNED 2; handlers: MALFORMED 3; job records: NOT_OWNER 1); 1 ban, 1 peer banned now"
    assert line in out
    console().print(
        render_status({"peers": [], "self": me, "refusals": {"streams": {}, "bans": 0, "total": 0}})
    )
    assert "refused:   0\n" in capsys.readouterr().out


def test_a_job_this_peer_does_not_apply_to_says_why(capsys) -> None:
    view = {
        **_job("planning"),
        "short_id": "abababab",
        "not_applying": "this peer takes part in 1 other live jobs (max_jobs)",
    }
    console().print(jobs_table([view]))
    assert "not applying here" in capsys.readouterr().out
    console().print(job_panel(view, {}))
    assert (
        "not applying here: this peer takes part in 1 other live jobs (max_jobs)" in capsys.readouterr().out
    )


def test_the_panel_shows_where_this_tasklets_step_goes(capsys) -> None:
    view = {**_job("running", 2), "tasklet": {"phases_s": {"compute": 0.012, "wait": 0.25, "send": 0.0031}}}
    console().print(job_panel(view, {}))
    assert "this tasklet's step: compute 12 ms, wait 250 ms, send 3 ms" in capsys.readouterr().out
