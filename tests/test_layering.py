"""The package order of docs/design.md, and bench/ and tests/ on the product's public surface only.

Imports are read as ``tests/test_import_cycles.py`` reads them: every import statement of every file,
wherever it stands (module level, inside a function, under ``if TYPE_CHECKING:``).

Layers. docs/design.md writes the order once, as a code span of package names joined by ``->``, top
first (``dagster_project -> assets -> ... -> sandboxes``); a package may import the packages below it
and never one above it. The domain packages and the viewer import no Dagster (``dagster_pipes`` is
allowed: it is what lets a process report to Dagster without depending on it).

Public. A project module is public when no part of its dotted name starts with ``_`` (``__init__``
and ``__main__`` aside); a name is public when it does not start with ``_``. A file in ``bench/``
reaches the product through public names of public modules only: no ``from pkg.mod import _name``,
no ``import pkg._mod``, no ``mod._name`` on a project module it imported. Tests are white-box tests of
their own package: a file under ``tests/<package>/`` may use that package's private names, as the
package's own modules do, and only public names of every other package; the files of ``tests/``
that belong to no package (``tests/e2e``, ``tests/reliability``, ...) use public names only. No file
of ``bench/`` imports ``tests`` (a bench builds what it needs from the product, e.g. ``serving.tiny``).
Imports through ``importlib`` with a computed name, and module paths given as strings (a trainer
config's ``environment``), are not seen.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_import_cycles import PACKAGES, ROOT, import_graph

DESIGN = ROOT / "docs" / "design.md"
DOMAIN = ("training", "evals", "serving", "sandboxes", "viewer")  # run without Dagster


def layers_in_design(text: str) -> list[str]:
    """The package order written in design.md: the first code span of names joined by `` -> ``."""
    for span in re.findall(r"`([^`\n]+)`", text):
        names = span.split(" -> ")
        if len(names) > 2 and all(re.fullmatch(r"[a-z_]+", n) for n in names):
            return names
    raise AssertionError(f"{DESIGN}: no package order written as `a -> b -> c` found")


def layer_violations(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Every import from a package to one at its own level or above it, ``module -> module``."""
    rank = {package: i for i, package in enumerate(order)}
    bad = []
    for module, targets in sorted(graph.items()):
        source = module.split(".")[0]
        for target in sorted(targets):
            package = target.split(".")[0]
            if package != source and rank[package] <= rank[source]:
                bad.append(f"{module} -> {target} ({package} is not below {source} in docs/design.md)")
    return bad


def _import_nodes(path: Path):
    return [n for n in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(n, (ast.Import, ast.ImportFrom))]


def dagster_imports(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Imports of ``dagster`` or a ``dagster_*`` library other than ``dagster_pipes`` in the packages."""
    bad = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in _import_nodes(path):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if not node.level else []
                for name in names:
                    top = name.split(".")[0]
                    if (top == "dagster" or top.startswith("dagster_")) and top != "dagster_pipes":
                        bad.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}")
    return bad


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path, own_package: str | None, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The private project names and modules a bench or test file reaches (see the module docstring),
    and, for a file of ``bench/``, its imports of ``tests``. ``own_package``: the package whose private
    names the file may use."""
    in_bench = "bench" in path.parts
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    bad = []
    bound: dict[str, str] = {}  # local name -> the project module it was bound to

    def foreign(module: str) -> bool:
        top = module.split(".")[0]
        return top in packages and top != own_package

    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if in_bench and alias.name.split(".")[0] == "tests":
                    bad.append(f"{where}:{node.lineno}: imports {alias.name}")
                if foreign(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        bad.append(f"{where}:{node.lineno}: imports private module {alias.name}")
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif node.module and not node.level:
            if in_bench and node.module.split(".")[0] == "tests":
                bad.append(f"{where}:{node.lineno}: imports {node.module}")
            if foreign(node.module):
                if any(_private(part) for part in node.module.split(".")):
                    bad.append(f"{where}:{node.lineno}: imports from private module {node.module}")
                for alias in node.names:
                    if _private(alias.name):
                        bad.append(f"{where}:{node.lineno}: imports private name {node.module}.{alias.name}")
                    else:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                bad.append(f"{where}:{node.lineno}: uses private name {bound[base.id]}...{node.attr}")
    return bad


def bench_violations(root: Path = ROOT) -> list[str]:
    return [v for path in sorted((root / "bench").rglob("*.py")) for v in private_uses(path, None)]


def violations_in_tests(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "tests").rglob("*.py")):
        parts = path.relative_to(root / "tests").parts
        own = parts[0] if len(parts) > 1 and parts[0] in PACKAGES else None
        bad += private_uses(path, own)
    return bad


def test_design_md_orders_every_package_and_each_imports_only_those_below_it():
    order = layers_in_design(DESIGN.read_text())
    assert sorted(order) == sorted(PACKAGES), f"docs/design.md orders {order}; the packages are {sorted(PACKAGES)}"
    graph = import_graph(ROOT)
    assert len(graph) > 50
    bad = layer_violations(graph, order)
    assert not bad, "imports against the package order of docs/design.md:\n" + "\n".join(bad)


def test_domain_packages_and_the_viewer_run_without_dagster():
    bad = dagster_imports(ROOT, DOMAIN)
    assert not bad, "Dagster imported where only dagster_pipes may be:\n" + "\n".join(bad)


def test_bench_and_tests_reach_the_product_through_public_names_only():
    bad = bench_violations() + violations_in_tests()
    assert not bad, "private names or tests/ reached from bench/ or tests/:\n" + "\n".join(bad)


def test_the_checks_see_planted_violations(tmp_path):
    """An arrow up the order, a Dagster import in a domain package, and a bench file that imports
    tests/ and private names three ways: each is reported."""
    for package in ("top", "low"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "top" / "a.py").write_text("def f():\n    from low import b\n")
    (tmp_path / "low" / "b.py").write_text("from top.a import f\nimport dagster\nimport dagster_pipes\n")
    graph = import_graph(tmp_path, ("top", "low"))
    assert layer_violations(graph, ["top", "low"]) == ["low.b -> top.a (top is not below low in docs/design.md)"]
    assert layer_violations(graph, ["low", "top"]) == ["top.a -> low.b (low is not below top in docs/design.md)"]
    assert dagster_imports(tmp_path, ("low",)) == ["low/b.py:2: imports dagster"]
    (tmp_path / "bench").mkdir()
    bench = tmp_path / "bench" / "x.py"
    bench.write_text("from tests.training.conftest import save_tiny_qwen\nfrom training.base_model import _examples\n"
                     "import serving._wire\nfrom training import progress\nprogress._plain({})\n"
                     "from training.base_model import BaseModelSpec\nBaseModelSpec.__name__\n")
    assert [v.split(": ", 1)[1] for v in private_uses(bench, None)] == [
        "imports tests.training.conftest", "imports private name training.base_model._examples",
        "imports private module serving._wire", "uses private name training.progress..._plain"]
    own = tmp_path / "tests" / "training" / "test_x.py"
    own.parent.mkdir(parents=True)
    own.write_text("from training.base_model import _examples\nfrom evals.bundled import _write_repo\n")
    assert [v.split(": ", 1)[1] for v in private_uses(own, "training")] == [
        "imports private name evals.bundled._write_repo"]
