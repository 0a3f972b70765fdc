"""A reasoning budget through the real engine: `bankml serve --native` on a tiny random llama (byte-level
vocabulary, CPU, seconds) with Qwen3's and DeepSeek-R1's templates. The model knows nothing of thinking, so
whatever it writes inside the thought is noise: the grammar (gateway/serving/reasoning.constrain) opens the
thought, closes it once `reasoning_budget_tokens` tokens are spent, and puts a JSON schema or a tool call
after it. Token counts are read off the answer's logprob entries, one per generated token."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from gateway_helpers import CliServer, sse_data, tiny_model

pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}}}


def _serve(bankml_cmd, tmp_path_factory, template: str) -> CliServer:
    model, fork = tiny_model(tmp_path_factory.mktemp(template))
    return CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "1024", "--config", "cpu",
                     "--chat-template-file", str(FIXTURES / f"template_{template}.jinja"))


@pytest.fixture(scope="module")
def qwen3(bankml_cmd, tmp_path_factory):
    s = _serve(bankml_cmd, tmp_path_factory, "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def r1(bankml_cmd, tmp_path_factory):
    s = _serve(bankml_cmd, tmp_path_factory, "deepseek_r1")
    yield s
    s.stop()


def chat(server, **body) -> dict:
    body = {"messages": HI, "max_tokens": 40, "temperature": 1.0, "seed": 3, "logprobs": True, "top_logprobs": 1,
            **body}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(doc: dict) -> list[bytes]:
    """The answer's generated tokens, as bytes (its logprob entries)."""
    return [bytes(e["bytes"]) for e in doc["choices"][0]["logprobs"]["content"]]


def test_a_budget_closes_the_thought_when_spent(qwen3):
    free = chat(qwen3, reasoning_format="none")  # no budget: a random model never opens a thought of its own
    assert not free["choices"][0]["message"]["content"].startswith("<think>")
    for budget in (1, 3, 5):
        doc = chat(qwen3, reasoning_format="none", reasoning_budget_tokens=budget)
        text = doc["choices"][0]["message"]["content"]
        assert text.startswith("<think>") and "</think>" in text, text
        toks = tokens(doc)
        assert b"".join(toks).decode("utf-8", "replace").startswith("<think>")
        thought = b"".join(toks).split(b"</think>")[0][len(b"<think>"):]
        # each vocabulary token is at most two bytes (its two merges): the thought took at most `budget` of them
        assert len(thought) <= 2 * budget, (budget, thought)


def test_the_thought_is_split_and_a_json_schema_holds_after_it(qwen3):
    doc = chat(qwen3, reasoning_budget_tokens=4, max_tokens=300,  # JSON's whitespace takes a random model a while
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    message = doc["choices"][0]["message"]
    assert json.loads(message["content"]) in ({"a": 1}, {"a": 2}), message
    raw = chat(qwen3, reasoning_budget_tokens=4, reasoning_format="none", max_tokens=300,
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    text = raw["choices"][0]["message"]["content"]
    assert text.startswith("<think>") and json.loads(text.split("</think>", 1)[1]) in ({"a": 1}, {"a": 2})


def test_a_required_tool_call_follows_the_bounded_thought(qwen3):
    doc = chat(qwen3, reasoning_budget_tokens=2, tools=[TOOL], tool_choice="required", logprobs=False,
               top_logprobs=None, max_tokens=300)
    choice = doc["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


def test_a_budget_of_zero_renders_thinking_off_and_forces_no_thought(qwen3):
    base = chat(qwen3, reasoning_format="none")
    doc = chat(qwen3, reasoning_format="none", reasoning_budget_tokens=0)
    assert doc["usage"]["prompt_tokens"] > base["usage"]["prompt_tokens"]  # "<think>\n\n</think>\n\n" in the prompt
    assert not doc["choices"][0]["message"]["content"].startswith("<think>")


def test_r1s_opened_thought_is_closed_at_the_budget(r1):
    for budget in (0, 2):
        doc = chat(r1, reasoning_format="none", reasoning_budget_tokens=budget)
        text = b"".join(tokens(doc))
        assert b"</think>" in text, text
        assert len(text.split(b"</think>")[0]) <= 2 * budget  # the prompt opened it: the answer starts inside
        split = chat(r1, reasoning_budget_tokens=budget)["choices"][0]["message"]
        assert "</think>" not in split["content"]


def test_a_streamed_thought_carries_every_tokens_logprob_entry(qwen3):
    body = {"messages": HI, "max_tokens": 24, "temperature": 1.0, "seed": 5, "logprobs": True, "top_logprobs": 1,
            "reasoning_budget_tokens": 3}
    whole = httpx.post(qwen3.url("/v1/chat/completions"), json=body, timeout=300).json()
    stream = httpx.post(qwen3.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=300).text
    chunks = [e for e in sse_data(stream) if e != "[DONE]" and e["choices"]]
    entries = [x for e in chunks for x in (e["choices"][0].get("logprobs") or {}).get("content", [])]
    # the tags' tokens are held until the text is sure; their entries ride on the next chunk sent
    assert [x["id"] for x in entries] == [x["id"] for x in whole["choices"][0]["logprobs"]["content"]]
    deltas = [e["choices"][0]["delta"] for e in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["choices"][0]["message"].get(
        "reasoning_content", "")
    assert "".join(d.get("content") or "" for d in deltas) == whole["choices"][0]["message"]["content"]
