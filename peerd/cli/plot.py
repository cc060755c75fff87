"""The loss plot of ``peerd demo``: a job's loss against its step, drawn with matplotlib into a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_loss_plot(view: dict[str, Any], path: Path) -> Path | None:
    """Loss vs step of the job (the last stage's replicas, averaged), and its held-out loss when the
    job has a validation split; None when there is no curve yet."""
    progress = view.get("progress") or {}
    points = progress.get("losses") or []
    held_out = progress.get("val_losses") or []
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps, losses = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, marker=".", linewidth=1.2, label="training")
    if held_out:  # evaluated after that many steps: the parameters the training loss of that step sees
        ax.plot(*zip(*held_out, strict=True), marker="o", linewidth=1.2, label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
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
