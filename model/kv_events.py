"""vLLM's KV cache events from our prefix cache (`--kv-events-config`), for a router that scores where a
prompt's prefix is cached (llm-d's precise prefix-cache scorer, its kv-cache indexer).

The flag takes vLLM's JSON (vllm/config/kv_events.py, `KVEventsConfig`): enable_kv_cache_events,
publisher ("zmq" or "null"; unset: zmq when enabled), endpoint ("tcp://*:5557"), replay_endpoint,
buffer_steps, hwm, max_queue_size, topic. The wire is vLLM's (vllm/distributed/kv_events.py,
`ZmqEventPublisher`; read at vllm-project/vllm commit 0181ea31, events as maps since vLLM #42892):
- a ZMQ PUB socket, bound when the endpoint has "*" or "::" or is ipc:// or inproc://, else connected
  (vLLM's rule: llm-d's endpoint picker binds a SUB socket and the model servers connect to it);
- each message three frames: the topic, a sequence number (8 bytes, big-endian, from 0) and the
  payload: msgpack of a KVEventBatch, the array [ts, events, data_parallel_rank (0)], each event a map
  tagged by "type": BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind}, BlockRemoved {block_hashes, medium,
  group_idx}, AllBlocksCleared {};
- with replay_endpoint, a ROUTER socket (always bound): a request [start seq, 8 bytes] is answered
  with every kept batch from there, [seq, payload] each, then [-1 (8 bytes, signed), b""].

A block is one of our KV pages; its hash is vLLM's default external form of a block hash
(kv_cache_utils.py, `maybe_convert_block_hash`): the low 64 bits, big-endian, of the page's sha256 chain
digest (model/pages.py, `chain_digest`), an unsigned int. Ints, not the 32-byte digests: every consumer
reads ints (llm-d's Go indexer decodes uint64) and vLLM sends ints unless told otherwise. llm-d's
indexer keys a block by hashing its token ids itself and keeps ours only to match later removals, so
token_ids and block_size are exact: one page's tokens per hash, parent = the previous page's hash
(None for a prompt's first page). "medium" is always "GPU": vLLM's name for the engine's own pool,
wherever that pool lives (a CPU server's is host memory, but it is not an offload tier).

The engine thread never waits on this: `PageSink` (model/pages.py's `PageEvents`, on the thread that
owns the pool) puts each event on a bounded queue without blocking; a full queue drops the event,
counts it, and the next one that fits is preceded by AllBlocksCleared, so a subscriber forgets rather
than trusts a block it may not have heard leave. The publisher thread takes what is queued, merges a
page that continues the previous one into one BlockStored (as vLLM sends a request's new blocks), and
sends one batch per wake-up.

What may listen: bankml serve answers loopback clients only, so by default the events stay on the
machine too: an endpoint that binds every interface (vLLM's default "tcp://*:5557") or that reaches
another host is refused unless --listen itself is not loopback. ipc:// is always local.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the engine's own KV pool
MAX_BATCH_EVENTS = 4096  # events taken from the queue into one batch at most
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame, as vLLM's


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, its fields and defaults (`parse` reads the flag's JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # events queued for the publisher thread
    topic: str = ""

    @property
    def on(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


_TYPES: dict[str, tuple[type, ...]] = {"enable_kv_cache_events": (bool,), "publisher": (str, type(None)),
                                       "endpoint": (str,), "replay_endpoint": (str, type(None)),
                                       "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
                                       "topic": (str,)}


def parse(text: str, listen_host: str, what: str = "--kv-events-config") -> KVEventsConfig:
    """The flag's JSON, checked: vLLM's keys only, their types, and what may listen (see the module's
    docstring); with events on, pyzmq and msgpack must be installed. Raises ValueError naming `what`."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: a JSON object of vLLM's KVEventsConfig, e.g. "
                         '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}')
    known = [f.name for f in fields(KVEventsConfig)]
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"{what}: unknown key {key!r} (vLLM's KVEventsConfig has {', '.join(known)})")
        if type(value) not in _TYPES[key]:
            raise ValueError(f"{what}: {key!r} must be {' or '.join(t.__name__ for t in _TYPES[key])}, "
                             f"not {type(value).__name__}")
        if _TYPES[key] == (int,) and value <= 0:
            raise ValueError(f"{what}: {key!r} must be positive, not {value}")
    config = KVEventsConfig(**raw)
    if config.publisher not in (None, "zmq", "null"):
        raise ValueError(f"{what}: publisher {config.publisher!r} is not one of zmq, null")
    if not config.on:
        return config
    for key, endpoint, binds in (("endpoint", config.endpoint, _binds(config.endpoint)),
                                 ("replay_endpoint", config.replay_endpoint, True)):
        if endpoint is not None and (why := endpoint_refusal(endpoint, binds, listen_host)):
            raise ValueError(f"{what}: {key} {endpoint!r} {why}")
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{what}: KV cache events need pyzmq and msgpack, which are not installed "
                         f"({e.name} is missing): pip install pyzmq msgpack") from None
    return config


def _binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard or a local transport, connect anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def endpoint_refusal(endpoint: str, binds: bool, listen_host: str) -> str | None:
    """Why `endpoint` may not be used while the server listens on `listen_host`; None: it may."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None  # a socket file, or this process: never off the machine
    if not endpoint.startswith("tcp://"):
        return "is not a tcp://, ipc:// or inproc:// endpoint"
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() or port == "*"):
        return "is not tcp://HOST:PORT"
    if ";" in host:
        return "names a source address (tcp://SOURCE;HOST:PORT), which bankml does not take"
    if _loopback(host) or not _loopback(listen_host):
        return None
    where = "binds every interface" if host == "*" else f"{'binds' if binds else 'connects to'} {host}"
    default = " (vLLM's default)" if endpoint == KVEventsConfig.endpoint else ""
    return (f"{where}{default}, and bankml serve listens on loopback only (--listen {listen_host}): "
            "the events stay on this machine unless --listen is not loopback. Give "
            '"endpoint": "tcp://127.0.0.1:PORT" (connects to a subscriber bound on this machine; llm-d\'s '
            'endpoint picker binds one) or "ipc:///path", and a replay_endpoint on 127.0.0.1')


def block_hash(digest: bytes) -> int:
    """vLLM's external block hash of a page keyed `digest`: its low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class PageSink:
    """model/pages.py's PageEvents for one pool: each event onto the publisher's queue, never blocking."""

    def __init__(self, events: queue.Queue):
        self._queue = events
        self.dropped = 0  # events lost to a full queue
        self._lost = False  # some were lost: the next batch that fits starts with AllBlocksCleared

    def stored(self, digest: bytes, parent: bytes, tokens: Sequence[int]) -> None:
        self._put(("stored", digest, parent, list(tokens)))

    def removed(self, digests: Sequence[bytes]) -> None:
        self._put(("removed", list(digests)))

    def cleared(self) -> None:
        self._lost = False  # a clear says all a lost event could have
        self._put(("cleared",))

    def _put(self, event: tuple) -> None:
        try:
            if self._lost:
                self._queue.put_nowait(("cleared",))
                self._lost = False
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            self._lost = True


def batch_events(items: list[tuple]) -> list[dict[str, Any]]:
    """The queued events as vLLM's event maps, in order; a page that continues the previous BlockStored
    (its parent is that one's last block) joins it, and consecutive removals are one BlockRemoved."""
    out: list[dict[str, Any]] = []
    for item in items:
        last = out[-1] if out else None
        if item[0] == "stored":
            _, digest, parent, tokens = item
            h, p = block_hash(digest), (block_hash(parent) if parent else None)
            if (last is not None and last["type"] == "BlockStored" and p is not None
                    and last["block_hashes"][-1] == p and last["block_size"] == len(tokens)):
                last["block_hashes"].append(h)
                last["token_ids"].extend(tokens)
                last["extra_keys"].append(None)
                continue
            out.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p, "token_ids": tokens,
                        "block_size": len(tokens), "lora_id": None, "medium": MEDIUM, "lora_name": None,
                        "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"})
        elif item[0] == "removed":
            hashes = [block_hash(d) for d in item[1]]
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].extend(hashes)
                continue
            out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0})
        else:
            out.append({"type": "AllBlocksCleared"})
    return out


class KVEventPublisher:
    """The ZMQ sockets and the thread that owns them: batches from the queue, numbered, sent, kept for replay."""

    def __init__(self, config: KVEventsConfig):
        import msgpack
        import zmq

        self.config = config
        self._packb = msgpack.packb
        self._zmq = zmq
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._sinks: list[PageSink] = []
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"--kv-events-config: {e} ({config.endpoint}"
                          + (f", replay {config.replay_endpoint}" if config.replay_endpoint else "") + ")") from None
        self._thread = threading.Thread(target=self._run, name="bankml-kv-events", daemon=True)
        self._thread.start()
        log.info("KV cache events (vLLM's format): %s %s, topic %r%s", "bound to" if _binds(config.endpoint)
                 else "connected to", config.endpoint, config.topic,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def sink(self) -> PageSink:
        """A pool's PageEvents (model/pages.py's `watch`); one per engine loaded."""
        s = PageSink(self._queue)
        self._sinks.append(s)
        return s

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self._sinks)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for `timeout_s` at most), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        # with a replay socket the thread also answers it, so it wakes every 50 ms (vLLM's, every 100 ms);
        # without one it sleeps on the queue
        wait_s = 0.05 if self._replay is not None else None
        reported = 0
        while True:
            try:
                item = self._queue.get(timeout=wait_s)
            except queue.Empty:
                item = ()
            items, done = ([item] if item else []), item is None
            while not done and items and len(items) < MAX_BATCH_EVENTS:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                done = nxt is None
                if not done:
                    items.append(nxt)
            items = [i for i in items if i is not None]
            try:
                if items:
                    self._send(batch_events(items))
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
            except Exception as e:  # a socket error loses this batch, never the thread
                log.warning("KV cache events: %s", e)
            if (dropped := self.dropped) > reported:
                log.warning("KV cache events: %d dropped so far (the queue of %d was full); subscribers were "
                            "sent AllBlocksCleared", dropped, self.config.max_queue_size)
                reported = dropped
            if done:
                return

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = self._packb([time.time(), events, 0], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self.config.topic.encode(), seq.to_bytes(8, "big"), payload))
        self._kept.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [identity, b"", start seq] from a REQ socket
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
