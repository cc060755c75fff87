"""Random heterogeneous clusters for benchmarks and tests: mixed regions, access-link tiers, GPUs.

Regions sit at random points of a plane whose axes are milliseconds, so delays
obey the triangle inequality; wide-area bandwidth falls with distance. Devices
land in regions with uneven (Dirichlet) shares, each behind an access link drawn
from volunteer-like tiers, with a GPU type that fixes both TFLOPS and memory.
"""

from __future__ import annotations

import numpy as np

from peerd.sched.scenario import Device, ModelShape, Regions, Scenario, TrainingSpec

# (name, measured dense fp16 TFLOPS, memory GB, share)
GPU_TYPES = [
    ("t4", 25.0, 16.0, 0.20),
    ("rtx3090", 70.0, 24.0, 0.30),
    ("v100", 100.0, 32.0, 0.20),
    ("a100-40", 220.0, 40.0, 0.20),
    ("a100-80", 250.0, 80.0, 0.10),
]
# (access link Mbit/s, share): home uplinks to data-centre NICs
ACCESS_TIERS = [(100.0, 0.15), (500.0, 0.30), (1000.0, 0.30), (10000.0, 0.25)]


def random_cluster(
    n: int,
    rng: np.random.Generator,
    *,
    regions: int | None = None,
    d_pp: int | None = None,
    layers: int = 24,
    name: str | None = None,
) -> Scenario:
    """A heterogeneous ``n``-device scenario; shape d_pp x (n / d_pp) (default: the most square)."""
    r = regions or int(np.clip(n // 12, 2, 12))
    xy = rng.uniform(0.0, 120.0, size=(r, 2))  # ms
    dist = np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1))
    delay = 2.0 + dist  # one-way ms between regions
    intra = rng.uniform(0.3, 5.0, size=r)
    np.fill_diagonal(delay, intra)
    bw = 1500.0 / (1.0 + dist / 40.0) * rng.uniform(0.7, 1.3, size=(r, r))  # Mbit/s
    bw = (bw + bw.T) / 2.0
    np.fill_diagonal(bw, rng.choice([5000.0, 10000.0, 25000.0], size=r))
    names = [f"r{k:02d}" for k in range(r)]
    share = rng.dirichlet(np.full(r, 1.5))
    region_of = rng.choice(r, size=n, p=share)
    gpu = rng.choice(len(GPU_TYPES), size=n, p=[g[3] for g in GPU_TYPES])
    access = rng.choice([t for t, _ in ACCESS_TIERS], size=n, p=[p for _, p in ACCESS_TIERS])
    width = len(str(n - 1))
    devices = [
        Device(
            id=f"g{k:0{width}d}",
            region=names[region_of[k]],
            tflops=GPU_TYPES[gpu[k]][1],
            memory_gb=GPU_TYPES[gpu[k]][2],
            access_mbps=float(access[k]),
        )
        for k in range(n)
    ]
    if d_pp is None:
        d_pp = max(k for k in range(1, int(np.sqrt(n)) + 1) if n % k == 0)
    return Scenario(
        name=name or f"random-{n}",
        description=f"random heterogeneous cluster: {n} devices, {r} regions",
        regions=Regions(
            names=names,
            delay_ms=np.round(delay, 3).tolist(),
            bandwidth_mbps=np.round(bw, 1).tolist(),
        ),
        devices=devices,
        model=ModelShape(layers=max(layers, d_pp), hidden=2048, seq=2048, params=1.3e9, name="gpt-1.3b"),
        training=TrainingSpec(global_batch=n // d_pp * 32, micro_batch=1, d_pp=d_pp, d_dp=n // d_pp),
    )
