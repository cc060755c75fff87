"""What one member's arithmetic in one all-reduce dispatches and moves, counted on ``MemberMath``.

A member flattens its gradients, encodes its contribution to every other member's share (error
feedback staged), decodes the others' contributions to its own share, reduces and encodes that
share, decodes the D - 1 averaged shares it gets back and unflattens the result. On a GPU that is
noise; on a CPU peer an 8-bit group of 8 spends about 9 ms of one core on 1.8 M values, which is
as long as the exchange over the matched links of ``peerd bench wan``. The ``peerd`` cost model
prices it like a layer's work beside its FLOPs: ``ops x seconds per op + bytes / memory
bandwidth`` at each device's measured figures (``peerd.sched.scenario.AveragingWork``).

The counts are linear in the group size and the number of values: ``ops + ops_per_partner (D - 1)``
ops and ``values x (bytes_per_value + bytes_per_value_partners (D - 1) / D)`` bytes, to 1-2 % for
shares that are not a whole number of quantizer groups (a whole number saves a tail's padding: a
few % of the bytes; an odd 4-bit tail costs a few ops more). The fit takes two group sizes and two share sizes, counted for real under
``peerd.models.launches.OpCounter``.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from peerd.averaging.aggregate import parse_aggregator
from peerd.averaging.codec import Compressor, decode_share, parse_compressor
from peerd.averaging.core import MemberMath
from peerd.averaging.partition import flatten, share_bounds, unflatten
from peerd.models.launches import OpCounter
from peerd.sched.scenario import AveragingWork

_CHUNK = 4096  # the two counts' shares differ by this many values
# Shares that are not a whole number of quantizer groups (almost every real one) pad their tail:
# some more ops per part and a copy. The counts' shares are ragged like that.
_RAGGED = 100


def count_member_work(compressor: Compressor = None, aggregator: str | None = None) -> AveragingWork:
    """One member's all-reduce arithmetic under the group's compressor and aggregator, fitted
    exactly in the group size and the number of values (see the module docstring)."""
    comp = parse_compressor(compressor)
    return _fit(None if comp is None else comp.bits, aggregator)


@lru_cache(maxsize=16)
def _fit(bits: int | None, aggregator: str | None) -> AveragingWork:
    sizes = (_CHUNK + _RAGGED, 2 * _CHUNK + _RAGGED)  # values per share
    counts = {
        (members, share): _count(members, members * share, bits, aggregator)
        for members in (2, 4)
        for share in sizes
    }
    per_value = {
        members: (counts[members, sizes[1]][1] - counts[members, sizes[0]][1]) / (members * _CHUNK)
        for members in (2, 4)
    }
    ops2, ops4 = counts[2, sizes[0]][0], counts[4, sizes[0]][0]
    partners = (per_value[4] - per_value[2]) / (3 / 4 - 1 / 2)  # per_value(D) = x0 + x1 (D - 1) / D
    return AveragingWork(
        ops=float(ops2 - (ops4 - ops2) / 2),
        ops_per_partner=float((ops4 - ops2) / 2),
        bytes_per_value=float(per_value[2] - partners / 2),
        bytes_per_value_partners=float(partners),
    )


def _count(members: int, values: int, bits: int | None, aggregator: str | None) -> tuple[int, int]:
    """(ops, bytes) of member 0's arithmetic in one step of a group of ``members`` over ``values``."""
    compressor = None if bits is None else f"q{bits}"
    gen = torch.Generator().manual_seed(members * values)
    maths = [
        MemberMath(rank, members, parse_compressor(compressor), parse_aggregator(aggregator))
        for rank in range(members)
    ]
    grads = [
        [torch.randn(values // 2, generator=gen), torch.randn(values - values // 2, generator=gen)]
        for _ in range(members)
    ]
    bounds = share_bounds(values, members)
    sent = [m.contributions(flatten(g)) for m, g in zip(maths, grads, strict=True)]
    answers = [
        maths[j]
        .reduce([sent[i][0] if i == j else decode_share(sent[i][1][j], end - start) for i in range(members)])
        .payload
        for j, (start, end) in enumerate(bounds)
    ]

    def member_step() -> list[torch.Tensor]:
        own, _frames = maths[0].contributions(flatten(grads[0]))
        start, end = bounds[0]
        maths[0].reduce([own] + [decode_share(sent[i][1][0], end - start) for i in range(1, members)])
        out = torch.empty(values)
        for j in range(1, members):
            start, end = bounds[j]
            out[start:end] = decode_share(answers[j], end - start)
        return unflatten(out, grads[0])

    member_step()  # codecs size their scratch buffers on first use
    with OpCounter() as counter:
        member_step()
    return counter.ops, counter.bytes
