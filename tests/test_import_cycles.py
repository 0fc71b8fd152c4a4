"""No import cycles among the project's modules.

Every ``import`` and ``from ... import`` statement of every module counts, wherever it stands: at
module level, inside a function, under ``if TYPE_CHECKING:``. An import moved into a function
still ties the two modules together (each needs the other to work), so it is an edge here too.
Relative imports are resolved against the importing module's package, and ``from X import Y`` is an
edge to ``X.Y`` when ``Y`` is a submodule of the project, else to ``X``. An import names its deepest
project module only: ``import serving.local_engine`` is an edge to ``serving.local_engine``, not to ``serving``.
Imports through ``importlib`` with a computed name are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dagster_project", "assets", "viewer", "training", "evals", "serving", "sandboxes")


def project_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the given top-level packages."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _deepest_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``module`` imports, by every import statement in its file."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _deepest_module(alias.name, modules)
                if target is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".") if package else []
                if node.level - 1 > len(anchor):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                target = submodule if submodule in modules else _deepest_module(base, modules)
                if target is not None:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = project_modules(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's
    algorithm, iterative), each written as a path that returns to its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    first = min(component)
    parents: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == first:
                    chain = [node]
                    while chain[-1] != first:
                        chain.append(parents[chain[-1]])
                    return chain[::-1] + [first]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle inside component {sorted(component)}")


def test_project_modules_import_each_other_without_a_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 50, f"found only {len(graph)} project modules under {ROOT}"
    found = cycles(graph)
    assert not found, "import cycles among project modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walker_sees_relative_function_level_and_submodule_imports(tmp_path):
    """The graph on a small tree with a known cycle: a relative import inside a function, an absolute
    ``from package import submodule``, and a ``from module import name`` closing it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from pkg import c\nimport os\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    (pkg / "d.py").write_text("from . import a\nfrom .sub.b import *\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.sub": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.a", "pkg.sub.b"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
