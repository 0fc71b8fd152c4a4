"""The project's own engine: a transformers + peft model served with SGLang's native HTTP API on CPU.

Not the default: replicas run vLLM (:mod:`serving.replica`). This engine is the baseline that
``bench/serving_vllm.py`` measures vLLM against, ``--engine local`` / ``POSTTRAIN_ENGINE=local``
where vLLM's CPU build cannot serve a model (head sizes it has no kernel for, e.g. 8 or 16), and an
in-process engine for the router's and the publisher's tests:

    from serving.local_engine import LocalEngine
    from serving.http import serve
    engine = LocalEngine("path/to/model"); server = serve(engine, port=0); server.url

As a process: ``python -m serving.local_engine --model PATH --port 30000`` (:mod:`.__main__`).
:mod:`.engine` holds the engine; :class:`serving.engines.local.LocalEngineClient` is its client
behind a replica's capture front.
"""

from serving.local_engine.engine import LocalEngine

__all__ = ["LocalEngine"]
