"""AC-SGD's regime: visits per example, the share of first visits and the wire ratio the planner prices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peerd.compress.codecs import make_codec
from peerd.errors import ConfigError
from peerd.jobs.demo import DEMO_SPEC
from peerd.jobs.regime import activation_regime, visits_per_example
from peerd.jobs.runner import train_config
from peerd.jobs.scoring import job_model
from peerd.jobs.spec import JobSpec, JobSpecError, parse_job_spec, pin_examples
from peerd.sched.allocation import Allocation


def _spec(examples: int | None = None, **compression) -> JobSpec:
    data = {**DEMO_SPEC, "compression": {**DEMO_SPEC["compression"], **compression}}
    data["planning"] = {**data["planning"], "examples": examples}
    return parse_job_spec(data)


def test_a_single_pass_sends_every_activation_through_the_first_visit_codec():
    spec = _spec(examples=16_383)  # 1 MiB of text: 120 x 16 = 1920 of 16383 windows
    assert visits_per_example(spec) == pytest.approx(1920 / 16_383)
    regime = activation_regime(spec)
    assert regime is not None and not regime.deltas_engage
    assert regime.forward_ratio == pytest.approx(8 / 32)  # q8, not fp32
    assert "single pass" in regime.describe() and "q8" in regime.describe()


def test_repeated_examples_send_deltas_after_their_first_visit():
    spec = _spec(examples=240)  # 1920 visits: 8 each, the first through q8
    regime = activation_regime(spec)
    assert regime is not None and regime.first_share == pytest.approx(1 / 8)
    assert regime.forward_ratio == pytest.approx(1 / 8 * 8 / 32 + 7 / 8 * 4 / 32)
    assert "8.0 visits each" in regime.describe()
    raw = activation_regime(_spec(examples=240, first_visit="fp32"))
    assert raw is not None and raw.forward_ratio == pytest.approx(1 / 8 + 7 / 8 * 4 / 32)


def test_examples_beyond_the_buffers_room_always_go_as_first_visits():
    spec = _spec(examples=240)
    wide = activation_regime(spec, hidden=2_000_000)  # 8 GiB / (64 x 2e6 x 4 B) = 16 examples buffered
    assert wide is not None and wide.buffered == 16
    assert wide.first_share == pytest.approx(1 - 16 / 240 * (1 - 1 / 8))


def test_unknown_examples_are_priced_as_a_single_pass_and_other_codecs_have_no_regime():
    regime = activation_regime(_spec(examples=None))
    assert regime is not None and regime.first_share == 1.0 and "examples unknown" in regime.describe()
    direct = parse_job_spec({**DEMO_SPEC, "compression": {"forward": "direct", "forward_bits": 4}})
    assert activation_regime(direct) is None


def test_the_planner_prices_the_ratio_the_regime_gets():
    single, repeated = job_model(_spec(examples=16_383)), job_model(_spec(examples=240))
    assert single.training.forward_ratio == pytest.approx(0.25)
    assert repeated.training.forward_ratio == pytest.approx(
        activation_regime(_spec(examples=240)).forward_ratio
    )
    direct = parse_job_spec({**DEMO_SPEC, "compression": {"forward": "direct", "forward_bits": 4}})
    assert job_model(direct).training.forward_ratio == pytest.approx(4 / 32)


def test_first_visit_is_checked_and_reaches_the_runtime():
    with pytest.raises(JobSpecError) as bad:
        _spec(first_visit="q5")
    assert "compression.first_visit" in str(bad.value)
    with pytest.raises(JobSpecError) as misplaced:
        parse_job_spec(
            {**DEMO_SPEC, "compression": {"forward": "direct", "forward_bits": 4, "first_visit": "q8"}}
        )
    assert "applies to forward: acsgd only" in str(misplaced.value)
    alloc = Allocation(stages=(("a", "b"), ("c", "d"), ("e", "f")))
    assert train_config("j", _spec(), alloc, None).compression.seed_codec == "q8"  # the default
    assert train_config("j", _spec(first_visit="q4"), alloc, None).compression.seed_codec == "q4"


def test_pin_examples_counts_the_corpus_windows_unless_the_spec_states_them():
    spec = pin_examples(_spec())
    assert spec.planning.examples == 255  # (16384 - 65) // 64 + 1
    assert pin_examples(_spec(examples=7)).planning.examples == 7
    hf = dataclasses.replace(
        spec, data=dataclasses.replace(spec.data, source="hf", hf_name="x"), planning=_spec().planning
    )
    assert pin_examples(hf).planning.examples is None  # not read at submit
    tiny = dataclasses.replace(
        spec, data=dataclasses.replace(spec.data, max_bytes=10), planning=_spec().planning
    )
    with pytest.raises(ConfigError):
        pin_examples(tiny)


def _reference_direct(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A plain direct quantizer (the baseline a first-visit codec must not lose to): per row of the
    last dimension, min-max uniform levels at ``bits``, round to nearest."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo).clamp_min(1e-12) / (2**bits - 1)
    return lo + torch.round((x - lo) / step) * step


@pytest.mark.parametrize("bits", [8, 4])
def test_the_first_visit_codec_errs_no_more_than_a_plain_direct_quantizer(bits: int):
    gen = torch.Generator().manual_seed(bits)
    # activation-like rows: mostly small, a few large outlier channels (what transformer blocks emit)
    x = torch.randn(8, 64, 128, generator=gen)
    x[..., :3] *= 20.0
    codec = make_codec(f"q{bits}")
    data, _ = codec.encode(x)
    ours = codec.decode(data)
    mine = float((ours - x).square().mean() / x.square().mean())
    theirs = float((_reference_direct(x, bits) - x).square().mean() / x.square().mean())
    assert mine <= theirs * 1.05, (mine, theirs)


def test_examples_are_refused_where_they_price_nothing():
    direct = {**DEMO_SPEC, "compression": {"forward": "direct", "forward_bits": 4}}
    with pytest.raises(JobSpecError) as refused:
        parse_job_spec({**direct, "planning": {**DEMO_SPEC["planning"], "examples": 255}})
    assert "planning.examples" in str(refused.value)
    assert pin_examples(parse_job_spec(direct)).planning.examples is None  # not counted either
