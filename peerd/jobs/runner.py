"""The job runner: on a committed allocation, run this peer's tasklet and publish its progress.

``TaskletRunner`` composes the pipeline and averaging layers for one peer: the job spec and
the committed allocation become a ``TrainConfig`` (layers per stage from the allocation,
compression from the spec), the allocation names the upstream and downstream neighbours and
the stage's replica group (``GroupAllReduce`` in allocation order), and a ``StageWorker``
trains on the daemon's transport until the job's last step, checkpointing every
``checkpoint_interval`` steps and at the end. Neighbours start within seconds of each other
(each sees the commit on its own poll); the streams' connect deadlines absorb that, so no
extra barrier is needed. Progress (step, loss history, tokens/s, bytes on the wire by kind
and what they would have been uncompressed) goes to ``progress_key(job)`` under this peer's
subkey every ``interval`` seconds and when the tasklet ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from peerd.averaging import GroupAllReduce
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable
from peerd.jobs.catalog import read_progress
from peerd.jobs.records import JobRecord, Progress, TaskState, downsample, encode_progress
from peerd.jobs.spec import JobSpec
from peerd.jobs.store import RecordStore
from peerd.log import get_logger
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.partition import balanced_layers_per_stage
from peerd.pipeline.streams import StreamConfig
from peerd.pipeline.worker import StageWorker, StepReport
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit
from peerd.swarm.keys import progress_key
from peerd.swarm.transport import Transport

logger = get_logger(__name__)

PROGRESS_TTL_S = 24 * 3600.0
READY_POLL_S = 0.5
_FORWARD = {"acsgd": "acsgd", "direct": "quant", "none": "none"}


def tasklet_of(allocation: Allocation, peer: str) -> tuple[int, int] | None:
    """(stage, replica) that ``peer`` runs in ``allocation``, or None (a spare or not allocated)."""
    for s, stage in enumerate(allocation.stages):
        if peer in stage:
            return s, stage.index(peer)
    return None


def unsupported(spec: JobSpec) -> tuple[list[ConfigError], list[str]]:
    """(errors, warnings) for running ``spec`` with the pipeline worker as it is today.

    Errors: what the runner cannot do at all (a fine-tune from ``init_checkpoint``). Warnings:
    settings it ignores, because the stage worker runs AdamW at a constant learning rate.
    """
    errors = []
    if spec.kind == "finetune":
        errors.append(
            ConfigError("kind", "finetune jobs cannot run yet: the runner does not load init_checkpoint")
        )
    opt, warnings = spec.optimizer, []
    if opt.name != "adamw":
        warnings.append(f"optimizer.name {opt.name!r} (the stage worker uses AdamW)")
    if opt.schedule != "constant" or opt.warmup_steps:
        warnings.append("optimizer.schedule/warmup_steps (the learning rate stays at optimizer.lr)")
    if opt.betas is not None:
        warnings.append("optimizer.betas (AdamW defaults 0.9, 0.999)")
    if opt.grad_clip is not None:
        warnings.append("optimizer.grad_clip (no clipping)")
    return errors, [f"ignored by the runner: {w}" for w in warnings]


def train_config(
    job_id: str, spec: JobSpec, allocation: Allocation, checkpoint_root: Path | None
) -> TrainConfig:
    """The pipeline configuration every tasklet of ``allocation`` runs with (identical on every peer)."""
    gpt = spec.model.gpt_config()
    layers = list(allocation.layers) if allocation.layers is not None else None
    if layers is None or sum(layers) != gpt.num_layers:
        layers = balanced_layers_per_stage(gpt.num_layers, allocation.d_pp)
    comp = spec.compression
    compression = CompressionConfig(
        forward=_FORWARD[comp.forward],  # type: ignore[arg-type]
        forward_bits=comp.forward_bits or 4,
        backward="quant" if comp.backward_bits else "none",
        backward_bits=comp.backward_bits or 8,
        gradients="quant" if comp.gradient_bits else "none",
        gradient_bits=comp.gradient_bits or 8,
    )
    overrides = dict(spec.model.overrides)
    return TrainConfig(
        job=job_id,
        model=ModelBuild(preset=spec.model.preset or "tiny", overrides=overrides, seed=spec.model.seed),
        data=spec.data,
        layers_per_stage=layers,
        global_batch=spec.global_batch,
        micro_batch_size=spec.micro_batch,
        steps=spec.steps,
        lr=spec.optimizer.lr,
        weight_decay=spec.optimizer.weight_decay,
        compression=compression,
        # neighbours start when they see the commit, seconds apart: generous connect deadlines
        streams=StreamConfig(connect_timeout_s=90.0, recv_timeout_s=180.0, ack_timeout_s=180.0),
        averaging_timeout_s=180.0,
        checkpoint_dir=str(checkpoint_root) if checkpoint_root is not None else None,
        checkpoint_every=spec.checkpoint_interval,
    )


class TaskletRunner:
    """Runs this peer's tasklet of a committed allocation: ``await run()`` returns when it ends."""

    def __init__(
        self,
        job: JobRecord,
        spec: JobSpec,
        commit: Commit,
        *,
        store: RecordStore,
        transport: Transport,
        peer_ref: Callable[[str], Any],
        checkpoint_root: Path | None,
        interval: float = 2.0,
        ready_timeout: float = 120.0,
    ) -> None:
        where = tasklet_of(commit.allocation, store.me)
        if where is None:
            raise ConfigError(
                "allocation", f"peer {store.me} has no tasklet in allocation {commit.allocation_hash}"
            )
        self.job, self.spec, self.commit, self.store = job, spec, commit, store
        self.stage, self.replica = where
        self.allocation = commit.allocation
        self.cfg = train_config(job.job_id, spec, commit.allocation, checkpoint_root)
        self.transport, self.peer_ref, self.interval = transport, peer_ref, interval
        self.ready_timeout = ready_timeout
        self.state = TaskState.RUNNING
        self.reason = ""
        self.step = 0
        self.losses: list[tuple[int, float]] = []
        self.tokens_per_s = 0.0
        self.wire: dict[str, int] = {}
        self.started_at = store.now()
        self.worker: StageWorker | None = None
        self._dirty = asyncio.Event()
        gpt = spec.model.gpt_config()
        self._boundary_raw = gpt.d_model * 4  # fp32 bytes per token crossing a stage boundary
        self._avg_raw_per_step = 0
        self._expires = 0.0
        self._group: GroupAllReduce | None = None

    def _reducer(self) -> GroupAllReduce | None:
        group = self.allocation.stages[self.stage]
        if len(group) == 1:
            return None
        return GroupAllReduce(
            self.transport,
            [self.peer_ref(p) for p in group],
            self.peer_ref(self.store.me),
            key=f"{self.job.job_id}/s{self.stage}",
            compressor=self.cfg.compression.gradient_compressor,
            timeout=self.cfg.averaging_timeout_s,
        )

    def _neighbour(self, stage: int) -> Any:
        if not 0 <= stage < self.allocation.d_pp:
            return None
        return self.peer_ref(self.allocation.stages[stage][self.replica])

    async def run(self) -> TaskState:
        torch.set_num_threads(1)  # several daemons share this machine's cores; one compute thread each
        logger.info(
            "job %s: running tasklet stage %d replica %d of %dx%d (layers %s)",
            self.job.job_id,
            self.stage,
            self.replica,
            self.allocation.d_pp,
            self.allocation.d_dp,
            self.cfg.layers_per_stage,
        )
        publisher = asyncio.create_task(self._publish_loop())
        try:
            self.worker = await asyncio.get_running_loop().run_in_executor(None, self._build_worker)
            await self.worker.start()  # serve the stage protocol ...
            if self._group is not None:
                await self._group.start()  # ... and the replica group's
            await self._publish()  # step 0: "this tasklet serves" (the ready handshake)
            await self._wait_ready()
            await self.worker.connect()
            await self.worker.run()
            self.state = TaskState.DONE
            logger.info(
                "job %s: tasklet s%dr%d finished %d steps",
                self.job.job_id,
                self.stage,
                self.replica,
                self.step,
            )
        except asyncio.CancelledError:
            self.state, self.reason = TaskState.FAILED, "stopped (job cancelled or daemon shutting down)"
            raise
        except PeerdError as exc:
            self.state, self.reason = TaskState.FAILED, str(exc)[:200]
            logger.warning(
                "job %s: tasklet s%dr%d failed: %s", self.job.job_id, self.stage, self.replica, exc
            )
        finally:
            if self.worker is not None:
                await self.worker.close()
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await publisher
            with contextlib.suppress(Exception):
                await asyncio.shield(self._publish())
        return self.state

    def _partners(self) -> set[str]:
        """Peers this tasklet opens streams to: its pipeline neighbours and its replica group."""
        stages, r = self.allocation.stages, self.replica
        near = {stages[s][r] for s in (self.stage - 1, self.stage + 1) if 0 <= s < len(stages)}
        return (near | set(stages[self.stage])) - {self.store.me}

    async def _wait_ready(self) -> None:
        """Wait until every partner published progress for this epoch, i.e. serves its protocols."""
        need = self._partners()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                found = await read_progress(self.store, self.job.job_id)
            except PeerdError as exc:
                logger.debug("job %s: reading progress failed: %s", self.job.job_id, exc)
                found = {}
            missing = {p for p in need if p not in found or found[p].epoch != self.commit.epoch}
            if not missing:
                return
            if time.monotonic() > deadline:
                raise PeerUnavailable(
                    f"tasklet partners {sorted(missing)} did not start within {self.ready_timeout:.0f} s",
                    code=ErrorCode.TIMEOUT,
                )
            await asyncio.sleep(READY_POLL_S)

    def _build_worker(self) -> StageWorker:
        reducer = self._group = self._reducer()
        self._avg_raw_per_step = 0
        worker = StageWorker(
            self.cfg,
            stage=self.stage,
            replica=self.replica,
            replicas=self.allocation.d_dp,
            transport=self.transport,
            upstream=self._neighbour(self.stage - 1),
            downstream=self._neighbour(self.stage + 1),
            reducer=reducer,
            on_report=self._on_report,
        )
        if reducer is not None:
            numel = sum(p.numel() for p in worker.params)
            d = self.allocation.d_dp
            self._avg_raw_per_step = int(numel * 4 * 2 * (d - 1) / d)  # fp32 reduce-scatter + all-gather
        return worker

    def _on_report(self, report: StepReport) -> None:
        self.step = report.step + 1
        self.tokens_per_s = report.tokens_per_s
        if report.loss is not None:
            self.losses.append((report.step, report.loss))
        worker = self.worker
        if worker is not None:
            self.wire = self._bytes(worker, report)
        self._dirty.set()

    def _bytes(self, worker: StageWorker, report: StepReport) -> dict[str, int]:
        sent = {"activations": 0, "gradients": 0}
        for (_, direction), counters in worker.stats.sent.items():
            sent["activations" if direction == "fwd" else "gradients"] += counters.wire_bytes
        steps = self.step
        tokens = report.tokens * steps  # this replica's tokens so far (same every step)
        out = dict(sent)
        out["activations_raw"] = tokens * self._boundary_raw if self.stage + 1 < self.allocation.d_pp else 0
        out["gradients_raw"] = tokens * self._boundary_raw if self.stage > 0 else 0
        stats = getattr(worker.reducer, "stats", None)
        out["averaging"] = int(getattr(stats, "bytes_sent", 0))
        out["averaging_raw"] = self._avg_raw_per_step * steps
        return out

    def progress(self) -> Progress:
        last = self.losses[-1][1] if self.losses else None
        return Progress(
            job_id=self.job.job_id,
            peer=self.store.me,
            epoch=self.commit.epoch,
            stage=self.stage,
            replica=self.replica,
            step=min(self.step, self.spec.steps),
            steps=self.spec.steps,
            state=self.state,
            tokens_per_s=float(self.tokens_per_s),
            updated_at=self.store.now(),
            started_at=self.started_at,
            loss=last,
            losses=downsample(self.losses),
            bytes=dict(self.wire),
            reason=self.reason,
        )

    async def _publish(self) -> bool:
        raw = encode_progress(self.progress())
        # strictly later expirations: hivemind keeps a subkey's value with the latest one
        self._expires = max(self.store.now() + PROGRESS_TTL_S, self._expires + 1e-3)
        return await self.store.put(progress_key(self.job.job_id), raw, self._expires)

    async def _publish_loop(self) -> None:
        last = -1.0
        while True:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=self.interval * 5)
            wait = self.interval - (time.monotonic() - last)
            if wait > 0:
                await asyncio.sleep(wait)
            self._dirty.clear()
            last = time.monotonic()
            try:
                await self._publish()
            except PeerdError as exc:
                logger.debug("job %s: publishing progress failed: %s", self.job.job_id, exc)
