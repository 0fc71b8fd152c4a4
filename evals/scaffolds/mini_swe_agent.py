"""mini-swe-agent (PyPI ``mini-swe-agent``, 2.4) as a posttrain scaffold.

mini-swe-agent's own agent loop (``minisweagent.agents.default.DefaultAgent``) and its LiteLLM model
(``LitellmModel``: the OpenAI chat API with one ``bash`` tool) run unchanged; posttrain supplies:

- :class:`SandboxEnvironment`, its environment: each ``bash`` action runs in the task's posttrain
  sandbox through pxd (:class:`evals.sandbox.PlatformSandbox`), in the repository folder, with the
  built-in harness's output cap and the task's time limit;
- :func:`chat_model`, its model: LiteLLM's OpenAI provider pointed at the router's (or a replica's)
  ``/v1/chat/completions`` with the episode's session id in ``X-Session-Id``, its key in
  ``X-Session-Key`` (made from this process's trainer credential, :mod:`serving.capture_store`: no
  other caller can read or add to the session) and the adapter version as the model name, so the
  replica captures every call's exact tokens under the episode's session;
- the templates: the task's instruction, and how to finish (``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``).

When the agent submits, its work tree is committed with the built-in harness's ``commit`` action;
the committed work (``git diff BASE HEAD``, :func:`evals.grading.committed_patch`) is graded by
:func:`evals.harness.grade_committed`, exactly as a built-in episode's. An agent that stops without
submitting is graded on what it committed itself (usually nothing).

Failures: a sandbox or model server that fails is ``infra_error`` (retried by the trainer, never
scored); a sandbox the agent's own command took down is its fault (0, as in the built-in loop); a
crash of mini-swe-agent or LiteLLM is ``scaffold_error``, a failed attempt scored 0 with the
traceback in ``Trajectory.error``: never an exception out of the episode.

mini-swe-agent reads a global config folder and LiteLLM a model price list from the network at
import; this module points the first at a private temporary folder and the second at LiteLLM's
bundled copy, and silences the start-up banner; a failed model call is not retried within the episode
(the trainer retries whole episodes); each unless the environment already sets it.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "posttrain-mini-swe-agent"))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # the trainer retries episodes, not calls

import litellm  # noqa: E402
import openai  # noqa: E402  (LiteLLM's client, whose error classes LiteLLM raises)
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

from evals.actions import Action  # noqa: E402
from evals.grading import INFRA_ERROR, committed_patch  # noqa: E402
from evals.harness import (  # noqa: E402
    OBSERVATION_CAP_CHARS, SCAFFOLD_ERROR, ModelCall, Step, Trajectory, agent_exhaustion, execute, fail_attempt,
    grade_committed,
)
from evals.sandbox import AgentFault, EpisodeSandbox, InfraError, SandboxFactory  # noqa: E402
from evals.tasks import Task  # noqa: E402
from serving.capture_store import session_headers  # noqa: E402
from serving.chat import BASE_MODEL  # noqa: E402
from serving.client import EngineClient, EngineError  # noqa: E402

NAME = "mini-swe-agent"
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
COMMAND_TIMEOUT_S = 60.0
SYSTEM_TEMPLATE = ("You are a coding agent working in a git repository. Run shell commands with the bash tool, "
                   "one per call.")
INSTANCE_TEMPLATE = ("{{task}}\n\nFix it in the repository (your working directory). When you are done, run `"
                     + SUBMIT_COMMAND + "` alone: your work tree is then committed and graded by the task's tests.")
# mini-swe-agent's exit statuses as the harness's stop reasons
STOP_REASONS = {"Submitted": "commit", "LimitsExceeded": "max_turns", "TimeExceeded": "time_limit",
                "RepeatedFormatError": "format_errors", "ContextWindowExceededError": "context"}


class SandboxEnvironment:
    """mini-swe-agent's ``Environment`` over a posttrain sandbox (see the module docstring).

    Every action becomes a :class:`evals.harness.Step` in ``steps``. An action that finds the
    sandbox gone raises :class:`AgentFault` when the agent's own command ended it (its memory or
    wall-time limit, processes killed from inside), else :class:`InfraError`."""

    def __init__(self, sandbox: EpisodeSandbox, steps: list[Step], *, deadline: float, timeout_s: float = COMMAND_TIMEOUT_S):
        self.sandbox = sandbox
        self.steps = steps
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.config = {"timeout_s": timeout_s}
        self.turn = 0

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = str(action.get("command", ""))
        remaining = self.deadline - time.monotonic()
        t0 = time.monotonic()
        if remaining <= 0:
            output = {"output": "", "returncode": -1, "exception_info": "the episode's time limit is reached"}
        else:
            try:
                res = self.sandbox.exec(command, timeout_s=min(float(timeout or self.timeout_s), remaining),
                                        output_cap_bytes=OBSERVATION_CAP_CHARS * 4)
            except InfraError:
                ended = agent_exhaustion(self.sandbox)
                if ended is None:
                    raise
                self.steps.append(Step(self.turn, {"tool": "bash", "args": {"command": command}},
                                       f"the sandbox is gone: {ended[1]}", time.monotonic() - t0))
                raise AgentFault(ended[0], ended[1]) from None
            output = {"output": res.output[-OBSERVATION_CAP_CHARS:], "returncode": res.exit_code,
                      "exception_info": f"the command timed out after {self.timeout_s:g} s" if res.timed_out else ""}
        self.steps.append(Step(self.turn, {"tool": "bash", "args": {"command": command}},
                               f"exit {output['returncode']}\n{output['output']}", time.monotonic() - t0))
        self.turn += 1
        lines = output["output"].lstrip().splitlines()
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            raise Submitted({"role": "exit", "content": "", "extra": {"exit_status": "Submitted", "submission": ""}})
        return output

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        return {**self.config, **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config, "environment_type": f"{__name__}.SandboxEnvironment"}}}


class PosttrainChatModel(LitellmModel):
    """LiteLLM's chat model with the model server's failures (unreachable, timed out, 5xx) as
    :class:`InfraError` (never retried here: the trainer retries the episode) and a refusal (4xx)
    passed to the agent loop at once."""

    abort_exceptions = [*LitellmModel.abort_exceptions, InfraError, litellm.exceptions.BadRequestError]

    def _query(self, messages: list[dict[str, str]], **kwargs):
        try:
            return super()._query(messages, **kwargs)
        except (openai.APIError, litellm.exceptions.APIError) as exc:  # LiteLLM's errors derive from either
            status = getattr(exc, "status_code", None)
            if isinstance(exc, openai.APIConnectionError) or (isinstance(status, int) and status >= 500):
                raise InfraError(f"model server failed: {type(exc).__name__}: {exc}") from exc
            raise


def chat_model(chat_url: str, *, adapter_version: str | None, session_id: str, max_new_tokens: int,
               temperature: float) -> PosttrainChatModel:
    """mini-swe-agent's model, talking to ``chat_url``'s ``/v1/chat/completions`` for ``session_id``."""
    return PosttrainChatModel(
        model_name=f"openai/{adapter_version or BASE_MODEL}", cost_tracking="ignore_errors",
        model_kwargs={"api_base": f"{chat_url.rstrip('/')}/v1", "api_key": "posttrain",
                      "extra_headers": session_headers(session_id), "temperature": temperature,
                      "max_tokens": max_new_tokens, "timeout": 600},
    )


def _transcript(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("role", "content", "tool_calls", "tool_call_id")
    out = []
    for message in messages:
        row = {k: message[k] for k in keep if message.get(k) not in (None, [], "")}
        if row.get("tool_calls"):
            row["tool_calls"] = [{"id": c.get("id"), "function": {"name": c["function"]["name"],
                                                                  "arguments": c["function"]["arguments"]}}
                                 for c in row["tool_calls"]]
        status = (message.get("extra") or {}).get("exit_status")
        if status:
            row["exit_status"] = status
        out.append(row)
    return out


def captured_calls(chat_url: str, session_id: str) -> list[ModelCall]:
    """The session's calls as the replicas captured them (exact ids and logprobs), oldest first."""
    calls = []
    for record in EngineClient(chat_url).session(session_id):
        response = record.get("response") or {}
        calls.append(ModelCall(list(record.get("input_ids") or []), list(record.get("output_ids") or []),
                               [float(x) for x in record.get("output_logprobs") or []],
                               response.get("content") or "",
                               {"tool_calls": response.get("tool_calls") or [], "finish_reason": record.get("finish_reason"),
                                "weight_version": record.get("weight_version"), "replica": record.get("replica"),
                                "complete": record.get("complete", True), "consistent": record.get("consistent", True)},
                               float(record.get("latency_s") or 0.0)))
    return calls


def run_mini_swe_agent(task: Task, *, chat_url: str, sandbox_factory: SandboxFactory, adapter_version: str | None,
                       session_id: str, max_turns: int = 8, max_new_tokens: int = 256, temperature: float = 1.0,
                       time_limit_s: float | None = None, grade: bool = True,
                       grader_factory: SandboxFactory | None = None, grade_cache: dict | None = None) -> Trajectory:
    """One mini-swe-agent episode of ``task``, graded (an :class:`evals.harness.Scaffold`)."""
    traj = Trajectory(task.id, session_id, adapter_version, NAME, started_at=time.time())
    limit_s = time_limit_s if time_limit_s is not None else task.limits.agent_timeout_s
    deadline = time.monotonic() + limit_s
    started = time.monotonic()
    agent = None
    try:
        with sandbox_factory(task) as box:
            env = SandboxEnvironment(box, traj.steps, deadline=deadline)
            try:
                model = chat_model(chat_url, adapter_version=adapter_version, session_id=session_id,
                                   max_new_tokens=max_new_tokens, temperature=temperature)
                agent = DefaultAgent(model, env, system_template=SYSTEM_TEMPLATE, instance_template=INSTANCE_TEMPLATE,
                                     step_limit=max_turns, cost_limit=0.0, wall_time_limit_seconds=max(1, int(limit_s)),
                                     max_consecutive_format_errors=3)
                exit_info = agent.run(task.instruction)
                status = exit_info.get("exit_status", "")
                traj.stop_reason = STOP_REASONS.get(status, status or "stopped")
            except litellm.exceptions.ContextWindowExceededError:
                traj.stop_reason = "context"
            if traj.stop_reason == "commit":
                observation, traj.committed = execute(Action("commit", {"message": "mini-swe-agent submission"}), task, box)
                traj.steps.append(Step(env.turn, {"tool": "commit", "args": {}}, observation, 0.0))
            if grade:
                traj.patch = committed_patch(box, task.base_commit or "HEAD")
    except InfraError as exc:
        traj.stop_reason, traj.error = INFRA_ERROR, str(exc)
    except AgentFault as exc:  # the agent broke its repository or sandbox: its failed attempt
        traj.stop_reason, traj.error = exc.label, str(exc)
        if grade:
            fail_attempt(traj, task, str(exc))
    except Exception as exc:  # mini-swe-agent or LiteLLM crashed: a failed attempt, never a stopped run
        traj.stop_reason, traj.error = SCAFFOLD_ERROR, traceback.format_exc()[-8000:]
        if grade:
            fail_attempt(traj, task, f"{type(exc).__name__}: {exc}")
    traj.agent_s = time.monotonic() - started
    if agent is not None:
        traj.transcript = _transcript(agent.messages)
    try:
        traj.calls = captured_calls(chat_url, session_id)
    except (OSError, EngineError):
        pass  # the trainer reads the capture itself; an episode without it is still graded
    if grade and traj.grade is None and traj.stop_reason != INFRA_ERROR:
        grade_committed(traj, task, grader_factory or sandbox_factory, grade_cache)
    return traj
