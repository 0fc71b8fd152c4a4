"""What the programs shipped into sandboxes share: built-in-module stand-ins for ``json``, ``ctypes``' prctl and ``os.path``.

Two programs run inside sandboxes as one file each, on whatever ``python3`` the sandbox has: the
daemon ``sandboxes/pxd.py`` and the grader's ``evals/call_probe.py``. Both start on the
interpreter's built-in modules where the packages would pull in ``re``, ``enum``, ``collections``
and friends (milliseconds of CPU a start, paid at every sandbox and every grading:
docs/benchmarks.md, "pxd on built-in modules"), so both need the same few stand-ins, written here
once:

- :func:`json_codec`: ``json.loads``/``json.dumps`` made of ``_json``, the json package's C half;
- :func:`make_not_dumpable`: ``prctl(PR_SET_DUMPABLE, 0)`` through ``_ctypes``, the ctypes
  package's C half;
- :func:`realpath`, :func:`normpath`, :func:`exec_candidates`: what pxd needs of ``os.path`` and
  ``os.get_exec_path`` without the ``os`` module (whose start makes the collection ABCs of
  ``os.environ``: about 1 ms of CPU a sandbox).

Each falls back to the package where the C half is missing or answers otherwise.

How it gets into a sandbox: a program imports it with one line, ``from sandboxes.standalone import
...``, which works where the program is imported from the repository (tests, tools). The copy
shipped into a sandbox is :func:`sandboxes.programs.shipped_source`: the program's text with that
line replaced by this file's text, so the one file in the sandbox imports nothing but the standard
library, and nothing of the project's tree. This file therefore imports only built-in modules, has
no ``from __future__`` line, and defines no name that a program defines again (tests/sandboxes/
test_standalone.py checks both).
"""

import errno
import posix
import stat

DEFAULT_EXEC_PATH = "/bin:/usr/bin"  # os.defpath: the folders searched for a command when env has no PATH
_JSON_SPACE = " \t\n\r"
_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3


def _unserializable(obj):
    raise TypeError(f"Object of type {obj.__class__.__name__} is not JSON serializable")


def json_codec(item_separator: str, key_separator: str):
    """``(loads, dumps)``: ``json.loads`` of bytes or text and ``json.dumps(obj, separators=(item_separator,
    key_separator))`` (``ensure_ascii``, ``allow_nan`` as the package), made of ``_json`` set up as the
    json package sets it up (the package itself imports ``re`` and ``enum``: about 4 ms of CPU a
    start). Where ``_json`` is missing or does not take these arguments, or a sample does not come out
    as the package gives it, the json package."""
    try:
        import _json

        class Context:  # what the C scanner reads of a json.JSONDecoder
            strict = True
            object_hook = None
            object_pairs_hook = None
            parse_float = float
            parse_int = int
            parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__

        scan = _json.make_scanner(Context)
        # markers None: no cycle check (nothing these programs write is cyclic)
        encode = _json.make_encoder(None, _unserializable, _json.encode_basestring_ascii, None, key_separator,
                                    item_separator, False, False, True)

        def loads(data):
            # a UnicodeDecodeError is a ValueError, as json.loads raises it
            text = data.decode("utf-8", "surrogatepass") if isinstance(data, bytes) else data
            start = len(text) - len(text.lstrip(_JSON_SPACE))
            try:
                obj, end = scan(text, start)
            except StopIteration as exc:
                raise ValueError(f"Expecting value: char {exc.value}") from None
            if text[end:].strip(_JSON_SPACE):
                raise ValueError(f"Extra data: char {end}")
            return obj

        def dumps(obj) -> str:
            return "".join(encode(obj, 0))

        sample = {"a": [1, -2.5, "\u00e9\n", None, True, False, {}], "b": ""}
        expected = ('{"a"K[1I-2.5I"\\u00e9\\n"InullItrueIfalseI{}]I"b"K""}'
                    .replace("I", item_separator).replace("K", key_separator))
        if (dumps(sample) != expected
                or loads(b' {"a": [1, -2.5, "\\u00e9\\n", null, true, false, {}], "b": ""} ') != sample):
            raise ValueError("_json does not answer as the json package does")
        return loads, dumps
    except (ImportError, AttributeError, TypeError, ValueError):
        import json

        return json.loads, lambda obj: json.dumps(obj, separators=(item_separator, key_separator))


def _libc_prctl():
    """``(prctl, get_errno)``: libc's ``prctl(2)`` (int arguments, int result, errno kept) through
    ``_ctypes``, declared as the ctypes package declares ``c_int`` and a ``CDLL(None,
    use_errno=True)`` function (the package's own start costs about 1.6 ms of CPU); through the
    package where ``_ctypes`` is missing or declines these."""
    try:
        import _ctypes

        class CInt(_ctypes._SimpleCData):
            _type_ = "i"

        class CFunction(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = CInt

        class Libc:  # what CFuncPtr reads of a ctypes.CDLL: the dlopen handle (of the program itself)
            _handle = _ctypes.dlopen(None, 0)

        return CFunction(("prctl", Libc)), _ctypes.get_errno
    except (ImportError, AttributeError, TypeError, OSError):
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl, ctypes.get_errno


def make_not_dumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``, checked with ``PR_GET_DUMPABLE``: processes of the same uid may
    then neither ptrace this one, nor take its descriptors with ``pidfd_getfd``, nor open its
    ``/proc/<pid>/fd``, ``mem`` or ``environ`` (all need CAP_SYS_PTRACE). :class:`OSError` when
    the process stays dumpable."""
    prctl, get_errno = _libc_prctl()
    if prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        code = get_errno()
        raise OSError(code, f"prctl(PR_SET_DUMPABLE, 0) failed: {posix.strerror(code)}")
    if prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(0, "still dumpable after prctl(PR_SET_DUMPABLE, 0)")


def realpath(path: str) -> str:
    """``os.path.realpath(path)``: absolute, every symbolic link on the way resolved, ``.`` and
    ``..`` taken out after them; a component that does not exist is kept as it is."""
    parts = (path if path.startswith("/") else posix.getcwd() + "/" + path).split("/")
    parts.reverse()
    done, links = "", 0
    while parts:
        part = parts.pop()
        if part in ("", "."):
            continue
        if part == "..":
            done = done.rsplit("/", 1)[0]
            continue
        candidate = f"{done}/{part}"
        try:
            is_link = stat.S_ISLNK(posix.lstat(candidate).st_mode)
        except OSError:
            is_link = False
        if not is_link:
            done = candidate
            continue
        links += 1
        if links > 40:
            raise OSError(errno.ELOOP, posix.strerror(errno.ELOOP), path)
        target = posix.readlink(candidate)
        if target.startswith("/"):
            done = ""
        parts.extend(reversed(target.split("/")))
    return done or "/"


def normpath(path: str) -> str:
    """``os.path.normpath(path)`` (posixpath's, as it is): ``.``, empty components and ``x/..``
    pairs taken out, without looking at the file system."""
    if not path:
        return "."
    slashes = 2 if path.startswith("//") and not path.startswith("///") else 1 if path.startswith("/") else 0
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part != ".." or (not slashes and not parts) or (parts and parts[-1] == ".."):
            parts.append(part)
        elif parts:
            parts.pop()
    return "/" * slashes + "/".join(parts) or "."


def exec_candidates(name: str, env: dict) -> list:
    """The paths ``os.execvpe`` and ``subprocess`` try, in order, for the command ``name``: ``name``
    itself when it has a slash, else ``name`` in each folder of ``env``'s ``PATH``
    (``os.get_exec_path``; ``DEFAULT_EXEC_PATH`` without one), an empty folder meaning this one."""
    if "/" in name:
        return [name]
    return [f"{d}/{name}" if d and not d.endswith("/") else d + name
            for d in env.get("PATH", DEFAULT_EXEC_PATH).split(":")]
