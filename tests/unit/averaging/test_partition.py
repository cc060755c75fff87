"""Share cuts, flatten/unflatten and the digests members compare."""

from __future__ import annotations

import pytest
import torch

from peerd.averaging.partition import flatten, group_digest, layout_of, share_bounds, unflatten
from peerd.errors import ConfigError


@pytest.mark.parametrize("members", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 1000, 1001, 99_991])
def test_shares_tile_the_vector_and_differ_by_at_most_one(numel: int, members: int):
    bounds = share_bounds(numel, members)
    assert len(bounds) == members
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(members - 1))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == numel


def test_share_bounds_rejects_empty_group():
    with pytest.raises(ConfigError):
        share_bounds(10, 0)


def test_flatten_unflatten_round_trip_keeps_shapes_dtypes_and_values():
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).half(),
        torch.randn(2, 2, 2, generator=g),
    ]
    flat = flatten(tensors)
    assert flat.dtype == torch.float32 and flat.shape == (15 + 7 + 8,)
    assert torch.equal(flat[:15], tensors[0].reshape(-1))
    back = unflatten(flat, tensors)
    assert [t.shape for t in back] == [t.shape for t in tensors]
    assert [t.dtype for t in back] == [t.dtype for t in tensors]
    for a, b in zip(back, tensors, strict=True):
        assert torch.equal(a, b)
    flat[0] = 123.0  # flatten copies: the inputs are untouched
    assert tensors[0][0, 0] != 123.0


def test_layout_signature_names_shapes_not_values():
    a = layout_of([torch.zeros(3, 4), torch.zeros(5)])
    b = layout_of([torch.ones(3, 4), torch.ones(5)])
    c = layout_of([torch.zeros(4, 3), torch.zeros(5)])
    assert a.numel == 17 and a.sizes == (12, 5)
    assert a.signature() == b.signature() != c.signature()


def test_layout_rejects_empty_and_integer_lists():
    with pytest.raises(ConfigError):
        layout_of([])
    with pytest.raises(ConfigError) as info:
        layout_of([torch.zeros(3), torch.zeros(2, dtype=torch.int64)])
    assert info.value.field == "tensors[1]"


def test_group_digest_depends_on_key_and_member_order():
    d = group_digest("job/stage0", ["a", "b", "c"])
    assert len(d) == 16
    assert d == group_digest("job/stage0", ["a", "b", "c"])
    assert d != group_digest("job/stage0", ["b", "a", "c"])
    assert d != group_digest("job/stage1", ["a", "b", "c"])
