"""A pytest plugin that streams each test's outcome to the grader, signed, and guarded against the code
under test, which runs in the same process.

The grader (:func:`evals.grading.grade_patch`) copies this file into the grading sandbox, outside the
repository and under a random module name, with a fresh 32-byte key beside it, and enables it for the
task's own test command through the environment (``PYTHONPATH`` and ``PYTEST_ADDOPTS=-p <module>``),
so the command itself stays as the task wrote it. ``POSTTRAIN_RESULTS_FD`` names the write end of a
pipe whose reader is the sandbox's daemon (``pxd``), which never imports the code under test;
``POSTTRAIN_RESULTS_KEY`` names the key's file. pytest imports ``-p`` plugins before any conftest,
test module or module of the repository, so everything below is in place before the first line of
the code under test runs.

The stream (stdlib and pytest only): one record a line, ``JSON<TAB>MAC``, where MAC is the hex
HMAC-SHA256 of ``<n>\\n<JSON>`` under the session's key (``n`` counts the session's records from 0;
JSON never holds a raw tab). Without a key the lines are bare JSON. The records:

- ``{"event": "start", "session": S, "pid": P, "guarded": G}`` when pytest loads the plugin;
- ``{"event": "report", "session": S, "nodeid": N, "when": "collect", "outcome": O}`` for a
  collector that did not pass (a test module that fails to import, a module-level skip);
- ``{"event": "collected", "session": S, "count": C}`` when collection is done;
- ``{"event": "report", "session": S, "nodeid": N, "when": W, "outcome": O}`` for each setup, call
  and teardown report (``pytest_runtest_logreport``);
- ``{"event": "tampered", "session": S, "reason": R}`` once, when the guard below catches the code
  under test at something no honest test run does (the grader scores such an attempt 0);
- ``{"event": "finish", "session": S, "exitstatus": X}`` last, from ``pytest_unconfigure`` after every
  other plugin (the JUnit writer included) is done; then the process ends at once with
  ``os._exit(X)``, so ``atexit`` hooks and finalizers of the code under test never run.

``S`` is a random id drawn when the plugin loads. The plugin moves the pipe to a high close-on-exec
descriptor and drops both variables from the environment, so programs the tests start inherit
neither. With no descriptor (or one that is not a pipe) the plugin does nothing: a pytest that the
tests start themselves streams nothing. Once read, the key file holds the key of the next pytest
session (``sha256(RATCHET_PREFIX + key)``): a command that runs pytest twice signs each session
with its own key, and no key of a session is left on disk while it runs.

**The guard** (Python 3.8+: ``sys.addaudithook``; an audit hook cannot be removed). What it knows
lives in the locals of one suspended generator, reached only through the audit hook; no module
attribute leads to it, and none of its code looks up a global or builtin name (the code under test
can rebind those). It holds:

- the key. The generator's frame is reachable only through ``gi_frame``/``gi_code`` (denied) and the
  garbage collector's ``get_objects``/``get_referrers``/``get_referents`` (denied while any frame of the
  repository's own code, tests aside, is on the stack: hypothesis and tests may use them), and
  ``sys.addaudithook`` is denied (a later hook would run inside the guard's own events). While the guard
  runs, signals are blocked (a handler already due runs before it resumes) and the collector is
  off, so no signal handler or finalizer of the code under test runs inside it. The process is made
  non-dumpable, so a process the tests start cannot read its memory.
- a snapshot, taken before any code under test runs, of the framework: every loaded module of
  ``pytest``, ``_pytest``, ``pluggy``, ``py``, ``unittest`` and this plugin (module dicts, each class's
  dict and MRO, closure cells, the ``sys.modules`` entries), then each installed plugin as pytest
  registers it, and the identity of every code object in them (with its globals).

What it checks, before the record of each test's call (and of each collection record, and
``finish``): the snapshot, in a few passes of C code (a module attribute replaced, as in
``_pytest.runner.call_and_report = fake``, a class attribute such as ``TestReport.__init__``, a
builtin such as ``str``, a framework module swapped in ``sys.modules``; what the framework does to
itself, a plain value or its own code in a slot of its own, is accepted); the implementations of
every hook that decides an outcome (``pytest_runtest_*``, ``pytest_pyfunc_call``, collection,
fixtures): framework, installed-plugin or conftest code only, so a plugin the code under test
registers, under any spelling of the plugin manager, is caught; no signal handler of the code under
test is installed. Before every record: the call stack, from the code that asks for it up to the
session's ``wrap_session`` frame, is framework or conftest code only (a record asked for by the code
under test, directly, from a thread or through the plugin manager, is refused; so is a plugin's
registration from such a stack); a report is the object ``pytest_runtest_makereport`` returned,
unchanged since; no report of a phase that raised (its ``CallInfo``, or the exception this plugin's
innermost ``pytest_runtest_call`` wrapper saw, which catches a report patched and restored within
one test) says ``passed``. At once, when it happens: ``__code__``, ``__defaults__``,
``__kwdefaults__`` or ``__class__`` set on a framework function or module, ``__code__`` on a test
function; a trace or profile function or a ``sys.monitoring`` callback set by the code under test;
code it compiles under the name of a file outside the repository or of one of its tests; ``ctypes`` symbols of the interpreter's internals; opening this
process's ``/proc/<pid>/mem``. Each of these is refused where an audit hook can refuse it, and each
ends in one signed ``tampered`` record. The cost: about 1 ms per test on a loaded 2-core machine
(``docs/reliability.md``).

**What it does not guarantee.** Code that runs before this plugin (a ``sitecustomize.py`` or ``.pth``
file, a module pytest imports at start-up shadowed by a file of the repository, a test command that
imports the code under test before pytest) can disable it. Native code (``ctypes`` pointers, an
extension module) can read and write the whole process, this generator included: no audit event
covers a ``ctypes`` pointer read. State of objects other than the framework's code, reached through
frames or ``sys.modules`` (a test item's ``obj``, a fixture's value, a test module's globals, the
standard library's modules), is not covered, nor a change made and undone between two full checks
that forges a setup or teardown. Files are not: a test module, a conftest or their cached bytecode
rewritten at run time, before pytest imports them, are read as the task's own. A later pytest
session of the same command can be subverted by an earlier one (the plugin and the next key are
files of the sandbox). Where the repository is pytest or pluggy itself (its tests patch the
framework) only signing is kept (``"guarded": false``), and so with a Python older than 3.8. Under
``pytest-xdist`` the tests run in worker processes this plugin does not stream from (such a run's
stream has no ``collected`` record and was refused before this guard too). The repository's own
pytest plugins (entry points or ``pytest_plugins`` modules inside it) are code under test: where they
implement a deciding hook, the run counts as tampered.
"""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import itertools
import operator
import os
import stat
import sys
import types

import pytest

FD_ENV = "POSTTRAIN_RESULTS_FD"
KEY_ENV = "POSTTRAIN_RESULTS_KEY"
EVENT = "posttrain.results"
RATCHET_PREFIX = b"posttrain-results-ratchet\x00"
KEY_BYTES = 32

# Modules whose code decides an outcome: snapshotted before any code under test, checked after.
_FRAMEWORK = ("pytest", "_pytest", "pluggy", "py", "unittest")
# Code on the stack of an import (a conftest's): trusted by identity, not snapshotted.
_IMPORT_MACHINERY = ("importlib", "importlib._bootstrap", "importlib._bootstrap_external", "importlib.util",
                     "importlib.machinery", "_frozen_importlib", "_frozen_importlib_external")
# Hooks whose implementations can change which tests run or how they end.
_DECIDING_HOOKS = ("pytest_runtest_", "pytest_pyfunc_call", "pytest_collect", "pytest_pycollect_",
                   "pytest_make_collect_report", "pytest_itemcollected", "pytest_generate_tests",
                   "pytest_fixture_setup", "pytest_exception_interact", "pytest_deselected")
_TESTISH_DIRS = ("tests", "test", "testing")
# Builtins that honest tests monkeypatch (and pytest's reporting does not call): not checked.
_PATCHABLE_BUILTINS = frozenset(("open", "input", "print", "__import__", "exit", "quit", "help", "breakpoint",
                                 "copyright", "credits", "license", "_"))
_DENIED = frozenset(("sys.addaudithook",))
_ROUTED = frozenset((EVENT, "object.__setattr__", "object.__delattr__", "object.__getattr__", "open", "exec",
                     "compile", "code.__new__", "sys.settrace", "sys.setprofile", "ctypes.dlsym",
                     "ctypes.dlsym/handle", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                     "sys.monitoring.register_callback")) | _DENIED
_INTERNAL_SYMBOLS = ("_Py", "PyInterpreterState", "PyThreadState_Get", "PyEval_GetFrame", "PyFrame_", "PySys_",
                     "PyGILState_GetThisThreadState", "PyGC_", "Py_AuditHook")
_EXIT = os._exit
_AUDIT = getattr(sys, "audit", None)


def _open_stream() -> int | None:
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


def _take_key() -> bytes | None:
    """The session's key from the file ``POSTTRAIN_RESULTS_KEY`` names, which then holds the next one."""
    path = os.environ.pop(KEY_ENV, None)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            key = os.read(fd, KEY_BYTES + 1)
            if len(key) != KEY_BYTES:
                return None
            os.ftruncate(fd, 0)
            os.pwrite(fd, hashlib.sha256(RATCHET_PREFIX + key).digest(), 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    return key


def _non_dumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): no process the tests start can read this one's memory or /proc files."""
    try:
        # inside the try: a Python without a usable ctypes only skips this
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


def _guard(box, event, args):
    """The audit hook (bound to ``box``, a tuple): runs on every audit event of the process.

    It looks up no global or builtin name: everything comes from ``box``. Cheap refusals happen
    here; an event that needs the guard's state goes to the generator, with signals blocked and the
    garbage collector off while it runs."""
    if event not in box[0]:
        return
    (_, gen, denied, refusal, protected, type_, id_, str_, bytes_, codetype, lock, gc_isenabled, gc_disable,
     gc_enable, sigmask, block, setmask, every_signal, flush, gettrace, getprofile, get_ident, main_thread,
     python_functions) = box
    if event == "object.__getattr__":
        if args[0] is not gen:
            return
    elif event in denied:
        raise refusal("the grader's pytest plugin denies " + event + " while the tests run")
    elif event == "open":
        path = args[0]
        if not ((type_(path) is str_ and path.endswith("mem")) or (type_(path) is bytes_ and path.endswith(b"mem"))):
            return
    elif event == "object.__setattr__" or event == "object.__delattr__":
        if id_(args[0]) not in protected and args[1] != "__code__":
            return
    elif event == "exec":
        code = args[0]
        if type_(code) is not codetype or not code.co_filename.endswith("conftest.py"):
            return
    elif event == "compile":
        name = args[1]
        if type_(name) is not str_ or not name.startswith("/"):
            return
    if get_ident() != main_thread and (type_(gettrace()) in python_functions or type_(getprofile()) in python_functions):
        # a trace function set through threading.settrace would see the guard's frames
        raise refusal("the grader's pytest plugin denies " + event + " under a Python trace or profile function")
    with lock:
        if gen.gi_running:
            return  # an event the guard itself raised
        collecting = gc_isenabled()
        gc_disable()
        masked = sigmask(block, every_signal)
        try:
            flush()  # a signal handler already due runs at this call, before the generator resumes
            verdict = gen.send((event, args))
        finally:
            sigmask(setmask, masked)
            if collecting:
                gc_enable()
    if verdict:
        raise refusal(verdict)


def _flush() -> None:
    """Called with signals blocked: Python runs any signal handler already due when a call starts."""


def _make_guardian(fd: int, key: bytes | None, session: str, guarded: bool, root_dir: str):
    """The generator that holds the key and the snapshot, and the ids of what it protects.

    Runs once, when the plugin loads, before any code under test. The functions defined in here run
    later (inside the generator) and look up no global or builtin name: each name they use is bound
    here, from objects taken now. ``tests/evals/test_pytest_tamper.py`` checks that with ``dis``."""
    # bound here as locals, not module globals that the code under test could rebind
    import _json
    import _signal

    # builtins and the C functions the guard needs, bound before the code under test can rebind them
    len_, type_, id_, all_, any_, map_, dict_, zip_, list_, tuple_ = (
        len, type, id, all, any, map, dict, zip, list, tuple)
    str_, bytes_, int_, bool_, float_, memoryview_ = str, bytes, int, bool, float, memoryview
    Exception_, OSError_, ValueError_, issubclass_, frozenset_ = Exception, OSError, ValueError, issubclass, frozenset
    write, getframe, encode_json, sha256, stat_fn = os.write, sys._getframe, _json.encode_basestring_ascii, \
        hashlib.sha256, os.stat
    getsignal = _signal.getsignal
    signals = tuple(sorted(_signal.valid_signals())) if guarded else ()
    mro_of = type.__dict__["__mro__"].__get__
    qualname_of = type.__dict__["__qualname__"].__get__
    module_of = type.__dict__["__module__"].__get__
    instance_dict = object.__getattribute__
    cell_get = types.CellType.cell_contents.__get__ if hasattr(types, "CellType") else None
    is_ = operator.is_
    chain_, repeat_, compress_ = itertools.chain, itertools.repeat, itertools.compress
    values_of = operator.methodcaller("values")
    FunctionType, MethodType, ModuleType, CodeType = types.FunctionType, types.MethodType, types.ModuleType, types.CodeType
    staticmethod_, classmethod_, property_ = staticmethod, classmethod, property
    EVENT_ = EVENT
    testish_dirs = _TESTISH_DIRS
    # what the interpreter keeps in any module's globals: warnings' once-only registry
    interpreter_state = frozenset_(("__warningregistry__",))
    inert_keys = frozenset_(("__doc__", "__module__", "__qualname__", "__annotations__", "__dict__", "__weakref__",
                             "__firstlineno__", "__static_attributes__", "__slots__", "__match_args__",
                             "__parameters__", "__orig_bases__", "__file__", "__cached__", "__loader__", "__spec__",
                             "__package__", "__name__", "__path__", "__all__", "__builtins__", "annotations",
                             "TYPE_CHECKING", "__final__", "__type_params__"))
    internal_symbols = _INTERNAL_SYMBOLS
    sys_modules = sys.modules
    builtins_module = builtins

    import unittest  # snapshotted with the framework: TestCase's asserts decide unittest-style tests

    # bound here as locals, not module globals that the code under test could rebind
    from _pytest.main import wrap_session
    from _pytest.outcomes import Skipped, XFailed
    from _pytest.reports import CollectReport, TestReport
    from _pytest.runner import CallInfo

    skipish = (Skipped, XFailed, unittest.SkipTest)
    wrap_session_code = wrap_session.__code__

    # ---- the snapshot, in plain containers
    modules: list = []  # [name, module, dict, keys tuple, values tuple, names not checked]
    classes: list = []  # [cls, mappingproxy, keys, values, mro]
    cells: list = []  # [cell, contents]
    by_name: dict = {}  # module name -> module, for sys.modules
    codes: dict = {}  # id(code) -> (code, globals, or None where any globals will do)
    protected: set = set()  # ids of framework functions and modules
    method_ids: set = set()  # ids of the functions framework classes hold (no class may borrow one)
    plugin_globals: set = set()  # ids of the dicts of installed plugins' modules, registered after the snapshot
    seen_classes: set = set()

    def add_codes(code, globals_) -> None:
        if id_(code) in codes:
            return
        codes[id_(code)] = (code, globals_)
        for const in code.co_consts:
            if type_(const) is CodeType:
                add_codes(const, globals_)

    def functions_in(value, depth: int):
        """The plain functions a module or class attribute holds (through wrappers and descriptors)."""
        found = []
        t = type_(value)
        if depth > 4:
            return found
        if t is FunctionType:
            found.append(value)
            wrapped = value.__dict__.get("__wrapped__")
            if wrapped is not None:
                found += functions_in(wrapped, depth + 1)
        elif t is staticmethod_ or t is classmethod_ or t is MethodType:
            found += functions_in(value.__func__, depth + 1)
        elif t is property_:
            for f in (value.fget, value.fset, value.fdel):
                found += functions_in(f, depth + 1)
        elif qualname_of(t) == "cached_property" and module_of(t) == "functools":
            found += functions_in(value.func, depth + 1)
        return found

    def add_function(f, filename) -> None:
        code = f.__code__
        if filename is not None and code.co_filename != filename:
            return  # defined elsewhere: what a plugin module holds is not necessarily its code
        add_codes(code, f.__globals__)
        protected.add(id_(f))
        for cell in f.__closure__ or ():
            try:
                cells.append([cell, cell_get(cell)])
            except ValueError_:
                pass

    def add_class(cls, module_name, filename) -> None:
        if id_(cls) in seen_classes or module_of(cls) != module_name:
            return
        seen_classes.add(id_(cls))
        proxy = cls.__dict__
        classes.append([cls, proxy, tuple_(proxy), tuple_(proxy.values()), mro_of(cls)])
        for value in list_(proxy.values()):
            if issubclass_(type_(value), type_):
                add_class(value, module_name, filename)
            else:
                for f in functions_in(value, 0):
                    add_function(f, filename)
                    method_ids.add(id_(f))

    def add_module(module, snapshot: bool, filename) -> None:
        """A module's code into ``codes``; with ``snapshot`` its attributes and classes are checked later.
        ``filename``: keep only functions defined in that file (a plugin registered later)."""
        name = module.__dict__.get("__name__")
        if type_(name) is not str_ or name in by_name:
            return
        d = module.__dict__
        for value in list_(d.values()):
            if issubclass_(type_(value), type_):
                add_class(value, name, filename)
            else:
                for f in functions_in(value, 0):
                    add_function(f, filename)
        if snapshot:
            by_name[name] = module
            modules.append([name, module, d, tuple_(d), tuple_(d.values()), interpreter_state])
            protected.add(id_(module))

    def testish(relative: str) -> bool:
        parts = relative.split("/")
        name = parts[-1]
        return (name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py")
                or any_(p in testish_dirs for p in parts[:-1]))

    if guarded:
        for name, module in sorted(sys.modules.items()):
            framework = any(name == p or name.startswith(p + ".") for p in _FRAMEWORK)
            if type(module) is ModuleType and (framework or module.__dict__.get("__file__") == __file__):
                add_module(module, True, None)
        for name in _IMPORT_MACHINERY:
            if type(sys.modules.get(name)) is ModuleType:
                add_module(sys.modules[name], False, None)
    if guarded:  # the builtins the framework's code calls (str, isinstance, ...); sys.modules not checked for it
        modules.append(["builtins", builtins, builtins.__dict__, tuple(builtins.__dict__),
                        tuple(builtins.__dict__.values()), _PATCHABLE_BUILTINS | interpreter_state])
    add_codes(_guard.__code__, None)
    add_codes(_flush.__code__, None)
    # the frame that imported this plugin (pytest's main, before any session): records asked for
    # before the session's own frame exists (a plugin's registration) are checked up to it
    boot_root = None
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame.f_code) in codes:
            boot_root = frame
        frame = frame.f_back
    del frame

    def guardian(key):
        # ---- the signing key, as the two padded hash states of HMAC-SHA256
        signing = key is not None
        if signing:
            padded = key + b"\x00" * (64 - len_(key))
            inner = sha256(bytes_(b ^ 0x36 for b in padded))
            outer = sha256(bytes_(b ^ 0x5C for b in padded))
            del padded
        del key
        seq = 0
        tampered = ""
        told = False
        root = None  # the first session's wrap_session frame
        first_config = None
        first_pm = None
        last_called = None  # (item, raised): what the innermost pytest_runtest_call wrapper saw
        last_made = None  # (report, outcome) as pytest_runtest_makereport returned it
        session_b = session.encode()
        root_len = len_(root_dir)
        volatile = {}  # (id of a module's dict or a class's mappingproxy, key) -> whether the key was there first
        checked_impls = ()  # the hooks' implementations last found to be framework code
        fast = []
        try:
            st = stat_fn("/proc/self/mem")
            mem_id = (st.st_dev, st.st_ino)
        except OSError_:
            mem_id = None

        def emit(fields: bytes) -> None:
            nonlocal seq
            line = b'{"session":"' + session_b + b'",' + fields + b"}"
            if signing:
                i = inner.copy()
                i.update(b"%d\n" % seq + line)
                o = outer.copy()
                o.update(i.digest())
                line = line + b"\t" + o.hexdigest().encode()
            seq += 1
            view = memoryview_(line + b"\n")
            while view:
                view = view[write(fd, view):]

        def quoted(text) -> bytes:
            return encode_json(text).encode()

        def trusted_frame(f) -> bool:
            c = f.f_code
            entry = codes.get(id_(c))
            return entry is not None and entry[0] is c and (entry[1] is None or entry[1] is f.f_globals)

        def where(f) -> str:
            c = f.f_code
            return c.co_filename + ":" + c.co_name

        def stack_problem(start, anchor) -> str:
            """'' when every frame from ``start`` up to ``anchor`` runs framework or conftest code."""
            f = start
            while f is not None:
                if f is anchor:
                    return ""
                if not trusted_frame(f):
                    return "code outside pytest asked for it (" + where(f) + ")"
                f = f.f_back
            return "it was asked for outside the pytest session (no session frame on the stack)"

        def agent_file(filename, globals_) -> bool:
            """Whether code of ``filename`` running in ``globals_`` is the repository's own (not its
            tests): a file under the repository; code made from a string is judged by the module whose
            globals it runs in."""
            if filename.startswith("/"):
                return filename.startswith(root_dir) and not testish(filename[root_len:])
            if filename.startswith("<frozen"):
                return False
            if type_(globals_) is not dict_ or not plain_keys(globals_):
                return True
            home = globals_.get("__file__")
            return type_(home) is not str_ or agent_file(home, None)

        def agent_on_stack(start):
            """The first frame from ``start`` down the whole stack that runs the repository's own code, or None."""
            f = start
            while f is not None:
                if not trusted_frame(f) and agent_file(f.f_code.co_filename, f.f_globals):
                    return f
                f = f.f_back
            return None

        def benign(v) -> bool:
            """A value the framework itself may put in its modules: a plain value, a closure of its
            own code, an instance of its own classes."""
            t = type_(v)
            if v is None or t is bool_ or t is int_ or t is float_ or t is str_ or t is bytes_:
                return True
            if t is FunctionType:
                entry = codes.get(id_(v.__code__))
                return entry is not None and entry[0] is v.__code__ and (
                    "<locals>" in v.__qualname__ or id_(v.__globals__) in plugin_globals)
            if issubclass_(t, type_):
                return False
            return any_(id_(base) in seen_classes for base in mro_of(t))

        def module_problem(entry) -> str:
            name, module, d, keys, values, unchecked = entry
            if len_(d) == len_(keys) and all_(map_(is_, d, keys)) and all_(map_(is_, d.values(), values)):
                return ""
            for k in list_(d):
                if type_(k) is not str_:
                    return name + " holds a key that is not a string"
            old = dict_(zip_(keys, values))
            for k, v in list_(d.items()):
                if k in unchecked or old.get(k, old) is v:
                    continue
                # a framework module may take on its own state; a builtin may be added, not replaced
                if (k in old) if module is builtins_module else not benign(v):
                    return "pytest's " + name + "." + k + " was replaced"
                volatile[(id_(d), k)] = True
            for k in keys:
                if k not in d and k not in unchecked:
                    return "pytest's " + name + "." + k + " was deleted"
            entry[3], entry[4] = tuple_(d), tuple_(d.values())  # the framework's own state: accepted
            return ""

        def class_problem(entry) -> str:
            cls, proxy, keys, values, mro = entry
            if mro_of(cls) is not mro:
                return "the bases of pytest's " + qualname_of(cls) + " were changed"
            if len_(proxy) == len_(keys) and all_(map_(is_, proxy, keys)) and all_(map_(is_, proxy.values(), values)):
                return ""
            named = module_of(cls) + "." + qualname_of(cls)
            old = dict_(zip_(keys, values))
            items = list_(proxy.items())
            for k, v in items:
                if type_(k) is not str_:
                    return "pytest's " + named + " holds a key that is not a string"
            for k in keys:
                if k not in proxy:
                    return "pytest's " + named + "." + k + " was deleted"
            for k, v in items:
                if old.get(k, old) is not v:
                    existed = volatile.get((id_(proxy), k), k in old)
                    if not benign_member(cls, k, v, existed):
                        return "pytest's " + named + "." + k + " was replaced"
                    volatile[(id_(proxy), k)] = existed
            entry[2], entry[3] = tuple_(proxy), tuple_(proxy.values())  # the framework's own doing: accepted
            return ""

        def benign_member(cls, name, v, existed) -> bool:
            """What pytest's own plugins do to its classes (``legacypath`` adds properties and replaces
            ``Config._getini_unknown_type``, ``debugging`` keeps its config on a class): a plain value or
            an instance of a framework class; or functions of framework code that are no class's
            methods, either under a new name no base class has, or named after the attribute."""
            t = type_(v)
            if t is property_:
                functions = [f for f in (v.fget, v.fset, v.fdel) if f is not None]
            elif t is staticmethod_ or t is classmethod_:
                functions = [v.__func__]
            elif t is FunctionType:
                functions = [v]
            else:
                return benign(v)
            for f in functions:
                if type_(f) is not FunctionType:
                    return False
                entry = codes.get(id_(f.__code__))
                if entry is None or entry[0] is not f.__code__ or entry[1] is not f.__globals__:
                    return False
                if id_(f.__globals__) in plugin_globals:
                    continue  # an installed plugin's own code (hypothesis wraps FixtureFunctionMarker.__call__)
                if id_(f) in method_ids or (existed and not f.__name__.endswith(name)):
                    return False
            if not existed:
                for base in mro_of(cls)[1:]:
                    if not plain_keys(base.__dict__) or name in base.__dict__:
                        return False
            return True

        def plain_keys(mapping) -> bool:
            """Every key an exact string: only then is a look-up in ``mapping`` free of the code under
            test (a key of another type could run code in ``__eq__``)."""
            return all_(map_(is_, map_(type_, mapping), repeat_(str_)))

        def slow_problem() -> str:
            """Entry by entry: what changed, and whether it is the framework's own doing."""
            if not all_(map_(plain_keys, fast[0])):
                return "a module or class of pytest holds a key that is not a string"
            for entry in modules:
                why = module_problem(entry)
                if why:
                    return why
            for entry in classes:
                why = class_problem(entry)
                if why:
                    return why
            for cell, contents in cells:
                try:
                    if cell_get(cell) is not contents:
                        return "a closure of pytest's code was changed"
                except ValueError_:
                    return "a closure of pytest's code was emptied"
            seen = 0
            for k, v in list_(sys_modules.items()):
                if type_(k) is not str_:
                    return "sys.modules holds a key that is not a string"
                expected = by_name.get(k)
                if expected is not None:
                    seen += 1
                    if v is not expected:
                        return "sys.modules[" + encode_json(k) + "] was replaced"
            if seen != len_(by_name):
                return "a module of pytest was removed from sys.modules"
            return ""

        def rebuild() -> None:
            """The snapshot flattened for :func:`fast_problem`; entries the framework itself changes
            (``volatile``) are left to a check of their own."""
            maps, mask, fvals, vol = [], [], [], []
            for name, module, d, keys, values, unchecked in modules:
                maps.append(d)
                for k, v in zip_(keys, values):
                    skip = k in unchecked or (id_(d), k) in volatile or inert(k, v)
                    mask.append(not skip)
                    if not skip:
                        fvals.append(v)
                    elif (id_(d), k) in volatile and k not in unchecked:
                        vol.append((d, k, None, v, True))
            for cls, proxy, keys, values, mro in classes:
                maps.append(proxy)
                for k, v in zip_(keys, values):
                    existed = volatile.get((id_(proxy), k))
                    check = existed is None and not inert(k, v)
                    mask.append(check)
                    if check:
                        fvals.append(v)
                    elif existed is not None:
                        vol.append((proxy, k, cls, v, existed))
            fast[:] = [tuple_(maps), tuple_(map_(len_, maps)), tuple_(mask), tuple_(fvals),
                       tuple_(c[0] for c in classes), tuple_(c[4] for c in classes), tuple_(c[0] for c in cells),
                       tuple_(c[1] for c in cells), tuple_(by_name), tuple_(by_name.values()), tuple_(vol)]

        def inert(key, value) -> bool:
            """An entry no code path reads to decide anything (documentation, bookkeeping, typing's
            markers): left out of the per-test check, to keep it short."""
            return key in inert_keys or module_of(type_(value)) == "typing"

        def fast_problem():
            """The snapshot checked in a few passes of C code: '' when nothing changed but the
            framework's own state, a reason, or None where :func:`slow_problem` must look."""
            maps, lens, mask, fvals, mro_classes, mros, cell_objs, cell_vals, names, mods, vol = fast
            if tuple_(map_(len_, maps)) != lens:
                return None
            # values in dict order, by identity: no look-up by key (a key of another type could run code in
            # __eq__); a key deleted and added again moves, which sends it to the slow path
            if not all_(map_(is_, compress_(chain_.from_iterable(map_(values_of, maps)), mask), fvals)):
                return None
            if not all_(map_(is_, map_(mro_of, mro_classes), mros)):
                return None
            try:
                if not all_(map_(is_, map_(cell_get, cell_objs), cell_vals)):
                    return "a closure of pytest's code was changed"
            except ValueError_:
                return "a closure of pytest's code was emptied"
            if not all_(map_(is_, map_(type_, sys_modules), repeat_(str_))):
                return "sys.modules holds a key that is not a string"
            if not all_(map_(is_, map_(sys_modules.get, names), mods)):
                return None
            if vol and not all_(map_(plain_keys, {id_(v[0]): v[0] for v in vol}.values())):
                return "a module or class of pytest holds a key that is not a string"
            for mapping, k, cls, base, existed in vol:
                v = mapping.get(k, vol)
                if v is base:
                    continue
                if v is vol or not (benign(v) if cls is None else benign_member(cls, k, v, existed)):
                    return None
            return ""

        def framework_problem() -> str:
            why = fast_problem()
            if why is None:
                why = slow_problem()
                if not why:
                    rebuild()
            return why

        def impls_problem(functions) -> str:
            nonlocal checked_impls
            if type_(functions) is not tuple_:
                return "the hooks' implementations came as a " + qualname_of(type_(functions))
            if len_(functions) == len_(checked_impls) and all_(map_(is_, functions, checked_impls)):
                return ""
            for f in functions:
                if type_(f) is MethodType:
                    f = f.__func__
                if type_(f) is not FunctionType:
                    return "a hook is implemented by an object that is not a function (" + qualname_of(type_(f)) + ")"
                c = f.__code__
                entry = codes.get(id_(c))
                if entry is None or entry[0] is not c or (entry[1] is not None and entry[1] is not f.__globals__):
                    return "the hook " + c.co_name + " is implemented by code outside pytest (" + c.co_filename + ")"
            checked_impls = functions
            return ""

        def handlers_problem() -> str:
            for n in signals:
                h = getsignal(n)
                if type_(h) is MethodType:
                    h = h.__func__
                if type_(h) is FunctionType:
                    c = h.__code__
                    entry = codes.get(id_(c))
                    if (entry is None or entry[0] is not c) and agent_file(c.co_filename, h.__globals__):
                        return "the code under test set a signal handler (" + c.co_filename + ":" + c.co_name + ")"
            return ""

        def fields_of(obj, names):
            """The exact-string attributes ``names`` of a plain instance, read from its dict."""
            d = instance_dict(obj, "__dict__")
            if type_(d) is not dict_:
                return None
            out = {}
            for k, v in list_(d.items()):
                if type_(k) is not str_:
                    return None
                if k in names:
                    out[k] = v
            return out

        def report_record(nodeid, fields, collect: bool) -> str:
            outcome = fields.get("outcome")
            when = "collect" if collect else fields.get("when")
            if type_(nodeid) is not str_ or outcome not in ("passed", "failed", "skipped") or type_(outcome) is not str_ \
                    or when not in ("collect", "setup", "call", "teardown") or type_(when) is not str_:
                return "a report with fields of the wrong kind reached the results"
            emit(b'"event":"report","nodeid":' + quoted(nodeid) + b',"when":"' + when.encode() + b'","outcome":"'
                 + outcome.encode() + b'"')
            return ""

        def raised(exc) -> bool:
            if exc is None:
                return False
            return not any_(base is s for base in mro_of(type_(exc)) for s in skipish)

        def made_problem(item, call, report, nodeid) -> str:
            nonlocal last_made
            last_made = None
            if type_(report) is not TestReport:
                return "pytest_runtest_makereport returned a " + qualname_of(type_(report))
            if type_(nodeid) is not str_:
                return "a report's node id is not a string"
            fields = fields_of(report, ("when", "outcome"))
            if fields is None:
                return "a report with a strange dict"
            outcome = fields.get("outcome")
            if outcome == "passed" and type_(outcome) is str_:
                if type_(call) is not CallInfo:
                    return "pytest_runtest_makereport was given a " + qualname_of(type_(call))
                info = fields_of(call, ("excinfo", "when"))
                if info is None or info.get("excinfo") is not None:
                    return "a phase that raised was reported as passed"
                if info.get("when") == "call" and last_called is not None and last_called[0] is item \
                        and last_called[1]:
                    return "the test raised, yet its report says passed"
            last_made = (report, outcome, nodeid)
            return ""

        def trust_plugin(plugin) -> None:
            """An installed plugin pytest registers (a module or an instance of a class of one), outside
            the repository: its code is trusted and its module snapshotted from now on."""
            module = plugin
            if type_(plugin) is not ModuleType:
                module_name = module_of(type_(plugin))
                module = sys_modules.get(module_name) if type_(module_name) is str_ else None
            if type_(module) is not ModuleType:
                return
            filename = module.__dict__.get("__file__")
            if type_(filename) is not str_ or not filename.startswith("/") or filename.startswith(root_dir):
                return
            add_module(module, True, filename)
            plugin_globals.add(id_(module.__dict__))
            rebuild()

        def anchor():
            return root if root is not None else boot_root

        def guarded_record(kind, args, caller) -> str:
            """Checks a record of the first session asks for, then writes it; the reason it is refused."""
            nonlocal last_called, last_made
            why = stack_problem(caller, anchor())
            if why:
                return "a test result was forged: " + why
            if kind == "called":
                last_called = (args[1], raised(args[2]))
                return ""
            if kind == "made":  # the snapshot is checked at the record of this report
                return made_problem(args[1], args[2], args[3], args[4])
            if kind == "finish":
                why = framework_problem() or handlers_problem()
                if not why and type_(args[1]) is int_:
                    emit(b'"event":"finish","exitstatus":%d' % args[1])
                return why
            # report, collect: (kind, report, node id, plugin manager, deciding hooks' functions);
            # collected: (kind, count, plugin manager, functions)
            if args[-2] is not first_pm:
                return "a record was asked for with another plugin manager"
            fields = None
            if kind == "report":
                report = args[1]
                made, last_made = last_made, None
                if type_(report) is not TestReport:
                    return "a report of type " + qualname_of(type_(report)) + " reached the results"
                if made is None or made[0] is not report:
                    return "a report that pytest_runtest_makereport never returned reached the results"
                fields = fields_of(report, ("when", "outcome"))
                if fields is None or fields.get("outcome") is not made[1] or type_(args[2]) is not str_ \
                        or args[2] != made[2]:
                    return "a report was changed after pytest_runtest_makereport returned it"
            # the snapshot and the hooks once a test (at its call), at each collection record and at the
            # end: a change that forged a setup is still there at the call of that test
            when = fields.get("when") if fields is not None else None
            if kind != "report" or (type_(when) is str_ and when == "call"):
                why = framework_problem() or handlers_problem() or impls_problem(args[-1])
                if why:
                    return why
            if kind == "collected":
                if type_(args[1]) is int_:
                    emit(b'"event":"collected","count":%d' % args[1])
                return ""
            if kind == "collect":
                report = args[1]
                fields = fields_of(report, ("outcome",)) if type_(report) is CollectReport else None
                if fields is None:
                    return "a collect report of the wrong kind reached the results"
                return report_record(args[2], fields, True)
            return report_record(args[2], fields, False)

        rebuild()
        started = False
        event, args = yield None
        while True:
            verdict = None
            caught = ""
            try:
                caller = getframe(2)  # 0: this generator, 1: the audit hook, 2: whoever raised the event
                if event == EVENT_:
                    kind = args[0]
                    if id_(caller.f_code) not in callers.get(kind, ()):
                        caught = "a record was asked for by code other than the grader's plugin (" + where(caller) + ")"
                    elif kind == "start":
                        if not started:
                            started = True
                            emit(b'"event":"start","pid":%d,"guarded":' % args[1] + (b"true" if guarded else b"false"))
                    elif kind == "plugin":
                        if first_pm is None:
                            first_pm = args[2]
                        if args[2] is first_pm and guarded:
                            why = stack_problem(caller, anchor())
                            if why:
                                caught = "a pytest plugin was registered, and " + why
                            else:
                                trust_plugin(args[1])
                    elif kind == "configure":
                        if first_config is None:
                            first_config = args[1]
                            f = caller
                            while f is not None and f.f_code is not wrap_session_code:
                                f = f.f_back
                            root = f if f is not None else boot_root
                    elif not guarded:
                        if kind == "report" or kind == "collect":
                            fields = fields_of(args[1], ("when", "outcome"))
                            caught = report_record(args[2], fields, kind == "collect") if fields is not None else \
                                "a report with a strange dict reached the results"
                        elif kind == "collected" and type_(args[1]) is int_:
                            emit(b'"event":"collected","count":%d' % args[1])
                        elif kind == "finish" and type_(args[1]) is int_:
                            emit(b'"event":"finish","exitstatus":%d' % args[1])
                    else:
                        caught = guarded_record(kind, args, caller)
                elif event == "object.__getattr__":
                    caught = "the code under test read the grader's guard (" + args[1] + ")"
                    verdict = "the grader's pytest plugin cannot be inspected"
                elif event == "object.__setattr__" or event == "object.__delattr__":
                    obj, name = args[0], args[1]
                    if id_(obj) in protected and guarded:
                        caught = "the code under test set " + name + " of pytest's code"
                        verdict = "the grader's pytest plugin denies changing pytest's code"
                    elif guarded and name == "__code__" and type_(obj) is FunctionType:
                        filename = obj.__code__.co_filename
                        if filename.startswith(root_dir) and testish(filename[root_len:]):
                            caught = "the code under test replaced the code of the test " + obj.__code__.co_name
                            verdict = "the grader's pytest plugin denies changing a test's code"
                elif event == "exec":
                    if guarded and not stack_problem(caller, anchor()):
                        add_codes(args[0], None)  # a conftest pytest itself imports
                elif event == "open":
                    try:
                        st = stat_fn(args[0])
                        if mem_id is not None and (st.st_dev, st.st_ino) == mem_id:
                            caught = "the code under test opened this process's memory"
                            verdict = "the grader's pytest plugin denies reading this process's memory"
                    except (OSError_, ValueError_):
                        pass
                elif event == "sys.settrace" or event == "sys.setprofile" or event == "sys.monitoring.register_callback":
                    # a trace, profile or (3.12+) monitoring callback runs inside whatever runs, the guard included
                    f = agent_on_stack(caller) if guarded else None
                    if f is not None:
                        caught = "the code under test called " + event + " (" + where(f) + ")"
                        verdict = "the grader's pytest plugin denies " + event + " to the code under test"
                elif event == "compile" or event == "code.__new__":
                    # code named after a file outside the repository, or after one of its tests, would
                    # pass for that file's code; the direct caller decides (importlib compiling a module
                    # the repository imports is framework code)
                    name = args[1]
                    borrowed = not name.startswith(root_dir) or testish(name[root_len:]) \
                        if type_(name) is str_ and name.startswith("/") else False
                    if guarded and borrowed and not trusted_frame(caller) \
                            and agent_file(caller.f_code.co_filename, caller.f_globals):
                        caught = "the code under test made code named after " + name + " (" + where(caller) + ")"
                        verdict = "the grader's pytest plugin denies code named after another file"
                elif event == "gc.get_objects" or event == "gc.get_referrers" or event == "gc.get_referents":
                    # the collector reaches every object, the guard's frame included: not for the code under
                    # test (hypothesis, the tests themselves may use it)
                    f = agent_on_stack(caller)
                    if f is not None:
                        verdict = "the grader's pytest plugin denies " + event + " to the code under test"
                elif event == "ctypes.dlsym" or event == "ctypes.dlsym/handle":
                    name = args[1]
                    if type_(name) is str_ and any_(name.startswith(p) for p in internal_symbols):
                        caught = "the code under test looked up the interpreter's " + name + " through ctypes"
                        verdict = "the grader's pytest plugin denies ctypes access to the interpreter's internals"
            except Exception_:  # an object of an unexpected shape: fail closed, never crash pytest
                caught = caught or "the grader's guard met an object it could not check"
            if caught and not tampered:
                tampered = caught
            if tampered and not told:
                told = True
                try:
                    emit(b'"event":"tampered","reason":' + quoted(tampered))
                except OSError_:
                    pass
            caller = f = args = obj = fields = None
            event, args = yield verdict

    callers: dict = {}  # record kind -> ids of the plugin's code allowed to ask for it (filled by _start)
    gen = guardian(key)
    del key
    next(gen)
    return gen, frozenset(protected), callers


def _start() -> bool:
    """Open the stream, take the key, arm the guard and write ``start``; False with no stream."""
    global _AUDIT
    fd = _open_stream()
    if fd is None:
        return False
    key = _take_key()
    _non_dumpable()
    root = os.path.realpath(os.getcwd()) + "/"
    # locals, not module globals that the code under test could rebind
    import _pytest
    import pluggy

    under_test = any(os.path.realpath(m.__file__).startswith(root) for m in (_pytest, pluggy))
    auditing = hasattr(sys, "addaudithook")
    gen, protected, callers = _make_guardian(fd, key, os.urandom(12).hex(), auditing and not under_test, root)
    del key
    recorder = _Recorder.__dict__
    for kind, function in (("start", _start), ("plugin", pytest_plugin_registered), ("configure", pytest_configure),
                           ("called", recorder["pytest_runtest_call"]), ("made", recorder["pytest_runtest_makereport"]),
                           ("report", recorder["pytest_runtest_logreport"]),
                           ("collect", recorder["pytest_collectreport"]),
                           ("collected", recorder["pytest_collection_finish"]), ("finish", recorder["pytest_unconfigure"])):
        callers[kind] = frozenset((id(function.__code__),))
    if auditing:
        # locals, not module globals that the code under test could rebind
        import _signal
        import _thread
        import gc

        box = (_ROUTED, gen, _DENIED, RuntimeError, protected | {id(_guard), id(_flush)}, type, id, str, bytes,
               types.CodeType, _thread.RLock(), gc.isenabled, gc.disable, gc.enable, _signal.pthread_sigmask,
               _signal.SIG_BLOCK, _signal.SIG_SETMASK, frozenset(_signal.valid_signals()), _flush, sys.gettrace,
               sys.getprofile, _thread.get_ident, _thread.get_ident(), frozenset((types.FunctionType, types.MethodType)))
        sys.addaudithook(types.MethodType(_guard, box))
    else:  # a Python without audit hooks: the records are signed, nothing is guarded
        _AUDIT = lambda event, *args: gen.send((event, args))  # as sys.audit hands (event, args) to a hook
    _AUDIT(EVENT, "start", os.getpid())
    return True


# ---------------------------------------------------------------- the hooks


def _hook_caller_type():
    # a local, not a module global that the code under test could rebind
    import pluggy

    for holder, name in ((pluggy, "HookCaller"), (getattr(pluggy, "_hooks", None), "_HookCaller"),
                         (getattr(pluggy, "hooks", None), "_HookCaller")):
        found = getattr(holder, name, None)
        if isinstance(found, type):
            return found
    return None


_HOOK_CALLER = _hook_caller_type()
_NEW_STYLE_WRAPPERS = "wrapper" in type(pytest.hookimpl).__call__.__code__.co_varnames  # pluggy 1.1+


def _deciding_functions(pm) -> tuple:
    """The functions implementing every hook that decides an outcome; a hook caller that is not
    pluggy's own is listed itself (the guard refuses anything that is not framework code)."""
    found = []
    relay = pm.hook
    for name in list(vars(relay)):
        if not name.startswith(_DECIDING_HOOKS):
            continue
        caller = vars(relay)[name]
        if type(caller) is not _HOOK_CALLER:
            found.append(caller)
            continue
        found += [impl.function for impl in caller.get_hookimpls()]
    return tuple(found)


def _exception_of(outcome):
    """The exception an old-style hook wrapper's outcome carries (pluggy before 1.1), or None."""
    excinfo = getattr(outcome, "_excinfo", None)
    if excinfo is not None:
        return excinfo[1]
    return getattr(outcome, "_exception", None)


class _Recorder:
    """The first session's recorder, registered by :func:`pytest_configure`; a pytest the tests run
    in this process (its own config) gets none."""

    def __init__(self, config) -> None:
        self.config = config
        self.pm = config.pluginmanager
        self.status = None

    if _NEW_STYLE_WRAPPERS:
        @pytest.hookimpl(wrapper=True, trylast=True)
        def pytest_runtest_call(self, item):
            # innermost of the wrappers registered after the conftests: sees the test's exception
            # before any wrapper the code under test could add around it
            try:
                result = yield
            except BaseException as exc:
                _AUDIT(EVENT, "called", item, exc)
                raise
            _AUDIT(EVENT, "called", item, None)
            return result
    else:
        @pytest.hookimpl(hookwrapper=True, trylast=True)
        def pytest_runtest_call(self, item):
            outcome = yield
            _AUDIT(EVENT, "called", item, _exception_of(outcome))

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        _AUDIT(EVENT, "made", item, call, report, str(report.nodeid))

    def pytest_collectreport(self, report) -> None:
        if not report.passed:
            _AUDIT(EVENT, "collect", report, str(report.nodeid), self.pm, _deciding_functions(self.pm))

    def pytest_collection_finish(self, session) -> None:
        _AUDIT(EVENT, "collected", len(session.items), self.pm, _deciding_functions(self.pm))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report) -> None:
        # the guard checks the hooks at a test's call (a setup or teardown record carries none)
        functions = _deciding_functions(self.pm) if report.when == "call" else ()
        _AUDIT(EVENT, "report", report, str(report.nodeid), self.pm, functions)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.status = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config) -> None:
        if config is not self.config or self.status is None:
            return
        _AUDIT(EVENT, "finish", self.status)
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        _EXIT(self.status)


_RECORDER: list = []


def pytest_plugin_registered(plugin, manager) -> None:
    if _ACTIVE:
        _AUDIT(EVENT, "plugin", plugin, manager)


def pytest_configure(config) -> None:
    if not _ACTIVE or _RECORDER:
        return
    _AUDIT(EVENT, "configure", config)
    _RECORDER.append(_Recorder(config))
    config.pluginmanager.register(_RECORDER[0], "posttrain-results-recorder")


_ACTIVE = False
_ACTIVE = _start()
