"""What a grading of a bundled task costs its sandbox: two commands (one script that applies the
patch, removes the tests and ``.git`` and writes the call probe; then the probe), and a probe that
starts on built-in modules (no ``json``, ``ctypes``, ``signal``, ``re`` or ``enum`` imported).

Real bubblewrap sandboxes; ``PlatformSandbox.exec`` is wrapped only to record the commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from evals import call_probe
from evals.attempts import APPLY_FAILED, GRADED
from evals.call_checks import PROBE_SOURCE
from evals.grading import committed_patch, grade_patch
from evals.sandbox import platform_sandbox_factory
from sandboxes.programs import shipped_source
from tests.sandboxes.conftest import installed

needs_bwrap = pytest.mark.skipif(not installed("bwrap"), reason="bubblewrap is not installed")


def _reference_patch(task, factory) -> str:
    from evals.actions import apply_edits

    with factory(task) as box:
        module = task.metadata["module_file"]
        edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
        box.write_file(module, apply_edits(box.read_file(module).decode(), edits).encode())
        assert box.exec(f"git add {module} && git commit -q -m fix").exit_code == 0
        return committed_patch(box, task.base_commit)


@needs_bwrap
def test_a_bundled_grading_is_two_commands_and_scores_as_before(small_tasks, commands):
    """ca97533: six commands (git apply, the tests' restore, the report's rm, rm of .git and the
    tests, the probe's install, the probe)."""
    factory = platform_sandbox_factory("bwrap")
    task = small_tasks[0]
    patch = _reference_patch(task, factory)
    grade_patch(task, "", factory)  # the hidden inputs answered first, in a sandbox of their own
    commands.clear()
    result = grade_patch(task, patch, factory)
    assert result.status == GRADED and result.scores.reward == 1.0, result.detail
    assert len(commands) == 2, commands
    assert commands[0].startswith("set -e; git apply") and "rm -rf -- .git tests" in commands[0]
    assert commands[1].startswith("python3 -I -S /tmp/.posttrain-grader/_posttrain_probe_")
    # the unpatched base still fails its targets, and a patch git refuses still scores apply_failed
    commands.clear()
    base = grade_patch(task, "", factory)
    assert base.status == GRADED and base.scores.f2p_passed == 0 and base.scores.p2p == 1.0
    assert len(commands) == 2, commands
    m = task.metadata["module_file"]
    bogus = f"diff --git a/{m} b/{m}\n--- a/{m}\n+++ b/{m}\n@@ -1 +1 @@\n-not this line\n+b\n"
    refused = grade_patch(task, bogus, factory)
    assert refused.status == APPLY_FAILED and refused.scores.reward == 0.0
    assert "patch" in refused.detail


def test_the_call_probe_starts_on_built_in_modules(tmp_path):
    """ca97533: the probe imported json (and with it re, enum) and ctypes at every grading."""
    (tmp_path / "m.py").write_text("def f(x):\n    return [x, 'é', 1.5, None, {'a': (1, 2)}]\n")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"module": "m", "call_timeout_s": 10, "one_process": False,
                                "calls": [[0, "f", "(3,)"], [1, "f", "('\\ud800',)"], [2, "g", "()"]]}))
    probe = tmp_path.parent / f"{tmp_path.name}-probe.py"  # as the grader ships it: one file, outside the task
    probe.write_bytes(shipped_source(PROBE_SOURCE))
    run = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", str(probe), str(spec)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert imported and not imported & {"json", "json.decoder", "ctypes", "signal", "re", "enum"}, imported
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert records[0] == {"event": "start"} and records[-1] == {"event": "finish"}
    assert records[1] == {"event": "value", "check": 0, "value": call_probe.encode([3, "é", 1.5, None, {"a": (1, 2)}])}
    assert records[2]["value"][1][0] == ["str", "\ud800"]
    assert records[3]["event"] == "raised" and "AttributeError" in records[3]["error"]


@pytest.mark.parametrize("value", [
    {"answers": [{"value": ["str", "\u00e9\n\"\\\ud800\x00"]}, {"raised": "E"}]},
    [1, -2.5, 1e300, None, True, False, {}, [], ""],
    {"import_error": "x" * 1000},
])
def test_the_probes_codec_reads_and_writes_as_the_json_package(value):
    text = call_probe.json_dumps(value)
    assert text == json.dumps(value)
    assert call_probe.json_loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize("data", [b"", b"{", b'{"a": 1} x', b"[" * 100_000, b'{"a": NaNx}', b"\xff"])
def test_the_probes_codec_refuses_what_the_json_package_refuses(data):
    with pytest.raises((ValueError, RecursionError)):
        json.loads(data)
    with pytest.raises((ValueError, RecursionError)):
        call_probe.json_loads(data)

