"""The two action formats an agent can speak, their parsers and the prompts that go with them.

**Compact** (for tiny models; a fix is tens of tokens). One action per line::

    edit OLD => NEW           replace the one occurrence of OLD in the file the prompt shows with
                              NEW (both taken as written, without the spaces around ``=>``); an
                              OLD found zero or several times is an error observation
    replace FILE:LINE TEXT    set line LINE (1-based) of FILE to TEXT (everything after the one
                              space that follows LINE, indentation included; may be empty)
    test                      run the tests; the observation lists the failing asserts
    reset                     undo every edit: the work tree goes back to the task's base commit
    commit                    commit the work tree; this ends the episode

The prompt (:func:`render_compact_prompt`) is the instruction, the module with line numbers and the
failing asserts seen at the base commit, then ``>``; a demonstration (:func:`demonstration`) is that
prompt with the reference solution as the action text, in ``edit`` actions. ``edit`` names the code
it changes instead of a file and a line number: a tiny model copies a line of the listing far more
reliably than it finds the line's number or the file's name (docs/benchmarks.md, "Edit by content"). A model answers with one or more action lines
per turn; after a turn without ``commit`` the observations are appended and the model is called again.

**JSON tool calls** (for real models). Each call is a JSON object ``{"tool": NAME, "args": {...}}``
(``{"name": ..., "arguments": ...}`` is accepted too), optionally inside ``<tool_call>...</tool_call>``.
Tools: ``bash`` (``command``), ``read_file`` (``path``), ``write_file`` (``path``, ``content``),
``str_replace`` (``path``, ``old``, ``new``: ``old`` must occur exactly once), ``replace_line``
(``path``, ``line``, ``text``), ``test``, ``reset`` and ``commit`` (``message``).

Both parsers return :class:`Action` objects; the harness executes them the same way.
The text the actions work on is handled here too: :func:`apply_edits` sets lines by number (the
``replace`` action, the bundled suite's reference solutions), :func:`content_edits` turns line edits
into ``edit OLD => NEW`` pairs, and :func:`failing_summary` gives the failing asserts that a ``test``
observation and a bundled task's instruction show.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from evals.tasks import Task

COMPACT, JSON_TOOLS = "compact", "json"
TOOLS = ("bash", "read_file", "write_file", "str_replace", "replace_line", "commit", "test", "reset")
_BARE = ("commit", "test", "reset")  # compact actions that are one word


class ActionParseError(ValueError):
    """The model's text holds no action, or a malformed one; the message becomes its observation."""


@dataclass(frozen=True)
class Action:
    """One thing the agent asked for: ``tool`` from :data:`TOOLS` and its arguments."""

    tool: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_compact(self) -> str:
        if self.tool == "replace_line":
            return f"replace {self.args['path']}:{self.args['line']} {self.args['text']}"
        if self.tool == "str_replace" and "path" not in self.args:
            return f"edit {self.args['old']}{EDIT_ARROW}{self.args['new']}"
        if self.tool in _BARE:
            return self.tool
        raise ValueError(f"action {self.tool!r} has no compact form")


_REPLACE = re.compile(r"^replace (?P<path>[^\s:]+):(?P<line>\d+)(?: (?P<text>.*))?$")
EDIT_ARROW = " => "
_EDIT = re.compile(r"^edit (?P<old>.+?) => (?P<new>.*)$")
_ACTIONS_HELP = "edit OLD => NEW | replace FILE:LINE TEXT | test | reset | commit"


def parse_compact(text: str) -> list[Action]:
    """The actions in a compact answer, up to and including the first ``commit``.

    Blank lines are skipped; any other line that is not an action raises :class:`ActionParseError`
    naming it (actions before it are kept in ``exc.actions`` so the harness can still run them).
    """
    actions: list[Action] = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        word = line.strip()
        if word in _BARE:
            actions.append(Action(word))
            if word == "commit":
                break
            continue
        match = _EDIT.match(line.strip())
        if match:
            actions.append(Action("str_replace", {"old": match["old"], "new": match["new"]}))
            continue
        match = _REPLACE.match(line.rstrip("\r"))
        if match:
            actions.append(Action("replace_line", {"path": match["path"], "line": int(match["line"]),
                                                   "text": match["text"] or ""}))
            continue
        err = ActionParseError(f"line {lineno}: {line[:80]!r} is not an action ({_ACTIONS_HELP})")
        err.actions = actions  # type: ignore[attr-defined]
        raise err
    if not actions:
        raise ActionParseError(f"no action in the answer ({_ACTIONS_HELP})")
    return actions


def _json_objects(text: str) -> list[Any]:
    decoder = json.JSONDecoder()
    objs, i = [], 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return objs
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        objs.append(obj)
        i = end


def parse_json_tools(text: str) -> list[Action]:
    """The tool calls in a JSON-tools answer, in order, up to and including the first ``commit``."""
    actions: list[Action] = []
    for obj in _json_objects(text):
        if not isinstance(obj, dict):
            continue
        name = obj.get("tool", obj.get("name"))
        args = obj.get("args", obj.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                raise ActionParseError(f"tool {name!r}: arguments are not valid JSON: {exc}") from exc
        if name is None:
            continue
        if name not in TOOLS:
            raise ActionParseError(f"unknown tool {name!r}; tools: {', '.join(TOOLS)}")
        if not isinstance(args, dict):
            raise ActionParseError(f"tool {name!r}: arguments must be an object")
        required = {"bash": ("command",), "read_file": ("path",), "write_file": ("path", "content"),
                    "str_replace": ("path", "old", "new"), "replace_line": ("path", "line", "text"),
                    "commit": (), "test": (), "reset": ()}[name]
        missing = [k for k in required if k not in args]
        if missing:
            raise ActionParseError(f"tool {name!r}: missing argument(s) {', '.join(missing)}")
        actions.append(Action(name, dict(args)))
        if name == "commit":
            break
    if not actions:
        raise ActionParseError('no tool call in the answer; write {"tool": NAME, "args": {...}}')
    return actions


def parse_actions(text: str, action_format: str) -> list[Action]:
    if action_format == COMPACT:
        return parse_compact(text)
    if action_format == JSON_TOOLS:
        return parse_json_tools(text)
    raise ValueError(f"action format {action_format!r}: expected {COMPACT!r} or {JSON_TOOLS!r}")


# ---------------------------------------------------------------- prompts


def numbered(text: str) -> str:
    return "\n".join(f"{i} {line}" for i, line in enumerate(text.rstrip("\n").split("\n"), 1))


def _clean_failure(line: str) -> str:
    return line.replace("AssertionError: ", "")


def render_compact_prompt(task: Task) -> str:
    """The compact prompt of a bundled task: instruction, numbered module, failing asserts, ``>``."""
    meta = task.metadata
    for key in ("module_file", "source_text", "failing_output"):
        if key not in meta:
            raise ValueError(f"task {task.id}: metadata has no {key!r}; the compact format needs a built bundled task")
    fails = "\n".join(f"fail: {_clean_failure(line)}" for line in meta["failing_output"].splitlines())
    return f"{task.instruction}\n{meta['module_file']}:\n{numbered(meta['source_text'])}\n{fails}\n>"


def compact_observation(results: Sequence[str]) -> str:
    """What the model sees after a turn: one line per action result, then the next ``>``."""
    return "\n" + "\n".join(results) + "\n>"


def reference_actions(task: Task, by_line: bool = False) -> list[Action]:
    """The reference solution of a bundled task as compact actions, ending with ``commit``: an
    ``edit`` of each buggy line (its text without indentation, which the generator keeps unique in
    the module), or with ``by_line`` a ``replace`` of each by file and line number."""
    edits = task.metadata.get("reference_edits")
    if not edits:
        raise ValueError(f"task {task.id}: no reference_edits in its metadata")
    if by_line:
        return [Action("replace_line", {"path": p, "line": int(n), "text": t}) for p, n, t in edits] + [Action("commit")]
    pairs = content_edits(str(task.metadata.get("source_text", "")), [(int(n), t) for _, n, t in edits])
    if pairs is None:
        raise ValueError(f"task {task.id}: a buggy line's text is not unique in its module; it cannot be an edit")
    return [Action("str_replace", {"old": old, "new": new}) for old, new in pairs] + [Action("commit")]


def content_edits(source: str, edits: Sequence[tuple[int, str]]) -> list[tuple[str, str]] | None:
    """Line edits ``(1-based line, new text)`` of ``source`` as ``(old, new)`` edits by content (each
    line's text without indentation), applied in order; ``None`` when an old text is not found exactly
    once in the text the edits before it left."""
    lines, text, out = source.split("\n"), source, []
    for lineno, new in edits:
        old = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        if not old or text.count(old) != 1:
            return None
        text = text.replace(old, new.strip())
        out.append((old, new.strip()))
    return out


def failing_summary(test_output: str, max_lines: int = 6) -> str:
    """The informative lines of pytest's ``--tb=short`` output: each failing assert and its ``E`` line."""
    lines = test_output.splitlines()
    out = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("assert ") and i + 1 < len(lines) and lines[i + 1].startswith("E"):
            out.append(f"{stripped} -> {lines[i + 1][1:].strip()}")
    return "\n".join(out[:max_lines])


def apply_edits(text: str, edits: Sequence[tuple[int, str]]) -> str:
    """``text`` with each 1-based line replaced; a line number out of range raises ``ValueError``."""
    lines = text.split("\n")
    for lineno, new in edits:
        if not 1 <= lineno <= len(lines) - (1 if text.endswith("\n") else 0):
            raise ValueError(f"line {lineno} is outside the file (1..{len(lines) - 1})")
        lines[lineno - 1] = new
    return "\n".join(lines)


def demonstration(task: Task, by_line: bool = False) -> tuple[str, str]:
    """``(prompt_text, action_text)``: the task's reference solution as a compact demonstration.

    ``prompt_text`` is exactly what :func:`render_compact_prompt` gives the model at turn 1, and
    ``action_text`` what a perfect model answers (each action on its own line, ending ``commit``),
    in ``edit`` actions or with ``by_line`` in ``replace`` ones (:func:`reference_actions`).
    """
    actions = reference_actions(task, by_line)
    return render_compact_prompt(task), "\n".join(a.to_compact() for a in actions) + "\n"


JSON_SYSTEM = (
    "You are a coding agent working in a git repository. Call tools with JSON objects "
    '{"tool": NAME, "args": {...}}. Tools: bash(command), read_file(path), write_file(path, content), '
    "str_replace(path, old, new), replace_line(path, line, text), test(), reset(), commit(message). Only committed work is graded; "
    "commit when you are done."
)


def render_json_prompt(task: Task) -> str:
    """The chat-style prompt for real models using JSON tool calls."""
    return (f"<|im_start|>system\n{JSON_SYSTEM}<|im_end|>\n<|im_start|>user\n{task.instruction}<|im_end|>\n"
            "<|im_start|>assistant\n")


def json_observation(results: Sequence[str]) -> str:
    body = json.dumps({"results": list(results)})
    return f"<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def render_prompt(task: Task, action_format: str) -> str:
    if action_format == COMPACT:
        return render_compact_prompt(task)
    if action_format == JSON_TOOLS:
        return render_json_prompt(task)
    raise ValueError(f"action format {action_format!r}: expected {COMPACT!r} or {JSON_TOOLS!r}")


def observation(results: Sequence[str], action_format: str) -> str:
    return compact_observation(results) if action_format == COMPACT else json_observation(results)
