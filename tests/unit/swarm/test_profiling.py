"""Device profiling on the real CPU: device selection, measured TFLOPS, live memory, and the on-disk cache."""

from __future__ import annotations

import json

import pytest
import torch

import peerd
from peerd.errors import ConfigError
from peerd.swarm import profiling
from peerd.swarm.profiling import (
    MessagingCost,
    cache_key,
    hardware_fingerprint,
    measure_matmul_tflops,
    memory_info,
    profile_device,
    resolve_device,
    with_live_memory,
)
from peerd.swarm.records import DeviceKind

BUDGET = 0.05  # seconds per dtype: enough for a real measurement, short enough for a unit test


def cpu_bf16_works() -> bool:
    try:
        torch.ones(8, 8, dtype=torch.bfloat16) @ torch.ones(8, 8, dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cache = tmp_path_factory.mktemp("profile") / "profiles.json"
    return cache, profile_device("cpu", cache_path=cache, budget_s=BUDGET)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    auto = resolve_device("auto")
    if torch.cuda.is_available():
        assert auto.type == "cuda" and auto.index is not None
    elif torch.backends.mps.is_available():
        assert auto.type == "mps"
    else:
        assert auto == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "xla", ""])
def test_bad_device_strings_are_config_errors(bad):
    with pytest.raises(ConfigError) as info:
        resolve_device(bad)
    assert info.value.field == "device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_unavailable_cuda_is_config_error():
    with pytest.raises(ConfigError, match="not available"):
        resolve_device("cuda:0")


def test_cpu_profile_is_measured(measured):
    _, prof = measured
    assert prof.kind == DeviceKind.CPU
    assert prof.name and prof.name == profiling.cpu_model()
    assert prof.tflops["fp32"] > 0
    assert ("bf16" in prof.tflops) == cpu_bf16_works()
    assert "fp16" not in prof.tflops  # not measured on CPU (see candidate_dtypes)
    assert prof.memory_total_bytes > 0
    assert prof.memory_free_bytes is not None and 0 <= prof.memory_free_bytes <= prof.memory_total_bytes


def test_flop_accounting_is_exact_on_a_fake_clock(monkeypatch):
    # every matmul "takes" exactly 1 ms on a fake clock: the measurement must be 2 n^3 / 1 ms, whatever the host load
    n, per_matmul_s = 64, 1e-3
    clock = {"now": 0.0}
    real_matmul = torch.matmul

    def matmul(*args, **kwargs):
        clock["now"] += per_matmul_s
        return real_matmul(*args, **kwargs)

    monkeypatch.setattr(profiling.torch, "matmul", matmul)
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock["now"])
    measured = measure_matmul_tflops(torch.device("cpu"), torch.float32, n=n, budget_s=0.05)
    assert measured == pytest.approx(2 * n**3 / per_matmul_s / 1e12, rel=1e-9)


def test_cache_is_written_and_reused(measured, monkeypatch):
    cache, first = measured
    data = json.loads(cache.read_text())
    key = cache_key(hardware_fingerprint(torch.device("cpu")))
    assert data["format"] == profiling.CACHE_FORMAT and key in data["entries"]
    assert "memory_free_bytes" not in data["entries"][key]  # free memory is never cached

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured although a matching cache entry exists")

    monkeypatch.setattr(profiling, "measure_tflops", must_not_measure)
    monkeypatch.setattr(profiling, "measure_memory_bandwidth", must_not_measure)
    monkeypatch.setattr(profiling, "launch_seconds", must_not_measure)
    monkeypatch.setattr(profiling, "element_seconds", must_not_measure)
    again = profile_device("cpu", cache_path=cache)
    assert again.tflops == first.tflops and again.measured_at == first.measured_at
    assert again.memory_gb_s == first.memory_gb_s and again.launch_us == first.launch_us
    assert again.element_ns == first.element_ns


def test_free_memory_is_read_live(measured, monkeypatch):
    cache, _ = measured
    monkeypatch.setattr(profiling, "system_memory", lambda: (1000, 123))
    assert profile_device("cpu", cache_path=cache).memory_free_bytes == 123
    monkeypatch.setattr(profiling, "system_memory", lambda: (1000, 456))
    assert profile_device("cpu", cache_path=cache).memory_free_bytes == 456


def test_with_live_memory_rereads_only_memory(measured, monkeypatch):
    _, prof = measured
    monkeypatch.setattr(profiling, "system_memory", lambda: (2000, 789))
    live = with_live_memory(prof, "cpu")
    assert (live.memory_total_bytes, live.memory_free_bytes) == (2000, 789)
    assert live.tflops == prof.tflops and live.measured_at == prof.measured_at


def test_software_upgrade_invalidates_the_cache(measured, monkeypatch):
    cache, first = measured
    monkeypatch.setattr(profiling, "__version__", "999.0")
    upgraded = profile_device("cpu", cache_path=cache, budget_s=BUDGET)
    assert upgraded.measured_at > first.measured_at
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 2  # the old entry stays for a downgrade
    assert {e["fingerprint"]["peerd"] for e in entries.values()} == {"999.0", peerd.__version__}


def test_refresh_remeasures(measured):
    cache, first = measured
    assert (
        profile_device("cpu", cache_path=cache, refresh=True, budget_s=BUDGET).measured_at > first.measured_at
    )


@pytest.mark.parametrize("content", ["{not json", '{"format": 99, "entries": {}}', "[]"])
def test_corrupt_cache_is_ignored_and_replaced(tmp_path, content):
    cache = tmp_path / "profiles.json"
    cache.write_text(content)
    prof = profile_device("cpu", cache_path=cache, budget_s=BUDGET)
    assert prof.tflops["fp32"] > 0
    assert json.loads(cache.read_text())["format"] == profiling.CACHE_FORMAT


def test_memory_bandwidth_is_measured_and_carried(measured):
    _, prof = measured
    # A CPU's DRAM copy bandwidth: more than 0.1 GB/s on anything that runs peerd, below 10 TB/s.
    assert prof.memory_gb_s is not None and 0.1 < prof.memory_gb_s < 10_000


def test_the_launch_cost_is_measured_and_carried(measured):
    _, prof = measured
    assert prof.launch_us is not None and 0.01 < prof.launch_us < 10_000


def test_a_cpu_profile_says_which_machine_and_how_much_of_it(measured):
    from peerd.swarm.host import available_cores, host_id

    _, prof = measured
    assert prof.host_id == host_id() and len(prof.host_id) == 16
    assert prof.host_cores == available_cores()
    assert prof.threads == torch.get_num_threads()


def test_a_named_machine_has_its_own_id() -> None:
    """A daemon's ``machine`` setting names the machine its cores belong to, instead of this kernel."""
    from peerd.swarm.host import host_id

    box = host_id("box-1")
    assert box == host_id("box-1") and len(box) == 16 and int(box, 16) >= 0
    assert len({box, host_id("box-2"), host_id()}) == 3


def test_the_element_costs_are_measured_and_carried(measured):
    _, prof = measured
    assert prof.element_ns is not None
    # a CPU's tanh GELU runs below its memory bandwidth; a fused attention kernel pays per head
    assert 0 < prof.element_ns.gelu < 1_000 and 0 < prof.element_ns.attention < 1_000_000


@pytest.mark.parametrize("field", ["memory_gb_s", "launch_us", "element_ns"])
def test_an_entry_from_before_a_measurement_is_remeasured(tmp_path, field):
    cache = tmp_path / "profiles.json"
    profile_device("cpu", cache_path=cache, budget_s=BUDGET)
    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        del entry[field]
    cache.write_text(json.dumps(data))
    again = profile_device("cpu", cache_path=cache, budget_s=BUDGET)
    value = getattr(again, field)
    assert value is not None and (field == "element_ns" or value > 0)
    assert all(field in e for e in json.loads(cache.read_text())["entries"].values())


def test_tampered_entry_is_remeasured(tmp_path):
    cache = tmp_path / "profiles.json"
    profile_device("cpu", cache_path=cache, budget_s=BUDGET)
    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        entry["tflops"] = {"fp32": "fast"}
    cache.write_text(json.dumps(data))
    assert isinstance(profile_device("cpu", cache_path=cache, budget_s=BUDGET).tflops["fp32"], float)


def test_no_cache_path_means_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    profile_device("cpu", cache_path=None, budget_s=BUDGET)
    assert not any(tmp_path.iterdir())
    assert profiling.default_cache_path().is_relative_to(tmp_path)


def test_memory_info_cpu_is_sane():
    total, free = memory_info(torch.device("cpu"))
    assert total > 64 * 2**20
    assert free is None or 0 <= free <= total


class CountingMeasurer:
    """Stands in for the loopback-pair measurement (tested on real p2pd in test_messaging.py): counts calls."""

    def __init__(self, answer: MessagingCost | None) -> None:
        self.answer, self.calls = answer, 0

    def __call__(self) -> MessagingCost | None:
        self.calls += 1
        return self.answer


def test_the_messaging_cost_is_measured_once_cached_and_carried(measured):
    cache, _ = measured
    measurer = CountingMeasurer(MessagingCost(2.5e-4, 1.25e-9, 9e-4, 4e-9))
    first = profile_device("cpu", cache_path=cache, messaging=measurer)
    again = profile_device("cpu", cache_path=cache, messaging=measurer)
    assert measurer.calls == 1
    assert first.message_us == again.message_us == 250.0 and first.wire_byte_ns == again.wire_byte_ns == 1.25
    assert first.codec_us == again.codec_us == 900.0 and first.codec_value_ns == again.codec_value_ns == 4.0
    # a daemon that passes no measurer still declares what the cache knows
    assert profile_device("cpu", cache_path=cache).message_us == 250.0


def test_a_machine_that_cannot_measure_it_says_so_once(tmp_path):
    cache = tmp_path / "profiles.json"
    measurer = CountingMeasurer(None)
    for _ in range(2):
        prof = profile_device("cpu", cache_path=cache, budget_s=BUDGET, messaging=measurer)
        assert prof.message_us is None and prof.wire_byte_ns is None
    assert measurer.calls == 1  # "could not" is an answer too: no loopback pair at every start
    assert profile_device("cpu", cache_path=cache, budget_s=BUDGET, refresh=True, messaging=measurer)
    assert measurer.calls == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"message_us": -1.0, "byte_ns": 1.0, "codec_us": 1.0, "codec_value_ns": 1.0},
        {"message_us": 5.0},
        {"message_us": 5.0, "byte_ns": 1.0},  # cached before codec calls were measured
        "fast",
    ],
)
def test_a_tampered_messaging_entry_is_remeasured(tmp_path, bad):
    cache = tmp_path / "profiles.json"
    profile_device(
        "cpu", cache_path=cache, budget_s=BUDGET, messaging=CountingMeasurer(MessagingCost(1e-4, 1e-9))
    )
    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        entry["messaging"] = bad
    cache.write_text(json.dumps(data))
    measurer = CountingMeasurer(MessagingCost(3e-4, 2e-9))
    assert profile_device("cpu", cache_path=cache, messaging=measurer).message_us == 300.0
    assert measurer.calls == 1
