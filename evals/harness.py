"""The agent harness: one *episode* of a model acting on a task in a sandbox until it commits.

The episode API (what training's producer and :func:`evals.evaluate.evaluate` call)::

    trajectory = run_episode(
        task,                      # evals.tasks.Task
        model,                     # ModelClient: serving.client.EngineClient(url), or InProcessClient(engine)
        tokenizer,                 # a Hugging Face tokenizer (text is encoded as text: serving.chat_template)
        sandbox_factory,           # evals.sandbox.SandboxFactory: task -> context manager of an EpisodeSandbox
        adapter_version="step_000004",   # LoRA adapter name sent as lora_path (None: base model)
        session_id="run-a/task/3",       # sent as rid, so the serving side's capture is keyed by it
        action_format="compact",   # or "json" (tool calls for real models)
        max_turns=4, max_new_tokens=64, temperature=1.0,
    )
    trajectory.reward              # 1.0 / 0.0 from grading the committed work (None: not graded)
    trajectory.calls               # every model call: input_ids, output_ids, output_logprobs, meta
    trajectory.steps               # every action, its observation and how long it took

How a turn goes: the context so far (the prompt from :mod:`evals.actions`, then each answer and its
observations) is tokenized and sent with ``return_logprob`` to the model; the answer's
``output_ids`` are decoded and parsed into actions, which run in the sandbox; their results are
appended as the next observation. The prompt and the observations are data (the task's text from its
repository, what the agent's commands printed): they are encoded as text, so a special token's string
in them (``<|im_end|>``, ``<|endoftext|>``) reaches the model as the characters it is, never as the
control token; only the markers the action format writes itself (the JSON format's ChatML turns) are
special ids (:func:`prompt_ids`, :func:`observation_ids`). The sandbox is opened at the first action
(an agent that never acts costs no sandbox; its committed patch is empty). The episode ends when the agent commits, or at ``max_turns``, the
time limit, or the context limit. Then the committed work (``git diff BASE HEAD``) is graded in a
fresh sandbox (:func:`evals.grading.grade_patch`); uncommitted edits are never graded. Token ids and
logprobs are the ones the serving side returned for the call, never re-tokenized text: the context of
turn ``t+1`` is the exact ``input_ids + output_ids`` of turn ``t`` followed by the observation's tokens.

A sandbox failure (:class:`evals.sandbox.InfraError`), or a model server that cannot be reached or
answers 5xx (a router restarting, a replica gone), ends the episode with ``stop_reason
"infra_error"`` and no reward: callers retry such episodes and never count them as failures.

What the agent breaks is its own failed attempt, never an infrastructure error (an agent that could
turn a likely 0 into "not scored" would learn to): an edit of a path inside ``.git`` is refused (an
error observation); a repository the agent's commands broke (:class:`evals.sandbox.AgentFault` from
reading the committed patch) ends the episode as ``agent_broke_repo``. Once an agent's command
(``bash``, ``test``, ``commit``, ``reset``: :data:`AGENT_COMMANDS`) has run in the episode's sandbox,
what it started may run on there, so a failure of that sandbox for a reason inside it, during any
later action or while the committed patch is read (:class:`evals.sandbox.SandboxBroken`: its
wall-time, memory or process limit reached, its runtime or gVisor's kernel ending by itself, its
daemon starved at its own CPU or memory limit; :func:`agent_exhaustion`), ends the episode with
``stop_reason`` set to the fault's label (:data:`evals.sandbox.AGENT_LABELS`: ``agent_pids_limit``,
``agent_memory_limit``, ``agent_wall_time``, ``agent_broke_sandbox``, ...) and a grade of status
``agent_fault`` with zero scores, the evidence (the runtime's exit status, what its cgroup counted)
in ``error`` and the grade's detail. A sandbox that could not start (image missing, runtime
failing), one killed from the host, and any failure before the agent's first command stay
infrastructure errors.

Other agent loops (mini-swe-agent: :mod:`evals.scaffolds`) are :class:`Scaffold` s: they talk to the
model through the OpenAI chat API and are graded by the same :func:`grade_committed`; the trainer
config key ``scaffold`` and ``posttrain eval --scaffold`` pick one (:data:`SCAFFOLD_NAMES`,
``builtin`` by default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import posixpath
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from evals.actions import Action, ActionParseError, apply_edits, failing_summary, observation, parse_actions, render_prompt
from evals.grading import AGENT_FAULT, INFRA_ERROR, GradeResult, committed_patch, edited_patch, grade_patch, zero_scores
from evals.sandbox import AGENT_LABELS, AgentFault, EpisodeSandbox, InfraError, SandboxBroken, SandboxFactory
from evals.tasks import Task
from serving.chat_template import TemplateText
from serving.client import EngineClient as HttpClient  # the HTTP ModelClient (replica, sidecar or router)
from serving.client import EngineError
from serving.protocol import GenerateRequest, parse_sampling_params

__all__ = ["HttpClient", "InProcessClient", "ModelCall", "ModelClient", "SCAFFOLD_NAMES", "Scaffold", "Step",
           "Trajectory", "check_scaffold", "fail_attempt", "grade_committed", "run_episode"]

OBSERVATION_CAP_CHARS = 2000
# stop reasons of an attempt the agent itself ended by breaking its sandbox (scored 0, never retried);
# the others are evals.sandbox.AGENT_LABELS
AGENT_BROKE_SANDBOX = AGENT_LABELS["runtime_exited"]
EDIT_TOOLS = ("str_replace", "replace_line", "write_file")
# actions that run code the agent wrote or controls (its commands, its tests, git hooks it may have left)
AGENT_COMMANDS = ("bash", "test", "commit", "reset")


class ModelClient(Protocol):
    """SGLang's native ``POST /generate``, as :class:`serving.client.EngineClient` calls it: the
    response dict holds ``output_ids`` and ``meta_info`` (with ``output_token_logprobs``)."""

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                 return_logprob: bool = False, lora_path: str | None = None, rid: str | None = None) -> dict[str, Any]: ...


class Tokenizer(Protocol):
    """A Hugging Face tokenizer (or one without special tokens): prompts and observations are
    encoded through :mod:`serving.chat_template`, which knows its special tokens and splits them."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ModelCall:
    """One call as the serving side answered it."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    meta: dict[str, Any]
    latency_s: float


@dataclass
class Step:
    turn: int
    action: dict[str, Any]
    observation: str
    duration_s: float


@dataclass
class Trajectory:
    """Everything an episode did; ``grade`` holds the grading of its committed work."""

    task_id: str
    session_id: str
    adapter_version: str | None
    action_format: str
    calls: list[ModelCall] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)  # a scaffold's own messages (inspection only)
    committed: bool = False
    stop_reason: str = ""
    patch: str = ""
    grade: GradeResult | None = None
    error: str = ""
    started_at: float = 0.0
    agent_s: float = 0.0
    grade_s: float = 0.0

    @property
    def reward(self) -> float | None:
        """1.0 / 0.0 once graded (``apply_failed`` is 0.0); None for infra errors and ungraded episodes."""
        if self.grade is None or self.grade.scores is None:
            return None
        return self.grade.scores.reward

    @property
    def infra_error(self) -> bool:
        return self.stop_reason == INFRA_ERROR or (self.grade is not None and self.grade.status == INFRA_ERROR)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["reward"] = self.reward
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)


def prompt_ids(tokenizer: Tokenizer, task: Task, action_format: str) -> list[int]:
    """The first context of an episode: the prompt of ``task`` in ``action_format``, its format's own
    markers as special ids and everything the task carries (instruction, files, failing output: text
    from its repository) as text."""
    text = TemplateText(tokenizer)
    hidden = {f.name: text.hide(getattr(task, f.name)) for f in dataclasses.fields(task)}
    changed = {name: value for name, value in hidden.items() if value != getattr(task, name)}
    return text.encode(render_prompt(dataclasses.replace(task, **changed) if changed else task, action_format))


def observation_ids(tokenizer: Tokenizer, results: list[str], action_format: str) -> list[int]:
    """The tokens appended after a turn: the results of its actions (what the sandbox printed, the
    agent's own text quoted back) as text, inside the format's own markers."""
    text = TemplateText(tokenizer)
    return text.encode(observation(text.hide(list(results)), action_format))


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The answer's text without special tokens (an end-of-sequence token is not part of an action)."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[call-arg]
    except TypeError:
        return tokenizer.decode(ids)


def execute(action: Action, task: Task, sandbox: EpisodeSandbox, *, timeout_s: float = 60.0,
            written: dict[str, bytes] | None = None) -> tuple[str, bool]:
    """Run one action in the sandbox; return ``(observation, committed)``.

    Mistakes of the agent (a line out of range, a missing file) become the observation; a sandbox
    failure raises :class:`InfraError`. ``written`` (path to content) records each file an edit wrote.
    """
    args = action.args
    try:
        if action.tool in EDIT_TOOLS:
            path = str(args["path"]) if "path" in args else _the_editable_file(task)
            if inside_git(path):
                return f"error: {path} is inside .git, which edits may not change (edit the work tree, then commit)", False
            if action.tool == "str_replace":
                data = replace_once(sandbox.read_file(path).decode(), str(args["old"]), str(args["new"]), path).encode()
            elif action.tool == "replace_line":
                data = apply_edits(sandbox.read_file(path).decode(), [(int(args["line"]), str(args["text"]))]).encode()
            else:
                data = str(args["content"]).encode()
            sandbox.write_file(path, data)
            if written is not None:
                written[path] = data
            return "ok", False
        if action.tool == "read_file":
            return sandbox.read_file(str(args["path"])).decode(errors="replace")[:OBSERVATION_CAP_CHARS], False
        if action.tool == "bash":
            res = sandbox.exec(str(args["command"]), timeout_s=timeout_s, output_cap_bytes=OBSERVATION_CAP_CHARS * 4)
            tail = res.output[-OBSERVATION_CAP_CHARS:]
            return f"exit {res.exit_code}{' (timed out)' if res.timed_out else ''}\n{tail}", False
        if action.tool == "test":
            res = sandbox.exec(task.test_command, timeout_s=task.limits.test_timeout_s)
            if res.exit_code == 0:
                return "all tests pass", False
            summary = ""
            if task.report_format == "junit":  # pytest: the failing asserts, else its error lines
                summary = failing_summary(res.output) or error_lines(res.output)
            return (summary or res.output[-OBSERVATION_CAP_CHARS:]).replace("AssertionError: ", ""), False
        if action.tool == "reset":
            res = sandbox.exec("git checkout -q -- . && git clean -fdq", timeout_s=60)
            if res.exit_code != 0:
                return f"reset failed: {res.output[-300:]}", False
            if written is not None:
                written.clear()  # the tree is the base commit's again
            return "ok", False
        if action.tool == "commit":
            message = str(args.get("message") or "agent commit").replace("'", "")
            # no `git maintenance run --auto` process after the commit: an episode's repository is
            # thrown away with its sandbox, and that process was one more start a commit
            res = sandbox.exec(f"git add -A && git -c maintenance.auto=false commit -q -m '{message}'", timeout_s=60)
            if res.exit_code != 0 and "nothing to commit" in res.output:
                return "nothing to commit", True
            return ("committed" if res.exit_code == 0 else f"commit failed: {res.output[-300:]}"), True
    except InfraError:
        raise
    except (ValueError, KeyError, FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        return f"error: {exc}", False
    return f"error: unknown tool {action.tool!r}", False


def inside_git(path: str) -> bool:
    """True when ``path`` (relative to the repository folder, or absolute) names ``.git`` or a file in
    it, however it is spelled (``./.git/HEAD``, ``src/../.git/config``)."""
    return ".git" in posixpath.normpath(path.replace("\\", "/")).split("/")


def agent_exhaustion(sandbox: EpisodeSandbox, error: BaseException | None = None) -> tuple[str, str] | None:
    """``(label, evidence)`` when the sandbox failed for a reason inside it, else None (an
    infrastructure failure). The caller decides whether that makes it the agent's: it is when the
    agent's own code has run in that sandbox.

    ``error`` is the failure the sandbox raised: a :class:`evals.sandbox.SandboxBroken` carries its
    label and evidence (:meth:`sandboxes.runtimes.Sandbox.end_cause`: the wall-time limit; an OOM
    kill at the memory limit; forks refused at the process limit; the runtime exiting by itself;
    the daemon starved at its own limits); any other :class:`InfraError` was judged outside (killed
    from the host, closed) and is None. Without ``error`` (a caller holding only the sandbox) the
    sandbox is asked again (``end_cause``), where it can say.
    """
    if isinstance(error, SandboxBroken):
        return error.label, error.evidence
    if error is not None:
        return None
    box = getattr(sandbox, "sandbox", sandbox)
    end_cause = getattr(box, "end_cause", None)
    end = end_cause() if callable(end_cause) else None
    if end is None or not end.inside:
        return None
    return AGENT_LABELS.get(end.cause, AGENT_BROKE_SANDBOX), end.evidence


def _agent_ended(box: EpisodeSandbox, exc: InfraError, agent_ran: bool) -> "_AgentEnded | None":
    """The agent's end of the episode when ``exc`` (a failure of ``box``) came from inside a
    sandbox where the agent's code has run, else None."""
    ended = agent_exhaustion(box, exc) if agent_ran else None
    if ended is None:
        return None
    return _AgentEnded(ended[0], str(exc) if ended[1] in str(exc) else f"{exc}; {ended[1]}")


class _AgentEnded(Exception):
    """The agent's own doing ended the episode: ``label`` is its stop reason."""

    def __init__(self, label: str, detail: str) -> None:
        super().__init__(detail)
        self.label = label


class HostEdits:
    """An episode's edits of its task's one editable file, kept on the host until the episode needs a
    sandbox: an episode that only edits and commits (no ``test`` whose observation is not known
    yet, no ``reset``) runs no code of the agent's, so it needs none. Its edits are data: the
    file's text at the base commit (read from the task's repository on the host, which the sandbox
    would copy) with the agent's edit applied by the same functions (:func:`execute`), and its
    commit's patch is the one a commit in a sandbox gives, made by the same ``git diff``
    (:func:`evals.grading.edited_patch`). The episode's sandbox and its commands (the commit, the
    grader's reading of the patch: ten processes and a sandbox start and stop) are left out; the
    grading still runs in a fresh sandbox of its own. The first action that needs a sandbox opens
    it, and the edits kept so far are written there first.

    Only the compact format's ``edit``/``replace`` of the file and its ``commit`` are taken, for a
    task whose base commit is a full id and whose repository is a local folder holding that file."""

    def __init__(self, task: Task, path: str, base: bytes) -> None:
        self.task, self.path, self.base, self.text = task, path, base, base

    @classmethod
    def of(cls, task: Task) -> "HostEdits | None":
        if not (task.repo_path and _FULL_COMMIT.fullmatch(task.base_commit or "")):
            return None
        try:
            path = _the_editable_file(task)
        except ValueError:
            return None
        file = Path(task.repo_path) / path
        if inside_git(path) or posixpath.normpath(path) != path or path.startswith("/") or not file.is_file() \
                or file.is_symlink() or not (Path(task.repo_path) / ".git").is_dir():
            return None
        return cls(task, path, file.read_bytes())

    def takes(self, action: Action, task: Task) -> bool:
        """Whether ``action`` is one this keeps on the host: an edit of the file, or a commit."""
        if action.tool == "commit":
            return not action.args.get("message")
        if action.tool == "str_replace":
            return str(action.args.get("path", self.path)) == self.path
        return action.tool == "replace_line" and str(action.args.get("path")) == self.path

    def read_file(self, path: str) -> bytes:
        return self.text  # only the file that :meth:`takes` names reaches here

    def write_file(self, path: str, data: bytes) -> None:
        self.text = data

    def patch(self, written: dict[str, bytes]) -> str:
        """The patch a commit of ``written`` gives (empty when it is the base's text)."""
        if all(data == self.base for data in written.values()):
            return ""
        return edited_patch(self.task.repo_path, self.task.base_commit, written)


_FULL_COMMIT = re.compile(r"[0-9a-f]{40}")


def _the_editable_file(task: Task) -> str:
    """The file an edit without a path changes: the task's one editable file (the one the compact
    prompt shows)."""
    files = [p for p in task.editable_paths if p and not p.endswith("/")] or [task.metadata.get("module_file")]
    if len(files) != 1 or not files[0]:
        raise ValueError(f"name the file: task {task.id} has {len(files)} editable paths")
    return str(files[0])


def replace_once(text: str, old: str, new: str, path: str = "the file") -> str:
    """``text`` with its one occurrence of ``old`` replaced by ``new``; zero or several occurrences
    raise ``ValueError`` saying which (the agent's observation). When ``old`` is not found but a line
    of ``text`` is close to it (:func:`closest_line`), the error quotes that line, as an editor's
    "did you mean" would: most missed edits miscopy one constant or operator of the line they mean."""
    if not old:
        raise ValueError("the text to replace is empty")
    found = text.count(old)
    if found == 0 and (near := closest_line(text, old)) is not None:
        raise ValueError(f"{old!r} occurs 0 times in {path}; closest line: {near!r}")
    if found != 1:
        raise ValueError(f"{old!r} occurs {found} times in {path}; give text that occurs once")
    return text.replace(old, new)


def closest_line(text: str, old: str, min_ratio: float = 0.75) -> str | None:
    """The line of ``text`` (without indentation) most similar to ``old`` when their similarity
    (``difflib``'s ratio) is at least ``min_ratio``, else ``None``; the first of equals wins."""
    target = old.strip()
    best, best_ratio = None, 0.0
    for line in (raw.strip() for raw in text.splitlines()):
        if not line:
            continue
        matcher = difflib.SequenceMatcher(None, target, line, autojunk=False)
        floor = max(best_ratio, min_ratio)
        if matcher.real_quick_ratio() < floor or matcher.quick_ratio() < floor:
            continue  # upper bounds of the ratio: this line cannot win
        ratio = matcher.ratio()
        if ratio > best_ratio and ratio >= min_ratio:
            best, best_ratio = line, ratio
    return best


def error_lines(test_output: str, max_lines: int = 6) -> str:
    """pytest's ``E`` lines (a syntax error while collecting, an exception), the last ``max_lines``."""
    lines = [line[1:].strip() for line in test_output.splitlines() if line.startswith("E ")]
    return "\n".join([line for line in lines if line][-max_lines:])


def _tree_digest(written: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(written):
        h.update(f"{path}\0{len(written[path])}\0".encode())
        h.update(written[path])
    return h.hexdigest()


def model_context_tokens(base_model: str | Path) -> int | None:
    """The context length of a Hugging Face model folder (``max_position_embeddings``), or None."""
    try:
        config = json.loads((Path(base_model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def episode_context(base_model: str | Path) -> dict[str, int]:
    """:func:`run_episode`'s ``max_context_tokens`` for episodes of ``base_model``: its own context,
    so that an episode that outgrows it stops (``stop_reason="context"``, its committed work graded)
    instead of the engine refusing the call, which would make it an infrastructure error the agent
    could provoke to leave a failing attempt unscored. Empty when the folder does not say."""
    context = model_context_tokens(base_model)
    return {"max_context_tokens": context} if context is not None else {}


def run_episode(
    task: Task,
    model: ModelClient,
    tokenizer: Tokenizer,
    sandbox_factory: SandboxFactory,
    *,
    adapter_version: str | None = None,
    session_id: str | None = None,
    action_format: str = "compact",
    max_turns: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    max_context_tokens: int = 4096,
    time_limit_s: float | None = None,
    stop_token_ids: tuple[int, ...] = (),
    grade: bool = True,
    grader_factory: SandboxFactory | None = None,
    grade_cache: dict | None = None,
) -> Trajectory:
    """Run one episode of ``task`` and grade its committed work; see the module docstring.

    ``seed`` (with ``turn`` added per call) makes sampling reproducible where the engine supports
    it. ``grader_factory`` opens the pristine grading sandbox (default: ``sandbox_factory``).
    ``grade_cache`` (a dict shared between episodes) reuses the grading of an identical patch of the
    same task, and the ``test`` observation of an identical work tree (one that only the episode's
    edits changed); use it only for tasks whose tests are deterministic (the bundled suite's are).
    """
    session_id = session_id or f"{task.id}/{uuid.uuid4().hex[:12]}"
    traj = Trajectory(task.id, session_id, adapter_version, action_format, started_at=time.time())
    deadline = time.monotonic() + (time_limit_s if time_limit_s is not None else task.limits.agent_timeout_s)
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            opened: list[EpisodeSandbox] = []

            def sandbox() -> EpisodeSandbox:
                # Opened at the first action that needs it (not an edit kept on the host): an agent
                # that never acts, or only edits and commits, has nothing to run there.
                if not opened:
                    opened.append(stack.enter_context(sandbox_factory(task)))
                    for path, data in (written or {}).items():  # the edits kept on the host so far
                        opened[0].write_file(path, data)
                return opened[0]

            context_ids = prompt_ids(tokenizer, task, action_format)
            written: dict[str, bytes] | None = {}  # what the edits wrote, while nothing else changed the tree
            host = HostEdits.of(task) if action_format == "compact" else None
            host_patch: str | None = None  # the patch of a commit made on the host
            agent_ran = False  # an agent's command has run in the sandbox: what it started may still run
            for turn in range(max_turns):
                if time.monotonic() > deadline:
                    traj.stop_reason = "time_limit"
                    break
                if len(context_ids) + max_new_tokens > max_context_tokens:
                    traj.stop_reason = "context"
                    break
                params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
                if stop_token_ids:
                    params["stop_token_ids"] = list(stop_token_ids)
                if seed is not None:
                    params["sampling_seed"] = seed + turn
                t0 = time.monotonic()
                try:
                    response = model.generate(list(context_ids), params, return_logprob=True,
                                              lora_path=adapter_version, rid=session_id)
                except OSError as exc:  # the router or replica is gone (restarting): not the model's failure
                    raise InfraError(f"model server unreachable: {exc}") from exc
                except EngineError as exc:
                    # The harness built the request, so a refusal is the serving side's too: most often
                    # a replica that does not hold the episode's adapter version (one that joined
                    # after it was published). The episode is retried, then its group dropped; a run
                    # whose calls keep failing stops on its infrastructure-failure limit.
                    raise InfraError(f"model server failed: {exc}") from exc
                output_ids = list(response["output_ids"])
                meta = dict(response.get("meta_info", {}))
                logprobs = [float(entry[0]) for entry in meta.pop("output_token_logprobs", [])]
                text = _decode(tokenizer, output_ids)
                traj.calls.append(ModelCall(list(context_ids), output_ids, logprobs, text, meta, time.monotonic() - t0))
                results = []
                try:
                    actions = parse_actions(text, action_format)
                    parse_error = None
                except ActionParseError as exc:
                    actions = list(getattr(exc, "actions", []))
                    parse_error = str(exc)
                for action in actions:
                    s0 = time.monotonic()
                    test_key = None
                    if action.tool == "test" and grade_cache is not None and written is not None:
                        test_key = ("test", task_fingerprint(task), _tree_digest(written))

                    def act() -> tuple[str, bool]:
                        nonlocal agent_ran
                        box = sandbox()
                        agent_ran = agent_ran or action.tool in AGENT_COMMANDS
                        try:
                            return execute(action, task, box, written=written)
                        except InfraError as exc:
                            ended = _agent_ended(box, exc, agent_ran)
                            if ended is None:
                                raise
                            traj.steps.append(Step(turn, asdict(action), f"the sandbox failed: {ended}",
                                                   time.monotonic() - s0))
                            raise ended from exc

                    on_host = host is not None and not opened and written is not None and host.takes(action, task)
                    if on_host and action.tool == "commit":
                        host_patch = host.patch(written)
                        obs, committed = ("committed" if host_patch else "nothing to commit"), True
                    elif on_host:
                        obs, committed = execute(action, task, host, written=written)
                    elif test_key is not None:  # one run of these tests on this tree, whoever asks first
                        obs, committed = cached_once(grade_cache, test_key, lambda: act()[0]), False
                    else:
                        obs, committed = act()
                    if action.tool == "bash":
                        written = None  # the work tree is no longer known from the edits alone
                    traj.steps.append(Step(turn, asdict(action), obs, time.monotonic() - s0))
                    results.append(obs)
                    if committed:
                        traj.committed = True
                        break
                if parse_error and not traj.committed:
                    traj.steps.append(Step(turn, {"tool": "parse_error", "args": {}}, parse_error, 0.0))
                    results.append(f"error: {parse_error}")
                if traj.committed:
                    traj.stop_reason = "commit"
                    break
                context_ids = context_ids + output_ids + observation_ids(tokenizer, results, action_format)
            else:
                traj.stop_reason = "max_turns"
            if grade and host_patch is not None:
                traj.patch = host_patch
            elif grade and opened:
                try:
                    traj.patch = committed_patch(opened[0], task.base_commit or "HEAD")
                except InfraError as exc:  # what the agent's commands left running may have ended the sandbox
                    ended = _agent_ended(opened[0], exc, agent_ran)
                    if ended is None:
                        raise
                    raise ended from exc
    except (AgentFault, _AgentEnded) as exc:  # the agent's failed attempt: scored 0, not retried
        traj.stop_reason = getattr(exc, "label", "") or AGENT_BROKE_SANDBOX
        traj.error = str(exc)
        traj.agent_s = time.monotonic() - started
        if grade:
            fail_attempt(traj, task, str(exc))
        return traj
    except InfraError as exc:
        traj.stop_reason = INFRA_ERROR
        traj.error = str(exc)
        traj.agent_s = time.monotonic() - started
        return traj
    traj.agent_s = time.monotonic() - started
    if grade:
        grade_committed(traj, task, grader_factory or sandbox_factory, grade_cache)
    return traj


def grade_committed(traj: Trajectory, task: Task, grader_factory: SandboxFactory, grade_cache: dict | None = None) -> None:
    """Grade ``traj.patch`` (the committed work, :func:`evals.grading.committed_patch`) in a fresh
    sandbox into ``traj.grade``; with ``grade_cache``, an identical patch of the task is graded once.
    Every scaffold's episode is graded here, the built-in one's included."""
    g0 = time.monotonic()
    if grade_cache is None:
        traj.grade = grade_patch(task, traj.patch, grader_factory)
    else:
        traj.grade = cached_once(grade_cache, grade_key(task, traj.patch),
                                 lambda: grade_patch(task, traj.patch, grader_factory),
                                 keep=lambda grade: grade.status != INFRA_ERROR)
    traj.grade_s = time.monotonic() - g0


_in_flight: dict[tuple[int, Any], threading.Event] = {}
_in_flight_lock = threading.Lock()
_MISSING = object()


def cached_once(cache: dict, key: Any, compute: Callable[[], Any], keep: Callable[[Any], bool] = lambda _: True) -> Any:
    """``cache[key]``, computed by ``compute()`` and stored when ``keep`` allows it, with one
    computation at a time per cache and key: a caller that finds ``key`` being computed by another
    thread waits for that result instead of computing it too.

    A group's episodes run at once on the same task, and many commit the same patch (the fix they
    all learned, the empty patch of those that never commit) at about the same moment: with a
    plain look-up each of them missed the cache and graded the same patch in a sandbox of its own
    (and ran the same tree's tests). Nothing is shared but the computed value, as before: each
    computation still runs in a sandbox of its own. A computation that raises, or whose value is not
    kept (an infrastructure error), leaves the key free: the next waiter computes it itself."""
    flight = (id(cache), key)
    while True:
        with _in_flight_lock:
            value = cache.get(key, _MISSING)  # one look-up: a GradeCache may drop its oldest meanwhile
            if value is not _MISSING:
                return value
            done = _in_flight.get(flight)
            if done is None:
                done = _in_flight[flight] = threading.Event()
                break
        done.wait()
    try:
        value = compute()
        if keep(value):
            cache[key] = value
        return value
    finally:
        with _in_flight_lock:
            del _in_flight[flight]
        done.set()


def task_fingerprint(task: Task) -> str:
    """What decides a grading of ``task`` and its tests' output, as a digest: every field of the task
    (its id, base commit, folder, tests, commands, paths, limits and metadata). A grading cache keyed
    by it and the patch (:func:`grade_key`) holds for whatever task set a process loads: two tasks
    of one id from different suites never share a grade."""
    # each field as JSON, anything else (the limits, a metadata value) by its repr: no deep copy
    fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()


def grade_key(task: Task, patch: str) -> tuple[str, str, str]:
    """The key of ``patch``'s grading of ``task`` in a ``grade_cache``."""
    return ("grade", task_fingerprint(task), hashlib.sha256(patch.encode()).hexdigest())


class GradeCache(dict):
    """A ``grade_cache`` (:func:`run_episode`) of at most ``limit`` entries, the oldest dropped first;
    safe to share between threads."""

    def __init__(self, limit: int = 8192) -> None:
        super().__init__()
        self.limit = limit
        self._lock = threading.Lock()

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            super().__setitem__(key, value)
            while len(self) > self.limit:
                super().__delitem__(next(iter(self)))


_shared_caches: "dict[int, tuple[SandboxFactory, GradeCache]]" = {}
_shared_caches_lock = threading.Lock()
_SHARED_FACTORIES = 4


def shared_grade_cache(grader_factory: SandboxFactory) -> GradeCache:
    """The grading cache of the evaluations that ``grader_factory`` grades in this process: each of
    them used to keep its own, so the demo's evaluations of the base model and of the final
    checkpoint graded again every patch both made (the reference fix of a task both solve, the empty
    patch of an attempt that never commits) and ran the unchanged tree's tests again. A bundled
    task's grading is a function of the task and the patch (the hidden inputs of seed 0, the tests
    deterministic), computed in a fresh sandbox no agent reached; the cache holds its result, never
    anything of a sandbox. Kept per factory (the factory object held with it, so its id is not
    reused while it is kept), for the last few factories."""
    with _shared_caches_lock:
        kept = _shared_caches.get(id(grader_factory))
        if kept is None or kept[0] is not grader_factory:
            kept = (grader_factory, GradeCache())
            _shared_caches[id(grader_factory)] = kept
            while len(_shared_caches) > _SHARED_FACTORIES:
                del _shared_caches[next(iter(_shared_caches))]
        return kept[1]


def fail_attempt(traj: Trajectory, task: Task, detail: str) -> None:
    """Score ``traj`` as the agent's failed attempt (status ``agent_fault``, zero scores): what it
    broke, or a scaffold that crashed; ``detail`` (prefixed with the stop reason) says how."""
    detail = detail if detail.startswith(traj.stop_reason) else f"{traj.stop_reason}: {detail}"
    traj.grade = GradeResult(AGENT_FAULT, zero_scores(task.target_tests, task.existing_tests), detail=detail[:2000])


# --- scaffolds: agent loops other than run_episode ------------------------------------------------

BUILTIN_SCAFFOLD = "builtin"
SCAFFOLD_NAMES = (BUILTIN_SCAFFOLD, "mini-swe-agent")  # evals.scaffolds.SCAFFOLDS implements each
SCAFFOLD_ERROR = "scaffold_error"  # stop reason of an episode whose scaffold raised: a failed attempt


class Scaffold(Protocol):
    """An agent loop that runs one episode of ``task``: it talks to the model through the OpenAI chat
    API at ``chat_url`` (the router's or a replica's ``/v1/chat/completions``) with the episode's
    session id, acts in sandboxes from ``sandbox_factory``, and returns the :class:`Trajectory` with
    its committed work in ``patch``, graded by :func:`grade_committed` as the built-in loop's is.
    The model calls' exact tokens are the replica's capture of the session (``calls`` is filled from
    it). Its infrastructure failures raise nothing: they are ``stop_reason`` ``infra_error``; a
    crash of the scaffold itself is :data:`SCAFFOLD_ERROR`, scored 0, its traceback in ``error``."""

    def __call__(self, task: Task, *, chat_url: str, sandbox_factory: SandboxFactory, adapter_version: str | None,
                 session_id: str, max_turns: int, max_new_tokens: int, temperature: float,
                 time_limit_s: float | None, grade: bool, grader_factory: SandboxFactory | None,
                 grade_cache: dict | None) -> Trajectory: ...


def check_scaffold(name: Any, where: str = "scaffold") -> str:
    """``name`` when it is a scaffold (:data:`SCAFFOLD_NAMES`), else a ``ValueError`` naming ``where``."""
    if name not in SCAFFOLD_NAMES:
        raise ValueError(f"{where} must be one of {', '.join(SCAFFOLD_NAMES)}, got {name!r}")
    return name


class InProcessClient:
    """A :class:`ModelClient` over an engine object in this process (``serving.local_engine.LocalEngine``)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                 return_logprob: bool = False, lora_path: str | None = None, rid: str | None = None) -> dict[str, Any]:
        request = GenerateRequest(list(input_ids), parse_sampling_params(sampling_params or {}), return_logprob,
                                  lora_path, rid)
        return self.engine.generate(request)

