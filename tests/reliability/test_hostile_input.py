"""Input files that are not UTF-8 (or not the format they claim): a run TOML given to ``posttrain
plan | validate | run`` is refused naming the file and saying it must be UTF-8; a Harbor dataset
with a task whose task.toml, instruction.md or tests/config.json cannot be decoded or parsed lists
that task as incomplete with a reason naming the file, and the other tasks load. Through the real
CLI entry (``dagster_project.cli.main``). Promise: DESIGN "Errors"; training/planner/schema.py
(``load_run_file``); evals/tasks.py (``load_harbor``). Text-level malformations of these files are
tests/reliability/test_bad_input.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dagster_project.cli import main

LATIN1 = "Café Ünïcödé".encode("latin-1")  # valid Latin-1, never valid UTF-8 (é is 0xE9 alone)


@pytest.mark.parametrize("command", [["plan"], ["validate"], ["run", "--dry-run"]])
def test_a_run_toml_that_is_not_utf8_is_refused_naming_the_file(tmp_path, capsys, command):
    from training.planner.cli import EXIT_INVALID

    path = tmp_path / "latin1-run.toml"
    path.write_bytes(b'[run]\nname = "' + LATIN1 + b'"\n')
    assert main([*command, str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"{path}: not UTF-8 text" in err and "must be UTF-8" in err, err


def _task(root: Path, name: str, *, toml: bytes | None = None, instruction: bytes | None = None,
          config: bytes | None = None) -> Path:
    """A Harbor task folder as the loader expects it (tests/evals/test_tasks.py's layout), with any
    of its three files replaced by the given bytes."""
    d = root / "tasks" / name
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_bytes(toml if toml is not None else (
        f'[metadata]\ntask_id = "{name}"\nlanguage = "python"\n[environment]\ndocker_image = "img:{name}"\n').encode())
    (d / "instruction.md").write_bytes(instruction if instruction is not None else f"fix {name}".encode())
    (d / "tests" / "config.json").write_bytes(config if config is not None else json.dumps(
        {"f2p_node_ids": ["t1"], "p2p_node_ids": ["t2"], "grade": {"format": "junit"}}).encode())
    return d


def test_harbor_tasks_with_undecodable_or_unparsable_files_are_incomplete_and_the_rest_load(tmp_path, capsys):
    from evals.tasks import load_harbor

    _task(tmp_path, "good-a")
    _task(tmp_path, "good-b", instruction="naïve café ✓".encode())  # UTF-8 beyond ASCII is fine
    bad = {
        "toml-latin1": _task(tmp_path, "toml-latin1", toml=b'[metadata]\ntask_id = "' + LATIN1 + b'"\n'),
        "instruction-latin1": _task(tmp_path, "instruction-latin1", instruction=b"Fix the " + LATIN1),
        "config-not-json": _task(tmp_path, "config-not-json", config=b"f2p_node_ids = [\"t1\"]\n"),
        "config-binary": _task(tmp_path, "config-binary", config=b"\x89PNG\r\n\x1a\n\x00\xff\xfe"),
    }
    expected = {
        "toml-latin1": ("task.toml", "not UTF-8 text"),
        "instruction-latin1": ("instruction.md", "not UTF-8 text"),
        "config-not-json": ("tests/config.json", "not valid JSON"),
        "config-binary": ("tests/config.json", "not UTF-8 text"),
    }

    task_set = load_harbor(tmp_path)
    assert sorted(t.id for t in task_set.tasks) == ["good-a", "good-b"]
    assert task_set.by_id()["good-b"].instruction == "naïve café ✓"
    reasons = {t.id: t.reason for t in task_set.incomplete}
    assert sorted(reasons) == sorted(bad)
    for task_id, (file, what) in expected.items():
        assert f"{bad[task_id] / file}: {what}" in reasons[task_id], reasons[task_id]
    assert next(t for t in task_set.incomplete if t.id == "config-not-json").language == "python"

    assert main(["tasks", "inspect", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tasks"] == 2 and sorted(out["incomplete"]) == sorted(bad)
