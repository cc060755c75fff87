"""The rl job's cost model on consensus rosters: roles (R trainers, rollout peers), the RL cost model's time, the island."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import pytest
from msgspec.structs import replace

from peerd.errors import ConfigError
from peerd.jobs.scoring_rl import RLRosterScorer, required_rollouts, rl_workload, roles
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.models.costs import matmul_params
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink
from peerd.sched.elements import PerFamily
from peerd.sched.hosts import HostShare
from peerd.wire.types import ElementCosts

PEERS = [f"Qm{c * 20}" for c in "abcdef"]
RL_JOB: dict[str, Any] = {
    "kind": "rl",
    "model": {"preset": "tiny"},
    "steps": 20,
    "global_batch": 64,
    "micro_batch": 32,
    "min_peers": 3,
    "rl": {"task": {"name": "addition", "max_size": 2}, "group_size": 8, "sampling": {"max_new_tokens": 6}},
}


def roster(
    tflops: list[float],
    bandwidth: list[float | None],
    link_bps: float = 1e9,
    launch: list[float | None] | None = None,
    host: HostShare | None = None,
) -> Roster:
    """Peers with these rates, every link ``link_bps`` and 1 ms; ``host``: all on that one machine."""
    peers = PEERS[: len(tflops)]
    launch = launch or [None] * len(tflops)
    machine = (host.host, host.cores, host.threads) if host is not None else (None, None, None)
    entries = [
        RosterEntry(
            job="j" * 32,
            epoch=0,
            peer=p,
            issued_at=0.0,
            profile=RosterDevice(tflops[i], 8 << 30, "eu", bandwidth[i], launch[i], *machine),
            links=tuple(RosterLink(q, 0.001, link_bps) for q in peers if q > p),
        )
        for i, p in enumerate(peers)
    ]
    return Roster.of(0, entries)


def test_the_workload_is_the_specs_iteration() -> None:
    w = rl_workload(parse_job_spec(RL_JOB))
    assert (w.prompts, w.responses_per_prompt, w.response_len) == (8, 8, 6)
    assert w.optimizer_steps == 2 and w.micro_batch == 32 and w.staleness == 0
    assert w.prompt_len > 0 and w.actor.layers == 2 and w.actor.params > 0
    assert w.constants.weight_bytes == 4.0  # fp32, as the runtime computes


def dp_spec(d_dp: int) -> JobSpec:
    """``RL_JOB`` with ``d_dp`` trainers, built around the spec's checks (which still say one trainer)."""
    spec = parse_job_spec(RL_JOB)
    return dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, d_pp=1, d_dp=d_dp))


def with_link(r: Roster, a: str, b: str, bps: float) -> Roster:
    """``r`` with the link between peers ``a`` and ``b`` at ``bps``."""
    entries = [
        RosterEntry(
            **{
                **{f: getattr(e, f) for f in e.__struct_fields__},
                "links": tuple(
                    RosterLink(lk.peer, lk.delay_s, bps if {e.peer, lk.peer} == {a, b} else lk.bandwidth_bps)
                    for lk in e.links
                ),
            }
        )
        for e in r.entries
    ]
    return Roster.of(r.epoch, entries)


def test_roles_and_their_errors() -> None:
    assert roles(Allocation(((PEERS[0],),), (PEERS[2], PEERS[1]))) == ((PEERS[0],), (PEERS[1], PEERS[2]))
    # R trainers in replica order; no rollout peer is the colocated plan
    assert roles(Allocation(((PEERS[1], PEERS[0]),), (PEERS[2],))) == ((PEERS[1], PEERS[0]), (PEERS[2],))
    assert roles(Allocation(((PEERS[0],),))) == ((PEERS[0],), ())
    with pytest.raises(ConfigError, match="one stage"):
        roles(Allocation(((PEERS[0],), (PEERS[1],)), (PEERS[2],)))
    with pytest.raises(ConfigError, match="two roles"):
        roles(Allocation(((PEERS[0],),), (PEERS[0],)))


def test_the_fastest_peer_trains_and_more_rollout_peers_generate_faster() -> None:
    spec = parse_job_spec({**RL_JOB, "rl": {**RL_JOB["rl"], "min_rollout_peers": 1}})
    r = roster([0.05, 0.2, 0.05, 0.05], [5e9] * 4, link_bps=1e11)  # each copy of the weights is cheap
    scorer = RLRosterScorer(spec)
    island = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
    island.step(5)
    best = island.best(1)[0]
    (trainer,), _ = roles(best)
    assert trainer == PEERS[1]  # 4x the TFLOPS: training is the heavy task
    # a peer re-scoring the candidate gets the island's cost, bit for bit
    assert RLRosterScorer(spec)(r, best) == island.best_cost() == scorer(r, best)
    one = Allocation(((PEERS[1],),), (PEERS[0],))
    assert scorer(r, one) > scorer(r, Allocation(((PEERS[1],),), (PEERS[0], PEERS[2], PEERS[3])))
    parts = scorer.predict(r, best)
    assert set(parts.tasks) == {"generate", "reference", "actor_train"} and parts.sync > 0


def test_generation_is_timed_by_memory_bandwidth() -> None:
    spec = parse_job_spec(RL_JOB)
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    fast = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10]), alloc)
    slow = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e8]), alloc)
    assert slow.tasks["generate"] > fast.tasks["generate"]
    assert slow.tasks["actor_train"] == fast.tasks["actor_train"]


def test_a_peer_that_measured_its_launch_cost_pays_it_per_counted_op() -> None:
    spec = parse_job_spec(RL_JOB)
    ops = rl_workload(spec).launches
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    plain = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10]), alloc)
    # the trainer (PEERS[0]) at 10 µs per op, the rollout peer predating the measurement
    costly = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10], launch=[1e-5, None]), alloc)
    assert costly.tasks["generate"] == plain.tasks["generate"]
    assert costly.tasks["reference"] - plain.tasks["reference"] == pytest.approx(ops.inference * 1e-5)
    updates = ops.train + ops.train_per_micro_batch * 2  # two optimizer steps of one micro-batch each
    assert costly.tasks["actor_train"] - plain.tasks["actor_train"] == pytest.approx(updates * 1e-5)


def test_a_peer_that_measured_its_element_costs_pays_them_per_counted_unit() -> None:
    spec = parse_job_spec(RL_JOB)
    n = rl_workload(spec).launches
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    base = roster([0.1, 0.1], [1e10, 1e10])
    plain = RLRosterScorer(spec).predict(base, alloc)
    costs = ElementCosts(gelu=2e-9, softmax=1e-9, attention=5e-7, attention_backward=8e-7)
    trainer = replace(base.entries[0], profile=replace(base.entries[0].profile, element_s=costs))
    costly = RLRosterScorer(spec).predict(Roster.of(0, [trainer, *base.entries[1:]]), alloc)
    ns = PerFamily(2.0, 1.0, 500.0, 800.0)
    sequences = 64  # the iteration's prompts x group size, all on the one trainer
    assert costly.tasks["generate"] == plain.tasks["generate"]  # the rollout peer measured none
    assert costly.tasks["reference"] - plain.tasks["reference"] == pytest.approx(
        sequences * n.inference_elements.seconds(ns)
    )
    assert costly.tasks["actor_train"] - plain.tasks["actor_train"] == pytest.approx(
        sequences * n.train_elements.seconds(ns)
    )


def test_a_measured_tflops_is_an_achieved_rate_not_a_peak() -> None:
    """The reference pass costs its forward FLOPs at the peer's measured rate (no MFU factor), its ops
    and the bytes they move beyond the weights at the peer's memory bandwidth. The FLOPs are those of
    the weights a token multiplies (no embedding) over every position but each sequence's last."""
    spec = parse_job_spec(RL_JOB)
    w = rl_workload(spec)
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    parts = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10], launch=[1e-5, 1e-5]), alloc)
    sequences = w.prompts * w.responses_per_prompt
    assert w.launches.inference_bytes_per_sequence > 0
    assert w.actor.flop_params == matmul_params(spec.model.gpt_config()) < w.actor.params
    assert parts.tasks["reference"] == pytest.approx(
        2 * matmul_params(spec.model.gpt_config()) * sequences * (w.seq_len - 1) / 0.1e12
        + w.launches.inference * 1e-5
        + sequences * w.launches.inference_bytes_per_sequence / 1e10
    )


def test_a_slow_link_makes_a_rollout_peer_not_worth_it() -> None:
    """Weight sync to a rollout peer behind a thin link costs more than its share of generation saves."""
    spec = parse_job_spec(RL_JOB)
    base = roster([0.2, 0.1, 0.1], [5e9] * 3)
    entries = list(base.entries)
    # PEERS[2] reaches the others at 10 kbit/s only
    entries = [
        RosterEntry(
            **{
                **{f: getattr(e, f) for f in e.__struct_fields__},
                "links": tuple(
                    RosterLink(
                        lk.peer, lk.delay_s, 1e4 if PEERS[2] in (e.peer, lk.peer) else lk.bandwidth_bps
                    )
                    for lk in e.links
                ),
            }
        )
        for e in entries
    ]
    r = Roster.of(0, entries)
    scorer = RLRosterScorer(spec)
    island = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
    island.step(5)
    (trainer,), rollouts = roles(island.best(1)[0])
    assert PEERS[2] not in (trainer, *rollouts)


def test_a_roster_without_memory_bandwidth_cannot_be_scored() -> None:
    spec = parse_job_spec(RL_JOB)
    r = roster([0.1, 0.1], [5e9, None])
    with pytest.raises(ConfigError) as err:
        RLRosterScorer(spec)(r, Allocation(((PEERS[0],),), (PEERS[1],)))
    assert err.value.field == "roster.entries[1].profile.memory_bandwidth"


def test_a_pretrain_spec_has_no_rl_workload() -> None:
    data = copy.deepcopy(RL_JOB)
    data.update(kind="pretrain", min_peers=1)
    del data["rl"]
    with pytest.raises(ConfigError):
        rl_workload(parse_job_spec(data))


def test_a_colocated_allocation_generates_on_its_trainer() -> None:
    """No rollout peer: the trainer samples its prompts itself, so nothing is synced or moved."""
    spec = parse_job_spec(RL_JOB)
    alloc = Allocation(((PEERS[0],),))
    fast = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10]), alloc)
    slow = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e8, 1e10]), alloc)
    assert math.isfinite(fast.seconds) and fast.sync == 0.0 and fast.transfers == 0.0
    assert slow.tasks["generate"] > fast.tasks["generate"] > 0  # timed by the trainer's memory bandwidth
    # and so is the traffic of its training ops (activations, gradients, the optimizer's moments)
    assert slow.tasks["actor_train"] > fast.tasks["actor_train"]
    # sync: generation, then the reference pass and training on the same device
    assert fast.seconds == pytest.approx(sum(fast.tasks.values()))


def test_two_trainers_with_two_rollout_peers_each_sync_their_own() -> None:
    spec = dp_spec(2)
    r = roster([0.2, 0.2, 0.1, 0.1], [5e9] * 4)
    two = RLRosterScorer(spec).predict(r, Allocation(((PEERS[0], PEERS[1]),), (PEERS[2], PEERS[3])))
    one = RLRosterScorer(parse_job_spec(RL_JOB)).predict(r, Allocation(((PEERS[0],),), (PEERS[2], PEERS[3])))
    assert math.isfinite(two.seconds) and set(two.tasks) == {"generate", "reference", "actor_train"}
    # each trainer scores half the sequences; each star sends one copy instead of two
    assert two.tasks["reference"] == pytest.approx(one.tasks["reference"] / 2)
    assert 0 < two.sync < one.sync
    assert (
        two.tasks["generate"] == one.tasks["generate"]
    )  # one rollout peer per trainer: half each either way


def test_rollout_peers_are_dealt_round_robin_over_the_trainers() -> None:
    """Rollout peer i serves trainer i % R: a third peer leaves trainer 1 with one, a fourth speeds it up."""
    spec = dp_spec(2)
    r = roster([0.2, 0.2, 0.1, 0.1, 0.1, 0.1], [5e9] * 6, link_bps=1e11)
    scorer = RLRosterScorer(spec)

    def generate(*rollouts: str) -> float:
        return scorer.predict(r, Allocation(((PEERS[0], PEERS[1]),), rollouts)).tasks["generate"]

    assert generate(*PEERS[2:5]) == generate(*PEERS[2:4]) > generate(*PEERS[2:6])
    # fewer rollout peers than trainers: trainer 1 samples its own share, trainer 0 waits on its peer
    mixed = scorer.predict(r, Allocation(((PEERS[0], PEERS[1]),), (PEERS[2],)))
    assert math.isfinite(mixed.seconds) and mixed.sync > 0


def test_the_trainers_all_reduce_their_gradients_once_per_update() -> None:
    """Only the link between the two trainers slows: actor training grows by the ring all-reduce's share."""
    spec = dp_spec(2)
    w = rl_workload(spec)
    alloc = Allocation(((PEERS[0], PEERS[1]),), (PEERS[2], PEERS[3]))
    base = roster([0.2, 0.2, 0.1, 0.1], [5e9] * 4, link_bps=1e11)
    fast = RLRosterScorer(spec).predict(base, alloc)
    slow = RLRosterScorer(spec).predict(with_link(base, PEERS[0], PEERS[1], 1e6), alloc)
    assert slow.sync == fast.sync and slow.tasks["generate"] == fast.tasks["generate"]
    grads = w.actor.params * 4.0  # fp32; each trainer sends and receives 2(R-1)/R = 1 of them
    extra = w.optimizer_steps * grads * (8 / 1e6 - 8 / 1e11)
    assert slow.tasks["actor_train"] - fast.tasks["actor_train"] == pytest.approx(extra)
    assert slow.seconds - fast.seconds == pytest.approx(extra)
    assert slow.average - fast.average == pytest.approx(extra)  # the all-reduces, named apart
    assert 0 < fast.average < fast.tasks["actor_train"]
    # two colocated trainers (the verl-like plan) pay it too, and nothing else
    colocated = Allocation(((PEERS[0], PEERS[1]),))
    plain = RLRosterScorer(spec).predict(base, colocated)
    assert plain.sync == 0.0 and plain.transfers == 0.0
    thin = RLRosterScorer(spec).predict(with_link(base, PEERS[0], PEERS[1], 1e6), colocated)
    assert thin.seconds - plain.seconds == pytest.approx(extra)


def test_compressed_gradients_cost_their_bits_on_the_trainers_link() -> None:
    """``compression.gradient_bits: 8``: each element travels as one byte plus its share of a
    bfloat16 scale per 256 (the averaging codec), a little over a quarter of the fp32 bytes."""
    fp32 = dp_spec(2)
    q8 = dataclasses.replace(fp32, compression=dataclasses.replace(fp32.compression, gradient_bits=8))
    assert rl_workload(q8).constants.allreduce_grad_bytes() == 1 + 2 / 256
    assert rl_workload(fp32).constants.allreduce_grad_bytes() == 4.0
    alloc = Allocation(((PEERS[0], PEERS[1]),), (PEERS[2], PEERS[3]))
    base = roster([0.2, 0.2, 0.1, 0.1], [5e9] * 4, link_bps=1e11)
    slow = with_link(base, PEERS[0], PEERS[1], 1e6)

    def ring(spec: JobSpec) -> float:
        """What the slow link between the trainers adds to the iteration."""
        scorer = RLRosterScorer(spec)
        return scorer.predict(slow, alloc).seconds - scorer.predict(base, alloc).seconds

    w = rl_workload(fp32)
    assert ring(fp32) == pytest.approx(w.optimizer_steps * w.actor.params * 4 * (8 / 1e6 - 8 / 1e11))
    assert ring(q8) == pytest.approx(ring(fp32) * (1 + 2 / 256) / 4)


BOX = HostShare("00ff00ff00ff00ff", cores=2, threads=1)


def test_peers_on_one_machine_slow_each_other_while_more_compute_than_it_has_cores() -> None:
    """Four colocated trainers on a 2-core machine each compute at half speed; in sync mode two
    rollout peers and then one trainer fit its two cores, three rollout peers do not."""
    rates = ([0.1] * 4, [5e9] * 4)
    colocated = Allocation((tuple(PEERS[:4]),))
    apart = RLRosterScorer(dp_spec(4)).predict(roster(*rates), colocated)
    shared = RLRosterScorer(dp_spec(4)).predict(roster(*rates, host=BOX), colocated)
    # training too: its all-reduce runs over loopback links, on the same oversubscribed cores
    for task in ("generate", "reference", "actor_train"):
        assert shared.tasks[task] == pytest.approx(2 * apart.tasks[task])

    spec = parse_job_spec(RL_JOB)
    two = Allocation(((PEERS[0],),), (PEERS[1], PEERS[2]))
    assert RLRosterScorer(spec).predict(roster(*rates, host=BOX), two) == RLRosterScorer(spec).predict(
        roster(*rates), two
    )
    three = Allocation(((PEERS[0],),), (PEERS[1], PEERS[2], PEERS[3]))
    alone, crowded = (
        RLRosterScorer(spec).predict(r, three) for r in (roster(*rates), roster(*rates, host=BOX))
    )
    assert crowded.tasks["generate"] == pytest.approx(1.5 * alone.tasks["generate"])
    assert crowded.tasks["actor_train"] == pytest.approx(alone.tasks["actor_train"])  # the trainer alone
    assert crowded.average == alone.average == 0.0  # a lone trainer averages nothing

    # async: the rollout peers sample while the trainer trains, three threads on two cores throughout
    lagged = parse_job_spec({**RL_JOB, "rl": {**RL_JOB["rl"], "staleness": 1}})
    alone, crowded = (
        RLRosterScorer(lagged).predict(r, two) for r in (roster(*rates), roster(*rates, host=BOX))
    )
    for task in ("generate", "reference", "actor_train"):
        assert crowded.tasks[task] == pytest.approx(1.5 * alone.tasks[task])


def test_a_roster_device_without_all_of_its_machine_is_priced_apart() -> None:
    from peerd.jobs.scoring import host_share

    assert host_share(RosterDevice(1.0, 1, "", 1e9, None, BOX.host, 2, 1)) == BOX
    assert host_share(RosterDevice(1.0, 1, "", 1e9, None, BOX.host, 2, None)) is None
    assert host_share(RosterDevice(1.0, 1, "", 1e9)) is None


def test_the_island_places_two_trainers_on_the_fastest_peers() -> None:
    spec = dp_spec(2)
    r = roster([0.05, 0.2, 0.05, 0.2, 0.05], [5e9] * 5, link_bps=1e11)
    scorer = RLRosterScorer(spec)
    island = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
    island.step(10)
    best = island.best(1)[0]
    trainers, rollouts = roles(best)
    assert trainers == (PEERS[1], PEERS[3])  # the 4x TFLOPS pair, in id order
    assert best.spares == rollouts
    assert RLRosterScorer(spec)(r, best) == island.best_cost() == scorer(r, best)
    # a migrant with another number of trainers is not this job's
    assert island.accept([Allocation(((PEERS[1],),), (PEERS[0],))]) == 0
    # a roster of exactly R peers has the colocated plan only
    pair = roster([0.1, 0.1], [5e9] * 2)
    alone = scorer.island(scorer.scenario(pair), seed=0, time_budget=1.0)
    alone.step(5)
    assert alone.best(1) == [Allocation(((PEERS[0], PEERS[1]),))]
    assert alone.best_cost() == scorer(pair, alone.best(1)[0])


def test_auto_chooses_the_trainer_count_the_links_afford() -> None:
    """``parallel.d_dp: auto``: the search runs one island per count that splits an update's groups
    (1, 2, 4 here); two trainers halve the training where the links make averaging cheap, and a
    lone trainer wins where they do not."""
    spec = parse_job_spec(RL_JOB)
    chosen = {}
    for bps in (1e11, 1e7):
        r = roster([0.1] * 6, [5e10] * 6, link_bps=bps)
        scorer = RLRosterScorer(spec)
        search = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
        search.step(10)
        assert set(search.islands) == {1, 2, 4}
        best = search.best(1)[0]
        assert search.best_cost() == min(i.best_cost() for i in search.islands.values()) == scorer(r, best)
        chosen[bps] = len(roles(best)[0])
        # a migrant goes to the island of its count; one with a count the job may not run is dropped
        three = Allocation(((PEERS[0], PEERS[1], PEERS[2]),), (PEERS[3],))
        assert search.accept([three]) == 0
    assert chosen == {1e11: 2, 1e7: 1}
    # the rollout peers the job keeps are not taken for trainers: 4 trainers on 4 peers leave none
    keep = parse_job_spec({**RL_JOB, "rl": {**RL_JOB["rl"], "min_rollout_peers": 1}})
    four = RLRosterScorer(keep)
    r4 = roster([0.1] * 4, [5e10] * 4, link_bps=1e11)
    assert set(four.island(four.scenario(r4), seed=0, time_budget=1.0).islands) == {1, 2}
    with pytest.raises(ConfigError, match="rollout peer"):
        four(r4, Allocation((tuple(PEERS[:4]),)))


def test_the_scorer_takes_the_specs_number_of_trainers() -> None:
    r = roster([0.1, 0.1, 0.1, 0.1], [5e9] * 4)
    two = Allocation(((PEERS[0], PEERS[1]),), (PEERS[2],))
    with pytest.raises(ConfigError, match="1 trainer"):
        RLRosterScorer(dp_spec(1))(r, two)
    # auto: any count that splits an update's 4 groups equally
    auto = RLRosterScorer(parse_job_spec(RL_JOB))
    assert auto.trainer_counts == (1, 2, 4) and auto(r, two) > 0
    with pytest.raises(ConfigError, match="1 or 2 or 4 trainer"):
        auto(r, Allocation(((PEERS[0], PEERS[1], PEERS[2]),), (PEERS[3],)))
    with pytest.raises(ConfigError, match="2 trainer"):
        RLRosterScorer(dp_spec(2))(r, Allocation(((PEERS[0],),), (PEERS[1],)))
    with pytest.raises(ConfigError, match="do not split"):  # 8 prompts over 3 trainers
        RLRosterScorer(dp_spec(3))(r, Allocation(((PEERS[0], PEERS[1], PEERS[2]),), (PEERS[3],)))


def test_a_lone_trainer_wins_where_sampling_on_it_is_fastest_unless_the_job_keeps_rollout_peers() -> None:
    """One fast peer and three 20x slower ones: it samples its prompts faster than they would."""
    r = roster([0.2, 0.01, 0.01, 0.01], [5e10, 5e8, 5e8, 5e8], link_bps=1e11)
    spec = parse_job_spec(RL_JOB)
    scorer = RLRosterScorer(spec)
    island = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
    island.step(5)
    lone = island.best(1)[0]
    assert roles(lone) == ((PEERS[0],), ())
    assert scorer(r, lone) == island.best_cost() < scorer(r, Allocation(((PEERS[0],),), (PEERS[1],)))
    # a job that keeps two rollout peers: no candidate with fewer, and a peer refuses one
    keep = parse_job_spec({**RL_JOB, "rl": {**RL_JOB["rl"], "min_rollout_peers": 2}})
    kept = RLRosterScorer(keep)
    island = kept.island(kept.scenario(r), seed=0, time_budget=1.0)
    island.step(5)
    (trainer,), rollouts = roles(island.best(1)[0])
    assert trainer == PEERS[0] and len(rollouts) >= 2
    with pytest.raises(ConfigError, match="min_rollout_peers"):
        kept(r, Allocation(((PEERS[0],),), (PEERS[1],)))
    # a roster that lost peers: the job keeps what it has beyond the trainer
    assert kept(roster([0.2, 0.01], [5e10, 5e8]), Allocation(((PEERS[0],),), (PEERS[1],))) > 0
    assert required_rollouts(2, roster=4, max_peers=2, replicas=1) == 1
    assert required_rollouts(0, roster=4, max_peers=None, replicas=1) == 0


def test_the_spec_refuses_more_rollout_peers_than_max_peers_leaves() -> None:
    with pytest.raises(ConfigError, match=r"rl\.min_rollout_peers"):
        parse_job_spec(
            {
                **RL_JOB,
                "max_peers": 3,
                "parallel": {"d_pp": 1, "d_dp": 2},
                "rl": {**RL_JOB["rl"], "min_rollout_peers": 2},
            }
        )
