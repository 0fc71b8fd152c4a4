"""The trainer-config key ``reward``: which grading score an RL episode is rewarded with.

``reward`` (the default) is the resolved/unresolved reward of evals; ``strict_target_score`` gives
partial credit on tasks with several target tests (a two-bug task with one bug fixed scores 0.5),
and nothing once an existing test breaks. Scores come from :func:`evals.grading.score` itself."""

from __future__ import annotations

import pytest

from evals.grading import GradeResult, Status, score
from evals.harness import Trajectory
from training.config import REWARDS, TrainConfig
from training.episodes import episode_reward


def _graded(statuses: dict[str, Status]) -> Trajectory:
    traj = Trajectory("bundled-l3-000-payroll", "s/0", None, "compact")
    scores = score(["tests/test_a.py::test_a", "tests/test_b.py::test_b"], ["tests/test_c.py::test_c"], statuses)
    traj.grade = GradeResult("graded", scores)
    return traj


def test_the_reward_key_is_validated_naming_the_key():
    assert TrainConfig(base_model="m").reward == "reward"
    assert TrainConfig.from_mapping({"base_model": "m", "reward": "strict_target_score"}).reward == "strict_target_score"
    with pytest.raises(ValueError, match="key 'reward' must be one of reward, strict_target_score"):
        TrainConfig.from_mapping({"base_model": "m", "reward": "partial"})


def test_strict_target_score_gives_partial_credit_and_nothing_for_a_broken_existing_test():
    p, f = Status.PASSED, Status.FAILED
    one_of_two = _graded({"tests/test_a.py::test_a": p, "tests/test_b.py::test_b": f, "tests/test_c.py::test_c": p})
    assert episode_reward(one_of_two, "reward") == 0.0
    assert episode_reward(one_of_two, "strict_target_score") == 0.5
    broke = _graded({"tests/test_a.py::test_a": p, "tests/test_b.py::test_b": p, "tests/test_c.py::test_c": f})
    assert [episode_reward(broke, r) for r in REWARDS] == [0.0, 0.0]
    solved = _graded({"tests/test_a.py::test_a": p, "tests/test_b.py::test_b": p, "tests/test_c.py::test_c": p})
    assert [episode_reward(solved, r) for r in REWARDS] == [1.0, 1.0]
    ungraded = Trajectory("bundled-l3-000-payroll", "s/1", None, "compact")  # nothing committed that applies
    assert [episode_reward(ungraded, r) for r in REWARDS] == [0.0, 0.0]
