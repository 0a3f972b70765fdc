"""A final assistant message is continued (llama-server's assistant prefill, vLLM's continue_final_message,
Anthropic's prefill): the prompt is the conversation cut just after that message's text, and the answer is
what comes next. Through /apply-template (the prompt itself), /v1/chat/completions, the input-token counts,
Anthropic's /v1/messages and Ollama's /api/chat with their SDKs; the combinations llama-server refuses are its 400s."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import pytest
from fake_engine import REPLY
from gateway_helpers import FakeServer, tiny_model

pytestmark = pytest.mark.timeout(120)

HI = {"role": "user", "content": "Name a book."}
PREFILL = {"role": "assistant", "content": "Whill "}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("prefill")))
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def prompt(server, body: dict) -> str:
    r = post(server, "/apply-template", body)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_the_prompt_is_the_conversation_cut_after_the_final_message(server):
    continued = prompt(server, {"messages": [HI, PREFILL]})
    # the tiny model's ChatML: the assistant turn open, its text (stripped, as transformers strips it), no <|im_end|>
    assert continued == "<|im_start|>user\nName a book.<|im_end|>\n<|im_start|>assistant\nWhill"
    later = prompt(server, {"messages": [HI, PREFILL, {"role": "user", "content": "Another."}]})
    assert later.startswith(continued + " <|im_end|>")  # the same text the whole conversation renders
    asked = prompt(server, {"messages": [HI, PREFILL], "continue_final_message": True, "add_generation_prompt": False})
    assert asked == continued  # vLLM's explicit name for the same prompt
    turn = prompt(server, {"messages": [HI]})
    assert continued.startswith(turn)  # the assistant turn opens as a generation prompt opens it


@pytest.mark.parametrize("body, message", [
    ({"messages": [HI, PREFILL, PREFILL]}, "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": [HI], "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message needs a final assistant message"),
    ({"messages": [HI, PREFILL], "continue_final_message": True},
     "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"messages": [HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "a final assistant message with tool_calls cannot be continued"),
])
def test_what_cannot_be_continued_is_a_400(server, body, message):
    for path in ("/apply-template", "/v1/chat/completions"):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (path, r.text)


def test_a_chat_answers_the_continuation_counted_on_the_continued_prompt(server):
    body = {"messages": [HI, PREFILL], "max_tokens": 32}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == REPLY  # what comes after "Whill", not it again
    counted = post(server, "/v1/chat/completions/input_tokens", body).json()["input_tokens"]
    assert answer["usage"]["prompt_tokens"] == counted == len(prompt(server, body).encode())  # a byte a token


def test_anthropics_prefill_through_its_sdk(server):
    client = anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0)
    messages = [HI, {"role": "assistant", "content": "Whill"}]
    message = client.messages.create(model="tiny-model.q8_0", max_tokens=32, messages=messages)
    assert message.content[0].text == REPLY and message.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model="tiny-model.q8_0", messages=messages).input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    assert counted == len(prompt(server, {"messages": messages}).encode())


def test_ollamas_prefill_through_its_client(server):
    client = ollama.Client(host=server.url(""))
    messages = [HI, {"role": "assistant", "content": "Whill"}]
    r = client.chat(model="tiny-model.q8_0", messages=messages)
    assert r.message.content == REPLY and r.message.role == "assistant"
    assert r.prompt_eval_count == len(prompt(server, {"messages": messages}).encode())  # the continued prompt
    called = [HI, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    assert client.chat(model="tiny-model.q8_0", messages=called).message.content == REPLY  # a finished turn
