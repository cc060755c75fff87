"""The data-parallel trainers' means: gradients (compressed where the spec says) and what must be exact.

Every update, the trainers of an rl job average their gradients together with the update's
figures (its group count, which scales the gradients, and its loss, KL and clip sums); at the
start they average their weights, and each iteration's first update also pools the reward
figures (``PooledRewards``). Gradients may travel quantized (``compression.gradient_bits``, with
error feedback: ``peerd.averaging``); the rest must come back exact, or the trainers would scale
their gradients and report their figures by rounded counts. So a compressing job's trainers keep
two groups of the same members: ``gradients`` at the spec's width and ``exact``, lossless, each
call's parts averaged on both at once; without gradient compression one group takes the whole
call in one round. A job whose ``averaging.aggregator`` is robust (``clipped``) keeps both groups
too: only the gradients go through the robust aggregator, which would otherwise cut the exact
figures and the start weights along with the gradients that share a share with them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Hashable, Sequence

import torch

from peerd.averaging import GradientCompression, GroupAllReduce
from peerd.averaging.aggregate import Aggregator
from peerd.jobs.rl.report import Rewards
from peerd.jobs.rl.shards import RLPlan
from peerd.rl.update import Average
from peerd.swarm.transport import Transport

AVERAGING_SLACK_S = 120.0  # beyond the rollout deadline, how long trainers wait for each other
GRPO_NORM_RATIO = 1e30
"""The trainers' bound on another trainer's contribution norm over their own whole gradient's
(``GroupAllReduce``'s screen): none in effect. Honest GRPO gradients differ by orders of magnitude
(a trainer whose groups all scored alike has only the KL term, 1e3x smaller than another's was
seen), and a refusal would recur on the same rollouts after every re-plan; contributions are still
checked finite, the averaged update is clipped to the spec's ``grad_clip``, and
``averaging.aggregator: clipped`` bounds what one trainer among three or more can move the mean by
(relative to the median, not to itself)."""


class TrainerMeans:
    """The averaging of one epoch's data-parallel trainers: ``gradients`` (maybe compressed) and
    ``exact`` (lossless; None when ``gradients`` is lossless itself)."""

    def __init__(self, gradients: GroupAllReduce, exact: GroupAllReduce | None = None) -> None:
        if exact is not None and exact.members != gradients.members:
            raise ValueError("the exact group must have the gradient group's members, in its order")
        self.gradients, self.exact = gradients, exact

    @property
    def size(self) -> int:
        return self.gradients.size

    @property
    def groups(self) -> list[GroupAllReduce]:
        return [g for g in (self.gradients, self.exact) if g is not None]

    def bytes_sent(self) -> tuple[int, int]:
        """Bytes these groups sent so far, and what they would have been as raw fp32."""
        return (
            sum(g.stats.bytes_sent for g in self.groups),
            sum(g.stats.raw_bytes_sent for g in self.groups),
        )

    def waited_s(self) -> float:
        """Seconds the averages so far waited for the other trainers' parts (``AveragingStats.waited_s``;
        both groups average each call at once: the longer wait counts)."""
        return max(g.stats.waited_s for g in self.groups)

    async def start(self) -> None:
        for group in self.groups:
            await group.start()

    async def close(self) -> None:
        await asyncio.gather(*(group.close() for group in self.groups))

    def mean(self, loop: asyncio.AbstractEventLoop) -> Average:
        """The trainers' mean, called from a worker thread while ``loop`` runs the groups. Each group
        numbers its steps in call order: every trainer makes the same calls (the alignment's two, then
        one per update)."""
        steps = {id(group): itertools.count() for group in self.groups}

        async def on(group: GroupAllReduce, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return await group.allreduce(next(steps[id(group)]), tensors)

        async def both(tensors: list[torch.Tensor], exact: int) -> list[torch.Tensor]:
            cut = len(tensors) - exact
            if self.exact is None or exact == 0:
                return await on(self.gradients, tensors)
            if cut == 0:
                return await on(self.exact, tensors)
            parts = [
                asyncio.ensure_future(on(self.gradients, tensors[:cut])),
                asyncio.ensure_future(on(self.exact, tensors[cut:])),
            ]
            try:
                lossy, kept = await asyncio.gather(*parts)
            except BaseException:  # one failed: the other fails too, and the caller sees the first error
                for part in parts:  # as it is (a TaskGroup would wrap it in an ExceptionGroup)
                    part.cancel()
                await asyncio.gather(*parts, return_exceptions=True)
                raise
            return [*lossy, *kept]

        def average(tensors: list[torch.Tensor], exact: int = 0) -> list[torch.Tensor]:
            if not 0 <= exact <= len(tensors):
                raise ValueError(f"exact={exact} of {len(tensors)} tensors")
            return asyncio.run_coroutine_threadsafe(both(tensors, exact), loop).result()

        return average


def trainer_means(
    transport: Transport, members: Sequence[Hashable], plan: RLPlan, epoch: int
) -> TrainerMeans:
    """The averaging of an rl job's data-parallel trainers in ``epoch`` (``members`` in replica order)."""
    bits = plan.spec.compression.gradient_bits

    def group(
        key: str, compressor: GradientCompression | None, aggregator: Aggregator | None = None
    ) -> GroupAllReduce:
        made = GroupAllReduce(
            transport,
            list(members),
            key=key,
            epoch=epoch,
            compressor=compressor,
            # a trainer may wait out its rollouts' deadline (and sample a missing shard) while the
            # others wait for it here: only a longer silence means a trainer is gone
            timeout=plan.rl.rollout_timeout_s + AVERAGING_SLACK_S,
            max_norm_ratio=GRPO_NORM_RATIO,
            aggregator=aggregator,
        )
        made.max_numel = 2 * plan.params + 64  # a call's tensors: gradients (or weights) and a few figures
        return made

    key = f"rl/{plan.job_id}/{epoch}"
    robust = plan.spec.averaging.aggregator != "mean"
    if bits is None and not robust:
        return TrainerMeans(group(key, None))
    # a robust aggregator would cut the exact figures with the gradients they share a share with
    compressor = GradientCompression(bits=bits) if bits is not None else None
    return TrainerMeans(group(key, compressor, plan.spec.averaging.build()), group(f"{key}/exact", None))


class PooledRewards:
    """Pools the reward figures of every data-parallel trainer's groups into the iteration's first
    average (the first update's), so they cost no averaging round of their own."""

    def __init__(self, average: Average, rewards: Rewards, rollouts: int, trainers: int) -> None:
        self.inner, self.trainers = average, trainers
        self.own = torch.tensor([rollouts, *(rollouts * v for v in vars(rewards).values())])
        self.mean: torch.Tensor | None = None

    def __call__(self, tensors: list[torch.Tensor], exact: int = 0) -> list[torch.Tensor]:
        if self.mean is not None:
            return self.inner(tensors, exact)
        *out, self.mean = self.inner([*tensors, self.own], exact + 1)
        return out

    def result(self) -> tuple[Rewards, int]:
        """The pooled figures and the completions of every trainer (after the updates averaged)."""
        assert self.mean is not None, "every data-parallel iteration averages at least once"
        total = float(self.mean[0])
        pooled = [float(v) / total if total > 0 else 0.0 for v in self.mean[1:]]
        return Rewards(*pooled), round(total * self.trainers)
