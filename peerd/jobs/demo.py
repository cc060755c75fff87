"""The job ``peerd demo`` runs: the built-in tiny GPT spec sized to the local swarm, and its summary.

The embedded spec is ``configs/jobs/gpt-tiny-demo.yaml`` (so the demo works from an installed
wheel, where ``configs/`` is absent) with short planning windows, because every daemon of
the demo shares this machine's clock. ``summarize`` turns the final job view into the
numbers the demo prints (``peerd.cli.plot`` draws its loss curve).
"""

from __future__ import annotations

import copy
from typing import Any

from peerd.jobs.views import compression_by_kind

DEMO_SPEC: dict[str, Any] = {
    "name": "gpt-tiny-demo",
    "kind": "pretrain",
    "model": {"preset": "tiny", "seed": 0},
    # 255 windows for 120 steps x 16 examples: each example comes back ~7.5 times, so AC-SGD sends
    # deltas from an example's second visit on (a single pass would send only first visits)
    "data": {"source": "builtin", "seq_len": 64, "max_bytes": 16384},
    "steps": 120,
    "global_batch": 16,
    "micro_batch": 4,
    "optimizer": {
        "name": "adamw",
        "lr": 0.003,
        "betas": [0.9, 0.95],
        "weight_decay": 0.01,
        "warmup_steps": 10,
        "schedule": "cosine",
    },
    "parallel": {"d_pp": 3, "d_dp": 2},
    "compression": {
        "forward": "acsgd",
        "forward_bits": 4,
        "first_visit": "q8",
        "backward_bits": 8,
        "gradient_bits": 8,
    },
    "checkpoint_interval": 40,
    "min_peers": 6,
    "max_peers": 6,
    "planning": {"time_budget_s": 5, "max_skew_s": 1.0},
}


def demo_shape(peers: int) -> tuple[int, int]:
    """(d_pp, d_dp) for a swarm of ``peers``: 3 stages x 2 replicas from six peers, smaller below."""
    if peers >= 4:
        return min(3, peers // 2), 2
    return max(1, peers), 1


def demo_spec(peers: int, steps: int | None = None, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The demo spec mapping for ``peers`` daemons (the extra ones observe), optionally with ``steps``."""
    spec = copy.deepcopy(base if base is not None else DEMO_SPEC)
    if base is None:
        d_pp, d_dp = demo_shape(peers)
        spec["parallel"] = {"d_pp": d_pp, "d_dp": d_dp}
        spec["min_peers"] = spec["max_peers"] = d_pp * d_dp
    if steps is not None:
        spec["steps"] = steps
        spec["checkpoint_interval"] = max(1, min(spec.get("checkpoint_interval", steps), steps))
        optimizer = spec.setdefault("optimizer", {})
        optimizer["warmup_steps"] = min(optimizer.get("warmup_steps", 0), max(0, steps - 1))
    return spec


def summarize(view: dict[str, Any], submitted_at: float) -> dict[str, Any]:
    """The demo's closing numbers from a final ``job_status`` view."""
    progress = view.get("progress") or {}
    losses = [loss for _, loss in progress.get("losses") or []]
    sent = progress.get("bytes") or {}
    kinds = ("activations", "gradients", "averaging")
    wire = {k: sent.get(k, 0) for k in kinds}
    raw = {k: sent.get(f"{k}_raw", 0) for k in kinds}
    alloc = view.get("allocation") or {}
    islands = [r["best_cost"] for r in (view.get("planning") or {}).get("islands", []) if r.get("best_cost")]
    out: dict[str, Any] = {
        "job_id": view["job_id"],
        "state": view["state"],
        "steps": progress.get("step"),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "tokens_per_s": progress.get("tokens_per_s"),
        "wire_bytes": wire,
        "raw_bytes": raw,
        "compression_ratio": round(sum(raw.values()) / sum(wire.values()), 3) if sum(wire.values()) else None,
        "compression_by_kind": compression_by_kind(sent),
        "regime": ((view.get("spec") or {}).get("compression") or {}).get("regime"),
        "bytes_saved": sum(raw.values()) - sum(wire.values()),
        "allocation_hash": alloc.get("allocation_hash"),
        "allocation_cost": alloc.get("cost"),
        "island_best_cost": min(islands) if islands else None,
        "pipelines": alloc.get("pipelines"),
        "layers": alloc.get("layers"),
        "submitted_at": submitted_at,
    }
    return out
