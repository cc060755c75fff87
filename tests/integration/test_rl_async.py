"""Issue 13's must-show on real daemons: on the same link-bound peers, async GRPO (k = 1) rolls out faster than sync.

Two daemons on loopback (a trainer and a rollout peer: the only allocation, so both arms run on the
same peers), the link between them shaped to 5 Mbit/s and 10 ms one way (``peerd bench rl-swarm
--peers 2 --link-mbps 5 --link-delay-ms 10``): a sync iteration is the rollout peer's weight fetch
(a 192 KB blob, 0.31 s on the wire alone) + sampling + push, then the trainer's update of
192 x 8 completions; k = 1 overlaps the two. The arms run the same job (only ``rl.staleness``
differs), sync first.
"""

from __future__ import annotations

import pytest

from peerd.bench.rl_swarm import Settings, async_comparison

pytestmark = pytest.mark.integration

SETTINGS = Settings(
    peers=2,
    prompts=192,
    warmup_steps=40,
    compare_async=1,
    compare_iterations=16,
    link_mbps=5.0,
    link_delay_ms=10.0,
    job_timeout_s=240,
)
# async / sync rollouts/s between the iterations the polls saw. On a shared 2-core machine at 5 Mbit/s and
# 10 ms it measured 1.21-1.30 over four runs (the trainer's per-iteration median: 1.17-1.59, fewer samples);
# at 10 Mbit/s and 5 ms the mean was higher but the spread too wide (1.05-1.71): the more link-bound
# regime gives the steadier margin. The claim is "faster"; the margin leaves room for a loaded CI machine.
MARGIN = 1.05


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_async_k1_rolls_out_faster_than_sync_on_the_same_shaped_peers() -> None:
    report = async_comparison(SETTINGS)
    sync, lagged = report["arms"]["rl-swarm-staleness0"], report["arms"]["rl-swarm-staleness1"]
    per_iteration = SETTINGS.prompts * SETTINGS.group_size
    for arm, k in ((sync, 0), (lagged, 1)):
        assert arm["state"] == "done" and arm["replans"] == 0
        # every completion of every iteration was trained, each within the staleness bound
        assert arm["completions_trained"] == SETTINGS.compare_iterations * per_iteration
        assert max(lag for lag, _ in arm["staleness"]) <= k
        assert arm["dropped_stale"] == 0 and arm["shards_missing"] == 0
    assert report["same_peers"] and len(sync["rollout_peers"]) == 1
    assert sum(n for lag, n in lagged["staleness"] if lag == 1) > 0  # the overlap did happen

    regime = report["regime"]
    assert regime["link"]["shaped"] and regime["link"]["mbps"] == SETTINGS.link_mbps
    # link-bound: a sync iteration spends longer on the link and waiting than the trainer computes
    assert regime["sync_beyond_compute_s"] > regime["compute_s_per_iteration"]["trainer"]
    ratio, steady = report["async_over_sync_rollouts_per_s"], report["async_over_sync_per_iteration"]
    print(
        f"async / sync rollouts/s: {ratio:.3f} on the trainers' clocks, {steady} median of the polled "
        f"iterations; wall {sync['wall_s']} s vs {lagged['wall_s']} s"
    )
    # the trainers' clocks: the polls see a trainer on another daemon up to a publish interval late
    # at either end of the run, which moved a 16-iteration ratio by +-8 % in CI
    assert report["ratio_source"].startswith("the trainer's own clock")
    assert ratio > MARGIN, report
    # end to end, async must not cost time. Each arm's wall time (~29 s) is mostly planning and the
    # warm-up, the same work in both and noisy by seconds, so the 16 faster iterations' saving sits
    # inside that noise (CI measured 29.16 s vs 29.10 s with the ratio above at 1.22)
    assert lagged["wall_s"] < 1.1 * sync["wall_s"], report
