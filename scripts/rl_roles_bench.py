"""Rollouts/s of an rl job's roles on loopback p2p: synchronous (staleness 0) vs async (staleness k), same peers.

One process, one p2pd per peer: a trainer and ``--peers`` rollout peers (``peerd.jobs.rl``),
the tiny GPT, no warm-up. Each mode runs ``--iterations`` GRPO iterations; the figure is
completions trained per second of wall-clock time from the first iteration's start to the
last one's end, plus the mean seconds per trainer phase, the staleness histogram and the mean
pass rate of the first and last five iterations (with ``--warmup-steps`` and enough iterations,
whether GRPO over the wire learns).
Machines are shared and noisy: read the ratio, not the times.

    .venv/bin/python scripts/rl_roles_bench.py [--peers 2] [--iterations 12] [--async-k 1] [--out FILE]
        [--digits 2] [--warmup-steps 0] [--lr 1e-3] [--global-batch 256] [--group-size 8] [--max-new-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from typing import Any

from peerd.jobs.rl import RLPlan, RLTrainer, RolloutConfig, RolloutPeer, TrainerConfig
from peerd.jobs.rl.shards import assign_shards
from peerd.jobs.spec import parse_job_spec
from peerd.pipeline.launch import start_peers, stop_peers


def plan(job: str, args: argparse.Namespace, staleness: int) -> RLPlan:
    spec = parse_job_spec(
        {
            "kind": "rl",
            "name": "rl-roles-bench",
            "model": {"preset": "tiny", "seed": 0},
            "steps": args.iterations,
            "global_batch": args.global_batch,
            "micro_batch": args.global_batch,
            "min_peers": 2,
            "optimizer": {"name": "adamw", "lr": args.lr, "schedule": "constant", "grad_clip": 1.0},
            "rl": {
                "task": {"name": "addition", "min_size": 1, "max_size": args.digits},
                "group_size": args.group_size,
                "staleness": staleness,
                "sampling": {"max_new_tokens": args.max_new_tokens},
                "warmup": {"steps": args.warmup_steps, "batch_size": 32},
            },
        }
    )
    return RLPlan(job, spec)


async def run_mode(peers: list[Any], p: RLPlan) -> dict[str, Any]:
    trainer_peer, rollout = peers[0], peers[1:]
    ids = sorted((x.peer_id for x in rollout), key=str)
    trainer = RLTrainer(trainer_peer.transport, p, ids, config=TrainerConfig(poll_hold_s=5))
    await trainer.start()
    workers = [
        RolloutPeer(
            x.transport,
            p,
            trainer_peer.peer_id,
            assign_shards(p.prompts, 1, [str(i) for i in ids])[ids.index(x.peer_id)],
            config=RolloutConfig(),
        )
        for x in rollout
    ]
    try:
        tasks = [asyncio.ensure_future(w.run()) for w in workers]
        started = time.perf_counter()
        reports = await trainer.run()
        wall = time.perf_counter() - started
        stats = await asyncio.gather(*tasks)
    finally:
        await trainer.close()
    lags: Counter[int] = Counter()
    phases: Counter[str] = Counter()
    for r in reports:
        lags.update(r.staleness)
        phases.update(r.seconds)
    rollouts = sum(r.rollouts for r in reports)
    return {
        "staleness_k": p.rl.staleness,
        "iterations": len(reports),
        "rollouts": rollouts,
        "wall_s": round(wall, 3),
        "rollouts_per_s": round(rollouts / wall, 1),
        "trainer_phase_mean_s": {k: round(v / len(reports), 4) for k, v in phases.items()},
        "rollout_generate_s": [round(s.generate_s, 3) for s in stats],
        "staleness": dict(sorted(lags.items())),
        "weight_sync_bytes": trainer.weight_sync_bytes,
        "pass_rate_first_last_5": [
            round(sum(r.pass_rate for r in reports[:5]) / len(reports[:5]), 4),
            round(sum(r.pass_rate for r in reports[-5:]) / len(reports[-5:]), 4),
        ],
        "kl_last": round(reports[-1].kl, 5),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    peers = await start_peers(1 + args.peers)
    try:
        modes = {
            "sync": await run_mode(peers, plan("c0" * 16, args, 0)),
            "async": await run_mode(peers, plan("c1" * 16, args, args.async_k)),
        }
    finally:
        await stop_peers(peers)
    sync, asynchronous = modes["sync"], modes["async"]
    return {
        "peers": {"trainer": 1, "rollout": args.peers},
        "sizes": {
            "global_batch": args.global_batch,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
        },
        "sync": sync,
        "async": asynchronous,
        "async_over_sync_rollouts_per_s": round(asynchronous["rollouts_per_s"] / sync["rollouts_per_s"], 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2, help="rollout peers")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=256, help="completions per iteration")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--async-k", type=int, default=1, help="staleness of the async mode")
    parser.add_argument("--digits", type=int, default=2, help="largest operand of the addition task")
    parser.add_argument("--warmup-steps", type=int, default=0, help="supervised warm-up before GRPO")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
