"""The router and the fleet over real HTTP: local tiny-model replicas in this process."""

import threading
import time

import pytest

from serving.adapters import publish_to_volume
from serving.client import EngineClient, EngineError
from serving.fleet import LocalFleet
from serving.router.core import Router
from serving.router.policy import KvHeadroom, Replica
from serving.capture_store import trainer_headers
from serving.protocol import BadRequest
from serving.router.server import serve_router

PROMPT = list(range(30, 70))
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture
def stack(tiny_model, tmp_path):
    router = Router("kv_headroom", adapters_volume=str(tmp_path / "adapters"), poll_interval_s=0.2)
    fleet = LocalFleet(tiny_model, router, engine_kwargs={"max_total_tokens": 8192, "torch_threads": 1})
    server = serve_router(router, port=0)
    yield router, fleet, EngineClient(server.url), tmp_path / "adapters"
    server.shutdown()
    fleet.shutdown()


def test_sessions_are_sticky_and_captured(stack):
    router, fleet, client, _ = stack
    fleet.scale_up(2)
    replicas = {}
    for rid in ("a", "b", "c", "d"):
        context = list(PROMPT) + [ord(rid)]
        for _ in range(3):
            out = client.generate(context, PARAMS, rid=rid, return_logprob=True)
            replicas.setdefault(rid, set()).add(out["meta_info"]["replica"])
            context += out["output_ids"] + [5]
    assert all(len(urls) == 1 for urls in replicas.values())
    record = client.session("a")  # read with the trainer credential (tests/serving/test_capture_sessions.py)
    assert len(record) == 3 and record[2]["cached_tokens"] > 0
    assert client.pool.json("POST", f"{client.url}/end_session", {"rid": "a"}, trainer_headers()) == {"ended": True}
    assert "a" not in router.sessions


def test_latest_version_waits_for_every_pool_and_running_sessions_keep_theirs(stack, adapters):
    router, fleet, client, volume = stack
    publish_to_volume(adapters["v000001"], volume, "v000001")
    reserved_url, = fleet.scale_up(1, pool="reserved", size_gpus=8)
    on_demand_url, = fleet.scale_up(1, pool="on_demand")
    # Both joined after v000001 was on the volume: each loaded it before taking traffic.
    assert all("v000001" in EngineClient(u).server_info()["loaded_adapters"] for u in (reserved_url, on_demand_url))
    old = client.generate(PROMPT, PARAMS, lora_path="latest", rid="old")
    assert old["meta_info"]["weight_version"] == "v000001"
    # v000002 reaches the reserved replica only (a sharded push): not ready in every pool yet.
    EngineClient(reserved_url).load_lora_adapter("v000002", str(adapters["v000002"]))
    router.replicas[reserved_url].adapters.add("v000002")
    assert router.newest_ready_version() == "v000001"
    assert client.generate(PROMPT, PARAMS, lora_path="latest", rid="mid")["meta_info"]["weight_version"] == "v000001"
    # Published to the router: the on-demand pool gets it, new sessions take it at once.
    client.pool.json("POST", f"{client.url}/publish_adapter", {"lora_name": "v000002", "lora_path": str(adapters["v000002"])},
                     trainer_headers())
    assert router.newest_ready_version() == "v000002"
    assert client.generate(PROMPT, PARAMS, lora_path="latest", rid="new")["meta_info"]["weight_version"] == "v000002"
    again = client.generate(PROMPT + old["output_ids"], PARAMS, lora_path="latest", rid="old")
    assert again["meta_info"]["weight_version"] == "v000001"  # a running rollout keeps its version
    with pytest.raises(EngineError) as err:
        client.generate(PROMPT, PARAMS, lora_path="v000002", rid="old")
    assert err.value.status == 400 and "lora_path" in err.value.message


def test_dead_replica_sessions_move_and_in_flight_call_is_retried(stack):
    router, fleet, client, _ = stack
    first, second = fleet.scale_up(2)
    out = client.generate(PROMPT, PARAMS, rid="s1")
    home = out["meta_info"]["replica"]
    result = {}

    def long_call():
        result["out"] = client.generate(PROMPT + out["output_ids"], {"max_new_tokens": 1500, "ignore_eos": True}, rid="s1")

    caller = threading.Thread(target=long_call)
    caller.start()
    home_client = EngineClient(home)
    while home_client.metrics().get("num_running_reqs", 0) < 1:  # the call is in flight on its replica
        time.sleep(0.01)
    fleet.kill(home)
    caller.join()
    moved = result["out"]
    assert moved["meta_info"]["replica"] != home and moved["meta_info"]["completion_tokens"] == 1500
    assert router.retried_calls >= 1 and router.moved_sessions >= 1
    assert not router.replicas[home].healthy
    # The session stays on its new replica; scale-up is one call and the newcomer takes new sessions.
    new_url, = fleet.scale_up(1)
    assert client.generate(PROMPT, PARAMS, rid="s1")["meta_info"]["replica"] == moved["meta_info"]["replica"]
    assert router.replicas[new_url].healthy


def test_router_rejects_bad_input(stack):
    router, fleet, client, _ = stack
    fleet.scale_up(1)
    for body, field in [({"input_ids": "x"}, "input_ids"), ({"input_ids": [1], "lora_path": "latest"}, "lora_path"),
                        ({"input_ids": [[1], [2]]}, "input_ids"), ({"input_ids": [1], "lora_path": "nope"}, "lora_path")]:
        with pytest.raises(EngineError) as err:
            client.pool.json("POST", f"{client.url}/generate", body)
        assert err.value.status == 400 and field in err.value.message
    with pytest.raises(EngineError) as err:
        client.pool.json("POST", f"{client.url}/workers", {"url": "ftp://x"}, trainer_headers())
    assert err.value.status == 400 and "url" in err.value.message
    with pytest.raises(EngineError) as err:
        client.pool.json("POST", f"{client.url}/workers", {"url": fleet and list(fleet.members)[0], "pool": "spot"},
                         trainer_headers())
    assert err.value.status == 400 and "pool" in err.value.message


class _FakeRouter:
    """Policy arithmetic only: replicas and sessions as plain records (no HTTP needed)."""

    def __init__(self, replicas, sessions):
        self.sessions = sessions
        self.group_replicas = {}


def test_kv_headroom_prefers_projected_room_over_current_room():
    class S:
        def __init__(self, context, growth):
            self.context_tokens, self.growth_per_turn_tokens = context, growth

    # A has more free KV now, but its live sessions grow fast; B's are nearly done growing.
    a = Replica("a", max_total_tokens=100_000, polled_used_tokens=40_000, sessions={"a1", "a2", "a3", "a4"})
    b = Replica("b", max_total_tokens=100_000, polled_used_tokens=50_000, sessions={"b1", "b2"})
    sessions = {**{f"a{i}": S(10_000, 2_000) for i in range(1, 5)}, **{f"b{i}": S(25_000, 50) for i in (1, 2)}}
    router = _FakeRouter([a, b], sessions)
    policy = KvHeadroom(sample_k=2, lookahead_turns=8)
    assert policy.projected_room_tokens(a, router) == 100_000 - 40_000 - 4 * 2_000 * 8
    assert policy.choose([a, b], 500, 0, router) is b
    # An 8-GPU replica with 8x the KV wins over a 1-GPU one at the same usage fraction.
    big = Replica("big", size_gpus=8, max_total_tokens=800_000, polled_used_tokens=400_000)
    small = Replica("small", size_gpus=1, max_total_tokens=100_000, polled_used_tokens=50_000)
    assert policy.choose([small, big], 500, 0, _FakeRouter([small, big], {})) is big


def test_replica_processes_join_with_the_newest_adapter_and_die_like_crashes(tiny_model, adapters, tmp_path):
    """`python -m serving.local_engine` replicas started by the fleet (the trainer's local mode)."""
    volume = tmp_path / "adapters"
    publish_to_volume(adapters["v000001"], volume, "v000001")
    router = Router("kv_headroom", adapters_volume=str(volume), poll_interval_s=0.2)
    fleet = LocalFleet(tiny_model, router, mode="process", engine_kwargs={"max_total_tokens": 4096, "torch_threads": 1})
    server = serve_router(router, port=0)
    try:
        first, second = fleet.scale_up(2)
        client = EngineClient(server.url)
        out = client.generate(PROMPT, PARAMS, lora_path="latest", rid="p1")
        assert out["meta_info"]["weight_version"] == "v000001"
        fleet.kill(out["meta_info"]["replica"])
        again = client.generate(PROMPT + out["output_ids"], PARAMS, lora_path="latest", rid="p1")
        assert again["meta_info"]["replica"] != out["meta_info"]["replica"]
        assert again["meta_info"]["weight_version"] == "v000001"
    finally:
        server.shutdown()
        fleet.shutdown()


def _vllm_shaped_engine(load, running: float = 0.0, kv_usage: float = 0.0):
    """A stand-in engine server with vLLM's metric names, no ``/server_info`` (404, as older SGLang),
    and ``load`` answering ``/load_lora_adapter``; started (``.url``, ``.shutdown()``)."""
    from serving.http import HttpError, JsonServer, Text

    def info(req):
        raise HttpError(404, "Not Found")

    metrics = Text(f"vllm:num_requests_running{{engine=\"0\"}} {running}\nvllm:kv_cache_usage_perc{{engine=\"0\"}} {kv_usage}\n"
                   "vllm:cache_config_info{kv_cache_size_tokens=\"4096\",engine=\"0\"} 1.0\n")
    return JsonServer({("POST", "/load_lora_adapter"): load, ("GET", "/server_info"): info,
                       ("GET", "/metrics"): lambda r: metrics}).start()


def test_adapters_are_tracked_by_the_router_not_the_engines_server_info():
    """An engine server without ``/server_info`` (older SGLang: 404) and whose load answers 400
    "already loaded" for a version it has: a stand-in speaking those shapes, since SGLang needs CUDA."""
    loads = []

    def load(req):
        name = req.json()["lora_name"]
        loads.append(name)
        if loads.count(name) > 1:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.")
        return {"success": True}

    fake = _vllm_shaped_engine(load, running=3.0, kv_usage=0.5)
    router = Router("kv_headroom", poll_interval_s=60)
    try:
        replica = router.add_replica(fake.url)
        # Capacity and load from the engine's own metric names when it has no sglang: ones.
        assert (replica.max_total_tokens, replica.running_reqs, replica.polled_used_tokens) == (4096, 3.0, 2048.0)
        router.publish_adapter("step_000001", "/v/step_000001")
        router.publish_adapter("step_000001", "/v/step_000001")  # known to serve it: not loaded again
        assert loads == ["step_000001"] and replica.adapters == {"step_000001"}
        router._load(fake.url, "step_000001", "/v/step_000001")  # "already loaded" is success
        assert router.newest_ready_version() == "step_000001"
    finally:
        router.close()
        fake.shutdown()


def test_a_version_published_while_a_replica_joins_reaches_it():
    """A publication that lands while a joining replica loads the newest version takes its targets
    before the replica is registered; the join then loads that version too, instead of serving one
    version behind until the next publication (seen as a replacement replica a version behind in the
    trainer's fault test). The engine is a stand-in speaking the load and metrics shapes."""
    router = Router("kv_headroom", poll_interval_s=60)
    loads = []

    def load(req):
        name = req.json()["lora_name"]
        loads.append(name)
        if name == "step_000001":  # the join's load: the trainer publishes the next version meanwhile
            publisher = threading.Thread(target=router.publish_adapter, args=("step_000002", "/v/step_000002"))
            publisher.start()
            publisher.join()
        return {"success": True}

    fake = _vllm_shaped_engine(load)
    try:
        router.published["step_000001"] = "/v/step_000001"
        replica = router.add_replica(fake.url)
        assert loads == ["step_000001", "step_000002"]
        assert replica.adapters == {"step_000001", "step_000002"}
        assert router.newest_ready_version() == "step_000002"
    finally:
        router.close()
        fake.shutdown()


def test_a_dead_replica_that_answers_again_at_its_address_rejoins(stack, tiny_model):
    """A Kubernetes engine pod deleted mid-run comes back under its StatefulSet name: the router takes
    it back (its newest adapter loaded first) instead of leaving it out of rotation for good."""
    from serving.http import serve
    from serving.local_engine import LocalEngine

    router, fleet, client, volume = stack
    url, = fleet.scale_up(1)
    fleet.kill(url)
    deadline = time.monotonic() + 60
    while router.replicas[url].healthy:
        assert time.monotonic() < deadline, "the router never noticed the replica died"
        time.sleep(0.05)
    server = serve(LocalEngine(tiny_model, **fleet.engine_kwargs), host="127.0.0.1", port=int(url.rsplit(":", 1)[1]))
    try:
        while not router.replicas[url].healthy:
            assert time.monotonic() < deadline + 60, "the replica that answers again was never taken back"
            time.sleep(0.05)
        assert client.generate(PROMPT, PARAMS, rid="back")["meta_info"]["replica"] == url
    finally:
        server.shutdown()
