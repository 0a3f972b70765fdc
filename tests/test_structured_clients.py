"""Structured output and tool calls through unchanged clients, on `bankml serve --native` with the real SmolLM2.

The issue's item 4: the `openai` client's `chat.completions.parse(response_format=Model)` for five pydantic
models (nested objects, arrays, enums, optional fields, bounded numbers) returns objects that validate;
`json_object` gives parseable JSON; a GBNF grammar (llama-server's `grammar` field) is matched; the `ollama`
client's `chat(format=schema)` validates. Tool calls (item 3; SmolLM2's template knows no tools, so the
generic JSON format): `tool_choice="required"` gives a call whose arguments validate against the
function's parameters; a round trip (call, tool result, final answer) works; a streamed call assembles to
the plain one; the `ollama` client gets its calls with the arguments as an object and sends them back.
One server for the module; every generation is bounded.
The constraint is llguidance's (model/constraint.py), so whatever the tiny model "wants", the output parses.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Literal

import httpx
import ollama
import openai
import pytest
from gateway_helpers import CliServer
from pydantic import BaseModel, Field, ValidationError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX = 96  # enough for each schema's smallest object; the grammar ends the answer when the object is complete


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):  # flat, numbers with bounds
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=50_000_000)


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: City


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=24)
    address: Address


class Shopping(BaseModel):  # arrays
    items: list[str] = Field(min_length=1, max_length=3)
    counts: list[int] = Field(max_length=3)


class Paint(BaseModel):  # enums, both kinds
    colour: Colour
    finish: Literal["matte", "gloss"]


class Rating(BaseModel):  # optional fields and float bounds
    score: float = Field(ge=0.0, le=5.0)
    comment: str | None = Field(default=None, max_length=24)
    stars: int | None = Field(default=None, ge=1, le=5)


MODELS = [City, Person, Shopping, Paint, Rating]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


class WeatherArgs(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]


@pytest.fixture(scope="module")
def served(bankml_cmd, smollm2_path, smollm2_fork):
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "1024", "--config", "cpu")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url("/v1"), api_key="none", max_retries=0,
                         http_client=httpx.Client(timeout=600))


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _parse(client):
    # openai >= 1.92 has parse() on chat.completions; older ones only under beta
    return getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse


@pytest.mark.parametrize("schema", MODELS, ids=[m.__name__ for m in MODELS])
def test_parse_returns_an_object_that_validates(client, model, schema):
    answer = _parse(client)(model=model, temperature=0, max_tokens=MAX, response_format=schema, messages=[
        {"role": "user", "content": f"Give me an example {schema.__name__} as JSON."}])
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "stop"  # the grammar completed, not the length
    assert isinstance(message.parsed, schema)
    schema.model_validate_json(message.content)  # the text itself validates, not only the client's reading


def test_json_object_returns_parseable_json(client, model):
    # any object: nothing but the model bounds its length, so the prompt asks for a small one
    answer = client.chat.completions.create(model=model, temperature=0, max_tokens=256,
                                            response_format={"type": "json_object"},
                                            messages=[{"role": "user", "content": 'Reply with {"name": "Tom"}.'}])
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_a_gbnf_grammar_is_matched(client, model):
    gbnf = 'root ::= "The answer is " [0-9] [0-9]? "."'
    answer = client.chat.completions.create(model=model, temperature=0.8, seed=7, max_tokens=16,
                                            extra_body={"grammar": gbnf},
                                            messages=[{"role": "user", "content": "What is six times seven?"}])
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", answer.choices[0].message.content)


def test_ollama_format_schema_validates(served):
    client = ollama.Client(host=served.url(), timeout=600)
    answer = client.chat(model="smollm2-135m-instruct.q4_1", format=Paint.model_json_schema(),
                         options={"temperature": 0, "num_predict": MAX},
                         messages=[{"role": "user", "content": "Pick a paint for a kitchen."}])
    Paint.model_validate_json(answer.message.content)
    plain_json = client.chat(model="smollm2-135m-instruct.q4_1", format="json",  # any object: a small one asked
                             options={"temperature": 0, "num_predict": 256},
                             messages=[{"role": "user", "content": 'Reply with {"name": "Rex"}.'}])
    assert isinstance(json.loads(plain_json.message.content), dict)



def _required_call(client, model, **kw):
    return client.chat.completions.create(model=model, temperature=0, max_tokens=MAX, tools=[WEATHER],
                                          tool_choice="required", messages=ASK_WEATHER, **kw)


def test_a_required_tool_call_has_arguments_that_validate(client, model):
    answer = _required_call(client, model)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    try:
        WeatherArgs.model_validate_json(call.function.arguments)
    except ValidationError as e:  # pragma: no cover - the message names what was wrong
        pytest.fail(f"arguments {call.function.arguments!r}: {e}")


def test_a_round_trip_call_tool_result_final_answer(client, model):
    call = _required_call(client, model).choices[0].message.tool_calls[0]
    history = [*ASK_WEATHER,
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})}]
    final = client.chat.completions.create(model=model, temperature=0, max_tokens=32, tools=[WEATHER],
                                           tool_choice="none", messages=history)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content.strip()


def test_a_streamed_call_assembles_to_the_plain_one(client, model):
    plain = _required_call(client, model).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _required_call(client, model, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            if d.function is not None:
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == plain.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(plain.function.arguments)
    assert calls[0]["id"]


def test_ollama_tools_come_back_as_calls_and_go_back_in_the_history(served):
    client = ollama.Client(host=served.url(), timeout=600)
    name = "smollm2-135m-instruct.q4_1"
    answer = client.chat(model=name, tools=[WEATHER], messages=ASK_WEATHER,
                         options={"temperature": 0, "num_predict": MAX})
    if answer.message.tool_calls:  # Ollama has no tool_choice: the model may answer in words instead
        (call,) = answer.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
        assert answer.message.content == ""
    else:
        assert answer.message.content.strip() and not answer.message.content.lstrip().startswith("{")
    streamed = [c for c in client.chat(model=name, tools=[WEATHER], messages=ASK_WEATHER, stream=True,
                                       options={"temperature": 0, "num_predict": MAX})]
    assert [tc.function.name for c in streamed for tc in c.message.tool_calls or []] == \
        [tc.function.name for tc in answer.message.tool_calls or []]
    assert "".join(c.message.content or "" for c in streamed) == answer.message.content
    # the history a client sends back: its call (arguments an object), the tool's result by name
    history = [*ASK_WEATHER,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": '{"temperature_c": 18}'}]
    final = client.chat(model=name, tools=[WEATHER], messages=history, options={"temperature": 0, "num_predict": MAX})
    assert final.done and (final.message.content.strip() or final.message.tool_calls)
