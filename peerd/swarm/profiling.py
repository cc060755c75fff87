"""Device profile: what the local device is and how fast it multiplies matrices, cached on disk.

TFLOPS come from timing dense square matmuls (2·n³ flops each) per dtype the device
supports, memory bandwidth from timing a large device-to-device copy (what decoding with a
KV cache is bound by: the RL cost model's generation term), the seconds per dispatched op from
timing a toy-width GPT's training steps (what a model too small to fill the device costs:
``peerd.models.launches``), and, where the caller passes a measurer, the host CPU one message
costs the machine (``MessagingCost``: what daemons that share a machine's cores spend beside
their compute, ``peerd.pipeline.messaging``). The measurement is cached in a JSON file under a
key made of the hardware and software versions (CPU model / GPU name, device string, torch,
peerd, CUDA), so a restart skips it and an upgrade re-measures. Free memory is always read live.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import msgspec
import torch
from hivemind.utils import get_dht_time

from peerd import __version__
from peerd.durable import remove_leftovers, replace_file
from peerd.errors import ConfigError
from peerd.log import get_logger
from peerd.models.launches import ELEMENT_FAMILIES, element_seconds, launch_seconds
from peerd.swarm.host import available_cores, host_id
from peerd.swarm.records import DeviceKind, DeviceProfile
from peerd.wire.types import ElementCosts

logger = get_logger(__name__)

CACHE_FORMAT = 1
MEASUREMENT_METHOD = 2  # bumped when a measurement changes how it is taken: cached figures are retaken
LEFTOVER_AGE_S = 60.0  # a cache temporary this old belongs to no live write (they take ms)
# Matrix side per device kind: big enough to reach steady-state throughput, small enough
# that one matmul takes milliseconds (CPU 512: ~3 ms at 100 GFLOPS; H100-class 8192: ~2 ms in bf16).
_MATMUL_N = {DeviceKind.CPU: 512, DeviceKind.CUDA: 8192, DeviceKind.MPS: 2048}
# Time budget per dtype; CPU measures fp32 + bf16, so the whole profile stays under ~2 s there.
_BUDGET_S = {DeviceKind.CPU: 0.6, DeviceKind.CUDA: 0.5, DeviceKind.MPS: 0.5}
_WINDOWS = 3
# Copy size per device kind: well past the last-level cache (CPU) or L2 (GPU), so the copy streams memory.
_COPY_BYTES = {DeviceKind.CPU: 64 << 20, DeviceKind.CUDA: 1 << 30, DeviceKind.MPS: 256 << 20}
_COPY_BUDGET_S = 0.3


@dataclass(frozen=True)
class MessagingCost:
    """Host CPU one message costs at each end (sender or receiver: its daemon and its p2pd)."""

    message_s: float
    """Seconds per message, whatever its size (framing, the event loop, p2pd's stream work)."""
    byte_s: float
    """Seconds per payload byte (copies, p2pd's encryption)."""
    codec_s: float | None = None
    """Seconds per call of a compressing boundary codec (an encode or a decode: its Python and its
    ops' dispatch around the values), whatever the size; None where not measured."""
    codec_value_s: float | None = None
    """Seconds per value a compressing codec call encodes or decodes."""


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device must exist here (else ConfigError)."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device", f"{device!r} is not a torch device string: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device!r} requested but CUDA is not available")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ConfigError("device", f"{device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("device", f"{device!r} requested but MPS is not available")
        return torch.device("mps")
    if dev.type == "cpu":
        return torch.device("cpu")
    raise ConfigError("device", f"{device!r}: peerd supports cpu, cuda[:N] and mps")


def device_kind(dev: torch.device) -> DeviceKind:
    return DeviceKind(dev.type)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if platform.system() == "Darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, timeout=2)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.decode().strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return f"{cpu_model()} (MPS)"
    return cpu_model()


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means no limit


def system_memory() -> tuple[int, int | None]:
    """(total, available) bytes of host RAM, narrowed to this container's cgroup v2 limit if there is one."""
    total: int | None = None
    free: int | None = None
    with contextlib.suppress(OSError, ValueError):
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024  # values are in kB
        total, free = info.get("MemTotal"), info.get("MemAvailable")
    if total is None:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with contextlib.suppress(ValueError, OSError):
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _read_int("/sys/fs/cgroup/memory.max")
    if limit is not None and limit < total:
        used = _read_int("/sys/fs/cgroup/memory.current") or 0
        total = limit
        free = max(0, limit - used) if free is None else min(free, max(0, limit - used))
    return total, free


def memory_info(dev: torch.device) -> tuple[int, int | None]:
    """Live (total, free) bytes of the memory the device computes from; free is None if unknown.

    On CUDA, free counts what this process's caching allocator holds without using (a stopped
    tasklet's blocks, kept for reuse): the driver reports them as taken, yet the next tasklet
    gets them, and a peer that under-reports its memory to a re-plan loses its own stage.
    """
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        idle = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(total), int(free + max(0, idle))
    return system_memory()  # CPU, and MPS (unified memory)


def with_live_memory(profile: DeviceProfile, device: str = "auto") -> DeviceProfile:
    """``profile`` with total/free memory re-read now (cheap); call it for every record a daemon publishes."""
    total, free = memory_info(resolve_device(device))
    return msgspec.structs.replace(profile, memory_total_bytes=total, memory_free_bytes=free)


def _synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def candidate_dtypes(dev: torch.device) -> dict[str, torch.dtype]:
    """dtypes worth measuring; whether each really works is decided by trying it."""
    if dev.type == "cuda":
        dtypes = {"fp32": torch.float32, "fp16": torch.float16}
        if torch.cuda.is_bf16_supported():
            dtypes["bf16"] = torch.bfloat16
        return dtypes
    if dev.type == "mps":
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    # CPU: fp16 matmul runs through slow reference kernels on most CPUs and nobody trains in it there.
    return {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_matmul_tflops(dev: torch.device, dtype: torch.dtype, *, n: int, budget_s: float) -> float:
    """Median dense-matmul throughput (TFLOPS) over a few timed windows of an n×n @ n×n product."""
    a_NN = torch.randn(n, n, device=dev, dtype=torch.float32).to(dtype)
    b_NN = torch.randn(n, n, device=dev, dtype=torch.float32).to(dtype)
    out_NN = torch.empty(n, n, device=dev, dtype=dtype)
    flops = 2.0 * n**3
    torch.matmul(a_NN, b_NN, out=out_NN)  # warm-up: library init, thread pools, kernel selection
    _synchronize(dev)
    start = time.perf_counter()
    torch.matmul(a_NN, b_NN, out=out_NN)
    _synchronize(dev)
    single_s = time.perf_counter() - start
    if single_s * 2 >= budget_s:  # too slow to repeat within budget (e.g. emulated bf16): one sample it is
        return flops / single_s / 1e12
    iters = max(1, int(budget_s / _WINDOWS / single_s))
    rates = []
    deadline = time.perf_counter() + budget_s
    for _ in range(_WINDOWS):
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a_NN, b_NN, out=out_NN)
        _synchronize(dev)
        elapsed = time.perf_counter() - start
        rates.append(flops * iters / elapsed / 1e12)
        if time.perf_counter() > deadline:
            break
    return statistics.median(rates)


def measure_tflops(dev: torch.device, *, budget_s: float | None = None) -> dict[str, float]:
    """TFLOPS per dtype name for every dtype the device actually runs; unsupported ones are left out."""
    kind = device_kind(dev)
    budget = _BUDGET_S[kind] if budget_s is None else budget_s
    results: dict[str, float] = {}
    # fp32 means true fp32 here, not TF32 tensor cores; restore the user's setting afterwards.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name, dtype in candidate_dtypes(dev).items():
            try:
                results[name] = measure_matmul_tflops(dev, dtype, n=_MATMUL_N[kind], budget_s=budget)
            except (RuntimeError, TypeError, NotImplementedError) as exc:
                logger.info("%s matmul not supported on %s: %s", name, dev, exc)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if "fp32" not in results:
        raise RuntimeError(f"could not run an fp32 matmul on {dev}")
    return results


def measure_memory_bandwidth(dev: torch.device, *, budget_s: float = _COPY_BUDGET_S) -> float:
    """Median device-memory bandwidth (GB/s) of a large copy: each copy reads and writes its bytes once."""
    nbytes = _COPY_BYTES[device_kind(dev)]
    src = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults and allocation happen here, not in the timing
    _synchronize(dev)
    rates: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(rates) < _WINDOWS or (time.perf_counter() < deadline and len(rates) < 20):
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(dev)
        rates.append(2.0 * nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def hardware_fingerprint(dev: torch.device) -> dict[str, Any]:
    """Everything that, when it changes, invalidates a cached measurement."""
    return {
        "device": str(dev),
        "name": device_name(dev),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "peerd": __version__,
        "machine": platform.machine(),
        "method": MEASUREMENT_METHOD,
    }


def cache_key(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:32]


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "peerd" / "device_profiles.json"


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable device profile cache %s: %s", path, exc)
        return {}
    if (
        not isinstance(data, dict)
        or data.get("format") != CACHE_FORMAT
        or not isinstance(data.get("entries"), dict)
    ):
        logger.warning("ignoring device profile cache %s: unknown format", path)
        return {}
    return data["entries"]


def _positive(x: Any) -> TypeGuard[float]:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


def _cached_profile(
    entry: Any, fingerprint: dict[str, Any]
) -> tuple[dict[str, float], float, float, dict[str, float], float] | None:
    """(tflops, memory GB/s, launch µs, element ns, measured_at) from a cache entry, or None if it is
    not a well-formed entry for this fingerprint (entries written before the bandwidth, the launch
    cost or the element costs were measured count as missing)."""
    if not isinstance(entry, dict) or entry.get("fingerprint") != fingerprint:
        return None
    tflops, measured_at = entry.get("tflops"), entry.get("measured_at")
    gb_s, launch_us = entry.get("memory_gb_s"), entry.get("launch_us")
    if not isinstance(tflops, dict) or not isinstance(measured_at, int | float) or "fp32" not in tflops:
        return None
    if not all(isinstance(k, str) and _positive(v) for k, v in tflops.items()):
        return None
    if not _positive(gb_s) or not _positive(launch_us):
        return None
    element_ns = entry.get("element_ns")
    if not isinstance(element_ns, dict) or set(element_ns) != set(ELEMENT_FAMILIES):
        return None
    if not all(_positive(v) or v == 0 for v in element_ns.values()):
        return None
    return (
        {k: float(v) for k, v in tflops.items()},
        float(gb_s),
        float(launch_us),
        {k: float(v) for k, v in element_ns.items()},
        float(measured_at),
    )


def _cached_messaging(entry: Any, fingerprint: dict[str, Any]) -> tuple[bool, MessagingCost | None]:
    """(whether a cache entry answers what a message costs, the answer): None where it records that
    this machine could not measure one."""
    if not isinstance(entry, dict) or entry.get("fingerprint") != fingerprint or "messaging" not in entry:
        return False, None
    found = entry["messaging"]
    if found is None:
        return True, None
    # an entry from before codec calls were measured is no answer: the messaging is measured again
    if not isinstance(found, dict) or not all(
        _positive(found.get(k)) for k in ("message_us", "byte_ns", "codec_us", "codec_value_ns")
    ):
        return False, None
    return True, MessagingCost(
        found["message_us"] * 1e-6,
        found["byte_ns"] * 1e-9,
        found["codec_us"] * 1e-6,
        found["codec_value_ns"] * 1e-9,
    )


def _cache_messaging(costs: MessagingCost | None) -> dict[str, float] | None:
    if costs is None:
        return None
    out = {"message_us": costs.message_s * 1e6, "byte_ns": costs.byte_s * 1e9}
    if costs.codec_s is not None and costs.codec_value_s is not None:
        out |= {"codec_us": costs.codec_s * 1e6, "codec_value_ns": costs.codec_value_s * 1e9}
    return out


def _store_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace the cache crash-safely (``peerd.durable``); temporaries of writers killed earlier go.

    Daemons of one machine share the cache, so only temporaries older than any live write
    (``LEFTOVER_AGE_S``) are removed.
    """
    text = json.dumps({"format": CACHE_FORMAT, "entries": entries}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path, older_than_s=LEFTOVER_AGE_S)
        replace_file(path, lambda fh: fh.write(text.encode()))  # readers never see a half-written cache
    except OSError as exc:
        logger.warning("could not write device profile cache %s: %s", path, exc)


def profile_device(
    device: str = "auto",
    *,
    cache_path: str | Path | None = None,
    refresh: bool = False,
    budget_s: float | None = None,
    messaging: Callable[[], MessagingCost | None] | None = None,
) -> DeviceProfile:
    """Profile ``device`` (``auto``/``cpu``/``cuda[:N]``/``mps``), reusing a cached measurement when one matches.

    ``cache_path=None`` disables the cache; ``refresh=True`` re-measures and overwrites it.
    ``messaging`` measures what a message costs the host (None where it cannot tell); it runs when
    the cache holds no answer of it yet, and a cached answer is used with or without it.
    Blocking (~2 s on CPU when not cached, ~1 s more for ``messaging``): call it from a worker thread
    in async code.
    """
    dev = resolve_device(device)
    fingerprint = hardware_fingerprint(dev)
    key = cache_key(fingerprint)
    path = Path(cache_path).expanduser() if cache_path is not None else None
    entries = _load_cache(path) if path is not None else {}
    cached = None if refresh else _cached_profile(entries.get(key), fingerprint)
    if cached is not None:
        tflops, gb_s, launch_us, element_ns, measured_at = cached
        logger.debug("device profile for %s from cache %s", dev, path)
    else:
        start = time.perf_counter()
        tflops = measure_tflops(dev, budget_s=budget_s)
        gb_s = measure_memory_bandwidth(dev)
        launch_us = launch_seconds(dev) * 1e6
        element_ns = {k: v * 1e9 for k, v in element_seconds(dev, launch_us * 1e-6, gb_s * 1e9).items()}
        measured_at = get_dht_time()
        logger.info(
            "measured %s in %.1f s: %s, memory %.3g GB/s, %.3g µs per op, %s",
            dev,
            time.perf_counter() - start,
            ", ".join(f"{k} {v:.3g} TFLOPS" for k, v in tflops.items()),
            gb_s,
            launch_us,
            ", ".join(f"{k} {v:.3g} ns" for k, v in element_ns.items()),
        )
        if path is not None:
            entries[key] = {
                "fingerprint": fingerprint,
                "tflops": tflops,
                "memory_gb_s": gb_s,
                "launch_us": launch_us,
                "element_ns": element_ns,
                "measured_at": measured_at,
            }
            _store_cache(path, entries)
    answered, costs = _cached_messaging(entries.get(key), fingerprint)
    if messaging is not None and (refresh or not answered):
        costs = messaging()
        entry = entries.get(key)
        if path is not None and isinstance(entry, dict):
            entry["messaging"] = _cache_messaging(costs)
            _store_cache(path, entries)
    total, free = memory_info(dev)
    kind = device_kind(dev)
    # a CPU device computes on the machine's cores, which other peers on it share (read live: a
    # cached measurement does not say where this process runs now)
    shared = kind == DeviceKind.CPU
    return DeviceProfile(
        name=fingerprint["name"],
        kind=kind,
        memory_total_bytes=total,
        memory_free_bytes=free,
        tflops=tflops,
        measured_at=measured_at,
        memory_gb_s=round(gb_s, 3),
        launch_us=round(launch_us, 3),
        element_ns=ElementCosts(**{k: round(v, 4) for k, v in element_ns.items()}),
        host_id=host_id() if shared else None,
        host_cores=available_cores() if shared else None,
        threads=torch.get_num_threads() if shared else None,
        message_us=round(costs.message_s * 1e6, 3) if costs is not None else None,
        wire_byte_ns=round(costs.byte_s * 1e9, 4) if costs is not None else None,
        codec_us=round(costs.codec_s * 1e6, 3) if costs is not None and costs.codec_s else None,
        codec_value_ns=round(costs.codec_value_s * 1e9, 4)
        if costs is not None and costs.codec_value_s
        else None,
    )
