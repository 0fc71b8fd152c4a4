"""Captured sessions belong to their caller: a second client on loopback, without the session's key,
cannot list sessions, read another episode's calls, append a call into its session (which would
become that episode's training data), delete or end it, or create it before the episode starts.

Real HTTP on 127.0.0.1 throughout: the project's engine server with the tiny model, the capture front
in front of it (the replica's), and the router in front of the front. The trainer's client holds this
process's trainer credential; the attacker is a bare HTTP client that holds at most the key of its own
episode's session (what a scaffold running in the sandbox would see in its own calls). The chat route
refuses before the engine is asked, so the chat attacks need no chat engine here; the chat API's own
flow with keys is tests/serving/test_chat.py's and tests/evals/test_scaffolds.py's (vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from serving.capture import serve_sidecar
from serving.capture_store import (CREDENTIAL_ENV, CREDENTIAL_FILE_ENV, SESSION_HEADER, SESSION_KEY_HEADER,
                                   CaptureStore, Credential, session_key, trainer_credential)
from serving.client import EngineClient, HttpPool
from serving.local_engine import LocalEngine
from serving.http import serve
from serving.router.core import Router
from serving.router.server import serve_router
from training.capture_rollouts import fetch_session

REPO = Path(__file__).resolve().parents[2]
PROMPT = list(range(20, 60))
PARAMS = {"max_new_tokens": 4, "ignore_eos": True}
VICTIM = "run-a/g0/0"  # another episode's session, live on the replica
OWN = "run-a/g0/1"  # the attacker's own episode: it has seen this session's key in its own calls
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(tiny_model):
    engine = serve(LocalEngine(tiny_model, torch_threads=1), port=0)
    front = serve_sidecar(engine.url, port=0)
    router = Router("round_robin", poll_interval_s=3600)
    router_server = serve_router(router, port=0)
    try:
        router.add_replica(front.url)
        trainer = EngineClient(router_server.url)
        trainer.generate(PROMPT, PARAMS, session_id=VICTIM)
        yield {"engine": engine, "front": front, "router": router, "router_url": router_server.url, "trainer": trainer}
    finally:
        router_server.shutdown()
        front.shutdown()
        engine.shutdown()


@pytest.fixture(scope="module")
def attacker():
    return HttpPool(timeout_s=120)


def own_key() -> dict[str, str]:
    return {SESSION_KEY_HEADER: session_key(trainer_credential(), OWN)}


# What the attacker presents: nothing, its own session's key replayed, a made-up key, LiteLLM's
# placeholder API key, the victim's id as the key.
ATTEMPTS = {
    "no_key": {},
    "own_key": "own",
    "made_up_key": {SESSION_KEY_HEADER: "0" * 64},
    "placeholder_bearer": {"Authorization": "Bearer posttrain"},
    "id_as_key": {SESSION_KEY_HEADER: VICTIM},
}


def attempt(name: str) -> dict[str, str]:
    headers = ATTEMPTS[name]
    return own_key() if headers == "own" else dict(headers)


def victim_calls(stack) -> list[dict]:
    return EngineClient(stack["front"].url).session(VICTIM)


@pytest.mark.parametrize("how", sorted(ATTEMPTS))
def test_listing_sessions_needs_the_trainer_credential(stack, attacker, how):
    for server in (stack["front"].url, stack["engine"].url):
        status, data, _ = attacker.request("GET", f"{server}/sessions", headers=attempt(how))
        assert status == 403, (server, status, data[:200])
        assert VICTIM.encode() not in data
    assert VICTIM in EngineClient(stack["front"].url).sessions()  # the trainer's view


@pytest.mark.parametrize("how", sorted(ATTEMPTS))
def test_another_episodes_session_cannot_be_read(stack, attacker, how):
    for server in (stack["front"].url, stack["router_url"], stack["engine"].url):
        for sid in (VICTIM, "run-a/g9/0"):  # a live session and one that does not exist: the same answer
            status, data, _ = attacker.request("GET", f"{server}/sessions/{quote(sid, safe='')}", headers=attempt(how))
            assert status == 403, (server, sid, status, data[:200])
            assert b"input_ids" not in data and "X-Session-Key" in json.loads(data)["error"]
    # The trainer reads it through the router and the replica; the session's own key opens it too.
    assert len(fetch_session(stack["router_url"], VICTIM)) == len(victim_calls(stack)) >= 1
    status, data, _ = attacker.request("GET", f"{stack['router_url']}/sessions/{quote(VICTIM, safe='')}",
                                       headers={SESSION_KEY_HEADER: session_key(trainer_credential(), VICTIM)})
    assert status == 200 and json.loads(data)["calls"]


@pytest.mark.parametrize("how", sorted(ATTEMPTS))
def test_no_call_can_be_appended_into_another_episodes_session(stack, attacker, how):
    before = victim_calls(stack)
    for server in (stack["front"].url, stack["router_url"]):
        body = {"input_ids": PROMPT, "sampling_params": PARAMS, "session_id": VICTIM}
        status, data, _ = attacker.request("POST", f"{server}/generate", json.dumps(body).encode(), attempt(how))
        assert status == 403, (server, status, data[:200])
        headers = {**attempt(how), SESSION_HEADER: VICTIM}
        status, data, _ = attacker.request("POST", f"{server}/v1/chat/completions", json.dumps(CHAT).encode(), headers)
        assert status == 403, (server, status, data[:200])
        body = {**CHAT, "session_id": VICTIM}  # the body's spelling of the session
        status, data, _ = attacker.request("POST", f"{server}/v1/chat/completions", json.dumps(body).encode(), attempt(how))
        assert status == 403, (server, status, data[:200])
    after = victim_calls(stack)
    assert [c["request_id"] for c in after] == [c["request_id"] for c in before]


@pytest.mark.parametrize("how", sorted(ATTEMPTS))
def test_another_episodes_session_cannot_be_deleted_or_ended(stack, attacker, how):
    status, data, _ = attacker.request("DELETE", f"{stack['front'].url}/sessions/{quote(VICTIM, safe='')}",
                                       headers=attempt(how))
    assert status == 403, (status, data[:200])
    status, data, _ = attacker.request("POST", f"{stack['router_url']}/end_session", json.dumps({"rid": VICTIM}).encode(),
                                       attempt(how))
    assert status == 403, (status, data[:200])
    assert victim_calls(stack) and VICTIM in stack["router"].sessions  # still captured, still placed


def test_a_session_cannot_be_created_before_its_episode_starts(stack, attacker):
    """Squatting: the attacker writes first under the id the next episode will use (ids are
    predictable: ``{group}/{index}``); nothing is recorded or placed, and the episode's own calls,
    with its key, are its session's only calls."""
    future = "run-a/g1/0"
    for server in (stack["front"].url, stack["router_url"]):
        body = {"input_ids": PROMPT, "sampling_params": PARAMS, "session_id": future}
        status, _, _ = attacker.request("POST", f"{server}/generate", json.dumps(body).encode(), own_key())
        assert status == 403
        status, _, _ = attacker.request("POST", f"{server}/v1/chat/completions", json.dumps(CHAT).encode(),
                                        {SESSION_HEADER: future})
        assert status == 403
    assert future not in EngineClient(stack["front"].url).sessions() and future not in stack["router"].sessions
    out = stack["trainer"].generate(PROMPT, PARAMS, session_id=future)
    calls = fetch_session(stack["router_url"], future)
    assert [c["output_ids"] for c in calls] == [out["output_ids"]]


def test_a_replica_of_the_attackers_own_cannot_join_the_router(stack, attacker):
    """A server the attacker runs on loopback, answering as a replica would, registered with the
    router, would be given sessions to serve and then be read as their capture: joining (and
    removing a real replica) needs the trainer credential."""
    from serving.http import JsonServer, Text

    fake = JsonServer({("GET", "/server_info"): lambda r: {"max_total_num_tokens": 1 << 20, "loaded_adapters": []},
                       ("GET", "/metrics"): lambda r: Text("sglang:num_running_reqs 0\n"),
                       ("GET", "/health"): lambda r: {"status": "ok"}}).start()
    try:
        router, url = stack["router"], stack["router_url"]
        before = set(router.replicas)
        for route in ("/workers", "/add_worker"):
            status, data, _ = attacker.request("POST", f"{url}{route}", json.dumps({"url": fake.url}).encode(), own_key())
            assert status == 403, (route, status, data[:200])
        status, data, _ = attacker.request("POST", f"{url}/remove_worker",
                                           json.dumps({"url": stack["front"].url}).encode(), own_key())
        assert status == 403, (status, data[:200])
        assert set(router.replicas) == before and all(r.healthy for r in router.replicas.values())
    finally:
        fake.shutdown()


def test_an_adapter_cannot_be_announced_to_the_router_without_the_credential(stack, attacker):
    """``POST /publish_adapter`` makes the router load a version on every replica and count it
    ready for new sessions: an announcement of the attacker's own (a folder it chose) is refused
    (403) with its own key, and the router's table and replicas are unchanged."""
    router, url = stack["router"], stack["router_url"]
    published = dict(router.published)
    serving = {u: set(r.adapters) for u, r in router.replicas.items()}
    for headers in ({}, own_key()):
        status, data, _ = attacker.request("POST", f"{url}/publish_adapter",
                                           json.dumps({"lora_name": "evil", "lora_path": "/tmp/evil"}).encode(), headers)
        assert status == 403 and b"trainer credential" in data, (status, data[:200])
    assert router.published == published and {u: set(r.adapters) for u, r in router.replicas.items()} == serving


def test_the_trainer_deletes_and_the_key_holder_keeps_working(stack):
    trainer = stack["trainer"]
    sid = "run-a/g2/0"
    trainer.generate(PROMPT, PARAMS, session_id=sid)
    trainer.generate(PROMPT, PARAMS, session_id=sid)
    assert len(trainer.session(sid)) == 2
    front = EngineClient(stack["front"].url)
    front.drop_session(sid)
    assert front.session(sid) == [] and sid not in front.sessions()


def test_a_session_holds_a_bounded_number_of_calls(stack):
    capture = stack["front"].capture
    sid = "run-a/g3/0"
    limit, capture.max_calls_per_session = capture.max_calls_per_session, 2
    try:
        client = EngineClient(stack["front"].url)
        client.generate(PROMPT, PARAMS, session_id=sid)
        client.generate(PROMPT, PARAMS, session_id=sid)
        status, data, _ = client.pool.request("POST", f"{client.url}/generate", json.dumps(
            {"input_ids": PROMPT, "sampling_params": PARAMS, "session_id": sid}).encode(),
            {SESSION_KEY_HEADER: client.session_key(sid)})
        assert status == 429 and "holds 2 calls" in json.loads(data)["error"]
        assert len(client.session(sid)) == 2
    finally:
        capture.max_calls_per_session = limit


def test_anonymous_sessions_never_evict_an_episodes_session():
    """Sessions the server made up for callers that named none are capped on their own: a flood of
    them (anyone may start one) drops the oldest of them, never an episode's session."""
    store = CaptureStore(max_sessions=8, max_anonymous_sessions=3)
    store.record({"rid": VICTIM, "input_ids": [1]})
    for i in range(50):
        store.record({"rid": f"chat-{i:032x}", "input_ids": [1]})
    assert store.sessions() == [VICTIM] + [f"chat-{i:032x}" for i in (47, 48, 49)]


def test_the_credential_comes_from_the_environment_and_is_checked(tmp_path):
    """A process's boundary (Credential.from_environment, which process_credential reads once)."""
    with pytest.raises(ValueError, match=r"\$POSTTRAIN_TRAINER_CREDENTIAL: the trainer credential must be at least 32"):
        Credential.from_environment({CREDENTIAL_ENV: "short"})
    with pytest.raises(ValueError, match=r"POSTTRAIN_TRAINER_CREDENTIAL_FILE \(.*missing\): the trainer credential file"):
        Credential.from_environment({CREDENTIAL_FILE_ENV: str(tmp_path / "missing")})
    secret = tmp_path / "credential"
    secret.write_text("c" * 40 + "\n")
    assert Credential.from_environment({CREDENTIAL_FILE_ENV: str(secret)}).value == "c" * 40
    assert Credential.from_environment({}) is None


def test_a_router_process_takes_the_credential_from_its_environment_never_its_command_line(tmp_path):
    """``python -m serving.router`` given the credential in a file: reads with it are answered, reads
    without it refused, and the secret is nowhere on the process's command line."""
    credential = "r" * 48
    path = tmp_path / "credential"
    path.write_text(credential)
    env = {k: v for k, v in os.environ.items() if k != CREDENTIAL_ENV}
    env.update({CREDENTIAL_FILE_ENV: str(path), "PYTHONPATH": str(REPO)})
    proc = subprocess.Popen([sys.executable, "-m", "serving.router", "--port", "0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert " on http" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" on ")[1].split()[0]
        assert credential.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        pool = HttpPool(timeout_s=60)
        status, _, _ = pool.request("GET", f"{url}/sessions/s", headers={"Authorization": f"Bearer {credential}"})
        assert status == 200
        status, _, _ = pool.request("GET", f"{url}/sessions/s", headers={SESSION_KEY_HEADER: session_key(credential, "s")})
        assert status == 200
        status, _, _ = pool.request("GET", f"{url}/sessions/s", headers={"Authorization": f"Bearer {trainer_credential()}"})
        assert status == 403  # this test process's credential is not the router's
    finally:
        proc.kill()
        proc.wait()
