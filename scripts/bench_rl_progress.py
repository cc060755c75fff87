"""What an rl trainer's progress record costs the daemon's event loop as a run grows.

The progress publisher builds the trainer's record every second or so, on the event loop whose
thread also hands the trainer's compute thread its work; the time it holds the GIL there is
time the compute waits. ``RunFigures`` folds each iteration's report once, as it comes; the
baseline re-folds every report so far for each record (what the trainer did before). Both are
timed here at a short and a long run, with synthetic reports shaped like the trainer's.
Machines are shared and noisy: read the ratio, not the times.

    .venv/bin/python scripts/bench_rl_progress.py [--iterations 100 --iterations 50000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from statistics import median

from peerd.jobs.rl.progress import RunFigures, figures
from peerd.jobs.rl.report import PHASES, IterationReport

PHASE_NAMES = (*PHASES, "generate")


def report(i: int, rng: random.Random) -> IterationReport:
    return IterationReport(
        iteration=i,
        version=i + 1,
        reward_mean=rng.random(),
        pass_rate=rng.random(),
        format_rate=1.0,
        kl=0.01,
        loss=-0.1,
        clip_fraction=0.0,
        response_len=3.0,
        rollouts=128,
        updates=2,
        shards=2,
        staleness={0: 96, 1: 32},
        weight_sync_bytes=4096,
        seconds={k: rng.random() * 0.01 for k in PHASE_NAMES},
        rollouts_per_s=5000.0 * (0.5 + rng.random()),
    )


def seconds(fn: Callable[..., object], args: tuple[object, ...], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - began)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, action="append", help="run lengths (default: 100 and 50000)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    for n in args.iterations or [100, 50_000]:
        reports = [report(i, rng) for i in range(n)]
        run = RunFigures()
        for r in reports:
            run.add(r)
        assert run.figures(n) == figures(reports, n)  # the same record either way
        refold = seconds(figures, (reports, n), args.repeats)
        folded = seconds(run.figures, (n,), args.repeats)
        rows.append(
            {
                "iterations": n,
                "refold_every_report_ms": refold * 1e3,
                "folded_as_they_come_ms": folded * 1e3,
                "ratio_refold_over_folded": refold / folded,
            }
        )
    print(json.dumps({"benchmark": "rl-progress-record", "repeats": args.repeats, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
