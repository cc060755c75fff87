"""The pure parts of ``peerd bench rl-swarm``: target arithmetic, rates, the rebuilt roster and its prediction, the plot.

Nothing here starts a daemon; ``peerd.bench.rl_swarm`` feeds it what the swarm and the
in-process replay measured (its docstring says what each figure is).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from peerd.bench.rosters import committed_roster
from peerd.jobs.rl.report import PHASES
from peerd.jobs.scoring_rl import RLRosterScorer, rl_workload
from peerd.jobs.spec import JobSpec
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice
from peerd.sched.rl.workload import Launches

TARGET_RATIO, TARGET_PASS = 3.0, 0.6  # issue 13: 3x the starting pass rate or >= 0.6, whichever is lower


def target(start: float) -> float:
    return min(TARGET_RATIO * start, TARGET_PASS)


def heldout_summary(start: dict[str, float], end: dict[str, float], kls: list[float]) -> dict[str, Any]:
    """Start vs end on the held-out set, the target and whether it was met (the end must also beat the start)."""
    goal = target(start["pass_rate"])
    return {
        "start": start,
        "end": end,
        "pass_rate_ratio": end["pass_rate"] / start["pass_rate"] if start["pass_rate"] else None,
        "target_pass_rate": goal,
        "target_met": end["pass_rate"] >= goal and end["pass_rate"] > start["pass_rate"],
        "kl_max": max(kls, default=None),
    }


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured: negative when the model is optimistic."""
    return (predicted - measured) / measured if measured > 0 else None


def throughput(seen: list[tuple[float, int]], per_iteration: int) -> float | None:
    """Completions per second between the first and the last iteration seen ((seconds, iteration) pairs)."""
    if len(seen) < 2 or seen[-1][1] <= seen[0][1] or seen[-1][0] <= seen[0][0]:
        return None
    return (seen[-1][1] - seen[0][1]) * per_iteration / (seen[-1][0] - seen[0][0])


def async_ratio(sync: dict[str, Any] | None, lagged: dict[str, Any] | None) -> dict[str, Any]:
    """Rollouts/s async over sync: on the trainers' own clocks, else between the iterations the polls saw,
    else the medians of the trainers' per-iteration rates the polls saw.

    The polls see a trainer on another daemon late (its progress record travels through the DHT),
    which moves either end of a short run by up to a publish interval: the trainers' clocks do not.
    """
    for key, source in (
        (
            "rollouts_per_s_trainer",
            "the trainer's own clock: completions over its iteration periods after the first",
        ),
        ("rollouts_per_s", "completions between the first and last iteration the polls saw"),
        ("rollouts_per_s_daemon_median", "the trainer's per-iteration rates the polls saw, median"),
    ):
        a, b = (lagged or {}).get(key), (sync or {}).get(key)
        if a and b:
            return {
                "async_over_sync_rollouts_per_s": a / b,
                "ratio_source": source,
                **steady_ratio(sync, lagged),
            }
    return {"async_over_sync_rollouts_per_s": None, "ratio_source": None, **steady_ratio(sync, lagged)}


def steady_ratio(sync: dict[str, Any] | None, lagged: dict[str, Any] | None) -> dict[str, Any]:
    """Async over sync in steady state: the trainers' per-iteration rates (the time from waiting for an
    iteration's shards to publishing its weights, the iteration period), median of those the polls saw."""
    a = (lagged or {}).get("rollouts_per_s_daemon_median")
    b = (sync or {}).get("rollouts_per_s_daemon_median")
    return {"async_over_sync_per_iteration": a / b if a and b else None}


def curve_points(rewards: list[list[float]], polled: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """The trainer's [iteration, reward, pass rate] points with what the polls saw at each iteration.

    A re-plan that makes another peer the trainer starts a new record: iterations before it that
    the polls saw come from the polls (``"from": "poll"``), the others are missing.
    """
    points: dict[int, dict[str, Any]] = {
        int(i): {**polled.get(int(i), {}), "iteration": int(i), "reward_mean": r, "pass_rate": p}
        for i, r, p in rewards
    }
    for i, seen in polled.items():
        if i not in points and "pass_rate" in seen:
            points[i] = {"iteration": i, **seen, "from": "poll"}
    return [points[i] for i in sorted(points)]


KILL_WINDOW = 30  # iterations of rollout pass rate averaged before a kill, and at the end


def kill_report(
    killed: dict[str, Any],
    curve: list[dict[str, Any]],
    view: dict[str, Any],
    per_iteration: int,
    seen: list[tuple[float, int]],
) -> dict[str, Any]:
    """What killing a rollout peer mid-job cost and how the job went on: the rollouts' mean pass rate
    over the ``KILL_WINDOW`` iterations up to the kill and over the job's last ones, whether the job
    re-planned (a later epoch) without the dead peer, how long until the polls saw it train again
    (``seen``: seconds since submit, iterations done), the shards the last trainer record counts
    dropped and the completions not trained."""
    at, peer = killed["at_iteration"], killed["peer_id"]

    def mean_pass(points: list[dict[str, Any]]) -> float | None:
        rates = [p["pass_rate"] for p in points]
        return sum(rates) / len(rates) if rates else None

    before = mean_pass([p for p in curve if at - KILL_WINDOW < p["iteration"] <= at])
    last = curve[-1]["iteration"] if curve else at
    after = mean_pass([p for p in curve if p["iteration"] > max(at, last - KILL_WINDOW)])
    rl = (view.get("progress") or {}).get("rl") or {}
    alloc = view.get("allocation") or {}
    members = {*(p for st in alloc.get("stages") or [] for p in st), *(alloc.get("spares") or [])}
    epoch = (view.get("churn") or {}).get("epoch")
    trained = sum(n for _, n in rl.get("staleness") or [])
    resumed = [t for t, it in seen if it > at and t > killed["at_s"]]
    return {
        **killed,
        "window_iterations": KILL_WINDOW,
        "pass_rate_before": before,
        "pass_rate_end": after,
        "rose_after": before is not None and after is not None and after > before,
        "epoch_end": epoch,
        "replanned_without_it": epoch is not None
        and killed.get("epoch") is not None
        and epoch > killed["epoch"]
        and peer not in members,
        "trained_again_after_s": round(resumed[0] - killed["at_s"], 2) if resumed else None,
        "shards_missing": rl.get("shards_missing"),
        "completions_not_trained": max(0, int(rl.get("iteration") or 0) * per_iteration - trained),
        "state": view.get("state"),
    }


def comparison(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per key of ``predicted`` found in ``measured``: both and the relative error."""
    return {
        k: {"predicted_s": v, "measured_s": measured[k], "relative_error": relative_error(v, measured[k])}
        for k, v in predicted.items()
        if k in measured
    }


def predict(spec: JobSpec, roster: Roster, alloc: dict[str, Any]) -> dict[str, Any]:
    """The RL cost model's prediction for the committed roles (the trainers, the spares rolling out),
    with each task's terms (``task_terms``)."""
    allocation = Allocation(tuple(tuple(s) for s in alloc["stages"]), tuple(alloc["spares"]))
    scorer = RLRosterScorer(spec)
    return {**scorer.predict(roster, allocation).to_dict(), "terms_s": task_terms(scorer, roster, allocation)}


def task_terms(scorer: RLRosterScorer, roster: Roster, allocation: Allocation) -> dict[str, dict[str, Any]]:
    """Per task, what the model's seconds are made of: ``flops_and_links`` (the arithmetic at the
    measured rates, the decode roofline, the trainers' all-reduce), ``launches`` (the counted ops at
    the measured seconds per op), ``traffic`` (the bytes those ops move at the memory bandwidth) and
    ``elements`` (the GELU, softmax and attention units beyond that, at the measured ns per unit),
    by pricing the roles without the counts, with the ops alone, with their traffic and whole;
    ``bound`` names the largest (the task's regime)."""
    w = scorer.workload
    none, ops, moved = (
        RLRosterScorer(scorer.spec, dataclasses.replace(w, launches=launches))
        .predict(roster, allocation)
        .tasks
        for launches in (Launches(), w.launches.without_traffic(), w.launches.without_elements())
    )
    whole = scorer.predict(roster, allocation).tasks
    out: dict[str, dict[str, Any]] = {}
    for task, seconds in whole.items():
        terms = {
            "flops_and_links": none[task],
            "launches": ops[task] - none[task],
            "traffic": moved[task] - ops[task],
            "elements": seconds - moved[task],
        }
        out[task] = {**terms, "bound": max(terms, key=lambda k: terms[k])}
    return out


# The trainer's phases (``peerd.jobs.rl.report``) under the cost model's task names.
SWARM_TASKS = {"generate": "generate", "reference": "reference", "actor_train": "train"}


def swarm_tasks(phases_s: dict[str, float] | None) -> dict[str, float]:
    """The swarm's median seconds per task, from the trainer's published phases, and ``sync``: the
    trainer's packing of its weights (``publish``) and what it waited for its shards beyond the
    slowest shard's sampling (weights to the rollout peers and their load, the shards back, every
    message's turn through the daemons)."""
    if not phases_s:
        return {}
    out = {task: phases_s[phase] for task, phase in SWARM_TASKS.items() if phase in phases_s}
    if "wait" in phases_s and "generate" in phases_s:
        out["sync"] = max(phases_s["wait"] - phases_s["generate"], 0.0) + phases_s.get("publish", 0.0)
    if "average" in phases_s:  # data-parallel trainers: their gradient averages, inside actor_train
        out["average"] = phases_s["average"]
    return out


def loop_seconds(phases_s: dict[str, float] | None) -> float | None:
    """The trainer's iteration from its published phase medians: the sum over its loop's phases
    (None when it published none). Every iteration after the first counts, where the polls see
    one iteration's rate every ~2 s (a handful in a short job)."""
    if not phases_s or not all(k in phases_s for k in PHASES):
        return None
    return sum(phases_s[k] for k in PHASES)


def prediction_report(
    predicted: dict[str, Any],
    phases: dict[str, Any],
    iteration_s: float | None,
    committed: float | None,
    swarm_phases_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The cost model's seconds per task and per iteration against the measured ones: in the swarm
    (the trainer's published phase medians) and replayed on one thread here."""
    tasks = dict(predicted["tasks"])
    replayed = sum(phases["median_s"].values())
    swarm = swarm_tasks(swarm_phases_s)
    looped = loop_seconds(swarm_phases_s)
    measured = looped if looped is not None else iteration_s
    return {
        "predicted": predicted,
        "committed_cost_s": committed,
        "rebuilt_over_committed": predicted["seconds"] / committed if committed else None,
        "per_task_swarm": comparison(
            {**tasks, "sync": predicted["sync"] + predicted["transfers"], "average": predicted["average"]},
            swarm,
        ),
        "per_task_swarm_source": (
            "the trainer's phase medians over the iterations after the first (protocols/jobs.md "
            "phases_s): generate = the slowest shard's sampling as its rollout peer timed it; sync = "
            "the trainer's publish and its wait for the shards beyond that, against the predicted "
            "weight sync (packing, transfer, loading) + rollout transfers; average (data-parallel trainers) = the time in the gradient "
            "averages, part of actor_train, against the predicted all-reduces"
        ),
        "swarm_phases_s": swarm_phases_s,
        "per_task": comparison(tasks, phases["median_s"]),
        "per_task_source": (
            f"phases of {phases['iterations']} sync iterations replayed in this process on one thread "
            f"({phases['rollout_shards']} shards; generate = the slowest shard), after the swarm closed"
        ),
        "replayed_phases_s": phases["median_s"],
        "iteration": {
            "predicted_s": predicted["seconds"],
            "measured_s": measured,
            "relative_error": relative_error(predicted["seconds"], measured) if measured else None,
            "measured_source": (
                "the trainer's phase medians on the swarm, summed over its loop (" + ", ".join(PHASES) + ")"
                if looped is not None
                else "the trainer's own iteration times on the swarm (completions / rollouts/s) the polls saw, median"
            ),
            "measured_polls_s": iteration_s,
            # the same phases back to back on one thread, no daemons: what the swarm adds is the rest
            "replayed_s": replayed,
            "replayed_relative_error": relative_error(predicted["seconds"], replayed),
            "measured_over_replayed": measured / replayed if measured and replayed else None,
        },
    }


def placement_arms(
    views: dict[str, dict[str, Any]],
    statuses: dict[str, dict[str, Any]],
    specs: dict[str, JobSpec],
    device: RosterDevice,
) -> dict[str, dict[str, Any]]:
    """Comparison arms (each job's final view, the owner's status right before its submission, its
    spec; ``device``: the shared profile as ``committed_roster`` takes it): each arm's roles,
    measured iteration (the trainers' loop, as the main prediction reads it), the RL cost model's
    prediction for it on the roster its consensus planned with, and what its trainers sent to
    average."""
    out: dict[str, dict[str, Any]] = {}
    for name, view in views.items():
        status = statuses[name]
        ids = {p["peer_id"]: p["name"] for p in status.get("peers", [])}
        alloc, rl = view["allocation"], view["progress"]["rl"]
        predicted = predict(specs[name], committed_roster(status, alloc, device), alloc)
        measured = loop_seconds(rl.get("phases_s"))
        sent = view["progress"].get("bytes") or {}
        out[name] = {
            "trainers": [ids.get(p, p) for p in alloc["stages"][0]],
            "rollout_peers": [ids.get(p, p) for p in alloc["spares"]],
            "measured_iteration_s": measured,
            "phases_s": rl.get("phases_s"),
            "predicted_iteration_s": predicted["seconds"],
            "predicted_tasks_s": predicted["tasks"],
            "relative_error": relative_error(predicted["seconds"], measured) if measured else None,
            # the trainers' all-reduces: predicted (inside actor_train) against their measured phase
            "average_s": comparison({"average": predicted["average"]}, swarm_tasks(rl.get("phases_s"))).get(
                "average"
            ),
            "rewards_last": (rl.get("rewards") or [None])[-1],
            "averaging_bytes": sent.get("averaging"),
            "averaging_raw_bytes": sent.get("averaging_raw"),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def colocated_report(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``consensus`` and ``colocated`` arms (``placement_arms``) and the ratio colocated / consensus
    (> 1: the consensus plan is faster)."""
    out: dict[str, Any] = dict(arms)
    con, col = out["consensus"], out["colocated"]
    out["measured_ratio_colocated_over_consensus"] = _ratio(
        col["measured_iteration_s"], con["measured_iteration_s"]
    )
    out["predicted_ratio_colocated_over_consensus"] = _ratio(
        col["predicted_iteration_s"], con["predicted_iteration_s"]
    )
    out["note"] = (
        "verl-like: every peer samples its share of the prompts, computes the reference and trains, "
        "the trainers averaging each update's gradients (no weight sync); measured on the same daemons, "
        "sync, one after the other"
    )
    return out


def gradient_report(
    arms: dict[str, dict[str, Any]],
    spec: JobSpec,
    link_mbps: float | None,
    compressed_on_fp32_roster_s: float | None = None,
) -> dict[str, Any]:
    """The ``dp-fp32`` and ``dp-q<bits>`` arms (``placement_arms``, fp32 first) of ``spec``'s job, the
    ratio fp32 / compressed of the iteration (> 1: compression pays) and of the averaging bytes, and
    the regime: how long the fp32 gradients of one iteration take on the shaped link.

    ``compressed_on_fp32_roster_s``: the compressed job priced on the fp32 arm's roster and roles;
    the predicted ratio then isolates the compression (each arm's own prediction also carries its
    own probes of the links, which on loopback move it by more than the bytes saved)."""
    out: dict[str, Any] = dict(arms)
    fp32, quant = arms.values()
    out["measured_ratio_fp32_over_compressed"] = _ratio(
        fp32["measured_iteration_s"], quant["measured_iteration_s"]
    )
    out["predicted_ratio_fp32_over_compressed"] = _ratio(
        fp32["predicted_iteration_s"], compressed_on_fp32_roster_s
    )
    out["predicted_ratio_own_rosters"] = _ratio(fp32["predicted_iteration_s"], quant["predicted_iteration_s"])
    out["bytes_ratio_fp32_over_compressed"] = _ratio(fp32["averaging_bytes"], quant["averaging_bytes"])
    w = rl_workload(spec)
    grads = w.actor.params * w.constants.grad_bytes * w.optimizer_steps  # one trainer sends, per iteration
    out["regime"] = {
        "link_mbps": link_mbps,
        "fp32_gradient_bytes_per_iteration": grads,
        # with two trainers each sends half its gradients to the other and gets the averaged half back
        "fp32_averaging_s_on_link": grads * 8 / (link_mbps * 1e6) if link_mbps else None,
        "note": "two data-parallel trainers and the consensus' rollout peers, sync, one job after the "
        "other on the same daemons; shaped links make the averaging link-bound, loopback leaves it host-bound",
    }
    return out


def write_plot(result: dict[str, Any], path: Path) -> str | None:
    """Reward and pass rate per iteration with the held-out start/end and the target; KL and length (None without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, held = result["curve"], result["heldout"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    xs = [c["iteration"] for c in curve]
    left.plot(xs, [c["pass_rate"] for c in curve], label="pass rate (rollouts)", linewidth=1.2)
    left.plot(xs, [c["reward_mean"] for c in curve], label="reward mean", linewidth=1.0, alpha=0.7)
    left.axhline(held["start"]["pass_rate"], color="grey", linestyle=":", label="held-out start")
    left.axhline(held["end"]["pass_rate"], color="green", linestyle="--", label="held-out end")
    left.axhline(held["target_pass_rate"], color="red", linestyle="-.", label="target")
    if (kill := result.get("kill")) is not None:
        left.axvline(kill["at_iteration"], color="black", linewidth=0.8, label=f"{kill['peer']} killed")
    left.set_xlabel("iteration")
    left.legend(fontsize=8)
    kl = [(c["iteration"], c["kl"]) for c in curve if "kl" in c]
    length = [(c["iteration"], c["response_len"]) for c in curve if "response_len" in c]
    if kl:
        right.plot(
            *zip(*kl, strict=True), "o-", label="KL to reference (polled)", color="purple", markersize=3
        )
    right.set_xlabel("iteration")
    right.set_ylabel("k3 KL")
    if length:
        twin = right.twinx()
        twin.plot(*zip(*length, strict=True), "s--", label="response length", color="orange", markersize=3)
        twin.set_ylabel("response length (tokens)")
        twin.legend(fontsize=8, loc="upper right")
    right.legend(fontsize=8, loc="upper left")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"peerd bench rl-swarm: {result['settings']['task']}, {result['settings']['peers']} daemons")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)
