"""OpenAI's Responses API on the answer pipeline (gateway/serving/answer.py):

- `POST /v1/responses` (and `/responses`): the body (request.py) and `model` resolved as chat resolves it;
  a `previous_response_id` puts that response's conversation (store.py) before this input; on the leased
  model the tools' plan, the prompt (the template with the thought's variables), then the answer, whole
  or streamed (writer.py); a `store: true` answer is kept;
- `GET` / `DELETE /v1/responses/{id}`: the kept response, or its deletion (`{"id", "object":
  "response.deleted", "deleted": true}`); `GET /v1/responses/{id}/input_items`: its input items, a
  cursor page (`after`, `limit` 1 to 100, default 20, `order` desc by default);
- `POST /v1/responses/input_tokens`: the prompt the same create would send, counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bankml import jstr
from bankml.errors import InvalidRequest
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.sanic_app import query_of, takes_query
from gateway.openai.resolve import resolve_for, shown_name
from gateway.responses.request import ResponsesRequest, messages_of, new_id, parse_responses
from gateway.responses.store import ResponseStore
from gateway.responses.writer import ResponsesWriter, Shape
from gateway.serving.answer import Work, answer, off_loop
from gateway.serving.reasoning import opened, thought_tags
from gateway.serving.request_fields import gguf_defaults
from gateway.serving.residency import FOREVER
from gateway.serving.tool_calls import ToolPlan
from gateway.serving.tool_calls import plan as tool_plan


def store_of(state) -> ResponseStore:
    return state.responses


@dataclass
class Prompt:
    plan: ToolPlan | None
    ids: list[int]
    tags: tuple[str, str] | None
    started: bool


async def _read(request, state) -> tuple[Any, ResponsesRequest, list[dict], int | None]:
    """The body read, its model resolved, and the conversation before this input."""
    doc = await off_loop(parse_body, request.body)
    resolved, doc, n_ctx = resolve_for(state, doc, by_name=True)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    req = await off_loop(parse_responses, doc, defaults)
    before: list[dict] = []
    if req.previous_response_id is not None:
        before = store_of(state).get(req.previous_response_id, "previous_response_id").conversation
    return resolved, req, before, n_ctx


def build_prompt(model, req: ResponsesRequest, before: list[dict]) -> Prompt:
    """The tools' plan and the prompt's tokens, as create sends them (and input_tokens counts them)."""
    messages = messages_of(req.instructions, before + req.input_items)
    plan = tool_plan(req.tools, messages, model.chat_template, req.text_schema)
    msgs, tools = (messages, None) if plan is None else (plan.messages, plan.template_tools)
    ids = model.prompt(msgs, True, tools, req.reasoning.template_kwargs() or None)
    tags = thought_tags(model.chat_template)
    return Prompt(plan, ids, tags, tags is not None and opened(model.tokenizer, ids, tags))


async def create(request, state):
    resolved, req, before, n_ctx = await _read(request, state)
    store = store_of(state)

    async def work(held) -> Work:
        loaded = held.loaded
        prompt = await off_loop(build_prompt, loaded.model, req, before)
        shape = Shape(new_id("resp"), int(time.time()), shown_name(loaded, resolved), req, prompt.plan, prompt.tags,
                      prompt.started)

        def keep(body: dict, output: list[dict]) -> None:
            if req.store:
                store.put(body, req.input_items, before + req.input_items + output)

        grammar = req.grammar if prompt.plan is None else prompt.plan.grammar
        return Work([prompt.ids], req.params, [shape.id], ResponsesWriter(shape, keep), req.stream, grammar=grammar,
                    n_ctx=n_ctx, reasoning=req.reasoning)

    return await answer(request, state, resolved.pin, FOREVER, work)


async def input_tokens(request, state):
    resolved, req, before, _ = await _read(request, state)
    residency = state.residency
    try:
        async with residency.lease(resolved.pin) as held:
            prompt = await off_loop(build_prompt, held.loaded.model, req, before)
    finally:
        residency.touch(resolved.pin.name, FOREVER)
    return json_response(jstr.dumps({"object": "response.input_tokens", "input_tokens": len(prompt.ids)}))


def _id_in(request, tail: str = "") -> str:
    path = request.raw_url.decode("latin-1").partition("?")[0].removesuffix(tail)
    return path.rpartition("/")[2]


@takes_query
async def retrieve(request, state):
    return json_response(jstr.dumps(store_of(state).get(_id_in(request)).response))


async def delete(request, state):
    response_id = _id_in(request)
    store = store_of(state)
    store.get(response_id)  # a 404 when it is not kept
    store.drop(response_id)
    return json_response(jstr.dumps({"id": response_id, "object": "response.deleted", "deleted": True}))


@takes_query
async def input_items(request, state):
    stored = store_of(state).get(_id_in(request, "/input_items"))
    query = query_of(request)

    def one(key: str, default: str | None) -> str | None:
        values = query.get(key)
        return values[-1] if values else default

    order = one("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"Invalid value for 'order': '{order}' (asc or desc).", param="order",
                             code="invalid_value")
    limit_text = one("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise InvalidRequest(f"Invalid value for 'limit': '{limit_text}' (1 to 100).", param="limit",
                             code="invalid_value")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = one("after", None)
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise InvalidRequest(f"Invalid value for 'after': no input item '{after}' in this response.",
                                 param="after", code="invalid_value")
        items = items[at + 1:]
    page = items[:int(limit_text)]
    return json_response(jstr.dumps({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                     "last_id": page[-1]["id"] if page else None,
                                     "has_more": len(items) > len(page)}))
