"""What one message costs its machine's CPU: measured on the pipeline's real stream path.

Daemons that share one machine's cores (a local swarm, or several volunteers' daemons on one box)
spend them on their messages as well as on their compute: the stream's framing, acknowledgements
and receive checks in Python, and p2pd's copies and encryption. The cost model counts a layout's
messages and bytes on the cores of their machine (``peerd.sched.cost_peerd``), at the costs this
module measures once per machine (cached with the device profile, ``peerd.swarm.profiling``).

Measurement: two bare p2pd daemons on loopback, a ``StreamSender`` on one and a ``StreamReceiver``
on the other (what stage workers send activations and gradients through), and activation
messages of two sizes, one at a time, each accepted before the next goes: a stage sends one
micro-batch's activation between two computes, not a burst (bursts of 8 cost ~0.6 ms per end
here against ~1.0 ms one at a time: writes, wake-ups and acknowledgements are not shared). The CPU time of the thread that runs both ends' event loop and
of the two p2pd processes, divided by the messages, gives one message's cost at both ends for each
size; the line through the two sizes splits it into a per-message and a per-byte part, each halved
for one end. Where the p2pd processes' CPU cannot be read (no ``/proc``), there is no answer.

Compressing codecs cost their machine too, mostly in Python around a few ops per call (about 1 ms
an encode or a decode of a micro-batch here, more than its values): ``measure_codecs`` times rounds
of the 8-bit and AC-SGD codecs' calls on two micro-batch sizes and splits them the same way.
"""

from __future__ import annotations

import asyncio
import time

import torch

from peerd.compress.codecs import make_codec
from peerd.compress.delta import DeltaConfig, DeltaDecoder, DeltaEncoder
from peerd.compress.quant import QuantConfig
from peerd.errors import PeerdError
from peerd.log import get_logger
from peerd.pipeline.codec import RawDecoder
from peerd.pipeline.frames import KIND_ACT, Expectation, TensorMessage, raw_payload
from peerd.pipeline.sender import StreamSender
from peerd.pipeline.streams import Inbox, StreamConfig, StreamReceiver, StreamStats, stage_protocol
from peerd.swarm.host import children, cpu_seconds
from peerd.swarm.profiling import MessagingCost
from peerd.swarm.transport import Transport, loopback_pair

logger = get_logger(__name__)

# (B, T, C) fp32 activations: 8 KiB (a small model's micro-batch) and 1 MiB (what bytes cost)
SMALL_SHAPE = (2, 16, 64)
LARGE_SHAPE = (2, 256, 512)
MESSAGES_PER_ROUND = 1
# ~0.8 s of CPU at ~1 ms per message (both ends): the p2pd processes' CPU is read in 10 ms ticks
SMALL_ROUNDS = 400
LARGE_ROUNDS = 48  # 48 MiB: ~0.1 s of CPU per byte cost


class StreamPair:
    """A stage-0 sender and a stage-1 receiver on one persistent stream (as between two stage workers)."""

    def __init__(self, client: Transport, server: Transport, tensor: torch.Tensor, count: int) -> None:
        self.client, self.server, self.tensor, self.count = client, server, tensor, count
        self.inbox, self.stats = Inbox(0), StreamStats()
        self.config = StreamConfig(recv_timeout_s=120, ack_timeout_s=120)
        self.protocol = stage_protocol("stream", 1)
        self.payload = raw_payload(tensor)
        self.receiver = StreamReceiver(
            upstream=client.peer_id,
            downstream=None,
            expectations={KIND_ACT: self._expect},
            decoders={KIND_ACT: RawDecoder()},
            inbox=self.inbox,
            stats=self.stats,
            config=self.config,
        )
        self.sender = StreamSender(
            client, server.peer_id, self.protocol, config=self.config, stats=StreamStats()
        )

    def _ids_of(self, step: int, mb: int) -> list[int] | None:
        b = self.tensor.shape[0]
        return list(range(mb * b, (mb + 1) * b)) if 0 <= mb < self.count else None

    def _expect(self, step: int) -> Expectation:
        row = tuple(self.tensor.shape[1:])
        return Expectation("stream", KIND_ACT, 0, "none", "float32", row, (step, step + 1), self._ids_of)

    async def start(self) -> None:
        await self.receiver.serve(self.server, self.protocol)
        await self.sender.start()

    async def run(self, step: int) -> float:
        """Seconds until ``count`` activation messages of step ``step`` are accepted by the receiver."""
        self.inbox.advance(step)
        started = time.perf_counter()
        for mb in range(self.count):
            ids = self._ids_of(step, mb)
            assert ids is not None
            shape = tuple(self.tensor.shape)
            msg = TensorMessage(
                KIND_ACT, "stream", step, mb, 0, tuple(ids), "none", shape, "float32", 0, self.payload.nbytes
            )
            await self.sender.send(msg, self.payload)
        for mb in range(self.count):
            await self.inbox.get(KIND_ACT, step, mb, 120)
        elapsed = time.perf_counter() - started
        await self.sender.flush()
        return elapsed

    async def close(self) -> None:
        await self.sender.close()
        await self.server.stop_serving(self.protocol)


def _cpu(pids: set[int]) -> float | None:
    """This thread's CPU seconds plus those of processes ``pids``; None if one cannot be read."""
    total = time.thread_time()
    for pid in pids:
        used = cpu_seconds(pid)
        if used is None:
            return None
        total += used
    return total


async def _seconds_per_message(
    client: Transport, server: Transport, shape: tuple[int, ...], rounds: int, p2pds: set[int]
) -> float | None:
    """CPU seconds (both ends) per activation message of ``shape`` over ``rounds`` rounds."""
    pair = StreamPair(client, server, torch.randn(*shape), MESSAGES_PER_ROUND)
    await pair.start()
    try:
        await pair.run(0)  # the stream's set-up is not a message's cost
        before = _cpu(p2pds)
        for step in range(1, rounds + 1):
            await pair.run(step)
        after = _cpu(p2pds)
    finally:
        await pair.close()
    if before is None or after is None:
        return None
    return (after - before) / (rounds * MESSAGES_PER_ROUND)


def _codec_seconds(shape: tuple[int, ...], rounds: int) -> float:
    """CPU seconds per compressing codec call on activations of ``shape``: rounds of an 8-bit
    encode and decode and an AC-SGD 4-bit delta encode and decode of the same examples (the calls a
    boundary's two ends make per micro-batch, each direction)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ids = list(range(shape[0]))
    direct = make_codec("q8")
    cfg = DeltaConfig(quant=QuantConfig(bits=4), seed_codec="q8")
    sender, receiver = DeltaEncoder(cfg), DeltaDecoder(cfg)

    def one_round() -> None:
        data, _ = direct.encode(x)
        direct.decode(data)
        receiver.decode(sender.encode(x, ids))

    one_round()  # first visits and scratch buffers are not a call's cost
    started = time.process_time()
    for _ in range(rounds):
        one_round()
    return (time.process_time() - started) / (4 * rounds)


def measure_codecs(small_rounds: int = 200, large_rounds: int = 10) -> tuple[float, float]:
    """(seconds per call, seconds per value) of the compressing boundary codecs on this machine,
    from the line through a small and a large micro-batch's calls (``_codec_seconds``)."""
    small = _codec_seconds(SMALL_SHAPE, small_rounds)
    large = _codec_seconds(LARGE_SHAPE, large_rounds)
    values = torch.Size(LARGE_SHAPE).numel() - torch.Size(SMALL_SHAPE).numel()
    per_value = max(large - small, 0.0) / values
    per_call = max(small - torch.Size(SMALL_SHAPE).numel() * per_value, 0.0)
    return max(per_call, 1e-7), max(per_value, 1e-12)


async def measure_messaging_async(
    small_rounds: int = SMALL_ROUNDS, large_rounds: int = LARGE_ROUNDS
) -> MessagingCost | None:
    """Per-message and per-byte CPU seconds at one end, measured as the module docstring says, and
    what a compressing codec call costs (``measure_codecs``)."""
    before = children()
    async with loopback_pair() as (_a, _b, client, server):
        p2pds = children() - before
        if len(p2pds) != 2:  # no /proc, or not the two daemons just started
            logger.info("cannot read the p2pd daemons' CPU time here: messaging cost not measured")
            return None
        small = await _seconds_per_message(client, server, SMALL_SHAPE, small_rounds, p2pds)
        large = await _seconds_per_message(client, server, LARGE_SHAPE, large_rounds, p2pds)
    if small is None or large is None:
        return None
    small_bytes = 4 * torch.Size(SMALL_SHAPE).numel()
    large_bytes = 4 * torch.Size(LARGE_SHAPE).numel()
    per_byte = max(large - small, 0.0) / (large_bytes - small_bytes)
    per_message = max(small - small_bytes * per_byte, 0.0)
    # halved: each end (and its p2pd) does about half; floors keep both positive on a noisy reading
    return MessagingCost(max(per_message / 2, 1e-7), max(per_byte / 2, 1e-12), *measure_codecs())


def measure_messaging() -> MessagingCost | None:
    """``measure_messaging_async`` on its own event loop (~2 s; the profile measures it in a worker
    thread); None where it cannot be measured here (logged)."""
    try:
        cost = asyncio.run(measure_messaging_async())
    except (TimeoutError, PeerdError, OSError, RuntimeError) as exc:
        logger.warning("could not measure what a message costs this machine: %s", exc)
        return None
    if cost is not None:
        logger.info(
            "a message costs this machine %.0f µs of CPU at each end, and %.2f ns per byte; a codec call"
            " %.0f µs and %.2f ns per value",
            cost.message_s * 1e6,
            cost.byte_s * 1e9,
            (cost.codec_s or 0.0) * 1e6,
            (cost.codec_value_s or 0.0) * 1e9,
        )
    return cost
