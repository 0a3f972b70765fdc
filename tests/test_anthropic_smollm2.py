"""Anthropic's Messages API on the real SmolLM2 (a template without tools or thoughts), through the
`anthropic` SDK: a tool call made by the generic JSON grammar when one is required, stop sequences,
count_tokens against the create's usage, the prefix cache as `cache_read_input_tokens`, and the stream
helper's message the same as a plain call's (greedy). `slow`: one server on the real model."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from gateway_helpers import CliServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GREEDY = {"temperature": 0.0}  # Anthropic's API field; this SDK sends it as extra_body
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(bankml_cmd, smollm2_path, smollm2_fork):
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "1024", "--config", "cpu")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return "SmolLM2-135M-Instruct.Q4_1.gguf"


def total_input(m) -> int:
    return m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_required_tool_call_is_made_by_the_grammar(client, model, choice):
    m = client.messages.create(model=model, max_tokens=96, tools=[WEATHER], tool_choice=choice, messages=ASK,
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use", m.content
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and isinstance(u.input.get("city"), str) for u in uses)
    assert uses[0].id.startswith("toolu_")
    count = client.messages.count_tokens(model=model, tools=[WEATHER], tool_choice=choice, messages=ASK)
    assert total_input(m) == count.input_tokens
    # the result goes back, and the model answers it (the generic form: a `response`, as text)
    turns = [*ASK, {"role": "assistant", "content": [u.to_dict() for u in uses]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 24 C"}
                                          for u in uses]}]
    after = client.messages.create(model=model, max_tokens=64, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=turns, extra_body=GREEDY)
    assert after.content and after.content[0].type == "text" and after.content[0].text.strip()
    assert total_input(after) == client.messages.count_tokens(model=model, tools=[WEATHER],
                                                              tool_choice={"type": "none"}, messages=turns).input_tokens


def test_a_stop_sequence_ends_the_answer(client, model):
    ask = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    whole = client.messages.create(model=model, max_tokens=48, messages=ask, extra_body=GREEDY)
    text = whole.content[0].text
    words = text.split()
    assert len(words) >= 4, text
    stop = words[2]
    m = client.messages.create(model=model, max_tokens=48, messages=ask, stop_sequences=[stop], extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[:text.index(stop)]


def test_count_tokens_is_the_prompt_and_a_repeat_reads_the_prefix_cache(client, model):
    ask = [{"role": "user", "content": "Name three colours of the rainbow, briefly."}]
    system = "You are a terse assistant. Answer in one line."
    count = client.messages.count_tokens(model=model, system=system, messages=ask).input_tokens
    first = client.messages.create(model=model, max_tokens=24, system=system, messages=ask, extra_body=GREEDY)
    assert total_input(first) == count
    again = client.messages.create(model=model, max_tokens=24, system=system, messages=ask, extra_body=GREEDY)
    assert total_input(again) == count
    assert again.usage.cache_read_input_tokens > count // 2 and again.usage.input_tokens < count
    assert again.content == first.content


def test_the_stream_helper_builds_the_greedy_message(client, model):
    ask = [{"role": "user", "content": "Say hello in French."}]
    plain = client.messages.create(model=model, max_tokens=32, messages=ask, extra_body=GREEDY)
    with client.messages.stream(model=model, max_tokens=32, messages=ask, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == plain.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (plain.stop_reason, plain.usage.output_tokens)
    assert total_input(final) == total_input(plain)


def test_a_long_prompt_is_pinged_while_it_is_prefilled(server):
    # --config cpu prefills 256 tokens a chunk: a prompt of ~700 is three chunks, a ping after each
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 70)
    r = httpx.post(server.url("/v1/messages"), timeout=300, json={
        "model": "m", "max_tokens": 4, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": long + " How many foxes?"}]})
    kinds = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    first_block = kinds.index("content_block_start") if "content_block_start" in kinds else kinds.index("message_delta")
    assert kinds[1:first_block].count("ping") >= 3, kinds
