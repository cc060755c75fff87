"""Run fixed placements with one OS process per peer: spawn, ready handshakes over JSON lines, collect, reap.

The parent (``PeerProcesses``) starts ``count`` children running ``child_main`` and talks to
each over its stdin (commands) and stdout (events), one JSON object per line:

    parent -> child                         child -> parent
    {"cmd": "start", "initial_peers": [...]}  {"event": "ready", "peer_id", "maddrs"}
    {"cmd": "plan", "config", "allocation",   {"event": "serving"}        (or "error")
     "peer_ids", "link", "until", "resume"}
    {"cmd": "go"}                             {"event": "report", ...} per step, then
                                              {"event": "done", "stats"}  (or "error")
    {"cmd": "exit"}                           (closes everything and exits 0)

Every wait has a deadline; whatever happens, ``close`` ends every child (exit command, then
SIGTERM, then SIGKILL) so no p2pd outlives the run. A child may run several plans in a row
(benchmarks reuse the processes across link settings). The gradient reducer is injected by
the entry point, as in ``peerd.pipeline.launch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable
from peerd.loading import from_mapping, to_mapping
from peerd.log import get_logger
from peerd.pipeline.config import TrainConfig
from peerd.pipeline.launch import (
    LocalPeer,
    Placement,
    ReducerFactory,
    RunResult,
    TaskletError,
    build_workers,
)
from peerd.pipeline.launch import resume_step as common_resume_step
from peerd.pipeline.worker import StageWorker, StepReport
from peerd.swarm.node import parse_peer_id
from peerd.swarm.shaper import LinkShaper, LinkSpec
from peerd.swarm.transport import Transport, create_p2p
from peerd.tasks import within

logger = get_logger(__name__)


class _Child:
    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index = index
        self.proc = proc

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def expect(self, event: str, timeout: float, on_other: Any = None) -> dict[str, Any]:
        """The next line with ``event``; other events go to ``on_other``; an ``error`` event raises."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    with contextlib.suppress(TimeoutError):
                        await within(self.proc.wait(), 5)
                    raise PeerUnavailable(f"peer process {self.index} exited (code {self.proc.returncode})")
                msg = json.loads(line)
                if msg.get("event") == event:
                    return msg
                if msg.get("event") == "error":
                    raise PeerdError(f"peer {self.index}: {msg['message']}", code=ErrorCode[msg["code"]])
                if on_other is not None:
                    on_other(msg)


class PeerProcesses:
    """``count`` peer processes; ``await start()``, then ``await run(...)`` any number of times, then ``close``."""

    def __init__(
        self, count: int, argv: list[str], *, log_dir: str | Path | None = None, threads: int = 1
    ) -> None:
        self.count = count
        self.argv = argv
        self.log_dir = Path(log_dir) if log_dir else None
        self.threads = threads
        self.children: list[_Child] = []
        self.peer_ids: list[str] = []

    async def start(self, timeout: float = 120.0) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PEERD_CHILD_THREADS": str(self.threads)}
        for i in range(self.count):
            stderr: Any = asyncio.subprocess.DEVNULL
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                stderr = open(self.log_dir / f"peer{i}.log", "wb")  # noqa: SIM115 - owned by the child
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
                start_new_session=True,  # the child and its p2pd form a group we can kill as one
            )
            self.children.append(_Child(i, proc))
        maddrs: list[str] = []
        for child in self.children:  # each bootstraps from all earlier peers: a full mesh on loopback
            await child.send({"cmd": "start", "initial_peers": maddrs})
            ready = await child.expect("ready", timeout)
            self.peer_ids.append(ready["peer_id"])
            maddrs = maddrs + ready["maddrs"]

    async def run(
        self,
        cfg: TrainConfig,
        placement: Placement,
        *,
        link: LinkSpec | None = None,
        until: int | None = None,
        resume: bool = False,
        timeout: float = 600.0,
    ) -> RunResult:
        """Run ``cfg`` as ``placement`` across the processes; ``link`` shapes the pipeline neighbours' links."""
        placement.validate(cfg, self.count)
        step = common_resume_step(cfg, placement) if resume else None
        plan = {
            "cmd": "plan",
            "config": to_mapping(cfg),
            "allocation": placement.peers,
            "peer_ids": self.peer_ids,
            "link": None if link is None else asdict(link),
            "until": until,
            "resume": step,
        }
        result = RunResult(start_step=step or 0)
        used = sorted({p for _, _, p in placement.tasklets()})
        for i in used:
            await self.children[i].send(plan)
        for i in used:
            await self.children[i].expect("serving", timeout)
        for i in used:
            await self.children[i].send({"cmd": "go"})

        def collect(msg: dict[str, Any]) -> None:
            if msg.get("event") == "report":
                result.reports.append(StepReport(**msg["report"]))

        async def finish(i: int) -> None:
            try:
                done = await self.children[i].expect("done", timeout, collect)
            except PeerdError as exc:
                s, r = placement.tasklet_of(i)
                result.errors.append(TaskletError(s, r, exc.code.name, exc.message))
                return
            s, r = placement.tasklet_of(i)
            result.stats[f"s{s}r{r}"] = done["stats"]
            for e in done.get("errors", []):
                result.errors.append(TaskletError(**e))

        await asyncio.gather(*(finish(i) for i in used))
        result.reports.sort(key=lambda r: (r.step, r.stage, r.replica))
        return result

    async def close(self, timeout: float = 20.0) -> None:
        """Ask every child to exit; terminate, then kill, whatever is left (with its process group)."""
        for child in self.children:
            with contextlib.suppress(Exception):
                await child.send({"cmd": "exit"})
        for child in self.children:
            try:
                await within(child.proc.wait(), timeout)
            except TimeoutError:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.proc.pid, sig)
                    try:
                        await within(child.proc.wait(), 5)
                        break
                    except TimeoutError:
                        continue
            # p2pd runs in the child's session: make sure it did not outlive the child
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)

    async def __aenter__(self) -> PeerProcesses:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------- child side


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def _lines() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _child(reducer_factory: ReducerFactory | None) -> None:
    commands = await _lines()

    async def next_cmd() -> dict[str, Any]:
        line = await commands.readline()
        if not line:
            return {"cmd": "exit"}
        return json.loads(line)

    cmd = await next_cmd()
    if cmd.get("cmd") != "start":
        return
    p2p = await create_p2p(cmd["initial_peers"])
    _emit("ready", peer_id=p2p.peer_id.to_base58(), maddrs=[str(m) for m in await p2p.get_visible_maddrs()])
    try:
        while (cmd := await next_cmd()).get("cmd") == "plan":
            await _run_plan(p2p, cmd, next_cmd, reducer_factory)
    finally:
        with contextlib.suppress(Exception):
            await within(p2p.shutdown(), 10)


async def _run_plan(
    p2p: Any, plan: dict[str, Any], next_cmd: Any, reducer_factory: ReducerFactory | None
) -> None:
    cfg = from_mapping(TrainConfig, plan["config"])
    placement = Placement(plan["allocation"])
    ids = [parse_peer_id(p) for p in plan["peer_ids"]]
    me = ids.index(p2p.peer_id)
    shaper = None
    if plan["link"] is not None:
        link = LinkSpec(**plan["link"])
        shaped = placement.neighbour_pairs()
        index_of = {pid: i for i, pid in enumerate(ids)}
        shaper = LinkShaper(lambda peer: link if frozenset((me, index_of.get(peer, -1))) in shaped else None)
    transport = Transport(p2p, shaper)
    # the other peers are known by id only; this process builds just its own tasklets
    peers = [LocalPeer(i, _Remote(pid) if i != me else p2p, transport) for i, pid in enumerate(ids)]
    workers: list[StageWorker] = []
    try:
        workers = build_workers(
            cfg,
            placement,
            peers,
            reducer_factory=reducer_factory,
            on_report=lambda report: _emit("report", report=asdict(report)),
            here={me},
        )
        for w in workers:
            if plan["resume"] is not None:
                w.restore(plan["resume"])
            await w.start()
        _emit("serving")
        if (await next_cmd()).get("cmd") != "go":
            return
        for w in workers:
            await w.connect()
        outcomes = await asyncio.gather(*(w.run(plan["until"]) for w in workers), return_exceptions=True)
        errors = []
        for w, outcome in zip(workers, outcomes, strict=True):
            if isinstance(outcome, PeerdError):
                errors.append(asdict(TaskletError(w.stage, w.replica, outcome.code.name, outcome.message)))
            elif isinstance(outcome, BaseException):
                raise outcome
        stats = workers[0].stats.snapshot() if workers else {}
        _emit("done", stats=stats, errors=errors)
    except PeerdError as exc:
        _emit("error", code=exc.code.name, message=exc.message)
    finally:
        for w in workers:
            await w.close()
        await transport.close()


class _Remote:
    """Stands in for another process's P2P: only its peer id is known here."""

    def __init__(self, peer_id: Any) -> None:
        self.peer_id = peer_id


def child_main(reducer_factory: ReducerFactory | None = None) -> None:
    """Entry point of a peer process (``python -m <module>`` whose ``__main__`` calls this)."""
    import torch

    threads = int(os.environ.get("PEERD_CHILD_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_child(reducer_factory))
