"""Counting dispatched ops and timing one: the inputs of the RL cost model's launch term."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn import functional as F

from peerd.models.launches import ELEMENT_FAMILIES, OpCounter, count_ops, element_seconds, launch_seconds
from peerd.sched.elements import PerFamily
from peerd.wire.types import ElementCosts


def test_the_counter_sees_each_dispatched_op_forward_and_backward():
    a_N = torch.ones(4, requires_grad=True)
    assert count_ops(lambda: a_N.detach() * 2) == 2  # detach, mul
    with OpCounter() as counter:
        (a_N * 3).sum().backward()
    forward = count_ops(lambda: (a_N * 3).sum())
    assert forward == 2 and counter.ops > forward  # the backward's ops count too
    assert count_ops(lambda: 1 + 1) == 0


def test_a_launch_costs_between_ten_nanoseconds_and_ten_milliseconds_here():
    seconds = launch_seconds(torch.device("cpu"), budget_s=0.05)
    assert 1e-8 < seconds < 1e-2


def test_the_counter_adds_up_the_bytes_each_op_reads_and_writes_views_and_excluded_weights_aside():
    x_N = torch.ones(1000)
    weight_NN = torch.ones(1000, 1000)
    with OpCounter() as counter:
        y_N = x_N * 2  # reads 4 kB, writes 4 kB
        y_N.add_(1.0)  # reads and writes the same 4 kB
        y_N.view(10, 100).t()  # views: nothing moves
    assert counter.ops == 4 and counter.bytes == 4 * 4000
    with OpCounter(exclude=[weight_NN]) as counter:
        weight_NN.t() @ x_N  # the matmul's weight reads are the arithmetic's, not this count's
    assert counter.bytes == 4000 + 4000


def test_the_counter_counts_the_units_of_each_element_family():
    x_BTC = torch.randn(2, 8, 16, requires_grad=True)
    q_BHTD = torch.randn(3, 2, 8, 4, requires_grad=True)
    with OpCounter() as counter:
        y = F.gelu(x_BTC, approximate="tanh")  # 256 elements forward, 256 in its backward
        F.gelu(x_BTC)  # the erf GELU runs near the memory bandwidth: priced by its traffic
        z = F.log_softmax(x_BTC, dim=-1)  # 256; its backward streams: not a family
        torch.softmax(x_BTC.detach(), dim=-1), x_BTC.detach().exp()  # 256 each
        a = F.scaled_dot_product_attention(q_BHTD, q_BHTD, q_BHTD, is_causal=True)  # 3 x 2 heads
        (y.sum() + z.sum() + a.sum()).backward()  # the attention's backward: 6 heads more
    assert counter.elements == {"gelu": 512, "softmax": 768, "attention": 6, "attention_backward": 6}
    assert tuple(counter.elements) == ELEMENT_FAMILIES


def test_the_cost_models_per_family_numbers_follow_the_counters_families():
    assert tuple(f.name for f in dataclasses.fields(PerFamily)) == ELEMENT_FAMILIES
    assert tuple(ElementCosts.__struct_fields__) == ELEMENT_FAMILIES
    units, ns = PerFamily(1000, 2000, 10, 20), PerFamily(2.0, 0.5, 500.0, 1000.0)
    assert units.seconds(ns) == pytest.approx(1e-9 * (2000 + 1000 + 5000 + 20000))


def test_element_costs_are_what_a_familys_workload_takes_beyond_its_launches_and_traffic():
    dev = torch.device("cpu")
    costs = element_seconds(dev, 2e-6, 4e10, budget_s=0.08)
    assert tuple(costs) == ELEMENT_FAMILIES
    assert all(0.0 <= s < 1e-3 and math.isfinite(s) for s in costs.values())
    # a device whose launches alone took longer than any workload: nothing is left per unit
    assert set(element_seconds(dev, 1.0, 4e10, budget_s=0.02).values()) == {0.0}
