"""What llama.cpp's own server tests (tools/server/tests/unit) found at the edges of the llama-server and
OpenAI routes, each as a client sees it: a null tool_choice, a response_format schema that is not an object,
a history call whose arguments are not JSON, an empty or a media embedding input, the model lists without
an API key, the biases ignore_eos applies, and llama-server's spelling of the slot directory flag."""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model

from bankml.cli import build_parser
from gateway.openai.chat_request import check_messages
from gateway.serving.tool_calls import read_tools

pytestmark = pytest.mark.timeout(120)

KEY = "sk-edge-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Say hello."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("edges")), engine={"max_seqs": 2}, flags=["--api-key", KEY])
    yield s
    s.stop()


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url(path), content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})}, timeout=60)


def error(r: httpx.Response) -> tuple[int, str, str]:
    e = r.json()["error"]
    return r.status_code, e["type"], e["message"]


def test_a_null_tool_choice_is_absent():
    # the fake engine's tokenizer cannot build a tools grammar: the reading is checked where it happens
    tools = read_tools({"tools": [TOOL], "tool_choice": None})
    assert tools is not None and tools == read_tools({"tools": [TOOL]})
    assert read_tools({"tool_choice": None}) is None


def test_a_null_tool_choice_without_tools_is_nothing_asked(server):
    assert post(server, "/v1/chat/completions", {"messages": HI, "tool_choice": None, "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("rf, where", [
    ({"type": "json_object", "schema": 123}, "response_format.schema"),
    ({"type": "json_object", "schema": "object"}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
])
def test_a_response_format_schema_that_is_not_an_object_is_a_400(server, rf, where):
    status, kind, message = error(post(server, "/v1/chat/completions", {"messages": HI, "response_format": rf}))
    assert (status, kind) == (400, "invalid_request_error")
    assert message.startswith(f"{where} must be a JSON Schema object")


def test_a_history_call_whose_arguments_are_not_json_is_a_400_naming_it(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    status, kind, message = error(post(server, "/v1/chat/completions", {"messages": messages, "tools": [TOOL]}))
    assert (status, kind) == (400, "invalid_request_error")
    assert "messages[1].tool_calls[0].function.arguments is not valid JSON" in message
    # arguments given as JSON text or as an object are taken
    for args in ('{"city": "Paris"}', {"city": "Paris"}):
        messages[1]["tool_calls"][0]["function"]["arguments"] = args
        assert check_messages(messages)[1]["tool_calls"][0]["function"]["arguments"] == args


def test_an_empty_embedding_input_has_a_vector(server):
    r = post(server, "/v1/embeddings", {"input": ""})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == 1 and len(body["data"][0]["embedding"]) > 1
    assert body["usage"]["prompt_tokens"] == 1  # the model's BOS (else EOS) stands for the empty text
    listed = post(server, "/v1/embeddings", {"input": ["hello", ""]})
    assert listed.status_code == 200 and len(listed.json()["data"]) == 2
    for empty in ({"content": []}, {"content": [{"type": "text", "text": 3}]}):  # no text part: as ""
        again = post(server, "/v1/embeddings", {"input": empty})
        assert again.status_code == 200 and again.json()["data"][0]["embedding"] == body["data"][0]["embedding"]
    multimodal = post(server, "/v1/embeddings", {"input": {"prompt_string": "x", "multimodal_data": []}})
    assert multimodal.status_code == 400, multimodal.text


@pytest.mark.parametrize("part, kind", [
    ({"type": "input_audio", "input_audio": {}}, "audio"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image"),
])
def test_media_on_a_text_model_is_a_400_naming_its_type(server, part, kind):
    for path, body in (("/v1/embeddings", {"input": {"content": [part]}}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]})):
        status, _, message = error(post(server, path, body))
        assert status == 400 and message.startswith(f"{kind} input is not supported"), (path, message)


@pytest.mark.parametrize("path", ["/models", "/v1/models", "/health", "/v1/health"])
def test_the_model_lists_and_health_need_no_key(server, path):
    r = httpx.get(server.url(path), timeout=30)
    assert r.status_code == 200 and "error" not in r.json()


def test_every_other_route_still_needs_the_key(server):
    r = httpx.post(server.url("/v1/chat/completions"), content=json.dumps({"messages": HI}).encode(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_ignore_eos_shows_the_end_of_generation_biases_it_applied(server):
    plain = post(server, "/completion", {"prompt": "Hi", "n_predict": 2, "logit_bias": [[5, -1.5]]}).json()
    assert plain["generation_settings"]["ignore_eos"] is False
    assert plain["generation_settings"]["logit_bias"] == [{"bias": -1.5, "token": 5}]
    r = post(server, "/completion", {"prompt": "Hi", "n_predict": 2, "ignore_eos": True, "logit_bias": [[5, -1.5]]})
    settings = r.json()["generation_settings"]
    assert settings["ignore_eos"] is True
    first, *ends = settings["logit_bias"]
    assert first == {"bias": -1.5, "token": 5}
    assert ends and all(e["bias"] is None for e in ends)  # -inf, which llama-server's JSON writes as null
    assert len({e["token"] for e in ends}) == len(ends)


def test_llama_servers_slot_flag_is_an_alias_of_ours():
    args = build_parser().parse_args(["serve", "--native", "--slot-save-path", "/tmp/slots"])
    assert args.slot_dir == "/tmp/slots"


def test_the_kv_cache_type_is_shown_in_bankml_props_and_slots(server):
    for path in ("/bankml", "/props"):
        assert httpx.get(server.url(path), headers=AUTH, timeout=30).json()["cache_type"] == "f16", path
    slots = httpx.get(server.url("/slots"), headers=AUTH, timeout=30).json()
    assert slots and all(s["cache_type"] == "f16" for s in slots)
