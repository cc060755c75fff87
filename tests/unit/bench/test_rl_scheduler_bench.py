"""The RL scheduler bench's reading of the quality-vs-budget curve and its tiny section."""

from peerd.bench.rl_scheduler import bench_tiny, first_within


def test_first_within_takes_the_smallest_good_budget():
    curve = [
        {"budget": 400, "gap_to_exact": 0.01, "time_s": 0.4},
        {"budget": 100, "gap_to_exact": 0.08, "time_s": 0.1},
        {"budget": 1500, "gap_to_exact": 0.0, "time_s": 1.5},
    ]
    assert first_within(curve, 0.05)["budget"] == 400
    assert first_within(curve, 0.1)["budget"] == 100
    assert first_within(curve, 0.001)["budget"] == 1500
    assert first_within(curve[1:2], 0.05) is None


def test_tiny_section_exact_equals_brute_force():
    out = bench_tiny()
    assert set(out) == {"tiny-6", "tiny-7-async", "tiny-6-ppo"}
    for case in out.values():
        assert case["exact_equals_brute_force"], case
        assert case["devices"] <= 8
