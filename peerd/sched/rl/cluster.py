"""An RL scenario (a cluster + a workload) and the cluster as SI arrays grouped into device classes.

The file is a ``peerd.sched.scenario`` file (devices, regions, links) plus a ``workload:``
section, either inline (see ``peerd.sched.rl.workload``) or the name of an entry of
``workloads.yaml`` in the same folder. Every device needs ``tflops``, ``memory_gb`` and
``memory_bandwidth_gb_s``.

Devices with equal TFLOPS, memory, memory bandwidth and links to everyone (same region and
access cap, no device-level links) form a *class*: swapping two devices of one class changes no
cost, so the searches work on how many devices of each class a group gets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from peerd import loading
from peerd.errors import ConfigError
from peerd.sched.elements import PerFamily
from peerd.sched.rl.workload import Launches, Workload
from peerd.sched.scenario import Scenario

WORKLOADS_FILE = "workloads.yaml"


@dataclass(frozen=True)
class RLScenario:
    """The devices and links to plan on, and the workload to plan for."""

    scenario: Scenario
    workload: Workload

    @property
    def name(self) -> str:
        return self.scenario.name

    def problems(self) -> list[ConfigError]:
        out = []
        for i, dev in enumerate(self.scenario.devices):
            for key in ("tflops", "memory_gb"):
                if getattr(dev, key) <= 0:
                    out.append(
                        ConfigError(f"devices[{i}].{key}", f"the RL scheduler needs it > 0 ({dev.id})")
                    )
            if dev.memory_bandwidth_gb_s is None:
                out.append(
                    ConfigError(
                        f"devices[{i}].memory_bandwidth_gb_s",
                        f"missing for {dev.id!r}: the RL scheduler times decoding by memory bandwidth",
                    )
                )
        if out:
            return out
        k = self.workload.constants
        usable = sum(d.memory_gb for d in self.scenario.devices) * 1e9 * k.memory_usable
        roles = ["actor"] + (["critic"] if self.workload.algo == "ppo" else [])
        for role in roles:
            need = self.workload.model(role).params * (k.weight_bytes + k.grad_bytes + k.optimizer_bytes)
            if need > usable:
                where = (
                    "workload.actor.params"
                    if role == "actor" or self.workload.critic is None
                    else "workload.critic.params"
                )
                out.append(
                    ConfigError(
                        where,
                        f"training the {role} needs {need / 1e9:.0f} GB of weights, gradients and optimizer "
                        f"state, more than the swarm's {usable / 1e9:.0f} GB usable memory",
                    )
                )
        return out


def rl_scenario(scenario: Scenario, workload: Workload) -> RLScenario:
    """Build and check; ``ConfigError`` names every bad field."""
    out = RLScenario(scenario, workload)
    loading.check(out.problems(), "the RL scenario")
    return out


def load_rl_scenario(path: str | Path, workload: str | None = None) -> RLScenario:
    """Load an RL scenario file; ``workload`` (a name in ``workloads.yaml`` beside it) replaces the file's own."""
    path = Path(path)
    data = dict(loading.load_mapping(path))
    section: Any = workload if workload is not None else data.pop("workload", None)
    data.pop("workload", None)
    if section is None:
        raise ConfigError("workload", f"{path} has no workload section and none was named")
    if isinstance(section, str):
        section = _named_workload(path.parent / WORKLOADS_FILE, section)
    scenario = Scenario.from_mapping(data)
    return rl_scenario(scenario, loading.from_mapping(Workload, section, "workload"))


def _named_workload(catalog: Path, name: str) -> Any:
    if not catalog.exists():
        raise ConfigError("workload", f"{name!r} names a workload, but there is no {catalog}")
    entries = loading.load_mapping(catalog)
    if name not in entries:
        raise ConfigError(
            "workload", f"no workload {name!r} in {catalog}; known: {', '.join(sorted(entries))}"
        )
    return {"name": name, **entries[name]}


@dataclass(frozen=True)
class Cluster:
    """The devices in SI units (FLOP/s, bytes, bytes/s, seconds), with their class structure.

    Arrays are indexed by device position in the scenario; ``cls[i]`` is device i's class.
    """

    ids: tuple[str, ...]
    flops: np.ndarray
    memory: np.ndarray
    """Usable bytes (``memory_usable`` x memory)."""
    mem_bw: np.ndarray
    launch: np.ndarray
    """Seconds per dispatched op (``launch_us``; 0 where not modelled)."""
    element_s: np.ndarray
    """(N, 3) seconds per sequence of the workload's element work (``Launches.*_elements`` at the
    device's ``element_ns``; 0 where not modelled): a generation's, an inference forward's, a
    training forward and backward's."""
    delay: np.ndarray
    """One-way delay in seconds, (N, N): the link's, and the host time a message costs its sender and
    its receiver where they measured it (``Device.message_us``: the daemons' framing and p2pd; a
    small model's weight sync and rollout shards are mostly that)."""
    bw: np.ndarray
    """Link bandwidth in bytes/s, (N, N); inf on the diagonal."""
    cls: np.ndarray
    regions: tuple[str, ...]

    @classmethod
    def of(cls, rl: RLScenario) -> Cluster:
        sc, k = rl.scenario, rl.workload.constants
        devs = sc.devices
        delay = np.asarray(sc.delay_matrix(), dtype=float)
        bw = np.asarray(sc.bandwidth_matrix(), dtype=float) / 8.0
        for m, what in ((delay, "delay"), (bw, "bandwidth")):
            if np.isnan(m).any():
                i, j = np.argwhere(np.isnan(m))[0]
                raise ConfigError("links", f"no {what} for {devs[i].id!r} -> {devs[j].id!r}")
        # a message's host time at its sender and its receiver, where measured (``Device.message_us``)
        host = np.array([(d.message_us or 0.0) * 1e-6 for d in devs])
        delay = delay + (host[:, None] + host[None, :]) * (1.0 - np.eye(len(devs)))
        linked = {x for lk in sc.links for x in (lk.src, lk.dst)}
        keys: dict[tuple, int] = {}
        classes = []
        for d in devs:
            # a device with its own links is a class of its own
            key: tuple = (
                d.tflops,
                d.memory_gb,
                d.memory_bandwidth_gb_s,
                d.launch_us,
                d.element_ns,
                d.region,
                d.access_mbps,
                d.message_us,
            )
            key = (*key, d.id) if d.id in linked else key
            classes.append(keys.setdefault(key, len(keys)))
        return cls(
            ids=tuple(d.id for d in devs),
            flops=np.array([d.tflops * 1e12 for d in devs]),
            memory=np.array([d.memory_gb * 1e9 * k.memory_usable for d in devs]),
            mem_bw=np.array([(d.memory_bandwidth_gb_s or 0.0) * 1e9 for d in devs]),
            launch=np.array([(d.launch_us or 0.0) * 1e-6 for d in devs]),
            element_s=np.array([_element_seconds(rl.workload.launches, d.element_ns) for d in devs]).reshape(
                len(devs), 3
            ),
            delay=delay,
            bw=bw,
            cls=np.array(classes, dtype=np.intp),
            regions=tuple(d.region for d in devs),
        )

    @property
    def n(self) -> int:
        return len(self.ids)

    @cached_property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """Device indices of each class, in scenario order."""
        k = int(self.cls.max()) + 1
        return tuple(tuple(int(i) for i in np.flatnonzero(self.cls == c)) for c in range(k))

    @property
    def n_classes(self) -> int:
        return len(self.members)

    @cached_property
    def class_sizes(self) -> np.ndarray:
        return np.array([len(m) for m in self.members], dtype=np.intp)

    def devices_of(self, counts: tuple[int, ...]) -> list[int]:
        """Representative devices for a class-count vector: the first ``counts[c]`` of each class."""
        return [i for c, k in enumerate(counts) for i in self.members[c][:k]]

    def counts_of(self, devices: list[int] | np.ndarray) -> tuple[int, ...]:
        return tuple(
            int(x)
            for x in np.bincount(self.cls[np.asarray(devices, dtype=np.intp)], minlength=self.n_classes)
        )

    def subset(self, keep: list[int]) -> Cluster:
        """The cluster restricted to devices ``keep`` (classes renumbered)."""
        idx = np.asarray(keep, dtype=np.intp)
        _, cls = np.unique(self.cls[idx], return_inverse=True)
        return dataclasses.replace(
            self,
            ids=tuple(self.ids[i] for i in keep),
            flops=self.flops[idx],
            memory=self.memory[idx],
            mem_bw=self.mem_bw[idx],
            launch=self.launch[idx],
            element_s=self.element_s[idx],
            delay=self.delay[np.ix_(idx, idx)],
            bw=self.bw[np.ix_(idx, idx)],
            cls=cls.astype(np.intp),
            regions=tuple(self.regions[i] for i in keep),
        )


def _element_seconds(n: Launches, ns: PerFamily | None) -> tuple[float, float, float]:
    """Seconds per sequence of a generation, an inference forward and a training micro-batch's
    element work on a device costing ``ns`` per unit (none where it is not modelled)."""
    if ns is None:
        return 0.0, 0.0, 0.0
    return n.generate_elements.seconds(ns), n.inference_elements.seconds(ns), n.train_elements.seconds(ns)
