"""The (a) vs (d) crossover of ``peerd bench wan``: its arithmetic on a hand-checked case."""

from __future__ import annotations

import math

import pytest

from peerd.bench.wan import PEER_COUNTS, arm_spec, arms, crossover, shape, slowest_link_mbps, tiny_sizes


def test_pipeline_with_compression_wins_below_the_bandwidth_the_arithmetic_predicts():
    a_arm, d_arm = arms(1)[0], arms(1)[-1]
    spec_a, spec_d = arm_spec(a_arm, 8, 20), arm_spec(d_arm, 8, 20)
    sizes = tiny_sizes(spec_a)  # 4 stages x 2 replicas; d: 1 x 8
    params = sizes["params"]
    # compute: 1.6 s for the batch / 8 peers x (8 peers / 2 cores); a's bubble (4 - 1) / 4 micro-batches
    c_a, c_d = 0.8 * (1 + 3 / 4), 0.8
    # bytes: a sends activations at 4 bits and their gradients at 8, and half its stage's 8-bit gradients
    v_a = sizes["c_pp_bytes"] * (4 + 8) / 32 + 2 * sizes["c_dp_bytes"] * (1 / 2) * 8 / 32
    v_d = 2 * params * 4 * (7 / 8) * 8 / 32  # the whole model's 8-bit ring share
    out = crossover(spec_a, spec_d, 1.6, 8, 2, link_mbps=10.0)
    assert out["a"]["compute_s"] == pytest.approx(c_a) and out["d"]["compute_s"] == pytest.approx(c_d)
    assert out["a"]["bytes"] == pytest.approx(v_a) and out["d"]["bytes"] == pytest.approx(v_d)
    b_star = (v_d - v_a) / (c_a - c_d)
    assert out["crossover_mbps"] == pytest.approx(b_star * 8 / 1e6)
    scaled = crossover(spec_a, spec_d, 1.6, 8, 2, link_mbps=10.0, bandwidth_factor=0.02)
    assert scaled["crossover_unscaled_mbps"] == pytest.approx(b_star * 8 / 1e6 / 0.02)  # the real links'
    link = 10e6 / 8
    assert out["predicted_a_over_d_tokens_per_s"] == pytest.approx((c_d + v_d / link) / (c_a + v_a / link))
    # at the crossover both arms take the same time; below it a is faster, above it d
    for mbps, a_faster in ((out["crossover_mbps"] / 2, True), (out["crossover_mbps"] * 2, False)):
        ratio = crossover(spec_a, spec_d, 1.6, 8, 2, link_mbps=mbps)["predicted_a_over_d_tokens_per_s"]
        assert (ratio > 1) == a_faster


def test_the_same_shape_and_bits_leave_bandwidth_nothing_to_decide():
    a_arm, d_arm = arms(1)[0], arms(1)[-1]
    spec_a = arm_spec(a_arm, 2, 20)  # 1 stage x 2 replicas, 8-bit gradients: what d is on 2 peers
    spec_d = arm_spec(d_arm, 2, 20)
    out = crossover(spec_a, spec_d, 1.0, 2, 2, link_mbps=100.0)
    assert out["crossover_mbps"] is None  # the same bytes: bandwidth decides nothing
    assert "never wins on bandwidth" in out["verdict"]


def test_the_slowest_link_is_between_two_used_regions():
    shaped = {
        "regions": {"names": ["x", "y", "z"], "bandwidth_mbps": [[100, 5, 1], [5, 100, 1], [1, 1, 100]]},
        "devices": [{"id": "p0", "region": "x"}, {"id": "p1", "region": "y"}, {"id": "p2", "region": "y"}],
    }
    assert slowest_link_mbps(shaped) == 5.0  # z holds no peer
    assert math.isinf(slowest_link_mbps({**shaped, "devices": shaped["devices"][:1]}))


@pytest.mark.parametrize(("peers", "expected"), [(4, (2, 2)), (8, (4, 2)), (16, (4, 4))])
def test_every_peer_count_the_cli_accepts_gets_a_shape_the_job_spec_accepts(peers, expected):
    assert peers in PEER_COUNTS and shape(peers) == expected
    for arm in arms(1):
        spec = arm_spec(arm, peers, 20)  # parses the job spec: 16 peers once asked for 8 stages of 6 layers
        parallel = spec["parallel"]
        assert parallel["d_pp"] * parallel["d_dp"] == peers
