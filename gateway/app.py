"""The native gateway: `run_gateway` (called by bankml/serve.py once the gate has passed) and the app.

Start-up, after the gate: start the engine thread, load and warm the model on it, bind both
addresses (--listen, and the compat listener --upstream names, for llama-server's clients), and
only then serve.
Any failure before serving prints `bankml serve: refuse: <why>` and returns 2 with no socket left
bound. Sanic runs in one process (`Sanic.serve_single`): the engine lives here, and JAX must never be
forked.

Routing is one table, matched on the exact request target, as the Rust bankml matches it: a `?query`,
a trailing slash or a percent-escape is another path, and any unknown (method, path) is a 404.
Every connection first passes the loopback rules (loopback.py).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sanic import Sanic

from bankml import __version__
from bankml.config import EngineConfig, ServeOptions
from bankml.errors import ConfigInvalid
from bankml.verify import GatedModel
from gateway import bankml_routes, llama_routes, monitor_routes, ollama_chat, ollama_create, ollama_models
from gateway.chat_route import chat_completions
from gateway.engine_client import EngineClient
from gateway.loopback import Limits, make_protocol
from gateway.monitoring import Monitoring
from gateway.residency import Loader, Residency
from gateway.sanic_app import bind, sanic_app
from gateway.shutdown import Shutdown
from gpu_monitor import limiter
from model import device_budget
from model.engine_thread import EngineThread

log = logging.getLogger("bankml.gateway")

Handler = Callable[[Any, "GatewayState"], Awaitable[Any]]

ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", "/bankml"): bankml_routes.bankml,
    ("GET", "/bankml/usage"): monitor_routes.usage,
    ("GET", "/bankml/metrics"): monitor_routes.metrics,
    ("GET", "/bankml/status"): monitor_routes.status,
    ("GET", "/metrics"): monitor_routes.prometheus,
    ("GET", "/health"): llama_routes.health,
    ("GET", "/props"): llama_routes.props,
    ("GET", "/v1/models"): llama_routes.models,
    ("GET", "/slots"): llama_routes.slots,  # and /slots?fail_on_no_slot=1
    ("GET", "/"): monitor_routes.root,  # the status page for a browser, else one line
    ("HEAD", "/"): monitor_routes.root,
    ("HEAD", "/health"): llama_routes.health,  # a balancer's probe: GET's status and headers, no body
    ("POST", "/tokenize"): llama_routes.tokenize,
    ("POST", "/apply-template"): llama_routes.apply_template,
    ("POST", "/v1/chat/completions"): chat_completions,
    ("POST", "/api/chat"): ollama_chat.chat,
    ("POST", "/api/generate"): ollama_chat.generate,
    ("POST", "/api/embed"): ollama_chat.refused,
    ("POST", "/api/embeddings"): ollama_chat.refused,
    ("POST", "/api/pull"): ollama_chat.refused,
    ("POST", "/api/push"): ollama_chat.refused,
    ("GET", "/api/version"): ollama_models.version,
    ("GET", "/api/tags"): ollama_models.tags,
    ("POST", "/api/show"): ollama_models.show,
    ("GET", "/api/ps"): ollama_models.ps,
    ("POST", "/api/create"): ollama_create.create,
    ("POST", "/api/copy"): ollama_create.copy,
    ("DELETE", "/api/delete"): ollama_create.delete,
}


ROOT_TEXT = "bankml is running (native)"  # GET / for clients that are not browsers; names no API it lacks


def routes_text() -> str:
    by_method: dict[str, list[str]] = {}
    for method, path in ROUTES:
        by_method.setdefault(method, []).append(path)
    return "bankml serve --native: " + ", ".join(f"{m} {' '.join(p)}" for m, p in by_method.items())


@dataclass
class GatewayState:
    residency: Residency
    client: EngineClient
    compat_listen: str  # "host:port" of the second listener (/bankml's "upstream")
    monitoring: Monitoring | None = None  # usage, the ring of answers, energy, Prometheus


def create_app(state: GatewayState, limits: Limits, name: str = "bankml_serve",
               shutdown: Shutdown | None = None) -> Sanic:
    return sanic_app(name, limits, ROUTES, routes_text(), state, shutdown)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def native_loader(n_ctx: int, engine: EngineConfig) -> Loader:
    def load(path: str):
        from model.engine_thread import load_engine

        loaded, backend = load_engine(path, n_ctx=n_ctx, max_seqs=engine.max_seqs,
                                      prefill_chunk=engine.max_prefill_bucket,
                                      compile_cache_dir=compile_cache_path(engine.compile_cache_dir),
                                      kv_cache_bytes=engine.kv_cache_bytes, page_size=engine.page_size)
        loaded.lazy_compile = True  # warm only what a first request needs; the rest compiles once bound
        return loaded, backend

    return load


def compile_cache_path(setting: str) -> str | None:
    """[engine] compile_cache_dir: "" turns JAX's persistent compilation cache off; `~` is expanded."""
    return os.path.expanduser(setting) if setting else None


def native_monitoring(state: GatewayState) -> Monitoring:
    """The monitor of a gateway whose engine runs in this process (the engine is loaded by now)."""
    from gpu_monitor import Monitor

    monitor = Monitor()
    monitor.start()  # RAPL's wrap accounting, and NVML's init before the first answer's mark
    return Monitoring(monitor, whoami=lambda: bankml_routes.bankml_info(state), mode="native",
                      root_text=ROOT_TEXT, energy_device=device_budget.engine_platform(),
                      engine_thread=state.client.thread)


def _refuse(why: str) -> int:
    print(f"bankml serve: refuse: {why}", file=sys.stderr, flush=True)
    return 2


def run_gateway(gated: GatedModel, options: ServeOptions, loader: Loader | None = None) -> int:
    """Load, warm, bind, serve until stopped. Returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="bankml serve: %(message)s", stream=sys.stderr)
    logging.getLogger("sanic.access").setLevel(logging.WARNING)
    limits = options.config.limits
    engine_cfg = options.config.engine
    max_seqs = engine_cfg.max_seqs
    try:  # before the engine first touches jax: JAX's allocator reads it once
        memory_fraction, fraction_note = device_budget.apply_memory_fraction(engine_cfg.memory_fraction)
    except ConfigInvalid as e:
        return _refuse(str(e))
    if fraction_note:
        log.warning("%s", fraction_note)
    thread = EngineThread(max_waiting=engine_cfg.max_waiting)
    client = EngineClient(thread)
    loader = loader or native_loader(options.ctx, engine_cfg)
    residency = Residency(gated, client, loader)
    log.info("loading %s into bankML's forward pass (n_ctx %d)", gated.path, options.ctx)
    try:
        loaded = residency.load_startup()
    except Exception as e:
        thread.stop()
        return _refuse(f"cannot load {gated.path}: {e}")
    limiter.register(device_budget.limiter_provider(lambda: thread.engine, memory_fraction=memory_fraction,
                                                    max_seqs=max_seqs, stats=client.stats, note=fraction_note))
    listen, compat_listen = _address(*options.listen), _address(*options.compat_listen)
    sockets: list[socket.socket] = []
    try:
        sockets.append(bind(*options.listen))
    except OSError as e:
        thread.stop()
        return _refuse(f"cannot listen on {listen}: {e.strerror or e}")
    try:
        sockets.append(bind(*options.compat_listen))
    except OSError as e:
        sockets[0].close()
        thread.stop()
        return _refuse(f"cannot listen on the engine address {compat_listen}: {e.strerror or e} "
                       "(is llama-server running there?)")
    listen = _address(*sockets[0].getsockname()[:2])  # a port 0 becomes the one the system chose
    compat_listen = _address(*sockets[1].getsockname()[:2])
    state = GatewayState(residency, client, compat_listen)
    state.monitoring = native_monitoring(state)
    shutdown = Shutdown(options.config.serve.shutdown_grace_s)
    for sock in sockets:
        shutdown.add_listener(sock)
    app = create_app(state, limits, shutdown=shutdown)
    for sock in sockets:
        app.prepare(sock=sock, protocol=make_protocol(limits, shutdown), single_process=True, motd=False,
                    access_log=False)
    v = loaded.verified
    log.info("%s verified (sha256 %s, %s, %s); compiled in %.1f s; engine: %s", loaded.path, v.model_sha256,
             v.arch, v.name, loaded.compile_s, loaded.backend)
    log.info("bankml %s --native: models %s; listening on http://%s and, for llama-server's clients, "
             "http://%s", __version__, ", ".join(residency.names), listen, compat_listen)
    if hasattr(thread.engine, "compile_in_background"):  # the rest of the programs, now that we are bound
        thread.engine.compile_in_background()
    try:
        Sanic.serve_single(app)
    finally:
        state.monitoring.close()
        limiter.unregister()
        thread.stop()
        for sock in sockets:
            sock.close()
    return 0
