"""The router: an HTTP service in front of the replicas, sticky per session.

- :mod:`serving.router.policy`: where a session goes (``kv_headroom``, ``round_robin``,
  ``least_loaded``) and the replica and session records the policies read.
- :mod:`serving.router.core`: :class:`~serving.router.core.Router`, fleet membership, sessions,
  adapter versions (``lora_path: "latest"``), retries on a dead replica.
- :mod:`serving.router.server`: :func:`~serving.router.server.serve_router`, its HTTP endpoints.
- ``python -m serving.router`` (:mod:`serving.router.__main__`): the router process.

In-process::

    from serving.router.core import Router
    from serving.router.server import serve_router
    router = Router(policy="kv_headroom"); server = serve_router(router, port=0)
"""
