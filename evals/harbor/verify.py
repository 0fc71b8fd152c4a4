"""One Harbor attempt: an agent's committed work, then DeepSWE v1.1's verifier flow and posttrain's grade.

Agents (:data:`AGENTS`): ``oracle`` applies ``solution/solution.patch`` and commits it; ``nop``
commits nothing; ``model`` is the built-in harness (:func:`evals.harness.run_episode`) or another
scaffold with a served model (:func:`run_agent`). :func:`verify` runs the task's ``tests/test.sh``
on the committed work in a fresh sandbox and grades the reports it wrote
(:func:`grade_harbor_reports`, through :func:`evals.grading.score`); :class:`HarborVerifier` is the
:class:`~evals.attempts.Verifier` that :func:`evaluate_harbor` runs every attempt through, each row made
by :func:`evals.attempts.attempt_row`. A checkpoint is served for it by
:func:`evals.evaluate.evaluate_checkpoint` (``evaluate_served=evaluate_harbor``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from evals.attempts import (
    AGENT_FAULT, APPLY_FAILED, GRADED, INFRA_ERROR, AgentRun, AttemptRow, Scores, attempt_row, attempt_seed,
    run_attempts,
)
from evals.grading import (
    ReportError, clean_test_ids, committed_patch, load_harbor_config, merge_statuses, parse_ctrf_bytes,
    parse_junit_bytes, score, zero_scores,
)
from evals.harness import run_episode
from evals.sandbox import AgentFault, InfraError, SandboxFactory
from evals.scaffolds import run_scaffold_episode
from evals.signals import parse_patch, patch_signals
from evals.tasks import Task


AGENTS = ("oracle", "nop", "model")
STAGING = ".git/.posttrain-verifier"  # inside the workspace's .git: never part of the work tree
REWARD_FIELDS = ("reward", "f2p_total", "f2p_passed", "p2p_total", "p2p_passed", "f2p", "p2p", "partial")
MAX_REPORT_BYTES = 12 << 20
VERIFIER_DIR = "/logs/verifier"
ENVIRONMENT_BROKEN = "environment_broken_tests"  # task.metadata: existing tests the reference fails here


def _sh_read(sandbox, path: str, cap: int = MAX_REPORT_BYTES) -> bytes | None:
    """A file anywhere in the sandbox (pxd reads only the workspace), or None when it is not a file."""
    result = sandbox.exec(f"test -f {shlex.quote(path)} && base64 -w0 < {shlex.quote(path)}", timeout_s=60,
                          output_cap_bytes=cap * 4 // 3 + 1024)
    if result.exit_code != 0 or result.timed_out:
        return None
    if result.truncated:
        raise ReportError(f"{path}: over {cap} bytes")
    try:
        return base64.b64decode(result.output.strip(), validate=True)
    except ValueError as exc:
        raise ReportError(f"{path}: could not be read back ({exc})") from None


def _stage_files(sandbox, files: dict[str, bytes], dest: str) -> None:
    """Write ``files`` (relative names) to the absolute folder ``dest`` of the sandbox, through the workspace."""
    for rel, data in files.items():
        sandbox.write_file(f"{STAGING}/{rel}", data)
    made = sandbox.exec(f"set -e; mkdir -p {shlex.quote(os.path.dirname(dest))}; rm -rf {shlex.quote(dest)}; "
                        f"mv {STAGING} {shlex.quote(dest)}; chmod -R u+rwX,go+rX {shlex.quote(dest)}", timeout_s=60)
    if made.exit_code != 0:
        raise InfraError(f"staging files to {dest} failed: {made.output[-300:]}")


# ---------------------------------------------------------------- agents


def oracle_patch(task: Task, sandbox) -> str:
    """Apply the task's reference solution in the agent sandbox, commit it as a submission, and
    return the committed patch."""
    path = task.metadata.get("solution_patch")
    if not path:
        raise AgentFault("no_solution", f"task {task.id} has no solution/solution.patch")
    sandbox.write_file(".git/posttrain-solution.patch", Path(path).read_bytes())
    result = sandbox.exec(
        "set -e; git apply --whitespace=nowarn .git/posttrain-solution.patch; rm -f .git/posttrain-solution.patch; "
        "git checkout -q -b feature/solution 2>/dev/null || true; git add -A; "
        "git -c user.name=oracle -c user.email=oracle@local commit -q --no-verify -m 'Apply reference solution'",
        timeout_s=120)
    if result.exit_code != 0:
        raise AgentFault("solution_failed", f"the reference solution did not apply or commit: {result.output[-1000:]}")
    return committed_patch(sandbox, task.base_commit or "HEAD")


def run_agent(task: Task, agent: str, factory: SandboxFactory, *, model=None, tokenizer=None,
              scaffold: str = "builtin", model_url: str | None = None, session_id: str = "",
              **episode_kwargs: Any) -> AgentRun:
    """Run ``agent`` (``oracle``, ``nop`` or ``model``) on ``task`` in a sandbox of ``factory`` and
    return its committed work. ``scaffold`` picks the model's agent loop: ``builtin``
    (:func:`evals.harness.run_episode` with ``model``, a client of the engine API, and its
    ``tokenizer``) or another of :mod:`evals.scaffolds` over the served model at ``model_url``."""
    if agent not in AGENTS:
        raise ValueError(f"agent {agent!r} is not one of {', '.join(AGENTS)}")
    started = time.monotonic()
    if agent == "nop":
        return AgentRun("", "nop", False, agent_s=0.0, session_id=session_id)
    if agent == "oracle":
        with factory(task) as box:
            patch = oracle_patch(task, box)
        return AgentRun(patch, "oracle", True, agent_s=time.monotonic() - started, session_id=session_id)
    if scaffold != "builtin" and model_url is None:
        raise ValueError(f"scaffold {scaffold!r} talks to a served model: give model_url (the router's or a replica's URL)")
    if scaffold == "builtin" and (model is None or tokenizer is None):
        raise ValueError("agent 'model' needs a model client and its tokenizer")
    patches: list[str] = []

    @contextlib.contextmanager
    def capturing(t: Task):
        # the committed work is read before the agent's sandbox closes; the harness does not grade
        with factory(t) as box:
            try:
                yield box
            finally:
                try:
                    patches.append(committed_patch(box, t.base_commit or "HEAD"))
                except (AgentFault, InfraError) as exc:
                    patches.append("")
                    errors.append(str(exc))

    errors: list[str] = []
    if scaffold == "builtin":
        traj = run_episode(task, model, tokenizer, capturing, grade=False, session_id=session_id or None, **episode_kwargs)
    else:  # another agent loop (evals.scaffolds), over the served model's chat API
        traj = run_scaffold_episode(scaffold, task, model_url=model_url, sandbox_factory=capturing, tokenizer=tokenizer,
                                    session_id=session_id or None, grade=False, **episode_kwargs)
    if traj.infra_error:
        raise InfraError(traj.error or "the agent's sandbox failed")
    return AgentRun.of_episode(traj, patches[0] if patches else "", "; ".join(errors))


# ---------------------------------------------------------------- the verifier


@dataclass
class Verification:
    """One run of a task's verifier and posttrain's grade of its reports.

    ``scores`` are posttrain's (None for an infrastructure error); ``task_reward`` is the task's own
    ``reward.json`` when its verifier wrote one; ``agrees`` says whether every field they share is
    equal (None without a reward.json). ``statuses`` are the graded tests' statuses."""

    status: str
    scores: Scores | None
    task_reward: dict | None = None
    agrees: bool | None = None
    disagreements: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    exit_code: int | None = None
    output: str = ""
    verifier_s: float = 0.0
    signals: tuple = ()
    reports: dict = field(default_factory=dict)

    @property
    def detail(self) -> str:
        return "; ".join(self.notes)

    def to_json(self) -> dict:
        data = asdict(self)
        data["scores"] = self.scores.to_dict() if self.scores is not None else None
        data.pop("reports")
        return data


def _task_config(task: Task) -> dict:
    return load_harbor_config(Path(task.metadata["tests_dir"]) / "config.json")


def compare_reward(task_reward: dict, scores: Scores) -> dict:
    """The fields of ``reward.json`` whose value differs from posttrain's: ``{field: [task's, posttrain's]}``."""
    ours = scores.to_dict()
    out = {}
    for key in REWARD_FIELDS:
        if key not in task_reward:
            continue
        theirs, mine = task_reward[key], ours[key]
        if not isinstance(theirs, (int, float)) or abs(float(theirs) - float(mine)) > 1e-9:
            out[key] = [theirs, mine]
    return out


def grade_harbor_reports(task: Task, reports: dict[str, bytes | None], config: dict | None = None) -> tuple[Scores, dict, list]:
    """posttrain's grade of a verifier's reports (``{path: content or None}``), with the notes of
    reports that were missing or malformed (their tests count as failed). Strict credit spares the
    existing tests of ``task.metadata["environment_broken_tests"]`` (:func:`with_environment_records`)."""
    config = config or _task_config(task)
    grade = config["grade"]
    parsed, notes = [], []
    for path in grade.get("reports", []):
        data = reports.get(path)
        if data is None:
            notes.append(f"report missing: {path}; its tests count as failed")
            continue
        try:
            if grade["format"] == "junit":
                parsed.append(parse_junit_bytes(data, path))
            else:
                parsed.append(parse_ctrf_bytes(data, path, grade.get("node_id", "name")))
        except ReportError as exc:
            notes.append(f"{exc}; its tests count as failed")
    statuses = merge_statuses(parsed)
    scores = score(config["f2p_node_ids"], config["p2p_node_ids"], statuses,
                   environment_broken=task.metadata.get(ENVIRONMENT_BROKEN, ()))
    wanted = set(clean_test_ids(config["f2p_node_ids"])) | set(clean_test_ids(config["p2p_node_ids"]))
    return scores, {k: v.name.lower() for k, v in statuses.items() if k in wanted}, notes


def _verify_once(task: Task, patch: str, factory: SandboxFactory, config: dict) -> Verification:
    tests_dir = Path(task.metadata["tests_dir"])
    files = {rel: (tests_dir / rel).read_bytes() for rel in task.metadata.get("test_files", ())}
    started = time.monotonic()
    with factory(task) as box:
        _stage_files(box, files, "/tmp/harbor/tests")
        _stage_files(box, {"model.patch": patch.encode()} if patch.strip() else {".keep": b""}, "/tmp/harbor/logs/artifacts")
        made = box.exec("mkdir -p /tmp/harbor/logs/verifier && rm -f /tmp/harbor/logs/artifacts/.keep", timeout_s=30)
        if made.exit_code != 0:
            raise InfraError(f"making /logs/verifier failed: {made.output[-300:]}")
        run = box.exec("bash /tests/test.sh", timeout_s=task.limits.test_timeout_s, output_cap_bytes=1 << 20,
                       kill_others=True)
        # every process the tests started is gone: the files read now are final
        reports: dict[str, bytes | None] = {}
        read_notes = []
        for path in config["grade"].get("reports", []):
            try:
                reports[path] = _sh_read(box, path)
                if reports[path] is None and path.startswith(VERIFIER_DIR + "/"):
                    # DeepSWE's test.sh moves every report under reports/ once it has graded
                    reports[path] = _sh_read(box, f"{VERIFIER_DIR}/reports/{path[len(VERIFIER_DIR) + 1:]}")
            except ReportError as exc:
                reports[path] = None
                read_notes.append(str(exc))
        reward_raw = _sh_read(box, "/logs/verifier/reward.json", 1 << 20)
    scores, statuses, notes = grade_harbor_reports(task, reports, config)
    notes = read_notes + notes
    if run.timed_out:
        notes.insert(0, f"the verifier timed out after {task.limits.test_timeout_s:g} s")
    task_reward = None
    if reward_raw is not None:
        try:
            task_reward = json.loads(reward_raw)
            if not isinstance(task_reward, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            notes.append(f"the task's reward.json is not a JSON object ({exc})")
            task_reward = None
    status = GRADED
    if task_reward is not None and task_reward.get("apply_failed"):
        status = APPLY_FAILED
    disagreements = compare_reward(task_reward, scores) if task_reward is not None else {}
    protected = [c.path for c in parse_patch(files.get("test.patch", b"").decode("utf-8", "replace"))]
    return Verification(status, scores, task_reward, None if task_reward is None else not disagreements,
                        disagreements, statuses, notes, run.exit_code, run.output[-4000:],
                        time.monotonic() - started, tuple(sorted(patch_signals(patch, protected))), reports)


def verify(task: Task, patch: str, factory: SandboxFactory, *, infra_retries: int = 1) -> Verification:
    """Run the task's verifier on ``patch`` in a fresh sandbox and grade its reports (see the module
    docstring). A sandbox failure is retried ``infra_retries`` times, then returned as
    ``infra_error`` with no scores (such an attempt is never counted)."""
    config = _task_config(task)
    errors = []
    for attempt in range(infra_retries + 1):
        try:
            return _verify_once(task, patch, factory, config)
        except (InfraError, OSError) as exc:
            errors.append(f"try {attempt + 1}: {type(exc).__name__}: {exc}")
    return Verification(INFRA_ERROR, None, notes=errors)


# ---------------------------------------------------------------- attempts and rows


def run_attempt(task: Task, agent: str, factory: SandboxFactory, *, infra_retries: int = 1,
                **agent_kwargs: Any) -> tuple[AgentRun | None, Verification]:
    """One attempt: the agent, then the verifier on its committed work. An agent that broke its
    repository scores 0 (``agent_fault``); an infrastructure failure that persists is ``infra_error``."""
    errors = []
    for _ in range(infra_retries + 1):
        try:
            run = run_agent(task, agent, factory, **agent_kwargs)
            break
        except AgentFault as exc:
            zero = zero_scores(task.target_tests, task.existing_tests)
            return AgentRun("", exc.label, error=str(exc)), Verification(AGENT_FAULT, zero, notes=[str(exc)])
        except (InfraError, OSError) as exc:
            errors.append(str(exc))
    else:
        return None, Verification(INFRA_ERROR, None, notes=errors)
    return run, verify(task, run.patch, factory, infra_retries=infra_retries)


@dataclass
class HarborVerifier:
    """The :class:`~evals.attempts.Verifier` of Harbor tasks: ``agent`` (``oracle``, ``nop`` or
    ``model``) in the task's image, then DeepSWE v1.1's verifier flow on its committed work
    (:func:`run_attempt`). ``agent_kwargs`` go to :func:`run_agent` for the ``model`` agent (its
    client, tokenizer, scaffold, episode keywords); with ``seed`` each attempt samples differently,
    reproducibly. With ``record_dir`` each attempt's verification is written to
    ``record_dir/<task>/<attempt>/`` (:func:`record_verification`)."""

    factory: SandboxFactory
    agent: str = "model"
    checkpoint: str = ""
    adapter_version: str | None = None
    infra_retries: int = 1
    seed: int | None = None
    record_dir: str | Path | None = None
    log: Callable[[str], None] | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)

    def attempt(self, task: Task, task_index: int, attempt: int) -> AttemptRow:
        kwargs: dict[str, Any] = {}
        if self.agent == "model":
            kwargs = {"session_id": f"{self.checkpoint or self.agent}/{task.id}/{attempt}", **self.agent_kwargs}
            kwargs.setdefault("adapter_version", self.adapter_version)
            if self.seed is not None:
                kwargs["seed"] = attempt_seed(int(self.seed), task_index, attempt)
        run, result = run_attempt(task, self.agent, self.factory, infra_retries=self.infra_retries, **kwargs)
        if self.record_dir is not None:
            record_verification(Path(self.record_dir) / task.id / str(attempt), result)
        if self.log is not None:
            reward = result.scores.reward if result.scores is not None else None
            self.log(f"{task.id} attempt {attempt}: {result.status} reward {reward} (verifier {result.verifier_s:.1f} s)")
        # A Harbor attempt records no transcript: the viewer's columns stay empty.
        return attempt_row(task, attempt, run, checkpoint=self.checkpoint or self.agent,
                           adapter_version=self.adapter_version, status=result.status, scores=result.scores,
                           detail=result.detail, grade_s=result.verifier_s, signals=result.signals,
                           infra_retries=len([n for n in result.notes if n.startswith("try ")]))


def evaluate_harbor(tasks: Sequence[Task], sandbox_factory: SandboxFactory, *, agent: str = "model", model=None,
                    tokenizer=None, checkpoint: str = "", adapter_version: str | None = None, attempts: int = 1,
                    workers: int = 1, scaffold: str = "builtin", model_url: str | None = None,
                    record_dir: str | Path | None = None,
                    log: Callable[[str], None] | None = None, **episode_kwargs: Any) -> list[dict[str, Any]]:
    """``attempts`` attempts of ``agent`` on every task, each through DeepSWE's verifier flow; one row
    per attempt (:data:`evals.attempts.ROW_COLUMNS`), in task order: :func:`evals.attempts.run_attempts`
    with a :class:`HarborVerifier`. With ``record_dir`` each attempt's verification is written to
    ``record_dir/<task>/<attempt>/``: ``posttrain-grade.json`` (posttrain's scores, statuses, notes)
    beside the task's own ``reward.json`` when it wrote one. A checkpoint's model is served for it by
    :func:`evals.evaluate.evaluate_checkpoint` (the ``deepswe_eval`` asset on a Harbor dataset); the
    ``model`` agent's ``episode_kwargs`` go to its episodes (``max_turns``, ``max_new_tokens``,
    ``temperature``, ``seed``, ``action_format``, ...)."""
    infra_retries = int(episode_kwargs.pop("infra_retries", 1))
    episode_kwargs.pop("reuse_grading", None)  # every attempt runs its verifier: real tests may be nondeterministic
    seed = episode_kwargs.pop("seed", None)
    verifier = HarborVerifier(
        sandbox_factory, agent, checkpoint, adapter_version, infra_retries=infra_retries, seed=seed,
        record_dir=record_dir, log=log, agent_kwargs=dict(model=model, tokenizer=tokenizer, scaffold=scaffold,
                                                          model_url=model_url, **episode_kwargs))
    return [row.to_row() for row in run_attempts(tasks, verifier, attempts=attempts, workers=workers)]


def record_verification(folder: Path, result: Verification) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if result.task_reward is not None:
        (folder / "reward.json").write_text(json.dumps(result.task_reward) + "\n")
    (folder / "posttrain-grade.json").write_text(json.dumps(result.to_json(), indent=1, default=str) + "\n")
    (folder / "verifier-output.txt").write_text(result.output)
