"""Scenario loading, link resolution and bad-input errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from peerd.errors import ConfigError
from peerd.sched.scenario import Scenario, load_scenario


def _base(**extra):
    data = {
        "name": "t",
        "regions": {
            "names": ["a", "b"],
            "delay_ms": [[1, 11], [12, None]],
            "bandwidth_mbps": [[5000, 1120], [1000, 5000]],
        },
        "devices": [
            {"id": "x", "region": "a", "tflops": 100, "memory_gb": 16},
            {"id": "y", "region": "b", "access_mbps": 100},
            {"id": "z", "region": "b"},
        ],
        "links": [{"src": "x", "dst": "z", "delay_ms": 3}],
    }
    data.update(extra)
    return data


def test_resolution_order_and_units():
    s = Scenario.from_mapping(_base())
    assert s.delay_s("x", "y") == pytest.approx(0.011)
    assert s.delay_s("y", "x") == pytest.approx(0.012)  # directional region matrix
    assert s.delay_s("x", "z") == pytest.approx(0.003)  # device link overrides the region
    assert s.delay_s("z", "x") == pytest.approx(0.012)  # ... in one direction only
    assert s.bandwidth_bps("x", "z") == pytest.approx(1.12e9)  # link without bandwidth falls back
    assert s.bandwidth_bps("x", "y") == pytest.approx(1e8)  # capped by y's access link
    assert s.delay_s("x", "x") == 0.0 and math.isinf(s.bandwidth_bps("x", "x"))
    assert s.devices[0].tflops == 100 and s.devices[1].memory_gb == 0.0


def test_missing_pair_raises_and_matrices_mark_nan():
    s = Scenario.from_mapping(_base())
    with pytest.raises(ConfigError, match=r"'y' -> 'z'"):
        s.delay_s("y", "z")
    d = s.delay_matrix()
    assert d.shape == (3, 3) and np.isnan(d[1, 2]) and np.isnan(d[2, 1])
    assert s.missing_pairs() == [("y", "z"), ("z", "y")]
    with pytest.raises(ValueError):
        d[0, 1] = 5.0  # read-only: cost code may cache views of it


def test_estimate_missing_uses_two_hop_relay():
    s = Scenario.from_mapping(_base(estimate_missing=True))
    # y -> z through x: 12 ms + 3 ms; bandwidth min(100 Mbit/s access cap, 1.12 Gbit/s)
    assert s.delay_s("y", "z") == pytest.approx(0.015)
    assert s.bandwidth_bps("y", "z") == pytest.approx(1e8)


def test_minimal_file_without_model_or_training(tmp_path):
    path = tmp_path / "pair.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "loopback pair",
                "devices": [{"id": "p0"}, {"id": "p1"}],
                "links": [
                    {"src": "p0", "dst": "p1", "delay_ms": 20, "bandwidth_mbps": 50, "symmetric": True}
                ],
            }
        )
    )
    s = load_scenario(path)
    assert s.model is None and s.training is None
    assert s.delay_s("p1", "p0") == pytest.approx(0.02)
    assert s.bandwidth_bps("p0", "p1") == pytest.approx(5e7)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        (
            {"regions": {"names": ["a"], "delay_ms": [[1]], "bandwidth_mbps": [[0]]}},
            "regions.bandwidth_mbps[0][0]",
        ),
        (
            {"regions": {"names": ["a"], "delay_ms": [[1]], "bandwidth_mbps": [[-5]]}},
            "regions.bandwidth_mbps[0][0]",
        ),
        ({"regions": {"names": ["a", "b"], "delay_ms": [[1]], "bandwidth_mbps": [[1]]}}, "regions.delay_ms"),
        ({"regions": {"names": ["a", "a"], "delay_ms": [], "bandwidth_mbps": []}}, "regions.names"),
        ({"devices": [{"id": "x", "region": "nowhere"}]}, "devices[0].region"),
        ({"devices": [{"id": "x", "region": "a"}, {"id": "x", "region": "a"}]}, "devices[1].id"),
        ({"devices": [{"id": "x", "region": "a", "memory_gb": -1}]}, "devices[0].memory_gb"),
        ({"links": [{"src": "x", "dst": "q", "delay_ms": 1}]}, "links[0].dst"),
        ({"links": [{"src": "x", "dst": "y", "bandwidth_mbps": 0}]}, "links[0].bandwidth_mbps"),
        ({"training": {"global_batch": 8, "d_dp": -2}}, "training.d_dp"),
        ({"training": {"global_batch": 8, "forward_ratio": 2}}, "training.forward_ratio"),
        ({"model": {"layers": 2, "hidden": 8, "seq": 4, "layer_params": [1]}}, "model.layer_params"),
        ({"devices": [{"id": "x", "region": "a", "message_us": 250}]}, "devices[0].message_us"),
        ({"devices": [{"id": "x", "region": "a", "idle_cores": 0.1}]}, "devices[0].idle_cores"),
        ({"colour": "blue"}, "colour"),
        ({"devices": []}, "devices"),
    ],
)
def test_bad_input_names_the_field(patch, field):
    with pytest.raises(ConfigError) as info:
        Scenario.from_mapping(_base(**patch))
    assert field in {e.field for e in info.value.errors}  # with the others it causes (every one is reported)


def test_bad_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_scenario(path)
