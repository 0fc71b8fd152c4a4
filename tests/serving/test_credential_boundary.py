"""The trainer credential crosses a process boundary only where one process starts another and hands
it over (``env=credential.environment()``); no module of the project writes it, or anything else, to
``os.environ`` when imported (:mod:`sandboxes.httpserver.auth`).

Each test runs the project in a fresh interpreter whose environment holds no credential (this test
session's own, tests/conftest.py, is taken out), so nothing it does can lean on one inherited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from serving.capture_store import CREDENTIAL_ENV, CREDENTIAL_FILE_ENV
from serving.replica import replica_command

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("sandboxes", "serving", "training", "evals", "assets", "dagster_project", "viewer")
# Modules that set a third-party library's settings in the environment when imported (read by that
# library at its own import); none is the credential. Outside this change: each is named here so
# that any other module writing to the environment, or these writing anything else, fails the test.
KNOWN_IMPORT_WRITES = {
    "training.backends.torch_peft": {"TORCHINDUCTOR_CACHE_DIR"},
    "evals.scaffolds.mini_swe_agent": {"LITELLM_LOCAL_MODEL_COST_MAP", "MSWEA_GLOBAL_CONFIG_DIR",
                                       "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "MSWEA_SILENT_STARTUP"},
}


def _bare_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (CREDENTIAL_ENV, CREDENTIAL_FILE_ENV)}
    env["PYTHONPATH"] = str(REPO)
    return env


def _run(script: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=_bare_environment(),
                          capture_output=True, text=True, timeout=timeout_s)


def test_importing_every_module_of_the_project_leaves_the_environment_unchanged():
    """Every module of the project's packages imported one by one: the variables each import added,
    changed or removed. The credential is never among them (at ca97533 the first module to import
    sandboxes.httpserver.auth wrote it)."""
    out = _run(f"""
        import importlib, json, os, pkgutil
        changed, failed = {{}}, {{}}
        def walk(pkg):
            yield pkg  # imported (its __init__) before its modules are listed
            yield from (m.name for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."))
        for pkg in {PACKAGES!r}:
            for name in walk(pkg):
                before = dict(os.environ)
                try:
                    importlib.import_module(name)
                except BaseException as exc:
                    failed[name] = repr(exc)[:300]
                after = dict(os.environ)
                keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
                if keys:
                    changed[name] = keys
        print(json.dumps({{"changed": changed, "failed": failed}}))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert not result["failed"], result["failed"]
    writers = {name: keys for name, keys in result["changed"].items()
               if not set(keys) <= KNOWN_IMPORT_WRITES.get(name, set())}
    assert not writers, f"importing these modules wrote to os.environ: {writers}"
    assert not any(CREDENTIAL_ENV in keys for keys in result["changed"].values())


def test_a_replica_given_the_credential_explicitly_authenticates_its_starter(tiny_model, tmp_path):
    """A process given no credential makes one (in memory), starts a replica with it
    (``start_engine``: the replica, then the replica's engine, each given it in their environment),
    and its calls with it are answered: a call into a session with the session's key, and the
    session read back with the credential; a caller holding another credential is refused. The
    starter's own environment still holds none afterwards."""
    out = _run(f"""
        import json, os
        from pathlib import Path
        from sandboxes.httpserver.auth import Credential, process_credential
        from serving.client import EngineClient, HttpPool
        from serving.fleet import start_engine, stop_replica
        mine = process_credential()
        assert mine.source == "generated", mine
        proc, url = start_engine({str(tiny_model)!r}, Path({str(tmp_path / 'replica.log')!r}), engine="local",
                                 torch_threads=1, timeout_s=300)
        try:
            client = EngineClient(url, timeout_s=120)
            client.generate(list(range(20, 40)), {{"max_new_tokens": 2, "ignore_eos": True}}, session_id="ep1")
            calls = client.session("ep1")
            status, _, _ = HttpPool(60).request("GET", url + "/sessions/ep1", headers=Credential.generate().headers())
            environ = open(f"/proc/{{proc.pid}}/environ", "rb").read().split(b"\\0")
        finally:
            stop_replica(proc)
        print(json.dumps({{"calls": len(calls), "stranger": status,
                          "given": (("{CREDENTIAL_ENV}=" + mine.value).encode() in environ),
                          "exported": "{CREDENTIAL_ENV}" in os.environ}}))
    """)
    assert out.returncode == 0, out.stderr[-3000:] + (tmp_path / "replica.log").read_text()[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"calls": 1, "stranger": 403, "given": True, "exported": False}, result


def test_a_replica_started_by_a_parent_without_the_credential_refuses_to_start(tiny_model):
    """``--exit-with-parent`` (a replica started by a trainer or a fleet) and no credential in its
    environment: its parent could never call it, so it exits at once with a message naming the
    variable rather than serving with a credential no other process knows (as it did at ca97533)."""
    proc = subprocess.Popen(replica_command(str(tiny_model), engine="local", torch_threads=1), cwd=REPO,
                            env=_bare_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()  # its banner once serving; "" once it has exited
        assert " on http" not in banner, f"the replica started without a credential its parent knows: {banner!r}"
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 2, (proc.returncode, stderr[-2000:])
    assert f"without ${CREDENTIAL_ENV} or ${CREDENTIAL_FILE_ENV}" in stderr, stderr[-2000:]
