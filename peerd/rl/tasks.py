"""Verifiable RL tasks generated on the fly: a registry of prompt formats with exact-match and format rewards.

Every task turns a seeded ``random.Random`` into a ``Problem`` (a prompt and its one correct
answer), so peers that share a seed share the problems and nothing is downloaded. Text is
tokenised byte-level, like peerd's corpora (``peerd.data.sources``: one token per UTF-8 byte,
vocabulary 256), so any built-in GPT with ``vocab_size=256`` can play.

Format of every task: the prompt ends with ``=``; a completion is *well formed* when it is a
non-empty run of the task's answer alphabet closed by the end marker ``END`` (a newline) and
nothing after it. It is *correct* when it is well formed and the run equals the answer. The
reward is ``correct_weight * correct + format_weight * well_formed`` (``RewardConfig``): the small
format term gives a signal to a policy that cannot solve the problem yet.

Tasks (``TASKS``, keyed by the spec's ``task.name``):

- ``addition``: ``"47+815="`` -> ``"862"``; operands have ``min_size..max_size`` digits.
- ``reversal``: ``"rev abcd="`` -> ``"dcba"``; lowercase strings of ``min_size..max_size`` letters.
- ``sorting``: ``"sort 3912="`` -> ``"1239"``; strings of ``min_size..max_size`` digits.
"""

from __future__ import annotations

import random
import string
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from peerd.errors import ConfigError
from peerd.loading import Range, check, problems

END = "\n"
"""End marker of every completion: generation stops when it is sampled."""
END_TOKEN = ord(END)
PAD_TOKEN = 0
"""Filler after a finished completion and before a left-padded prompt; never a target (masked)."""
VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    """Byte-level tokens of ``text`` (its UTF-8 bytes)."""
    return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    """Text of byte tokens; bytes that are not UTF-8 become U+FFFD (a policy may emit anything)."""
    return bytes(tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Problem:
    """One task instance: what the policy sees and the answer that earns the reward."""

    prompt: str
    answer: str

    @property
    def prompt_ids(self) -> list[int]:
        return encode(self.prompt)

    @property
    def target_ids(self) -> list[int]:
        """The correct completion as tokens: the answer and the end marker (teacher forcing)."""
        return encode(self.answer + END)


@dataclass(frozen=True)
class Score:
    """How one completion did."""

    correct: bool
    well_formed: bool
    reward: float


@dataclass
class RewardConfig:
    """Weights of the two reward terms."""

    correct_weight: Annotated[float, Range(ge=0, le=1e6)] = 1.0
    """Reward of an exactly correct, well-formed answer."""
    format_weight: Annotated[float, Range(ge=0, le=1e6)] = 0.1
    """Reward of a well-formed answer (the alphabet, closed by the end marker), correct or not."""

    def problems(self) -> list[ConfigError]:
        if self.correct_weight == 0 and self.format_weight == 0:
            return [ConfigError("correct_weight", "correct_weight and format_weight cannot both be 0")]
        return []


@dataclass
class TaskConfig:
    """The ``task:`` section of an RL job spec."""

    name: str = "addition"
    """Registry key: one of ``TASKS`` (addition, reversal, sorting)."""
    min_size: Annotated[int, Range(ge=1, le=16)] = 1
    """Smallest instance: digits per operand (addition) or characters (reversal, sorting)."""
    max_size: Annotated[int, Range(ge=1, le=16)] = 3
    """Largest instance, same unit; sizes are drawn uniformly from ``min_size..max_size``."""
    reward: RewardConfig = field(default_factory=RewardConfig)

    def problems(self) -> list[ConfigError]:
        out = []
        if self.name not in TASKS:
            out.append(ConfigError("name", f"unknown task {self.name!r} (known: {', '.join(sorted(TASKS))})"))
        if self.min_size > self.max_size:
            out.append(ConfigError("min_size", f"must be <= max_size={self.max_size}, got {self.min_size}"))
        return out


class Task(ABC):
    """A generator of problems plus the verifier of their completions."""

    name: ClassVar[str]
    alphabet: ClassVar[frozenset[str]]
    """Characters an answer may consist of (the format check)."""

    def __init__(self, cfg: TaskConfig) -> None:
        check(problems(cfg, "task"), "the task")
        self.cfg = cfg

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn from ``rng``."""

    @property
    @abstractmethod
    def max_answer_len(self) -> int:
        """Longest answer (in tokens, end marker excluded) of any problem this task draws."""

    @property
    @abstractmethod
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens."""

    def problems(self, n: int, seed: int) -> list[Problem]:
        """``n`` problems from a generator seeded by ``seed`` (the same list on every peer)."""
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    def score(self, problem: Problem, completion: Sequence[int]) -> Score:
        """Score the completion tokens (as generated: up to and including the end marker, if any)."""
        text = decode(completion)
        body, closed, rest = text.partition(END)
        well_formed = bool(closed) and not rest and bool(body) and set(body) <= self.alphabet
        correct = well_formed and body == problem.answer
        w = self.cfg.reward
        return Score(correct, well_formed, w.correct_weight * correct + w.format_weight * well_formed)

    def _size(self, rng: random.Random) -> int:
        return rng.randint(self.cfg.min_size, self.cfg.max_size)


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    assert cls.name not in TASKS, f"task {cls.name!r} registered twice"
    TASKS[cls.name] = cls
    return cls


def make_task(cfg: TaskConfig) -> Task:
    """The task ``cfg.name`` names, checked (``ConfigError`` naming the field otherwise)."""
    if cfg.name not in TASKS:
        raise ConfigError("task.name", f"unknown task {cfg.name!r} (known: {', '.join(sorted(TASKS))})")
    return TASKS[cfg.name](cfg)


DIGITS = frozenset(string.digits)


@register_task
class Addition(Task):
    """``a+b=`` -> the decimal sum; each operand has ``min_size..max_size`` digits (1 digit: 0..9)."""

    name = "addition"
    alphabet = DIGITS

    def _operand(self, rng: random.Random) -> int:
        digits = self._size(rng)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    @property
    def max_answer_len(self) -> int:
        return self.cfg.max_size + 1  # the carry

    @property
    def max_prompt_len(self) -> int:
        return 2 * self.cfg.max_size + 2


@register_task
class Reversal(Task):
    """``rev abc=`` -> ``cba``; lowercase strings of ``min_size..max_size`` letters."""

    name = "reversal"
    alphabet = frozenset(string.ascii_lowercase)

    def sample(self, rng: random.Random) -> Problem:
        s = "".join(rng.choices(string.ascii_lowercase, k=self._size(rng)))
        return Problem(prompt=f"rev {s}=", answer=s[::-1])

    @property
    def max_answer_len(self) -> int:
        return self.cfg.max_size

    @property
    def max_prompt_len(self) -> int:
        return self.cfg.max_size + 5


@register_task
class Sorting(Task):
    """``sort 3912=`` -> ``1239``; strings of ``min_size..max_size`` digits, sorted ascending."""

    name = "sorting"
    alphabet = DIGITS

    def sample(self, rng: random.Random) -> Problem:
        s = "".join(rng.choices(string.digits, k=self._size(rng)))
        return Problem(prompt=f"sort {s}=", answer="".join(sorted(s)))

    @property
    def max_answer_len(self) -> int:
        return self.cfg.max_size

    @property
    def max_prompt_len(self) -> int:
        return self.cfg.max_size + 6
