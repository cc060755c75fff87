"""The demo job: the embedded spec matches configs/jobs/gpt-tiny-demo.yaml, shapes fit the swarm, summary and plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerd.jobs.demo import DEMO_SPEC, demo_shape, demo_spec, summarize
from peerd.jobs.spec import load_job_spec, parse_job_spec
from peerd.loading import load_mapping


def test_embedded_spec_is_the_config_file_with_a_shared_clock() -> None:
    on_disk = load_mapping("configs/jobs/gpt-tiny-demo.yaml")
    embedded = dict(DEMO_SPEC)
    assert embedded.pop("planning") == {**on_disk.pop("planning"), "max_skew_s": 1.0}
    assert embedded == on_disk
    assert (
        parse_job_spec(DEMO_SPEC).planning.timing().vote_s
        < load_job_spec("configs/jobs/gpt-tiny-demo.yaml").planning.timing().vote_s
    )


@pytest.mark.parametrize(
    "peers, shape", [(1, (1, 1)), (2, (2, 1)), (3, (3, 1)), (4, (2, 2)), (6, (3, 2)), (16, (3, 2))]
)
def test_demo_spec_fits_the_swarm(peers: int, shape: tuple[int, int]) -> None:
    assert demo_shape(peers) == shape
    spec = parse_job_spec(demo_spec(peers, steps=12))
    assert (spec.parallel.d_pp, spec.parallel.d_dp) == shape
    assert spec.min_peers == spec.max_peers == shape[0] * shape[1] <= peers
    assert spec.steps == 12 and spec.optimizer.warmup_steps < 12 and spec.checkpoint_interval <= 12


def test_summary_and_loss_plot(tmp_path: Path) -> None:
    view = {
        "job_id": "ab" * 16,
        "name": "demo",
        "state": "done",
        "progress": {
            "step": 3,
            "losses": [[0, 5.5], [1, 4.0], [2, 3.0]],
            "tokens_per_s": 1000.0,
            "bytes": {"activations": 100, "activations_raw": 800, "gradients": 50, "gradients_raw": 200},
        },
        "allocation": {
            "allocation_hash": "cd" * 32,
            "cost": 0.5,
            "stages": [["a"], ["b"]],
            "pipelines": [["a", "b"]],
        },
        "planning": {"islands": [{"best_cost": 0.5}, {"best_cost": None}]},
    }
    s = summarize(view, 0.0)
    assert (s["first_loss"], s["final_loss"]) == (5.5, 3.0)
    assert s["compression_ratio"] == pytest.approx(1000 / 150, rel=1e-3) and s["bytes_saved"] == 850
    assert s["compression_by_kind"] == {"activations": 8.0, "gradients": 4.0}  # averaging sent nothing
    assert s["island_best_cost"] == 0.5


def test_the_demo_job_is_one_where_ac_sgd_engages() -> None:
    """Its examples repeat (steps x batch over the corpus's windows), so deltas go out after first visits."""
    from peerd.jobs.regime import activation_regime
    from peerd.jobs.spec import pin_examples

    spec = pin_examples(parse_job_spec(DEMO_SPEC))
    assert spec.planning.examples is not None and spec.planning.examples < spec.steps * spec.global_batch / 4
    regime = activation_regime(spec)
    assert regime is not None and regime.deltas_engage and regime.first_share < 0.2
    assert regime.first_visit == "q8" and "examples repeat" in regime.describe()
