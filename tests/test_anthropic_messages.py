"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the `anthropic` SDK itself,
against the fake engine: the message, its stream (events in order, the stream helper's message the same
as a plain call's), stop sequences, thinking blocks, tool use and its round trip, count_tokens, the
receipt, and every error in Anthropic's shape with the SDK's exception for its status."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from fake_engine import CALL_PIECES, REPLY, REPLY_PIECES, THOUGHT, THOUGHT_PIECES
from gateway_helpers import EdgeServer, FakeServer, registry_dir, tiny_model

from bankml import signing

pytestmark = pytest.mark.timeout(120)

KEY = "sk-anthropic-test-key"
MODEL = "tiny-model.q8_0"
HI = [{"role": "user", "content": "Say hello."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("anthropic")
    model, fork = tiny_model(d)
    registry_dir(d / "reg", ["Other-Model.Q8_0.gguf"])  # two models: an unknown name is a 404
    s = FakeServer(model, fork, registry=d / "reg", flags=["--api-key", KEY], limits={"max_body_bytes": MAX_BODY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def public_key(server):
    r = httpx.get(server.url("/bankml/receipt-key"), headers={"x-api-key": KEY}, timeout=10)
    return serialization.load_pem_public_key(r.json()["public_key"].encode())


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def comparable(message) -> dict:
    """A message as a client compares two: its id and receipt aside."""
    d = message.to_dict()
    d.pop("id")
    d.pop("bankml_receipt", None)
    for block in d["content"]:
        block.pop("parsed_output", None)  # the stream helper's TextBlock has it
        if block["type"] == "tool_use":
            block.pop("id")
    return d


def events(server, body: dict) -> list[tuple[str, dict]]:
    r = httpx.post(server.url("/v1/messages"), json={"model": MODEL, "stream": True, **body},
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.split("\n\n"):
        if block.strip():
            head, data = block.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


# --- the message ----------------------------------------------------------------------------------------


def test_a_message_with_its_usage_and_a_receipt_that_verifies(client, public_key):
    m = client.messages.create(model=MODEL, max_tokens=64, messages=HI)
    assert m.id.startswith("msg_") and len(m.id) == 36 and m.type == "message" and m.role == "assistant"
    assert m.model == "Tiny-Model.Q8_0.gguf"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == REPLY
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert m.usage.output_tokens == len(REPLY_PIECES)  # a piece a step
    assert m.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count > 0
    receipt = m.model_extra["bankml_receipt"]
    assert signing.verify(receipt, public_key)
    assert receipt["response_sha256"] == sha(REPLY) and receipt["completion_tokens"] == m.usage.output_tokens


def test_system_as_a_string_or_text_blocks(client):
    plain = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    said = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HI).input_tokens
    blocks = client.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                          messages=HI).input_tokens
    assert said == blocks > plain
    m = client.messages.create(model=MODEL, max_tokens=64, system=[{"type": "text", "text": "Be brief."}], messages=HI)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == said


def test_the_token_limit_is_max_tokens(client):
    # (the fake engine honours no stop strings: stop_sequences are tested on SmolLM2, test_anthropic_smollm2.py)
    m = client.messages.create(model=MODEL, max_tokens=3, messages=HI)
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 3)


def test_block_content_and_the_fields_the_sdk_no_longer_sends(client):
    # temperature, top_p and top_k are Anthropic's API's still; this SDK sends them as extra_body
    m = client.messages.create(model=MODEL, max_tokens=64, metadata={"user_id": "u-1"}, service_tier="auto",
                               speed="standard", cache_control={"type": "ephemeral"},
                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Say"},
                                                                      {"type": "text", "text": "hello."}]}])
    assert m.content[0].text == REPLY


# --- the stream -------------------------------------------------------------------------------------------


def test_the_events_in_order_with_the_receipt_on_message_delta(server, public_key):
    got = events(server, {"max_tokens": 64, "messages": HI})
    kinds = [k for k, _ in got]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[3:-3] == ["content_block_delta"] * (len(kinds) - 6)
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == kind for kind, data in got)
    start = got[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0 and start["usage"]["output_tokens"] == 0
    assert got[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for k, d in got if k == "content_block_delta") == REPLY
    delta = got[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None, "stop_details": None}
    assert delta["usage"]["output_tokens"] == len(REPLY_PIECES)
    assert signing.verify(delta["bankml_receipt"], public_key)
    assert delta["bankml_receipt"]["response_sha256"] == sha(REPLY)


def test_the_stream_helper_builds_the_message_a_plain_call_returns(client):
    asked = {"model": MODEL, "max_tokens": 64, "messages": HI}
    plain = client.messages.create(**asked)
    with client.messages.stream(**asked) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == REPLY
    assert comparable(final) == comparable(plain)
    assert final.stop_reason == "end_turn" and final.stop_sequence is None


def test_an_engine_failure_after_the_head_is_an_error_event(server, client):
    got = events(server, {"max_tokens": 64, "messages": [{"role": "user", "content": "Hi FAIL"}]})
    assert got[-1][0] == "error" and got[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [k for k, _ in got]
    with pytest.raises(anthropic.APIStatusError, match="failed on purpose"):
        for _ in client.messages.create(model=MODEL, max_tokens=64, stream=True,
                                        messages=[{"role": "user", "content": "Hi FAIL"}]):
            pass


# --- thinking ---------------------------------------------------------------------------------------------

THINK = [{"role": "user", "content": "Think first. THINK"}]
THINKING = {"type": "enabled", "budget_tokens": 40}


def test_thinking_is_a_thinking_block_then_the_text(client, public_key):
    m = client.messages.create(model=MODEL, max_tokens=64, thinking=THINKING, messages=THINK)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THOUGHT and m.content[0].signature == sha(THOUGHT)
    assert m.content[1].text == REPLY
    receipt = m.model_extra["bankml_receipt"]
    assert signing.verify(receipt, public_key) and receipt["response_sha256"] == sha("".join(THOUGHT_PIECES))
    with client.messages.stream(model=MODEL, max_tokens=64, thinking=THINKING, messages=THINK) as stream:
        final = stream.get_final_message()
    assert comparable(final) == comparable(m)


def test_thinking_streams_as_thinking_and_signature_deltas(server):
    got = events(server, {"max_tokens": 64, "thinking": THINKING, "messages": THINK})
    blocks = [d["content_block"]["type"] for k, d in got if k == "content_block_start"]
    assert blocks == ["thinking", "text"]
    deltas = [d["delta"] for k, d in got if k == "content_block_delta" and d["index"] == 0]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == THOUGHT
    assert deltas[-1] == {"type": "signature_delta", "signature": sha(THOUGHT)}


def test_an_omitted_thought_keeps_its_signature(client):
    thinking = {**THINKING, "display": "omitted"}
    m = client.messages.create(model=MODEL, max_tokens=64, thinking=thinking, messages=THINK)
    assert m.content[0].type == "thinking" and m.content[0].thinking == "" and m.content[0].signature == sha(THOUGHT)
    with client.messages.stream(model=MODEL, max_tokens=64, thinking=thinking, messages=THINK) as stream:
        assert comparable(stream.get_final_message()) == comparable(m)


def test_thinking_in_the_history_and_its_refusals(client):
    history = [*THINK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I was asked.", "signature": "x"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Again."}]
    assert client.messages.create(model=MODEL, max_tokens=64, thinking=THINKING, messages=history).content
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model=MODEL, max_tokens=16, thinking={"type": "enabled", "budget_tokens": 16},
                               messages=HI)


# --- tools ----------------------------------------------------------------------------------------------

CALL = [{"role": "user", "content": "What is the weather in Paris? CALLTOOL"}]
CALL_TEXT = "".join(CALL_PIECES)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_tool_call_is_a_tool_use_block(client, public_key, choice):
    m = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], tool_choice=choice, messages=CALL)
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
    use = m.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    receipt = m.model_extra["bankml_receipt"]
    assert signing.verify(receipt, public_key) and receipt["response_sha256"] == sha(CALL_TEXT)


def test_a_streamed_tool_call_is_an_input_json_delta(server, client):
    got = events(server, {"max_tokens": 64, "tools": [WEATHER], "tool_choice": {"type": "any"}, "messages": CALL})
    start = [d["content_block"] for k, d in got if k == "content_block_start"]
    assert len(start) == 1 and start[0]["type"] == "tool_use" and start[0]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for k, d in got if k == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"
    asked = {"model": MODEL, "max_tokens": 64, "tools": [WEATHER], "tool_choice": {"type": "any"}, "messages": CALL}
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert comparable(final) == comparable(client.messages.create(**asked))


def test_a_tool_result_turn_goes_into_the_prompt(client):
    use = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], tool_choice={"type": "any"},
                                 messages=CALL).content[0]
    turns = [*CALL, {"role": "assistant", "content": [use.to_dict()]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": [{"type": "text", "text": "Sunny, 24 degrees"}]}]}]
    m = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=turns)
    assert m.stop_reason in ("end_turn", "tool_use")
    count = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=turns).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count
    failed = [*turns[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                                         "content": "Sunny, 24 degrees"}]}]
    more = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=failed).input_tokens
    assert more > count - len("[{\"type\": \"text\", \"text\": ") and more != count  # is_error is said
    without = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=CALL).input_tokens
    assert count > without + len("Sunny, 24 degrees")


def test_count_tokens_counts_the_tools(client):
    plain = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=HI).input_tokens > plain + 50
    assert client.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "none"},
                                        messages=HI).input_tokens == plain


# --- errors ---------------------------------------------------------------------------------------------


def error_of(e: anthropic.APIStatusError) -> dict:
    body = e.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


@pytest.mark.parametrize("body, words", [
    ({"messages": HI}, "max_tokens: Field required"),
    ({"max_tokens": 8, "messages": HI, "n": 2}, "n: Extra inputs are not permitted"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "'image' block"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "'document' block"),
    ({"max_tokens": 8, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "'web_search_20250305' tool"),
    ({"max_tokens": 8, "messages": HI, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "'mcp_servers'"),
    ({"max_tokens": 8, "messages": HI, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "'output_config'"),
    ({"max_tokens": 8, "messages": HI, "thinking": {"type": "adaptive"}}, "'adaptive'"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 8, "messages": []}, "at least one message"),
    ({"max_tokens": 8, "messages": HI, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 8, "messages": HI, "tools": [{"name": "f"}]}, "tools.0.input_schema: Field required"),
    ({"max_tokens": 8, "messages": HI, "tool_choice": {"type": "some"}}, "tool_choice"),
])
def test_a_bad_request_is_anthropics_400(client, body, words):
    with pytest.raises(anthropic.BadRequestError) as e:  # sent as it is: the SDK checks some fields itself
        client.post("/v1/messages", body={"model": MODEL, **body}, cast_to=httpx.Response)
    err = error_of(e.value)
    assert err["type"] == "invalid_request_error" and words in err["message"], err


def test_a_wrong_key_is_an_authentication_error_and_both_key_headers_work(server):
    wrong = anthropic.Anthropic(base_url=server.url(""), api_key="sk-wrong", max_retries=0)
    for call in (lambda: wrong.messages.create(model=MODEL, max_tokens=8, messages=HI),
                 lambda: wrong.messages.count_tokens(model=MODEL, messages=HI)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            call()
        assert error_of(e.value)["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url(""), auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.create(model=MODEL, max_tokens=8, messages=HI).content[0].text


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4-1", max_tokens=8, messages=HI)
    err = error_of(e.value)
    assert err["type"] == "not_found_error" and "claude-opus-4-1" in err["message"]


def test_a_body_over_the_limit_is_request_too_large(client):
    with pytest.raises(anthropic.RequestTooLargeError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x" * MAX_BODY}])
    assert error_of(e.value)["type"] == "request_too_large"


def test_an_unknown_messages_route_and_the_beta_query(server, client):
    r = httpx.post(server.url("/v1/messages/batches"), json={}, headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    m = client.beta.messages.create(model=MODEL, max_tokens=64, messages=HI)  # POST /v1/messages?beta=true
    assert m.content[0].text == REPLY


def test_every_error_class_renders_in_anthropics_shape():
    from bankml.errors import TABLE, ModelUnusable
    from gateway.http.errors import ANTHROPIC_TYPES, Api, GatewayErrorHandler, api_of, render

    for cls, row in TABLE.items():
        r = render(cls("why it failed"), Api.ANTHROPIC)
        kind = ANTHROPIC_TYPES.get(row.openai, "api_error" if row.openai >= 500 else "invalid_request_error")
        assert (r.status, json.loads(r.body)) == (row.openai, {"type": "error", "error": {
            "type": kind, "message": "why it failed"}}), cls
    assert api_of("/v1/messages") is api_of("/v1/messages/count_tokens") is Api.ANTHROPIC
    assert api_of("/v1/messagesx") is Api.OPENAI
    r = GatewayErrorHandler("").default(SimpleNamespace(path="/v1/messages", method="POST"), ModelUnusable("changed"))
    assert (r.status, json.loads(r.body)["error"]) == (503, {"type": "overloaded_error", "message": "changed"})


def test_a_changed_model_file_is_a_503_overloaded_error(tmp_path):
    model, fork = tiny_model(tmp_path)
    s = FakeServer(model, fork)
    try:
        c = anthropic.Anthropic(base_url=s.url(""), api_key="unused", max_retries=0)
        assert c.messages.create(model=MODEL, max_tokens=8, messages=HI).content
        with open(model, "ab") as f:  # the file changes under the server
            f.write(b"\0")
        for stream in (False, True):
            with pytest.raises(anthropic.InternalServerError) as e:
                c.messages.create(model=MODEL, max_tokens=8, messages=HI, stream=stream)
            assert e.value.status_code == 503 and error_of(e.value)["type"] == "overloaded_error"
            assert "changed since bankml verified it" in error_of(e.value)["message"]
    finally:
        s.stop()


def test_a_stream_cut_by_shutdown_ends_with_anthropics_error_event(tmp_path):
    model, fork = tiny_model(tmp_path)
    config = tmp_path / "grace.toml"
    config.write_text("[serve]\nshutdown_grace_s = 0.5\n")
    s = FakeServer(model, fork, step_ms=20, flags=["--config", str(config)])
    try:
        body = {"model": MODEL, "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": "LONG"}]}
        with httpx.stream("POST", s.url("/v1/messages"), json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: message_start"
            s.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-3:-1] == ["event: error", 'data: {"type": "error", "error": {"type": "overloaded_error", '
                               '"message": "bankml serve is shutting down; the answer was cut short"}}'], rest[-4:]
    finally:
        s.stop()


def test_a_thinking_template_splits_the_thought_unasked_and_reads_thinking_disabled(tmp_path):
    model, fork = tiny_model(tmp_path)
    template = Path(__file__).parent / "fixtures" / "template_qwen3.jinja"
    s = EdgeServer(model, fork, "--chat-template-file", str(template))
    try:
        c = anthropic.Anthropic(base_url=s.url(""), api_key="unused", max_retries=0)
        m = c.messages.create(model=MODEL, max_tokens=64, messages=THINK)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
            ("thinking", THOUGHT), ("text", REPLY)]
        default = c.messages.count_tokens(model=MODEL, messages=THINK).input_tokens
        off = c.messages.count_tokens(model=MODEL, messages=THINK, thinking={"type": "disabled"}).input_tokens
        assert off == default + len("<think>\n\n</think>\n\n")  # enable_thinking false: Qwen3's empty thought
        m = c.messages.create(model=MODEL, max_tokens=64, messages=THINK, thinking={"type": "disabled"})
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == off
    finally:
        s.stop()


def test_the_model_list_is_anthropics_for_its_sdk_and_openais_for_the_rest(server, client):
    import openai

    listed = client.models.list()  # the SDK sends anthropic-version: Anthropic's list, which it parses
    ids = [m.id for m in listed.data]
    assert ids == ["Tiny-Model.Q8_0.gguf", "Other-Model.Q8_0.gguf"]
    assert all(m.type == "model" and m.display_name == m.id and m.created_at.year >= 1970 for m in listed.data)
    assert client.models.retrieve(ids[0]).id == ids[0]
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")
    oai = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    assert sorted(m.id for m in oai.models.list()) == sorted(ids)
    assert oai.models.retrieve(ids[0]).owned_by == "bankML"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
