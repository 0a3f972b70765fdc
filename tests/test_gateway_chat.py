"""/v1/chat/completions and llama-server's routes over the fake engine: shapes, receipts, failures.

The `openai` client is used unchanged; the raw bytes it sent and received are checked too. The gate
(guard, pin, the per-request identity check) is the real one, on a tiny GGUF pinned for the test.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import httpx
import openai
import pytest
from fake_engine import REPLY, REPLY_PIECES
from gateway_helpers import FakeServer, connect, exchange, request_bytes, split_response, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from bankml.errors import EngineGone, Overloaded
from gateway.http.errors import Api, render
from model.chat_template import render_chat

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "Say hello."}]


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def server(pinned):
    s = FakeServer(*pinned)
    yield s
    s.stop()


def pinned_sha(fork) -> str:
    return json.loads(fork.read_text())["files"][0]["sha256"]


class Recorder:
    """An httpx client for `openai` that keeps the raw request bodies it sent."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.http = httpx.Client(event_hooks={"request": [lambda r: self.bodies.append(r.read())]}, timeout=30)


def client(server, rec: Recorder | None = None, upstream: bool = False) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1", upstream), api_key="none", max_retries=0,
                         http_client=rec.http if rec else None)


def post(server, path: str, body, upstream: bool = False) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url(path, upstream), content=content, headers={"Content-Type": "application/json"},
                      timeout=30)


def sse_events(raw: str) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e]


# --- the openai client -----------------------------------------------------------------------------


def test_openai_client_plain_and_streamed_agree_and_their_receipts_check_out(server, pinned):
    rec = Recorder()
    c = client(server, rec)
    plain = c.chat.completions.create(model="Tiny-Model.Q8_0.gguf", messages=HI)
    text = plain.choices[0].message.content
    assert text == REPLY and plain.choices[0].finish_reason == "stop"
    assert plain.model == "Tiny-Model.Q8_0.gguf" and plain.object == "chat.completion"
    assert plain.usage.completion_tokens == 9 and plain.usage.total_tokens == plain.usage.prompt_tokens + 9

    receipt = plain.model_extra["bankml_receipt"]
    assert list(receipt) == ["bankml", "engine", "model_sha256", "guard", "prompt_tokens", "completion_tokens",
                             "ttft_ms", "wall_ms", "response_sha256", "request_sha256", "signed", "key_id",
                             "signature"]
    assert receipt["response_sha256"] == sha(text)
    assert receipt["request_sha256"] == sha(rec.bodies[-1])
    assert receipt["model_sha256"] == pinned_sha(pinned[1])
    assert (receipt["guard"], receipt["signed"]) == ("play", True)
    assert (receipt["prompt_tokens"], receipt["completion_tokens"]) == (plain.usage.prompt_tokens, 9)
    assert isinstance(receipt["ttft_ms"], int) and 0 <= receipt["ttft_ms"] <= receipt["wall_ms"]
    timings = plain.model_extra["timings"]
    assert list(timings) == ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                             "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
    assert timings["predicted_n"] == 9 and timings["prompt_n"] == plain.usage.prompt_tokens

    pieces, streamed_receipt, finish, usage = [], None, None, None
    for chunk in c.chat.completions.create(model="tiny-model.q8_0", messages=HI, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        elif chunk.model_extra and "bankml_receipt" in chunk.model_extra:
            streamed_receipt = chunk.model_extra["bankml_receipt"]
    assert "".join(pieces) == text and finish == "stop" and usage.completion_tokens == 9
    assert streamed_receipt["response_sha256"] == sha(text)
    assert streamed_receipt["request_sha256"] == sha(rec.bodies[-1]) != receipt["request_sha256"]


def test_the_stream_on_the_wire(server):
    body = json.dumps({"messages": HI, "stream": True}).encode()
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert r.headers["connection"] == "close"
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    receipt = json.loads(events[-2])
    assert receipt["choices"] == [] and "bankml_receipt" in receipt and receipt["object"] == "chat.completion.chunk"
    final = json.loads(events[-3])
    assert final["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert final["object"] == "chat.completion.chunk" and final["timings"]["cache_n"] == 0
    assert receipt["usage"] == final["usage"] and receipt["id"] == final["id"]
    chunks = [json.loads(e) for e in events[:-3]]
    assert all(list(c) == ["choices", "created", "id", "model", "system_fingerprint", "object"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}  # always, as llama-server
    assert all(c["choices"][0]["finish_reason"] is None and list(c["choices"][0]["delta"]) == ["content"]
               for c in chunks[1:])
    sent = "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:])
    assert receipt["bankml_receipt"]["response_sha256"] == sha(sent)
    assert receipt["bankml_receipt"]["request_sha256"] == sha(body)
    # the Rust bankml's JSON style: ", " and ": " separators, non-ASCII written raw
    assert '"delta": {"content": " Ça"}' in r.text and '"signed": true, "key_id": "' in r.text


def test_the_engine_address_serves_chat_too(server):
    out = client(server, upstream=True).chat.completions.create(model="tiny-model.q8_0", messages=HI)
    assert out.choices[0].message.content == REPLY


def test_max_tokens_stops_with_length(server):
    out = client(server).chat.completions.create(model="tiny-model.q8_0", messages=HI, max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert out.choices[0].message.content == "Savante knows"
    r = post(server, "/v1/chat/completions", {"messages": HI, "n_predict": 2})
    assert r.json()["choices"][0]["message"]["content"] == "Savante"


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"[1, 2]", 400, "'messages' is required"),
    ({"messages": "hi"}, 400, "Expected 'messages' to be an array"),
    ({"messages": HI, "top_logprobs": 3}, 400, "top_logprobs requires logprobs to be set to true"),
    ({"messages": HI, "mirostat": 2}, 400, "'mirostat' is not supported by bankml serve --native yet"),
    ({"messages": HI, "temperature": "hot"}, 400,
     "Field 'temperature': [json.exception.type_error.302] type must be number, but is string"),
])
def test_bad_requests_are_refused_in_llama_servers_error_shape(server, body, status, message):
    # every llama-server refusal is compared with its recording in tests/test_parity.py
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status
    assert r.json() == {"error": {"code": status, "message": message,
                                  "type": "invalid_request_error" if status == 400 else "not_found_error"}}


def test_the_model_is_resolved_by_its_pin_name_and_absent_means_the_startup_model(server):
    # its name in any case, with :latest or .gguf, or none at all; the answer says what answered
    for name in ("tiny-model.q8_0", "Tiny-Model.Q8_0.gguf", "tiny-model.q8_0:latest", "", None):
        r = post(server, "/v1/chat/completions", {"messages": HI, "model": name})
        assert r.status_code == 200 and r.json()["model"] == "Tiny-Model.Q8_0.gguf"
        assert r.json()["choices"][0]["message"]["content"] == REPLY


def test_a_server_of_one_model_answers_any_model_name_with_it(server):
    # llama-server's clients send "gpt-3.5-turbo" and the like; with one model there is nothing to choose
    r = post(server, "/v1/chat/completions", {"messages": HI, "model": "gpt-4"})
    assert r.status_code == 200 and r.json()["model"] == "Tiny-Model.Q8_0.gguf"


def test_a_body_that_is_not_json_gets_the_json_librarys_parse_error(server):
    r = post(server, "/v1/chat/completions", b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("[json.exception.parse_error.101] parse error at line 1")


def test_neutral_values_of_unsupported_fields_pass(server):
    r = post(server, "/v1/chat/completions", {"messages": HI, "stop": [], "n": 1, "logprobs": False,
                                              "presence_penalty": 0, "response_format": {"type": "text"}})
    assert r.status_code == 200


def test_a_prompt_that_does_not_fit_is_llama_servers_400(pinned):
    s = FakeServer(*pinned, ctx=64)
    try:
        messages = [{"role": "user", "content": "x" * 100}]
        n = len(render_chat(None, messages).encode())
        r = post(s, "/v1/chat/completions", {"messages": messages})
        assert r.status_code == 400
        assert r.text == (f'{{"error": {{"code": 400, "message": "request ({n} tokens) exceeds the available context '
                          f'size (64 tokens), try increasing it", "type": "exceed_context_size_error", '
                          f'"n_prompt_tokens": {n}, "n_ctx": 64}}}}')
        with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
            client(s).chat.completions.create(model="tiny-model.q8_0", messages=messages)
    finally:
        s.stop()


# --- engine failures and clients that leave ---------------------------------------------------------


def test_an_engine_failure_is_a_500_with_the_reason_and_no_receipt(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL"}]})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "RuntimeError: the fake engine failed on purpose"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL"}], "stream": True})
    events = sse_events(r.text)
    assert r.status_code == 200 and json.loads(events[-1])["error"]["message"] == "RuntimeError: the fake engine failed on purpose"
    assert "bankml_receipt" not in r.text and "[DONE]" not in r.text
    assert post(server, "/v1/chat/completions", {"messages": HI}).status_code == 200  # and it goes on


def test_a_client_that_leaves_mid_stream_frees_the_engine(pinned):
    s = FakeServer(*pinned, step_ms=5)  # the LONG answer would take 25 s
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "LONG"}], "stream": True}).encode()
        with connect(s.port) as sock:
            sock.sendall(request_bytes("POST", "/v1/chat/completions", body=body))
            seen = b""
            while seen.count(b"tick") < 3:
                seen += sock.recv(4096)
        t0 = time.monotonic()
        r = post(s, "/v1/chat/completions", {"messages": HI})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY
        assert time.monotonic() - t0 < 5
        m = s.wait_for_log(r"fake-engine: \S+ aborted after (\d+) steps")
        assert m is not None and int(m.group(1)) < 1000
    finally:
        s.stop()


def test_a_dead_engine_thread_is_a_503_that_says_why(pinned):
    s = FakeServer(*pinned)
    try:
        r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "DIE"}]})
        assert r.status_code == 503 and "the fake engine thread was told to die" in r.json()["error"]["message"]
        r = post(s, "/v1/chat/completions", {"messages": HI})
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("the engine thread stopped")
        assert httpx.get(s.url("/health")).status_code == 503
    finally:
        s.stop()


# --- the per-request identity check ------------------------------------------------------------------


def test_a_model_file_changed_under_the_server_is_503_without_receipt_then_verified_again(tmp_path):
    model, fork = tiny_model(tmp_path)
    original = model.read_bytes()
    s = FakeServer(model, fork)
    try:
        assert post(s, "/v1/chat/completions", {"messages": HI}).status_code == 200
        hashed_at = httpx.get(s.url("/bankml")).json()["hashed_at"]

        with open(model, "ab") as f:  # an in-place change: same inode, new size and mtime
            f.write(b"\0")
        for stream in (False, True):
            if stream:  # the first 503 unloaded it; change it again so the next one is a 503 too
                assert post(s, "/v1/chat/completions", {"messages": HI}).status_code == 503
                model.write_bytes(original)
                assert post(s, "/v1/chat/completions", {"messages": HI}).status_code == 200
                with open(model, "ab") as f:
                    f.write(b"\0")
            r = post(s, "/v1/chat/completions", {"messages": HI, "stream": stream})
            assert r.status_code == 503
            assert r.json()["error"]["message"] == ("Tiny-Model.Q8_0.gguf changed since bankml verified it: unloaded, "
                                                    "and refused; the next request verifies it again")
            assert "bankml_receipt" not in r.text
        assert httpx.get(s.url("/bankml")).json()["resident"] is None

        # the next request verifies it again: the changed file fails its pin, and the answer is the same 503
        r = post(s, "/v1/chat/completions", {"messages": HI})
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("Tiny-Model.Q8_0.gguf changed since")
        assert "bankml_receipt" not in r.text
        # ... and the file put back passes, loads and answers with a receipt again
        time.sleep(1.1)
        model.write_bytes(original)
        r = post(s, "/v1/chat/completions", {"messages": HI})
        assert r.status_code == 200 and r.json()["bankml_receipt"]["model_sha256"] == pinned_sha(fork)
        status = httpx.get(s.url("/bankml")).json()
        assert status["resident"] == "tiny-model.q8_0" and status["hashed_at"] > hashed_at
    finally:
        s.stop()


def test_a_replaced_file_is_seen_too(tmp_path):
    model, fork = tiny_model(tmp_path)
    s = FakeServer(model, fork)
    try:
        replacement = tmp_path / "new.gguf"
        replacement.write_bytes(model.read_bytes())
        os.replace(replacement, model)  # same bytes, another inode
        r = post(s, "/v1/chat/completions", {"messages": HI})
        assert r.status_code == 503 and "changed since bankml verified it" in r.text
        r = post(s, "/v1/chat/completions", {"messages": HI})  # same bytes: the pin still holds
        assert r.status_code == 200 and "bankml_receipt" in r.json()
    finally:
        s.stop()


# --- llama-server's routes and bankML's own ------------------------------------------------------


def test_llama_server_routes(server, pinned):
    model, fork = pinned
    for upstream in (False, True):
        assert httpx.get(server.url("/health", upstream)).text == '{"status": "ok"}'
        models = httpx.get(server.url("/v1/models", upstream)).json()
        assert models == {"object": "list", "data": [{"id": "Tiny-Model.Q8_0.gguf", "object": "model",
                                                      "owned_by": "bankML"}]}
        props = httpx.get(server.url("/props", upstream)).json()
        assert props["model_path"] == str(model.resolve()) and props["n_ctx"] == 4096
        params = props["default_generation_settings"]["params"]  # llama-server's float32 values
        assert {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p")} == {
            "temperature": 0.800000011920929, "top_k": 40, "top_p": 0.949999988079071, "min_p": 0.05000000074505806}
        assert props["build_info"].startswith("bankML ") and props["build_info"].endswith(" native")
    assert post(server, "/tokenize", {"content": "hé"}).text == '{"tokens": [104,195,169]}'
    prompt = post(server, "/apply-template", {"messages": HI}).json()["prompt"]
    assert prompt == render_chat(None, HI)
    assert post(server, "/apply-template", {"nothing": 1}).status_code == 400


def test_bankml_says_what_was_verified(server, pinned):
    model, fork = pinned
    r = httpx.get(server.url("/bankml"))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["verified", "model", "upstream", "engine", "hashed_at", "resident", "models", "weights",
                          "cache_type", "loaded", "health"]
    assert body["weights"] is None  # the fake engine does not report its weights
    assert f'"model_sha256": "{pinned_sha(fork)}"' in r.text and '"verdict": "play"' in r.text
    assert body["model"] == str(model.resolve()) and body["upstream"] == f"127.0.0.1:{server.upstream_port}"
    assert body["resident"] == "tiny-model.q8_0" and body["models"] == ["tiny-model.q8_0"]
    assert body["loaded"] == ["tiny-model.q8_0"]
    assert body["engine"].startswith("bankML ") and abs(body["hashed_at"] - time.time()) < 3600


def test_usage_and_metrics_answer_with_what_exists(server):
    post(server, "/v1/chat/completions", {"messages": HI})
    metrics = httpx.get(server.url("/bankml/metrics")).json()
    assert metrics["kept"] >= 1 and metrics["records"][-1]["completion_tokens"] == 9
    assert metrics["records"][-1]["model"] == "Tiny-Model.Q8_0" and metrics["keep"] == 256
    usage = httpx.get(server.url("/bankml/usage")).json()
    assert usage["rss_bytes"] > 0 and usage["processes"][0]["name"] == "bankml serve"


def test_a_foreign_host_cannot_reach_bankml(server):
    status, _, _ = split_response(exchange(server.port, request_bytes("GET", "/bankml", host="evil.example")))
    assert status == 403


# --- many requests at once: /slots, a full waiting queue -------------------------------------------


def prometheus(server) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(server.url("/metrics"), timeout=10).text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(v for _, v in sorted(s.labels.items()))] = s.value
    return out


def test_slots_in_llama_servers_shape_on_both_addresses(server):
    for upstream in (False, True):
        r = httpx.get(server.url("/slots", upstream))
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == [{"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": False, "id_task": -1,
                             "cache_type": "f16"}]
        assert httpx.get(server.url("/slots?fail_on_no_slot=1", upstream)).status_code == 200  # one is idle
    assert httpx.get(server.url("/slots/")).status_code == 404  # only the query is let through
    assert httpx.get(server.url("/health?fail_on_no_slot=1")).status_code == 404


def test_a_full_waiting_queue_is_a_503_with_retry_after_and_the_waiting_request_is_served(pinned):
    # one sequence at a time and one request waiting at most: LONG runs, HI waits, the third is refused
    s = FakeServer(*pinned, step_ms=5, engine={"max_seqs": 1, "max_waiting": 1})
    try:
        long_body = {"messages": [{"role": "user", "content": "LONG"}], "stream": True, "seed": 7,
                     "temperature": 0.5, "max_tokens": 3000, "stop": ["never said"]}
        with httpx.stream("POST", s.url("/v1/chat/completions"), content=json.dumps(long_body).encode(),
                          headers={"Content-Type": "application/json"}, timeout=30) as long:
            received = long.iter_bytes()  # kept: a dropped iterator would close the stream
            next(received)

            [slot] = httpx.get(s.url("/slots", upstream=True)).json()
            assert slot["is_processing"] and slot["id_task"] >= 0 and slot["speculative"] is False
            params = slot["params"]
            assert (params["seed"], params["temperature"], params["n_predict"]) == (7, 0.5, 3000)
            assert "stop" not in params  # another client's stop strings stay its own too
            nt = slot["next_token"][0]
            assert nt["has_next_token"] and 0 < nt["n_decoded"] and nt["n_remain"] == 3000 - nt["n_decoded"]
            assert "prompt" not in slot and "generated" not in slot  # another client's text stays its own
            r = httpx.get(s.url("/slots?fail_on_no_slot=1"))
            assert r.status_code == 503 and r.json() == {"error": {"code": 503, "message": "no slot available",
                                                                   "type": "unavailable_error"}}

            waited: dict = {}
            waiting = threading.Thread(target=lambda: waited.update(r=post(s, "/v1/chat/completions",
                                                                           {"messages": HI})))
            waiting.start()
            for _ in range(200):
                prom = prometheus(s)
                if prom["bankml_requests_waiting"][()] == 1:
                    break
            assert (prom["bankml_requests_running"][()], prom["bankml_requests_waiting"][()]) == (1, 1)

            for stream in (False, True):
                r = post(s, "/v1/chat/completions", {"messages": HI, "stream": stream})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.headers["content-type"] == "application/json"
                error = r.json()["error"]
                assert error["type"] == "unavailable_error" and error["code"] == 503
                assert "1 requests are waiting" in error["message"] and "max_waiting = 1" in error["message"]
            # the openai client reads it as a 503 (its own retries honour Retry-After)
            with pytest.raises(openai.InternalServerError) as e:
                client(s).chat.completions.create(model="tiny-model.q8_0", messages=HI)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
            prom = prometheus(s)
            assert (prom["bankml_requests_running"][()], prom["bankml_requests_waiting"][()]) == (1, 1)
            assert prom["bankml_requests_overloaded_total"][()] == 3
            assert ("error",) not in prom.get("bankml_answers_total", {})  # a refusal is no failed answer
        # the client left the long answer: it aborts, and the waiting one runs and completes
        t_left = time.monotonic()
        waiting.join(30)
        assert waited["r"].status_code == 200 and waited["r"].json()["choices"][0]["message"]["content"] == REPLY
        assert time.monotonic() - t_left < 10
        record = httpx.get(s.url("/bankml/metrics")).json()["records"][-1]
        assert record["completion_tokens"] == len(REPLY_PIECES) and record["queue_ms"] > 50  # it waited its turn
        prom = prometheus(s)
        assert (prom["bankml_requests_running"][()], prom["bankml_requests_waiting"][()]) == (0, 0)
        assert prom["bankml_answers_total"][("abort",)] == 1 and prom["bankml_answers_total"][("stop",)] == 1
        assert post(s, "/v1/chat/completions", {"messages": HI}).status_code == 200  # room again
        # the scheduler's counters are there; the fake engine has no paged pool, so no KV usage series
        assert prom["bankml_prefix_cache_queries_total"][()] == 0 and "bankml_kv_cache_usage_ratio" not in prom
    finally:
        s.stop()


def test_overloaded_is_a_503_with_retry_after_in_each_apis_shape():
    error = Overloaded("the server is busy", retry_after_s=3)
    for api, body in [(Api.OPENAI, {"error": {"code": 503, "message": "the server is busy",
                                              "type": "unavailable_error"}}),
                      (Api.LLAMA, {"error": {"code": 503, "message": "the server is busy",
                                             "type": "unavailable_error"}}),
                      (Api.OLLAMA, {"error": "the server is busy"})]:
        response = render(error, api)
        assert response.status == 503 and response.headers["retry-after"] == "3"
        assert json.loads(response.body) == body
    assert "retry-after" not in render(EngineGone("gone"), Api.OPENAI).headers  # only a full queue says when


def test_slots_lists_every_sequence_slot(pinned):
    s = FakeServer(*pinned, engine={"max_seqs": 3})
    try:
        slots = httpx.get(s.url("/slots")).json()
        assert [x["id"] for x in slots] == [0, 1, 2] and not any(x["is_processing"] for x in slots)
        usage = httpx.get(s.url("/bankml/usage")).json()["gpu_limiter"]
        assert (usage["sequences_max"], usage["sequences_in_use"]) == (3, 0)
    finally:
        s.stop()


def test_p0_serves_no_slots_of_its_own():
    # behind llama-server, /slots stays llama-server's (its entries carry every client's prompt): not passed on
    from gateway.p0 import app as p0
    assert ("GET", "/slots") not in p0.ROUTES
