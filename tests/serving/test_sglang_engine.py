"""SglangEngine against a fake SGLang server on loopback that answers in SGLang 0.5.23's shapes.

SGLang needs a GPU, so the server here is a stand-in: a real HTTP server on 127.0.0.1 whose routes,
JSON keys, status codes and messages are those of the 0.5.23 sources (``http_server.py``,
``io_struct.LoRAUpdateOutput``, ``lora_manager.py``, ``lora_registry.py``, ``tokenizer_manager.py``,
``api/v1/api_types.py``, ``metrics_collector.py``). It refuses a ``rid`` already in flight, an unknown
``sampling_params`` key and an adapter that is not loaded, as SGLang does. The last tests hold the
stand-in to the pinned release: the routes, messages, fields and metric names it uses are read from
the release's own files, and the ``/generate`` body the engine sends passes the release's own API
contract decoder.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serving.client import EngineError, HttpPool
from serving.engines.sglang import SglangEngine, parse_sglang_metrics
from serving.protocol import BadRequest, SamplingParams

# 0.5.23's sglang.api.v1.SamplingParams fields (unknown keys are refused).
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
}
SERVED_MODEL = "/data/model"


def lora_update_output(success: bool, error_message: str = "", loaded_adapters: dict | None = None) -> dict:
    """msgspec_to_builtins(LoRAUpdateOutput(...)): BaseReq's fields, then the output's."""
    return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error_message,
            "loaded_adapters": loaded_adapters}


class FakeSglang:
    """The state of one fake server. ``old_release``: no ``/server_info`` route (404) and LoRA
    answers without ``loaded_adapters``, as older releases answer."""

    def __init__(self, *, old_release: bool = False):
        self.old_release = old_release
        self.adapters: dict[str, str] = {}  # name -> path, in load order
        self.in_flight: dict[str, int] = {}  # rid -> count, to see a reused rid
        self.rids: list[str] = []  # accepted
        self.refused: list[str] = []  # refused: already in flight
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.prompts: list[list[int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.changed = threading.Condition()
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.lock = threading.Lock()

    # -- routes ------------------------------------------------------------------------------------

    def generate(self, body: dict) -> tuple[int, dict]:
        unknown = sorted(set(body.get("sampling_params") or {}) - SAMPLING_KEYS)
        if unknown:
            expected = ", ".join(f"`{k}`" for k in sorted(SAMPLING_KEYS))
            return 400, {"error": f"unknown field `{unknown[0]}`, expected one of {expected}"}
        rid = body.get("rid")
        with self.lock:
            if rid in self.in_flight:
                self.refused.append(rid)
                return 400, {"error": {"message": f"Duplicate request ID detected: {rid}"}}
            lora = body.get("lora_path")
            if lora is not None and lora not in self.adapters:
                return 400, {"error": {"message": f"The following requested LoRA adapters are not loaded: {lora}\n"
                                                  f"Loaded adapters: dict_keys({list(self.adapters)})."}}
            self.in_flight[rid] = 1
            self.rids.append(rid)
        with self.changed:
            self.changed.notify_all()
        try:
            self.hold.wait()
            ids = list(body["input_ids"])
            n = body["sampling_params"]["max_new_tokens"]
            with self.lock:
                cached = max((_common_prefix(ids, p) for p in self.prompts), default=0)
                self.prompts.append(ids)
                self.prompt_tokens += len(ids)
                self.cached_tokens += cached
                self.generation_tokens += n
            out_ids = [(sum(ids) + i) % 50 + 1 for i in range(n)]
            meta = {"id": rid, "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ids),
                    "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                    "completion_tokens": n, "cached_tokens": cached}
            if body.get("return_logprob"):
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [[-0.25 * (i + 1), t, None] for i, t in enumerate(out_ids)]
                meta["output_token_logprobs_length"] = n
            return 200, {"text": "", "output_ids": out_ids, "meta_info": meta}
        finally:
            with self.lock:
                self.in_flight.pop(rid, None)

    def load(self, body: dict) -> tuple[int, dict]:
        name, path = body["lora_name"], body["lora_path"]
        with self.lock:
            if name in self.adapters:
                # lora_manager.validate_new_adapter, answered with the manager's adapters
                out = lora_update_output(False, f"Failed to load LoRA adapter {name} because it is already loaded",
                                         dict(self.adapters))
                return 400, self._old(out)
            if not Path(path, "adapter_config.json").exists():
                out = lora_update_output(False, f"Can't find 'adapter_config.json' at '{path}'", dict(self.adapters))
                return 400, self._old(out)
            self.adapters[name] = path
            return 200, self._old(lora_update_output(True, "", dict(self.adapters)))

    def unload(self, body: dict) -> tuple[int, dict]:
        name = body["lora_name"]
        with self.lock:
            if name not in self.adapters:
                # lora_registry.unregister's ValueError, caught by the tokenizer manager
                message = f"LoRA with name {name} does not exist. Loaded LoRAs: dict_keys({list(self.adapters)})"
                return 400, self._old(lora_update_output(False, message))
            del self.adapters[name]
            return 200, self._old(lora_update_output(True, "", dict(self.adapters)))

    def models(self) -> dict:
        cards = [{"id": SERVED_MODEL, "object": "model", "created": 1, "owned_by": "sglang", "root": SERVED_MODEL,
                  "parent": None, "max_model_len": 4096}]
        with self.lock:
            cards += [{"id": name, "object": "model", "created": 1, "owned_by": "sglang", "root": path,
                       "parent": SERVED_MODEL, "max_model_len": None} for name, path in self.adapters.items()]
        return {"object": "list", "data": cards}

    def metrics(self) -> str:
        labels = f'engine_type="unified",model_name="{SERVED_MODEL}",moe_ep_rank="0",pp_rank="0"'
        with self.lock:
            running = len(self.in_flight)
            prompt, generation, cached = self.prompt_tokens, self.generation_tokens, self.cached_tokens
        lines = []
        # scheduler gauges: one series per data-parallel rank (dp_rank), total under priority=""
        for name, per_rank, doc in (("num_running_reqs", [running, 2], "The number of running requests."),
                                    ("num_queue_reqs", [3, 1], "The number of requests in the waiting queue."),
                                    ("token_usage", [0.25, 0.5], "The token usage."),
                                    ("max_total_num_tokens", [1000, 1000], "Maximum total number of tokens.")):
            lines += [f"# HELP sglang:{name} {doc}", f"# TYPE sglang:{name} gauge"]
            for rank, value in enumerate(per_rank):
                lines.append(f'sglang:{name}{{dp_rank="{rank}",{labels},priority="",tp_rank="{rank}"}} {float(value)}')
            if name in ("num_running_reqs", "num_queue_reqs"):  # a per-priority breakdown, not to be added
                lines.append(f'sglang:{name}{{dp_rank="0",{labels},priority="5",tp_rank="0"}} 7.0')
        tokenizer = 'engine_type="unified",model_name="/data/model"'
        for name, series in (("prompt_tokens_total", [("is_streaming", "false", prompt), ("is_streaming", "true", 0)]),
                             ("generation_tokens_total", [("is_streaming", "false", generation)]),
                             ("cached_tokens_total", [("cache_source", "device", cached), ("cache_source", "host", 0)])):
            lines += [f"# HELP sglang:{name} Tokens.", f"# TYPE sglang:{name} counter"]
            lines += [f'sglang:{name}{{{key}="{value}",{tokenizer}}} {float(count)}' for key, value, count in series]
        lines += ["# TYPE sglang:e2e_request_latency_seconds histogram",
                  f'sglang:e2e_request_latency_seconds_bucket{{le="+Inf",{tokenizer}}} 4.0',
                  f'sglang:e2e_request_latency_seconds_count{{{tokenizer}}} 4.0']
        return "\n".join(lines) + "\n"

    def _old(self, out: dict) -> dict:
        if self.old_release:
            out = {k: v for k, v in out.items() if k != "loaded_adapters"}
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def serve_fake(fake: FakeSglang) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, payload: object, content_type: str = "application/json") -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            fake.paths.append(self.path)
            if self.path == "/health":
                self._send(200, "", "text/plain")
            elif self.path == "/v1/models":
                self._send(200, fake.models())
            elif self.path == "/metrics":
                self._send(200, fake.metrics(), "text/plain; version=0.0.4; charset=utf-8")
            elif self.path == "/server_info" and not fake.old_release:
                self._send(200, {"model_path": SERVED_MODEL, "version": "0.5.23", "internal_states": []})
            else:
                self._send(404, {"detail": "Not Found"})  # FastAPI's answer for a route it does not have

        def do_POST(self):
            fake.paths.append(self.path)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.bodies.append(body)
            routes = {"/generate": fake.generate, "/load_lora_adapter": fake.load, "/unload_lora_adapter": fake.unload}
            if self.path not in routes:
                self._send(404, {"detail": "Not Found"})
                return
            status, payload = routes[self.path](body)
            with fake.changed:
                fake.changed.notify_all()
            self._send(status, payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(params=["0.5.23", "older"])
def fake(request):
    fake = FakeSglang(old_release=request.param == "older")
    server = serve_fake(fake)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield fake
    fake.hold.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def adapter_dirs(tmp_path):
    dirs = {}
    for name in ("v000001", "v000002"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text('{"r": 8}')
        dirs[name] = str(tmp_path / name)
    return dirs


def test_generate_sends_sglangs_native_body_and_reads_ids_logprobs_and_cache(fake, adapter_dirs):
    engine = SglangEngine(fake.url)
    engine.load_adapter("v000001", adapter_dirs["v000001"])
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=-1, stop_token_ids=(7,), seed=11)
    first = engine.generate([5, 6, 7, 8], params, adapter="v000001", request_id="rollout-3")
    body = fake.bodies[-1]
    assert body["input_ids"] == [5, 6, 7, 8] and body["return_logprob"] is True and body["lora_path"] == "v000001"
    assert body["sampling_params"] == {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                       "ignore_eos": False, "stop_token_ids": [7], "sampling_seed": 11}
    assert first.output_ids == [(26 + i) % 50 + 1 for i in range(4)]
    assert first.output_logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert first.finish_reason == {"type": "length", "length": 4}
    assert first.prompt_tokens == 4 and first.cached_tokens == 0
    assert first.engine_request_id == body["rid"] and body["rid"].startswith("rollout-3")
    second = engine.generate([5, 6, 7, 9, 10], params, adapter=None, request_id="rollout-3")
    assert "lora_path" not in fake.bodies[-1]
    assert second.cached_tokens == 3  # the prefix [5, 6, 7] was served before
    assert second.engine_request_id != first.engine_request_id  # same session, a new rid per call


def test_a_session_id_reused_by_concurrent_calls_gets_a_rid_per_call(fake):
    """SGLang refuses a rid already in flight; two calls of one session at once both succeed."""
    engine = SglangEngine(fake.url)
    fake.hold.clear()
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(engine.generate([1, 2], SamplingParams(max_new_tokens=2),
                                                                              adapter=None, request_id="session-9")))
               for _ in range(2)]
    for t in threads:
        t.start()
    with fake.changed:
        # a guard against hanging, not a timed assertion: both arrive at once or one is refused
        fake.changed.wait_for(lambda: len(fake.in_flight) == 2 or fake.refused, timeout=300)
    assert fake.refused == [] and len(fake.in_flight) == 2  # both in flight together
    fake.hold.set()
    for t in threads:
        t.join()
    assert len(results) == 2
    assert len(set(fake.rids)) == 2 and all(r.startswith("session-9") for r in fake.rids)


def test_the_fake_refuses_a_rid_in_flight_as_sglang_does(fake):
    """The control for the test above: the same rid sent twice at once is refused."""
    pool = HttpPool(60)
    fake.hold.clear()
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "rid": "session-9"}
    held = threading.Thread(target=lambda: pool.json("POST", f"{fake.url}/generate", body))
    held.start()
    with fake.changed:
        fake.changed.wait_for(lambda: "session-9" in fake.in_flight, timeout=300)
    with pytest.raises(EngineError) as err:
        pool.json("POST", f"{fake.url}/generate", body)
    fake.hold.set()
    held.join()
    assert err.value.status == 400 and "Duplicate request ID detected: session-9" in str(err.value)


def test_adapters_load_idempotently_and_are_listed_from_v1_models_not_server_info(fake, adapter_dirs):
    engine = SglangEngine(fake.url)
    assert engine.loaded_adapters() == set()
    engine.load_adapter("v000001", adapter_dirs["v000001"])
    # Loaded already (by the sidecar, or a retry): SGLang answers 400 "already loaded"; that is success.
    engine.load_adapter("v000001", adapter_dirs["v000001"])
    assert fake.paths.count("/load_lora_adapter") == 2
    engine.load_adapter("v000002", adapter_dirs["v000002"])
    assert engine.loaded_adapters() == {"v000001", "v000002"}  # the base model's card is not an adapter
    engine.unload_adapter("v000001")
    engine.unload_adapter("v000001")  # not loaded any more: already done
    assert engine.loaded_adapters() == {"v000002"}
    assert "/server_info" not in fake.paths


def test_a_version_the_sidecar_loaded_from_staging_is_loaded_when_published_on_the_volume(fake, tmp_path, adapter_dirs):
    """The sidecar loads a sharded upload from its staging folder; publication then loads the same
    version from the run volume: SGLang answers 400 "already loaded", and the version is served."""
    staged = tmp_path / "staging" / "v000001"
    staged.mkdir(parents=True)
    (staged / "adapter_config.json").write_text('{"r": 8}')
    engine = SglangEngine(fake.url)
    engine.load_adapter("v000001", str(staged))
    engine.load_adapter("v000001", adapter_dirs["v000001"])
    assert fake.paths.count("/load_lora_adapter") == 2 and fake.adapters == {"v000001": str(staged)}
    assert engine.loaded_adapters() == {"v000001"}


def test_sglang_errors_come_back_with_sglangs_message(fake, tmp_path, adapter_dirs):
    engine = SglangEngine(fake.url)
    with pytest.raises(EngineError) as err:  # {"success": false, "error_message": ...}
        engine.load_adapter("v000009", str(tmp_path / "missing"))
    assert err.value.status == 400 and "Can't find 'adapter_config.json'" in err.value.message
    with pytest.raises(BadRequest, match="requested LoRA adapters are not loaded: v000009"):  # {"error": {"message"}}
        engine.generate([1, 2], SamplingParams(max_new_tokens=1), adapter="v000009", request_id="r")
    with pytest.raises(EngineError) as err:  # {"error": "..."}: the API contract
        engine.http.json("POST", f"{fake.url}/generate", {"input_ids": [1], "sampling_params": {"seed": 3}})
    assert err.value.status == 400 and "unknown field `seed`" in str(err.value)
    with pytest.raises(EngineError) as err:  # FastAPI's {"detail": "Not Found"}
        SglangEngine(fake.url + "/nowhere").loaded_adapters()
    assert err.value.status == 404 and err.value.message == "Not Found"


def test_health_and_metrics_from_sglangs_names(fake, adapter_dirs):
    engine = SglangEngine(fake.url)
    assert engine.health()
    engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5), adapter=None, request_id="a")
    engine.generate([1, 2, 4], SamplingParams(max_new_tokens=2), adapter=None, request_id="b")
    m = engine.metrics()
    # ranks add up (0 + 2 running, 3 + 1 queued), the per-priority series does not; usage is the fullest rank's
    assert (m.running, m.queued, m.kv_usage, m.max_total_tokens) == (2.0, 4.0, 0.5, 2000.0)
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (6.0, 7.0)
    assert (m.prefix_cache_hits, m.prefix_cache_queries) == (2.0, 6.0)
    assert not SglangEngine("http://127.0.0.1:9").health()


def test_metrics_without_sglang_series_are_zero():
    m = parse_sglang_metrics("# nothing\nvllm:num_requests_running 3\n")
    assert (m.running, m.kv_usage, m.prompt_tokens_total) == (0.0, 0.0, 0.0)


# -- the stand-in held to the pinned release's own files ------------------------------------------------


@pytest.fixture(scope="module")
def release():
    from tests.serving.test_sglang import pinned_sglang_source

    unpacked, _ = pinned_sglang_source()
    return unpacked / "sglang"


def test_the_fake_uses_the_pinned_releases_routes_messages_and_fields(release):
    srt = release / "srt"
    http_server = (srt / "entrypoints" / "http_server.py").read_text()
    for route in ("/generate", "/load_lora_adapter", "/unload_lora_adapter", "/v1/models", "/health", "/health_generate"):
        assert re.search(rf'@app\.(get|post|api_route)\(\s*"{re.escape(route)}"', http_server), route
    # /v1/models: the adapters' cards have the base model as parent
    assert re.search(r"ModelCard\(\s*id=lora_ref\.lora_name,\s*root=lora_ref\.lora_path,\s*parent=served_model_names\[0\]",
                     http_server)
    assert 'Mount("/metrics"' in (srt / "utils" / "common.py").read_text()

    def fields(path: Path, cls: str) -> list[str]:
        tree = ast.parse(path.read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]

    io_struct = srt / "managers" / "io_struct.py"
    assert fields(io_struct, "BaseReq") + fields(io_struct, "LoRAUpdateOutput") == list(lora_update_output(True))
    assert set(fields(release / "api" / "v1" / "api_types.py", "SamplingParams")) == SAMPLING_KEYS
    lora_manager = (srt / "lora" / "lora_manager.py").read_text()
    assert 'f"Failed to load LoRA adapter {lora_ref.lora_name} because it is already loaded"' in lora_manager
    registry = (srt / "lora" / "lora_registry.py").read_text()
    assert 'f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {self._registry.keys()}"' in registry
    assert 'f"The following requested LoRA adapters are not loaded: {name}\\n"' in registry
    tokenizer_manager = (srt / "managers" / "tokenizer_manager.py").read_text()
    assert 'raise ValueError(f"Duplicate request ID detected: {rid}")' in tokenizer_manager
    for key in ('"id": rid', '"finish_reason"', '"prompt_tokens"', '"cached_tokens"'):
        assert key in tokenizer_manager, key
    assert 'meta_info["output_token_logprobs"] = state.output_token_logprobs' in tokenizer_manager
    assert "(logprob, token_id, None)" in tokenizer_manager


def test_the_metric_names_read_are_the_pinned_releases(release):
    source = (release / "srt" / "observability" / "metrics_collector.py").read_text()
    kinds = {name: kind for kind, name in re.findall(r'= (Gauge|Counter|Histogram)\(\s*name="(sglang:[a-z_]+)"', source)}
    assert kinds["sglang:num_running_reqs"] == kinds["sglang:num_queue_reqs"] == "Gauge"
    assert kinds["sglang:token_usage"] == kinds["sglang:max_total_num_tokens"] == "Gauge"
    for counter in ("prompt_tokens_total", "generation_tokens_total", "cached_tokens_total"):
        assert kinds[f"sglang:{counter}"] == "Counter", counter
    engine_source = Path(__file__).resolve().parents[2].joinpath("serving", "engines", "sglang.py").read_text()
    read = set(re.findall(r'(?:total|gauges\.get|counters\.get)\("([a-z_]+)"', engine_source))
    assert read and {f"sglang:{name}" for name in read} <= set(kinds)


CONTRACT = r"""
import json, os, sys, types

root = sys.argv[1]
package = types.ModuleType("sglang")
package.__path__ = [os.path.join(root, "sglang")]
sys.modules["sglang"] = package
from sglang.srt.entrypoints.api_contract import generate_contract_error

json.dump([generate_contract_error(body) for body in json.load(sys.stdin)], sys.stdout)
"""


def test_the_generate_body_passes_the_pinned_releases_api_contract(fake, adapter_dirs):
    from tests.serving.test_sglang import run_with_sglang

    engine = SglangEngine(fake.url)
    engine.load_adapter("v000001", adapter_dirs["v000001"])
    engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, top_k=5, top_p=0.9, seed=4, stop_token_ids=(2,)),
                    adapter="v000001", request_id="s")
    engine.generate([1, 2, 3], SamplingParams(), adapter=None, request_id="s")
    sent = [b for b in fake.bodies if "input_ids" in b]
    assert len(sent) == 2
    broken = {"input_ids": [1], "sampling_params": {"seed": 4}}  # the control: a key SGLang does not know
    *verdicts, refused = run_with_sglang(CONTRACT, [*sent, broken])
    assert verdicts == [None, None]
    assert "unknown field `seed`" in refused


def test_the_capture_sidecar_in_front_of_sglang_records_each_call_of_a_session(fake, adapter_dirs):
    """The pod's pair: ``python -m serving.capture --engine sglang`` in front of SGLang on localhost."""
    from serving.capture import serve_sidecar
    from serving.client import EngineClient

    front = serve_sidecar(fake.url, engine="sglang")
    try:
        client = EngineClient(front.url)
        client.load_lora_adapter("v000001", adapter_dirs["v000001"])
        client.load_lora_adapter("v000001", adapter_dirs["v000001"])  # a retried publication
        outs = [client.generate([3, 4, 5], {"max_new_tokens": 3}, return_logprob=True, lora_path="v000001",
                                rid="rollout-1") for _ in range(2)]
        calls = client.session("rollout-1")
        assert [c["output_ids"] for c in calls] == [o["output_ids"] for o in outs] == [[13, 14, 15]] * 2
        assert [c["output_logprobs"] for c in calls] == [[-0.25, -0.5, -0.75]] * 2
        assert len({c["engine_request_id"] for c in calls}) == 2 and set(fake.rids) == {c["engine_request_id"] for c in calls}
        assert client.server_info()["loaded_adapters"] == ["v000001"]
        assert "/server_info" not in fake.paths  # SGLang's own is never asked
    finally:
        front.shutdown()
