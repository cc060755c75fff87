"""Parallel layouts of one task (data x pipeline x tensor parallel) and the tasklet -> device arrangement.

A group of ``n`` devices runs each of its tasks with a layout ``dp * pp * tp = n``; tasklet
(replica r, stage s, tensor rank t) goes to one device. The arrangement is canonical: devices
sorted by (region, TFLOPS desc, memory bandwidth desc, memory desc, position), then

- ``replica_major``: position p -> replica p // (pp tp), stage (p // tp) % pp, rank p % tp
  (each pipeline replica is a block of neighbours; data-parallel groups span the blocks);
- ``stage_major``: position p -> stage p // (dp tp), replica (p // tp) % dp, rank p % tp
  (each stage's data-parallel group is a block; pipelines span the blocks).

Tensor ranks are always adjacent (same node when nodes are regions). Only device attributes
enter the sort, so devices of one class are interchangeable and a group's cost depends only
on how many devices of each class it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peerd.sched.rl.cluster import Cluster

TP_DEGREES = (1, 2, 4, 8)
"""Tensor parallelism beyond one 8-GPU node is never worth its per-layer all-reduces."""
MAX_PP = 16


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    stage_major: bool = False
    fsdp: bool = False
    """Parameters sharded and gathered per micro-batch (ZeRO-3; pp = tp = 1): the verl-like
    baseline's training and inference, never searched for peerd's own plans."""
    fsdp_size: int = 0
    """With ``fsdp``: devices per shard group (verl's ``fsdp_config.fsdp_size``); 0 = all ``dp``
    devices (FULL_SHARD), fewer = HYBRID_SHARD (shard inside groups of consecutive devices in
    scenario order, replicate across groups)."""
    micro_batch: int = 0
    """With ``fsdp``: sequences per micro-batch on each device (verl's ``*_micro_batch_size_per_gpu``);
    0 = the workload's."""

    @property
    def shard(self) -> int:
        """Devices per FSDP shard group (``dp`` for FULL_SHARD)."""
        return self.fsdp_size or self.dp

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        order = " stage-major" if self.stage_major else ""
        shard = ""
        if self.fsdp:
            shard = f" fsdp{self.shard}" + (f" mb{self.micro_batch}" if self.micro_batch else "")
        return f"dp{self.dp} pp{self.pp} tp{self.tp}{order}{shard}"

    def to_dict(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {
            "dp": self.dp,
            "pp": self.pp,
            "tp": self.tp,
            "stage_major": self.stage_major,
        }
        if self.fsdp:  # only the baseline's layouts carry the key: peerd's plans print as before
            out["fsdp"] = True
            out["fsdp_size"] = self.shard
            if self.micro_batch:
                out["micro_batch"] = self.micro_batch
        return out


def layouts(n: int, layers: int, heads: int, generation: bool) -> list[Layout]:
    """Every layout of ``n`` devices: tp divides the heads, pp <= layers (and 1 for generation)."""
    out = []
    for tp in TP_DEGREES:
        if n % tp or heads % tp:
            continue
        rest = n // tp
        for pp in range(1, min(rest, layers, 1 if generation else MAX_PP) + 1):
            if rest % pp:
                continue
            dp = rest // pp
            out.append(Layout(dp, pp, tp))
            if dp > 1 and pp > 1:
                out.append(Layout(dp, pp, tp, stage_major=True))
    return out


def canonical_order(cluster: Cluster, devices: list[int]) -> list[int]:
    """The devices in the canonical arrangement order (see the module docstring)."""
    return sorted(
        devices,
        key=lambda i: (
            cluster.regions[i],
            -cluster.flops[i],
            -cluster.mem_bw[i],
            -cluster.memory[i],
            int(cluster.cls[i]),
            i,
        ),
    )


def arrange(ordered: list[int], layout: Layout) -> np.ndarray:
    """Device index of each tasklet, shape (dp, pp, tp), from devices already in arrangement order."""
    assert len(ordered) == layout.size, "a layout uses every device of its group"
    flat = np.asarray(ordered, dtype=np.intp)
    if layout.stage_major:
        return flat.reshape(layout.pp, layout.dp, layout.tp).transpose(1, 0, 2).copy()
    return flat.reshape(layout.dp, layout.pp, layout.tp)
