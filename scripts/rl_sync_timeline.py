"""Where a sync rl iteration's wait goes: timestamps at each hop between the trainer and one rollout peer.

One process, one p2pd per peer (no DHT, no other daemons), the job of ``peerd bench rl-swarm``
(the tiny GPT at ``--d-model``, 16 prompts x 8 completions of 1-digit addition, 3 new tokens).
The trainer's ``wait`` for iteration t's shard is cut at these points (medians over the
iterations after the second):

  weights out   the trainer published version t -> the rollout peer's poll returned with it
  load          unpack, check and load the weights (``RolloutPeer._take_weights``)
  sampling      the shard's sampling (``RolloutPeer._sample``)
  rollouts in   sampling done -> the trainer starts taking the shard (``rl.rollouts`` on the wire)
  intake        the trainer takes the shard and wakes its wait

The RL cost model prices "weights out" and "rollouts in" as link transfers and "sampling" as
generation; "load" and the per-message work are host costs it has no term for.

    .venv/bin/python scripts/rl_sync_timeline.py [--d-model 32] [--iterations 40]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from peerd.jobs.rl import RLPlan, RLTrainer, RolloutConfig, RolloutPeer, TrainerConfig
from peerd.jobs.rl.shards import assign_shards
from peerd.jobs.spec import parse_job_spec
from peerd.pipeline.launch import start_peers, stop_peers

MARKS: defaultdict[str, list[float]] = defaultdict(list)


def timed(cls: type, name: str, begin: str, end: str) -> None:
    """Record ``perf_counter`` on entry (``begin``) and exit (``end``) of ``cls.name`` (sync or async)."""
    fn: Callable[..., Any] = getattr(cls, name)
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            MARKS[begin].append(time.perf_counter())
            out = await fn(*args, **kwargs)
            MARKS[end].append(time.perf_counter())
            return out

    else:

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            MARKS[begin].append(time.perf_counter())
            out = fn(*args, **kwargs)
            MARKS[end].append(time.perf_counter())
            return out

    setattr(cls, name, wrapper)


def plan(d_model: int, iterations: int) -> RLPlan:
    spec = parse_job_spec(
        {
            "kind": "rl",
            "name": "rl-sync-timeline",
            "model": {"preset": "tiny", "seed": 0, "overrides": {"d_model": d_model}},
            "steps": iterations,
            "global_batch": 128,
            "micro_batch": 64,
            "min_peers": 2,
            "optimizer": {"name": "adamw", "lr": 0.001, "schedule": "constant", "grad_clip": 1.0},
            "rl": {
                "task": {"name": "addition", "min_size": 1, "max_size": 1},
                "group_size": 8,
                "sampling": {"max_new_tokens": 3, "temperature": 1.0},
                "warmup": {"steps": 20, "batch_size": 64, "lr": 0.003},
            },
        }
    )
    return RLPlan("t" * 32, spec)


async def run(p: RLPlan) -> list[dict[str, float]]:
    peers = await start_peers(2)
    try:
        trainer_peer, rollout_peer = peers
        trainer = RLTrainer(
            trainer_peer.transport, p, [rollout_peer.transport.peer_id], config=TrainerConfig(poll_hold_s=5)
        )
        worker = RolloutPeer(
            rollout_peer.transport,
            p,
            trainer_peer.transport.peer_id,
            assign_shards(p.prompts, 1, [str(rollout_peer.transport.peer_id)])[0],
            config=RolloutConfig(),
        )
        rolling = asyncio.ensure_future(worker.run())
        await trainer.start()
        try:
            await trainer.run()
            await rolling
        finally:
            await trainer.close()
        return [r.seconds for r in trainer.reports]
    finally:
        await stop_peers(peers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each daemon of the bench computes
    timed(RLTrainer, "_publish", "publish", "published")
    timed(RLTrainer, "_take", "take", "taken")
    timed(RLTrainer, "_collect", "collect", "collected")
    timed(RolloutPeer, "_poll", "poll", "polled")
    timed(RolloutPeer, "_take_weights", "load", "loaded")
    timed(RolloutPeer, "_sample", "sample", "sampled")
    seconds = asyncio.run(run(plan(args.d_model, args.iterations)))
    # round t: the trainer publishes version t (index t: index 0 is the warm-up's), its poll returns it
    # (index t: the first poll answers the warm-up's version), the shard of t goes in (index t)
    rounds = range(2, args.iterations)

    def median_ms(end: str, begin: str) -> float:
        return round(statistics.median(MARKS[end][t] - MARKS[begin][t] for t in rounds) * 1e3, 3)

    hops = {
        "weights_out": median_ms("polled", "published"),
        "load": median_ms("loaded", "polled"),
        "sampling": median_ms("sampled", "sample"),
        "rollouts_in": median_ms("take", "sampled"),
        "intake": median_ms("collected", "take"),
        "wait": median_ms("collected", "collect"),
    }
    phases = {k: round(statistics.median(s[k] for s in seconds[2:]) * 1e3, 3) for k in seconds[0]}
    print(json.dumps({"d_model": args.d_model, "hops_ms": hops, "trainer_phases_ms": phases}, indent=2))


if __name__ == "__main__":
    main()
