"""Fault injection's cut: which peers it blocks, and until when."""

from __future__ import annotations

from peerd.swarm.faults import FAULT_INJECTION_ENV, Cut, fault_injection_enabled


def test_a_cut_blocks_its_peers_until_it_ends() -> None:
    cut = Cut(frozenset({"QmA", "QmB"}), until=100.0)
    assert cut.blocks("QmA", now=99.9) and cut.blocks("QmB", now=0.0)
    assert not cut.blocks("QmC", now=50.0)  # a peer of this peer's own half
    assert not cut.blocks("QmA", now=100.0)  # healed
    assert cut.active(now=99.0) and not cut.active(now=100.0)
    assert not Cut().blocks("QmA") and not Cut().active()


def test_fault_injection_is_off_unless_the_environment_turns_it_on(monkeypatch) -> None:
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    assert not fault_injection_enabled()
    for value in ("0", "yes", "true", ""):
        monkeypatch.setenv(FAULT_INJECTION_ENV, value)
        assert not fault_injection_enabled(), value
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    assert fault_injection_enabled()
