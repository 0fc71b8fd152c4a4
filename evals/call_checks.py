"""The bundled suite's tests graded as call checks: the agent's code makes the calls, the host judges.

A bundled task's tests (:mod:`evals.bundled`) are ``assert f(<literals>) == <literal>`` lines in
``test_*`` functions. Run by a test runner, each pass would be decided in the process that imports the
agent's module, and that module can reach the runner there (its frames, globals, builtins, modules)
and report a pass for a test it fails. So grading splits a test in two:

- :func:`call_checks` reads the test file from the task's own repository on the host (never the
  sandbox's copy) into :class:`CallCheck` s: the test, the function, the arguments and the expected
  value;
- in the grading sandbox, with the tests and ``.git`` removed so that no file there holds an expected
  value, :mod:`evals.call_probe` makes each call and streams back what it returned, as plain data;
- :func:`check_statuses`, on the host, compares each returned value with the expected one and
  decides every test's status. A test passes when every one of its checks returned a value equal to
  the expected one (Python's ``==`` on plain builtin values, as the test's own ``assert`` compares
  them).

Code of the agent can still rewrite the probe or write to the stream; what it cannot do is know what
to write: the expected values never enter the sandbox. An object that claims equality with anything
(an ``__eq__`` returning ``True``) is not plain data and fails its check.

A task whose tests are not all such asserts has no call checks (:func:`call_checks` is None) and is
graded by running its tests (:mod:`evals.grading`).
"""

from __future__ import annotations

import ast
import base64
import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from evals import safe_ast
from evals.actions import apply_edits
from evals.sandbox import InfraError
from evals.signals import OVERFITS_TESTS

PROBE_SOURCE = Path(__file__).with_name("call_probe.py")


@dataclass(frozen=True)
class CallCheck:
    """One ``assert function(args) == expected`` of a test; ``args`` is the tuple's literal source.

    A ``hidden`` check is no test's: a call the tests do not show, whose ``expected`` value is the
    reference solution's and ``unfixed`` the base code's (they differ). It never changes a test's
    status; an attempt that passes every test yet returns ``unfixed`` there (or fails the call) kept
    the bug off the tests, e.g. by answering the tests' own inputs from a table: signal
    :data:`OVERFITS_TESTS`."""

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


def call_checks(task) -> tuple[CallCheck, ...] | None:
    """The call checks of a bundled task, read from the test file in its repository on the host, then
    its hidden checks (:func:`hidden_checks`); None when the task is not bundled, or its tests are not
    all ``assert f(<literals>) == <literal>``, or they do not cover every target and existing test."""
    test_file = (task.metadata or {}).get("test_file")
    if task.source != "bundled" or not task.repo_path or not isinstance(test_file, str):
        return None
    checks = _parse_test_file(str(Path(task.repo_path) / test_file), test_file)
    if checks is None:
        return None
    covered = {c.test_id for c in checks}
    if not {*task.target_tests, *task.existing_tests} <= covered:
        return None
    return checks + hidden_checks(task, checks)


def hidden_checks(task, checks: Sequence[CallCheck]) -> tuple[CallCheck, ...]:
    """Calls the tests do not show, where the reference solution and the base code disagree.

    Each test call's arguments are varied one at a time (an integer moved, a string or an integer
    list extended); both the reference module (the base source with ``reference_edits``) and the base
    module answer them in a subprocess on the host (:mod:`evals.call_probe`, our own generated code
    only, never the agent's), and the calls whose answers differ, as plain data, become hidden checks.
    Empty when the task carries no reference solution."""
    meta = task.metadata or {}
    source, edits = meta.get("source_text"), meta.get("reference_edits")
    if not isinstance(source, str) or not isinstance(edits, list) or not isinstance(meta.get("module_file"), str):
        return ()
    shown = tuple((c.test_id, c.function, c.args) for c in checks if not c.hidden)
    return _hidden_checks(meta["module_file"], source, json.dumps(edits), shown)


@functools.lru_cache(maxsize=4096)
def _hidden_checks(module_file: str, source: str, edits: str,
                   shown_calls: tuple[tuple[str, str, str], ...]) -> tuple[CallCheck, ...]:
    shown = {(function, args) for _, function, args in shown_calls}
    calls: dict[tuple[str, str], str] = {}
    for test_id, function, args_text in shown_calls:
        args = safe_ast.literal_eval(args_text)
        for i, arg in enumerate(args):
            for variant in _variants(arg):
                text = repr((*args[:i], variant, *args[i + 1:]))
                if (function, text) not in shown:
                    calls.setdefault((function, text), test_id)
    if not calls:
        return ()
    fixed = apply_edits(source, [(int(line), text) for _, line, text in json.loads(edits)])
    keys = list(calls)
    reference, unfixed = (_answers(module_file, text, keys) for text in (fixed, source))
    hidden = []
    for key in keys:
        if key in reference and key in unfixed and reference[key] != unfixed[key]:
            hidden.append(CallCheck(calls[key], key[0], key[1], reference[key], hidden=True, unfixed=unfixed[key]))
    return tuple(hidden[:MAX_HIDDEN])


MAX_HIDDEN = 12


def _variants(arg: Any) -> list[Any]:
    if type(arg) is int:
        return [arg + 1, arg + 4, arg * 3 + 2]
    if type(arg) is str:
        return [arg + "q", "z" + arg]
    if type(arg) is list and arg and all(type(v) is int for v in arg):
        return [arg + [max(arg) + 3], arg[::-1] + [arg[0] + 5]]
    return []


def _answers(module_file: str, module_source: str, calls: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """What ``module_source`` returns for each call, as plain data (calls that raise are left out)."""
    module = module_file.removesuffix(".py")
    with tempfile.TemporaryDirectory(prefix="posttrain-hidden-") as tmp:
        Path(tmp, module_file).write_text(module_source)
        spec = Path(tmp, "spec.json")
        spec.write_bytes(probe_spec(module, [CallCheck("", f, a, None) for f, a in calls]))
        env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_RESULTS_FD"}
        run = subprocess.run([sys.executable, "-I", "-S", str(PROBE_SOURCE), str(spec)], cwd=tmp, env=env,
                             capture_output=True, timeout=60)
    answers = {}
    for line in run.stdout.splitlines():
        record = json.loads(line)
        if record.get("event") == "value":
            answers[tuple(calls[record["check"]])] = decode(record["value"])
    return answers


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


def probe_spec(module: str, checks: Sequence[CallCheck]) -> bytes:
    """The probe's spec: the module and, per check, its number, function and arguments; no expected value."""
    return json.dumps({"module": module, "calls": [[i, c.function, c.args] for i, c in enumerate(checks)]}).encode()


def install_probe(sandbox, grader_dir: str, spec: bytes) -> str:
    """Write the probe and its spec under ``grader_dir`` in the sandbox; return the command that runs it."""
    name = f"_posttrain_probe_{os.urandom(8).hex()}"
    files = ((f"{grader_dir}/{name}.py", PROBE_SOURCE.read_bytes()), (f"{grader_dir}/{name}.json", spec))
    script = "; ".join(f"printf %s {base64.b64encode(data).decode()} | base64 -d > {path}" for path, data in files)
    made = sandbox.exec(f"set -e; umask 077; mkdir -p {grader_dir}; {script}", timeout_s=30)
    if made.timed_out or made.exit_code != 0:
        raise InfraError(f"writing the call probe to {grader_dir} failed: {made.output[-300:]}")
    return f"python3 -I -S {grader_dir}/{name}.py {grader_dir}/{name}.json"


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
    """Whether each test passed, from the probe's stream ``data``: passed when each of its checks returned
    the expected value, else failed (a check with no record failed: the probe died or timed out).

    Raises :class:`StreamBroken` when the stream breaks its rules, which the probe never does on its
    own: a line that is not a JSON object, a record before ``start`` or after ``finish``, two
    ``start`` s, a check reported twice or one that does not exist, a value that is not an encoded
    value, a cut stream.
    """
    if truncated:
        raise StreamBroken("the stream exceeds what the grader reads")
    results: dict[int, tuple[bool, str]] = {}
    kept_bug: dict[int, bool] = {}  # a hidden check answered as the base code does, or not answered
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
                results[number] = (False, f"{check.shown()} raised {str(record.get('error'))[:300]}")
                kept_bug[number] = True
                continue
            try:
                value = decode(record.get("value"))
            except (ValueError, RecursionError) as exc:
                raise StreamBroken(f"line {n}: {exc}") from exc
            passed = _equal(value, check.expected)
            kept_bug[number] = check.hidden and not passed and _equal(value, check.unfixed)
            results[number] = (passed, "" if passed else f"{check.shown()} returned {value!r:.200}, "
                                                          f"expected {check.expected!r:.200}")
        else:
            raise StreamBroken(f"line {n}: unknown event {str(event)[:40]!r}")
    failed: dict[str, list[str]] = {}
    for number, check in enumerate(checks):
        passed, why = results.get(number, (False, f"{check.shown()} returned nothing (the probe ended first)"))
        if import_error is not None:
            why = f"importing the module raised {import_error}"
        if not passed and not check.hidden:
            failed.setdefault(check.test_id, []).append(why)
    overfit = ""
    if finished and not failed:
        off_tests = [results[number][1] for number, check in enumerate(checks) if check.hidden and kept_bug.get(number)]
        if off_tests:
            overfit = f"{OVERFITS_TESTS}: every test passes, yet off the tests' inputs " + "; ".join(off_tests[:3])
    tests = dict.fromkeys(c.test_id for c in checks if not c.hidden)
    passed = {t: t not in failed for t in tests}
    lines = [f"FAILED {t} - {'; '.join(dict.fromkeys(failed[t]))}" for t in tests if t in failed]
    passed_count = sum(passed.values())
    counts = ", ".join(part for part in (f"{len(failed)} failed" if failed else "",
                                         f"{passed_count} passed" if passed_count else "") if part)
    return CheckOutcome(passed, "\n".join([*lines, counts or "no tests ran", *([overfit] if overfit else [])]),
                        finished, overfit)


def _equal(value: Any, expected: Any) -> bool:
    """``value == expected`` of two plain values (both the host's own objects: no agent code runs)."""
    try:
        return bool(value == expected)
    except RecursionError:
        return False
