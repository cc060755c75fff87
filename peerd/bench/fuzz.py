"""``peerd bench fuzz``: random, truncated, bit-flipped, wrong-typed and huge-size inputs to every decoder; JSON per decoder.

Each decoder (``peerd.bench.fuzz_targets``) gets ``--inputs`` inputs, mutations of valid
encodings made by the real encoders plus pure noise, drawn from a seeded RNG (``--seed``:
the same run again finds the same inputs). The mutations:

- ``random``     — random bytes of a random length (0 B to 4 KiB), or a seed's prefix plus noise;
- ``truncated``  — a seed cut at a random byte;
- ``bitflip``    — 1 to 8 flipped bits of a seed;
- ``splice``     — a chunk of a seed deleted, repeated or overwritten with noise;
- ``wrong_type`` — one field of the seed's tree (msgpack map, frame header, YAML mapping)
  replaced by a value of another type (null, bool, -1, 2**63, NaN, a 4 KiB string, a long
  list, a deep nest...), deleted, or joined by an unknown field, then re-encoded;
- ``huge_size``  — a length or count field made huge: a 4-byte window set to 0xFFFFFFFF /
  0x7FFFFFFF (either byte order), or a msgpack str/bin/array/map header announcing 4 Gi
  elements spliced in.

Per decoder it reports ``decoded`` (accepted), ``rejected`` (a typed ``PeerdError``, by code),
``other`` (anything else: a bug; the first few with mutation, input and traceback), ``hangs``
(an input still running after ``--hang-s`` of CPU time), the slowest input in ms of process
CPU time (must stay < 50 ms; wall time beside it, which on shared cores also counts waiting) and
peak Python-heap memory per input (tracemalloc on one input in four, since tracing slows
allocation several-fold and would distort the times of the others; numpy's buffers report to
it, torch's own
allocator does not, so the process's peak RSS growth is given beside it) against the input's
size: ``peak_over_input`` is the largest ``peak / max(size, 4 KiB)``. ``ok`` is false when any
input was ``other``, hung, took >= 50 ms, or peaked above ``F x max(size, 4 KiB) + 1 MiB`` with
the decoder's factor F (64 for binary decoders, 256 for YAML files: ``Target.memory_factor``).
Each decoder first decodes its seeds once, untimed, so one-off warm-up (schema builders,
imports) is not charged to the first input. Then the heap so far (torch, the targets: ~220,000
objects) is frozen out of the cyclic collector (``gc.freeze``): otherwise about one input in a
thousand is charged a full collection of those unrelated objects (100-170 ms here), which measures
the process, not the decoder; collections of what the decoders allocate are still charged.
For formats with aliases (YAML), wrong-typed values include an alias bomb (9 levels of 10
references: 10^9 values from 200 bytes).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import random
import resource
import signal
import time
import traceback
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import click

from peerd.bench import emit_json
from peerd.bench.fuzz_targets import Target, all_targets
from peerd.errors import PeerdError
from peerd.log import get_logger

logger = get_logger(__name__)

SLOW_MS = 50.0
MEMORY_FLOOR = 4096  # inputs below this size are charged as this size
MEMORY_EVERY = 4  # one input in this many runs under tracemalloc (memory), the rest are timed
MEMORY_SLACK = 1 << 20  # fixed per-call overhead (interpreter caches, small tensors)
MUTATIONS = ("random", "truncated", "bitflip", "splice", "wrong_type", "huge_size")
_HUGE_HEADERS = (
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
)
_HUGE_WORDS = (b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80")


def _bomb() -> list[Any]:
    """9 levels of lists holding 10 references to the level below: 10^9 values once aliases expand."""
    level: list[Any] = ["lol"] * 10
    for _ in range(8):
        level = [level] * 10
    return level


def _values(rng: random.Random, aliases: bool = False) -> Any:
    """A value of some type that a field probably does not expect (an alias bomb where ``aliases``)."""
    depth = rng.choice((50, 200))
    nest: Any = 0
    for _ in range(depth):
        nest = [nest]
    pool: list[Any] = [
        *([_bomb()] if aliases else []),
        None,
        True,
        False,
        -1,
        0,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        1.5,
        -0.0,
        math.nan,
        math.inf,
        -math.inf,
        1e308,
        "",
        "x" * 4096,
        "\u0000\u202e",
        b"\x00" * 16,
        [],
        {},
        [0] * 4096,
        list(range(64)),
        {"k": None, 1: 2},
        nest,
    ]
    return rng.choice(pool)


def _paths(tree: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:32]):
            yield from _paths(v, (*prefix, i))


def _wrong_type(rng: random.Random, target: Target, seed: bytes) -> bytes:
    tree = copy.deepcopy(target.tree(seed))
    paths = list(_paths(tree))
    path = rng.choice(paths[1:] or paths)
    if not path:
        return target.build(_values(rng, target.aliases), seed)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key, op = path[-1], rng.random()
    if op < 0.15 and isinstance(parent, dict):
        del parent[key]
    elif op < 0.25 and isinstance(parent, dict):
        parent[f"unknown_{rng.randrange(100)}"] = _values(rng, target.aliases)
    else:
        parent[key] = _values(rng, target.aliases)
    return target.build(tree, seed)


def mutate(rng: random.Random, target: Target) -> tuple[str, bytes]:
    """One input for ``target``: (mutation name, bytes)."""
    seed = rng.choice(target.seeds)
    kind = rng.choice(MUTATIONS)
    if kind == "random":
        n = rng.choice((0, 1, 2, 8, 16, 64, 256, 4096))
        noise = rng.randbytes(n)
        return kind, (seed[: rng.randrange(len(seed) + 1)] + noise) if rng.random() < 0.5 else noise
    if kind == "truncated":
        return kind, seed[: rng.randrange(len(seed))]
    if kind == "bitflip":
        b = bytearray(seed)
        for _ in range(rng.randint(1, 8)):
            bit = rng.randrange(len(b) * 8)
            b[bit // 8] ^= 1 << (bit % 8)
        return kind, bytes(b)
    if kind == "splice":
        a = rng.randrange(len(seed))
        z = min(len(seed), a + rng.randint(1, 64))
        op = rng.randrange(3)
        chunk = seed[a:z] * rng.randint(2, 8) if op == 1 else rng.randbytes(z - a) if op == 2 else b""
        return kind, seed[:a] + chunk + seed[z:]
    if kind == "wrong_type":
        try:
            return kind, _wrong_type(rng, target, seed)
        except (ValueError, TypeError, OverflowError, RecursionError, UnicodeError):
            return "bitflip", bytes(b ^ 0x01 if i == 0 else b for i, b in enumerate(seed))  # not encodable
    pos = rng.randrange(len(seed) + 1)
    if rng.random() < 0.5:  # overwrite a 4-byte window (binary headers: lengths, counts, shapes)
        word = rng.choice(_HUGE_WORDS)
        return kind, seed[:pos] + word + seed[pos + len(word) :]
    return kind, seed[:pos] + rng.choice(_HUGE_HEADERS) + seed[pos:]  # a msgpack container announcing 4 Gi


class _Hang(BaseException):
    """Raised by the alarm when one input runs too long (BaseException: decoders must not swallow it)."""


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def fire(_sig: int, _frame: Any) -> None:
        raise _Hang()

    previous = signal.signal(signal.SIGPROF, fire)  # CPU time: a busy machine's waiting is no hang
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def fuzz_target(
    target: Target, inputs: int, rng: random.Random, hang_s: float, keep: int = 5
) -> dict[str, Any]:
    """Feed ``inputs`` mutations to one decoder; the per-decoder report."""
    outcomes: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    mutations: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    slowest = (0.0, "", b"")
    slowest_wall = 0.0
    peak_max, peak_ratio, memory_ok = 0, 0.0, True
    rss0 = _rss_bytes()
    cpu0 = time.process_time()
    with _alarm(hang_s):
        for seed in target.seeds:  # warm-up, untimed: lazily built schemas and caches
            signal.setitimer(signal.ITIMER_PROF, hang_s)
            with contextlib.suppress(Exception, _Hang):
                target.decode(seed)
            signal.setitimer(signal.ITIMER_PROF, 0)
        gc.collect()
        gc.freeze()
        for i in range(inputs):
            kind, data = mutate(rng, target)
            mutations[kind] += 1
            traced = i % MEMORY_EVERY == 0  # tracemalloc slows allocation-heavy decoders several-fold:
            if traced:  # these inputs measure memory, the others time
                tracemalloc.start()
            signal.setitimer(signal.ITIMER_PROF, hang_s)
            started, wall = time.process_time(), time.perf_counter()
            try:
                result = target.decode(data)
                del result
                outcome = "decoded"
            except PeerdError as exc:
                outcome = "rejected"
                codes[exc.code.name] += 1
            except _Hang:
                outcome = "hangs"
                failures.append(_failure(kind, data, "hang", f"still running after {hang_s} s of CPU time"))
            except Exception as exc:
                outcome = "other"
                if len(failures) < keep:
                    failures.append(_failure(kind, data, type(exc).__name__, traceback.format_exc()))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
                elapsed = (time.process_time() - started) * 1e3
                elapsed_wall = (time.perf_counter() - wall) * 1e3
            outcomes[outcome] += 1
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                charged = max(len(data), MEMORY_FLOOR)
                peak_max = max(peak_max, peak)
                peak_ratio = max(peak_ratio, peak / charged)
                if peak > target.memory_factor * charged + MEMORY_SLACK:
                    memory_ok = False
            else:
                slowest_wall = max(slowest_wall, elapsed_wall)
                if elapsed > slowest[0]:
                    slowest = (elapsed, kind, data)
    gc.unfreeze()
    other, hangs = outcomes["other"], outcomes["hangs"]
    return {
        "inputs": inputs,
        "decoded": outcomes["decoded"],
        "rejected": outcomes["rejected"],
        "other": other,
        "hangs": hangs,
        "rejected_by_code": dict(codes.most_common()),
        "mutations": dict(sorted(mutations.items())),
        "slowest_ms": round(slowest[0], 3),
        "slowest_input": {
            "mutation": slowest[1],
            "bytes": len(slowest[2]),
            "head_hex": slowest[2][:64].hex(),
        },
        "slowest_wall_ms": round(slowest_wall, 3),
        "peak_heap_bytes": peak_max,
        "peak_over_input": round(peak_ratio, 2),
        "peak_rss_growth_bytes": max(0, _rss_bytes() - rss0),
        "memory_factor": target.memory_factor,
        "cpu_seconds": round(time.process_time() - cpu0, 2),
        "ok": other == 0 and hangs == 0 and slowest[0] < SLOW_MS and memory_ok,
        "failures": failures,
    }


def _failure(kind: str, data: bytes, error: str, trace: str) -> dict[str, Any]:
    return {
        "mutation": kind,
        "bytes": len(data),
        "input_hex": data[:256].hex(),
        "error": error,
        "traceback": trace[-2000:],
    }


def run(inputs: int, seed: int, only: tuple[str, ...] = (), hang_s: float = 5.0) -> dict[str, Any]:
    targets = [t for t in all_targets() if not only or t.name in only]
    unknown = set(only) - {t.name for t in all_targets()}
    if unknown:
        raise click.BadParameter(f"unknown decoder(s) {sorted(unknown)}", param_hint="--only")
    report: dict[str, Any] = {}
    started = time.perf_counter()
    for i, target in enumerate(targets):
        t0 = time.perf_counter()
        report[target.name] = fuzz_target(target, inputs, random.Random(f"{seed}/{target.name}"), hang_s)
        report[target.name]["seconds"] = round(time.perf_counter() - t0, 1)
        logger.info("fuzz %s (%d/%d): %s", target.name, i + 1, len(targets), report[target.name]["ok"])
    return {
        "benchmark": "fuzz",
        "inputs_per_decoder": inputs,
        "seed": seed,
        "limits": {
            "slowest_ms": SLOW_MS,
            "peak_heap": f"memory_factor x max(input, {MEMORY_FLOOR} B) + {MEMORY_SLACK} B",
        },
        "decoders": report,
        "total_inputs": inputs * len(targets),
        "untyped_failures": sum(r["other"] for r in report.values()),
        "hangs": sum(r["hangs"] for r in report.values()),
        "all_ok": all(r["ok"] for r in report.values()),
        "seconds": round(time.perf_counter() - started, 1),
    }


@click.command(
    "fuzz",
    epilog="""
\b
  peerd bench fuzz                         100,000 inputs to each decoder (minutes)
  peerd bench fuzz --inputs 2000 --seed 7  a quick run; the same seed finds the same inputs
  peerd bench fuzz --only pipeline.frame --only job.record
""",
)
@click.option(
    "--inputs", type=click.IntRange(min=1), default=100_000, show_default=True, help="Inputs per decoder."
)
@click.option("--seed", type=int, default=0, show_default=True, help="RNG seed of the mutations.")
@click.option("--only", multiple=True, help="Fuzz only this decoder (repeatable), e.g. job.spec.")
@click.option(
    "--hang-s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="An input using more CPU time is a hang.",
)
def command(inputs: int, seed: int, only: tuple[str, ...], hang_s: float) -> None:
    """Fuzz every decoder a peer's bytes reach; JSON per decoder (exit 1 if any untyped failure, hang, slow or memory-hungry input)."""
    result = run(inputs, seed, only, hang_s)
    emit_json(result)
    if not result["all_ok"]:
        raise SystemExit(1)
