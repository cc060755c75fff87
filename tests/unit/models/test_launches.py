"""Counting dispatched ops and timing one: the inputs of the RL cost model's launch term."""

from __future__ import annotations

import torch

from peerd.models.launches import OpCounter, count_ops, launch_seconds


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
