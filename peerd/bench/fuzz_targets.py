"""The decoders ``peerd bench fuzz`` attacks: each one a bytes -> value function, with valid seeds from the real encoders.

Every decoder here is a path bytes from another peer (or a file a user was handed) take in
peerd: transport frames, pipeline frames through the receiver's checks and codecs,
compressed tensors and AC-SGD packets, averaging messages and shares, peer records, consensus
messages, job records / indexes / progress / vote lists, state-sync headers and state blobs,
job specs and scenario files. A target also says how to take its seed apart into a tree and
build bytes back (``tree`` / ``build``), for the field-level (wrong-typed) mutations.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
import yaml

from peerd.averaging import messages as avg_messages
from peerd.averaging.codec import build_codec, decode_share, parse_compressor
from peerd.averaging.partition import share_bounds
from peerd.compress import wire
from peerd.compress.codecs import decode_frame, make_codec
from peerd.compress.delta import DeltaConfig, DeltaDecoder, DeltaEncoder
from peerd.compress.quant import QuantConfig
from peerd.errors import ErrorCode
from peerd.jobs import catalog
from peerd.jobs.records import (
    JobIndex,
    Progress,
    TaskState,
    decode_index,
    decode_job,
    decode_progress,
    encode_index,
    encode_job,
    encode_progress,
    new_job_record,
)
from peerd.jobs.spec import load_job_spec, parse_job_spec
from peerd.loading import to_mapping
from peerd.pipeline import statesync
from peerd.pipeline.codec import QuantDecoder, RawDecoder
from peerd.pipeline.frames import (
    CONTROL_KINDS,
    KIND_ACT,
    Abort,
    Ack,
    Assembler,
    Expectation,
    Hello,
    Nack,
    TensorMessage,
    check_message,
    control_header,
    parse_control,
    parse_part,
    part_header,
    raw_payload,
)
from peerd.rl.weights import pack_weights, read_weights
from peerd.sched.allocation import Allocation
from peerd.sched.consensus import messages as consensus
from peerd.sched.scenario import load_scenario
from peerd.swarm.framing import PREFIX_LEN, encode_frame, encode_prefix, error_header, read_frame
from peerd.swarm.records import (
    DeviceKind,
    DeviceProfile,
    PeerRecord,
    PeerState,
    decode_peer_record,
    encode_peer_record,
)

PEER_A = "QmYTJ4YCJcMgEYmsfimctoaJWL2a6WAZN5wht9CVeWDWSz"
PEER_B = "QmS4b4CzEgSbXSUgnZKvJ99r3yBsz53Psgqi7fQT4nGrNk"
T0 = 1_767_225_600.0


@dataclass
class Target:
    """One decoder under attack."""

    name: str
    decode: Callable[[bytes], Any]
    seeds: list[bytes]
    tree: Callable[[bytes], Any]
    """A seed taken apart (a msgpack/YAML tree, or a frame's header) for field-level mutations."""
    build: Callable[[Any, bytes], bytes]
    """Bytes from a mutated tree and the seed it came from (which keeps e.g. a frame's payload)."""
    memory_factor: int = 64
    """Peak heap allowed per input byte: binary decoders hold a copy or two; a YAML file becomes one
    Python object per token (~100 B for 2-4 B of text), so text files get 256."""
    aliases: bool = False
    """The format can share one value between places (YAML anchors): wrong-typed values include
    an alias bomb."""


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _pack(obj: Any, _seed: bytes) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _msgpack_target(name: str, decode: Callable[[bytes], Any], seeds: list[bytes]) -> Target:
    return Target(name, decode, seeds, _unpack, _pack)


# ---------------------------------------------------------------- frames (transport layer and above)


_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP


async def _read(data: bytes) -> tuple[dict[str, Any], bytearray]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    header, payload, _ = await read_frame(reader, timeout=1.0)
    return header, payload


def read_one(data: bytes) -> tuple[dict[str, Any], bytearray]:
    """One transport frame from ``data`` through the real stream reader (limits, truncation, header schema)."""
    return _loop().run_until_complete(_read(data))


def _frame_tree(raw: bytes) -> Any:
    header_len = int.from_bytes(raw[4:8], "big")
    return _unpack(raw[PREFIX_LEN : PREFIX_LEN + header_len])


def _frame_build(header: Any, seed: bytes) -> bytes:
    header_len = int.from_bytes(seed[4:8], "big")
    payload = seed[PREFIX_LEN + header_len :]
    raw = msgpack.packb(header, use_bin_type=True)
    return encode_prefix(len(raw), len(payload)) + raw + payload


def _frame_target(name: str, decode: Callable[[bytes], Any], seeds: list[bytes]) -> Target:
    return Target(name, decode, seeds, _frame_tree, _frame_build)


def transport_target() -> Target:
    seeds = [
        encode_frame({"kind": "probe.ping", "seq": 3, "t": 1.5}, b""),
        encode_frame({"kind": "probe.down", "bytes": 4096, "ids": [1, 2, 3]}, bytes(range(256)) * 4),
        encode_frame(error_header(204, "peer not allowed")),
    ]
    return _frame_target("transport.frame", read_one, seeds)


SHAPE = (2, 4, 8)  # (B, T, C) of the fuzzed pipeline messages
IDS = (11, 12)


def _expect(kind: str) -> Expectation:
    return Expectation(
        "job",
        kind,
        0,
        "none",
        "float32",
        SHAPE[1:],
        (5, 6),
        lambda s, mb: IDS if mb == 0 and s in (5, 6) else None,
    )


def _q8_expect() -> Expectation:
    return Expectation(
        "job",
        KIND_ACT,
        0,
        "q8",
        "float32",
        SHAPE[1:],
        (5, 6),
        lambda s, mb: IDS if mb == 0 and s in (5, 6) else None,
    )


_RAW, _Q8 = RawDecoder(), QuantDecoder("q8", QuantConfig(bits=8))


def decode_pipeline(data: bytes) -> Any:
    """What a stage's receiver does with one frame: schema, checks against the stage, assembly, decode."""
    header, payload = read_one(data)
    if header.get("kind") in CONTROL_KINDS:
        return parse_control(header)
    part = parse_part(header)
    expect = _q8_expect() if part.message.codec == "q8" else _expect(part.message.kind)
    if part.index == 0:
        check_message(part.message, expect)
    done = Assembler().feed(part, payload)
    if done is None:
        return part
    msg, buf = done
    return (_Q8 if msg.codec == "q8" else _RAW).decode(msg, buf)


def pipeline_target() -> Target:
    x = torch.linspace(-2, 2, 64).view(SHAPE)
    raw = TensorMessage(KIND_ACT, "job", 5, 0, 0, IDS, "none", SHAPE, "float32", 4, x.numel() * 4)
    q8_payload, _ = make_codec("uniform", QuantConfig(bits=8)).encode(x)
    q8 = TensorMessage(KIND_ACT, "job", 5, 0, 0, IDS, "q8", SHAPE, "float32", 4, len(q8_payload))
    seeds = [
        encode_frame(part_header(raw), raw_payload(x)),
        encode_frame(part_header(q8), q8_payload),
        encode_frame(part_header(raw, 0, 2, 0), bytes(raw_payload(x))[:128]),
        *(
            encode_frame(control_header(c))
            for c in (
                Ack(7),
                Nack(3, ErrorCode.SHAPE_MISMATCH, "shape"),
                Abort(5, ErrorCode.TIMEOUT, "t"),
                Hello(2),
            )
        ),
    ]
    return _frame_target("pipeline.frame", decode_pipeline, seeds)


def averaging_target() -> Target:
    n = 300
    numel = share_bounds(n, 2)[0][1]
    raw_share = build_codec(None).encode(torch.linspace(-1, 1, numel))[0]
    q8_share = build_codec(parse_compressor("q8")).encode(torch.linspace(-1, 1, numel))[0]
    part = avg_messages.AvgMessage(avg_messages.KIND_PART, "0123456789abcdef", 3, 1, 0, n, "00ff00ff00ff00ff")
    seeds = [
        encode_frame(part.header(), raw_share),
        encode_frame(part.header(), q8_share),
        encode_frame(avg_messages.hello("0123456789abcdef", 4).header()),
    ]

    def decode(data: bytes) -> Any:
        header, payload = read_one(data)
        if header.get("kind") == avg_messages.KIND_HELLO:
            return avg_messages.parse_hello(header, "0123456789abcdef", 4)
        msg = avg_messages.parse(header, avg_messages.KIND_PART)
        avg_messages.check(msg, avg_messages.Expect("0123456789abcdef", src=1, share=0, total=n))
        start, end = share_bounds(msg.total, 2)[0]
        return decode_share(payload, end - start)

    return _frame_target("averaging.message", decode, seeds)


def statesync_target() -> Target:
    seeds = [
        encode_frame(statesync.header(statesync.Describe(stage=1, step=40))),
        encode_frame(
            statesync.header(statesync.Info(stage=1, step=40, size=9000, sha256=bytes(32), chunk=4096))
        ),
        encode_frame(statesync.header(statesync.ChunkRequest(stage=1, step=40, offset=4096, length=4096))),
        encode_frame(statesync.header(statesync.Data(stage=1, step=40, offset=0, length=16)), bytes(16)),
    ]

    def decode(data: bytes) -> Any:
        header, _payload = read_one(data)
        return statesync.parse(header, (*statesync.REQUEST_KINDS, *statesync.REPLY_KINDS))

    return _frame_target("statesync.message", decode, seeds)


def state_blob_target() -> Target:
    state = {"step": 40, "module": {"w": torch.linspace(0, 1, 32).view(4, 8)}, "optimizer": {"lr": 0.1}}
    seed = statesync.pack_state(state)
    return Target("statesync.blob", statesync.unpack_state, [seed], lambda raw: list(raw[:64]), _bytes_prefix)


def rl_weights_target() -> Target:
    """The rl weights blob, read as a rollout peer reads it: against its own model's names and shapes."""
    shapes = {"embed": (4, 8), "head.bias": (3,)}
    seed = pack_weights(7, {name: torch.linspace(-1, 1, math.prod(s)).view(s) for name, s in shapes.items()})

    def decode(raw: bytes) -> Any:
        read_weights(raw, {name: torch.zeros(s) for name, s in shapes.items()}, 7)

    return Target("rl.weights", decode, [seed], lambda raw: list(raw[:64]), _bytes_prefix)


def _bytes_prefix(tree: Any, seed: bytes) -> bytes:
    """A state or weights blob is not a tree: the field-level mutation rewrites its first 64 bytes."""
    head = bytes(v & 0xFF if isinstance(v, int) and not isinstance(v, bool) else 0 for v in tree[:64])
    return head + seed[len(head) :]


# ---------------------------------------------------------------- tensors


_FIRST_VISIT: list[bytes] = []  # the AC-SGD packet that fills a fresh decoder's buffers for ids (1, 2)


def decode_tensor(data: bytes) -> Any:
    """A compressed-tensor frame or an AC-SGD packet (magic decides), decoded as a receiver does.

    Packets go to a fresh decoder whose buffers hold the seed's first visit, so deltas are
    decoded against real buffers and no input sees another's state.
    """
    if data[:2] == wire.PACKET_MAGIC:
        decoder = DeltaDecoder(DeltaConfig())
        decoder.decode(_FIRST_VISIT[0])
        return decoder.decode(data)
    return decode_frame(wire.parse_frame(data), float32=True)


def tensor_target() -> Target:
    x = torch.linspace(-3, 3, 96).view(2, 6, 8)
    seeds = [make_codec("fp32").encode(x)[0], make_codec("fp16").encode(x)[0]]
    for bits in (2, 3, 4, 8):
        seeds.append(make_codec("uniform", QuantConfig(bits=bits)).encode(x)[0])
    seeds.append(
        make_codec("uniform", QuantConfig(bits=4, layout="group", group_size=16)).encode(x.view(-1))[0]
    )
    enc = DeltaEncoder(DeltaConfig())
    _FIRST_VISIT[:] = [enc.encode(x, (1, 2))]  # first visit: the seed codec
    seeds.append(_FIRST_VISIT[0])
    seeds.append(enc.encode(x * 1.01, (1, 2)))  # a delta against the buffers
    return Target("compressed.tensor", decode_tensor, seeds, lambda raw: list(raw[:48]), _bytes_prefix)


# ---------------------------------------------------------------- records


def _profile() -> DeviceProfile:
    return DeviceProfile(
        name="cpu",
        kind=DeviceKind.CPU,
        memory_total_bytes=8 << 30,
        memory_free_bytes=4 << 30,
        tflops={"fp32": 0.5, "bf16": 1.0},
        measured_at=T0,
    )


def peer_record_target() -> Target:
    rec = PeerRecord(
        peer_id=PEER_A,
        name="alice",
        state=PeerState.ONLINE,
        maddrs=[f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_A}"],
        profile=_profile(),
        software_version="0.1.0",
        started_at=T0,
        updated_at=T0 + 30,
        seq=3,
    )
    return _msgpack_target("peer.record", decode_peer_record, [encode_peer_record(rec)])


def consensus_target() -> Target:
    device = consensus.RosterDevice(0.5, 8 << 30, "cpu")
    entry = consensus.RosterEntry(PEER_A, 1, "job", T0, device, (consensus.RosterLink(PEER_B, 0.01, 1e8),))
    allocation = Allocation.from_plain([[PEER_A], [PEER_B]], [], [2, 2])
    cand = consensus.Candidate(
        PEER_A, 1, "job", 1.25, allocation, T0, tuple(sorted((PEER_A, PEER_B))), bytes(32)
    )
    vote = consensus.Vote(PEER_A, 1, 0, "job", 1.25, bytes(32), T0, bytes(32))
    commit = consensus.CommitRecord(PEER_A, 1, 0, "job", T0, cand, ((PEER_A, bytes(32)),), (vote,))
    seeds = [consensus.encode(m) for m in (entry, cand, vote, commit)]
    return _msgpack_target("consensus.message", consensus.decode, seeds)


_SPEC_TEXT = """\
name: fuzz
kind: pretrain
model: {preset: tiny, seed: 0}
data: {source: builtin, seq_len: 64, max_bytes: 1048576}
steps: 120
global_batch: 16
micro_batch: 4
optimizer: {name: adamw, lr: 0.003, betas: [0.9, 0.95], weight_decay: 0.01, warmup_steps: 10, schedule: cosine}
parallel: {d_pp: 3, d_dp: 2}
compression: {forward: acsgd, forward_bits: 4, backward_bits: 8, gradient_bits: 8}
checkpoint_interval: 40
min_peers: 6
max_peers: 6
planning: {time_budget_s: 5}
"""


def job_targets() -> list[Target]:
    spec = parse_job_spec(yaml.safe_load(_SPEC_TEXT))
    job = new_job_record(
        PEER_A, "default", spec, bytes(16), now=T0, epoch0_start=T0 + 5, timing=spec.planning.timing()
    )
    index = JobIndex(PEER_A, (job.job_id,), T0)
    progress = Progress(
        job_id=job.job_id,
        peer=PEER_B,
        epoch=1,
        stage=0,
        replica=1,
        step=3,
        steps=120,
        state=TaskState.RUNNING,
        tokens_per_s=100.0,
        updated_at=T0 + 9,
        started_at=T0 + 6,
        loss=2.5,
        losses=((1, 3.0), (2, 2.7)),
        bytes={"activations": 1000},
        suspects=(PEER_A,),
    )
    vote = consensus.Vote(PEER_A, 1, 0, job.job_id, 1.25, bytes(32), T0, bytes(32))
    return [
        _msgpack_target("job.record", decode_job, [encode_job(job)]),
        _msgpack_target("job.index", decode_index, [encode_index(index)]),
        _msgpack_target("job.progress", decode_progress, [encode_progress(progress)]),
        _msgpack_target(
            "job.votes", catalog.decode_votes, [catalog.encode_votes([consensus.encode(vote)] * 2)]
        ),
    ]


# ---------------------------------------------------------------- files (YAML)


class _Files:
    """One temporary file each decoder rewrites: the loaders take paths, as the CLI gives them."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="peerd-fuzz-"))

    def write(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        return path


_FILES = _Files()


def _yaml_tree(raw: bytes) -> Any:
    return yaml.safe_load(raw.decode())


def _yaml_build(tree: Any, _seed: bytes) -> bytes:
    return yaml.safe_dump(tree, sort_keys=False).encode()


def spec_target() -> Target:
    seed = _SPEC_TEXT.encode()
    as_json = yaml.safe_dump(to_mapping(parse_job_spec(yaml.safe_load(_SPEC_TEXT)))).encode()
    return Target(
        "job.spec",
        lambda data: load_job_spec(_FILES.write("spec.yaml", data)),
        [seed, as_json],
        _yaml_tree,
        _yaml_build,
        memory_factor=256,
        aliases=True,
    )


_SCENARIO_TEXT = """\
name: fuzz
regions:
  names: [a, b]
  delay_ms: [[1.0, 40.0], [40.0, 1.0]]
  bandwidth_mbps: [[1000.0, 50.0], [50.0, 1000.0]]
devices:
- {id: p0, region: a, tflops: 0.1, memory_gb: 8.0}
- {id: p1, region: b, tflops: 0.2, memory_gb: 16.0}
"""


def scenario_target() -> Target:
    return Target(
        "scenario.file",
        lambda data: load_scenario(_FILES.write("scenario.yaml", data)),
        [_SCENARIO_TEXT.encode()],
        _yaml_tree,
        _yaml_build,
        memory_factor=256,
        aliases=True,
    )


def all_targets() -> list[Target]:
    return [
        transport_target(),
        pipeline_target(),
        averaging_target(),
        tensor_target(),
        peer_record_target(),
        consensus_target(),
        *job_targets(),
        statesync_target(),
        state_blob_target(),
        rl_weights_target(),
        spec_target(),
        scenario_target(),
    ]
