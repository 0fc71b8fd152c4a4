"""The bundled suite's graded calls: each made in a process of its own, judged where no agent code runs.

The grader (:mod:`evals.call_checks`) copies this file into the grading sandbox, outside the
repository and under a random name, beside a spec naming the calls to make: for each check its
number, the function and the arguments (Python literals), never the value the test expects. It runs

    python3 -I -S /tmp/.posttrain-grader/<name>.py SPEC

in the task's folder after removing the tests and ``.git``, so no file in the sandbox holds an
expected value.

Two kinds of process, and only one of them holds the results pipe (``POSTTRAIN_RESULTS_FD``, read by
the sandbox's daemon):

- **the parent** reads the spec, deletes it, makes itself non-dumpable (so no process of its uid
  can trace it, read its memory or take its descriptors through ``/proc/PID/fd`` or
  ``pidfd_getfd``), and never imports the task's module;
- **one child per call** (or one for all the calls when the spec says ``one_process``, which the
  grader does only for the reference solution and the base code answering hidden inputs in a sandbox
  no agent touched), forked from the parent: it closes the results pipe before anything else,
  imports the module, makes its one call and writes what came back on a pipe of its own, as one
  JSON object. Its only output is its own return value: whatever the agent's code does in that
  process (rewrite this file's functions, find descriptors, kill itself, fork, hang), it cannot
  write the stream that decides grades. A child that dies, hangs past ``call_timeout_s``, or
  writes anything but one well-formed answer fails its check.

The parent writes to the results pipe, one JSON object a line:

- ``{"event": "start"}`` first;
- ``{"event": "import_error", "error": E}`` when the first call's process could not import the
  module (no further call is made);
- ``{"event": "value", "check": N, "value": V}``: the call returned ``V``, encoded by
  :func:`encode` (only ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``, ``tuple`` and
  ``dict`` of exactly those types: no subclass, so no ``__eq__`` of the agent's takes part);
- ``{"event": "raised", "check": N, "error": E}``: the call raised, returned something that is
  not plain data, or its process died, hung or answered garbage;
- ``{"event": "finish"}`` last; then the parent ends at once (``os._exit``).

The grader compares the values with the expected ones it keeps on the host. Stdlib only, one file
(it runs on the sandbox's own ``python3``): its one import from the project,
:mod:`sandboxes.standalone` (the stand-ins it shares with pxd), is written into the copy the grader
ships in place of the import's block (:func:`sandboxes.programs.shipped_source`), so the sandbox's
copy imports nothing of the project's tree.

It starts on built-in modules where it can: the JSON codec from ``_json`` (the json package's C
half; the package imports ``re``), ``prctl`` through ``_ctypes`` (the ctypes package's C half), both
standalone's, and ``SIGKILL`` from ``_signal`` (the signal module imports ``enum``): about half of
its start's CPU, paid at every grading. Where a C half is missing or answers otherwise, the package.
"""

import fcntl
import os
import select
import stat
import sys
import time

# >>> standalone: where the probe is shipped, sandboxes/standalone.py's text stands here (sandboxes.programs)
try:
    from sandboxes.standalone import json_codec, make_not_dumpable
except ModuleNotFoundError:  # run as a file from the repository: standalone.py is in ../sandboxes
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandboxes"))
    from standalone import json_codec, make_not_dumpable
    del sys.path[0]
# <<< standalone

FD_ENV = "POSTTRAIN_RESULTS_FD"
MAX_ITEMS = 10_000  # elements of one returned value; a larger one is not plain data for grading
MAX_DEPTH = 32
MAX_ANSWER_BYTES = 4 << 20  # a child's whole answer; more is garbage
DEFAULT_CALL_TIMEOUT_S = 10.0
try:
    from _signal import SIGKILL
except ImportError:  # not CPython
    from signal import SIGKILL


json_loads, json_dumps = json_codec(", ", ": ")


class NotPlainData(Exception):
    pass


def encode(value, depth: int = 0, budget: list | None = None):
    """``value`` as tagged JSON (``["int", "6"]``, ``["list", [...]]``...) when it is plain data of
    exactly the builtin types; else :class:`NotPlainData`."""
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise NotPlainData("the value is too large or too deep")
    kind = type(value)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value is True]
    if kind is int:
        return ["int", int.__repr__(value)]
    if kind is float:
        return ["float", float.__repr__(value)]
    if kind is str:
        return ["str", str.__str__(value)]
    if kind is list or kind is tuple:
        return [kind.__name__, [encode(item, depth + 1, budget) for item in kind.__iter__(value)]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)] for k, v in dict.items(value)]]
    raise NotPlainData(f"a {kind.__module__}.{kind.__qualname__}, not plain data")


def _open_stream():
    # as evals/pytest_results.py and evals/quicktest.py open it: each file travels alone into a sandbox
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


def _error(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:500]
    except Exception:  # noqa: BLE001 - the exception's own __str__ failed
        return "an exception whose text cannot be shown"


def _child(results_fd, answer_fd: int, module_name: str, calls: list) -> None:
    """``calls`` (``[function, args]`` pairs) in a forked child; never returns. Runs the agent's code,
    so nothing it writes is trusted beyond being these calls' answers: ``{"answers": [...]}``, one
    ``{"value": V}`` or ``{"raised": E}`` a call, or ``{"import_error": E}``."""
    try:
        if results_fd is not None:
            os.close(results_fd)  # before any agent code: the grades' stream is out of this process
        os.setpgid(0, 0)  # its own group, so that the parent can end whatever the call starts
        parsed = [(function, eval(args_source, {"__builtins__": {}})) for function, args_source in calls]  # noqa: S307 - the grader's own literals
        sys.path.insert(0, os.getcwd())
        try:
            module = __import__(module_name)
        except BaseException as exc:  # noqa: BLE001 - any failure to import is the patch's
            answer = {"import_error": _error(exc)}
        else:
            answers = []
            for function, args in parsed:
                try:
                    answers.append({"value": encode(getattr(module, function)(*args))})
                except BaseException as exc:  # noqa: BLE001 - a call that raises fails its check
                    answers.append({"raised": _error(exc)})
            answer = {"answers": answers}
        view = memoryview(json_dumps(answer).encode())
        while view:
            view = view[os.write(answer_fd, view):]
    finally:
        os._exit(0)


def _wait_answer(pid: int, answer_fd: int, timeout_s: float) -> tuple[dict | None, str]:
    """The child's answer (or None) and, when there is none, why. The answer is what the pipe held
    when the child ended: a process the call left behind keeps the pipe open but is not waited for."""
    deadline = time.monotonic() + timeout_s
    chunks, size, why, status = [], 0, "", None
    os.set_blocking(answer_fd, False)
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f"the call did not answer within {timeout_s:g}s"
            break
        select.select([answer_fd], [], [], min(left, 0.05))
        ended, code = os.waitpid(pid, os.WNOHANG)
        if ended:
            status = code
        try:  # after the child ended: what it wrote is all in the pipe now
            while size <= MAX_ANSWER_BYTES:
                data = os.read(answer_fd, 65536)
                if not data:
                    break
                chunks.append(data)
                size += len(data)
        except BlockingIOError:
            pass
        if size > MAX_ANSWER_BYTES:
            why = f"the call's answer exceeds {MAX_ANSWER_BYTES} bytes"
            break
    os.close(answer_fd)
    for target in (-pid, pid):  # the call's group, then the child itself if it left the group
        try:
            os.kill(target, SIGKILL)
        except OSError:
            pass
    if status is None:
        _, status = os.waitpid(pid, 0)
    if why:
        return None, why
    try:
        answer = json_loads(b"".join(chunks))
    except (ValueError, RecursionError):
        answer = None
    if isinstance(answer, dict) and len(answer) == 1 and next(iter(answer)) in ("answers", "import_error"):
        return answer, ""
    if os.WIFSIGNALED(status):
        return None, f"the call's process was killed by signal {os.WTERMSIG(status)}"
    if not chunks:
        return None, "the call's process ended without an answer"
    return None, "the call's process wrote something that is not an answer"


def _emit_answer(emit, number: int, answer, why: str) -> None:
    """The record of check ``number`` from its answer (a dict of one key), or ``raised`` with ``why``."""
    if not isinstance(answer, dict) or len(answer) != 1:
        emit(event="raised", check=number, error=why or "the call's process wrote something that is not an answer")
    elif "raised" in answer:
        emit(event="raised", check=number, error=str(answer["raised"])[:500])
    elif "value" in answer:
        try:
            emit(event="value", check=number, value=answer["value"])
        except (ValueError, RecursionError):  # nested past what json writes: not plain data
            emit(event="raised", check=number, error="the call's answer is not plain data")
    else:
        emit(event="raised", check=number, error="the call's process wrote something that is not an answer")


def main(argv) -> int:
    fd = _open_stream()

    def emit(**record) -> None:
        if fd is None:
            print(json_dumps(record), flush=True)
            return
        view = memoryview(json_dumps(record).encode() + b"\n")
        while view:
            view = view[os.write(fd, view):]

    with open(argv[1], encoding="utf-8") as f:
        spec = json_loads(f.read())
    try:
        os.unlink(argv[1])  # the calls' processes need none of it
    except OSError:
        pass
    make_not_dumpable()
    timeout_s = float(spec.get("call_timeout_s", DEFAULT_CALL_TIMEOUT_S))
    calls = spec["calls"]
    # one process a call, unless the spec says the module is the grader's own (the reference solution
    # answering hidden inputs in a sandbox no agent touched): then one process makes them all
    batches = [calls] if spec.get("one_process") else [[call] for call in calls]
    emit(event="start")
    for batch in batches:
        answer_read, answer_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(answer_read)
            _child(fd, answer_write, spec["module"], [[function, args] for _, function, args in batch])
        os.close(answer_write)
        answer, why = _wait_answer(pid, answer_read, timeout_s * len(batch))
        if answer is not None and "import_error" in answer:
            if batch[0] is calls[0]:
                emit(event="import_error", error=str(answer["import_error"])[:500])
                break
            answer, why = None, f"importing the module raised {str(answer['import_error'])[:300]}"
        answers = answer["answers"] if answer is not None else None
        if not isinstance(answers, list) or len(answers) != len(batch):
            answers, why = [None] * len(batch), why or "the call's process wrote something that is not an answer"
        for (number, _, _), one in zip(batch, answers):
            _emit_answer(emit, number, one, why)
    emit(event="finish")
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
