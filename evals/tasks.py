"""What a task is, and the loaders that turn each source format into one schema.

A :class:`Task` is the same thing whatever it came from: an id, a repository snapshot (a local git
repo at a base commit, or a container image), an instruction, the *target tests* (they must go from
failing to passing) and the *existing tests* (they must keep passing), how to run the tests and in
which report format, resource limits, and free-form metadata.

Sources:

- **Harbor / DeepSWE** (:func:`load_harbor`): a folder of task folders, each with ``task.toml``,
  ``instruction.md`` and ``tests/config.json`` (``f2p_node_ids``, ``p2p_node_ids``, ``grade``), read
  whole: ``environment/Dockerfile`` (the recipe :mod:`sandboxes.harbor` builds), ``tests/`` (the
  verifier's files: ``test.sh``, ``test.patch``, ...) and ``solution/solution.patch`` are recorded in
  the task's metadata (``environment``, ``tests_dir``, ``test_files``, ``solution_patch``, and
  ``writable_root``: whether its sandboxes need a writable root, :func:`needs_writable_root`). A task
  folder that lacks a file, or whose file is malformed (not UTF-8, not valid TOML/JSON, a bad key), is
  returned as an :class:`IncompleteTask` with the reason naming the file, never dropped. Given a
  folder of repository sources (``sources=``), a task that cannot be built from them (no recipe, a
  recipe the builder refuses, no source of its repository, a source without its base commit, no
  verifier script) is incomplete too, with that reason.
- **SWE-bench** (:func:`load_swebench`): JSONL or Parquet rows with ``instance_id``,
  ``problem_statement``, ``base_commit`` and ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` as JSON strings, and
  the hidden ``test_patch``. Graded as the bundled suite is: the files the test patch names, every
  ``conftest.py`` and pytest's configuration are protected (:data:`PYTEST_CONFIG_PATHS`), the test
  patch is applied over them, and the JUnit report is written inside the repository, where the
  sandbox's daemon reads it.
- **Bundled** (:func:`load_bundled`): the generated suite of small Python repos (see
  :mod:`evals.bundled`), each task a ``task.json`` beside its git repo.

:func:`load_tasks` picks the loader from what ``PATH`` is; :func:`summarize` gives the summary that
``posttrain tasks inspect`` prints.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import statistics
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

from evals.signals import parse_patch
from sandboxes.files import NotARegularFile, check_regular_file, open_regular_file, read_regular_bytes
from sandboxes.harbor import RecipeError, find_source, parse_dockerfile, source_has_commit

REPORT_FORMATS = ("junit", "ctrf")

# pytest's configuration wherever it may be found (pytest reads each of these files in the folders
# above the tests it runs, and every conftest.py beside and above them): protected paths of a task
# whose patch may touch any file (a SWE-bench row), so that no patch changes how its tests run.
PYTEST_CONFIG_PATHS = ("**/conftest.py", "**/pytest.toml", "**/.pytest.toml", "**/pytest.ini", "**/.pytest.ini",
                       "**/tox.ini", "**/setup.cfg", "**/pyproject.toml:tool.pytest")
SWEBENCH_REPORT = ".git/posttrain-report.xml"  # inside .git: no patch ships one, the daemon reads it


class TaskLoadError(ValueError):
    """A task source is malformed; the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class ResourceLimits:
    """What one sandbox of the task may use, and how long agent and tests may run."""

    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 4096
    agent_timeout_s: float = 600.0
    test_timeout_s: float = 300.0


@dataclass(frozen=True)
class Task:
    """One task in the schema every source is loaded into.

    ``repo_path`` (a local git repository whose ``base_commit`` is the state the agent starts from)
    or ``image`` (a container image with the repository at ``workdir``) names the snapshot.
    ``test_command`` runs the tests inside the sandbox, in the repository folder, and writes the
    reports listed in ``report_paths`` in ``report_format`` (``junit`` or ``ctrf``); for CTRF,
    ``ctrf_node_id`` says how a test id is built (``name`` or ``suite.name``).
    ``protected_paths`` are restored from the base commit before grading, so an agent cannot pass by
    editing the tests: each is a path (a file or a folder, restored whatever the patch did), a
    ``**/NAME`` pattern (every path the patch changed whose file name matches ``NAME``, a glob:
    ``**/conftest.py``), or ``PATH.toml:TABLE`` (the file, a path or a pattern, restored where the
    patch changed that dotted table: ``**/pyproject.toml:tool.pytest``); see
    :func:`evals.grading.grade_patch`. A SWE-bench task's ``metadata["test_patch"]`` is applied after
    them. When ``editable_paths`` is set, only the patch's changes to those paths are graded (a
    one-file task cannot be passed by adding a ``conftest.py`` or shadowing pytest). ``split``
    (``train`` / ``eval``) and ``difficulty`` (1..3) are set where the source defines them (the
    bundled suite), else empty / 0.
    """

    id: str
    source: str
    language: str
    instruction: str
    target_tests: tuple[str, ...]
    existing_tests: tuple[str, ...]
    test_command: str
    report_format: str
    report_paths: tuple[str, ...]
    base_commit: str | None = None
    repo_path: str | None = None
    image: str | None = None
    workdir: str = "/app"
    ctrf_node_id: str = "name"
    protected_paths: tuple[str, ...] = ()
    editable_paths: tuple[str, ...] = ()
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    split: str = ""
    difficulty: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            raise TaskLoadError("task: empty id")
        if self.report_format not in REPORT_FORMATS:
            raise TaskLoadError(f"task {self.id}: report format {self.report_format!r}, expected one of {REPORT_FORMATS}")
        if self.repo_path is None and self.image is None:
            raise TaskLoadError(f"task {self.id}: neither a repository path nor an image")
        for entry in self.protected_paths:
            problem = _protected_problem(entry) if isinstance(entry, str) else "not a string"
            if problem:
                raise TaskLoadError(f"task {self.id}: key 'protected_paths': {entry!r}: {problem}")

    def to_row(self) -> dict[str, Any]:
        """A flat row for Parquet: lists and mappings become JSON strings."""
        row = asdict(self)
        row["target_tests"] = json.dumps(list(self.target_tests))
        row["existing_tests"] = json.dumps(list(self.existing_tests))
        row["report_paths"] = json.dumps(list(self.report_paths))
        row["protected_paths"] = json.dumps(list(self.protected_paths))
        row["editable_paths"] = json.dumps(list(self.editable_paths))
        row["limits"] = json.dumps(asdict(self.limits))
        row["metadata"] = json.dumps(dict(self.metadata), sort_keys=True, default=str)
        return row


@dataclass(frozen=True)
class IncompleteTask:
    """A task that a source lists but that cannot be loaded; kept so it is reported, not lost."""

    id: str
    source: str
    path: str
    reason: str
    language: str = ""


@dataclass(frozen=True)
class TaskSet:
    """The loaded tasks of one or more sources, and the ones that could not be loaded."""

    tasks: tuple[Task, ...]
    incomplete: tuple[IncompleteTask, ...] = ()

    def __add__(self, other: "TaskSet") -> "TaskSet":
        return TaskSet(self.tasks + other.tasks, self.incomplete + other.incomplete)

    def by_id(self) -> dict[str, Task]:
        return {t.id: t for t in self.tasks}

    def split(self, name: str) -> list[Task]:
        return [t for t in self.tasks if t.split == name]


def demonstration_tasks(tasks: Iterable[Task]) -> list[Task]:
    """The train tasks a base model may learn from by demonstration: all of them, except those a
    source marks ``metadata.demonstration = false`` (the bundled suite's RL tasks)."""
    return [t for t in tasks if t.split == "train" and t.metadata.get("demonstration", True) is not False]


def rl_tasks(tasks: Iterable[Task]) -> list[Task]:
    """The train tasks RL draws from: all of them, except those a source marks
    ``metadata.demonstration = true`` (the bundled suite's demonstrations, which the embedded base
    model was trained on)."""
    return [t for t in tasks if t.split == "train" and t.metadata.get("demonstration") is not True]


# ---------------------------------------------------------------- protected paths and test ids


def protected_entry(entry: str) -> tuple[str, str]:
    """One ``protected_paths`` entry as ``(path or **/NAME pattern, dotted TOML table or '')``."""
    head, sep, table = entry.rpartition(":")
    if sep and head.endswith(".toml") and table:
        return head, table
    return entry, ""


def is_path_pattern(path: str) -> bool:
    """Whether a protected path (the first half of :func:`protected_entry`) is a ``**/NAME`` pattern."""
    return path.startswith("**/")


def protected_path_matches(path: str, changed: str) -> bool:
    """Whether ``changed`` (a repository path) is the protected ``path``, or a file ``**/NAME`` names."""
    if is_path_pattern(path):
        return fnmatch.fnmatchcase(PurePosixPath(changed).name, path[3:])
    return changed == path


def _protected_problem(entry: str) -> str:
    path, table = protected_entry(entry)
    name = path[3:] if is_path_pattern(path) else path
    if not name or "\0" in entry or name.startswith("/") or ".." in PurePosixPath(name).parts:
        return "expected a path inside the repository (no '..', not absolute)"
    if "**" in name or (is_path_pattern(path) and "/" in name):
        return "a pattern is '**/NAME' (a file name, globs allowed), nothing else"
    if table and not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", table):
        return f"TOML table {table!r} is not a dotted name (tool.pytest)"
    return ""


def junit_id(nodeid: str) -> str:
    """The id pytest's JUnit writer gives a node id (what :func:`evals.grading.parse_junit` reads back).

    ``tests/test_x.py::TestY::test_z[a::b]`` becomes ``tests.test_x.TestY.test_z[a::b]``: the file path
    is dotted and loses ``.py``, ``::`` separators become dots, the parameter bracket stays opaque.
    Test ids in the task schema are these (DeepSWE's ``f2p_node_ids`` are written so).
    """
    path, sep, tail = nodeid.partition("::")
    names = [path]
    params = None
    if sep:
        name_part, bracket, param_part = tail.partition("[")
        names += name_part.split("::")
        params = param_part.removesuffix("]") if bracket else None
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    if params is not None:
        names[-1] += f"[{params}]"
    return ".".join(names)


# ---------------------------------------------------------------- Harbor / DeepSWE


def _read_bytes(path: Path) -> bytes:
    """A task file's bytes; one that cannot be read, or is not a regular file (a FIFO would be
    waited on forever), raises :class:`TaskLoadError` naming it."""
    try:
        return read_regular_bytes(path)
    except OSError as exc:
        raise TaskLoadError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _read_text(path: Path) -> str:
    """A task file's text; a file that is not UTF-8 (as TOML, JSON and Markdown here must be) or
    cannot be read raises :class:`TaskLoadError` naming it."""
    raw = _read_bytes(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskLoadError(f"{path}: not UTF-8 text (byte {exc.start} is {raw[exc.start:exc.start + 1]!r}): "
                            "task files must be UTF-8") from exc


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise TaskLoadError(f"{path}: not valid TOML: {exc}") from exc


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise TaskLoadError(f"{path}: not valid JSON: {exc}") from exc


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskLoadError(f"{where}: expected a list of test ids (strings), got {type(value).__name__}")
    return tuple(value)


def _harbor_task_dirs(root: Path) -> list[Path]:
    if (root / "task.toml").is_file():
        return [root]
    base = root / "tasks" if (root / "tasks").is_dir() else root
    dirs = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [d for d in dirs if (d / "task.toml").is_file() or (d / "instruction.md").is_file()]


def load_harbor_task(task_dir: Path) -> Task | IncompleteTask:
    """Load one Harbor task folder; a missing file gives an :class:`IncompleteTask` with the reason.

    A file that exists but is malformed raises :class:`TaskLoadError` naming the file and key: that
    is broken data, not a partial copy.
    """
    task_dir = Path(task_dir)
    toml_path = task_dir / "task.toml"
    meta_all = _read_toml(toml_path) if toml_path.is_file() else {}
    meta = meta_all.get("metadata", {})
    for table in ("metadata", "environment", "verifier", "agent"):
        if not isinstance(meta_all.get(table, {}), dict):
            raise TaskLoadError(f"{toml_path}: key {table!r} must be a table")
    task_id = str(meta.get("task_id") or task_dir.name)
    language = str(meta.get("language", ""))
    missing = [name for name in ("task.toml", "instruction.md", "tests/config.json") if not (task_dir / name).is_file()]
    if missing:
        return IncompleteTask(task_id, "harbor", str(task_dir), f"missing {', '.join(missing)}", language)

    config_path = task_dir / "tests" / "config.json"
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise TaskLoadError(f"{config_path}: expected a JSON object")
    for key in ("f2p_node_ids", "p2p_node_ids", "grade"):
        if key not in config:
            raise TaskLoadError(f"{config_path}: missing key {key!r}")
    grade = config["grade"]
    if not isinstance(grade, dict) or grade.get("format") not in REPORT_FORMATS:
        raise TaskLoadError(f"{config_path}: key 'grade.format' must be one of {REPORT_FORMATS}")
    node_id = grade.get("node_id", "name")
    if node_id not in ("name", "suite.name"):
        raise TaskLoadError(f"{config_path}: key 'grade.node_id' is {node_id!r}, expected 'name' or 'suite.name'")
    env = meta_all.get("environment", {})
    verifier = meta_all.get("verifier", {})
    agent = meta_all.get("agent", {})
    try:
        limits = ResourceLimits(
            cpus=float(env.get("cpus", 2)),
            memory_mb=int(env.get("memory_mb", 8192)),
            storage_mb=int(env.get("storage_mb", 20480)),
            agent_timeout_s=float(agent.get("timeout_sec", 5400.0)),
            test_timeout_s=float(verifier.get("timeout_sec", 1800.0)),
        )
    except (TypeError, ValueError) as exc:
        raise TaskLoadError(f"{toml_path}: a resource limit (environment.cpus, memory_mb, storage_mb, "
                            f"agent.timeout_sec, verifier.timeout_sec) is not a number: {exc}") from exc
    dockerfile = task_dir / "environment" / "Dockerfile"
    image = env.get("docker_image") or (task_id if dockerfile.is_file() else None)
    if not image:
        raise TaskLoadError(f"{toml_path}: missing key 'environment.docker_image' (and no environment/Dockerfile)")
    extra = {k: v for k, v in meta.items() if k not in ("task_id", "language")}
    extra["tool_label"] = grade.get("tool_label", "")
    extra["task_dir"] = str(task_dir)
    extra["docker_image"] = str(env.get("docker_image") or "")
    extra["environment"] = str(dockerfile) if dockerfile.is_file() else ""
    tests_dir = task_dir / "tests"
    extra["tests_dir"] = str(tests_dir)
    extra["test_files"] = sorted(str(p.relative_to(tests_dir)) for p in tests_dir.rglob("*") if p.is_file())
    solution = task_dir / "solution" / "solution.patch"
    extra["solution_patch"] = str(solution) if solution.is_file() else ""
    if "writable_root" in env and not isinstance(env["writable_root"], bool):
        raise TaskLoadError(f"{toml_path}: key 'environment.writable_root' must be true or false, "
                            f"got {env['writable_root']!r}")
    extra["writable_root"], extra["writable_root_reason"] = needs_writable_root(tests_dir, env.get("writable_root"))
    return Task(
        id=task_id,
        source="harbor",
        language=language,
        instruction=_read_text(task_dir / "instruction.md"),
        target_tests=_str_list(config["f2p_node_ids"], f"{config_path}: key 'f2p_node_ids'"),
        existing_tests=_str_list(config["p2p_node_ids"], f"{config_path}: key 'p2p_node_ids'"),
        # Harbor runs the task's verifier script; the scripts are not part of the shared copy.
        test_command="bash /tests/test.sh",
        report_format=grade["format"],
        report_paths=_str_list(grade.get("reports", []), f"{config_path}: key 'grade.reports'"),
        base_commit=str(config.get("base_commit") or meta.get("base_commit_hash") or "") or None,
        image=str(image),
        workdir="/app",
        ctrf_node_id=node_id,
        limits=limits,
        split=str(meta.get("split", "")) if meta.get("split") in ("train", "eval") else "",
        difficulty=meta["difficulty"] if isinstance(meta.get("difficulty"), int) and not isinstance(meta.get("difficulty"), bool) else 0,
        metadata=extra,
    )


# A command that installs into the task's environment (its virtual environment, npm's global prefix):
# where a verifier runs one, it writes outside /app, as it may in the task's container.
_INSTALL_COMMAND = re.compile(
    r"(^|[\s;&|(])(pip3?|python3?\s+-m\s+pip|uv\s+pip|poetry|pdm)\s+(install|sync|add)\b"
    r"|(^|[\s;&|(])(npm|pnpm|yarn)\s+(install|i|ci|add|link)\s+(-g|--global)\b"
    r"|(^|[\s;&|(])python3?\s+setup\.py\s+(develop|install)\b")


def _verifier_scripts(tests_dir: Path) -> Iterable[tuple[str, str]]:
    """The shell scripts a task's verifier runs: ``tests/*.sh`` and the ``.sh`` files its
    ``test.patch`` adds to the repository (their added lines), as ``(name, text)``."""
    for path in sorted(tests_dir.glob("*.sh")):
        yield path.name, _read_bytes(path).decode("utf-8", "replace")
    patch = tests_dir / "test.patch"
    if not patch.is_file():
        return
    name, lines = "", []
    for line in _read_bytes(patch).decode("utf-8", "replace").splitlines():
        if line.startswith("diff --git "):
            if name.endswith(".sh"):
                yield name, "\n".join(lines)
            name, lines = line.rsplit(" b/", 1)[-1], []
        elif line.startswith("+") and not line.startswith("+++"):
            lines.append(line[1:])
    if name.endswith(".sh"):
        yield name, "\n".join(lines)


def needs_writable_root(tests_dir: Path, declared: bool | None = None) -> tuple[bool, str]:
    """Whether a Harbor task's sandboxes need a writable root, and why.

    A task's container is writable everywhere, and a few verifiers rely on it: DeepSWE's
    bandit-interprocedural-taint-checks re-runs ``pip install -e .`` into ``/opt/venv`` before
    its tests, which a read-only root stops before any test runs (every test then counts as
    failed, the reference solution's too). posttrain's sandbox root is read-only outside
    ``/workspace``, ``/tmp`` and ``$HOME`` by default, which catches a test that writes where it
    should not, so the writable root is chosen per task: ``[environment] writable_root`` in
    ``task.toml`` decides when it is set; otherwise a task needs one when a script its verifier
    runs (``tests/*.sh``, or a ``.sh`` file its ``test.patch`` adds) has an install command
    outside a comment (``pip install``, ``uv pip install``, ``poetry install``, ``npm install -g``,
    ``setup.py develop``, ...). The writes land in the sandbox's own layer and vanish with it
    (:func:`sandboxes.runtimes.start`); the host toolchain stays read-only either way."""
    if declared is not None:
        return declared, "task.toml: environment.writable_root = " + ("true" if declared else "false")
    for name, text in _verifier_scripts(tests_dir):
        for line in text.splitlines():
            code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
            match = _INSTALL_COMMAND.search(code)
            if match:
                return True, f"{name} installs into the environment: {line.strip()[:200]}"
    return False, ""


def _harbor_identity(task_dir: Path) -> tuple[str, str]:
    """The task's id and language from its task.toml where that can be read, else (folder name, "")."""
    try:
        meta = _read_toml(task_dir / "task.toml").get("metadata", {})
    except TaskLoadError:
        meta = {}
    if not isinstance(meta, dict):
        meta = {}
    return str(meta.get("task_id") or task_dir.name), str(meta.get("language", ""))


def harbor_build_problem(task: Task, sources: str | Path) -> str:
    """Why ``task`` (a Harbor task) cannot be built from the repository sources in ``sources``, or ''."""
    meta = task.metadata
    if not meta.get("environment"):
        return f"{meta.get('task_dir')}: no environment/Dockerfile to build the task's image from"
    missing = [f for f in ("test.sh", "config.json") if f not in meta.get("test_files", ())]
    if missing:
        return f"{meta.get('tests_dir')}: no {', '.join(missing)} (the verifier's files)"
    try:
        recipe = parse_dockerfile(meta["environment"])
        source = find_source(sources, recipe.clone_url)
    except RecipeError as exc:
        return str(exc)
    if task.base_commit and not source_has_commit(source, task.base_commit):
        return f"the source {source} of {recipe.clone_url} does not hold the base commit {task.base_commit}"
    return ""


def load_harbor(root: str | Path, sources: str | Path | None = None) -> TaskSet:
    """Every task folder under ``root`` (a dataset folder with ``tasks/``, or one task folder).

    One broken task does not sink the dataset: a task folder with a missing file, or a file that is
    malformed (not UTF-8, not valid TOML or JSON, a missing or wrongly typed key), is returned among
    ``incomplete`` with the reason, which names the file; the other tasks load. With ``sources`` (a
    folder of repository sources, see :func:`sandboxes.harbor.find_source`) a task that cannot be
    built from them is incomplete too (:func:`harbor_build_problem` gives the reason).
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskLoadError(f"{root}: not a folder")
    tasks: list[Task] = []
    incomplete: list[IncompleteTask] = []
    for task_dir in _harbor_task_dirs(root):
        try:
            loaded = load_harbor_task(task_dir)
        except TaskLoadError as exc:
            task_id, language = _harbor_identity(task_dir)
            loaded = IncompleteTask(task_id, "harbor", str(task_dir), str(exc), language)
        if sources is not None and isinstance(loaded, Task):
            problem = harbor_build_problem(loaded, sources)
            if problem:
                loaded = IncompleteTask(loaded.id, "harbor", str(task_dir), f"cannot be built: {problem}",
                                        loaded.language)
        (incomplete if isinstance(loaded, IncompleteTask) else tasks).append(loaded)
    if not tasks and not incomplete:
        raise TaskLoadError(f"{root}: no Harbor task folders (a folder with task.toml) found")
    return TaskSet(tuple(tasks), tuple(incomplete))


# ---------------------------------------------------------------- SWE-bench


def _swebench_test_id(test_id: str) -> str:
    """A SWE-bench test id in the task schema: a pytest node id (``tests/test_a.py::test_x``) as its
    JUnit id (``tests.test_a.test_x``), the id the grader reads; any other form as it is."""
    return junit_id(test_id) if "::" in test_id.split("[", 1)[0] else test_id


def _json_list_field(row: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    if key not in row:
        raise TaskLoadError(f"{where}: missing key {key!r}")
    value = row[key]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise TaskLoadError(f"{where}: key {key!r} is not a JSON list string: {exc}") from exc
    elif hasattr(value, "tolist"):
        value = value.tolist()
    return _str_list(list(value) if isinstance(value, tuple) else value, f"{where}: key {key!r}")


def swebench_image(instance_id: str) -> str:
    """The SWE-bench harness's conventional evaluation image name of an instance."""
    return f"swebench/sweb.eval.x86_64.{instance_id.replace('__', '_1776_').lower()}:latest"


def _swebench_rows(path: Path) -> list[tuple[str, Mapping[str, Any]]]:
    if path.suffix == ".parquet":
        # heavy: pyarrow; only SWE-bench Parquet files need it
        import pyarrow.parquet as pq

        try:
            with open_regular_file(path) as fh:  # a FIFO or a device is refused at once
                table = pq.read_table(fh)
        except NotARegularFile as exc:
            raise TaskLoadError(str(exc)) from None
        return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskLoadError(f"{path}: not valid JSON: {exc}") from exc
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise TaskLoadError(f"{path}: entry {i}: expected a JSON object")
        return [(f"{path}: entry {i}", row) for i, row in enumerate(data)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskLoadError(f"{path}: line {lineno}: not valid JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise TaskLoadError(f"{path}: line {lineno}: expected a JSON object")
        rows.append((f"{path}: line {lineno}", row))
    return rows


def _test_patch_files(test_patch: str, where: str) -> list[str]:
    """The repository paths a SWE-bench ``test_patch`` writes (each once, in patch order)."""
    files: list[str] = []
    for change in parse_patch(test_patch):
        for name in (change.old_path, change.path):
            if name and name not in files:
                problem = _protected_problem(name) or ("a pattern, not a path" if is_path_pattern(name) else "")
                if problem or ":" in name:
                    raise TaskLoadError(f"{where}: key 'test_patch' writes {name!r}: "
                                        f"{problem or 'a path with a colon'}")
                files.append(name)
    return files


def load_swebench(path: str | Path) -> TaskSet:
    """SWE-bench-style rows from a ``.jsonl``, ``.parquet`` or ``.json`` (an array of rows) file.

    A row without ``instance_id``, ``problem_statement`` or ``base_commit`` raises
    :class:`TaskLoadError` naming the line. Each row is graded like the bundled suite's tasks
    (:func:`evals.grading.grade_patch`): the files its ``test_patch`` writes, every ``conftest.py``
    and pytest's configuration (:data:`PYTEST_CONFIG_PATHS`) are protected, restored to the base
    commit before the tests run, and the test patch (``metadata["test_patch"]``) is applied over them,
    as SWE-bench's harness does. Tests run with pytest on the Python files the test patch writes (the
    whole suite without one) and report JUnit XML to :data:`SWEBENCH_REPORT`, inside the repository,
    where the sandbox's daemon reads it once every process of the tests is gone; an explicit
    ``test_cmd`` column overrides the command. Test ids written as pytest node ids
    (``tests/test_a.py::test_x``) become the JUnit ids the grader reads (``tests.test_a.test_x``).
    """
    path = Path(path)
    try:
        check_regular_file(path)
    except FileNotFoundError:
        raise TaskLoadError(f"{path}: no such file") from None
    except OSError as exc:
        raise TaskLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    tasks = []
    for where, row in _swebench_rows(path):
        for key in ("instance_id", "problem_statement", "base_commit"):
            if not row.get(key):
                raise TaskLoadError(f"{where}: missing key {key!r}")
        instance_id = str(row["instance_id"])
        meta = {k: row[k] for k in ("repo", "version", "created_at", "environment_setup_commit") if row.get(k)}
        test_patch = row.get("test_patch") or ""
        if not isinstance(test_patch, str):
            raise TaskLoadError(f"{where}: key 'test_patch' must be a patch (a string), got {type(test_patch).__name__}")
        test_files = _test_patch_files(test_patch, where)
        if test_patch.strip():
            meta["test_patch"] = test_patch
        run = [f for f in test_files if f.endswith(".py") and PurePosixPath(f).name != "conftest.py"]
        command = " ".join(["python -m pytest -rA", f"--junitxml={SWEBENCH_REPORT}", *map(shlex.quote, run)])
        tasks.append(
            Task(
                id=instance_id,
                source="swebench",
                language=str(row.get("language") or "python"),
                instruction=str(row["problem_statement"]),
                target_tests=tuple(map(_swebench_test_id, _json_list_field(row, "FAIL_TO_PASS", where))),
                existing_tests=tuple(map(_swebench_test_id, _json_list_field(row, "PASS_TO_PASS", where))),
                test_command=str(row.get("test_cmd") or command),
                report_format="junit",
                report_paths=(SWEBENCH_REPORT,),
                base_commit=str(row["base_commit"]),
                image=str(row.get("image_name") or swebench_image(instance_id)),
                workdir="/testbed",
                protected_paths=(*test_files, *PYTEST_CONFIG_PATHS),
                metadata=meta,
            )
        )
    return TaskSet(tuple(tasks))


# ---------------------------------------------------------------- bundled suite and dispatch


def load_bundled(root: str | Path) -> TaskSet:
    """The built bundled suite under ``root`` (see :func:`evals.bundled.build_suite`)."""
    root = Path(root)
    index = root / "suite.json"
    if not index.exists():  # one that is there but not a file is refused by the read, naming it
        raise TaskLoadError(f"{root}: no suite.json; build the bundled suite with `posttrain tasks build OUT`")
    suite = _read_json(index)
    if not isinstance(suite, dict) or not isinstance(suite.get("tasks", []), list):
        raise TaskLoadError(f"{index}: expected an object with a list 'tasks'")
    tasks = []
    for task_id in suite.get("tasks", []):
        path = root / "tasks" / task_id / "task.json"
        if not path.exists():
            raise TaskLoadError(f"{index}: lists task {task_id} but {path} is missing")
        tasks.append(task_from_json(_read_json(path), root / "tasks" / task_id, str(path)))
    return TaskSet(tuple(tasks))


def task_from_json(data: Mapping[str, Any], task_dir: Path, where: str) -> Task:
    """A bundled task from its ``task.json``; ``repo`` is resolved relative to ``task_dir``."""
    if not isinstance(data, dict):
        raise TaskLoadError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        limits = ResourceLimits(**data.get("limits", {}))
        repo = (task_dir / data["repo"]).resolve()
        if not repo.is_relative_to(Path(task_dir).resolve()):
            raise TaskLoadError(f"{where}: key 'repo' must be a folder inside {task_dir}, got {data['repo']!r}")
        return Task(
            id=data["id"],
            source=data.get("source", "bundled"),
            language=data["language"],
            instruction=data["instruction"],
            target_tests=_str_list(data["target_tests"], f"{where}: key 'target_tests'"),
            existing_tests=_str_list(data["existing_tests"], f"{where}: key 'existing_tests'"),
            test_command=data["test_command"],
            report_format=data["report_format"],
            report_paths=tuple(data["report_paths"]),
            base_commit=data["base_commit"],
            repo_path=str(repo),
            workdir=data.get("workdir", "."),
            protected_paths=tuple(data.get("protected_paths", ())),
            editable_paths=tuple(data.get("editable_paths", ())),
            limits=limits,
            split=data.get("split", ""),
            difficulty=int(data.get("difficulty", 0)),
            metadata=_bundled_metadata(data.get("metadata", {}), repo, where),
        )
    except KeyError as exc:
        raise TaskLoadError(f"{where}: missing key {exc.args[0]!r}") from exc
    except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type
        if isinstance(exc, TaskLoadError):
            raise
        raise TaskLoadError(f"{where}: {exc}") from exc


MODULE_FILE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.py")  # a bundled task's module: a plain file at the top


def _bundled_metadata(meta: Any, repo: Path, where: str) -> dict[str, Any]:
    """A bundled task's ``metadata``, checked as the data it is: the grader reads ``test_file`` on the
    host and imports ``module_file`` in a sandbox, so both must name files inside the task's
    repository (``module_file`` a plain ``name.py`` at its top); ``reference_edits`` are
    ``[file, line, text]``. Nothing here is ever executed or written on the host."""
    if not isinstance(meta, dict):
        raise TaskLoadError(f"{where}: key 'metadata' must be an object, got {type(meta).__name__}")
    module_file = meta.get("module_file")
    if module_file is not None and not (isinstance(module_file, str) and MODULE_FILE.fullmatch(module_file)):
        raise TaskLoadError(f"{where}: key 'metadata.module_file' must be a file name like 'name.py' at the top of "
                            f"the task's repository, got {str(module_file)[:120]!r}")
    test_file = meta.get("test_file")
    if test_file is not None:
        inside = isinstance(test_file, str) and not PurePosixPath(test_file).is_absolute() \
            and ".." not in PurePosixPath(test_file).parts and (repo / test_file).resolve().is_relative_to(repo)
        if not inside or not test_file.endswith(".py"):
            raise TaskLoadError(f"{where}: key 'metadata.test_file' must be a .py file inside the task's repository, "
                                f"got {str(test_file)[:120]!r}")
    edits = meta.get("reference_edits")
    if edits is not None and not (isinstance(edits, list) and all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and type(e[1]) is int and e[1] >= 1
            and isinstance(e[2], str) for e in edits)):
        raise TaskLoadError(f"{where}: key 'metadata.reference_edits' must be a list of [file, line (>= 1), text]")
    return meta


def load_tasks(path: str | Path, sources: str | Path | None = None) -> TaskSet:
    """Load ``path`` with the loader its shape calls for.

    A ``.jsonl`` or ``.parquet`` file is SWE-bench; a folder with ``suite.json`` is a built bundled
    suite; any other folder is read as Harbor task folders. The bundled suite that is not built yet
    is generated by :mod:`evals.bundled` (:func:`evals.bundled.load_suite`; ``posttrain tasks
    inspect bundled``), which builds on this module.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        try:
            check_regular_file(p)
        except NotARegularFile as exc:  # a FIFO or a device: refused at once, never read
            raise TaskLoadError(f"{p}: is {exc.kind}, expected a SWE-bench .jsonl/.parquet file or a task "
                                "folder") from None
    if p.is_file() and p.suffix in (".jsonl", ".json", ".parquet"):
        return load_swebench(p)
    if p.is_dir() and (p / "suite.json").exists():
        return load_bundled(p)
    if p.is_dir():
        return load_harbor(p, sources)
    raise TaskLoadError(f"{path}: no such file or folder (expected a Harbor folder, a SWE-bench .jsonl/.parquet, "
                        "or a built bundled suite folder)")


def _median(values: Iterable[int]) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else 0.0


def summarize(task_set: TaskSet) -> dict[str, Any]:
    """The ``posttrain tasks inspect`` summary: counts over the complete tasks, and the incomplete ids."""
    by_language: dict[str, int] = {}
    for task in task_set.tasks:
        by_language[task.language] = by_language.get(task.language, 0) + 1
    return {
        "tasks": len(task_set.tasks),
        "incomplete": [t.id for t in task_set.incomplete],
        "by_language": dict(sorted(by_language.items())),
        "median_target_tests": _median(len(t.target_tests) for t in task_set.tasks),
        "median_existing_tests": _median(len(t.existing_tests) for t in task_set.tasks),
        "ids": [t.id for t in task_set.tasks],
    }
