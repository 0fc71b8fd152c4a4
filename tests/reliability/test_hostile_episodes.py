"""Episodes that try to pass the agent's own failure off as the infrastructure's, each once a real
attack: an edit into ``.git`` then a commit, a module that writes into ``.git`` or kills every process
it can see when the tests import it, a command that runs the sandbox out of wall time. Promise
(evals/harness.py, training/episodes.py, training/loop.py): such an attempt is finished and scored 0
with its label, never an infra error that is retried, skipped or that stops the run. The sandboxes are
real (bubblewrap); the policy is scripted (the attack is what is under test, not the model), and the
trainer run is a real trainer process on a tiny random model."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

from evals.harness import run_episode
from tests.reliability.conftest import Scripted, scripted_environment, scripted_trainer_run

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")

KILL_ALL = "import os; [os.kill(int(p), 9) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]"
WRITE_GIT = "open('.git/HEAD', 'w').write('garbage')"


def attacks(task) -> dict[str, str]:
    """Compact answers: ``git-head`` edits ``.git/HEAD``; ``git-at-import`` and ``kill-at-import`` put a
    statement on the module's first line (its first function's body joined onto line 2), then test
    and commit; ``solve`` is the reference fix."""
    from evals.actions import demonstration

    module = task.metadata["module_file"]
    lines = (Path(task.repo_path) / module).read_text().splitlines()
    joined = f"{lines[0]} {lines[1].strip()}"  # "def f(x): return ..." keeps the module valid
    return {
        "git-head": "replace .git/HEAD:1 x\ncommit\n",
        "git-at-import": f"replace {module}:1 {WRITE_GIT}\nreplace {module}:2 {joined}\ntest\ncommit\n",
        "kill-at-import": f"replace {module}:1 {KILL_ALL}\nreplace {module}:2 {joined}\ntest\ncommit\n",
        "solve": demonstration(task)[1],
    }


ORDER = ("git-head", "git-at-import", "kill-at-import", "solve")  # episode i of a group plays ORDER[i]


def hostile_env(cfg, run_dir: Path):
    """The scripted attacks of :data:`ORDER` as the policy of the trainer's real harness environment."""
    return scripted_environment(cfg, attacks, ORDER)


@pytest.fixture(scope="module")
def suite(rl_suite):
    return rl_suite


@pytest.fixture(scope="module")
def task(suite):
    from evals.tasks import load_bundled, rl_tasks

    return sorted(rl_tasks(load_bundled(suite).tasks), key=lambda t: t.id)[0]


@pytest.fixture(scope="module")
def tokenizer():
    from serving.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _episode(task, tokenizer, name: str, factory=None, action_format="compact"):
    from evals.bundled import default_sandbox_factory

    text = attacks(task)[name] if name in ORDER else name
    model = Scripted(tokenizer, {n: text for n in ORDER}, ORDER)
    return run_episode(task, model, tokenizer, factory or default_sandbox_factory(), session_id="g/0",
                       action_format=action_format, max_turns=2)


def test_edit_inside_git_is_refused_and_the_commit_scores_zero(task, tokenizer):
    traj = _episode(task, tokenizer, "git-head")
    assert traj.steps[0].observation.startswith("error: .git/HEAD is inside .git")
    assert traj.stop_reason == "commit" and not traj.infra_error
    assert traj.reward == 0.0 and traj.grade.status == "graded"
    for spelled in ("./.git/config", "src/../.git/hooks/pre-commit", ".git"):
        traj = _episode(task, tokenizer, f'{{"tool": "write_file", "args": {{"path": "{spelled}", "content": "x"}}}}',
                        action_format="json")
        assert "is inside .git" in traj.steps[0].observation, spelled


def test_module_that_breaks_git_at_import_is_the_agents_failure(task, tokenizer):
    traj = _episode(task, tokenizer, "git-at-import")
    assert traj.stop_reason == "agent_broke_repo" and not traj.infra_error
    assert traj.reward == 0.0 and traj.grade.status == "agent_fault"
    assert ".git/HEAD holds 'garbage'" in traj.grade.detail
    row = json.loads(traj.to_json())
    assert row["stop_reason"] == "agent_broke_repo" and row["reward"] == 0.0


def test_module_that_kills_every_process_at_import_scores_zero(task, tokenizer):
    traj = _episode(task, tokenizer, "kill-at-import")
    assert not traj.infra_error and traj.reward == 0.0
    assert traj.stop_reason in ("commit", "agent_killed_sandbox", "agent_broke_sandbox"), traj.stop_reason


def test_command_that_runs_the_sandbox_out_of_wall_time_is_the_agents_failure(task, tokenizer):
    """A real bwrap sandbox with a 3 s wall-time limit; the agent's command sleeps past it."""
    import sandboxes
    from evals.sandbox import PlatformSandbox

    @contextlib.contextmanager
    def short_lived(t):
        box = sandboxes.start(t.repo_path, runtime="bwrap", limits=sandboxes.Limits(cpus=1, memory_mib=256, wall_s=3))
        with box:
            yield PlatformSandbox(box)

    traj = _episode(task, tokenizer, '{"tool": "bash", "args": {"command": "sleep 60"}}', factory=short_lived,
                    action_format="json")
    assert traj.stop_reason == "agent_wall_time" and not traj.infra_error
    assert traj.reward == 0.0 and traj.grade.status == "agent_fault"
    assert "wall-time limit of 3 s" in traj.grade.detail


def test_sandbox_killed_from_the_host_stays_an_infra_error(task, tokenizer):
    """The other side of the line: the runtime SIGKILLed from outside (a lost node) says nothing about
    the agent, so the episode is an infra error as before."""
    from tests.reliability.test_sandbox_faults import killing_factory

    factory, _ = killing_factory(kill_first=1)
    traj = _episode(task, tokenizer, '{"tool": "bash", "args": {"command": "sleep 30"}}', factory=factory,
                    action_format="json")
    assert traj.stop_reason == "infra_error" and traj.reward is None


def test_attacks_inside_a_real_run_are_scored_zero_and_the_run_finishes(tmp_path: Path, suite):
    """A 2-step trainer run whose groups are the four scripted episodes: every attack is a finished
    rollout with reward 0 and its label, the fix earns 1, nothing is lost, the run ends at its last step."""
    run, _, by_play = scripted_trainer_run(tmp_path, suite, "tests.reliability.test_hostile_episodes:hostile_env",
                                           ORDER, reuse_grading=False)
    assert not (run / "logs" / "lost-episodes.jsonl").exists()  # no episode was passed off as infra
    for reward, info in by_play["git-head"]:
        assert reward == 0.0 and info["stop_reason"] == "commit"
    for reward, info in by_play["git-at-import"]:
        assert reward == 0.0 and (info["stop_reason"], info["grade_status"]) == ("agent_broke_repo", "agent_fault")
    for reward, info in by_play["kill-at-import"]:
        assert reward == 0.0 and info["stop_reason"] != "infra_error"
    for reward, info in by_play["solve"]:
        assert reward == 1.0 and info["stop_reason"] == "commit"
