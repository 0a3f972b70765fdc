"""Reasoning models over HTTP, as the `openai` and `ollama` clients see them: tiny GGUFs served with Qwen3's and
DeepSeek-R1's real chat templates (tests/fixtures/template_*.jinja, --chat-template-file) over the fake engine,
whose answer to a prompt ending in THINK is a thought between <think> tags, then its reply (THINKTOOL: then a
hermes tool call). The thought is `reasoning_content` on /v1/chat/completions and `thinking` on Ollama's
routes, whole and streamed; the receipt covers the text as the model wrote it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from fake_engine import REPLY, THINK_CALL_PIECES, THOUGHT, THOUGHT_PIECES
from gateway_helpers import FakeServer, sse_data, tiny_model

pytestmark = pytest.mark.timeout(120)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GENERATED = "".join(THOUGHT_PIECES)  # the fake's answer, as written
HI = [{"role": "user", "content": "Hi THINK"}]
THOUGHT_TOKENS = THOUGHT_PIECES.index("think>") + 1
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _server(tmp_path_factory, template: str) -> FakeServer:
    model, fork = tiny_model(tmp_path_factory.mktemp(template))
    return FakeServer(model, fork, flags=["--chat-template-file", str(FIXTURES / f"template_{template}.jinja")])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    s = _server(tmp_path_factory, "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    s = _server(tmp_path_factory, "deepseek_r1")
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --- /v1/chat/completions --------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["qwen3", "r1"])
def test_the_openai_client_reads_the_thought_as_reasoning_content(request, template):
    server = request.getfixturevalue(template)
    answer = client(server).chat.completions.create(model="tiny", messages=HI)
    message = answer.choices[0].message
    assert message.content == REPLY
    assert message.reasoning_content == THOUGHT  # an unknown field: the client keeps it (model_extra)
    # the thought's tokens, its tags included: the fake's pieces up to "think>"
    assert answer.usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    # the receipt covers what the model wrote: tags, thought and reply
    assert answer.model_extra["bankml_receipt"]["response_sha256"] == sha256(GENERATED)


def test_the_streamed_thought_is_delta_reasoning_content_then_the_reply_is_content(qwen3):
    stream = client(qwen3).chat.completions.create(model="tiny", messages=HI, stream=True)
    thought, content, receipt, used = [], [], None, None
    for chunk in stream:
        used = chunk.usage or used
        if not chunk.choices:
            receipt = (chunk.model_extra or {}).get("bankml_receipt") or receipt
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert not content  # the thought comes first
            thought.append(extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
    assert "".join(thought) == THOUGHT and "".join(content) == REPLY
    assert len(thought) > 1  # streamed as it came, not at the end
    assert used.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    assert receipt["response_sha256"] == sha256(GENERATED)


@pytest.mark.parametrize("fmt, content, reasoning", [
    ("none", GENERATED, None),  # the thought left in the text, as llama-server's none
    ("deepseek", REPLY, THOUGHT),
    ("auto", REPLY, THOUGHT),
    ("deepseek-legacy", GENERATED, THOUGHT),  # the content keeps it too
])
def test_reasoning_format_chooses_where_the_thought_goes(qwen3, fmt, content, reasoning):
    doc = post(qwen3, "/v1/chat/completions", {"messages": HI, "reasoning_format": fmt}).json()
    message = doc["choices"][0]["message"]
    assert message["content"] == content and message.get("reasoning_content") == reasoning
    body = post(qwen3, "/v1/chat/completions", {"messages": HI, "reasoning_format": fmt, "stream": True}).text
    deltas = [e["choices"][0]["delta"] for e in sse_data(body) if e != "[DONE]" and e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert ("".join(d.get("reasoning_content", "") for d in deltas) or None) == reasoning


def test_chat_template_kwargs_reach_the_template(qwen3):
    on = client(qwen3).chat.completions.create(model="tiny", messages=HI)
    off = client(qwen3).chat.completions.create(model="tiny", messages=HI,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3 renders thinking off as an empty thought in the prompt: "<think>\n\n</think>\n\n"
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len("<think>\n\n</think>\n\n")
    assert off.choices[0].message.reasoning_content == THOUGHT  # a model that thinks anyway is still split
    prompt = post(qwen3, "/apply-template", {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}})
    assert prompt.json()["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    budget0 = post(qwen3, "/apply-template", {"messages": HI, "reasoning_budget_tokens": 0}).json()["prompt"]
    assert budget0.endswith("<think>\n\n</think>\n\n")  # a budget of 0 renders thinking off
    assert post(qwen3, "/apply-template", {"messages": HI}).json()["prompt"].endswith("<|im_start|>assistant\n")


def test_the_r1_prompt_opens_the_thought_itself(r1):
    prompt = post(r1, "/apply-template", {"messages": HI}).json()["prompt"]
    assert prompt.endswith("<｜Assistant｜><think>\n")
    # the answer begins inside the thought: its close tag ends it, streamed the same
    body = post(r1, "/v1/chat/completions", {"messages": HI, "stream": True}).text
    deltas = [e["choices"][0]["delta"] for e in sse_data(body) if e != "[DONE]" and e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == REPLY


@pytest.mark.parametrize("fmt", ["deepseek", "deepseek-legacy"])
def test_a_tool_call_is_parsed_from_the_answer_after_the_thought(qwen3, fmt):
    messages = [{"role": "user", "content": "Weather in Paris? THINKTOOL"}]
    extra = {"reasoning_format": fmt}
    answer = client(qwen3).chat.completions.create(model="tiny", messages=messages, tools=[TOOL], extra_body=extra)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == THOUGHT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # legacy: the content keeps the thought (the text around the call), else there is none
    kept = "<think>\nThe user greets me. I answer.\n</think>" if fmt == "deepseek-legacy" else None
    assert (choice.message.content or None) == kept
    assert answer.model_extra["bankml_receipt"]["response_sha256"] == sha256("".join(THINK_CALL_PIECES))
    stream = client(qwen3).chat.completions.create(model="tiny", messages=messages, tools=[TOOL], stream=True,
                                                   extra_body=extra)
    thought, calls, content, finish = "", [], "", None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content", "")
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert thought == THOUGHT and (content or None) == kept and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("body, message", [
    ({"chat_template_kwargs": [1, 2]}, "'chat_template_kwargs' must be a JSON object, got array"),
    ({"chat_template_kwargs": {"messages": []}}, "'chat_template_kwargs' cannot set 'messages'"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, 'invalid type for "enable_thinking"'),
    ({"reasoning_format": "deepthink"}, "Unknown reasoning format: deepthink"),
    ({"reasoning_effort": {"level": "high"}}, "'reasoning_effort' must be a string"),
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"reasoning_budget_message": "Time's up."}, "'reasoning_budget_message' is not supported"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/apply-template"])
def test_a_bad_reasoning_field_is_a_400_naming_it(qwen3, body, message, path):
    if path == "/apply-template" and ("reasoning_budget" in json.dumps(body) or "reasoning_format" in body):
        pytest.skip("/apply-template renders, as llama-server's: it does not read the answer's fields")
    r = post(qwen3, path, {"messages": HI, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert message in r.json()["error"]["message"]


def test_the_openai_client_sees_a_bad_reasoning_field_as_a_bad_request(qwen3):
    with pytest.raises(openai.BadRequestError, match="Unknown reasoning format"):
        client(qwen3).chat.completions.create(model="tiny", messages=HI, extra_body={"reasoning_format": "x"})


# --- Ollama's /api/chat and /api/generate -------------------------------------------------------------------


def ollama_client(server) -> ollama.Client:
    return ollama.Client(host=server.url(), timeout=60)


@pytest.mark.parametrize("think", [None, True, "high"])
def test_ollamas_client_reads_the_thought_as_message_thinking(qwen3, think):
    answer = ollama_client(qwen3).chat(model="tiny-model.q8_0", messages=HI, think=think)
    assert answer.message.thinking == THOUGHT and answer.message.content == REPLY
    raw = post(qwen3, "/api/chat", {"model": "tiny-model.q8_0", "messages": HI, "think": think, "stream": False})
    assert raw.json()["bankml_receipt"]["response_sha256"] == sha256(GENERATED)  # the text as written
    lines = post(qwen3, "/api/chat", {"model": "tiny-model.q8_0", "messages": HI, "think": think}).text.splitlines()
    assert json.loads(lines[-1])["bankml_receipt"]["response_sha256"] == sha256(GENERATED)  # streamed too
    thought, content = "", ""
    for part in ollama_client(qwen3).chat(model="tiny-model.q8_0", messages=HI, think=think, stream=True):
        assert not (part.message.thinking and content)  # the thought first
        thought += part.message.thinking or ""
        content += part.message.content or ""
    assert (thought, content) == (THOUGHT, REPLY)


def test_ollamas_think_false_renders_thinking_off_and_hides_nothing(qwen3):
    on = ollama_client(qwen3).chat(model="tiny-model.q8_0", messages=HI)
    off = ollama_client(qwen3).chat(model="tiny-model.q8_0", messages=HI, think=False)
    assert off.prompt_eval_count == on.prompt_eval_count + len("<think>\n\n</think>\n\n")
    assert off.message.thinking is None and off.message.content == GENERATED  # the model thought anyway: kept


def test_ollamas_generate_has_thinking_beside_response(r1):
    answer = ollama_client(r1).generate(model="tiny-model.q8_0", prompt="Hi THINK", think=True)
    assert answer.thinking == THOUGHT and answer.response == REPLY
    parts = list(ollama_client(r1).generate(model="tiny-model.q8_0", prompt="Hi THINK", think=True, stream=True))
    assert "".join(p.thinking or "" for p in parts) == THOUGHT and "".join(p.response for p in parts) == REPLY


def test_a_bad_think_value_is_ollamas_400(qwen3):
    r = post(qwen3, "/api/chat", {"model": "tiny-model.q8_0", "messages": HI, "think": "max", "stream": False})
    assert r.status_code == 400 and "invalid think value" in r.json()["error"]


@pytest.mark.parametrize("template", ["qwen3", "r1"])
def test_props_says_the_template_thinks(request, template):
    props = httpx.get(request.getfixturevalue(template).url("/props"), timeout=30).json()
    assert props["thought_tags"] == ["<think>", "</think>"]
