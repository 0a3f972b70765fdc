"""--kv-events-config (model/kv_events.py): vLLM's KV cache events, read here as a subscriber written from
vLLM's message schema would (vllm/distributed/kv_events.py: frames [topic, seq, payload], the payload
msgpack's [ts, events, data_parallel_rank], each event a map tagged by "type"), decoded by hand with
msgpack, never with our encoder. The hashes are checked against the prefix cache's own keys
(model/pages.py's chain_digest, low 64 bits big-endian as vLLM's maybe_convert_block_hash)."""

from __future__ import annotations

import json
import queue
import sys
import threading

import httpx
import pytest
from gateway_helpers import CliServer, free_port, tiny_model

from bankml.config import Config, serve_options
from bankml.errors import ConfigInvalid
from model.kv_events import PageSink, parse
from model.pages import ROOT_DIGEST, PagePool, chain_digest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

PAGE = 16  # [engine] page_size's default


def vllm_hash(digest: bytes) -> int:
    """vLLM's kv_cache_utils.maybe_convert_block_hash: int.from_bytes(big) & (2**64 - 1)."""
    return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1)


# --- the flag -------------------------------------------------------------------------------------


def test_vllms_default_endpoint_is_refused_on_loopback_with_the_way_out_named():
    with pytest.raises(ValueError) as e:
        parse('{"enable_kv_cache_events": true}', "127.0.0.1")
    message = str(e.value)
    assert "tcp://*:5557" in message and "binds every interface" in message and "vLLM's default" in message
    assert "tcp://127.0.0.1:PORT" in message and "--listen" in message


@pytest.mark.parametrize("endpoint, listen, ok", [
    ("tcp://127.0.0.1:5557", "127.0.0.1", True),
    ("tcp://localhost:5557", "127.0.0.1", True),
    ("ipc:///tmp/bankml-kv", "127.0.0.1", True),
    ("tcp://*:5557", "127.0.0.1", False),
    ("tcp://10.0.0.7:5557", "127.0.0.1", False),  # connects to another host
    ("tcp://epp.default.svc:5557", "::1", False),
    ("tcp://*:5557", "0.0.0.0", True),  # the server itself is not loopback: neither are its events
    ("tcp://epp.default.svc:5557", "10.0.0.5", True),
    ("udp://127.0.0.1:5557", "127.0.0.1", False),
    ("tcp://127.0.0.1", "127.0.0.1", False),
])
def test_what_may_listen(endpoint, listen, ok):
    text = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
    if ok:
        assert parse(text, listen).on
    else:
        with pytest.raises(ValueError):
            parse(text, listen)


def test_a_replay_endpoint_binds_so_it_is_loopback_too():
    with pytest.raises(ValueError, match="replay_endpoint 'tcp://\\*:5558'"):
        parse('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
              '"replay_endpoint": "tcp://*:5558"}', "127.0.0.1")


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://127.0.0.1:1"}', "unknown key 'endpont'"),
    ('{"enable_kv_cache_events": "yes"}', "'enable_kv_cache_events' must be bool"),
    ('{"enable_kv_cache_events": true, "hwm": 0, "endpoint": "tcp://127.0.0.1:1"}', "'hwm' must be positive"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka'"),
    ("[1]", "a JSON object"),
    ("{", "not JSON"),
])
def test_bad_json_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text, "127.0.0.1")


def test_off_unless_enabled_and_zmq_as_vllm():
    assert not parse("{}", "127.0.0.1").on  # enable_kv_cache_events defaults to false
    assert not parse('{"enable_kv_cache_events": true, "publisher": "null"}', "127.0.0.1").on
    assert not parse('{"enable_kv_cache_events": false, "endpoint": "tcp://*:1"}', "127.0.0.1").on


def test_without_pyzmq_or_msgpack_the_start_is_refused_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # an import of it now fails
    with pytest.raises(ValueError, match="pip install pyzmq msgpack"):
        parse('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}', "127.0.0.1")


def test_serve_options_take_the_flag_for_the_native_engine_and_one_model(tmp_path):
    text = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}'
    options = serve_options(Config(), native=True, kv_events_config=text)
    assert options.kv_events is not None and options.kv_events.topic == "kv"
    assert serve_options(Config(), native=True).kv_events is None
    with pytest.raises(ConfigInvalid, match="--native"):
        serve_options(Config(), kv_events_config=text)
    with pytest.raises(ConfigInvalid, match="not with --registry"):
        serve_options(Config(), native=True, kv_events_config=text, registry=str(tmp_path))
    with pytest.raises(ConfigInvalid, match="binds every interface"):
        serve_options(Config(), native=True, kv_events_config='{"enable_kv_cache_events": true}')


# --- the prefix cache's events --------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.seen: list[tuple] = []

    def stored(self, digest, parent, tokens):
        self.seen.append(("stored", digest, parent, list(tokens)))

    def removed(self, digests):
        self.seen.append(("removed", list(digests)))

    def cleared(self):
        self.seen.append(("cleared",))


def test_the_pool_says_what_it_keys_evicts_forgets_and_clears():
    pool, events = PagePool(2, 2), Recorder()
    pool.watch(events)
    d1 = chain_digest(ROOT_DIGEST, [1, 2])
    d2 = chain_digest(d1, [3, 4])
    a, b = pool.take(2)
    pool.publish(a, d1, [1, 2], ROOT_DIGEST)
    pool.publish(b, d2, [3, 4], d1)
    pool.publish(b, d2, [3, 4], d1)  # already keyed: nothing new
    pool.release([a, b])
    pool.take(1)  # evicts the least recently used cached page
    pool.forget([d1, d2])  # d1 is gone already
    pool.clear()
    assert events.seen == [("cleared",), ("stored", d1, ROOT_DIGEST, [1, 2]), ("stored", d2, d1, [3, 4]),
                           ("removed", [d1]), ("removed", [d2]), ("cleared",)]


def test_a_full_queue_drops_counts_and_then_tells_subscribers_to_forget():
    q: queue.Queue = queue.Queue(maxsize=2)
    sink = PageSink(q)
    d = chain_digest(ROOT_DIGEST, [1])
    sink.stored(d, ROOT_DIGEST, [1])
    sink.removed([d])
    sink.removed([d])  # dropped
    assert sink.dropped == 1
    q.get_nowait()
    q.get_nowait()
    sink.removed([d])
    assert [q.get_nowait()[0], q.get_nowait()[0]] == ["cleared", "removed"]


# --- on the wire, from a running server -----------------------------------------------------------


class Subscriber:
    """A SUB socket bound on loopback (llm-d's endpoint picker binds; the server connects), read all the
    time on a thread of its own, as a subscriber's loop does: a SUB sends its subscription only when its
    thread calls it, and a PUB drops what it sends before that arrives."""

    def __init__(self, prefix: bytes):
        self.messages: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self.port = self._sub.bind_to_random_port("tcp://127.0.0.1")
        self._sub.setsockopt(zmq.SUBSCRIBE, prefix)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(50):
                self.messages.put(self._sub.recv_multipart())
        self._sub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def receive(sub: Subscriber, timeout_s: float = 60) -> tuple[bytes, int, list]:
    """One message, as vLLM's subscriber reads it: [topic, seq (8 bytes, big-endian), payload]."""
    try:
        topic, seq, payload = sub.messages.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no KV event batch arrived in {timeout_s} s") from None
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3  # KVEventBatch, array_like: [ts, events, dp rank]
    ts, events, rank = batch
    assert isinstance(ts, float) and rank == 0
    return topic, int.from_bytes(seq, "big"), events


def events_until(sub, want: str, seqs: list[int]) -> list[dict]:
    """Every event up to and including the first of type `want`."""
    out: list[dict] = []
    while not any(e["type"] == want for e in out):
        topic, seq, events = receive(sub)
        assert topic == b"kv@bankml"
        seqs.append(seq)
        out.extend(events)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, bankml_cmd):
    d = tmp_path_factory.mktemp("kvevents")
    model, fork = tiny_model(d)
    sub = Subscriber(b"kv@")
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv@bankml",
                         "endpoint": f"tcp://127.0.0.1:{sub.port}",
                         "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})
    server = CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "256", "--config", "cpu",
                       "--slot-dir", str(d / "slots"), "--kv-events-config", config)
    yield server, sub
    server.stop()
    sub.close()


def test_stored_then_removed_blocks_are_the_prefix_caches_pages(served):
    server, sub = served
    seqs: list[int] = []
    if not sub.messages.empty():  # the pool's start, unless it went out before our subscription arrived
        topic, seq, events = receive(sub)  # (the replay test reads it either way)
        assert (topic, seq, events) == (b"kv@bankml", 0, [{"type": "AllBlocksCleared"}])
        seqs.append(seq)
    prompt = "the quick brown fox jumps over the lazy dog, then " * 3
    ids = httpx.post(server.url("/tokenize"), json={"content": prompt, "add_special": True}, timeout=60).json()["tokens"]
    assert len(ids) > 2 * PAGE
    r = httpx.post(server.url("/completion"), json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                   "id_slot": 0, "cache_prompt": True}, timeout=300)
    assert r.status_code == 200, r.text
    n_cached = r.json()["tokens_cached"]

    stored: list[dict] = []
    while sum(len(e["block_hashes"]) for e in stored) < n_cached // PAGE:
        _, seq, events = receive(sub)
        seqs.append(seq)
        stored.extend(e for e in events if e["type"] == "BlockStored")
    hashes = [h for e in stored for h in e["block_hashes"]]
    tokens = [t for e in stored for t in e["token_ids"]]
    assert len(hashes) == n_cached // PAGE and len(tokens) == len(hashes) * PAGE
    # the prompt's tokens as the engine computed them (then the answer's), in whole pages only
    n = min(len(tokens), len(ids))
    assert n > len(ids) - PAGE and tokens[:n] == ids[:n]
    parent, digest = None, ROOT_DIGEST
    for e in stored:
        assert e["block_size"] == PAGE and e["parent_block_hash"] == parent  # the chain: None, then the last
        assert e["medium"] == "GPU" and e["lora_id"] is None and e["lora_name"] is None
        assert len(e["extra_keys"]) == len(e["block_hashes"])
        for i, h in enumerate(e["block_hashes"]):
            digest = chain_digest(digest, e["token_ids"][i * PAGE:(i + 1) * PAGE])
            assert h == vllm_hash(digest)  # the page's key in our prefix cache
        parent = e["block_hashes"][-1]

    r = httpx.post(server.url("/slots/0?action=erase"), json={}, timeout=60)  # forgets the slot's pages
    assert r.status_code == 200, r.text
    removed = [e for e in events_until(sub, "BlockRemoved", seqs) if e["type"] == "BlockRemoved"]
    assert sorted(h for e in removed for h in e["block_hashes"]) == sorted(hashes)
    assert all(e["medium"] == "GPU" for e in removed)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] <= 1  # in order, none missed


def test_missed_batches_are_replayed_from_the_router_socket(served):
    server, _ = served
    config = json.loads(next(a for a in server.proc.args if a.startswith("{")))
    req = zmq.Context.instance().socket(zmq.REQ)
    req.connect(config["replay_endpoint"])
    try:
        req.send((0).to_bytes(8, "big"))  # vLLM's replay request: the first seq wanted
        assert req.poll(30_000)
        seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        req.close(linger=0)
