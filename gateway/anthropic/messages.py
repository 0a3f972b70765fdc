"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, a dialect on the
one answer pipeline (gateway/serving/answer.py).

- the body (off the loop), checked as Anthropic checks it and written as our chat body (request.py);
  `model` resolved as on /v1/chat/completions (resolve.py), a derived model's layer over it; the chat
  body read by the chat parser (its sampler fields, stop strings, tools and history checks, once);
- on the leased model: the tools' plan, the template's variables (`thinking`), the prompt's tokens, and
  how its text will be cut into blocks (writer.Cut: the thought's tags, the calls);
- written (writer.py): one message, or Anthropic's SSE events, the receipt in both.
count_tokens builds the same prompt (`_prompt`), so its count is what the create prompts:
`usage.input_tokens + usage.cache_read_input_tokens` of the same create.
"""

from __future__ import annotations

import uuid

from bankml import jstr
from gateway.anthropic.request import MessagesRequest, read_messages_request
from gateway.anthropic.writer import Cut, Message, MessagesWriter
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.sanic_app import takes_query
from gateway.openai.chat_request import ChatRequest, parse_chat_request
from gateway.openai.resolve import resolve_for, shown_name
from gateway.serving.answer import Work, answer, off_loop
from gateway.serving.reasoning import TAGS, opened, thought_tags
from gateway.serving.request_fields import gguf_defaults
from gateway.serving.residency import FOREVER
from gateway.serving.tool_calls import plan as tool_plan


async def _read(request, state, count: bool) -> tuple[MessagesRequest, ChatRequest, object, int | None]:
    doc = await off_loop(parse_body, request.body)
    req = await off_loop(read_messages_request, doc, count)
    resolved, body, n_ctx = resolve_for(state, req.chat_body, by_name=True)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    chat = await off_loop(parse_chat_request, body, defaults, 1)
    shift = len(chat.messages) - len(req.thoughts)  # a derived model's layer may put its system first
    for i, thought in enumerate(req.thoughts):
        if thought is not None:
            chat.messages[i + shift]["reasoning_content"] = thought
    return req, chat, resolved, n_ctx


@takes_query  # the SDK's beta client asks /v1/messages?beta=true
async def create(request, state):
    req, chat, resolved, n_ctx = await _read(request, state, count=False)

    async def work(held) -> Work:
        loaded = held.loaded
        prompt, cut = await off_loop(_prompt, loaded.model, chat, req)
        message = Message(f"msg_{uuid.uuid4().hex}", shown_name(loaded, resolved))
        writer = MessagesWriter(message, cut, len(prompt))
        return Work([prompt], chat.params, [message.id], writer, req.stream,
                    grammar=None if cut.plan is None else cut.plan.grammar, n_ctx=n_ctx, progress=req.stream,
                    reasoning=req.reasoning)

    return await answer(request, state, resolved.pin, FOREVER, work)  # /v1 keeps its model forever


@takes_query
async def count_tokens(request, state):
    """`{"input_tokens": N}`: the tokens of the prompt the same create would send."""
    req, chat, resolved, _ = await _read(request, state, count=True)
    residency = state.residency
    try:
        async with residency.lease(resolved.pin) as held:
            prompt, _ = await off_loop(_prompt, held.loaded.model, chat, req)
    finally:
        residency.touch(resolved.pin.name, FOREVER)
    return json_response(jstr.dumps({"input_tokens": len(prompt)}))


def _prompt(model, chat: ChatRequest, req: MessagesRequest) -> tuple[list[int], Cut]:
    """The prompt's tokens (the tools' plan, the template's variables), and how the answer will be cut."""
    plan = tool_plan(chat.tools, chat.messages, model.chat_template)
    messages, tools = (chat.messages, None) if plan is None else (plan.messages, plan.template_tools)
    kwargs = req.reasoning.template_kwargs() or None
    prompt = model.prompt(messages, chat.add_generation_prompt, tools, kwargs, chat.continue_final)  # a prefill
    # the thought's tags: the template's, or <think> when the request asks for thinking on one that names none
    tags = thought_tags(model.chat_template) or (TAGS[0] if req.thinking else None)
    return prompt, Cut(tags, opened(model.tokenizer, prompt, tags), plan, req.omit_thought)
