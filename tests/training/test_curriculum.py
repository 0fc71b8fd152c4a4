"""The curriculum: tiers from pass rates, the retry queue, and a state that resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.curriculum import Curriculum

RATES = {"a": 1.0, "b": 0.75, "c": 0.25, "d": 0.125, "e": 0.0, "f": 0.0}


def test_tiers_are_ordered_easy_to_hard():
    cur = Curriculum.from_pass_rates(RATES)
    assert cur.tiers() == {"easy": ["a", "b"], "medium": ["c", "d"], "hard": ["e", "f"]}


def test_hard_tier_opens_later_and_failed_tasks_come_back(tmp_path: Path):
    cur = Curriculum.from_pass_rates(RATES, open_hard_after_steps=3, retry_after_steps=2)
    assert set(cur.open_tasks()) == {"a", "b", "c", "d"}
    cur.record("c", [0.0] * 8)  # no passing attempt: into the retry queue
    assert "c" not in cur.open_tasks()
    cur.advance(2)
    assert "c" in cur.open_tasks()
    cur.advance(3)
    assert {"e", "f"} <= set(cur.open_tasks())
    cur.record("c", [1.0, 0.0])
    assert "c" not in cur.retry_due


def test_draws_resume_exactly_from_saved_state(tmp_path: Path):
    cur = Curriculum.from_pass_rates(RATES, seed=5)
    cur.next_tasks(3)
    cur.save(tmp_path / "c.json")
    expected = [cur.next_tasks(2) for _ in range(4)]
    again = Curriculum.load(tmp_path / "c.json")
    assert [again.next_tasks(2) for _ in range(4)] == expected


def test_informative_tasks_are_drawn_more():
    cur = Curriculum.from_pass_rates({"always": 1.0, "half": 0.5}, seed=0)
    draws = [cur.next_tasks(1)[0] for _ in range(400)]
    assert draws.count("half") > 3 * draws.count("always")


def test_bad_state_names_the_key(tmp_path: Path):
    (tmp_path / "c.json").write_text('{"pass_rates": {}}')
    with pytest.raises(ValueError, match="estimates"):
        Curriculum.load(tmp_path / "c.json")
    with pytest.raises(ValueError, match="pass rate"):
        Curriculum.from_pass_rates({"x": 1.5})
