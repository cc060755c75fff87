"""``peerd bench consensus``'s in-process quality run, tiny: the report's shape and its invariants."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner

from peerd.bench.consensus import command, island_seed


def test_quality_run_reports_ratios_against_islands() -> None:
    result = CliRunner().invoke(
        command,
        ["--skip-swarm", "--devices", "8", "--islands", "2", "--generations", "2", "--migrate-every", "1"],
    )
    assert result.exit_code == 0, result.output

    report = json.loads(result.output)
    (row,) = report["quality"]
    assert row["devices"] == 8 and row["islands"] == 2
    for key in ("committed_vs_best_isolated_island", "committed_vs_single_island_same_budget"):
        assert math.isfinite(row[key]) and row[key] > 0
    assert row["islands_agreeing_on_the_winner"] >= 1  # the winner is one island's final candidate
    assert "latency" not in report


def test_island_seeds_follow_the_consensus_machine() -> None:
    from peerd.sched.consensus.machine import ConsensusConfig, ConsensusMachine
    from peerd.sched.consensus.messages import RosterDevice

    machine = ConsensusMachine("job", "QmPeer", ConsensusConfig(0.0), lambda r, a: 0.0, RosterDevice(1.0, 1))
    assert island_seed("job", 3, "QmPeer") == machine._island_seed(3)
