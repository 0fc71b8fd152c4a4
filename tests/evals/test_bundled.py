"""The bundled suite: deterministic generation, real validation, demonstrations that round-trip."""

import json
import subprocess

import pytest

from evals import bundled
from evals.actions import ActionParseError, demonstration, parse_compact, reference_actions, render_compact_prompt
from evals.tasks import load_tasks, summarize


def test_generation_is_deterministic_and_split():
    """Per level: 60 tasks (every 4th held out, the others demonstrations for the base model), then
    45 RL tasks, then 135 more held-out tasks (150 a level held out); no two tasks share a module's
    text, so no RL task repeats a held-out one."""
    a, b = bundled.generate(), bundled.generate()
    assert [g.files for g in a] == [g.files for g in b]
    assert len(a) == 720 and len({g.id for g in a}) == 720
    assert len({g.files[f"{g.module}.py"] for g in a}) == 720
    assert {g.difficulty for g in a} == {1, 2, 3}
    held_out = [g for g in a if g.split == "eval"]
    assert len(held_out) == 450 and all(g.split == "train" for g in a if g not in held_out)
    assert {lv: sum(g.difficulty == lv for g in held_out) for lv in (1, 2, 3)} == {1: 150, 2: 150, 3: 150}
    demonstrations = [g for g in a if g.demonstration]
    assert len(demonstrations) == 135 and not any(g.demonstration for g in held_out)
    rl = [g for g in a if g.split == "train" and not g.demonstration]
    assert len(rl) == 135 and all(60 <= int(g.id.split("-")[2]) < 105 for g in rl)
    assert all(int(g.id.split("-")[2]) >= 105 for g in held_out if int(g.id.split("-")[2]) >= 60)
    assert all(len(g.reference_edits) == (2 if g.difficulty == 3 else 1) for g in a)
    # each part comes after the ones before it: fewer extra held-out tasks, or none, or no RL tasks
    # either, leave the tasks before them as they were
    assert [g.files for g in bundled.generate(extra_eval_per_level=0)] == [g.files for g in a if int(g.id.split("-")[2]) < 105]
    assert [g.files for g in bundled.generate(rl_per_level=0, extra_eval_per_level=0)] == \
        [g.files for g in a if int(g.id.split("-")[2]) < 60]
    # the held-out tasks of 30 and of 75 extra a level (135 and 270 in all) are among the 450
    assert [g.files for g in bundled.generate(extra_eval_per_level=30)] == [g.files for g in a if int(g.id.split("-")[2]) < 135]
    assert [g.files for g in bundled.generate(extra_eval_per_level=75)] == [g.files for g in a if int(g.id.split("-")[2]) < 180]
    with pytest.raises(ValueError, match="extra_eval_per_level=-1"):
        bundled.generate(extra_eval_per_level=-1)


def test_built_suite_is_real(small_suite, small_tasks):
    assert len(small_tasks) == 9  # per level: one held out, one demonstration, one RL task
    assert [t.metadata["demonstration"] for t in small_tasks[:3]] == [False, True, False]
    assert [t.split for t in small_tasks[:3]] == ["eval", "train", "train"]
    summary = summarize(load_tasks(small_suite))
    assert summary["tasks"] == 9 and summary["incomplete"] == [] and summary["by_language"] == {"python": 9}
    for task in small_tasks:
        repo = task.repo_path
        head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert head == task.base_commit
        assert task.metadata["failing_output"].count("->") >= len(task.target_tests)
    # the same generator gives the same commits
    again = json.loads((small_suite / "tasks" / small_tasks[0].id / "task.json").read_text())
    assert again["base_commit"] == small_tasks[0].base_commit


def test_rebuild_gives_identical_commits(small_tasks, tmp_path):
    from evals.bundled import _write_repo, generate

    gen = generate(per_level=2)[0]
    assert _write_repo(gen, tmp_path / "repo") == small_tasks[0].base_commit


@pytest.mark.parametrize("kind, error", [
    # a "bug" that changes nothing: its target test passes at base, so the task is invalid
    (bundled.Kind("noop", ("def {f}(x):", "    return x  # {f}"), 1, "    return x  # {f}", lambda k: [(1,), (2,)]),
     r"task bundled-l1-000-\w+: target tests pass at the base commit"),
    # two bugs of one kind in a module of that kind only: once one is fixed, the other line repeats
    (bundled.Kind("same", ("def {f}(x):", "    return x + 1"), 1, "    return x - 1", lambda k: [(1,), (2,)]),
     r"task bundled-l3-000-\w+: 100 draws, and each repeats a buggy line"),
], ids=["target-passes-at-base", "buggy-line-repeats"])
def test_invalid_task_fails_the_build_with_its_id(tmp_path, monkeypatch, kind, error):
    monkeypatch.setattr(bundled, "KINDS", (kind,) * 4)
    with pytest.raises(bundled.SuiteBuildError, match=error):
        bundled.build_suite(tmp_path / "out", per_level=1, workers=1)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.building-*"))  # nothing half-written is left


def test_the_first_invalid_task_stops_the_build_without_validating_the_rest(tmp_path, monkeypatch):
    seen = []

    def validate(task, factory):
        seen.append(task.id)
        raise bundled.SuiteBuildError(f"task {task.id}: rejected by the test")

    monkeypatch.setattr(bundled, "validate_task", validate)
    with pytest.raises(bundled.SuiteBuildError, match="rejected by the test"):
        bundled.build_suite(tmp_path / "out", per_level=2, workers=1)
    assert len(seen) <= 2  # one worker: the failing task and at most the one it had started next
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left


def test_a_negative_worker_count_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"build_suite: workers must be >= 0 .* got -1"):
        bundled.build_suite(tmp_path / "out", per_level=1, workers=-1)
    assert list(tmp_path.iterdir()) == []
    assert 1 <= bundled.default_build_workers() <= 32


def test_demonstration_round_trips(small_tasks):
    for task in small_tasks:
        prompt, action_text = demonstration(task)
        assert prompt == render_compact_prompt(task) and prompt.endswith("\n>")
        assert task.metadata["module_file"] + ":" in prompt and "fail: " in prompt
        assert parse_compact(action_text) == reference_actions(task)
        assert action_text.endswith("commit\n") and len(action_text) < 160
        _, by_line = demonstration(task, by_line=True)
        assert parse_compact(by_line) == reference_actions(task, by_line=True)
        assert by_line.startswith(f"replace {task.metadata['module_file']}:")


def test_every_fix_of_the_suite_is_an_edit_of_a_unique_line():
    """The generator draws a task again while a buggy line's text repeats in its module, so each
    reference ``edit`` names its line unambiguously; applying the edits gives the fixed module."""
    from evals.actions import apply_edits
    from evals.bundled import _edits_are_unique
    from evals.harness import replace_once

    gens = bundled.generate()
    assert all(_edits_are_unique(g) for g in gens)
    for g in gens:
        text = fixed = g.files[f"{g.module}.py"]
        for _, lineno, new in g.reference_edits:
            old = text.split("\n")[lineno - 1].strip()
            fixed = replace_once(fixed, old, new.strip())
        assert fixed == apply_edits(text, [(n, t) for _, n, t in g.reference_edits]), g.id


def test_compact_parser():
    edit = parse_compact("edit return x + 2 => return x * 2\ncommit")
    assert [(a.tool, a.args) for a in edit] == [("str_replace", {"old": "return x + 2", "new": "return x * 2"}),
                                                ("commit", {})]
    assert edit[0].to_compact() == "edit return x + 2 => return x * 2"
    assert parse_compact("edit a => b => c")[0].args == {"old": "a", "new": "b => c"}  # the first arrow splits
    actions = parse_compact("reset\nreplace a.py:3     return x * 2\n\ntest\ncommit\nreplace a.py:1 ignored")
    assert [a.tool for a in actions] == ["reset", "replace_line", "test", "commit"]
    assert [a.to_compact() for a in actions] == ["reset", "replace a.py:3     return x * 2", "test", "commit"]
    actions = actions[1:]
    assert actions[0].args == {"path": "a.py", "line": 3, "text": "    return x * 2"}
    assert parse_compact("replace a.py:2")[0].args["text"] == ""
    with pytest.raises(ActionParseError, match="line 2: 'rm -rf /' is not an action") as info:
        parse_compact("replace a.py:1 x\nrm -rf /")
    assert len(info.value.actions) == 1
    with pytest.raises(ActionParseError, match="no action"):
        parse_compact("\n\n")


def test_the_train_split_is_demonstrations_for_the_base_model_and_rl_tasks_for_the_rest(small_suite, small_tasks):
    """The base model learns from the demonstration tasks only, and the RL loop draws from the rest
    of the train split; a task a source does not mark belongs to both (any non-bundled source)."""
    import dataclasses

    from evals.tasks import demonstration_tasks, rl_tasks
    from training.demonstrations import demonstrations
    from training.episodes import training_tasks

    demos, rl = demonstration_tasks(small_tasks), rl_tasks(small_tasks)
    assert [t.id for t in demos] == [t.id for t in small_tasks if t.metadata["demonstration"]] and len(demos) == 3
    assert {t.id for t in rl} == {t.id for t in small_tasks if t.split == "train"} - {t.id for t in demos}
    assert sorted(training_tasks(str(small_suite))) == sorted(t.id for t in rl)
    assert len(demonstrations(demos)) == 3
    with pytest.raises(ValueError, match=f"task {rl[0].id}: kept for RL"):
        demonstrations(rl[:1])
    unmarked = [dataclasses.replace(t, metadata={k: v for k, v in t.metadata.items() if k != "demonstration"})
                for t in small_tasks if t.split == "train"]
    assert demonstration_tasks(unmarked) == rl_tasks(unmarked) == unmarked
