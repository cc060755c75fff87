"""RL tasks: seeded generation, prompt format, exact-match and format rewards, the registry and bad configs."""

from __future__ import annotations

import random

import pytest

from peerd.errors import ConfigError
from peerd.loading import from_mapping
from peerd.rl.tasks import (
    END,
    END_TOKEN,
    TASKS,
    Problem,
    RewardConfig,
    TaskConfig,
    decode,
    encode,
    make_task,
)


def test_registry_holds_the_three_tasks():
    assert set(TASKS) >= {"addition", "reversal", "sorting"}


@pytest.mark.parametrize("name", ["addition", "reversal", "sorting"])
def test_same_seed_same_problems_other_seed_differs(name):
    task = make_task(TaskConfig(name=name, min_size=2, max_size=4))
    assert task.problems(20, seed=3) == task.problems(20, seed=3)
    assert task.problems(20, seed=3) != task.problems(20, seed=4)


@pytest.mark.parametrize("name", ["addition", "reversal", "sorting"])
def test_answers_are_right_and_within_the_declared_lengths(name):
    task = make_task(TaskConfig(name=name, min_size=1, max_size=5))
    for p in task.problems(300, seed=0):
        assert p.prompt.endswith("=")
        assert len(encode(p.prompt)) <= task.max_prompt_len
        assert 1 <= len(p.answer) <= task.max_answer_len
        assert set(p.answer) <= task.alphabet
        q = p.prompt[:-1]
        if name == "addition":
            a, b = q.split("+")
            assert int(p.answer) == int(a) + int(b)
            assert 1 <= len(a) <= 5 and 1 <= len(b) <= 5
        elif name == "reversal":
            assert p.answer == q.removeprefix("rev ")[::-1]
        else:
            assert p.answer == "".join(sorted(q.removeprefix("sort ")))


def test_operand_sizes_cover_the_range_without_leading_zeros():
    task = make_task(TaskConfig(name="addition", min_size=2, max_size=3))
    operands = [x for p in task.problems(200, seed=1) for x in p.prompt[:-1].split("+")]
    assert {len(x) for x in operands} == {2, 3}
    assert all(not x.startswith("0") for x in operands)


def test_score_exact_match_and_format():
    task = make_task(TaskConfig(name="addition", reward=RewardConfig(correct_weight=1.0, format_weight=0.1)))
    p = Problem(prompt="12+30=", answer="42")
    right = task.score(p, encode("42" + END))
    assert (right.correct, right.well_formed, right.reward) == (True, True, pytest.approx(1.1))
    wrong = task.score(p, encode("43" + END))
    assert (wrong.correct, wrong.well_formed, wrong.reward) == (False, True, pytest.approx(0.1))
    # not closed by the end marker (cut at max length), foreign characters, empty body, text after END
    for bad in ["42", "4a" + END, END, "42" + END + "1"]:
        s = task.score(p, encode(bad))
        assert (s.correct, s.well_formed, s.reward) == (False, False, 0.0), bad


def test_score_of_non_utf8_bytes_is_zero_not_an_error():
    task = make_task(TaskConfig(name="reversal"))
    assert task.score(Problem("rev ab=", "ba"), [0xFF, 0xFE, END_TOKEN]).reward == 0.0


def test_target_ids_are_answer_then_end_marker():
    p = Problem(prompt="rev ab=", answer="ba")
    assert p.target_ids == [ord("b"), ord("a"), END_TOKEN]
    assert decode(p.prompt_ids) == "rev ab="


@pytest.mark.parametrize(
    ("mapping", "field"),
    [
        ({"name": "chess"}, "task.name"),
        ({"min_size": 4, "max_size": 2}, "task.min_size"),
        ({"max_size": 0}, "task.max_size"),
        ({"max_size": 40}, "task.max_size"),
        ({"reward": {"format_weight": -1}}, "task.reward.format_weight"),
        ({"reward": {"correct_weight": 0, "format_weight": 0}}, "task.reward.correct_weight"),
        ({"difficulty": 3}, "task.difficulty"),
    ],
)
def test_bad_task_config_names_the_field(mapping, field):
    with pytest.raises(ConfigError) as exc:
        from_mapping(TaskConfig, mapping, "task")
    assert field in {e.field for e in exc.value.errors}


def test_make_task_refuses_an_unknown_name_and_bad_sizes():
    with pytest.raises(ConfigError, match="unknown task 'chess'") as exc:
        make_task(TaskConfig(name="chess"))
    assert exc.value.field == "task.name"
    with pytest.raises(ConfigError) as exc:
        make_task(TaskConfig(min_size=3, max_size=1))
    assert exc.value.field == "task.min_size"


def test_sample_uses_only_the_given_rng():
    task = make_task(TaskConfig(name="sorting", min_size=3, max_size=3))
    a, b = random.Random(9), random.Random(9)
    random.seed(1)
    first = task.sample(a)
    random.seed(2)
    assert task.sample(b) == first
