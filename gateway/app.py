"""The native gateway: `run_gateway` (called by bankml/serve.py once the gate has passed) and the app.

Start-up, after the gate (spec §0): build the registry (the startup model, then every pin of
--registry DIR, and the derived manifests over them), load and warm the startup model on its own
engine thread, bind both addresses (--listen, and the compat listener --upstream names, for
llama-server's clients), start the reaper with the server, and only then serve. Other models load
on their first request, each on an engine thread of its own (residency.py).
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
from dataclasses import dataclass, field
from typing import Any

from sanic import Sanic

from bankml import __version__
from bankml.config import EngineConfig, ServeOptions
from bankml.default_model import cache_dir
from bankml.errors import ConfigInvalid, refuse_start
from bankml.signing import ReceiptKey
from bankml.verify import GatedModel
from gateway.anthropic import messages as anthropic_messages
from gateway.anthropic import models as anthropic_models
from gateway.http.access import Access
from gateway.http.loopback import Limits, make_protocol
from gateway.http.sanic_app import bind, sanic_app
from gateway.http.shutdown import Shutdown
from gateway.monitor import bankml_routes
from gateway.monitor import routes as monitor_routes
from gateway.monitor.monitoring import Monitoring
from gateway.ollama import chat as ollama_chat
from gateway.ollama import create as ollama_create
from gateway.ollama import models as ollama_models
from gateway.ollama.embed import embed as ollama_embed
from gateway.ollama.embed import embeddings as ollama_embeddings
from gateway.openai import completion as completion_route
from gateway.openai import (
    llama_routes,
    refusals,  # issue 15 C
)
from gateway.openai import slots as slot_route
from gateway.openai.chat import chat_completions
from gateway.openai.embeddings import embedding, oai_embeddings
from gateway.responses import routes as responses
from gateway.responses.store import ResponseStore
from gateway.serving.registry import Registry
from gateway.serving.residency import Estimate, Loader, Residency
from gpu_monitor import limiter
from model import device_budget
from model.kv_events import KVEventPublisher

log = logging.getLogger("bankml.gateway")

Handler = Callable[[Any, "GatewayState"], Awaitable[Any]]

ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", "/bankml"): bankml_routes.bankml,
    ("GET", "/bankml/receipt-key"): bankml_routes.receipt_key,
    ("GET", "/bankml/usage"): monitor_routes.usage,
    ("GET", "/bankml/metrics"): monitor_routes.metrics,
    ("GET", "/bankml/status"): monitor_routes.status,
    ("GET", "/metrics"): monitor_routes.prometheus,
    ("GET", "/health"): llama_routes.health,
    ("GET", "/props"): llama_routes.props,
    ("GET", "/v1/models"): anthropic_models.models,  # OpenAI's list, or Anthropic's for its clients
    ("GET", "/v1/models/{id}"): anthropic_models.model,
    ("GET", "/slots"): llama_routes.slots,  # and /slots?fail_on_no_slot=1
    ("GET", "/"): monitor_routes.root,  # the status page for a browser, else one line
    ("HEAD", "/"): monitor_routes.root,
    ("HEAD", "/health"): llama_routes.health,  # a balancer's probe: GET's status and headers, no body
    ("POST", "/tokenize"): llama_routes.tokenize,
    ("POST", "/apply-template"): llama_routes.apply_template,
    ("POST", "/v1/chat/completions"): chat_completions,
    ("POST", "/api/chat"): ollama_chat.chat,
    ("POST", "/api/generate"): ollama_chat.generate,
    ("POST", "/api/pull"): ollama_chat.refused,
    ("POST", "/api/push"): ollama_chat.refused,
    ("GET", "/api/version"): ollama_models.version,
    ("GET", "/api/tags"): ollama_models.tags,
    ("POST", "/api/show"): ollama_models.show,
    ("GET", "/api/ps"): ollama_models.ps,
    ("POST", "/api/create"): ollama_create.create,
    ("POST", "/api/copy"): ollama_create.copy,
    ("DELETE", "/api/delete"): ollama_create.delete,
    # issue 15 A: completions (llama-server's own and its alias, OpenAI's legacy), /infill, llama-server's aliases
    ("POST", "/completion"): completion_route.completion,
    ("POST", "/completions"): completion_route.completion,  # llama-server's alias of /completion (recorded)
    ("POST", "/v1/completions"): completion_route.completions_oai,
    ("POST", "/infill"): completion_route.infill,
    ("POST", "/chat/completions"): chat_completions,
    ("GET", "/models"): llama_routes.models,
    # issue 15 C: llama-server's small endpoints, and a refusal by name for each route of its b11434 we
    # do not serve (gateway/openai/refusals.py); /completion(s), /infill, /chat/completions, /models and the
    # embeddings are A's and B's
    ("GET", "/v1/health"): llama_routes.health,
    ("POST", "/detokenize"): llama_routes.detokenize,
    ("POST", "/props"): llama_routes.change_props,
    ("POST", "/slots/{id}"): slot_route.slot_action,  # ?action=save|restore|erase, with --slot-dir
    ("POST", "/rerank"): refusals.RERANK,
    ("POST", "/reranking"): refusals.RERANK,
    ("POST", "/v1/rerank"): refusals.RERANK,
    ("POST", "/v1/reranking"): refusals.RERANK,
    ("GET", "/lora-adapters"): refusals.lora_adapters,
    ("POST", "/lora-adapters"): refusals.LORA_CHANGE,
    ("POST", "/v1/messages"): anthropic_messages.create,  # issue 29: Anthropic's Messages API
    ("POST", "/v1/messages/count_tokens"): anthropic_messages.count_tokens,
    ("POST", "/v1/responses"): responses.create,  # issue 29: OpenAI's Responses API (gateway/responses/)
    ("POST", "/responses"): responses.create,
    ("POST", "/v1/responses/input_tokens"): responses.input_tokens,
    ("POST", "/responses/input_tokens"): responses.input_tokens,
    ("GET", "/v1/responses/{id}"): responses.retrieve,
    ("GET", "/responses/{id}"): responses.retrieve,
    ("DELETE", "/v1/responses/{id}"): responses.delete,
    ("DELETE", "/responses/{id}"): responses.delete,
    ("GET", "/v1/responses/{id}/input_items"): responses.input_items,
    ("GET", "/responses/{id}/input_items"): responses.input_items,
    ("POST", "/v1/chat/completions/input_tokens"): llama_routes.count_tokens,
    ("POST", "/chat/completions/input_tokens"): llama_routes.count_tokens,
    ("POST", "/v1/chat/completions/control"): refusals.CONTROL,
    ("POST", "/v1/audio/transcriptions"): refusals.TRANSCRIPTIONS,
    ("POST", "/audio/transcriptions"): refusals.TRANSCRIPTIONS,
    ("POST", "/v1/systemone"): refusals.SYSTEMONE,
    ("GET", "/v1/stream"): refusals.STREAMS,
    ("DELETE", "/v1/stream"): refusals.STREAMS,
    ("POST", "/v1/streams/lookup"): refusals.STREAMS,
    ("GET", "/cors-proxy"): refusals.feature_disabled,
    ("POST", "/cors-proxy"): refusals.feature_disabled,
    ("GET", "/tools"): refusals.feature_disabled,
    ("POST", "/tools"): refusals.feature_disabled,
    # issue 15 B: embeddings (gateway/openai/embeddings.py, gateway/ollama/embed.py; the engine's model/embed.py)
    ("POST", "/v1/embeddings"): oai_embeddings,
    ("POST", "/embeddings"): embedding,  # llama-server's alias of /embedding (its shape, recorded)
    ("POST", "/embedding"): embedding,
    ("POST", "/api/embed"): ollama_embed,
    ("POST", "/api/embeddings"): ollama_embeddings,
}


ROOT_TEXT = "bankml is running (Ollama's API at /api, native only)"  # GET / for clients that are not browsers


def routes_text() -> str:
    by_method: dict[str, list[str]] = {}
    for method, path in ROUTES:
        by_method.setdefault(method, []).append(path)
    return "bankml serve --native: " + ", ".join(f"{m} {' '.join(p)}" for m, p in by_method.items())


@dataclass
class GatewayState:
    registry: Registry  # every model served, and how a `model` name finds one
    residency: Residency  # which are resident; a route holds one with `async with residency.lease(pin)`
    compat_listen: str  # "host:port" of the second listener (/bankml's "upstream")
    receipt_key: ReceiptKey  # signs every receipt
    monitoring: Monitoring | None = None  # usage, the ring of answers, energy, Prometheus
    access: Access = field(default_factory=Access)  # the origin and API key rules (the keys as digests only)
    slot_dir: str | None = None  # --slot-dir: where POST /slots/{id} saves and restores (None: refused)
    # the Responses API's stored responses ([limits] responses_store_bytes)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(Limits().responses_store_bytes))


def create_app(state: GatewayState, limits: Limits, name: str = "bankml_serve",
               shutdown: Shutdown | None = None, *, access_log: bool = True) -> Sanic:
    app = sanic_app(name, limits, ROUTES, routes_text(), state, shutdown, access_log=access_log)

    async def start_reaper(app) -> None:
        state.residency.start_reaper()

    async def stop_reaper(app) -> None:
        state.residency.stop_reaper()  # the engine threads stop once the loop has ended (run_gateway)

    app.register_listener(start_reaper, "after_server_start")
    app.register_listener(stop_reaper, "after_server_stop")
    return app


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def native_loader(n_ctx: int, engine: EngineConfig, whole_contexts: bool = False,
                  kv_events: KVEventPublisher | None = None) -> Loader:
    """whole_contexts: several models may share the device, so each gets a KV pool of max_seqs whole
    contexts (unless [engine] kv_cache_bytes says), never most of what the device has left. kv_events:
    each engine loaded tells it what its prefix cache keys and forgets (--kv-events-config)."""
    def load(path: str):
        from model.loading import load_engine

        loaded, backend = load_engine(path, n_ctx=n_ctx, max_seqs=engine.max_seqs,
                                      prefill_chunk=engine.max_prefill_bucket,
                                      compile_cache_dir=compile_cache_path(engine.compile_cache_dir),
                                      kv_cache_bytes=engine.kv_cache_bytes, page_size=engine.page_size,
                                      whole_contexts=whole_contexts, cache_type=engine.cache_type,
                                      speculation=engine.speculation, tensor_parallel=engine.tensor_parallel)
        loaded.lazy_compile = True  # warm only what a first request needs; the rest compiles once bound
        if kv_events is not None:
            loaded.watch_pages(kv_events.sink())
        return loaded, backend

    return load


def native_estimate(n_ctx: int, engine: EngineConfig) -> Estimate:
    """The bytes a load will hold before it runs: the file, and the KV pool it will get."""
    def estimate(path: str) -> int:
        from model.loading import whole_contexts_bytes

        pool = engine.kv_cache_bytes
        if pool == 0:
            try:
                pool = whole_contexts_bytes(path, n_ctx=n_ctx, max_seqs=engine.max_seqs, page_size=engine.page_size,
                                            cache_type=engine.cache_type)
            except Exception:  # the header says nothing usable: the load will say why; the file alone
                pool = 0
        return os.path.getsize(path) + pool

    return estimate


def compile_cache_path(setting: str) -> str | None:
    """[engine] compile_cache_dir: "" turns JAX's persistent compilation cache off; `{cache}` is
    bankml's cache directory (bankml/default_model.py's `cache_dir`), `~` is expanded."""
    if not setting:
        return None
    return os.path.expanduser(setting.replace("{cache}", os.fspath(cache_dir())))


def native_monitoring(state: GatewayState) -> Monitoring:
    """The monitor of a gateway whose engine runs in this process (the engine is loaded by now)."""
    from gpu_monitor import Monitor

    monitor = Monitor()
    monitor.start()  # RAPL's wrap accounting, and NVML's init before the first answer's mark
    monitoring = Monitoring(monitor, whoami=lambda: bankml_routes.bankml_info(state), mode="native",
                            root_text=ROOT_TEXT, energy_device=device_budget.engine_platform(),
                            engines=state.residency)
    state.residency.meter = monitoring.meter  # every engine thread, present and to come, reads it
    return monitoring


def _log_edge(options: ServeOptions) -> None:
    """What the edge admits, said once at start (a key itself never: its count only), and what signs."""
    log.info("receipts signed with %s (key_id %s)", options.receipt_key.path, options.receipt_key.key_id)
    if options.api_keys:
        log.info("API keys: %d; every route but /health, /v1/health, /models, /v1/models and / needs one", len(options.api_keys))
    if options.allowed_origins:
        log.info("browser origins admitted: %s", ", ".join(options.allowed_origins))
    if options.chat_template:
        log.info("chat template: %s (sha256 %s) replaces the startup model's; read once, not re-read",
                 options.chat_template.path, options.chat_template.sha256)


def run_gateway(gated: GatedModel, options: ServeOptions, loader: Loader | None = None,
                estimate: Estimate | None = None, budget_bytes: int | None = None) -> int:
    """Load, warm, bind, serve until stopped. Returns the process exit code. The tests give their own
    loader, estimate and memory budget (default: the device's, or 80% of the RAM)."""
    logging.basicConfig(level=logging.INFO, format="bankml serve: %(message)s", stream=sys.stderr)
    logging.getLogger("sanic.access").setLevel(logging.WARNING)
    limits = options.config.limits
    engine_cfg = options.config.engine
    max_seqs = engine_cfg.max_seqs
    try:  # before the engine first touches jax: JAX's allocator reads it once
        memory_fraction, fraction_note = device_budget.apply_memory_fraction(engine_cfg.memory_fraction)
    except ConfigInvalid as e:
        return refuse_start(str(e))
    if fraction_note:
        log.warning("%s", fraction_note)
    template = options.chat_template
    registry = Registry(gated, options.registry_dir, options.rule_set, template.text if template else None)
    if not registry.startup.native:
        return refuse_start(registry.startup.reason or f"{gated.path} cannot be played by this engine")
    several = len(registry.pins) > 1
    kv_events = None
    if options.kv_events is not None:  # before the load: its first events go out
        try:
            kv_events = KVEventPublisher(options.kv_events)
        except OSError as e:
            return refuse_start(str(e))
    loader = loader or native_loader(options.ctx, engine_cfg, whole_contexts=several, kv_events=kv_events)
    residency = Residency(registry, gated, loader, max_loaded=options.max_loaded, budget_bytes=0,
                          default_keep_alive_s=options.keep_alive_s, ctx=options.ctx,
                          max_waiting=engine_cfg.max_waiting, estimate=estimate or native_estimate(options.ctx, engine_cfg),
                          chat_template=template, max_seqs=max_seqs)
    residency.pinned = options.cluster is not None
    log.info("loading %s into bankML's forward pass (n_ctx %d)", gated.path, options.ctx)
    try:
        loaded = residency.load_startup()
    except Exception as e:
        if kv_events is not None:
            kv_events.close()
        return refuse_start(f"cannot load {gated.path}: {str(e) or type(e).__name__}")
    # after the first load: jax has started, the device is known
    residency.budget_bytes = device_budget.memory_budget_bytes() if budget_bytes is None else budget_bytes

    def recent_engine():  # the limiter reads the most recently used model's engine (its max_seqs) and snapshot
        r = residency.most_recent()
        return r.client if r is not None and r.client.has_engine else None

    def recent_stats():
        r = residency.most_recent()
        return r.client.stats() if r is not None else None

    limiter.register(device_budget.limiter_provider(recent_engine, memory_fraction=memory_fraction,
                                                    max_seqs=max_seqs, stats=recent_stats, note=fraction_note))
    listen, compat_listen = _address(*options.listen), _address(*options.compat_listen)
    sockets: list[socket.socket] = []
    try:
        sockets.append(bind(*options.listen))
    except OSError as e:
        residency.stop_all()
        return refuse_start(f"cannot listen on {listen}: {e.strerror or e}")
    try:
        sockets.append(bind(*options.compat_listen))
    except OSError as e:
        sockets[0].close()
        residency.stop_all()
        return refuse_start(f"cannot listen on the engine address {compat_listen}: {e.strerror or e} "
                       "(is llama-server running there?)")
    listen = _address(*sockets[0].getsockname()[:2])  # a port 0 becomes the one the system chose
    compat_listen = _address(*sockets[1].getsockname()[:2])
    state = GatewayState(registry, residency, compat_listen, options.receipt_key,
                         access=Access.of(options.api_keys, options.allowed_origins), slot_dir=options.slot_dir)
    state.responses = ResponseStore(limits.responses_store_bytes)
    state.monitoring = native_monitoring(state)
    shutdown = Shutdown(options.config.serve.shutdown_grace_s)
    for sock in sockets:
        shutdown.add_listener(sock)
    app = create_app(state, limits, shutdown=shutdown, access_log=options.config.serve.access_log)
    for sock in sockets:
        app.prepare(sock=sock, protocol=make_protocol(limits, shutdown, state.access), single_process=True, motd=False,
                    access_log=False)
    v = loaded.verified
    log.info("%s verified (sha256 %s, %s, %s); compiled in %.1f s; engine: %s", loaded.path, v.model_sha256,
             v.arch, v.name, loaded.compile_s, loaded.backend)
    _log_edge(options)
    for pin in registry.pins[1:]:
        if not pin.native:
            log.warning("%s is listed, not served: %s", pin.file_name, pin.reason)
    served = [p.name for p in registry.pins if p.native] + [d.name for d in registry.derived.all()]

    async def announce(app) -> None:
        # once the stop signals are the Shutdown's (sanic_app's first after-start listener): Sanic's own
        # handler, there before it, called app.stop() while Sanic still started, and a supervisor's
        # signal sent on this line was lost
        log.info("bankml %s --native: models %s (at most %d resident); listening on http://%s and, for "
                 "llama-server's clients, http://%s", __version__, ", ".join(served), options.max_loaded, listen,
                 compat_listen)

    app.register_listener(announce, "after_server_start")
    residency.compile_rest(loaded)  # the rest of the programs, now that we are bound
    try:
        Sanic.serve_single(app)
    finally:
        state.monitoring.close()
        limiter.unregister()
        residency.stop_all()
        for sock in sockets:
            sock.close()
        if kv_events is not None:
            kv_events.close()
    return 0
