"""posttrain's quick test runner: the bundled suite's tests, run the way pytest runs them, for a
tenth of pytest's start-up.

The bundled tasks' tests are module-level ``test_*`` functions with plain ``assert`` statements.
pytest spends about 0.35 s of CPU starting up for each run (importing itself, its plugins and
configuring), and the embedded default runs those tests thousands of times (every ``test`` action
of an episode, every grading, every validation); a run of this file costs about 0.03 s
(``python3 -S``: the standard library only). Each bundled task carries a copy at
``tests/posttrain_quicktest.py`` (a protected path, so grading restores it from the base commit
before it runs) and its test command is ``python3 -S tests/posttrain_quicktest.py ...``.

What it keeps of pytest, so that everything downstream reads it as it reads pytest:

- the command line the bundled suite uses: paths (files, or folders searched for ``test_*.py`` and
  ``*_test.py``), ``--junitxml PATH``; ``-q``, ``--tb=short`` and ``-p NAME`` are accepted and
  change nothing; anything else is a usage error (exit 4);
- node ids (``tests/test_x.py::test_y``), the test order (files sorted, functions in definition
  order), ``sys.path`` (the current folder, then each test file's folder, as ``python -m pytest``
  and its default import mode give);
- the ``--tb=short`` failure text: ``path:line: in function`` and the source line of each frame from
  the test down, then ``E`` lines: for a failed ``assert`` of one comparison its operands' values
  (``E   assert 6 == 7``, ``E    +  where 6 = k(3)``), else the exception as Python formats it; a
  test module that fails to import is a collection error and no test runs (exit 2);
- the short summary (``FAILED tests/test_x.py::test_y - assert 6 == 7``), the closing counts line,
  and the exit status (0 all passed, 1 some failed, 2 collection errors, 5 none collected);
- the JUnit XML report pytest writes (``classname`` and ``name`` per test case, ``failure`` and
  ``error`` elements);
- the grader's results stream (:mod:`evals.pytest_results`' protocol and its defences, written by
  the runner itself): with ``POSTTRAIN_RESULTS_FD`` naming a pipe, ``start`` before any test module
  is imported, a ``report`` for each collector that failed, ``collected``, ``setup``/``call``/
  ``teardown`` reports of each test, ``finish``, then ``os._exit`` so no ``atexit`` hook of the code
  under test runs. The descriptor moves to a high close-on-exec number and the variable leaves the
  environment.

Fixtures, classes, marks, parametrization and plugins are not supported: a test function with
parameters fails its setup. Stdlib only, one file, nothing imported from the project.
"""

# Nothing here imports more than Python itself loads at start-up, plus fcntl, unicodedata, reprlib
# and the C parser's node classes: ast, json, traceback or linecache would double a run's cost.
import _ast
import fcntl
import os
import reprlib
import stat
import sys
import time
import unicodedata

FD_ENV = "POSTTRAIN_RESULTS_FD"
RUNNER_FILE = "posttrain_quicktest.py"  # the copy's name in a task's tests/ folder
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, EXIT_NO_TESTS = 0, 1, 2, 4, 5
_COMPARE_OPS = {_ast.Eq: "==", _ast.NotEq: "!=", _ast.Lt: "<", _ast.LtE: "<=", _ast.Gt: ">", _ast.GtE: ">=",
                _ast.Is: "is", _ast.IsNot: "is not", _ast.In: "in", _ast.NotIn: "not in"}
_MAX_REPR = 240


class Stream:
    """The grader's results stream (one JSON object per line, one ``os.write`` each), or nothing."""

    def __init__(self) -> None:
        self.fd = self._open()
        self.session = os.urandom(12).hex()

    @staticmethod
    def _open() -> int | None:
        # as evals/pytest_results.py opens it: each file travels alone into a sandbox, so they share no module
        raw = os.environ.pop(FD_ENV, None)
        if raw is None:
            return None
        try:
            fd = int(raw)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return None
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 200)
            os.close(fd)
            return moved
        except (ValueError, OSError):
            return None

    def emit(self, **record) -> None:
        if self.fd is None:
            return
        line = to_json({**record, "session": self.session}).encode() + b"\n"
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            self.fd = None  # the reader is gone; the grader sees an unfinished stream


def _json_string(text: str) -> str:
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    if any(ord(c) < 0x20 or 0xD800 <= ord(c) <= 0xDFFF for c in out):
        out = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or 0xD800 <= ord(c) <= 0xDFFF else c for c in out)
    return f'"{out}"'


def to_json(record: dict) -> str:
    """One flat record (str, int and bool values) as compact JSON, as ``json.dumps`` writes it."""
    parts = []
    for key, value in record.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(int(value))
        else:
            text = _json_string(str(value))
        parts.append(f"{_json_string(key)}:{text}")
    return "{" + ",".join(parts) + "}"


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> tuple[list[str], str | None]:
    """``(paths, junitxml)`` from pytest's command line as the bundled suite writes it."""
    paths: list[str] = []
    junit = None
    args = iter(argv)
    for arg in args:
        if arg in ("-q", "--quiet", "-qq") or arg.startswith("--tb="):
            continue
        if arg == "-p":
            if next(args, None) is None:
                raise UsageError("argument -p: expected one argument")
        elif arg.startswith("-p"):
            continue
        elif arg == "--junitxml" or arg == "--junit-xml":
            junit = next(args, None)
            if junit is None:
                raise UsageError(f"argument {arg}: expected one argument")
        elif arg.startswith(("--junitxml=", "--junit-xml=")):
            junit = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise UsageError(f"unrecognized arguments: {arg} (posttrain's quick test runner takes paths, "
                             "--junitxml, -q, --tb and -p)")
        else:
            paths.append(arg)
    return paths or ["."], junit


def _is_test_file(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def find_test_files(paths: list[str]) -> list[str]:
    """Test files under ``paths``, relative to the current folder with ``/``, in pytest's order."""
    found: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for folder, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                found += [os.path.join(folder, f) for f in sorted(files) if _is_test_file(f)]
        elif os.path.exists(path):
            found.append(path)
        else:
            raise UsageError(f"file or directory not found: {path}")
    return [os.path.relpath(p).replace(os.sep, "/") for p in found]


class _SafeRepr(reprlib.Repr):
    """pytest's repr of values in assertion messages (``_pytest._io.saferepr``): reprlib's limits
    (6 items of a list, 4 of a dict), a failing ``__repr__`` named, the whole cut to ``maxsize`` with
    ``...`` in the middle."""

    def __init__(self, maxsize: int, use_ascii: bool = False) -> None:
        super().__init__()
        self.maxstring, self.maxsize, self.use_ascii = maxsize, maxsize, use_ascii

    def repr(self, x) -> str:
        try:
            text = ascii(x) if self.use_ascii else super().repr(x)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - the object's own __repr__ failed
            text = _repr_failed(exc, x)
        return _ellipsize(text, self.maxsize)

    def repr_instance(self, x, level: int) -> str:
        try:
            text = builtin_repr(x)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            text = _repr_failed(exc, x)
        return _ellipsize(text, self.maxsize)

    def repr_dict(self, x, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(x[k], level - 1)}" for k in list(x)[:self.maxdict]]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"


builtin_repr = repr


def _repr_failed(exc: BaseException, x) -> str:
    try:
        info = builtin_repr(exc)
    except Exception:  # noqa: BLE001
        info = "unpresentable exception"
    return f"<[{info} raised in repr()] {type(x).__name__} object at 0x{id(x):x}>"


def _ellipsize(text: str, maxsize: int) -> str:
    if len(text) > maxsize:
        i = max(0, (maxsize - 3) // 2)
        j = max(0, maxsize - 3 - i)
        return text[:i] + "..." + text[len(text) - j:]
    return text


def saferepr(value, maxsize: int = _MAX_REPR, use_ascii: bool = False) -> str:
    return _SafeRepr(maxsize, use_ascii).repr(value)


def compare_reprs(left, op: str, right) -> tuple[str, str]:
    """The operands of a failed comparison as pytest's first explanation line shows them: each cut
    to ``(80 - 15 - len(op) - 2) // 2`` characters; equal-looking strings in ``ascii``."""
    use_ascii = isinstance(left, str) and isinstance(right, str) and (
        unicodedata.normalize("NFD", left) == unicodedata.normalize("NFD", right))
    maxsize = (80 - 15 - len(op) - 2) // 2
    return saferepr(left, maxsize, use_ascii), saferepr(right, maxsize, use_ascii)


_SOURCES: dict[str, list[str]] = {}


def source_lines(filename: str) -> list[str]:
    """The lines of a source file (empty when it cannot be read), read once."""
    if filename not in _SOURCES:
        try:
            with open(filename, encoding="utf-8", errors="replace") as f:
                _SOURCES[filename] = f.read().splitlines()
        except OSError:
            _SOURCES[filename] = []
    return _SOURCES[filename]


def source_line(filename: str, lineno: int) -> str:
    lines = source_lines(filename)
    return lines[lineno - 1] if 0 < lineno <= len(lines) else ""


def _walk(node):
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, _ast.AST):
                todo.append(value)
            elif isinstance(value, list):
                todo += [v for v in value if isinstance(v, _ast.AST)]


def _assert_node(filename: str, lineno: int):
    try:
        tree = compile("\n".join(source_lines(filename)), filename, "exec", _ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError):
        return None
    for node in _walk(tree):
        if isinstance(node, _ast.Assert) and node.lineno <= lineno <= (node.end_lineno or node.lineno):
            return node
    return None


def _source_of(node, filename: str) -> str:
    lines = source_lines(filename)[node.lineno - 1:node.end_lineno]
    if not lines:
        return "?"
    if len(lines) == 1:
        return lines[0][node.col_offset:node.end_col_offset]
    return " ".join([lines[0][node.col_offset:], *(line.strip() for line in lines[1:-1]), lines[-1][:node.end_col_offset].strip()])


def _evaluate(node, frame) -> object:
    expression = _ast.Expression(node)
    code = compile(expression, "<assert>", "eval")
    return eval(code, frame.f_globals, dict(frame.f_locals))  # noqa: S307 - the test's own expression


def explain_assert(exc: AssertionError, frame, lineno: int) -> list[str] | None:
    """pytest's explanation of a failed ``assert`` in ``frame`` at ``lineno``: the operands' values
    (evaluated again in the test's namespace), and where the left one came from a call."""
    filename = frame.f_code.co_filename
    node = _assert_node(filename, lineno)
    if node is None:
        return None
    test = node.test
    try:
        if isinstance(test, _ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _COMPARE_OPS:
            left, right = _evaluate(test.left, frame), _evaluate(test.comparators[0], frame)
            op = _COMPARE_OPS[type(test.ops[0])]
            shown_left, shown_right = compare_reprs(left, op, right)
            lines = [f"assert {shown_left} {op} {shown_right}"]
            shown = test.left
        else:
            left = _evaluate(test, frame)
            lines = [f"assert {saferepr(left)}"]
            shown = test
    except Exception:  # noqa: BLE001 - evaluating again failed: fall back to the exception itself
        return None
    if isinstance(shown, _ast.Call):
        lines.append(f" +  where {saferepr(left)} = {_source_of(shown, filename)}")
    if node.msg is not None and exc.args:
        lines = [f"AssertionError: {exc.args[0]}", *lines]
    return lines


def _frames_text(tb, start_code) -> list[str]:
    """``path:line: in name`` and the stripped source line of each frame from ``start_code`` down."""
    out, started = [], start_code is None
    for frame, lineno in walk_tb(tb):
        if frame.f_code is start_code:
            started = True
        if not started:
            continue
        path = frame.f_code.co_filename
        try:
            shown = os.path.relpath(path)
            shown = path if shown.startswith("..") else shown
        except ValueError:
            shown = path
        out.append(f"{shown}:{lineno}: in {frame.f_code.co_name}")
        line = source_line(path, lineno).strip()
        out.append(f"    {line}" if line else "    ???")
    return out


def walk_tb(tb):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def exception_only(exc: BaseException) -> list[str]:
    """The exception's last lines as Python prints them (``traceback.format_exception_only``)."""
    if isinstance(exc, SyntaxError):
        import traceback  # rare: worth its import only here

        return "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n").split("\n")
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - the exception's own __str__ failed
        text = "<exception str() failed>"
    return f"{name}: {text}".split("\n") if text else [name]


def failure_text(exc: BaseException, start_code) -> tuple[str, str]:
    """``(longrepr, message)`` of an exception raised in a test (or while importing one)."""
    tb = exc.__traceback__
    lines = _frames_text(tb, start_code)
    explained = None
    last = None
    for frame, lineno in walk_tb(tb):
        last = (frame, lineno)
    if isinstance(exc, AssertionError) and last is not None and last[0].f_code is start_code:
        explained = explain_assert(exc, *last)
    if explained is None:
        explained = exception_only(exc)
    lines += [f"E   {line}" for line in explained]
    return "\n".join(lines), "\n".join(explained)


def _xml_escape(text: str, attribute: bool = False) -> str:
    text = "".join(c if c in "\t\n\r" or ord(c) >= 0x20 else f"#x{ord(c):02X}" for c in text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if attribute:
        text = text.replace('"', "&quot;").replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#09;")
    return text


class Result:
    __slots__ = ("nodeid", "outcome", "longrepr", "message", "duration", "collect")

    def __init__(self, nodeid: str, outcome: str, longrepr: str = "", message: str = "", duration: float = 0.0,
                 collect: bool = False) -> None:
        self.nodeid, self.outcome, self.longrepr, self.message = nodeid, outcome, longrepr, message
        self.duration, self.collect = duration, collect


def write_junit(path: str, results: list[Result], elapsed: float) -> None:
    cases = []
    for r in results:
        if r.collect:
            classname, name = "", r.nodeid[:-3].replace("/", ".") if r.nodeid.endswith(".py") else r.nodeid
        else:
            file, _, func = r.nodeid.partition("::")
            classname, name = file[:-3].replace("/", "."), func
        head = f'<testcase classname="{_xml_escape(classname, True)}" name="{_xml_escape(name, True)}" time="{r.duration:.3f}"'
        if r.outcome == "passed":
            cases.append(head + " />")
        else:
            tag, message = ("error", "collection failure") if r.collect else ("failure", r.message)
            cases.append(f'{head}><{tag} message="{_xml_escape(message, True)}">{_xml_escape(r.longrepr)}</{tag}></testcase>')
    failures = sum(r.outcome != "passed" and not r.collect for r in results)
    errors = sum(r.collect for r in results)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    xml = ('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" '
           f'errors="{errors}" failures="{failures}" skipped="0" tests="{len(results)}" time="{elapsed:.3f}" '
           f'timestamp="{stamp}" hostname="{_xml_escape(os.uname().nodename, True)}">{"".join(cases)}</testsuite></testsuites>')
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(xml)


def _module_name(path: str) -> str:
    return os.path.basename(path)[:-3]


def import_test_file(path: str):
    """Import ``path`` as pytest's default import mode does: its folder first on ``sys.path``, the
    module named by its file name."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = _module_name(path)
    module = type(sys)(name)
    module.__file__ = os.path.abspath(path)
    sys.modules[name] = module
    with open(path, "rb") as f:
        code = compile(f.read(), module.__file__, "exec")
    exec(code, module.__dict__)  # noqa: S102 - importing the test module
    return module


def test_functions(module) -> list[tuple[str, object]]:
    """The module's own ``test_*`` functions in definition order."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("test") and callable(value) and getattr(value, "__module__", None) == module.__name__:
            found.append((name, value))
    return sorted(found, key=lambda item: getattr(getattr(item[1], "__code__", None), "co_firstlineno", 0))


def fixture_error(func) -> str | None:
    """Why ``func`` cannot be called without pytest's fixtures, or None."""
    code = getattr(func, "__code__", None)
    if code is None or code.co_argcount - len(getattr(func, "__defaults__", None) or ()) <= 0:
        return None
    names = ", ".join(code.co_varnames[:code.co_argcount])
    return f"fixtures are not supported by posttrain's quick test runner: {func.__name__}({names})"


def run_test(nodeid: str, func) -> Result:
    started = time.perf_counter()
    try:
        func()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a test's exception is its failure
        longrepr, message = failure_text(exc, getattr(func, "__code__", None))
        return Result(nodeid, "failed", longrepr, message, time.perf_counter() - started)
    return Result(nodeid, "passed", duration=time.perf_counter() - started)


def _rule(title: str, char: str = "=", width: int = 80) -> str:
    title = f" {title} "
    left = max(0, (width - len(title)) // 2)
    return f"{char * left}{title}{char * max(0, width - left - len(title))}"


def _counts(results: list[Result]) -> str:
    failed = sum(r.outcome == "failed" for r in results)
    errors = sum(r.outcome == "error" for r in results)
    passed = sum(r.outcome == "passed" for r in results)
    parts = [f"{n} {word}" for n, word in ((failed, "failed"), (passed, "passed"),
                                            (errors, "error" if errors == 1 else "errors")) if n]
    return ", ".join(parts) or "no tests ran"


def main(argv: list[str] | None = None) -> int:
    stream = Stream()
    stream.emit(event="start", pid=os.getpid())
    started = time.perf_counter()
    out = sys.stdout
    try:
        paths, junit = parse_args(list(sys.argv[1:] if argv is None else argv))
        files = find_test_files(paths)
    except UsageError as exc:
        print(f"ERROR: usage: {RUNNER_FILE} [options] [paths]\n{exc}", file=sys.stderr)
        return _finish(stream, EXIT_USAGE)
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = os.getcwd()  # what `python -m pytest` puts first
    elif os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    collected: list[tuple[str, object]] = []
    errors: list[Result] = []
    for path in files:
        try:
            module = import_test_file(path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a module that fails to import is a collection error
            longrepr, message = failure_text(exc, None)
            errors.append(Result(path, "error", longrepr, message, collect=True))
            stream.emit(event="report", nodeid=path, when="collect", outcome="failed")
            continue
        collected += [(f"{path}::{name}", func) for name, func in test_functions(module)]
    stream.emit(event="collected", count=len(collected))

    results: list[Result] = list(errors)
    if not errors:
        progress = []
        for nodeid, func in collected:
            why = fixture_error(func)
            # each phase is reported before the next starts: a test that ends the process has
            # its setup on record and no call, and so failed
            stream.emit(event="report", nodeid=nodeid, when="setup", outcome="failed" if why else "passed")
            if why:
                result = Result(nodeid, "error", f"{nodeid}\nE   {why}", why)
            else:
                result = run_test(nodeid, func)
                stream.emit(event="report", nodeid=nodeid, when="call", outcome=result.outcome)
            stream.emit(event="report", nodeid=nodeid, when="teardown", outcome="passed")
            results.append(result)
            progress.append({"passed": ".", "failed": "F"}.get(result.outcome, "E"))
        if progress:
            line = "".join(progress)
            out.write(f"{line}{' ' * max(1, 73 - len(line))}[100%]\n")
    elapsed = time.perf_counter() - started

    bad = [r for r in results if r.outcome != "passed"]
    if errors:
        out.write(_rule("ERRORS") + "\n")
        for r in errors:
            out.write(_rule(f"ERROR collecting {r.nodeid}", "_") + "\n" + r.longrepr + "\n")
    failed = [r for r in bad if not r.collect]
    if failed:
        out.write(_rule("FAILURES") + "\n")
        for r in failed:
            out.write(_rule(r.nodeid.split("::")[-1], "_") + "\n" + r.longrepr + "\n")
    if junit:
        write_junit(junit, results, elapsed)
        out.write(f"- generated xml file: {os.path.abspath(junit)} -\n")
    if bad:
        out.write(_rule("short test summary info") + "\n")
        for r in bad:
            first = r.message.split("\n")[0]
            label = "ERROR" if r.outcome == "error" else "FAILED"
            out.write(f"{label} {r.nodeid}{' - ' + first if first else ''}\n")
    if errors:
        out.write(_rule(f"Interrupted: {len(errors)} error{'s' if len(errors) > 1 else ''} during collection", "!") + "\n")
    out.write(f"{_counts(results)} in {elapsed:.2f}s\n")
    if errors:
        status = EXIT_INTERRUPTED
    elif not collected:
        status = EXIT_NO_TESTS
    else:
        status = EXIT_FAILED if bad else EXIT_OK
    return _finish(stream, status)


def _finish(stream: Stream, status: int) -> int:
    """The ``finish`` record, then the process ends at once when a grader reads the stream: no
    ``atexit`` hook or finalizer of the code under test runs after the results are in."""
    if stream.fd is None:
        return status
    stream.emit(event="finish", exitstatus=status)
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            s.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
