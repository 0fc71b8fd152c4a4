"""The writable root of Harbor sandboxes: chosen per task (``task.toml`` or a verifier that installs
into the environment), its writes kept in the sandbox's own layer, the host toolchain read-only
either way, and the read-only default kept for every other task. Real bwrap and gVisor sandboxes
of an exported bundled task whose recipe writes a folder outside ``/app``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import sandboxes
from evals.harbor import GRADED, build_task_image, export_harbor, harbor_sandbox_factory, run_attempt
from evals.tasks import TaskLoadError, load_bundled, load_harbor, load_harbor_task, needs_writable_root
from sandboxes.harbor import harbor_image_name

MARK = "echo verifier > /opt/env/marker || exit 7\n"


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """One exported bundled task in two copies whose recipe makes ``/opt/env/marker`` and whose
    verifier rewrites it first: ``writable`` (``writable_root = true`` in task.toml) and ``default``."""
    from evals.bundled import build_suite

    root = tmp_path_factory.mktemp("writable")
    build_suite(root / "suite", per_level=1, rl_per_level=0, extra_eval_per_level=0, workers=2)
    task = next(t for t in load_bundled(root / "suite").tasks if t.difficulty == 1)
    export_harbor([task], root / "dataset")
    original = root / "dataset" / "tasks" / task.id
    dockerfile = original / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "RUN mkdir -p /opt/env && echo base > /opt/env/marker\n")
    test_sh = original / "tests" / "test.sh"
    test_sh.write_text(test_sh.read_text().replace("cd /app || exit 6\n", "cd /app || exit 6\n" + MARK, 1))
    out = {}
    for name, key in (("writable", "writable_root = true\n"), ("default", "")):
        folder = root / name / task.id
        shutil.copytree(original, folder)
        toml = folder / "task.toml"
        toml.write_text(toml.read_text().replace("gpus = 0\n", "gpus = 0\n" + key))
        [out[name]] = load_harbor(folder, sources=root / "dataset" / "repos").tasks
    store = sandboxes.ImageStore(root / "store")
    cache = sandboxes.LayerCache(root / "cache", 1 << 30)
    build = build_task_image(out["writable"], root / "dataset" / "repos", store, network=False)
    return out, build.image, store, cache


def _script_task(tmp_path: Path, test_sh: str, patch_sh: str = "", fixture: str = "") -> Path:
    tests = tmp_path / "tests"
    tests.mkdir(parents=True)
    (tests / "test.sh").write_text(test_sh)
    diff = ""
    for name, text in (("test.sh", patch_sh), ("tests/fixtures/ci.yml", fixture)):
        if text:
            added = "".join(f"+{line}\n" for line in text.splitlines())
            diff += (f"diff --git a/{name} b/{name}\nnew file mode 100755\n--- /dev/null\n+++ b/{name}\n"
                     f"@@ -0,0 +1,{len(text.splitlines())} @@\n{added}")
    (tests / "test.patch").write_text(diff)
    return tests


def test_the_need_is_read_from_task_toml_or_the_verifiers_install_commands(tmp_path, variants):
    tasks, *_ = variants
    assert tasks["writable"].metadata["writable_root"] is True
    assert tasks["writable"].metadata["writable_root_reason"] == "task.toml: environment.writable_root = true"
    assert tasks["default"].metadata["writable_root"] is False  # a write outside /app is no install command
    # DeepSWE's bandit-interprocedural-taint-checks: the repository's test.sh reinstalls before its tests
    bandit = _script_task(tmp_path / "a", "#!/bin/bash\nbash /app/test.sh base\n",
                          "#!/bin/bash\ncase $1 in\n  base)\n    pip install --no-build-isolation -e . > /dev/null 2>&1\n"
                          "    pytest tests ;;\nesac\n")
    need, why = needs_writable_root(bandit)
    assert need and why == "test.sh installs into the environment: pip install --no-build-isolation -e . > /dev/null 2>&1"
    for script in ("uv pip install -e .", "python3 -m pip install .", "npm install -g pnpm", "poetry install",
                   "cd /app && python setup.py develop"):
        assert needs_writable_root(_script_task(tmp_path / script.replace(" ", "_").replace("/", ""), script))[0], script
    # a comment, or an install line in a test fixture (not a script the verifier runs), is no need
    quiet = _script_task(tmp_path / "b", "#!/bin/bash\n# an agent re-running `pnpm install` is fine\nnpm test # npm ci\n",
                         fixture="steps:\n  - run: npm install\n  - run: pip install x\n")
    assert needs_writable_root(quiet) == (False, "")
    assert needs_writable_root(bandit, declared=False) == (False, "task.toml: environment.writable_root = false")


def test_a_writable_root_that_is_not_a_boolean_is_refused_naming_the_key(variants, tmp_path):
    tasks, *_ = variants
    folder = tmp_path / "task"
    shutil.copytree(tasks["default"].metadata["task_dir"], folder)
    toml = folder / "task.toml"
    toml.write_text(toml.read_text().replace("gpus = 0\n", 'gpus = 0\nwritable_root = "yes"\n'))
    with pytest.raises(TaskLoadError, match=r"task.toml: key 'environment.writable_root' must be true or false, got 'yes'"):
        load_harbor_task(folder)


@pytest.mark.parametrize("runtime", ["bwrap", "gvisor"])
def test_writes_land_in_the_sandboxs_own_layer_and_the_toolchain_stays_read_only(variants, runtime):
    tasks, image, store, cache = variants
    limits = sandboxes.Limits(memory_mib=512, disk_mib=64)
    with sandboxes.start(image, runtime=runtime, limits=limits, store=store, cache=cache, writable_root=True) as box:
        wrote = box.exec("echo agent > /opt/env/marker && mkdir /opt/env/site && cat /opt/env/marker")
        assert wrote.exit_code == 0 and wrote.output.strip() == "agent", wrote.output
        for path in ("/usr/bin/posttrain-planted", "/usr/lib/posttrain-planted", "/posttrain-planted",
                     "/etc/posttrain-planted"):
            denied = box.exec(f"touch {path}")
            assert denied.exit_code != 0, path  # the host's /usr, and the root-owned folders of the image
        assert box.exec("test -w /workspace && test -w /tmp").exit_code == 0
    assert not Path("/usr/bin/posttrain-planted").exists() and not Path("/usr/lib/posttrain-planted").exists()
    # the next sandbox of the image starts from the cached layers, untouched
    with sandboxes.start(image, runtime=runtime, limits=limits, store=store, cache=cache) as box:
        assert box.exec("cat /opt/env/marker").output.strip() == "base"
        assert box.exec("test -e /opt/env/site").exit_code != 0
        refused = box.exec("echo agent > /opt/env/marker")  # the default: read-only outside the workspace
        assert refused.exit_code != 0 and "Read-only file system" in refused.output, refused.output


def test_the_verifier_of_a_task_that_needs_it_gets_a_writable_root_and_others_do_not(variants):
    tasks, image, store, cache = variants
    factory = harbor_sandbox_factory(store, cache)
    _, writable = run_attempt(tasks["writable"], "oracle", factory)
    assert writable.status == GRADED and writable.scores.reward == 1.0, (writable.notes, writable.output)
    assert writable.exit_code == 0
    # the same task without the key: its verifier stops at the write, before any test runs
    _, default = run_attempt(tasks["default"], "oracle", factory)
    assert default.exit_code == 7 and "Read-only file system" in default.output, default.output
    assert default.scores.reward == 0.0 and default.scores.f2p_passed == 0
    assert any(n.startswith("report missing: /logs/verifier/") for n in default.notes)
    assert harbor_image_name(tasks["writable"].id) == image.name
