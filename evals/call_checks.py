"""The bundled suite's tests graded as call checks: the agent's code makes the calls, the host judges.

A bundled task's tests (:mod:`evals.bundled`) are ``assert f(<literals>) == <literal>`` lines in
``test_*`` functions. Run by a test runner, each pass would be decided in the process that imports the
agent's module, and that module can reach the runner there (its frames, globals, builtins, modules)
and report a pass for a test it fails. So grading splits a test in two:

- :func:`call_checks` reads the test file from the task's own repository on the host (never the
  sandbox's copy; parsed as data, never run) into :class:`CallCheck` s: the test, the function, the
  arguments and the expected value;
- in the grading sandbox, with the tests and ``.git`` removed so that no file there holds an expected
  value, :mod:`evals.call_probe` makes each call in a process of its own and streams back what it
  returned, as plain data; the process that writes that stream never imports the agent's code;
- :func:`check_statuses`, on the host, compares each returned value with the expected one and
  decides every test's status.

**The score counts inputs the agent never saw.** Beside each test's visible calls it has hidden ones
(:func:`hidden_checks`): the same function on inputs drawn from the test's own arguments (an integer
moved, a string or list extended, drawn anew for each ``seed``), whose expected values are the
reference solution's. A test passes only when its visible calls AND its hidden calls return the
expected values, so a patch that answers the tests' inputs from a table, or fails on the first
input it does not know, fails the test. The hidden inputs and their values are computed in a fresh
sandbox of the task that no agent has touched (the task's code never runs on the host), exist only
in the grader's memory and enter the grading sandbox only as the probe's spec, after the episode;
the text a reader sees says how many hidden calls failed, never which inputs.

A task whose tests are not all such asserts has no call checks (:func:`call_checks` is None) and is
graded by running its tests (:mod:`evals.grading`).
"""

from __future__ import annotations

import ast
import base64
import functools
import hashlib
import json
import os
import random
import string
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from evals import safe_ast
from evals.actions import apply_edits
from evals.sandbox import InfraError
from evals.signals import OVERFITS_TESTS
from evals.tasks import MODULE_FILE
from sandboxes.programs import shipped_digest, shipped_source

PROBE_SOURCE = Path(__file__).with_name("call_probe.py")  # shipped as sandboxes.programs.shipped_source makes it
GRADER_DIR = "/tmp/.posttrain-grader"  # outside the repository: no patch can ship a file there
RESULTS_FD = 3
MAX_HIDDEN_PER_TEST = 6


@dataclass(frozen=True)
class CallCheck:
    """One ``assert function(args) == expected`` of a test; ``args`` is the tuple's literal source.

    A ``hidden`` check is a call the tests do not show, counted in its test's status: ``expected`` is
    the reference solution's value there and ``unfixed`` the base code's (equal where the bug does
    not show on that input; None where the base code raised)."""

    test_id: str
    function: str
    args: str
    expected: Any
    hidden: bool = False
    unfixed: Any = None

    def shown(self) -> str:
        return f"{self.function}{self.args if not self.args.endswith(',)') else self.args[:-2] + ')'}"


class StreamBroken(ValueError):
    """The probe's stream broke its rules; the message says how."""


def module_name(task) -> str:
    """The Python module of a bundled task's ``metadata.module_file``, checked to be a plain
    ``name.py`` in the repository's top folder (``ValueError`` naming the task otherwise)."""
    module_file = (task.metadata or {}).get("module_file")
    if not isinstance(module_file, str) or not MODULE_FILE.fullmatch(module_file):
        raise ValueError(f"task {task.id}: metadata.module_file must be a file name like 'name.py' in the "
                         f"repository's top folder, got {str(module_file)[:80]!r}")
    return module_file.removesuffix(".py")


def call_checks(task) -> tuple[CallCheck, ...] | None:
    """The visible call checks of a bundled task, read from the test file in its repository on the
    host; None when the task is not bundled, or its tests are not all ``assert f(<literals>) ==
    <literal>``, or they do not cover every target and existing test. The test file must lie inside
    the repository (a task's metadata is data: a path out of it is refused, not read)."""
    meta = task.metadata or {}
    test_file = meta.get("test_file")
    if task.source != "bundled" or not task.repo_path or not isinstance(test_file, str):
        return None
    repo = Path(task.repo_path).resolve()
    path = (repo / test_file).resolve()
    if not path.is_relative_to(repo) or not test_file.endswith(".py"):
        raise ValueError(f"task {task.id}: metadata.test_file must be a .py file inside its repository, "
                         f"got {test_file[:120]!r}")
    module_name(task)
    checks = _parse_test_file(str(path), test_file)
    if checks is None:
        return None
    covered = {c.test_id for c in checks}
    if not {*task.target_tests, *task.existing_tests} <= covered:
        return None
    return checks


def graded_checks(task, sandbox_factory, seed: int = 0) -> tuple[CallCheck, ...] | None:
    """Every check that grades ``task``: the visible ones, then the hidden ones of ``seed``
    (:func:`hidden_checks`); None when the task has no call checks."""
    visible = call_checks(task)
    if visible is None:
        return None
    return visible + hidden_checks(task, visible, sandbox_factory, seed)


def hidden_inputs(task, visible: Sequence[CallCheck], seed: int = 0) -> list[tuple[str, str, str]]:
    """Candidate hidden calls ``(test_id, function, args)``: each visible call's arguments varied one
    at a time by values drawn from a generator seeded by the task and ``seed`` (plain data only; never
    one of the visible calls). Same task and seed, same calls."""
    rng = random.Random(hashlib.sha256(f"{task.id}\0{seed}".encode()).digest())
    shown = {(c.function, c.args) for c in visible if not c.hidden}
    calls: dict[tuple[str, str], str] = {}
    for check in visible:
        if check.hidden:
            continue
        args = safe_ast.literal_eval(check.args)
        for i, arg in enumerate(args):
            siblings = [a for j, a in enumerate(args) if j != i and type(a) is int]
            for variant in _variants(arg, rng, siblings):
                text = repr((*args[:i], variant, *args[i + 1:]))
                if (check.function, text) not in shown:
                    calls.setdefault((check.function, text), check.test_id)
    return [(test_id, function, args) for (function, args), test_id in calls.items()]


def _variants(arg: Any, rng: random.Random, siblings: Sequence[int] = ()) -> list[Any]:
    """Values near ``arg`` of its type; for an integer also the other integer arguments' values and
    their neighbours (``siblings``), where boundaries lie (``lo <= x <= hi``)."""
    if type(arg) is bool:
        return [not arg]
    if type(arg) is int:
        spread = (min(0, arg) - 5, 3 * abs(arg) + 12)
        near = [arg + rng.randint(1, 9), arg - rng.randint(1, 9), arg * rng.randint(2, 5) + rng.randint(1, 7),
                arg * rng.randint(2, 5),  # a multiple keeps what divides the argument
                rng.randint(*spread), rng.randint(*spread)]
        edges = [v + d for v in siblings for d in (0, 1, -1)]
        rng.shuffle(edges)
        return near + [v for v in edges[:4] if v != arg]
    if type(arg) is str:
        letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 4)))
        return [arg + letters, letters + arg, " ".join(reversed(arg.split())) + " " + letters]
    if type(arg) is list and arg and all(type(v) is int for v in arg):
        low, high = min(arg) - 5, max(arg) + 9
        return [arg + [rng.randint(low, high)], [rng.randint(low, high) for _ in range(rng.randint(2, 6))],
                list(reversed(arg)) + [arg[0] + rng.randint(1, 6)]]
    if type(arg) is list and arg:
        return [arg + [rng.choice(arg)], list(reversed(arg))]
    return []


def hidden_checks(task, visible: Sequence[CallCheck], sandbox_factory, seed: int = 0) -> tuple[CallCheck, ...]:
    """The hidden checks of ``task`` for ``seed``: :func:`hidden_inputs` answered by the reference
    solution (the base module with ``metadata.reference_edits``) and by the base module, in a fresh
    sandbox of the task from ``sandbox_factory``; the calls the reference answers with plain data, up
    to :data:`MAX_HIDDEN_PER_TEST` a test, those where the two disagree first (where the bug shows).
    Empty when the task carries no reference solution.

    Computed once per task and factory in a process (:func:`_hidden_answers`), keyed by what
    decides them rather than by where the task lies, so a task validated in a folder that is then
    renamed is not answered again by the same factory."""
    line_edits, calls = _reference_and_calls(task, visible, seed)
    if not calls:
        return ()
    reference, unfixed = _hidden_answers(task, sandbox_factory, line_edits, calls)
    return _choose(calls, reference, unfixed)


# (answers key, factory id) -> (factory, (reference answers, base answers))
_answers: "OrderedDict[tuple[str, int], tuple[Any, tuple[dict[int, Any], dict[int, Any]]]]" = OrderedDict()
_answers_locks: dict[tuple[str, int], threading.Lock] = {}
_answers_guard = threading.Lock()
_ANSWERS_KEPT = 4096


def _reference_and_calls(task, visible: Sequence[CallCheck], seed: int) -> tuple[tuple, tuple]:
    """``task``'s reference edits (``metadata.reference_edits`` as (line, text) pairs) and its hidden
    calls for ``seed``; two empty tuples when it carries no reference solution. Bad metadata raises
    naming the task."""
    edits = (task.metadata or {}).get("reference_edits")
    if not isinstance(edits, list) or not edits:
        return (), ()
    try:
        line_edits = tuple((int(line), str(text)) for _, line, text in edits)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task {task.id}: metadata.reference_edits must be [file, line, text] lists: {exc}") from exc
    return line_edits, tuple(hidden_inputs(task, visible, seed))


def _answers_key(task, line_edits, calls) -> str:
    """What decides the hidden answers: the task, its base commit and base module as the host's copy
    of its repository holds them, the reference edits, the calls, and the probe that makes them
    (not the folder the task lies in: the task stream validates a task in a folder it renames)."""
    source = b""
    if task.repo_path:
        try:
            source = (Path(task.repo_path) / f"{module_name(task)}.py").read_bytes()  # read as data, never run
        except OSError:
            pass
    digest = hashlib.sha256(json.dumps([task.id, task.base_commit, hashlib.sha256(source).hexdigest(),
                                        list(line_edits), list(calls)]).encode())
    digest.update(_probe_digest())
    return digest.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def _probe_digest() -> bytes:
    return bytes.fromhex(shipped_digest(PROBE_SOURCE))  # the probe as shipped: standalone.py's text in it


def _hidden_answers(task, sandbox_factory, line_edits, calls) -> tuple[dict[int, Any], dict[int, Any]]:
    """The reference solution's and the base code's answers to ``calls`` (by position; calls that
    raise are left out), computed in a fresh sandbox of ``sandbox_factory`` once per task content
    and factory in this process. Gradings of one task that start together wait for one computation
    instead of each starting a sandbox (a group's episodes end close together)."""
    key = (_answers_key(task, line_edits, calls), id(sandbox_factory))
    with _answers_guard:
        if key in _answers and _answers[key][0] is sandbox_factory:
            _answers.move_to_end(key)
            return _answers[key][1]
        lock = _answers_locks.setdefault(key, threading.Lock())
    with lock:
        with _answers_guard:
            if key in _answers and _answers[key][0] is sandbox_factory:
                return _answers[key][1]
        encoded = _compute_answers(task, sandbox_factory, line_edits, calls)
        return _keep_answers(key, sandbox_factory, encoded)


def _keep_answers(key, sandbox_factory, encoded) -> tuple[dict[int, Any], dict[int, Any]]:
    """Decode the probe's answers and keep them under ``key`` with their factory (held by the
    caller's per-key lock)."""
    answers = tuple({i: decode(v) for i, v in side.items()} for side in encoded)
    with _answers_guard:
        # the factory is kept with its answers: a factory's id is reused only once it is gone
        _answers[key] = (sandbox_factory, answers)
        while len(_answers) > _ANSWERS_KEPT:
            _answers.popitem(last=False)
        _answers_locks.pop(key, None)
    return answers


def _compute_answers(task, sandbox_factory, line_edits, calls) -> tuple[dict[int, Any], dict[int, Any]]:
    """The answers, as the probe encoded them, of the reference solution and of the base module, in
    a fresh sandbox of the task."""
    try:
        with sandbox_factory(task) as sandbox:
            return _answers_in(sandbox, task, line_edits, calls)
    except (InfraError, OSError) as exc:
        raise InfraError(f"task {task.id}: answering the hidden inputs in a fresh sandbox failed: {exc}") from exc


def _answers_in(sandbox, task, line_edits, calls, restore: bool = False) -> tuple[dict[int, Any], dict[int, Any]]:
    """The reference solution's and the base module's answers in ``sandbox``, whose work tree holds
    the base module; its module file is left with the reference edits applied, or as it was with
    ``restore``.

    One command does it all: it writes the probe and both its specs, runs it on the base module,
    writes the reference solution over the module (the shell's own ``printf``), runs it again and,
    with ``restore``, writes the base module back; the two runs' streams follow each other on the
    results pipe (:func:`_two_streams`). That was four commands and two file writes: two probe
    installs, each a round trip to the sandbox's daemon and a shell."""
    module_file = f"{module_name(task)}.py"
    probe_calls = [CallCheck(test_id, function, args, None) for test_id, function, args in calls]
    base_source = sandbox.read_file(module_file).decode()
    try:
        fixed = apply_edits(base_source, list(line_edits))
    except ValueError as exc:
        raise ValueError(f"task {task.id}: metadata.reference_edits do not fit {module_file}: {exc}") from exc
    spec = probe_spec(module_name(task), probe_calls, 5.0, one_process=True)
    install, (unfixed_run, reference_run) = probe_install(GRADER_DIR, spec, runs=2)
    steps = ["set -e", install, unfixed_run, _write_command(module_file, fixed.encode()), reference_run]
    if restore:
        steps.append(_write_command(module_file, base_source.encode()))
    timeout_s = 2 * max(60.0, task.limits.test_timeout_s)
    run = sandbox.exec("; ".join(steps), timeout_s=timeout_s, output_cap_bytes=1 << 16,
                       env={"POSTTRAIN_RESULTS_FD": str(RESULTS_FD)}, results_fd=RESULTS_FD, kill_others=True)
    if run.timed_out or run.results is None:
        raise InfraError(f"the probe did not finish: {run.output[-300:]}")
    unfixed, reference = _two_streams(run.results, run.output)
    return reference, unfixed


def _two_streams(data: bytes, output: str) -> tuple[dict[int, Any], dict[int, Any]]:
    """The answers (by call number, as the probe encoded them; calls that raised left out) of each of
    two probe runs whose streams follow each other in ``data``; :class:`InfraError` unless both
    started and finished (the probe is the grader's own and so are both modules: anything else is
    the machinery failing)."""
    runs: list[dict[int, Any]] = []
    finished = 0
    for line in data.splitlines():
        record = json.loads(line)
        event = record.get("event")
        if event == "start":
            runs.append({})
        elif event == "finish":
            finished += 1
        elif event == "value" and runs:
            decode(record["value"])  # refused here, not when read back
            runs[-1][int(record["check"])] = record["value"]
    if len(runs) != 2 or finished != 2:
        raise InfraError(f"the probe did not finish both runs ({len(runs)} started, {finished} finished): "
                         f"{output[-300:]}")
    return runs[0], runs[1]


def answer_hidden_in(sandbox, task, sandbox_factory, seed: int = 0) -> None:
    """Answer ``task``'s hidden inputs of ``seed`` in ``sandbox`` and keep them as the answers of
    ``sandbox_factory`` (:func:`hidden_checks` then starts no sandbox for them), unless that factory
    has them already. For a caller that holds a fresh sandbox of the task in which only the host's
    own code ran, its work tree at the base commit (:func:`evals.bundled.validate_task`, after the
    base run of the task's own tests): one sandbox instead of two. The answers must never come from
    a sandbox an agent's command reached. The module file is left as it was; the task's metadata is
    checked as :func:`hidden_checks` checks it."""
    visible = call_checks(task)
    if visible is None:
        return
    line_edits, calls = _reference_and_calls(task, visible, seed)
    if not calls:
        return
    key = (_answers_key(task, line_edits, calls), id(sandbox_factory))
    with _answers_guard:
        if key in _answers and _answers[key][0] is sandbox_factory:
            return
        lock = _answers_locks.setdefault(key, threading.Lock())
    with lock:
        with _answers_guard:
            if key in _answers and _answers[key][0] is sandbox_factory:
                return
        try:
            encoded = _answers_in(sandbox, task, line_edits, calls, restore=True)
        except (InfraError, OSError) as exc:
            raise InfraError(f"task {task.id}: answering the hidden inputs in its validation sandbox failed: "
                             f"{exc}") from exc
        _keep_answers(key, sandbox_factory, encoded)


def _choose(calls: Sequence[tuple[str, str, str]], reference: Mapping[int, Any],
            unfixed: Mapping[int, Any]) -> tuple[CallCheck, ...]:
    """Up to :data:`MAX_HIDDEN_PER_TEST` hidden checks a test, among the calls the reference answers:
    where the bug shows first (the base code answers otherwise), each time one whose expected value the
    test's picks do not hold yet where there is one, so that a function of few outcomes (a bool) is
    checked on each: a wrong fix that agrees with the reference on the common answer fails the rest."""
    def bug_shows(i: int) -> bool:
        return i not in unfixed or not _equal(reference[i], unfixed[i])

    by_test: dict[str, list[int]] = {}
    for i in sorted((i for i in range(len(calls)) if i in reference), key=lambda i: not bug_shows(i)):
        by_test.setdefault(calls[i][0], []).append(i)
    chosen = []
    for test_id, candidates in by_test.items():
        picked: list[int] = []
        while candidates and len(picked) < MAX_HIDDEN_PER_TEST:
            fresh = next((i for i in candidates if not any(_equal(reference[i], reference[j]) for j in picked)),
                         candidates[0])
            candidates.remove(fresh)
            picked.append(fresh)
        chosen += [CallCheck(test_id, calls[i][1], calls[i][2], reference[i], hidden=True, unfixed=unfixed.get(i))
                   for i in picked]
    order = list(dict.fromkeys(t for t, _, _ in calls))
    return tuple(sorted(chosen, key=lambda c: order.index(c.test_id)))


@functools.lru_cache(maxsize=4096)
def _parse_test_file(path: str, relative: str) -> tuple[CallCheck, ...] | None:
    try:
        tree = safe_ast.parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, SyntaxError, ValueError):
        return None
    imported: set[str] = set()
    checks: list[CallCheck] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            imported |= {alias.name for alias in node.names if alias.asname is None}
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            test_id = f"{relative[:-3].replace('/', '.')}.{node.name}"  # evals.grading.junit_id of the node id
            for statement in node.body:
                check = _check(statement, test_id, imported)
                if check is None:
                    return None
                checks.append(check)
        else:
            return None
    return tuple(checks)


def _check(statement: ast.stmt, test_id: str, imported: set[str]) -> CallCheck | None:
    if not (isinstance(statement, ast.Assert) and statement.msg is None):
        return None
    test = statement.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    call = test.left
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in imported
            and not call.keywords and not any(isinstance(a, ast.Starred) for a in call.args)):
        return None
    args = ast.Tuple(elts=list(call.args), ctx=ast.Load())
    try:
        ast.literal_eval(args)
        expected = ast.literal_eval(test.comparators[0])
    except ValueError:
        return None
    source = ast.unparse(args)
    return CallCheck(test_id, call.func.id, source if source.startswith("(") else f"({source})", expected)


def probe_spec(module: str, checks: Sequence[CallCheck], call_timeout_s: float = 10.0, *,
               one_process: bool = False) -> bytes:
    """The probe's spec: the module and, per check, its number, function and arguments; no expected
    value. ``one_process`` (only for a module of the grader's own, never the agent's): the calls are
    made in one process instead of one each."""
    return json.dumps({"module": module, "call_timeout_s": call_timeout_s, "one_process": one_process,
                       "calls": [[i, c.function, c.args] for i, c in enumerate(checks)]}).encode()


_PRINTF_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !\"#$&()*+,-./:;<=>?@[]^_`{|}~")


def _write_command(path: str, data: bytes) -> str:
    """A shell command that writes ``data`` to ``path`` with the shell's own ``printf``: the bytes
    as its format, in single quotes, every other byte than plain ASCII as an octal escape (no
    ``base64`` process a file: a grading writes two). Data with a NUL byte, which a format cannot
    hold, goes through ``base64``."""
    if b"\0" in data:
        return f"printf %s {base64.b64encode(data).decode()} | base64 -d > {path}"
    return f"printf '{_printf_format(data)}' > {path}"


# each byte's text in a printf format: itself where plain, ``%%`` for ``%``, else an octal escape
_PRINTF_TABLE = {b: chr(b) if b in _PRINTF_PLAIN else "%%" if b == 0x25 else f"\\{b:03o}" for b in range(256)}


def _printf_format(data: bytes) -> str:
    # latin-1 maps each byte to the code point of its value; translate then looks each up (in C: a
    # grading's spec is made at every grading, and a loop over its bytes in Python cost ~1 ms)
    return data.decode("latin-1").translate(_PRINTF_TABLE)


@functools.lru_cache(maxsize=1)
def _probe_write_format() -> str:
    """The probe's source as shipped (:func:`sandboxes.programs.shipped_source`: one file, nothing
    imported from the project) as a ``printf`` format: the same every grading, made once (Python
    source holds no NUL byte, which a format could not)."""
    return _printf_format(shipped_source(PROBE_SOURCE))


def probe_install(grader_dir: str, spec: bytes, runs: int = 1) -> tuple[str, Any]:
    """The shell commands that write the probe and its spec under ``grader_dir`` (a fresh random name,
    owner-only files, the shell's own ``printf``: ``mkdir`` is their one process), and the command
    that then runs it. The grader runs the two in one exec where it can (:func:`evals.grading`):
    each exec is a round trip to the sandbox's daemon and a shell. With ``runs`` > 1 the spec is
    written that many times (the probe deletes the spec it read) and the commands are a tuple, one
    a run."""
    name = f"_posttrain_probe_{os.urandom(8).hex()}"
    specs = [f"{grader_dir}/{name}.json" if n == 0 else f"{grader_dir}/{name}-{n}.json" for n in range(runs)]
    script = " && ".join([f"printf '{_probe_write_format()}' > {grader_dir}/{name}.py",
                          *(_write_command(path, spec) for path in specs)])
    # a subshell (a fork, no exec) keeps the umask to the grader's files
    install = f"(umask 077 && mkdir -p {grader_dir} && {script})"
    commands = tuple(f"python3 -I -S {grader_dir}/{name}.py {path}" for path in specs)
    return install, commands[0] if runs == 1 else commands


def decode(value: Any) -> Any:
    """A value :func:`evals.call_probe.encode` wrote, back as plain data; :class:`ValueError` when it
    is not one."""
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ValueError(f"not an encoded value: {str(value)[:80]}")
    tag, rest = value[0], value[1:]
    if tag == "none" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError(f"an encoded {tag!r} takes one field")
    (body,) = rest
    if tag == "bool" and isinstance(body, bool):
        return body
    if tag == "int" and isinstance(body, str):
        return int(body)
    if tag == "float" and isinstance(body, str):
        return float(body)
    if tag == "str" and isinstance(body, str):
        return body
    if tag in ("list", "tuple") and isinstance(body, list):
        items = [decode(item) for item in body]
        return items if tag == "list" else tuple(items)
    if tag == "dict" and isinstance(body, list):
        pairs = []
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("an encoded dict holds [key, value] pairs")
            pairs.append((decode(pair[0]), decode(pair[1])))
        try:
            return dict(pairs)
        except TypeError as exc:
            raise ValueError(f"an unhashable key: {exc}") from exc
    raise ValueError(f"unknown encoded value {tag!r}")


@dataclass(frozen=True)
class CheckOutcome:
    """What the probe's stream says: whether each test passed, the text a reader sees, and whether
    the stream finished."""

    passed: Mapping[str, bool]
    output: str
    finished: bool
    overfit: str = ""  # why the attempt passes the tests yet keeps the bug off them, or ""


def check_statuses(data: bytes, checks: Sequence[CallCheck], *, truncated: bool = False) -> CheckOutcome:
    """Whether each test passed, from the probe's stream ``data``: passed when each of its checks,
    visible and hidden, returned the expected value, else failed (a check with no record failed: its
    call's process died, hung, or the probe ended first).

    ``overfit`` is set when every visible check passed yet a hidden one failed: the patch answers the
    tests' own inputs and not the task (a test table, a special case), signal :data:`OVERFITS_TESTS`.
    What a reader sees of a failed hidden check is its count and whether the bug's answer came back,
    never its input or expected value.

    Raises :class:`StreamBroken` when the stream breaks its rules, which the probe never does on its
    own: a line that is not a JSON object, a record before ``start`` or after ``finish``, two
    ``start`` s, a check reported twice or one that does not exist, a value that is not an encoded
    value, a cut stream.
    """
    if truncated:
        raise StreamBroken("the stream exceeds what the grader reads")
    results: dict[int, tuple[bool, str]] = {}
    started = finished = False
    import_error = None
    if data and not data.endswith(b"\n"):
        raise StreamBroken("the stream ends inside a record")
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise StreamBroken(f"line {n} is not JSON the grader reads") from exc
        if not isinstance(record, dict):
            raise StreamBroken(f"line {n} is not a JSON object")
        event = record.get("event")
        if finished:
            raise StreamBroken(f"line {n}: a record after finish")
        if event == "start":
            if started:
                raise StreamBroken(f"line {n}: a second start")
            started = True
            continue
        if not started:
            raise StreamBroken(f"line {n}: a record before start")
        if event == "finish":
            finished = True
        elif event == "import_error":
            if import_error is not None or results:
                raise StreamBroken(f"line {n}: an import error after the calls began")
            import_error = str(record.get("error"))[:500]
        elif event in ("value", "raised"):
            number = record.get("check")
            if type(number) is not int or not 0 <= number < len(checks):
                raise StreamBroken(f"line {n}: no check {str(number)[:40]}")
            if number in results or import_error is not None:
                raise StreamBroken(f"line {n}: check {number} reported twice")
            check = checks[number]
            if event == "raised":
                error = str(record.get("error"))[:300]
                results[number] = (False, "raised" if check.hidden else f"{check.shown()} raised {error}")
                continue
            try:
                value = decode(record.get("value"))
            except (ValueError, RecursionError) as exc:
                raise StreamBroken(f"line {n}: {exc}") from exc
            passed = _equal(value, check.expected)
            if check.hidden:
                why = "" if passed else ("the unfixed code's answer" if _equal(value, check.unfixed) else "a wrong answer")
            else:
                why = "" if passed else f"{check.shown()} returned {value!r:.200}, expected {check.expected!r:.200}"
            results[number] = (passed, why)
        else:
            raise StreamBroken(f"line {n}: unknown event {str(event)[:40]!r}")
    failed: dict[str, list[str]] = {}
    hidden_failed: dict[str, list[str]] = {}
    for number, check in enumerate(checks):
        passed, why = results.get(number, (False, "no answer" if check.hidden else
                                           f"{check.shown()} returned nothing (the probe ended first)"))
        if import_error is not None:
            why = f"importing the module raised {import_error}"
        if not passed:
            (hidden_failed if check.hidden else failed).setdefault(check.test_id, []).append(why)
    overfit = ""
    if not failed and hidden_failed:  # the probe may have been ended by a hidden call that hung
        count = sum(len(v) for v in hidden_failed.values())
        overfit = (f"{OVERFITS_TESTS}: every visible assert passes, yet {count} hidden input(s) of "
                   f"{len(hidden_failed)} test(s) get the wrong answer")
    tests = dict.fromkeys(c.test_id for c in checks if not c.hidden)
    passed = {t: t not in failed and t not in hidden_failed for t in tests}
    lines = []
    for t in tests:
        if t in failed or t in hidden_failed:
            whys = list(dict.fromkeys(failed.get(t, [])))
            if t in hidden_failed and import_error is None:
                kinds = dict.fromkeys(hidden_failed[t])
                whys.append(f"{len(hidden_failed[t])} hidden input(s) failed ({', '.join(kinds)})")
            lines.append(f"FAILED {t} - {'; '.join(whys)}")
    passed_count = sum(passed.values())
    failed_count = len(tests) - passed_count
    counts = ", ".join(part for part in (f"{failed_count} failed" if failed_count else "",
                                         f"{passed_count} passed" if passed_count else "") if part)
    return CheckOutcome(passed, "\n".join([*lines, counts or "no tests ran", *([overfit] if overfit else [])]),
                        finished, overfit)


def _equal(value: Any, expected: Any) -> bool:
    """``value == expected`` of two plain values (both the host's own objects: no agent code runs)."""
    try:
        return bool(value == expected)
    except RecursionError:
        return False
