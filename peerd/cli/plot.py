"""The loss plot of ``peerd demo``: a job's loss against its step, drawn with matplotlib into a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_loss_plot(view: dict[str, Any], path: Path) -> Path | None:
    """Loss vs step of the job (the last stage's replicas, averaged); None when there is no curve yet."""
    points = (view.get("progress") or {}).get("losses") or []
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps, losses = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, marker=".", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    name = view.get("name") or view["job_id"][:8]
    alloc = view.get("allocation") or {}
    shape = f"{len(alloc['stages'])}x{len(alloc['stages'][0])} pipeline" if alloc.get("stages") else ""
    ax.set_title(f"peerd demo: {name} {shape}".strip())
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
