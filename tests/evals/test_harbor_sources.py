"""A Harbor task's repository checked out at its base commit from an imperfect source: a partial
clone (its promisor packs, which ``git gc`` never prunes, must not carry later commits into the
image) and a snapshot missing objects of older history (cut at the base commit), with real git."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sandboxes.harbor import RecipeError, checkout_at_base

GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
       "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=GIT).stdout.strip()


def history(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """old (adds old.txt) -> base (removes it, adds m.py) -> future (the "solution")."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commits = {}
    for name, files, gone in (("old", {"old.txt": "only in the history\n"}, ()),
                              ("base", {"m.py": "X = 1\n"}, ("old.txt",)),
                              ("future", {"m.py": "X = 2  # the solution\n"}, ())):
        for rel, text in files.items():
            (repo / rel).write_text(text)
        for rel in gone:
            (repo / rel).unlink()
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", name)
        commits[name] = git(repo, "rev-parse", "HEAD")
    return repo, commits


def stored_commits(repo: Path) -> set[str]:
    listed = git(repo, "cat-file", "--batch-all-objects", "--batch-check=%(objecttype) %(objectname)")
    return {line.split()[1] for line in listed.splitlines() if line.startswith("commit ")}


def test_a_partial_clone_source_leaves_no_later_commit_in_the_checkout(tmp_path):
    upstream, commits = history(tmp_path)
    source = tmp_path / "partial"
    subprocess.run(["git", "clone", "-q", "--bare", "--filter=blob:none", f"file://{upstream}", str(source)],
                   check=True, env=GIT, capture_output=True)
    assert list(source.glob("objects/pack/*.promisor"))  # a partial clone, as fetched snapshots are
    assert commits["future"] in stored_commits(source)
    dest = tmp_path / "app"
    assert checkout_at_base(source, commits["base"], dest) == ""
    assert git(dest, "rev-parse", "HEAD") == commits["base"]
    # not even unreachable: git fsck --lost-found would find the solution's commit
    assert stored_commits(dest) == {commits["old"], commits["base"]}
    assert git(dest, "fsck", "--unreachable", "--no-reflogs") == ""


def test_a_source_missing_older_objects_is_cut_at_the_base_commit(tmp_path):
    source, commits = history(tmp_path)
    old_blob = git(source, "rev-parse", f"{commits['old']}:old.txt")
    (source / ".git" / "objects" / old_blob[:2] / old_blob[2:]).unlink()  # a snapshot without it
    dest = tmp_path / "app"
    note = checkout_at_base(source, commits["base"], dest)
    assert note.startswith(f"the source {source} lacks objects of the history before {commits['base']}: "
                           "the repository is cut at the base commit (shallow, no ancestors)")
    assert git(dest, "rev-list", "--all").split() == [commits["base"]]
    assert stored_commits(dest) == {commits["base"]} and commits["future"] not in git(dest, "fsck", "--unreachable")
    git(dest, "checkout", "-q", ".")
    assert (dest / "m.py").read_text() == "X = 1\n" and not (dest / "old.txt").exists()


def test_a_source_missing_objects_of_the_base_commit_itself_is_refused(tmp_path):
    source, commits = history(tmp_path)
    blob = git(source, "rev-parse", f"{commits['base']}:m.py")
    old_blob = git(source, "rev-parse", f"{commits['old']}:old.txt")
    for sha in (blob, old_blob):
        (source / ".git" / "objects" / sha[:2] / sha[2:]).unlink()
    with pytest.raises(RecipeError, match=rf"lacks objects of the base commit {commits['base']} itself"):
        checkout_at_base(source, commits["base"], tmp_path / "app")


def test_an_env_path_that_extends_path_keeps_the_build_steps_tools(tmp_path):
    """``ENV PATH="/app/node_modules/.bin:${PATH}"`` (DeepSWE's testem recipes) extends the build's
    own PATH: the RUN steps still find mkdir and git, and the image's PATH keeps the new entry."""
    import sandboxes
    from sandboxes.harbor import build_harbor_image

    upstream, commits = history(tmp_path)
    sources = tmp_path / "sources"
    sources.mkdir()
    upstream.rename(sources / "owner+proj")
    recipe = tmp_path / "Dockerfile"
    recipe.write_text(f"FROM base\nWORKDIR /app\nARG BASE_SHA={commits['base']}\n"
                      "RUN git clone https://example.com/owner/proj.git . && git checkout $BASE_SHA\n"
                      'ENV PATH="/app/node_modules/.bin:${PATH}"\n'
                      "RUN mkdir -p /opt/tools-seen && git --version > /opt/tools-seen/git\n")
    store = sandboxes.ImageStore(tmp_path / "store")
    build = build_harbor_image("harbor-path", recipe, commits["base"], sources, store, network=False)
    assert build.env["PATH"] == "/app/node_modules/.bin"
    with sandboxes.start(build.image, store=store, cache=sandboxes.LayerCache(tmp_path / "cache", 1 << 30)) as box:
        assert box.exec("cat /opt/tools-seen/git").output.startswith("git version ")
