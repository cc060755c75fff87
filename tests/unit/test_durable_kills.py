"""Crash safety under SIGKILL (issue 15): a writer killed at a random moment, 100 times, never leaves a torn file.

A forked child writes in a loop through the real peerd writer (stage checkpoints, the
remembered-peers file, identity keys) and is SIGKILLed after a random delay. After every
kill the newest file must load, and be at least as new as the one before the kill; the
temporaries killed writes leave behind are removed by the next start of their owner
(the next checkpoint save, ``KnownPeersStore.load``, ``Identity.load_or_create``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from peerd.durable import TMP_PREFIX, tmp_prefix
from peerd.models.checkpoint import open_checkpoint, save_checkpoint
from peerd.models.gpt import GPTConfig
from peerd.models.registry import GPTFamily
from peerd.pipeline import checkpoint
from peerd.swarm import profiling
from peerd.swarm.identity import LEFTOVER_AGE_S, Identity
from peerd.swarm.membership import KnownPeer, KnownPeersStore

KILLS = 100
MAX_DELAY_S = 0.05  # a small checkpoint's save takes a few ms: kills land before, during and after saves


def _run_and_kill(body: Callable[[], None], rng: random.Random, max_delay_s: float = MAX_DELAY_S) -> None:
    """Fork a child that runs ``body`` forever; SIGKILL it after a random delay and reap it."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            while True:
                body()
        finally:
            os._exit(1)
    time.sleep(rng.uniform(0.0, max_delay_s))  # the kill's moment is the point of the test
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _tmps(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{TMP_PREFIX}*"))


def _state(step: int) -> dict:
    return {
        "format": checkpoint.FORMAT,
        "job": "j",
        "stage": 0,
        "replica": 0,
        "step": step,
        "module": {"w": torch.full((64, 256), float(step))},  # 64 KiB: a write takes a while
        "optimizer": {"state": {}, "param_groups": []},
        "data": {"position": step},
        "meta": {},
    }


def test_a_checkpoint_writer_killed_100_times_always_leaves_the_previous_checkpoint_loadable(tmp_path: Path):
    directory = tmp_path / "ckpt"
    rng = random.Random(15)
    newest, torn_moments = -1, 0
    for _ in range(KILLS):
        start = newest + 1

        def save_next(counter: list[int] = [start]) -> None:  # noqa: B006 - the child's own step counter
            checkpoint.save(directory, _state(counter[0]), keep=2)
            counter[0] += 1

        _run_and_kill(save_next, rng)
        torn_moments += bool(_tmps(directory))  # killed between a temporary's creation and its rename
        steps = checkpoint.saved_steps(directory)
        if not steps:
            continue  # killed before its first save finished
        state = checkpoint.load(directory)  # the newest complete file, never a torn one
        assert state["step"] == steps[-1] >= newest
        assert torch.equal(state["module"]["w"], torch.full((64, 256), float(state["step"])))
        newest = state["step"]
    assert newest >= KILLS // 10, newest  # the children did write (on a loaded machine, fewer saves)
    assert torn_moments > 0  # and some kills did land mid-write
    checkpoint.save(directory, _state(newest + 1))  # the next start's first save clears them
    assert _tmps(directory) == []
    assert checkpoint.load(directory)["step"] == newest + 1
    print(f"KILLS checkpoint: {KILLS} kills, {torn_moments} mid-write, newest step {newest}, 0 torn loads")


def test_the_remembered_peers_file_survives_kills_and_its_leftovers_go_at_the_next_load(tmp_path: Path):
    path = tmp_path / "known_peers.json"
    peers = tuple(
        KnownPeer(pid, (f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{pid}",), 1.0)
        for i, pid in enumerate(f"Qm{c * 44}" for c in "abc")
    )
    rng = random.Random(16)
    torn_moments = 0
    for i in range(KILLS):

        def save(counter: list[int] = [i]) -> None:  # noqa: B006 - the child's own counter
            store = KnownPeersStore(path, "s")
            store.peers = peers[: 1 + counter[0] % len(peers)]  # a different list each save
            store.save(now=float(counter[0]))
            counter[0] += 1

        _run_and_kill(save, rng)
        torn_moments += bool(_tmps(tmp_path))
        if path.exists():
            loaded = KnownPeersStore(path, "s").load()  # the next start: reads, and removes leftovers
            assert loaded and loaded == peers[: len(loaded)]
            assert _tmps(tmp_path) == []
    assert path.exists() and torn_moments > 0


def test_identity_creation_killed_never_leaves_a_torn_key_and_its_leftovers_go(tmp_path: Path):
    rng = random.Random(17)
    made: list[Path] = []
    for i in range(KILLS // 4):  # RSA key generation is slow: fewer, longer runs
        base = tmp_path / f"run{i}"

        def create(counter: list[int] = [0], base: Path = base) -> None:  # noqa: B006
            Identity.load_or_create(base / f"id{counter[0]}.key")
            counter[0] += 1

        _run_and_kill(create, rng, max_delay_s=0.4)
        made += sorted(base.glob("id*.key")) if base.exists() else []
    assert made  # some creations finished between the kills
    for key in made:
        assert Identity.load(key).peer_id  # every key file that exists is whole
    # what a kill between the temporary's write and its link leaves: the next start removes it
    # once it is older than any live creation could be, and spares a young one (another creator's)
    key = made[0]
    old, young = (key.parent / f"{tmp_prefix(key)}{tag}" for tag in ("old", "young"))
    old.write_bytes(b"\x08\x00partial")
    young.write_bytes(b"\x08\x00partial")
    os.utime(old, (time.time() - 2 * LEFTOVER_AGE_S,) * 2)
    assert Identity.load_or_create(key).peer_id == Identity.load(key).peer_id
    assert not old.exists() and young.exists()


def test_the_device_profile_cache_survives_kills_and_old_leftovers_go_at_the_next_write(tmp_path: Path):
    """The cache every daemon of a machine shares: always whole, and killed writers' temporaries removed."""
    path = tmp_path / "device_profiles.json"
    entry = {"fingerprint": {"name": "cpu"}, "tflops": {"fp32": 0.1}, "memory_gb_s": 5.0, "measured_at": 1.0}
    rng = random.Random(18)
    torn_moments = 0
    for i in range(KILLS):

        def store(counter: list[int] = [i]) -> None:  # noqa: B006 - the child's own counter
            # a few hundred KiB, different each time: writes take long enough to be cut
            profiling._store_cache(path, {f"k{j}": entry for j in range(2000 + counter[0] % 7)})
            counter[0] += 1

        _run_and_kill(store, rng)
        leftovers = [p for p in tmp_path.iterdir() if p != path]
        torn_moments += bool(leftovers)
        if path.exists():
            assert len(profiling._load_cache(path)) >= 2000  # never torn, never empty
    # what a kill between the temporary's write and its rename leaves (the kills above leave some
    # when they land mid-write: not every run does, so one is made too)
    (tmp_path / f"{tmp_prefix(path)}killed").write_bytes(b'{"format": 1, "entr')
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    for p in leftovers:  # as old as any write could be: a later daemon removes them
        os.utime(p, (time.time() - 2 * profiling.LEFTOVER_AGE_S,) * 2)
    young = tmp_path / f"{tmp_prefix(path)}live"  # another daemon writing right now: spared
    young.write_bytes(b"{")
    profiling._store_cache(path, {"k": entry})
    assert [p.name for p in tmp_path.iterdir() if p != path] == [young.name]
    assert profiling._load_cache(path) == {"k": entry}
    print(f"KILLS profile cache: {KILLS} kills, {torn_moments} mid-write, 0 torn loads")


def test_a_model_file_writer_killed_100_times_always_leaves_a_whole_file(tmp_path: Path):
    """``peerd fetch``'s output (``models.checkpoint.save_checkpoint``): the previous file always opens."""
    family = GPTFamily(GPTConfig(n_layer=1, d_model=32, max_seq_len=16), seed=4)
    state = family.build().state_dict()
    path = tmp_path / "model.pt"
    rng = random.Random(19)
    newest, torn_moments = -1, 0
    for i in range(KILLS):

        def save(counter: list[int] = [(i + 1) * 10_000]) -> None:  # noqa: B006 - above any earlier child's
            save_checkpoint(path, family, state, step=counter[0])
            counter[0] += 1

        _run_and_kill(save, rng)
        torn_moments += bool(_tmps(tmp_path))
        if path.exists():
            step = open_checkpoint(path).meta["step"]
            assert step >= newest
            newest = step
    save_checkpoint(path, family, state, step=newest + 1)  # the next write clears every leftover
    assert _tmps(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert open_checkpoint(path).meta["step"] == newest + 1
    print(f"KILLS model file: {KILLS} kills, {torn_moments} mid-write, 0 torn loads")
