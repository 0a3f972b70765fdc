"""OpenAI's Responses API (gateway/responses/) over the fake engine, through the real `openai` SDK: create
with a string and with items, the stream helper's final response the same as a plain create's, the raw
event sequence and its numbers, retrieve / delete / input_items, previous_response_id, store false, the
store's LRU bound, a thinking template's reasoning item and reasoning tokens, a failure mid-stream, and
the 400s and 404s in OpenAI's shape. The model-dependent checks (tools, text.format, the agents SDK,
the prefix cache) are in test_responses_smollm2.py."""

from __future__ import annotations

import hashlib
import json

import httpx
import openai
import pytest
from fake_engine import REPLY, REPLY_PIECES, THOUGHT
from gateway_helpers import FakeServer, tiny_model

pytestmark = pytest.mark.timeout(120)

# a template that thinks: Qwen3's shape, enable_thinking false gives an empty thought
THINKING_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("responses")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    d = tmp_path_factory.mktemp("responses_think")
    template = d / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    s = FakeServer(*tiny_model(d), flags=["--chat-template-file", str(template)])
    yield openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=60)
    s.stop()


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_a_string_input_answers_a_response_object_with_a_receipt(client):
    r = client.responses.create(model="any", input="Say hello.", metadata={"k": "v"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == REPLY
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.usage.output_tokens == len(REPLY_PIECES) and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.metadata, r.user, r.store, r.tool_choice, r.tools, r.parallel_tool_calls) == \
        ({"k": "v"}, "u1", True, "auto", [], True)
    receipt = r.model_extra["bankml_receipt"]
    assert receipt["signed"] is True and receipt["response_sha256"] == sha256(REPLY)
    assert receipt["completion_tokens"] == r.usage.output_tokens


def test_items_with_content_parts_and_instructions_are_the_prompt_input_tokens_counts(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour."}]},
             {"role": "user", "content": "Say hello."}]
    r = client.responses.create(model="any", input=items, instructions="Be brief.")
    assert r.output_text == REPLY and r.instructions == "Be brief."
    counted = client.responses.input_tokens.count(model="any", input=items, instructions="Be brief.")
    assert counted.object == "response.input_tokens" and counted.input_tokens == r.usage.input_tokens
    # the fake's tokens are bytes: the instructions' text and their system turn are in the prompt
    alone = client.responses.input_tokens.count(model="any", input=items).input_tokens
    assert counted.input_tokens - alone == len("<|im_start|>system\nBe brief.<|im_end|>\n")


def comparable(r: dict) -> dict:
    """A Response without what differs between two answers: ids, times, the receipt's clocks."""
    out = {k: v for k, v in r.items() if k not in ("id", "created_at", "completed_at", "bankml_receipt")}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in r["output"]]
    for item in out["output"]:
        for part in item.get("content") or []:
            part.pop("parsed", None)  # the stream helper's parsed text (None here)
    return out


def test_the_stream_helper_ends_with_what_a_plain_create_returns(client):
    plain = client.responses.create(model="any", input="Say hello.", temperature=0.5)
    with client.responses.stream(model="any", input="Say hello.", temperature=0.5) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == REPLY == final.output_text
    assert comparable(final.model_dump()) == comparable(plain.model_dump())
    assert final.model_extra["bankml_receipt"]["response_sha256"] == sha256(REPLY)


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.url("/v1/responses"), json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            head, data = block.split("\n", 1)  # every event names itself, as OpenAI's do
            events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(d["type"] == name for name, d in events)
    return events


def test_a_raw_stream_is_openais_event_sequence_numbered(server):
    events = raw_events(server, {"model": "any", "input": "Say hello."})
    names = [n for n, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(REPLY_PIECES),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    created, last = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and last["id"] == created["id"]
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0
               for n, d in events[3:-2] if n != "response.output_item.done")
    assert last["status"] == "completed" and last["output"][0]["content"][0]["text"] == REPLY
    assert last["bankml_receipt"]["response_sha256"] == sha256(REPLY)


def test_a_length_cut_is_incomplete_whole_and_streamed(client, server):
    r = client.responses.create(model="any", input="Say hello.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "".join(REPLY_PIECES[:3]) and r.max_output_tokens == 3
    assert r.output[0].status == "incomplete"
    events = raw_events(server, {"model": "any", "input": "Say hello.", "max_output_tokens": 3})
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failure_mid_stream_is_an_error_event(client, server):
    events = raw_events(server, {"model": "any", "input": "FAIL"})
    failed = events[-1][1]["response"]
    assert events[-2][0] == "error" and "failed on purpose" in events[-2][1]["message"]
    assert events[-1][0] == "response.failed" and failed["status"] == "failed"
    assert failed["error"]["code"] == "server_error" and "bankml_receipt" not in failed  # no receipt for a failure
    with client.responses.stream(model="any", input="FAIL") as stream:
        seen = [e for e in stream if e.type in ("error", "response.failed")]
        assert [e.type for e in seen] == ["error", "response.failed"]
        with pytest.raises(RuntimeError):
            stream.get_final_response()  # it never completed


def test_retrieve_input_items_and_delete(client):
    items = [{"role": "user", "content": f"Turn {i}"} for i in range(3)]
    r = client.responses.create(model="any", input=items)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    listed = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in listed.data] == ["Turn 2", "Turn 1", "Turn 0"]  # newest first
    assert listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id
    assert not listed.has_more
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Turn 0", "Turn 1"] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", limit=2, after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Turn 2"] and not rest.has_more
    # the SDK's auto-pagination walks the pages
    assert [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc", limit=1)] == \
        ["Turn 0", "Turn 1", "Turn 2"]
    deleted = httpx.delete(str(client.base_url) + f"responses/{r.id}", timeout=30)
    assert deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body == {"code": None, "message": f"Response with id '{r.id}' not found.",
                            "type": "invalid_request_error", "param": None}
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="any", input="My name is Ann.", instructions="Be brief.")
    second = client.responses.create(model="any", input="Say hello.", previous_response_id=first.id)
    alone = client.responses.input_tokens.count(model="any", input="Say hello.").input_tokens
    counted = client.responses.input_tokens.count(model="any", input="Say hello.", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.usage.input_tokens == counted.input_tokens
    # the first turn (its input and its answer; not its instructions, as OpenAI's) comes before the second
    turn = f"<|im_start|>user\nMy name is Ann.<|im_end|>\n<|im_start|>assistant\n{REPLY}<|im_end|>\n"
    assert counted.input_tokens - alone == len(turn.encode())
    # a third turn on the second carries both
    third = client.responses.create(model="any", input="Say hello.", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["Say hello."]


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="any", input="Say hello.", store=False)
    assert r.store is False and r.output_text == REPLY
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="any", input="Say hello.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["message"] == f"Previous response with id '{r.id}' not found."


def test_the_store_evicts_the_least_recently_used_past_its_bytes(tmp_path):
    s = FakeServer(*tiny_model(tmp_path), limits={"responses_store_bytes": 8_000})
    try:
        c = openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=60)
        first = c.responses.create(model="any", input="Say hello.")
        size = len(json.dumps([first.model_dump(exclude_unset=True)]))  # about a third of the bound
        assert 1_500 < size < 4_000  # with its input items: a third of the bound or more
        ids = [first.id]
        for _ in range(6):
            ids.append(c.responses.create(model="any", input="Say hello.").id)
            c.responses.retrieve(first.id)  # used: it stays while the others go
        c.responses.retrieve(first.id)
        c.responses.retrieve(ids[-1])
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[1])
    finally:
        s.stop()


def test_a_thinking_template_gives_a_reasoning_item_then_the_message(thinking):
    r = thinking.responses.create(model="any", input="THINK")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [THOUGHT] and r.output_text == REPLY
    # the thought's pieces: "<th", "ink>", "\nThe user", " greets me.", " I answer.", "\n</", "think>"
    assert r.usage.output_tokens_details.reasoning_tokens == 7
    assert r.model_extra["bankml_receipt"]["response_sha256"] == sha256(f"<think>\n{THOUGHT}\n</think>\n\n{REPLY}")
    with thinking.responses.stream(model="any", input="THINK") as stream:
        thought = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert thought == THOUGHT and comparable(final.model_dump()) == comparable(r.model_dump())
    none = thinking.responses.create(model="any", input="Say hello.", reasoning={"effort": "none"})
    assert none.reasoning.effort == "none" and none.usage.output_tokens_details.reasoning_tokens == 0
    low = thinking.responses.input_tokens.count(model="any", input="Say hello.", reasoning={"effort": "low"})
    # effort none renders the template's empty thought (enable_thinking false); low does not
    assert none.usage.input_tokens - low.input_tokens == len("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
])
def test_what_we_do_not_serve_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="any", **{"input": "Say hello.", **extra})
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert param.split("[")[0].split(".")[0] in body["message"]


def test_an_unknown_previous_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="any", input="Say hello.", previous_response_id="resp_nothing")
    assert e.value.status_code == 404 and e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="any", input="Say hello.", previous_response_id="resp_nothing")


WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_required_call_is_a_function_call_item_whole_and_streamed(client, server):
    r = client.responses.create(model="any", input="CALLTOOL", tools=[WEATHER], tool_choice="required")
    [call] = r.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == \
        ("function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tools[0].name == "get_weather" and r.tools[0].strict is True and r.tool_choice == "required"
    events = raw_events(server, {"model": "any", "input": "CALLTOOL", "tools": [WEATHER], "tool_choice": "required"})
    assert [n for n, _ in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                      "response.function_call_arguments.delta",
                                      "response.function_call_arguments.done", "response.output_item.done",
                                      "response.completed"]
    added, done = events[2][1]["item"], events[5][1]["item"]
    assert added["arguments"] == "" and added["status"] == "in_progress" and added["id"] == done["id"]
    assert json.loads(events[3][1]["delta"]) == {"city": "Paris"} == json.loads(done["arguments"])
    strict = {**WEATHER, "strict": True}  # the SDK parses the arguments of a strict tool
    with client.responses.stream(model="any", input="CALLTOOL", tools=[strict], tool_choice="required") as stream:
        final = stream.get_final_response()
    assert final.output[0].parsed_arguments == {"city": "Paris"} and final.output[0].name == "get_weather"


def test_a_function_call_output_continues_and_is_in_the_prompt(client):
    r = client.responses.create(model="any", input="CALLTOOL", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    call = r.output[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    second = client.responses.create(model="any", previous_response_id=r.id, input=[output], tools=[WEATHER],
                                     tool_choice="none")
    assert second.output_text == REPLY
    without = client.responses.input_tokens.count(model="any", previous_response_id=r.id, tools=[WEATHER],
                                                  tool_choice="none", input=[]).input_tokens
    # the first turn, then the tool's output as a turn of its own
    assert second.usage.input_tokens - without == len("<|im_start|>tool\nSunny, 21 C.<|im_end|>\n")
    assert [i.type for i in client.responses.input_items.list(second.id)] == ["function_call_output"]
