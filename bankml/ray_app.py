"""Replicas of `bankml serve --native` on Ray Serve (docs/beyond-one-machine-ray.md):

    serve run bankml.ray_app:app model=FILE fork=FORK.json replicas=2

A request's path: Ray's HTTP proxy (loopback unless http_options says otherwise) → `Ingress` (reads the
body, bounded, and takes its affinity key: bankml/replica.py's `affinity_key`) → a `Replica`, picked
by `AffinityRouter` (the same key to the same replica, unless it is loaded well past the others; then
the least loaded) or by Ray's power of two choices (`routing=pow2`) → that replica's own
`bankml serve --native` child on loopback, which answers as it does alone → back, chunk by chunk.

Why each replica runs the ordinary gateway as a child process rather than the engine in the actor:
the gateway is the one place where the routes, the loopback and Host rules, the API keys, the size and
time limits, the receipts and the monitor live; a child runs all of it unchanged, where an in-actor
copy would be a second edge to keep in step. The child also runs the gate exactly as `bankml serve`
does (bankml/serve.py: guard, then the sha256 pin, on the replica's node, before the engine loads), and
the replica reports ready only once the child listens; a refusal raises in the constructor with the
child's reason, so `serve status` shows DEPLOY_FAILED and why. JAX is never forked and Sanic keeps its
own process and loop. What it costs: one loopback HTTP hop per request (bench/replicas.py measures it).

One receipt key for the application: the builder makes or reads it once, on the driver
(`receipt_key=FILE`, else bankml/signing.py's config directory's), and every replica's child signs with
that file; a replica whose node has another key there refuses to start, so `GET /bankml/receipt-key`
is the same from every replica and a client verifies any answer with it. The file must be at the same
path on every node (as the model and its FORK.json must).

Failures: the replica's health check fails once its child has exited, and Ray replaces it; a stream
cut by a dying child or actor ends with an error event in its own shape; every wait has a timeout.
Scale to zero is refused (a replica's warm-up takes minutes on a CPU).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields

import httpx
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bankml.config import LimitsConfig
from bankml.errors import ConfigInvalid
from bankml.replica import (
    ChildServer,
    Forwarded,
    Head,
    ReplicaRefused,
    Unavailable,
    error_body,
    error_chunk,
    forward,
)
from bankml.replica import affinity_key as key_of
from bankml.signing import read_key, server_key

REPLICA_HEADER = "x-bankml-replica"  # which replica answered (its Ray replica id)
ROUTINGS = ("affinity", "pow2")


@dataclass(frozen=True)
class AppArgs:
    """`serve run bankml.ray_app:app KEY=VALUE ...`: every key, its default; unknown keys are refused."""

    model: str = ""  # the GGUF, at this path on every node
    fork: str = ""  # its FORK.json, at this path on every node
    replicas: int = 1  # fixed replica count (unless min_replicas/max_replicas ask for autoscaling)
    min_replicas: int = -1  # either of these given: Ray's autoscaling between them (-1: not given); 0 is refused
    max_replicas: int = -1
    target_ongoing_requests: float = 4.0  # autoscaling's target per replica ([engine] max_seqs' default)
    routing: str = "affinity"  # affinity | pow2
    prefix_chars: int = 512  # the affinity key: this many characters of the system prompt + first message
    # answers under way on a key's replica before the key's next replica takes the rest (the children's
    # [engine] max_seqs: past it, an answer waits for a place in the batch)
    affinity_bound: int = 4
    num_cpus: float = 1.0  # each replica's ray_actor_options
    num_gpus: float = 0.0
    max_ongoing_requests: int = 32  # per replica ([limits] max_connections' default: the child's own bound)
    receipt_key: str = ""  # the key every replica signs with ("": the driver's config directory's)
    flags: str = ""  # more `bankml serve` flags for every child, e.g. "--config cpu --ctx 1024"
    startup_timeout_s: float = 1800.0  # gate + load + warm-up of one replica
    read_timeout_s: float = 600.0  # the longest gap between two chunks of an answer (a first token too)

    @classmethod
    def parse(cls, args: dict[str, str]) -> AppArgs:
        known = {f.name: f for f in fields(cls)}
        values: dict = {}
        for key, text in args.items():
            if key not in known:
                raise ConfigInvalid(f"bankml.ray_app: unknown argument {key!r} (known: {', '.join(known)})")
            kind = type(getattr(cls(), key))
            try:
                values[key] = kind(text)
            except ValueError:
                raise ConfigInvalid(f"bankml.ray_app: {key}={text!r} is not a {kind.__name__}") from None
        out = cls(**values)
        out.check()
        return out

    def check(self) -> None:
        if not self.model or not self.fork:
            raise ConfigInvalid("bankml.ray_app: model=FILE and fork=FORK.json are required")
        if self.routing not in ROUTINGS:
            raise ConfigInvalid(f"bankml.ray_app: routing={self.routing!r}: affinity or pow2")
        if self.replicas < 1:
            raise ConfigInvalid(f"bankml.ray_app: replicas={self.replicas}: at least 1")
        if self.min_replicas != -1 and self.min_replicas < 1:
            raise ConfigInvalid("bankml.ray_app: min_replicas must be at least 1: scale to zero is refused, since "
                                "a replica's gate, load and warm-up take minutes on a CPU before its first answer")
        if self.max_replicas != -1 and self.max_replicas < max(self.min_replicas, 1):
            raise ConfigInvalid(f"bankml.ray_app: max_replicas={self.max_replicas} is below "
                                f"min_replicas={self.min_replicas}")
        if self.prefix_chars < 1:
            raise ConfigInvalid("bankml.ray_app: prefix_chars must be positive")
        if self.affinity_bound < 1:
            raise ConfigInvalid("bankml.ray_app: affinity_bound must be positive (the children's max_seqs)")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != -1 or self.max_replicas != -1

    def autoscaling_config(self) -> dict:
        low = 1 if self.min_replicas == -1 else self.min_replicas
        return {"min_replicas": low, "max_replicas": max(low, self.max_replicas),
                "target_ongoing_requests": self.target_ongoing_requests}


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica is started with (made once on the driver)."""

    model: str
    fork: str
    receipt_key: str  # the path
    key_id: str  # the key every replica must find at that path
    flags: tuple[str, ...]
    startup_timeout_s: float
    read_timeout_s: float
    max_connections: int


# --- routing ---------------------------------------------------------------------------------------


class AffinityRouter(RequestRouter):
    """Prefix-cache affinity with bounded loads: a request's key (the `affinity` keyword of
    Replica.forward) ranks the replicas by rendezvous hashing over their ids (a replica that goes or
    comes moves only its own keys), and the request goes to the first in that order with fewer than
    `affinity_bound` answers under way (a replica's batch: past it, an answer only waits there); when
    all are at the bound, to the first in the key's order within one answer of the least loaded. So a
    key's requests fill its replica's batch, then its second replica's, and so on: one shared system
    prompt uses every replica once the load asks for it, each caching the prompt once, and a
    conversation stays where its pages are while there is room.
    No key: two at random, the less loaded (Ray's power of two choices). Ray's own
    PrefixCacheAffinityRouter (ray.serve.llm) needs ray[llm]'s dependencies and its request objects.
    The load is the router's own count of the answers it sent each replica that have not finished
    (on_request_routed / on_request_completed): Ray's queue-length cache keeps the count a replica last
    reported, which after a burst stayed high and sent every next request of a key elsewhere."""

    def initialize_state(self, affinity_bound: int = 4, **kwargs) -> None:
        self.affinity_bound = affinity_bound
        self.in_flight: dict[str, int] = {}  # replica id -> answers sent there, not finished

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.in_flight[replica_id.unique_id] = self.in_flight.get(replica_id.unique_id, 0) + 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.in_flight[replica_id.unique_id] = max(0, self.in_flight.get(replica_id.unique_id, 0) - 1)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica is a candidate each time
        avoid = kwargs.get("avoid") or ()  # replicas whose server took no connection (a retry)
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        key = kwargs.get("affinity")
        if not key or len(candidate_replicas) == 1:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ranked = sorted(candidate_replicas, key=lambda r: _score(key, r.replica_id.unique_id), reverse=True)
        load = [self.in_flight.get(r.replica_id.unique_id, 0) for r in ranked]
        room = [i for i, n in enumerate(load) if n < self.affinity_bound]
        # the first with room; every one at the bound (answers wait anyway): the first in the key's order
        # within one answer of the least loaded, so the wait is where the prompt's pages are
        i = room[0] if room else next(j for j, n in enumerate(load) if n <= min(load) + 1)
        return [[ranked[i]], ranked[:i] + ranked[i + 1:]]  # the rest: Ray's fallback when its queue is full


def _score(key: str, replica: str) -> bytes:
    return hashlib.sha256(f"{replica}\0{key}".encode()).digest()


# --- the deployments -------------------------------------------------------------------------------


class Replica:
    """One `bankml serve --native` child on this replica's node: gated and loaded before the constructor
    returns (Ray counts the replica ready only then)."""

    def __init__(self, spec: ReplicaSpec):
        key = read_key(spec.receipt_key, "the application's receipt key")  # ConfigInvalid says why
        if key.key_id != spec.key_id:
            raise ReplicaRefused(f"the receipt key at {spec.receipt_key} on this node is key_id {key.key_id}, "
                                 f"not the application's {spec.key_id}: copy the driver's key file here")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.spec = spec
        self.child = ChildServer.start(spec.model, spec.fork, spec.receipt_key, list(spec.flags),
                                       spec.startup_timeout_s)
        limits = httpx.Limits(max_connections=spec.max_connections, max_keepalive_connections=spec.max_connections)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(spec.read_timeout_s, connect=10.0), limits=limits)

    async def forward(self, request: Forwarded, affinity: str | None = None,
                      avoid: tuple[str, ...] = ()) -> AsyncIterator[Head | bytes | Unavailable]:
        """The child's answer: a Head (with this replica's id added), then the body as it comes (a small
        whole answer: in the Head alone); or Unavailable when the child has exited (Ray's health check
        replaces this replica within seconds). `affinity` and `avoid` are the router's (AffinityRouter)."""
        async for part in forward(self.client, self.child.url, request):
            if isinstance(part, Head):
                part = Head(part.status, [*part.headers, (REPLICA_HEADER, self.replica_id)], part.body)
            elif isinstance(part, Unavailable):
                part = Unavailable(part.reason, self.replica_id)
            yield part

    def identity(self) -> dict:
        """Which replica, its child's pid (the tests kill it) and port (the bench reads each one's metrics)."""
        return {"replica": self.replica_id, "child_pid": self.child.pid, "port": self.child.port}

    def check_health(self) -> None:
        """Ray's health check: a replica whose child has exited is unhealthy, and replaced."""
        if (ended := self.child.exited()) is not None:
            raise RuntimeError(ended)

    def __del__(self) -> None:
        child = getattr(self, "child", None)
        if child is not None:
            child.stop()


class Ingress:
    """Every HTTP request: read the body (bounded as the gateway bounds it), take its affinity key, pass
    it to a replica and stream the replica's answer back, status and headers as the child wrote them.
    A replica whose server has exited (between its death and Ray's health check) took nothing: the
    request goes to another, TRIES times at most."""

    TRIES = 3

    def __init__(self, replicas: DeploymentHandle, routing: str, prefix_chars: int, read_timeout_s: float):
        self.replicas = replicas.options(stream=True)
        self.routing, self.prefix_chars, self.read_timeout_s = routing, prefix_chars, read_timeout_s
        self.max_body_bytes = LimitsConfig().max_body_bytes

    async def __call__(self, request: Request) -> Response:
        scope = request.scope
        target = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return _error(413, f"request body over {self.max_body_bytes} bytes", target)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        key = key_of(bytes(body), self.prefix_chars) if self.routing == "affinity" else None
        forwarded = Forwarded(request.method, target, headers, bytes(body))
        avoid: tuple[str, ...] = ()
        for _ in range(self.TRIES):
            stream = self.replicas.forward.remote(forwarded, affinity=key, avoid=avoid)
            try:
                head = await asyncio.wait_for(stream.__anext__(), self.read_timeout_s)
            except TimeoutError:
                stream.cancel()
                return _error(504, f"no replica answered within {self.read_timeout_s:.0f} s", target)
            except Exception as e:  # the replica died before it answered: the client sees why, no traceback
                return _error(502, f"the replica failed before it answered: {type(e).__name__}: {_first_line(e)}",
                              target)
            if not isinstance(head, Unavailable):
                break
            avoid += (head.replica,)  # nothing was sent: another replica may take it
        else:
            return _error(503, f"no replica's server took the request ({self.TRIES} tries): {head.reason}", target)
        if not isinstance(head, Head):
            return _error(502, "the replica answered without a head", target)
        if head.body is not None:  # a whole answer, in one item
            return Response(head.body, status_code=head.status, headers=_headers(head.headers))
        content_type = dict((k.lower(), v) for k, v in head.headers).get("content-type", "")
        return StreamingResponse(self._rest(stream, content_type, target), status_code=head.status,
                                 headers=_headers(head.headers))

    async def _rest(self, stream, content_type: str, target: str) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), self.read_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                stream.cancel()
                message = f"the replica wrote nothing for {self.read_timeout_s:.0f} s"
            except Exception as e:  # the replica's actor died mid-answer
                message = f"the replica failed mid-answer: {type(e).__name__}: {_first_line(e)}"
            else:
                yield chunk
                continue
            if (tail := error_chunk(content_type, 502, message, target)) is not None:
                yield tail
            return


def _headers(pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in pairs:  # a repeated header (set-cookie never comes from bankml) joins with commas
        out[k] = f"{out[k]}, {v}" if k in out else v
    return out


def _error(status: int, message: str, target: str) -> Response:
    """An answer of the ingress's own, in the API's shape of the request's path (bankml/replica.py)."""
    return Response(error_body(status, message, target), status_code=status, media_type="application/json")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


# --- the application builder -----------------------------------------------------------------------


def app(args: dict[str, str]) -> serve.Application:
    """`serve run bankml.ray_app:app model=FILE fork=FORK.json replicas=N [routing=pow2] ...` (AppArgs)."""
    a = AppArgs.parse(args)
    key = server_key(a.receipt_key, "receipt_key")  # made here, once, when there is none yet
    spec = ReplicaSpec(os.path.abspath(a.model), os.path.abspath(a.fork), key.path, key.key_id,
                       tuple(shlex.split(a.flags)), a.startup_timeout_s, a.read_timeout_s, a.max_ongoing_requests)
    scaling: dict = ({"autoscaling_config": a.autoscaling_config()} if a.autoscaling
                     else {"num_replicas": a.replicas})
    router = ({"request_router_config": RequestRouterConfig(
        request_router_class=AffinityRouter, request_router_kwargs={"affinity_bound": a.affinity_bound})}
        if a.routing == "affinity" else {})
    replica = serve.deployment(Replica, name="Replica", ray_actor_options={"num_cpus": a.num_cpus, "num_gpus": a.num_gpus},
                               max_ongoing_requests=a.max_ongoing_requests, health_check_period_s=2.0,
                               health_check_timeout_s=30.0, graceful_shutdown_timeout_s=30.0,
                               max_constructor_retry_count=2, **scaling, **router)
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1024)
    return ingress.bind(replica.bind(spec), a.routing, a.prefix_chars, a.read_timeout_s)
