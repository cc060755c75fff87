"""Free device memory as a peer reports it to the planner: on CUDA it includes the blocks the caching allocator holds unused."""

from __future__ import annotations

import pytest
import torch

from peerd.swarm.profiling import memory_info

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_free_memory_counts_the_allocators_idle_blocks() -> None:
    dev = torch.device("cuda")
    block = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB, then released to the cache
    del block
    driver_free, _ = torch.cuda.mem_get_info(dev)
    idle = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    assert idle >= 256 << 20  # still reserved by this process: the driver counts it as used
    total, free = memory_info(dev)
    assert free is not None and free <= total
    assert (
        free - driver_free >= (256 << 20) * 0.99
    )  # the peer offers it (another process may allocate meanwhile)
    torch.cuda.empty_cache()
