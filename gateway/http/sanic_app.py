"""The Sanic app both gateways share: one route table dispatched on the exact raw path, the limits of
`[limits]`, and one error handler. The native gateway (gateway/app.py) and P0 (gateway/p0/app.py) differ
only in their routes and their start/stop hooks.

An answer to a browser origin that --allow-origin lists (the loopback protocol admitted it, access.py)
carries `Access-Control-Allow-Origin` with that origin and `Vary: Origin`: Sanic's response middleware
runs before the head of every answer goes out, streamed, refused by a route or failed.

A target matches a route exactly; only a handler marked `takes_query` (llama-server's `GET /slots`,
whose clients send `?fail_on_no_slot=1`) is also reached by its path followed by `?query`, and reads
the query itself (`query_of`). A route whose path ends in `/{id}` (`POST /slots/{id}`) takes any
last segment, and reads it from the raw target itself; one whose id is the segment before the last
(`GET /v1/responses/{id}/input_items`) takes any segment there.

The loop's default executor (every `asyncio.to_thread`) is a `liveness.WorkerPool`, which counts its
work, and `app.ctx.liveness` (also `liveness.serving()`) reads it with the engines for /health's wedge check and
/bankml's "health" (liveness.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from sanic import Sanic
from sanic.exceptions import NotFound

from bankml.errors import BankmlError
from gateway.http import access_log as access_log_
from gateway.http.errors import GatewayErrorHandler, api_of, status_of
from gateway.http.liveness import Liveness, WorkerPool
from gateway.http.loopback import Limits
from gateway.http.shutdown import Shutdown

Handler = Callable[[Any, Any], Awaitable[Any]]


def takes_query(handler: Handler) -> Handler:
    """Mark a route whose path may be followed by `?query` (every other target must match exactly)."""
    handler.takes_query = True  # type: ignore[attr-defined]
    return handler


def query_of(request) -> dict[str, list[str]]:
    """The raw target's query, decoded as a form (llama-server's `req.get_param`); {} without one."""
    _, _, query = request.raw_url.decode("latin-1").partition("?")
    return parse_qs(query, keep_blank_values=True)


def sanic_app(name: str, limits: Limits, routes: dict[tuple[str, str], Handler], routes_text: str,
              state: Any, shutdown: Shutdown | None = None, *, access_log: bool = True) -> Sanic:
    """With `shutdown`, a stop (SIGTERM, SIGINT) ends the connections of its listeners gracefully
    (loopback.Shutdown) before Sanic's own shutdown runs. `access_log`: a line per request
    (gateway/http/access_log.py)."""
    os.environ.setdefault("SANIC_IGNORE_PRODUCTION_WARNING", "1")  # its "consider --debug or --dev": not our flags
    app = Sanic(name, configure_logging=False, error_handler=GatewayErrorHandler(routes_text))
    app.config.update({
        "REQUEST_MAX_SIZE": limits.max_body_bytes,
        "REQUEST_TIMEOUT": limits.read_timeout_s,  # idle time while a body is read (restarts at each byte)
        "KEEP_ALIVE": False,  # one request per connection; every answer says Connection: close
        "KEEP_ALIVE_TIMEOUT": limits.read_timeout_s,
        # no whole-response limit: an answer is bounded by the context, a blocked write by write_timeout_s
        "RESPONSE_TIMEOUT": 365 * 24 * 3600,
        "GRACEFUL_SHUTDOWN_TIMEOUT": 2.0,
        "ACCESS_LOG": False,
        "NOISY_EXCEPTIONS": False,
        "MOTD": False,
        "FALLBACK_ERROR_FORMAT": "text",
    })
    app.ctx.state = state
    workers = WorkerPool()
    app.ctx.liveness = Liveness(workers, limits.wedged_after_s)

    @app.before_server_start
    async def own_workers(app):
        app.ctx.liveness.install(asyncio.get_running_loop())

    @app.on_response
    async def cors(request, response):
        origin = getattr(getattr(request, "protocol", None), "cors_origin", None)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    if shutdown is not None:
        @app.after_server_start
        async def stop_signals(app):  # the first after-start listener: before the server says it listens
            shutdown.take_signals(app, (signal.SIGINT, signal.SIGTERM))

        @app.before_server_stop
        async def end_connections(app):
            await shutdown.stop()

    async def dispatch(request, path: str = ""):
        if not access_log:
            return await route(request)
        entry, t0 = access_log_.begin()
        status = None
        try:
            response = await route(request)
            status = getattr(response, "status", None)
            return response
        except BankmlError as e:  # the error handler answers it with its table's status
            status = status_of(e, api_of(request.path))
            raise
        except Exception as e:
            status = getattr(e, "status_code", 500)
            raise
        finally:
            if status is None:  # a stream: the route sent its answer itself
                status = getattr(getattr(getattr(request, "stream", None), "response", None), "status", None)
            access_log_.write(request.method, request.path, status, entry, t0)

    async def route(request):
        # paths match exactly, raw: `?query`, a trailing / or %-escapes are 404, as in the Rust bankml
        target = request.raw_url.decode("latin-1")
        handler = routes.get((request.method, target))
        path = target.partition("?")[0]
        if handler is None and "?" in target:
            handler = routes.get((request.method, path))
            if not getattr(handler, "takes_query", False):
                handler = None
        if handler is None:  # a route with a last segment of its own, e.g. POST /slots/{id}
            handler = routes.get((request.method, path.rpartition("/")[0] + "/{id}"))
            if handler is not None and "?" in target and not getattr(handler, "takes_query", False):
                handler = None
        if handler is None:  # an id before the last segment, e.g. GET /v1/responses/{id}/input_items
            head, _, last = path.rpartition("/")
            handler = routes.get((request.method, head.rpartition("/")[0] + "/{id}/" + last))
            if handler is not None and "?" in target and not getattr(handler, "takes_query", False):
                handler = None
        if handler is None:
            raise NotFound()
        return await handler(request, app.ctx.state)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]
    app.add_route(dispatch, "/", methods=methods, name="root")
    app.add_route(dispatch, "/<path:path>", methods=methods, name="dispatch")
    return app


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)
