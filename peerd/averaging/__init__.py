"""Data-parallel gradient averaging inside a stage group: an all-reduce over peerd's own p2p Transport.

Why not hivemind's averaging (``DecentralizedAverager`` / ``GradientAverager``)? Those form
groups by DHT matchmaking under a prefix before every round (``min_matchmaking_time`` 5 s by
default in 1.1.12), with fixed matchmaking and all-reduce deadlines (a known pain: groups
that do not fill in time, peers averaged with whoever showed up).
peerd does not need matchmaking: the committed allocation already tells every replica of a
stage who its D_DP peers are, in an agreed order. Given that, a plain all-reduce over the
transport the pipeline already uses is simpler and gives more:

- the group is exactly the allocation's replicas, so every member averages the same set and
  ends with bit-identical fp32 results (the exactness test of issue 5 needs this); hivemind
  weights and partitions by whoever joined and what bandwidth they claimed;
- only group members may open the stream (NOT_ALLOWED otherwise), frames carry the step and
  a group digest (WRONG_STEP / NOT_ALLOWED), errors are peerd's typed ErrorCodes, and a
  vanished member is reported as PeerUnavailable within one ``timeout`` of no progress,
  which the job runner turns into a retry or a re-plan;
- compression is peerd.compress's codecs and wire format with error feedback on both the
  sender and the reducer side (compression.md; ``ErrorFeedbackCompressor`` with staged
  residuals, committed only when the whole group step succeeded); hivemind's quantizing averagers keep no
  error feedback at all (only its PowerSGD averager does);
- traffic goes through the same link shaper and byte counters as the pipeline streams, so
  benchmarks on emulated WAN links and ``peerd status`` see it;
- no extra DHT traffic or background process per step (hivemind's averager runs in its own
  process with shared-memory tensors).

The all-reduce is reduce-scatter + all-gather (butterfly): each member reduces a 1/D_DP
share, so each sends and receives 2·(D_DP−1)/D_DP of the gradient bytes per step — the
cost model's dp term. The arithmetic is pure (``core``), the network shell is ``allreduce``.
"""

from peerd.averaging.allreduce import PROTOCOL_PREFIX, AveragingStats, GroupAllReduce
from peerd.averaging.codec import GradientCompression, parse_compressor
from peerd.averaging.core import MemberMath, simulate

__all__ = [
    "PROTOCOL_PREFIX",
    "AveragingStats",
    "GradientCompression",
    "GroupAllReduce",
    "MemberMath",
    "parse_compressor",
    "simulate",
]
