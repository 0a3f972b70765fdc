"""OpenAI's Responses API on the real SmolLM2 (a template without tools or thoughts: tool calls by the
generic JSON grammar), through the `openai` and `openai-agents` SDKs: text.format json_schema strict and
`responses.parse`, a required (and a named) function call as a `function_call` item, its output continuing
the conversation by previous_response_id, the stream helper's final response the same as a plain call's
with a call, the prefix cache as `cached_tokens`, and an Agent with a function tool run by `Runner.run`
over `OpenAIResponsesModel`. `slow`: one server on the real model."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from pathlib import Path

import openai
import pytest
from gateway_helpers import CliServer
from pydantic import BaseModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
ASK = "What is the weather like in Paris today?"


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(bankml_cmd, smollm2_path, smollm2_fork):
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "1024", "--config", "cpu")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def test_a_strict_json_schema_answers_valid_json_and_parse_reads_it(client):
    schema = Person.model_json_schema() | {"additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Ann is 30. Give her as JSON.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    parsed = client.responses.parse(model=MODEL, input="Ann is 30. Give her as JSON.", text_format=Person,
                                    temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Person) and parsed.output_parsed == Person(**person)


def test_json_object_answers_json(client):
    r = client.responses.create(model=MODEL, input="List two colours as a JSON object.", temperature=0,
                                max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_a_repeated_prompt_is_read_from_the_prefix_cache(client):
    first = client.responses.create(model=MODEL, input="Name a fruit.", temperature=0, max_output_tokens=8)
    again = client.responses.create(model=MODEL, input="Name a fruit.", temperature=0, max_output_tokens=8)
    assert first.usage.input_tokens == again.usage.input_tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    assert again.output_text == first.output_text


def test_a_required_call_then_its_output_continues_the_conversation(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                                parallel_tool_calls=False, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather" and r.tools[0].strict is True
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    more = {"model": MODEL, "previous_response_id": r.id, "tools": [WEATHER], "input": [output]}
    second = client.responses.create(**more, tool_choice="none", temperature=0, max_output_tokens=40)
    assert [o.type for o in second.output] == ["message"] and second.output_text
    # the second prompt is the first turn (the question and the call), then the call's output
    turn = client.responses.input_tokens.count(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="none").input_tokens
    assert second.usage.input_tokens > turn
    assert second.usage.input_tokens == client.responses.input_tokens.count(**more, tool_choice="none").input_tokens
    # the same history given as items, without the store, is the same prompt
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             output]
    assert client.responses.input_tokens.count(model=MODEL, input=items, tools=[WEATHER],
                                               tool_choice="none").input_tokens == second.usage.input_tokens


def test_a_named_function_is_called(client):
    lookup = {**WEATHER, "name": "lookup_city"}
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, lookup], temperature=0, max_output_tokens=60,
                                tool_choice={"type": "function", "name": "lookup_city"}, parallel_tool_calls=False)
    assert [(o.type, o.name) for o in r.output] == [("function_call", "lookup_city")]


def test_the_stream_helper_with_a_call_ends_as_a_plain_create(client):
    args = {"model": MODEL, "input": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
            "parallel_tool_calls": False, "max_output_tokens": 60}
    plain = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    strip = {"id", "call_id", "parsed_arguments"}
    assert [{k: v for k, v in o.model_dump().items() if k not in strip} for o in final.output] == \
        [{k: v for k, v in o.model_dump().items() if k not in strip} for o in plain.output]
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.model_extra["bankml_receipt"]["response_sha256"] == plain.model_extra["bankml_receipt"][
        "response_sha256"]


def test_an_agent_calls_its_function_tool_and_answers(server):
    from agents import Agent, ModelSettings, RunHooks, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 C in {city}."

    class AnswerAfterTheTool(RunHooks):
        """A 135M model calls again when it may: once the tool answered, the next turn answers."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = agent.model_settings.resolve(ModelSettings(tool_choice="none"))

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server.url("/v1"),
                                                                               api_key="unused", max_retries=0))
    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=model, reset_tool_choice=False,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80,
                                               parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, ASK, max_turns=4, hooks=AnswerAfterTheTool()))
    assert cities and all(isinstance(c, str) and c for c in cities)
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.raw_responses[-1].response_id.startswith("resp_")


def test_the_readmes_snippets_run_as_written(server):
    """docs/apis.md's "OpenAI's Responses API" examples (the openai SDK's and the agent's), against this server."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "apis.md").read_text()  # moved from the README
    section = readme.split("## OpenAI's Responses API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("http://127.0.0.1:18093", server.url()), {"__name__": "readme"})
        assert out.getvalue().strip()
