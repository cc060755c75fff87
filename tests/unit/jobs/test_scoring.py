"""The job's cost model on consensus rosters larger than its shape: spares, auto shapes, runnable widths."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest

from peerd.errors import ConfigError
from peerd.jobs.island import IslandThread
from peerd.jobs.scoring import RosterScorer, job_model, job_shapes
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink
from peerd.sched.problem import Shape
from peerd.wire.types import ElementCosts

PEERS = [f"Qm{c * 20}" for c in "abcdefgh"]


def spec(d_pp: int | str, d_dp: int | str, **extra: Any) -> JobSpec:
    mapping: dict[str, Any] = {
        "name": "elastic",
        "kind": "pretrain",
        "model": {"preset": "tiny"},
        "steps": 10,
        "global_batch": 16,
        "micro_batch": 4,
        "data": {"seq_len": 32},
        "parallel": {"d_pp": d_pp, "d_dp": d_dp},
        "min_peers": 4,
        "max_peers": 5,
    }
    mapping.update(extra)
    return parse_job_spec(mapping)


def roster(n: int) -> Roster:
    """``n`` peers, the first one slow (the obvious spare), links measured one way only."""
    peers = PEERS[:n]
    entries = [
        RosterEntry(
            job="j" * 32,
            epoch=0,
            peer=p,
            issued_at=0.0,
            profile=RosterDevice(1e-5 if i == 0 else 0.2 + 0.01 * i, 8 << 30, "eu"),
            links=tuple(RosterLink(q, 0.002 + 0.001 * j, 1e9) for j, q in enumerate(peers) if q > p),
        )
        for i, p in enumerate(peers)
    ]
    return Roster.of(0, entries)


def search(scorer: RosterScorer, r: Roster, seed: int = 1) -> Allocation:
    island = scorer.island(scorer.scenario(r), seed, time_budget=2.0)
    island.step(3)
    return island.best(1)[0]


def test_a_fixed_two_by_two_job_on_five_peers_plans_with_one_spare() -> None:
    s, r = spec(2, 2), roster(5)
    scorer = RosterScorer(s)
    alloc = search(scorer, r)
    assert (alloc.d_pp, alloc.d_dp) == (2, 2)
    assert alloc.spares == (PEERS[0],)  # the slow device waits
    assert sorted([*alloc.devices, *alloc.spares]) == sorted(r.peers)
    cost = scorer(r, alloc)
    # another peer re-scores the candidate from the same roster: the same cost, bit for bit
    assert RosterScorer(s)(r, alloc) == cost > 0
    # the same tasklets with the spare swapped in for a fast peer is a different, worse allocation
    fast = alloc.stages[0][0]
    swapped = Allocation(
        tuple(tuple(PEERS[0] if d == fast else d for d in stage) for stage in alloc.stages),
        (fast,),
        alloc.layers,
    )
    assert scorer(r, swapped) > cost


def test_shapes_the_runtime_cannot_run_are_refused() -> None:
    s, r = spec(2, 2), roster(5)
    scorer = RosterScorer(s)
    one_stage = Allocation(((PEERS[1], PEERS[2], PEERS[3], PEERS[4]),), (PEERS[0],))
    with pytest.raises(ConfigError, match="shape 1x4 is not allowed"):
        scorer(r, one_stage)
    with pytest.raises(ConfigError, match="tasklets need 4 devices"):
        scorer(roster(3), Allocation(((PEERS[0], PEERS[1]), (PEERS[2],))))


def test_auto_shapes_offer_only_widths_that_keep_the_global_batch() -> None:
    s, r = spec("auto", "auto"), roster(5)
    scorer = RosterScorer(s)
    shapes = job_shapes(scorer.scenario(r), scorer.jm)
    assert {sh.d_dp for sh in shapes} == {1, 2, 4}  # 16 examples in whole micro-batches of 4
    assert all(sh.active <= 5 for sh in shapes) and Shape(1, 4) in shapes
    alloc = search(scorer, r, seed=5)
    assert Shape(alloc.d_pp, alloc.d_dp) in shapes
    assert len(alloc.devices) + len(alloc.spares) == 5
    assert RosterScorer(s)(r, alloc) == scorer(r, alloc)
    # a width of 5 would need 16 / 5 examples per replica: not proposed, and refused when offered
    wide = Allocation((tuple(PEERS[:5]),))
    with pytest.raises(ConfigError, match="not allowed"):
        scorer(r, wide)


def test_a_model_with_tied_weights_plans_one_stage() -> None:
    tied = {"preset": "tiny", "overrides": {"tie_weights": True}}
    with pytest.raises(ConfigError, match="ties its embedding and head"):
        job_model(spec(2, 2, model=tied))
    scorer = RosterScorer(spec("auto", "auto", model=tied))
    shapes = job_shapes(scorer.scenario(roster(5)), scorer.jm)
    assert shapes and {sh.d_pp for sh in shapes} == {1}


def test_the_dtfm_objective_says_it_uses_every_peer() -> None:
    s = spec(2, 2, planning={"objective": "dtfm"})
    scorer = RosterScorer(s)
    with pytest.raises(ConfigError, match="uses every device"):
        job_shapes(scorer.scenario(roster(5)), scorer.jm)
    assert job_shapes(scorer.scenario(roster(4)), scorer.jm) == [Shape(2, 2)]


def test_an_island_that_cannot_search_reports_why_without_a_traceback(caplog) -> None:
    scorer = RosterScorer(spec(2, 2, planning={"objective": "dtfm"}))
    scenario = scorer.scenario(roster(5))
    thread = IslandThread(
        lambda: scorer.island(scenario, 1, time_budget=1.0), epoch=3, seed=1, deadline=1e18, clock=time.time
    )
    with caplog.at_level(logging.WARNING, logger="peerd.jobs.island"):
        thread.start()
        give_up = time.monotonic() + 30
        while thread.running and time.monotonic() < give_up:
            time.sleep(0.01)
    assert not thread.running, "the island thread did not end on its error"
    assert "uses every device" in thread.report.error and "[CONFIG_INVALID]" not in thread.report.error
    assert caplog.records and all(r.exc_info is None for r in caplog.records)


# ---------------------------------------------------------------- memory: what the peers measured free


def _with_memory(r: Roster, peer: str, memory: int) -> Roster:
    entries = [
        RosterEntry(
            e.job,
            e.epoch,
            e.peer,
            e.issued_at,
            RosterDevice(e.profile.tflops, memory, e.profile.region),
            e.links,
        )
        if e.peer == peer
        else e
        for e in r.entries
    ]
    return Roster.of(r.epoch, entries)


def test_a_roster_entry_carries_the_free_memory_the_peer_measured() -> None:
    from peerd.jobs.service import roster_profile
    from peerd.swarm.records import DeviceKind, DeviceProfile

    profile = DeviceProfile(
        name="gpu",
        kind=DeviceKind.CUDA,
        memory_total_bytes=80 << 30,
        memory_free_bytes=3 << 30,
        measured_at=1.0,
    )
    assert roster_profile(profile, "eu").memory_bytes == 3 << 30  # free, not total
    # a record from a platform that cannot tell free memory (the field is optional): the total
    unknown = DeviceProfile(name="cpu", kind=DeviceKind.CPU, memory_total_bytes=8 << 30, measured_at=1.0)
    assert roster_profile(unknown, "eu").memory_bytes == 8 << 30
    assert roster_profile(unknown, "eu").launch_s is None  # a peer that predates the measurement
    measured = DeviceProfile(
        name="cpu", kind=DeviceKind.CPU, memory_total_bytes=8 << 30, measured_at=1.0, launch_us=3.5
    )
    assert roster_profile(measured, "eu").launch_s == pytest.approx(3.5e-6)
    assert roster_profile(measured, "eu").element_s is None  # a peer that predates the measurement
    costs = ElementCosts(gelu=1.0, softmax=0.25, attention=600.0, attention_backward=900.0)
    in_ns = roster_profile(msgspec.structs.replace(measured, element_ns=costs), "eu").element_s
    assert in_ns is not None
    assert msgspec.structs.astuple(in_ns) == pytest.approx((1e-9, 0.25e-9, 600e-9, 900e-9))
    assert roster_profile(measured, "eu").host is None  # a peer that predates the machine's id
    on_box = DeviceProfile(
        name="cpu",
        kind=DeviceKind.CPU,
        memory_total_bytes=8 << 30,
        measured_at=1.0,
        host_id="0123456789abcdef",
        host_cores=2,
        threads=1,
    )
    device = roster_profile(on_box, "eu")
    assert (device.host, device.host_cores, device.threads) == ("0123456789abcdef", 2, 1)
    assert device.message_s is None and device.idle_cores is None  # not measured
    busy = msgspec.structs.replace(
        on_box, message_us=250.0, wire_byte_ns=1.5, idle_cores=0.04, codec_us=900.0, codec_value_ns=4.0
    )
    device = roster_profile(busy, "eu")
    assert (device.message_s, device.wire_byte_s, device.idle_cores) == pytest.approx((250e-6, 1.5e-9, 0.04))
    assert (device.codec_s, device.codec_value_s) == pytest.approx((900e-6, 4e-9))
    # the machine they are spent on is what makes them priceable: without it they stay home
    homeless = roster_profile(msgspec.structs.replace(busy, host_id=None), "eu")
    assert (homeless.message_s, homeless.wire_byte_s, homeless.idle_cores) == (None, None, None)
    assert (homeless.codec_s, homeless.codec_value_s) == (None, None)


def test_a_peer_whose_free_memory_cannot_hold_a_stage_is_never_allocated_one() -> None:
    s = spec(2, 2)
    r = roster(5)
    full = RosterScorer(s)
    best = search(full, r)
    starved = next(p for p in best.devices)  # a fast peer the search wanted, now nearly out of memory
    r2 = _with_memory(r, starved, 64 << 10)  # 64 KiB free: not even one tiny layer with its Adam state
    scorer = RosterScorer(s)
    for seed in (1, 2, 3):
        alloc = search(scorer, r2, seed)
        assert starved not in alloc.devices and starved in alloc.spares
        assert scorer(r2, alloc) > 0
    # the allocation that still holds it is no candidate: scoring refuses it, naming the memory
    with pytest.raises(ConfigError, match="free memory"):
        scorer(r2, best)
    # with only four peers, one of them starved, no 2 x 2 allocation fits: none is scorable
    four = _with_memory(roster(4), PEERS[2], 64 << 10)
    island = scorer.island(scorer.scenario(four), 1, time_budget=2.0)
    island.step(3)
    with pytest.raises(ConfigError, match="free memory"):
        scorer(four, island.best(1)[0])


def test_the_memory_a_stage_needs_follows_the_optimizer() -> None:
    from peerd.jobs.scoring import state_bytes_per_param

    assert state_bytes_per_param(spec(2, 2)) == 16.0  # adamw: weights, gradients, two moments
    assert state_bytes_per_param(spec(2, 2, optimizer={"name": "sgd", "momentum": 0.9})) == 12.0
    assert state_bytes_per_param(spec(2, 2, optimizer={"name": "sgd"})) == 8.0
    assert job_model(spec(2, 2, optimizer={"name": "sgd"})).training.state_bytes_per_param == 8.0


def test_a_pretraining_job_prices_its_layers_work_at_each_peers_measured_costs() -> None:
    """Under the peerd objective the job model carries each layer's counted work
    (``peerd.pipeline.launches``), and a roster entry's launch, bandwidth and element costs reach the
    scenario: the same allocation costs more on peers that measured them than on bare profiles."""
    job = spec(2, 2, planning={"objective": "peerd"})
    jm = job_model(job)
    assert jm.model.layer_work is not None and len(jm.model.layer_work) == jm.model.layers
    assert jm.training.averaging_work is not None
    dtfm = job_model(spec(2, 2, planning={"objective": "dtfm"}))
    assert dtfm.model.layer_work is None and dtfm.training.averaging_work is None
    bare = roster(4)
    costs = ElementCosts(gelu=1e-9, softmax=0.2e-9, attention=700e-9, attention_backward=900e-9)
    measured = Roster.of(
        0,
        [
            msgspec.structs.replace(
                e,
                profile=msgspec.structs.replace(
                    e.profile, launch_s=3e-6, memory_bandwidth=3e10, element_s=costs
                ),
            )
            for e in bare.entries
        ],
    )
    scorer = RosterScorer(job)
    scenario = scorer.scenario(measured)
    assert [d.launch_us for d in scenario.devices] == pytest.approx([3.0] * 4)
    assert [d.memory_bandwidth_gb_s for d in scenario.devices] == pytest.approx([30.0] * 4)
    alloc = Allocation(((PEERS[1], PEERS[2]), (PEERS[3], PEERS[0])))
    plain, priced = scorer.cost(bare, alloc), scorer.cost(measured, alloc)
    assert priced.parts["compute_per_micro_batch"] > plain.parts["compute_per_micro_batch"]
    # the replicas' averaging arithmetic too, at the same costs (groups of 2): its ops and the bytes
    # of one stage's values, fewer than the model's
    ops, per_value = jm.training.averaging_work.at(2)
    added = priced.parts["dp"] - plain.parts["dp"]
    assert ops * 3e-6 < added < ops * 3e-6 + sum(jm.model.layer_params) * per_value / 3e10


def test_peers_sharing_a_machine_are_priced_its_cores_for_their_compute_and_messages() -> None:
    """Roster entries on one machine that declare what a message costs it and their idle load: the
    scenario carries both, and the cost has a floor of the layout's CPU time over the cores left."""
    job = spec(2, 2, planning={"objective": "peerd"})
    bare = roster(4)

    def on_box(message_s: float | None, idle: float | None) -> Roster:
        profile = {"host": "0123456789abcdef", "host_cores": 2, "threads": 1}
        if message_s is not None:
            profile |= {"message_s": message_s, "wire_byte_s": 2e-9, "idle_cores": idle}
            profile |= {"codec_s": 1e-3, "codec_value_s": 3e-9}
        return Roster.of(
            0,
            [
                msgspec.structs.replace(e, profile=msgspec.structs.replace(e.profile, **profile))
                for e in bare.entries
            ],
        )

    scorer = RosterScorer(job)
    busy = on_box(5e-3, 0.3)
    devices = scorer.scenario(busy).devices
    for d in devices:
        assert (d.message_us, d.wire_byte_ns, d.idle_cores) == pytest.approx((5e3, 2.0, 0.3))
        assert (d.codec_us, d.codec_value_ns) == pytest.approx((1e3, 3.0))
    alloc = Allocation(((PEERS[1], PEERS[2]), (PEERS[3], PEERS[0])))
    shared, priced = scorer.cost(on_box(None, None), alloc), scorer.cost(busy, alloc)
    assert priced.parts["host_cpu"] > shared.parts["host_cpu"] > 0
    # each hop also waits for its ends' message and codec CPU: the pipeline and the norm's trip grow
    assert shared.parts["hop_cpu_per_micro_batch"] == 0 < priced.parts["hop_cpu_per_micro_batch"]
    assert priced.parts["pp"] > shared.parts["pp"] and priced.parts["norm"] > shared.parts["norm"]
    links = sum(priced.parts[k] for k in ("pp", "dp", "norm", "update"))
    assert priced.total == pytest.approx(max(priced.parts["host_cpu"], links))
