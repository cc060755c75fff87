"""``peerd bench grpo``: supervised warm-up, then single-process GRPO; pass rate against the starting policy.

The baseline is the starting policy itself, measured in the same run: the warmed-up weights are
evaluated on a fixed, held-out problem set (``--eval-problems`` problems, ``--group-size``
samples each at the training temperature, plus greedy), GRPO runs ``--steps`` iterations, and the
trained policy is evaluated on the same problems with the same sampling seed. The JSON holds:

- ``iterations``: per iteration, pass rate and reward mean of its rollouts, k3 KL to the
  reference, mean response length, clip fraction, and seconds per phase;
- ``start`` / ``end``: the held-out evaluations; ``summary``: their ratio, the target of issue 13
  (``min(3 x start, 0.6)``) and whether it was met, the largest KL, rollouts/s, and the mean
  seconds per phase (generate, reference, reward, actor_train, weight_sync) with their shares:
  what the RL cost model's per-task predictions are checked against.

Threads: one torch thread by default (``--threads``), so the per-phase times are those of one
core and do not depend on how busy the machine's other cores are.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import click
import torch

from peerd.bench import emit_json
from peerd.log import get_logger
from peerd.models.gpt import GPT, GPTConfig
from peerd.rl.loss import GRPOLossConfig
from peerd.rl.rollout import SamplingConfig
from peerd.rl.tasks import TASKS, TaskConfig, make_task
from peerd.rl.trainer import PHASES, GRPOConfig, GRPOTrainer, evaluate
from peerd.rl.warmup import WarmupConfig, supervised_warmup

log = get_logger(__name__)

TARGET_RATIO, TARGET_PASS = 3.0, 0.6  # issue 13: 3x the starting pass rate or >= 0.6, whichever is lower


def run(
    task_cfg: TaskConfig,
    model_cfg: GPTConfig,
    warmup: WarmupConfig,
    grpo: GRPOConfig,
    steps: int,
    eval_problems: int,
    seed: int,
) -> dict:
    """Warm-up, evaluate, GRPO for ``steps`` iterations, evaluate again; the bench's JSON as a dict."""
    task = make_task(task_cfg)
    model = GPT(model_cfg, seed=seed)
    held_out = task.problems(
        eval_problems, seed=seed + 1_000_003
    )  # apart from the training and warm-up streams
    greedy = SamplingConfig(max_new_tokens=grpo.sampling.max_new_tokens, temperature=0.0)

    def assess() -> dict:
        sampled = evaluate(model, task, held_out, grpo.group_size, grpo.sampling, seed)
        return {
            **asdict(sampled),
            "greedy_pass_rate": evaluate(model, task, held_out, 1, greedy, seed).pass_rate,
        }

    warm = supervised_warmup(model, task, warmup)
    start = assess()
    log.info("start: pass %.3f (greedy %.3f)", start["pass_rate"], start["greedy_pass_rate"])
    trainer = GRPOTrainer(model, task, grpo)
    iterations = []
    t0 = time.perf_counter()
    for i in range(steps):
        iterations.append(asdict(stats := trainer.step()))
        if (i + 1) % 50 == 0:
            log.info(
                "grpo %d/%d: pass %.3f reward %.3f kl %.3f",
                i + 1,
                steps,
                stats.pass_rate,
                stats.reward_mean,
                stats.kl,
            )
    grpo_seconds = time.perf_counter() - t0
    end = assess()

    phase_total = {p: sum(it["seconds"][p] for it in iterations) for p in PHASES}
    busy = sum(phase_total.values())
    target = min(TARGET_RATIO * start["pass_rate"], TARGET_PASS)
    return {
        "config": {
            "task": asdict(task_cfg),
            "model": {**asdict(model_cfg), "params": model.num_parameters()},
            "warmup": asdict(warmup),
            "grpo": asdict(grpo),
            "steps": steps,
            "eval_problems": eval_problems,
            "seed": seed,
            "threads": torch.get_num_threads(),
        },
        "warmup": {
            "steps": warmup.steps,
            "loss_first": warm.losses[0] if warm.losses else None,
            "loss_last": warm.losses[-1] if warm.losses else None,
            "seconds": warm.seconds,
        },
        "start": start,
        "end": end,
        "iterations": iterations,
        "summary": {
            "pass_rate_start": start["pass_rate"],
            "pass_rate_end": end["pass_rate"],
            "pass_rate_ratio": end["pass_rate"] / start["pass_rate"] if start["pass_rate"] else None,
            "target_pass_rate": target,
            # a start already at the target proves nothing: the run must also have raised the pass rate
            "target_met": end["pass_rate"] >= target and end["pass_rate"] > start["pass_rate"],
            "reward_mean_start": start["reward_mean"],
            "reward_mean_end": end["reward_mean"],
            "kl_max": max((it["kl"] for it in iterations), default=0.0),
            "kl_median": statistics.median(it["kl"] for it in iterations) if iterations else None,
            "kl_last10": _tail_mean([it["kl"] for it in iterations]),
            "pass_rate_last10": _tail_mean([it["pass_rate"] for it in iterations]),
            "response_len_last10": _tail_mean([it["response_len"] for it in iterations]),
            "rollouts_per_s": sum(it["rollouts"] for it in iterations) / grpo_seconds
            if grpo_seconds
            else None,
            "grpo_seconds": grpo_seconds,
            "phase_seconds_mean": {p: v / max(steps, 1) for p, v in phase_total.items()},
            "phase_share": {p: v / busy for p, v in phase_total.items()} if busy else {},
        },
    }


def _tail_mean(xs: list[float], n: int = 10) -> float | None:
    tail = xs[-n:]
    return sum(tail) / len(tail) if tail else None


# Per-task defaults, measured on a 2-core shared CPU to reach the target in a few minutes: the
# warm-up leaves the policy well short of solving the task, GRPO does the rest. 1..2-digit addition
# rises too, but slower (1.4-1.9x in 500-800 iterations): pass --max-size 2 to see it.
PRESETS: dict[str, dict[str, float | int]] = {
    "addition": {
        "min_size": 1,
        "max_size": 1,
        "warmup_steps": 150,
        "lr": 1e-3,
        "d_model": 32,
        "kl_coef": 0.04,
    },
    # reversal sharpens hardest: at kl_coef 0.04 its KL kept climbing (1.4 over the last 10 iterations)
    "reversal": {
        "min_size": 1,
        "max_size": 4,
        "warmup_steps": 200,
        "lr": 1e-3,
        "d_model": 64,
        "kl_coef": 0.1,
    },
    "sorting": {"min_size": 2, "max_size": 5, "warmup_steps": 60, "lr": 1e-3, "d_model": 64, "kl_coef": 0.04},
}


def _preset_help(key: str) -> str:
    return ", ".join(f"{task} {p[key]:g}" for task, p in PRESETS.items())


@click.command("grpo")
@click.option("--task", "task_name", type=click.Choice(sorted(TASKS)), default="addition", show_default=True)
@click.option(
    "--min-size",
    type=int,
    default=None,
    help=f"Smallest operand digits / string length [{_preset_help('min_size')}].",
)
@click.option(
    "--max-size",
    type=int,
    default=None,
    help=f"Largest operand digits / string length [{_preset_help('max_size')}].",
)
@click.option("--steps", type=int, default=300, show_default=True, help="GRPO iterations.")
@click.option(
    "--warmup-steps",
    type=int,
    default=None,
    help=f"Supervised warm-up steps first [{_preset_help('warmup_steps')}].",
)
@click.option("--group-size", type=int, default=8, show_default=True, help="Completions per prompt (G).")
@click.option("--prompts", type=int, default=16, show_default=True, help="Prompts per iteration.")
@click.option("--lr", type=float, default=None, help=f"GRPO learning rate, AdamW [{_preset_help('lr')}].")
@click.option(
    "--kl-coef", type=float, default=None, help=f"Weight of the k3 KL penalty [{_preset_help('kl_coef')}]."
)
@click.option("--staleness", type=int, default=0, show_default=True, help="Async bound k (0 = sync).")
@click.option(
    "--d-model", type=int, default=None, help=f"Width of the 2-layer GPT [{_preset_help('d_model')}]."
)
@click.option(
    "--eval-problems", type=int, default=256, show_default=True, help="Held-out problems for start/end."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="torch threads (1: per-phase times of one core).",
)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the JSON here.")
def command(
    task_name: str,
    min_size: int | None,
    max_size: int | None,
    steps: int,
    warmup_steps: int | None,
    group_size: int,
    prompts: int,
    lr: float | None,
    kl_coef: float | None,
    staleness: int,
    d_model: int | None,
    eval_problems: int,
    seed: int,
    threads: int,
    out: str | None,
) -> None:
    """Warm up a small GPT on a task's format, then GRPO; prints pass rate, KL and per-phase times (JSON).

    Options left out take the task's preset (shown in brackets).
    """
    if steps < 1 or eval_problems < 1 or threads < 1:
        raise click.BadParameter("--steps, --eval-problems and --threads must be >= 1")
    preset = PRESETS[task_name]
    min_size = int(preset["min_size"]) if min_size is None else min_size
    max_size = int(preset["max_size"]) if max_size is None else max_size
    warmup_steps = int(preset["warmup_steps"]) if warmup_steps is None else warmup_steps
    lr = float(preset["lr"]) if lr is None else lr
    d_model = int(preset["d_model"]) if d_model is None else d_model
    kl_coef = float(preset["kl_coef"]) if kl_coef is None else kl_coef
    torch.set_num_threads(threads)
    task_cfg = TaskConfig(name=task_name, min_size=min_size, max_size=max_size)
    task = make_task(task_cfg)
    max_new = task.max_answer_len + 1  # the answer and the end marker
    model_cfg = GPTConfig(n_layer=2, n_head=2, d_model=d_model, max_seq_len=task.max_prompt_len + max_new)
    grpo = GRPOConfig(
        group_size=group_size,
        prompts_per_step=prompts,
        lr=lr,
        staleness=staleness,
        seed=seed,
        sampling=SamplingConfig(max_new_tokens=max_new),
        loss=GRPOLossConfig(kl_coef=kl_coef),
    )
    warmup = WarmupConfig(steps=warmup_steps, seed=seed + 1)  # its own problem stream
    emit_json(run(task_cfg, model_cfg, warmup, grpo, steps, eval_problems, seed), out)
