"""One HTTP layer for every server of the project (the engine server, the capture front, the router,
the sandbox pool): uvicorn through its public interface, the access policy apart from the routes.

    from sandboxes.httpserver import Endpoint, HttpServer, needs_bearer
    server = HttpServer({("GET", "/health"): lambda req: {"status": "ok"},
                         ("POST", "/publish"): Endpoint(publish, needs_bearer(credential, "publishing"))},
                        port=0).start()
    server.url; server.shutdown()

- :mod:`sandboxes.httpserver.transport`: uvicorn on a background thread, and each connection's bounds before
  it has a request (connections, the header timeout, the head's size and framing): ``HttpLimits``.
- :mod:`sandboxes.httpserver.app`: the ASGI application: a request's bounds (size, time, framing), the access
  each route declares (checked once, before its handler), handlers on worker threads or, where a route
  says so (``async def``, or ``Endpoint(on_loop=True)``), on the event loop; the answers.
- :mod:`sandboxes.httpserver.auth`: the trainer credential as an object (``Credential``).

It imports nothing of the project, so the lowest package (sandboxes, for its pool) and serving share it.
"""

from sandboxes.httpserver.app import Access, Bearer, Endpoint, HttpError, Reply, Request, Route, Stream, Text, needs_bearer
from sandboxes.httpserver.auth import Credential
from sandboxes.httpserver.transport import MAX_BODY_BYTES, HttpLimits, HttpServer, stop_as_interrupt

__all__ = ["Access", "Bearer", "Credential", "Endpoint", "HttpError", "HttpLimits", "HttpServer", "MAX_BODY_BYTES",
           "Reply", "Request", "Route", "Stream", "Text", "needs_bearer", "stop_as_interrupt"]
