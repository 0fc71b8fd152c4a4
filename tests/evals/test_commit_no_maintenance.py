"""The ``commit`` action commits and nothing more: git's ``maintenance run --auto`` (which a plain
``git commit`` starts after every commit, a process of its own in the sandbox, and which runs
``gc`` when the repository's thresholds say so) is not started. An episode's repository is thrown
away with its sandbox, so that process was only a cost of every episode that commits.

Real bwrap sandbox: the repository is set to need a ``gc`` (``gc.auto = 1``, two loose objects in
``objects/17``, the folder git samples), so a maintenance run would pack them; after the action
they are still loose and no pack exists."""

from __future__ import annotations

import hashlib
import itertools

from evals.actions import Action
from evals.bundled import default_sandbox_factory
from evals.harness import execute


def blobs_in_folder_17(count: int) -> list[str]:
    """``count`` file contents whose git blob ids start with ``17``."""
    found = []
    for i in itertools.count():
        text = f"loose {i}\n"
        if hashlib.sha1(f"blob {len(text)}\0{text}".encode()).hexdigest().startswith("17"):
            found.append(text)
            if len(found) == count:
                return found
    raise AssertionError("unreachable")


def test_commit_starts_no_git_maintenance(small_tasks):
    task = small_tasks[0]
    module = task.metadata["module_file"]
    with default_sandbox_factory()(task) as box:
        setup = ["git config gc.auto 1", "git config gc.autoDetach false", "git config maintenance.auto true"]
        setup += [f"printf '{text}' | git hash-object -w --stdin" for text in blobs_in_folder_17(2)]
        made = box.exec(" && ".join(setup), timeout_s=60)
        assert made.exit_code == 0, made.output
        assert len(box.exec("ls .git/objects/17", timeout_s=30).output.split()) >= 2
        box.write_file(module, box.read_file(module) + b"\n# edited\n")
        observation, committed = execute(Action("commit", {"message": "fix"}), task, box)
        assert (observation, committed) == ("committed", True)
        packs = box.exec("ls .git/objects/pack; ls .git/objects/17", timeout_s=30).output.split()
        assert not [name for name in packs if name.endswith(".pack")], packs
        assert len([name for name in packs if len(name) == 38]) >= 2  # still loose
