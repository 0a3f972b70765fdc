"""P0: bankml serve in front of llama.cpp's llama-server (`--spawn BIN` or `--upstream H:P`).

It vouches for the file, the path and the transcript, not for the arithmetic: the tokens come from
llama-server. `run_p0(gated, options)`, after bankml/serve.py gated the file (steps 1-4: identity,
verify, identity again, the upstream address), as the Rust bankml's serve.rs starts:
5. SIGTERM, SIGINT and SIGHUP stop a spawned llama-server, then exit 128 + the signal (spawn.py); once
   serving, the answers in flight are let finish first (shutdown.py, [serve] shutdown_grace_s),
   and a second signal meanwhile stops at once;
6. with --spawn: refuse if anything answers on the upstream address, else launch llama-server on the
   canonical path of the verified file;
7. poll /health every 500 ms, for 900 s with --spawn (a spawned llama-server that exits is noticed at once,
   its last stderr lines in the refusal) and 10 s without;
8. /props model_path, canonicalised, must be the verified file;
9. hashed_at = now; the backend string names the llama-server build /props reports;
10. only now bind --listen, then serve. Any refusal prints `bankml serve: refuse: <why>`, stops a
    spawned llama-server and returns 2, with no socket bound.
Routes: /bankml (what was verified), /bankml/receipt-key (what signs the receipts), the monitor's
(gateway/monitor/routes.py, shared with --native: usage of this process and the engine, an empty ring of
answers, Prometheus, the status page), llama-server's /health, /props and /v1/models passed through,
and /v1/chat/completions with signed receipts (chat.py).
They match the exact request target (a `?query` is another path); every connection passes the
loopback rules first (loopback.py, shared with --native unchanged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sanic import HTTPResponse, Sanic

from bankml import __version__, jstr
from bankml.config import ServeOptions
from bankml.errors import BankmlError, StartFailed, UpstreamFailed, refuse_start
from bankml.signing import ReceiptKey
from bankml.verify import GatedModel
from gateway.http.access import Access
from gateway.http.errors import json_response
from gateway.http.loopback import Limits, make_protocol
from gateway.http.sanic_app import bind, sanic_app
from gateway.http.shutdown import Shutdown
from gateway.monitor import bankml_routes
from gateway.monitor import routes as monitor_routes
from gateway.monitor.monitoring import Monitoring
from gateway.p0.chat import chat_completions
from gateway.p0.spawn import (
    STOP_SIGNALS,
    LlamaServer,
    exit_status_text,
    install_stop_signals,
    llama_server_argv,
)
from gateway.p0.upstream import (
    MAX_UPSTREAM_BODY_BYTES,
    Upstream,
    UpstreamError,
    address,
    already_answers,
    served_model,
    wait_healthy,
)

log = logging.getLogger("bankml.gateway")

SPAWN_HEALTH_S = 900
UPSTREAM_HEALTH_S = 10


def backend_name(build_info: str | None) -> str:
    """What answers (the receipt's "engine"), naming the build of the llama-server actually behind us."""
    return f"llama.cpp {build_info + ' ' if build_info else ''}llama-server (loopback), behind bankml P0"


@dataclass
class P0State:
    gated: GatedModel
    upstream_at: tuple[str, int]
    upstream_address: str  # "host:port", as /bankml reports it
    backend: str  # the receipt's and /bankml's "engine": llama-server and its build
    hashed_at: int
    spawned: LlamaServer | None
    receipt_key: ReceiptKey  # signs every receipt
    max_upstream_body_bytes: int = MAX_UPSTREAM_BODY_BYTES
    upstream: Upstream | None = None  # the pooled client, made in the serving loop
    monitoring: Monitoring | None = None
    stop_signal: int = 0  # the signal that stopped the server while it served (the exit is 128 + it)


# --- routes ------------------------------------------------------------------------------------


def bankml_info(state: P0State) -> dict[str, Any]:
    """The /bankml body, P0's keys in the Rust bankml's order."""
    return {
        "verified": state.gated.verified.as_dict(),
        "model": state.gated.path,
        "upstream": state.upstream_address,
        "engine": state.backend,
        "hashed_at": state.hashed_at,
    }


async def bankml(request, state: P0State):
    return json_response(jstr.dumps(bankml_info(state)))


def _processes(state: P0State) -> list[tuple[str, int]]:
    """Who /bankml/usage measures: this process, and llama-server while it runs (pid 0: none)."""
    llama_server = state.spawned
    running = llama_server is not None and llama_server.returncode() is None
    return [("bankml serve", os.getpid()), ("llama-server", llama_server.pid if running else 0)]


def p0_monitoring(state: P0State) -> Monitoring:
    """The shared monitor (usage, the ring of answers, Prometheus, the status page). llama-server
    measures its own answers, so the ring stays empty in P0, as in the Rust bankml."""
    from gpu_monitor import Monitor

    monitor = Monitor(processes=lambda: _processes(state))
    monitor.start()
    return Monitoring(monitor, whoami=lambda: bankml_info(state), mode="p0", root_text=ROOT_TEXT)


def _proxy(path: str) -> Callable[[Any, P0State], Awaitable[HTTPResponse]]:
    async def proxy(request, state: P0State) -> HTTPResponse:
        try:
            status, content_type, body = await state.upstream.get(path)
        except UpstreamError as e:
            raise UpstreamFailed(str(e)) from None
        return HTTPResponse(body, status=status, content_type=content_type)

    return proxy


ROUTES: dict[tuple[str, str], Callable[[Any, P0State], Awaitable[HTTPResponse]]] = {
    **monitor_routes.ROUTES,  # /, /bankml/usage, /bankml/metrics, /bankml/status, /metrics
    ("GET", "/bankml"): bankml,
    ("GET", "/bankml/receipt-key"): bankml_routes.receipt_key,
    ("GET", "/health"): _proxy("/health"),
    ("HEAD", "/health"): _proxy("/health"),  # llama-server's GET /health; Sanic sends no body for a HEAD
    ("GET", "/props"): _proxy("/props"),
    ("GET", "/v1/models"): _proxy("/v1/models"),
    ("POST", "/v1/chat/completions"): chat_completions,
}

ROUTES_TEXT = ("bankml serve: GET / /bankml /bankml/receipt-key /bankml/usage /bankml/metrics /bankml/status "
               "/metrics /health /props /v1/models, HEAD / /health, POST /v1/chat/completions")
ROOT_TEXT = "bankml is running (in front of llama-server)"  # GET / for clients that are not browsers


def create_p0_app(state: P0State, limits: Limits, name: str = "bankml_p0", shutdown: Shutdown | None = None, *,
                  access_log: bool = True) -> Sanic:
    """With `shutdown`, a stop signal while serving ends the connections gracefully (the answers in
    flight need llama-server, so it is stopped after them); without, at once, as during start-up."""
    app = sanic_app(name, limits, ROUTES, ROUTES_TEXT, state, access_log=access_log)

    @app.before_server_start
    async def open_upstream(app):
        state.upstream = Upstream(*state.upstream_at, state.max_upstream_body_bytes)

    @app.after_server_start
    async def own_signals(app):
        # Sanic set SIGINT and SIGTERM to its own (or ignored) while starting: ours again
        if shutdown is None:
            return install_stop_signals(lambda: state.spawned)

        def stopping(signum: int) -> None:
            state.stop_signal = signum
            log.info("signal %s: stopping", signal.Signals(signum).name)

        shutdown.take_signals(app, STOP_SIGNALS, stopping)

    if shutdown is not None:
        @app.before_server_stop
        async def end_connections(app):
            # a second signal while the answers finish stops the engine and exits at once (Sanic
            # has just taken the loop's SIGINT and SIGTERM handlers away; SIGHUP's is taken here, or
            # the loop's close would reset SIGHUP to its default, which ends the process at once
            # without stopping llama-server)
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            install_stop_signals(lambda: state.spawned)
            await shutdown.stop()

    @app.after_server_stop
    async def close_upstream(app):
        if state.upstream is not None:
            await state.upstream.aclose()

    return app


# --- start-up ----------------------------------------------------------------------------------


def _watch(llama_server: LlamaServer) -> None:
    """Say so when llama-server ends while we serve (answers are 502 from then on)."""

    def wait() -> None:
        code = llama_server.proc.wait()
        if llama_server.stopping:
            return
        log.warning("llama-server (pid %d) exited (%s) while serving; answers are 502 from now on; "
                    "its last lines:\n%s", llama_server.pid, exit_status_text(code), llama_server.last_output())

    threading.Thread(target=wait, name="llama-server-watch", daemon=True).start()


def start_llama_server(gated: GatedModel, options: ServeOptions, up: str, holder: list) -> str | None:
    """Steps 6-8: launch (with --spawn) or find llama-server; returns its build_info. Raises StartFailed
    or UpstreamFailed. A launched one is put in `holder` at once, so a signal or a refusal can stop it."""
    if options.spawn:
        if already_answers(up):
            raise StartFailed(f"{up} already answers: an engine is running there, and bankml would bind to it "
                          "instead of the one it launches. Stop it, or use --upstream to check it by its /props")
        host, port = options.upstream
        argv = llama_server_argv(options.spawn, gated.path, host, port, options.threads, options.ctx,
                           options.spec_ngram, options.slot_dir, options.spec_sizes)
        try:
            holder.append(LlamaServer(argv))
        except OSError as e:
            raise StartFailed(f"cannot launch {options.spawn}: {e.strerror or e}") from e
        log.info("launched %s (pid %d) on %s; waiting for /health", options.spawn, holder[0].pid, up)
    wait_healthy(up, SPAWN_HEALTH_S if options.spawn else UPSTREAM_HEALTH_S, holder[0] if holder else None)
    return served_model(up, gated.path).build_info


def run_p0(gated: GatedModel, options: ServeOptions) -> int:
    """Start llama-server (or check it), bind --listen, serve until stopped. Returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="bankml serve: %(message)s", stream=sys.stderr)
    logging.getLogger("sanic.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream request
    limits = options.config.limits
    up = address(*options.upstream)
    holder: list[LlamaServer] = []
    install_stop_signals(lambda: holder[0] if holder else None)
    try:
        build_info = start_llama_server(gated, options, up, holder)
        hashed_at = int(time.time())
        try:
            sock = bind(*options.listen)
        except OSError as e:
            raise StartFailed(f"cannot listen on {address(*options.listen)}: {e.strerror or e}") from e
    except BankmlError as e:
        if holder:
            holder[0].stop()
        return refuse_start(str(e))
    except BaseException:
        if holder:  # a bug must not leave llama-server running until we exit
            holder[0].stop()
        raise
    spawned = holder[0] if holder else None
    state = P0State(gated, options.upstream, up, backend_name(build_info), hashed_at, spawned,
                    options.receipt_key, options.config.limits.max_upstream_body_bytes)
    state.monitoring = p0_monitoring(state)
    shutdown = Shutdown(options.config.serve.shutdown_grace_s)
    shutdown.add_listener(sock)
    app = create_p0_app(state, limits, shutdown=shutdown, access_log=options.config.serve.access_log)
    access = Access.of(options.api_keys, options.allowed_origins)  # the keys and origins, as --native's
    app.prepare(sock=sock, protocol=make_protocol(limits, shutdown, access), single_process=True, motd=False,
                access_log=False, register_sys_signals=False)
    if spawned is not None:
        _watch(spawned)
    listen = address(*sock.getsockname()[:2])
    log.info("receipts signed with %s (key_id %s)", options.receipt_key.path, options.receipt_key.key_id)

    async def announce(app) -> None:
        # only once the stop signals are ours again (own_signals, registered first): Sanic ignores
        # SIGINT and SIGTERM while it starts, and a supervisor's signal sent on this line was lost
        log.info("bankml serve %s: %s verified (sha256 %s), upstream %s serves it (%s); listening on http://%s",
                 __version__, gated.path, gated.verified.model_sha256, up, state.backend, listen)

    app.register_listener(announce, "after_server_start")
    try:
        Sanic.serve_single(app)
    finally:
        state.monitoring.close()
        if spawned is not None:
            spawned.stop()
        sock.close()
    return 128 + state.stop_signal if state.stop_signal else 0
