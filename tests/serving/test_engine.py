"""The local engine over real HTTP on 127.0.0.1 with a tiny random Qwen2 model."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from serving.capture_store import trainer_headers
from serving.client import EngineClient, EngineError
from serving.local_engine import LocalEngine
from serving.http import serve
from serving.protocol import parse_metrics

PROMPT = list(range(10, 50))


def test_generate_answers_sglang_fields(engine_server):
    client = EngineClient(engine_server.url)
    out = client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}, return_logprob=True, rid="s")
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 12 == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["weight_version"] == "base"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert "output_token_logprobs" not in client.generate(PROMPT, {"max_new_tokens": 2})["meta_info"]


def test_stop_token_and_greedy_determinism(engine_server):
    client = EngineClient(engine_server.url)
    a = client.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    b = client.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert a["output_ids"] == b["output_ids"]
    stop = a["output_ids"][3]
    c = client.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]})
    first = a["output_ids"].index(stop)
    assert c["output_ids"] == a["output_ids"][: first + 1]
    assert c["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_prefix_cache_hits_and_concurrent_batching_match_single_requests(engine_server):
    client = EngineClient(engine_server.url)
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    prompts = [PROMPT + [60 + i] for i in range(12)]
    singles = [client.generate(p, params)["output_ids"] for p in prompts]
    with ThreadPoolExecutor(12) as ex:
        batched = list(ex.map(lambda p: client.generate(p, params), prompts))
    # A batch of left-padded rows decodes the same tokens as each request alone.
    assert [b["output_ids"] for b in batched] == singles
    assert all(b["meta_info"]["cached_tokens"] >= 32 for b in batched)  # the shared 40-token prompt, in 16-token blocks
    m = client.metrics()
    assert 0 < m["cache_hit_rate"] <= 1
    assert m["num_requests_total"] == 24


def test_budget_evicts_cache_and_retracts_running_requests(tiny_model):
    engine = LocalEngine(tiny_model, max_total_tokens=256, max_running_requests=16, admission_reserve_tokens=8, torch_threads=1)
    server = serve(engine, port=0)
    try:
        client = EngineClient(server.url)
        params = {"max_new_tokens": 60, "temperature": 1.0, "ignore_eos": True}
        for round_ in range(5):  # concurrent arrivals overflow the budget as they grow
            prompts = [[100 + round_ * 16 + i] * 20 for i in range(8)]
            with ThreadPoolExecutor(8) as ex:
                outs = list(ex.map(lambda p: client.generate(p, params, return_logprob=True), prompts))
            assert all(len(o["output_ids"]) == 60 == len(o["meta_info"]["output_token_logprobs"]) for o in outs)
            if engine.num_retracted_reqs:
                break
        assert engine.num_retracted_reqs > 0
        assert engine.cache.stats.evicted_tokens > 0
        m = client.metrics()
        assert m["num_retracted_reqs"] == engine.num_retracted_reqs
        assert m["num_used_tokens"] == 0 and m["token_usage"] == 0  # nothing running, nothing locked
        assert engine.cache.cached_tokens <= 256
    finally:
        server.shutdown()


def test_several_adapters_in_one_batch(engine_server, adapters):
    client = EngineClient(engine_server.url)
    for name, path in adapters.items():
        client.load_lora_adapter(name, str(path))
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    versions = [None, "v000001", "v000002"]
    singles = {v: client.generate(PROMPT, params, lora_path=v)["output_ids"] for v in versions}
    assert len({tuple(s) for s in singles.values()}) == 3  # each version is a different model
    with ThreadPoolExecutor(9) as ex:
        mixed = list(ex.map(lambda v: (v, client.generate(PROMPT, params, lora_path=v)), versions * 3))
    for version, out in mixed:
        assert out["output_ids"] == singles[version]
        assert out["meta_info"]["weight_version"] == (version or "base")
    client.unload_lora_adapter("v000001")
    with pytest.raises(EngineError) as err:
        client.generate(PROMPT, params, lora_path="v000001")
    assert err.value.status == 400 and "lora_path" in err.value.message
    assert client.generate(PROMPT, params, lora_path="v000002")["output_ids"] == singles["v000002"]
    client.unload_lora_adapter("v000002")  # the last one: the engine is back on the plain base model
    assert client.generate(PROMPT, params)["output_ids"] == singles[None]
    client.load_lora_adapter("v000002", str(adapters["v000002"]))
    assert client.generate(PROMPT, params, lora_path="v000002")["output_ids"] == singles["v000002"]


@pytest.mark.parametrize("body, field", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"input_ids": [1, 99999]}, "input_ids"),
    ({"text": "hi"}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"beam": 2}}, "sampling_params.beam"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1], "lora_path": "nope"}, "lora_path"),
])
def test_bad_input_is_a_400_naming_the_field(engine_server, body, field):
    client = EngineClient(engine_server.url)
    with pytest.raises(EngineError) as err:
        client.pool.json("POST", f"{engine_server.url}/generate", body)
    assert err.value.status == 400
    assert field in err.value.message


def test_bad_adapter_requests_are_400(engine_server, tmp_path):
    client = EngineClient(engine_server.url)
    with pytest.raises(EngineError) as err:
        client.load_lora_adapter("v1", str(tmp_path))
    assert err.value.status == 400 and "lora_path" in err.value.message
    with pytest.raises(EngineError) as err:
        client.pool.json("POST", f"{engine_server.url}/load_lora_adapter", {"lora_name": "bad name!", "lora_path": "x"},
                         trainer_headers())
    assert err.value.status == 400 and "lora_name" in err.value.message


def test_metrics_use_sglang_names_and_both_spellings_parse(engine_server):
    client = EngineClient(engine_server.url)
    client.generate(PROMPT, {"max_new_tokens": 2})
    _, text, _ = client.pool.request("GET", f"{engine_server.url}/metrics")
    text = text.decode()
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "num_retracted_reqs"):
        assert f"sglang:{name}{{" in text
    underscored = text.replace("sglang:", "sglang_")
    assert parse_metrics(underscored) == parse_metrics(text)
    assert parse_metrics(text)["num_requests_total"] == 1


def test_batched_input_ids_answer_a_list(engine_server):
    client = EngineClient(engine_server.url)
    out = client.pool.json("POST", f"{engine_server.url}/generate",
                           {"input_ids": [PROMPT, PROMPT[:5]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT), 5]
