"""One OS process per peer (the benchmark's runner): ready handshakes, the same curve as in-process, shaped
links, clean reaping of every child and its p2pd."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import pytest

from peerd.data.config import DataConfig, build_dataset
from peerd.models.gpt import GPT
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.launch import Placement
from peerd.pipeline.local import LocalRunConfig, train_pipelined
from peerd.pipeline.processes import PeerProcesses
from peerd.swarm.shaper import LinkSpec

pytestmark = pytest.mark.integration

CFG = TrainConfig(
    job="procs",
    model=ModelBuild("tiny"),
    data=DataConfig(seq_len=32, max_bytes=64 * 1024),
    layers_per_stage=[2, 2],
    global_batch=4,
    micro_batch_size=2,
    steps=4,
    lr=3e-3,
    device="cpu",  # the exactness bar is against the CPU reference (a GPU run has its own check)
)


def test_peer_processes_train_like_the_reference_and_leave_nothing_behind():
    async def go():
        procs = PeerProcesses(2, [sys.executable, "-m", "peerd.bench.pipeline"], threads=1)
        try:
            await procs.start()
            plain = await procs.run(CFG, Placement([[0], [1]]), timeout=120)
            slow = dataclasses.replace(CFG, job="procs-shaped", steps=2)
            # 2 Mbit/s + 20 ms: 2 x 16 KiB per micro-batch each way cannot take less than ~0.15 s a step
            shaped = await procs.run(slow, Placement([[1], [0]]), link=LinkSpec(0.02, 2e6), timeout=120)
        finally:
            await procs.close()
        return procs, plain, shaped

    procs, plain, shaped = asyncio.run(asyncio.wait_for(go(), 240))
    local = LocalRunConfig(steps=4, global_batch=4, micro_batch_size=2, layers_per_stage=[2, 2], lr=3e-3)
    reference = train_pipelined(GPT(CFG.model.gpt(), seed=0), build_dataset(CFG.data), local)
    assert plain.ok and shaped.ok, (plain.errors, shaped.errors)
    assert plain.losses() == pytest.approx(reference, rel=1e-5)
    assert shaped.losses() == pytest.approx(reference[:2], rel=1e-5)  # the roles swapped peers, same job
    assert all(r.step_s > 0.15 for r in shaped.reports)
    assert plain.stats["s0r0"]["wire_bytes"]["b0.fwd.sent"] > 4 * 2 * 2 * 32 * 64 * 4
    for child in procs.children:
        assert child.proc.returncode == 0
        with pytest.raises(ProcessLookupError):  # its process group (p2pd included) is gone
            os.killpg(child.proc.pid, 0)
