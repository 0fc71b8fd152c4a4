"""posttrain serving: engines, capture in the replica, adapter versions, the router, the fleet.

Everything speaks SGLang's native HTTP API (``/generate``, the adapter routes, ``/sessions``). A replica
(``python -m serving.replica``) is an engine process behind the capture front (:mod:`serving.capture`,
which records every call): vLLM by default (its CPU build here and on a Kubernetes CPU fleet), SGLang
on GPUs, or the project's ``serving.local_engine.LocalEngine`` (transformers + peft on CPU), each
reached through one client protocol (:mod:`serving.engines`). Nothing here imports Dagster; of
posttrain's packages only ``sandboxes``, below it.

A tiny model for tests and CPU runs (no downloads)::

    from serving.tiny import build_tiny_model, build_tiny_lora_adapter
    model_dir = build_tiny_model(tmp / "model")                  # Qwen2, hidden 64, 2 layers, BPE tokenizer
    adapter_dir = build_tiny_lora_adapter(model_dir, tmp / "step_000001")

A local engine, in-process or as a process (``python -m serving.local_engine --model DIR --port N``)::

    from serving.local_engine import LocalEngine
    from serving.http import serve
    engine = LocalEngine(model_dir, max_total_tokens=65536, max_running_requests=64)
    server = serve(engine, port=0)
    server.url                                 # http://127.0.0.1:PORT; server.shutdown() to stop
    # or without HTTP, from any thread (blocking; concurrent calls are batched together):
    from serving.protocol import GenerateRequest, SamplingParams
    engine.generate(GenerateRequest(input_ids, SamplingParams(max_new_tokens=48), return_logprob=True,
                                    lora_path="step_000001", rid="rollout-42"))   # same dict as /generate

Engine knobs: ``max_total_tokens`` (KV budget; cache eviction then retraction past it),
``max_running_requests`` (admission), ``block_size`` (prefix-cache block), ``max_prefill_batch``
(equal-shape prompts prefilled in one forward), ``torch_threads``. In-process engine calls are not
captured (capture lives in the HTTP layer, ``EngineServer.capture``).

Calling it (a replica, the capture sidecar or the router; all take the same calls)::

    from serving.client import EngineClient
    client = EngineClient(server.url)
    client.load_lora_adapter("step_000001", adapter_dir)
    out = client.generate(input_ids, {"max_new_tokens": 48, "temperature": 1.0, "stop_token_ids": [2]},
                          return_logprob=True, lora_path="step_000001", rid="rollout-42")
    out["output_ids"]                                   # sampled token ids
    out["meta_info"]["output_token_logprobs"]           # [[logprob, token_id, None], ...]
    out["meta_info"]["weight_version"]                  # the adapter version that served it
    out["meta_info"]["cached_tokens"], out["meta_info"]["finish_reason"]
    client.session("rollout-42")   # captured calls: input_ids, output_ids, output_logprobs, lora_path, ...

HTTP endpoints of a replica (``serving.http``): ``POST /generate``, ``POST /load_lora_adapter``,
``POST /unload_lora_adapter``, ``PUT /lora_shards/{name}/{i}?num_shards=N`` +
``POST /commit_lora_adapter`` (sharded adapter upload), ``GET /health``, ``/server_info``,
``/metrics`` (``sglang:`` names), ``GET|DELETE /sessions/{rid}``. Bad input: HTTP 400 naming the field.
The adapter routes, and the router's ``/publish_adapter``, need the trainer credential
(``Authorization: Bearer``, :mod:`serving.capture_store`); ``push_adapter`` and ``EngineClient`` send it.

Publishing a new adapter version (the trainer, ``training.publish``; versions are named by step)::

    from serving.adapters import publish_to_volume, push_adapter
    publish_to_volume(adapter_dir, run_dir / "adapters", "step_000002")  # late joiners load the newest
    push_adapter(replica_url, "step_000002", adapter_dir, num_shards=4)   # parallel shards over HTTP
    EngineClient(router_url).pool.json("POST", f"{router_url}/publish_adapter",
        {"lora_name": "step_000002", "lora_path": str(run_dir / "adapters" / "step_000002")}, trainer_headers())

The router and the fleet (``lora_path="latest"``: the newest version ready in every pool, pinned
for the session's life)::

    from serving.router.core import Router
    from serving.router.server import serve_router
    from serving.fleet import LocalFleet
    router = Router("kv_headroom", adapters_volume=run_dir / "adapters")
    fleet = LocalFleet(model_dir, router, mode="thread"); fleet.scale_up(2)
    router_server = serve_router(router, port=0)   # POST /generate, /end_session, /workers, /publish_adapter

On Kubernetes (``training.planner.k8s``): GPU engines are SGLang, one pod as
``serving.sglang.sglang_launch_spec(knobs, ...)`` describes it (the SGLang container, with
``sglang_server_args``, and the capture sidecar ``python -m serving.capture``), which the planner makes
the run's engine StatefulSet; CPU engines are replicas of vLLM's CPU build (``python -m serving.replica
--engine vllm``), a StatefulSet as well.

Benchmarks: ``bench/router.py`` (simulated fleet, ``serving.sim``) and ``bench/serving_engine.py``.
CLI: ``posttrain serving replica|engine|router|sidecar|tiny-model|sglang-args``.
"""
