"""The simulated engine keeps real KV accounting behind the real HTTP API."""

from concurrent.futures import ThreadPoolExecutor

from serving.client import EngineClient
from serving.http import serve
from serving.prefix_cache import PrefixCache
from serving.sim import ServiceModel, SimEngine

# A decode step of 20 ms: a 96-token request decodes for about 0.25 s, so six sent together are all
# running at once even when a loaded machine spreads their arrival (at 0.1 ms a step the first could
# finish before the fourth arrived, and nothing would be retracted).
SERVICE = ServiceModel(prefill_s_per_token=1e-7, decode_step_s=0.02, decode_s_per_req=0.0, decode_chunk_tokens=8)


def test_multi_turn_hits_and_budget_retractions():
    server = serve(SimEngine(max_total_tokens=1024, service=SERVICE), port=0)
    try:
        client = EngineClient(server.url)
        context = list(range(100, 300))
        out = client.generate(context, {"max_new_tokens": 16})
        assert out["meta_info"]["cached_tokens"] == 0 and len(out["output_ids"]) == 16
        context += out["output_ids"] + [7] * 20
        second = client.generate(context, {"max_new_tokens": 16})
        assert second["meta_info"]["cached_tokens"] == 208  # 200 prompt + 16 output, in whole 16-token blocks
        with ThreadPoolExecutor(6) as ex:  # 6 x (200 + 96) tokens cannot all fit 1024
            list(ex.map(lambda i: client.generate([i] * 200, {"max_new_tokens": 96}), range(6)))
        m = client.metrics()
        assert m["num_retracted_reqs"] > 0 and m["num_used_tokens"] == 0
    finally:
        server.shutdown()


def test_prefix_cache_evicts_lru_leaves_first_and_respects_locks():
    cache = PrefixCache(block_size=4)
    a = cache.insert(None, list(range(12)))
    b = cache.insert(None, [9] * 8)
    cache.lock(b)
    assert cache.cached_tokens == 20
    assert cache.evict(4) == 4  # the deepest block of the unlocked chain goes first
    assert len(cache.match(None, list(range(12)))) == 2
    assert cache.evict(100) == 8  # the rest of a; b is locked
    assert cache.match(None, [9] * 8) == b
    cache.unlock(b)
    assert cache.evictable_tokens == 8
    assert cache.match("lora", list(range(12))) == [] and a
