"""What one job can make a peer buffer for AC-SGD (issue 15): every job's boundary sides are bounded in all.

A job's spec picks the data, batch and model sizes, so the number of distinct examples that
cross a boundary is the spec author's choice; device and RAM budgets alone only decided where
the buffers went, and spill files took the rest without bound. Every job now runs with a total
per side (``CompressionConfig.buffer_total_mb``), the same on every peer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peerd.errors import ConfigError
from peerd.pipeline.codec import CompressionConfig, build_codecs

EXAMPLE = (64, 128)  # (T, C): 32 KiB per example in float32


def test_a_jobs_acsgd_buffers_are_bounded_in_all_on_both_sides_alike():
    comp = CompressionConfig(forward="acsgd")  # what the job runner builds: the budgets are the defaults
    sender = build_codecs(comp, first=True, last=False).send_act.codec
    receiver = build_codecs(comp, first=False, last=True).recv_act.codec
    x = torch.randn(2, *EXAMPLE)
    receiver.decode(sender.encode(x, [0, 1]))
    per_example = EXAMPLE[0] * EXAMPLE[1] * 4
    bound = int(comp.buffer_total_mb * 2**20) // per_example
    assert sender.store.room() == receiver.store.room() == bound - 2
    sender.close()
    receiver.close()


def test_a_negative_total_is_refused():
    with pytest.raises(ConfigError, match="buffer_total_mb"):
        dataclasses.replace(CompressionConfig(), buffer_total_mb=-1.0).validate()
