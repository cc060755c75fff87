"""One peer's search island for one planning epoch, run in a background thread beside the event loop.

The thread builds the island (``RosterScorer.island``), steps it one generation at a time
until a deadline on DHT time, takes migrants the driver hands over, and keeps the best
allocation found so far for the driver to ``propose``. It idles once it stopped improving and
no migrant arrived for ``patience`` generations: a small roster converges in well under the
budget, and a busy machine has better uses for the core.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from peerd.errors import PeerdError
from peerd.log import get_logger
from peerd.sched.allocation import Allocation

logger = get_logger(__name__)

IDLE_WAIT_S = 0.2


class SearchIsland(Protocol):
    """What the thread drives: ``peerd.sched.evolution.Island`` (pretraining) or an RL role island."""

    generation: int

    @property
    def obj(self) -> Any:
        """Has ``evaluations``: how many candidates were scored."""

    def step(self, generations: int = 1, deadline: float | None = None) -> bool: ...

    def best(self, k: int = 1) -> list[Allocation]: ...

    def best_cost(self) -> float: ...

    def accept(self, migrants: list[Allocation]) -> int: ...


@dataclass
class IslandReport:
    """How one epoch's island did (for logs, ``peerd status`` and the quality benchmark)."""

    epoch: int
    seed: int
    best_cost: float | None = None  # the island's final best, as re-scored by the shared cost model
    generations: int = 0
    evaluations: int = 0
    migrants_offered: int = 0
    migrants_taken: int = 0
    seconds: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class IslandThread:
    """Runs ``build()``'s island until ``deadline`` (DHT time) or ``stop()``; thread-safe best/migrants."""

    def __init__(
        self,
        build: Callable[[], SearchIsland],
        *,
        epoch: int,
        seed: int,
        deadline: float,
        clock: Callable[[], float],
        patience: int = 25,
    ) -> None:
        self.report = IslandReport(epoch, seed)
        self._build, self._deadline, self._clock, self._patience = build, deadline, clock, patience
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._migrants: list[Allocation] = []
        self._best: Allocation | None = None
        self.version = 0  # grows whenever the best changes
        self._thread = threading.Thread(target=self._run, name=f"peerd-island-e{epoch}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def best(self) -> tuple[int, Allocation | None]:
        with self._lock:
            return self.version, self._best

    def offer(self, allocation: Allocation) -> None:
        """A verified foreign candidate to take into the population at the next generation."""
        with self._lock:
            self._migrants.append(allocation)
            self.report.migrants_offered += 1
        self._wake.set()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            island = self._build()
            self._publish(island)
            stale = 0
            while not self._stop.is_set() and self._clock() < self._deadline:
                with self._lock:
                    migrants, self._migrants = self._migrants, []
                taken = island.accept(migrants) if migrants else 0
                if stale >= self._patience and not taken:
                    self._wake.wait(IDLE_WAIT_S)  # converged: wait for migrants or the end
                    self._wake.clear()
                    continue
                before = island.best_cost()
                island.step(1)
                improved = island.best_cost() < before or taken > 0
                stale = 0 if improved else stale + 1
                with self._lock:
                    self.report.migrants_taken += taken
                    self.report.generations = island.generation
                    self.report.evaluations = island.obj.evaluations
                if improved:
                    self._publish(island)
        except PeerdError as exc:  # the roster cannot be planned (e.g. no shape fits): a reason, not a bug
            logger.warning("island of epoch %d cannot search: %s", self.report.epoch, exc)
            self.report.error = exc.message
        except Exception as exc:  # a scheduler bug must not take the daemon down; planning goes on without us
            logger.exception("island of epoch %d failed", self.report.epoch)
            self.report.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.report.seconds = round(time.monotonic() - started, 3)

    def _publish(self, island: SearchIsland) -> None:
        best = island.best(1)
        if not best:
            return
        with self._lock:
            self._best = best[0]
            self.version += 1
            self.report.generations = island.generation
            self.report.evaluations = island.obj.evaluations
