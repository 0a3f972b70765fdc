"""/api/chat and /api/generate answers: Ollama's shapes (gateway/ollama/shapes.py) and the whole path over
the fake engine (gateway/ollama/chat.py), with the real `ollama` client too."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from types import SimpleNamespace

import httpx
import ollama
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fake_engine import REPLY, REPLY_PIECES, StubHandle
from gateway_helpers import FakeServer, tiny_model

from bankml import jstr
from bankml.errors import EngineFailed, InvalidRequest
from bankml.signing import ReceiptKey
from gateway.http.timestamps import created_at
from gateway.ollama import chat as ollama_chat
from gateway.ollama.shapes import final_object, logprob_entry, piece_line
from model.messages import FinishReason, LogprobEntry, StepOutput, Timeline, TopLogprob

CREATED_AT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")
FINAL_KEYS = ["model", "created_at", "message", "done", "done_reason", "total_duration", "load_duration",
              "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration", "bankml_cache_n",
              "bankml_receipt"]


# --- shapes -----------------------------------------------------------------------------------------


def test_created_at_is_rfc3339_utc_with_nine_digits():
    assert created_at(0.0) == "1970-01-01T00:00:00.000000000Z"
    assert created_at(1764654000.5) == "2025-12-02T05:40:00.500000000Z"
    assert created_at(1764654000.25) == "2025-12-02T05:40:00.250000000Z"
    t = 1764654000.123456
    text = created_at(t)
    assert CREATED_AT.match(text)
    parsed = datetime.fromisoformat(text[:26] + "+00:00")  # Python reads 6 of the 9 digits
    assert abs(parsed.timestamp() - t) < 1e-5 and parsed.tzinfo == UTC
    assert CREATED_AT.match(created_at(1.9999999999))  # never a 10th digit from rounding up


def test_piece_lines():
    line = piece_line("smollm2:latest", "chat", "Hi", None)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    obj = json.loads(line)
    assert list(obj) == ["model", "created_at", "message", "done"]
    assert obj["message"] == {"role": "assistant", "content": "Hi"} and obj["done"] is False
    assert CREATED_AT.match(obj["created_at"])
    obj = json.loads(piece_line("x:latest", "generate", "Hi", [{"token": "Hi", "logprob": -0.5}]))
    assert list(obj) == ["model", "created_at", "response", "done", "logprobs"] and obj["response"] == "Hi"


def _last(**kw) -> StepOutput:
    tl = Timeline(queued_s=10.0, started_s=10.5, first_token_s=10.75, first_text_s=10.8, ended_s=11.5)
    return StepOutput(token=2, finish_reason=FinishReason.STOP, prompt_tokens=30, completion_tokens=7,
                      cached_tokens=12, timeline=tl, **kw)


def test_the_final_object_has_the_spec_keys_in_order_and_integer_durations():
    obj = json.loads(final_object("smollm2:latest", "chat", "Hello.", "stop", 123456789, 5000, _last(),
                                  None, {"bankml": "x"}))
    assert list(obj) == FINAL_KEYS
    assert obj["message"] == {"role": "assistant", "content": "Hello."}
    assert (obj["done"], obj["done_reason"]) == (True, "stop")
    assert (obj["total_duration"], obj["load_duration"]) == (123456789, 5000)
    assert (obj["prompt_eval_count"], obj["eval_count"], obj["bankml_cache_n"]) == (30, 7, 12)
    assert obj["prompt_eval_duration"] == 250_000_000 and obj["eval_duration"] == 750_000_000
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert type(obj[k]) is int
    with_logprobs = json.loads(final_object("m:latest", "generate", "x", "length", 1, 0, _last(),
                                            [{"token": "x", "logprob": -1.0}], {"r": 1}))
    assert list(with_logprobs) == ["model", "created_at", "response", *FINAL_KEYS[3:-1], "logprobs", "bankml_receipt"]


def test_tool_calls_ride_in_the_message_after_its_content():
    calls = [{"id": "abcd", "function": {"index": 0, "name": "f", "arguments": {"x": 1}}}]
    obj = json.loads(final_object("m:latest", "chat", "", "stop", 1, 0, _last(), None, {"r": 1}, calls))
    assert obj["message"] == {"role": "assistant", "content": "", "tool_calls": calls}
    line = json.loads(piece_line("m:latest", "chat", "", None, calls))
    assert line["message"] == {"role": "assistant", "content": "", "tool_calls": calls} and line["done"] is False
    assert "tool_calls" not in json.loads(piece_line("m:latest", "chat", "hi", None, []))["message"]


def test_a_load_has_no_counts_and_no_receipt():
    obj = json.loads(final_object("m:latest", "chat", "", "load", 10, 7))
    assert list(obj) == ["model", "created_at", "message", "done", "done_reason", "total_duration", "load_duration"]
    assert obj["message"]["content"] == "" and obj["done_reason"] == "load"


def test_logprob_entries_in_ollamas_shape():
    e = LogprobEntry(token=42, text=" caf\xc3\xa9".encode("latin-1"), logprob=-0.25,
                     top=(TopLogprob(42, b" caf\xc3\xa9", -0.25), TopLogprob(7, b"", -2.0), TopLogprob(9, b"x", -3.0)))
    out = logprob_entry(e, 2)
    assert out == {"token": " café", "logprob": -0.25, "bytes": list(" café".encode()),
                   "top_logprobs": [{"token": " café", "logprob": -0.25, "bytes": list(" café".encode())},
                                    {"token": "", "logprob": -2.0}]}
    assert "id" not in out
    # no text: no bytes; top 0: no top list; a trailing incomplete character is cut from the token
    assert logprob_entry(LogprobEntry(1, b"", -1.0, (TopLogprob(1, b"a", -1.0),)), 0) == {"token": "", "logprob": -1.0}
    cut = logprob_entry(LogprobEntry(1, b"a\xe2\x9c", -1.0, ()), 0)
    assert cut["token"] == "a" and cut["bytes"] == [97, 0xE2, 0x9C]


def test_the_logprobs_hash_covers_the_array_as_written():
    entries = [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5, "bytes": [98]}]
    body = final_object("m:latest", "chat", "ab", "stop", 1, 0, _last(), entries, {"r": 1})
    assert jstr.dumps(entries) in body  # the receipt hashes jstr.dumps(entries): this very substring
    # streamed: each line's array without its brackets, joined by ", ", inside [ ]
    lines = [piece_line("m:latest", "chat", "a", entries[:1]), piece_line("m:latest", "chat", "b", entries[1:])]
    arrays = [re.search(rb'"logprobs": (\[.*\])\}', line).group(1).decode() for line in lines]
    assert "[" + ", ".join(a[1:-1] for a in arrays) + "]" == jstr.dumps(entries)


# --- the handler over stubs: what the fake engine cannot produce (logprobs, held text, failures) -------


class _Model:
    """NativeModel's surface: one token per character."""

    n_ctx = 4096
    count_limit = 2 * 4096 + 1024
    chat_template = None  # a template that does not think: nothing is cut out of the answer

    def render(self, messages, add_generation_prompt=True, tools=None):
        listed = "".join(f"<tool>{t['function']['name']}" for t in tools or [])
        return listed + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def tokenize(self, text, add_special, parse_special, limit=None):
        return [ord(c) for c in text]


class _Client(StubHandle):
    """Hands the route the outputs it was given (the rest of the handle: StubHandle)."""

    failure = None

    def __init__(self, outputs):
        self.outputs = outputs
        self.requests = []

    def generate(self, request):
        self.requests.append(request)
        client = self

        class _Gen:
            async def __aenter__(self):
                async def it():
                    for out in client.outputs:
                        yield out
                return it()

            async def __aexit__(self, *exc):
                return None

        return _Gen()

    def generate_all(self, requests):
        """The answer pipeline hands its sequences over together (here: one)."""
        (request,) = requests
        inner = self.generate(request)

        class _All:
            async def __aenter__(self):
                return [await inner.__aenter__()]

            async def __aexit__(self, *exc):
                return await inner.__aexit__(*exc)

        return _All()


class _Residency:
    ctx = 4096
    default_keep_alive_s = 300.0

    def __init__(self, loaded):
        self.loaded = loaded
        self.calls = []

    @contextlib.asynccontextmanager
    async def lease(self, pin):
        self.calls.append(("lease", pin.name))
        yield SimpleNamespace(loaded=self.loaded, load_ns=1234, reloaded=True)
        self.calls.append(("release", pin.name))

    def record_shown(self, name, shown_as, num_ctx, reloaded):
        self.calls.append(("shown", name, shown_as, num_ctx, reloaded))

    def touch(self, name, keep_alive_s):
        self.calls.append(("touch", name, keep_alive_s))

    async def unload(self, name):
        self.calls.append(("unload", name))
        return True


class _Monitoring:
    def __init__(self):
        self.records = []

    def answer(self):
        monitoring = self

        class _A:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

            def record(self, model, last):
                monitoring.records.append((model, last.completion_tokens))

        return _A()


class _Stream:
    def __init__(self):
        self.data = bytearray()
        self.content_type = None
        self.ended = False

    async def send(self, data):
        self.data += data

    async def eof(self):
        self.ended = True


class _Request:
    def __init__(self, body: dict, path="/api/chat"):
        self.body = json.dumps(body).encode()
        self.path = path
        self.stream = _Stream()

    async def respond(self, content_type=None, headers=None):
        self.stream.content_type = content_type
        return self.stream


def _state(outputs):
    from test_ollama_request import FakeRegistry

    loaded = SimpleNamespace(model=_Model(), client=_Client(outputs), file_name="SmolLM2.Q4_1.gguf",
                             backend="fake", verified=SimpleNamespace(model_sha256="ab" * 32))
    return SimpleNamespace(registry=FakeRegistry(), residency=_Residency(loaded), monitoring=_Monitoring(),
                           receipt_key=ReceiptKey(Ed25519PrivateKey.generate(), ""))


TL = Timeline(queued_s=1.0, started_s=1.0, first_token_s=1.1, first_text_s=1.1, ended_s=1.3)


def _entry(token: int, text: bytes, lp: float) -> LogprobEntry:
    return LogprobEntry(token, text, lp, (TopLogprob(token, text, lp), TopLogprob(5, b"z", lp - 1)))


def _run(handler, request, state):
    return asyncio.run(handler(request, state))


def test_streamed_logprobs_ride_on_their_lines_and_the_hash_covers_them():
    outputs = [StepOutput(1, text="", logprobs=_entry(1, b"", -0.1)),  # the first token: a line without text
               StepOutput(2, text="Hi", logprobs=_entry(2, b"Hi", -0.2)),
               StepOutput(3, text="", logprobs=_entry(3, b"", -0.3)),  # held back: no line, no entry
               StepOutput(4, text=" you", logprobs=_entry(4, b" you", -0.4), finish_reason=FinishReason.STOP,
                          prompt_tokens=9, completion_tokens=4, timeline=TL)]
    state = _state(outputs)
    request = _Request({"messages": [{"role": "user", "content": "hello"}], "logprobs": True, "top_logprobs": 1})
    assert _run(ollama_chat.chat, request, state) is None
    assert request.stream.content_type == "application/x-ndjson" and request.stream.ended
    raw_lines = bytes(request.stream.data).split(b"\n")
    assert raw_lines[-1] == b""
    lines = [json.loads(x) for x in raw_lines[:-1]]
    assert [x["message"]["content"] for x in lines] == ["", "Hi", " you", ""]
    assert [len(x.get("logprobs", [])) for x in lines] == [1, 1, 1, 0]
    assert lines[1]["logprobs"] == [{"token": "Hi", "logprob": -0.2, "bytes": [72, 105],
                                     "top_logprobs": [{"token": "Hi", "logprob": -0.2, "bytes": [72, 105]}]}]
    final = lines[-1]
    assert final["done"] is True and final["eval_count"] == 4 and "logprobs" not in final
    arrays = [re.search(rb'"logprobs": (\[.*\])\}', x).group(1).decode() for x in raw_lines[:3]]
    joined = "[" + ", ".join(a[1:-1] for a in arrays) + "]"
    receipt = final["bankml_receipt"]
    assert receipt["logprobs_sha256"] == hashlib.sha256(joined.encode()).hexdigest()
    assert receipt["response_sha256"] == hashlib.sha256(b"Hi you").hexdigest()
    assert receipt["request_sha256"] == hashlib.sha256(request.body).hexdigest()
    assert state.monitoring.records == [("SmolLM2.Q4_1", 4)]
    # the request the engine got: the template's prompt, n_probs = max(top, 1)
    sent = state.residency.loaded.client.requests[0]
    assert sent.prompt_tokens == [ord(c) for c in "<user>hello<assistant>"] and sent.params.n_probs == 1
    calls = state.residency.calls
    assert calls[0] == ("lease", "smollm2") and calls[1] == ("shown", "smollm2", "smollm2:latest", 4096, True)
    assert calls[-1] == ("touch", "smollm2", 300.0)  # after the lease went back
    assert calls.index(("release", "smollm2")) < len(calls) - 1


def test_whole_answer_keeps_held_text_trims_the_stop_words_entries_and_hashes_the_body_array():
    outputs = [StepOutput(1, text="Hi", logprobs=_entry(1, b"Hi", -0.2)),
               StepOutput(2, text="", logprobs=_entry(2, b"", -0.3)),
               StepOutput(3, text="", logprobs=_entry(3, b"", -0.4), finish_reason=FinishReason.STOP,
                          logprobs_trim=2, prompt_tokens=9, completion_tokens=3, timeline=TL)]
    state = _state(outputs)
    request = _Request({"model": "smollm2", "prompt": "hello", "stream": False, "logprobs": True,
                        "options": {"stop": ["END"]}}, "/api/generate")
    response = _run(ollama_chat.generate, request, state)
    body = response.body.decode()
    obj = json.loads(body)
    assert list(obj) == ["model", "created_at", "response", *FINAL_KEYS[3:-1], "logprobs", "bankml_receipt"]
    assert obj["response"] == "Hi" and [e["token"] for e in obj["logprobs"]] == ["Hi"]
    array = re.search(r'"logprobs": (\[.*?\]), "bankml_receipt"', body).group(1)
    assert obj["bankml_receipt"]["logprobs_sha256"] == hashlib.sha256(array.encode()).hexdigest()
    assert state.residency.loaded.client.requests[0].params.stop == ("END",)

    held = [StepOutput(1, text="Hi", finish_reason=FinishReason.LENGTH, held_text=" EN", completion_tokens=1,
                       timeline=TL)]
    state = _state(held)
    obj = json.loads(_run(ollama_chat.generate, _Request({"prompt": "x", "stream": False}), state).body)
    assert obj["response"] == "Hi EN" and obj["done_reason"] == "length"
    assert obj["bankml_receipt"]["response_sha256"] == hashlib.sha256(b"Hi EN").hexdigest()
    assert "logprobs" not in obj and "logprobs_sha256" not in obj["bankml_receipt"]
    # streamed, the held text is the last piece
    state = _state(held)
    request = _Request({"prompt": "x"}, "/api/generate")
    _run(ollama_chat.generate, request, state)
    lines = [json.loads(x) for x in bytes(request.stream.data).splitlines()]
    assert [x["response"] for x in lines] == ["Hi EN", ""]


def test_an_engine_failure_mid_stream_is_an_error_line_and_before_it_a_500():
    failing = [StepOutput(1, text="Hi"), StepOutput(None, finish_reason=FinishReason.ERROR, error="boom")]
    state = _state(failing)
    request = _Request({"messages": [{"role": "user", "content": "x"}]})
    _run(ollama_chat.chat, request, state)
    lines = [json.loads(x) for x in bytes(request.stream.data).splitlines()]
    assert lines[-1] == {"error": "boom"} and lines[0]["message"]["content"] == "Hi"
    assert state.monitoring.records == []
    with pytest.raises(EngineFailed, match="boom"):
        _run(ollama_chat.chat, _Request({"messages": [{"role": "user", "content": "x"}], "stream": False}),
             _state(failing))
    with pytest.raises(EngineFailed):  # nothing sent yet: the status is the error's
        _run(ollama_chat.chat, _Request({"messages": [{"role": "user", "content": "x"}]}), _state(failing[1:]))


def test_an_empty_prompt_loads_or_unloads_without_checks():
    state = _state([])
    response = _run(ollama_chat.chat, _Request({"messages": [], "keep_alive": "10m",
                                                "options": {"num_ctx": 1024, "bogus": 1}}), state)
    assert response.content_type == "application/x-ndjson" and response.body.endswith(b"}\n")
    obj = json.loads(response.body)
    assert list(obj) == ["model", "created_at", "message", "done", "done_reason", "total_duration", "load_duration"]
    assert obj["done_reason"] == "load" and obj["load_duration"] == 1234
    assert state.residency.calls == [("lease", "smollm2"), ("shown", "smollm2", "smollm2:latest", 4096, True),
                                     ("release", "smollm2"), ("touch", "smollm2", 600.0)]
    state = _state([])
    response = _run(ollama_chat.generate, _Request({"model": "smollm2", "keep_alive": 0, "stream": False},
                                                   "/api/generate"), state)
    obj = json.loads(response.body)
    assert response.content_type == "application/json" and obj["done_reason"] == "unload"
    assert obj["load_duration"] == 0 and obj["response"] == ""
    assert state.residency.calls == [("unload", "smollm2")]
    state = _state([])
    _run(ollama_chat.chat, _Request({"options": {"num_ctx": 1024}}), state)
    assert ("shown", "smollm2", "smollm2:latest", 1024, True) in state.residency.calls


def test_a_refusal_comes_before_any_lease():
    state = _state([])
    with pytest.raises(InvalidRequest, match="^options.bogus"):
        _run(ollama_chat.chat, _Request({"messages": [{"role": "user", "content": "x"}], "options": {"bogus": 1}}),
             state)
    assert state.residency.calls == []


def test_refused_routes_say_why():
    for path, words in (("/api/pull", "sha256-pinned"), ("/api/push", "publishes nothing")):
        with pytest.raises(InvalidRequest, match=words):
            _run(ollama_chat.refused, _Request({}, path), None)


# --- end to end over the fake engine: two fake models in a registry -----------------------------------


@pytest.fixture(scope="module")
def fake_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    model, fork = tiny_model(root / "startup")
    registry = root / "registry"
    tiny_model(registry, "Tiny-Two.Q8_0.gguf")
    return model, fork, registry


@pytest.fixture(scope="module")
def server(fake_models):
    model, fork, registry = fake_models
    s = FakeServer(model, fork, registry=registry)
    yield s
    s.stop()


FIRST, SECOND = "tiny-model.q8_0", "tiny-two.q8_0"
MSGS = [{"role": "user", "content": "hello"}]


def _post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url(path), content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=30)


def _ps(server) -> list[str]:
    return [m["name"] for m in httpx.get(server.url("/api/ps"), timeout=10).json()["models"]]


def test_the_ndjson_stream_on_the_wire(server):
    body = {"model": FIRST, "messages": MSGS}
    raw = json.dumps(body).encode()
    r = httpx.post(server.url("/api/chat"), content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert r.text.endswith("}\n")
    lines = [json.loads(x) for x in r.text.splitlines()]
    pieces, final = lines[:-1], lines[-1]
    assert [p["message"]["content"] for p in pieces] == REPLY_PIECES
    for p in pieces:
        assert list(p) == ["model", "created_at", "message", "done"] and p["done"] is False
        assert p["model"] == f"{FIRST}:latest" and CREATED_AT.match(p["created_at"])
    assert list(final) == FINAL_KEYS and final["done"] is True and final["done_reason"] == "stop"
    assert final["message"] == {"role": "assistant", "content": ""}
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert type(final[k]) is int and final[k] >= 0
    assert final["eval_count"] == len(REPLY_PIECES) and final["prompt_eval_count"] > 0
    receipt = final["bankml_receipt"]
    assert receipt["response_sha256"] == hashlib.sha256(REPLY.encode()).hexdigest()
    assert receipt["request_sha256"] == hashlib.sha256(raw).hexdigest()
    assert list(receipt) == ["bankml", "engine", "model_sha256", "guard", "prompt_tokens", "completion_tokens",
                             "ttft_ms", "wall_ms", "response_sha256", "request_sha256", "signed", "key_id",
                             "signature"]


def test_generate_as_one_json_body(server):
    r = _post(server, "/api/generate", {"model": FIRST, "prompt": "hello", "stream": False,
                                        "options": {"num_predict": 3}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    obj = r.json()
    assert list(obj) == ["model", "created_at", "response", *FINAL_KEYS[3:]]
    assert obj["response"] == "".join(REPLY_PIECES[:3]) and obj["done_reason"] == "length"
    assert obj["bankml_receipt"]["response_sha256"] == hashlib.sha256(obj["response"].encode()).hexdigest()


def test_errors_are_ollamas_shape(server):
    r = _post(server, "/api/chat", {"model": "no-such", "messages": MSGS})
    assert r.status_code == 404 and list(r.json()) == ["error"] and "not found" in r.json()["error"]
    r = _post(server, "/api/chat", {"messages": MSGS, "options": {"mirostat": 2}})
    assert r.status_code == 400 and r.json()["error"].startswith("mirostat:")
    r = httpx.post(server.url("/api/chat"), content=b"{", headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (400, {"error": "body is not JSON"})
    for method, path in (("GET", "/api/nope"), ("GET", "/api/chat"), ("POST", "/api/tags")):
        r = httpx.request(method, server.url(path), content=b"{}", headers={"Content-Type": "application/json"})
        assert r.status_code == 404 and r.json()["error"].startswith("bankml serve --native (Ollama API): GET "
                                                                     "/api/version")
    for path in ("/api/pull", "/api/push"):  # /api/embed and /api/embeddings are served (test_embeddings.py)
        r = _post(server, path, {"model": FIRST})
        assert r.status_code == 400 and r.json()["error"]


def test_load_and_unload_by_an_empty_prompt(server):
    r = _post(server, "/api/generate", {"model": SECOND, "keep_alive": "1h", "options": {"num_ctx": 1024}})
    obj = r.json() if r.headers["content-type"] == "application/json" else json.loads(r.text)
    assert r.status_code == 200 and obj["done_reason"] == "load" and obj["load_duration"] > 0
    assert "eval_count" not in obj and "bankml_receipt" not in obj
    ps = httpx.get(server.url("/api/ps")).json()["models"]
    entry = next(m for m in ps if m["name"] == f"{SECOND}:latest")
    assert entry["context_length"] == 1024
    again = json.loads(_post(server, "/api/generate", {"model": SECOND}).text)
    assert again["load_duration"] == 0  # resident already
    gone = json.loads(_post(server, "/api/chat", {"model": SECOND, "messages": [], "keep_alive": 0}).text)
    assert gone["done_reason"] == "unload" and gone["load_duration"] == 0
    assert f"{SECOND}:latest" not in _ps(server)


def test_the_ollama_client(server):
    client = ollama.Client(host=server.url(), timeout=30)
    out = client.chat(model=FIRST, messages=MSGS)
    assert out.message.content == REPLY and out.done and out.model == f"{FIRST}:latest"
    gen = client.generate(model=FIRST, prompt="hello")
    assert gen.response == REPLY and gen.eval_count == len(REPLY_PIECES)
    parts = list(client.generate(model=FIRST, prompt="hello", stream=True))
    assert "".join(p.response for p in parts) == REPLY and parts[-1].done and not parts[0].done
    parts = list(client.chat(model=FIRST, messages=MSGS, stream=True))
    assert "".join(p.message.content for p in parts) == REPLY
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such", messages=MSGS)
    assert e.value.status_code == 404
    # an answer with keep_alive 0: answered, then unloaded once idle
    assert client.chat(model=SECOND, messages=MSGS, keep_alive=0).message.content == REPLY
    deadline = time.monotonic() + 10
    while f"{SECOND}:latest" in _ps(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{SECOND}:latest" not in _ps(server)


def test_two_models_stream_at_once_each_its_own_answer(server):
    def ask(model: str) -> list[dict]:
        r = _post(server, "/api/generate", {"model": model, "prompt": "hello"})
        return [json.loads(x) for x in r.text.splitlines()]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [FIRST, SECOND, FIRST, SECOND]))
    for model, lines in zip([FIRST, SECOND, FIRST, SECOND], answers, strict=True):
        assert {x["model"] for x in lines} == {f"{model}:latest"}
        assert "".join(x["response"] for x in lines) == REPLY and lines[-1]["done"] is True
