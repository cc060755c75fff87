"""The all-reduce arithmetic of one member, without I/O: what it sends, how it reduces, what everyone ends with.

Member ``r`` of ``D`` (shares from ``partition.share_bounds``):

1. *reduce-scatter*: for every other rank ``j`` it encodes its slice ``j`` with sender-side
   error feedback (key ``send/j``) and sends it to ``j``; its own slice ``r`` stays exact;
2. *reduce*: with all ``D`` contributions to share ``r`` (decoded, in rank order) it computes
   ``((c_0 + c_1) + …) / D``, a fixed order, and encodes the mean with reducer-side error
   feedback (key ``reduce``);
3. *all-gather*: every member, the reducer included, takes share ``r`` to be exactly what
   those bytes decode to — so all members end with bit-identical results, compressed or not.

``simulate`` runs a whole group through these same functions in one process: the reference
the network path is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerd.averaging.aggregate import Aggregator, parse_aggregator
from peerd.averaging.codec import GradientCompression, build_codec, decode_share, finite
from peerd.averaging.partition import share_bounds
from peerd.compress.gradient import Encoded, ErrorFeedbackCompressor
from peerd.errors import CodecError, ErrorCode


class MemberMath:
    """Rank ``rank``'s side of the averaging arithmetic, with its two error-feedback stores."""

    def __init__(
        self,
        rank: int,
        members: int,
        compression: GradientCompression | None,
        aggregator: Aggregator | str | None = None,
    ) -> None:
        assert 0 <= rank < members
        self.rank = rank
        self.members = members
        self.aggregator = parse_aggregator(aggregator)  # the robust-aggregation hook (default: the mean)
        # one codec each: codecs reuse scratch buffers, and the two sides may run in different threads.
        # Residuals are staged: they count only once the whole group step succeeded (a retry
        # resends the same bytes); share sizes change with the group, so a reshaped key starts over.
        self.sender = ErrorFeedbackCompressor(codec=build_codec(compression), on_reshape="reset")
        self.reducer = ErrorFeedbackCompressor(codec=build_codec(compression), on_reshape="reset")

    def contributions(self, flat_N: torch.Tensor) -> tuple[torch.Tensor, dict[int, bytes]]:
        """This member's exact own share and one encoded frame per other rank (residuals staged)."""
        if not finite(flat_N):  # refuse before anything is sent: NaN poisons every member
            raise CodecError("local gradients hold NaN or Inf", code=ErrorCode.NON_FINITE)
        bounds = share_bounds(flat_N.numel(), self.members)
        frames = {}
        for j, (start, end) in enumerate(bounds):
            if j != self.rank:
                frames[j] = self.sender.compress(f"send/{j}", flat_N[start:end], stage=True)
        start, end = bounds[self.rank]
        return flat_N[start:end], frames

    def reduce(self, parts: Sequence[torch.Tensor]) -> Encoded:
        """The aggregate (by default the mean) of the ``D`` contributions to this member's share, encoded for the all-gather."""
        assert len(parts) == self.members
        acc = self.aggregator.aggregate(parts)
        return self.reducer.encode("reduce", acc, stage=True)  # both codecs refuse NaN/Inf (NON_FINITE)

    def commit(self) -> None:
        self.sender.commit()
        self.reducer.commit()

    def discard(self) -> None:
        self.sender.discard()
        self.reducer.discard()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"sender": self.sender.state_dict(), "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.sender.load_state_dict(state.get("sender", {}))
        self.reducer.load_state_dict(state.get("reducer", {}))


def simulate(maths: Sequence[MemberMath], flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One step of the whole group in one process; returns each member's averaged flat vector.

    Bytes move between members exactly as over the wire (encode -> bytes -> decode_share);
    residuals are committed at the end, as after a successful network step.
    """
    members = len(maths)
    numel = flats[0].numel()
    bounds = share_bounds(numel, members)
    sent = [m.contributions(f) for m, f in zip(maths, flats, strict=True)]
    gathered: list[bytes] = []
    for j, (start, end) in enumerate(bounds):
        parts = [sent[i][0] if i == j else decode_share(sent[i][1][j], end - start) for i in range(members)]
        gathered.append(maths[j].reduce(parts).payload)
    result_N = torch.cat([decode_share(gathered[j], end - start) for j, (start, end) in enumerate(bounds)])
    for m in maths:
        m.commit()
    return [result_N.clone() for _ in range(members)]
