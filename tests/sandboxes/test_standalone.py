"""The programs shipped into sandboxes share sandboxes/standalone.py and still run as one file each.

pxd and the grader's probe are written once where they share code (the ``_json`` codec, ``prctl``,
pxd's ``os.path`` stand-ins): each takes it with one import line, which the shipped copy replaces by
standalone.py's text (sandboxes.programs). What runs in a sandbox must import nothing but the
standard library, from one file, on the sandbox's own ``python3``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals.call_checks import PROBE_SOURCE
from sandboxes import standalone
from sandboxes.programs import PXD, STANDALONE, shipped_source
from sandboxes.toolchain import SANDBOX_PYTHON

PROGRAMS = (PXD, PROBE_SOURCE)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names  # imports left out: a module imported twice is the same module


def test_standalone_is_written_into_the_program_with_only_built_in_imports():
    """standalone.py may only import built-in modules (it is in pxd's start), has no ``__future__``
    line (it lands in the middle of a file), and defines no name a program defines again."""
    tree = ast.parse(STANDALONE.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert {a.name for n in top for a in n.names} <= set(sys.builtin_module_names) | {"errno", "stat"}
    assert not any(isinstance(n, ast.ImportFrom) for n in top)
    shared = _top_level_names(tree)
    for program in PROGRAMS:
        own = ast.parse(program.read_text())
        imports = [n for n in ast.walk(own) if isinstance(n, ast.ImportFrom) and n.module == "sandboxes.standalone"]
        assert len(imports) == 1, program
        redefined = _top_level_names(own) & shared
        assert not redefined, f"{program.name} defines again {sorted(redefined)}: the shipped copy would shadow them"


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_the_shipped_program_imports_only_the_standard_library(program, tmp_path):
    """The shipped copy is one file: every import in it is a standard library module, and it runs
    with nothing of the project importable (-I -S, in an empty folder, on the sandbox's python3)."""
    data = shipped_source(program)
    modules = set()
    for node in ast.walk(ast.parse(data)):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"__future__", "_sha2"}  # _sha2: _sha256 of Python 3.12 on
    assert modules <= allowed, modules - allowed
    shipped = tmp_path / "shipped.py"
    shipped.write_bytes(data)
    # the module's top level (all its imports), not its main
    run = subprocess.run([SANDBOX_PYTHON, "-I", "-S", "-c", "import sys; f = sys.argv[1]; exec(compile(open(f).read(), f, "
                          "'exec'), {'__name__': 'shipped'}); print('loaded')", str(shipped)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout == "loaded\n", run.stderr[-2000:]


def test_a_program_without_its_import_line_is_refused_by_name(tmp_path):
    """The shipped copy needs the one block to replace; a program without it is an error naming it."""
    program = tmp_path / "tool.py"
    program.write_text("import sys\nprint(sys.argv)\n")
    with pytest.raises(ValueError, match=r"tool\.py must import sandboxes\.standalone in one block"):
        shipped_source(program)


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_the_codec_is_the_json_packages(separators):
    """Both programs' separators, on values with escapes, non-ASCII, nesting and special floats."""
    loads, dumps = standalone.json_codec(*separators)
    for value in ({"a": [1, -2.5, "\u00e9\n\ud800", None, True, {"b": []}]}, [float("inf"), 1e300, ""], "x"):
        assert dumps(value) == json.dumps(value, separators=separators)
        assert loads(json.dumps(value, indent=2).encode()) == json.loads(json.dumps(value))
    for bad in (b"", b"[1,", b"[1] x", b"\xff"):
        with pytest.raises(ValueError):
            loads(bad)


def test_the_path_stand_ins_are_os_paths(tmp_path, monkeypatch):
    """realpath and normpath answer as os.path does (links, ``..``, missing parts), and the
    command search tries what ``os.get_exec_path`` lists."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "rel").symlink_to("real/sub")
    monkeypatch.chdir(tmp_path)
    for path in (f"{tmp_path}/link/sub/..", "link/./sub", "rel/../x/y", "/", ".", "..", f"{tmp_path}//link/",
                 "missing/../rel"):
        assert standalone.realpath(path) == os.path.realpath(path), path
    for path in ("", "/", "//", "///a", "a/../..", "../a/./b/", "/../a", "a//b/../c", "//a/b/.."):
        assert standalone.normpath(path) == os.path.normpath(path), path
    env = {"PATH": "/usr/bin::/bin/"}
    assert standalone.exec_candidates("sh", env) == [os.path.join(d, "sh") for d in os.get_exec_path(env)]
    assert standalone.exec_candidates("./x", env) == ["./x"]
    assert standalone.exec_candidates("sh", {}) == [os.path.join(d, "sh") for d in os.get_exec_path({})]


def test_posttrain_sandbox_shipped_prints_the_shipped_file(tmp_path):
    """The command that gives an image built by hand its pxd, and what it says of a wrong file."""
    posttrain = Path(sys.executable).with_name("posttrain")
    done = subprocess.run([str(posttrain), "sandbox", "shipped", str(PXD)], capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout == shipped_source(PXD), done.stderr[-2000:]
    (tmp_path / "tool.py").write_text("print(1)\n")
    done = subprocess.run([str(posttrain), "sandbox", "shipped", str(tmp_path / "tool.py")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "tool.py must import sandboxes.standalone in one block" in done.stderr


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_the_programs_still_run_as_files_of_the_repository(program, tmp_path):
    """``python3 -I -S sandboxes/pxd.py`` (bench/load_pxd.py, a developer) runs with nothing of the
    project importable but the file's own folder: its block takes standalone.py from the repository."""
    run = subprocess.run([SANDBOX_PYTHON, "-I", "-S", "-c", "import sys; f = sys.argv[1]; exec(compile(open(f).read(), f, "
                          "'exec'), {'__name__': 'raw', '__file__': f}); print('loaded')", str(program)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout == "loaded\n", run.stderr[-2000:]
    if program == PXD:
        run = subprocess.run([SANDBOX_PYTHON, "-I", "-S", str(program), "--port", "1"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and "unexpected argument '--port'" in run.stderr, run.stderr[-2000:]
