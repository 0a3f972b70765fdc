"""`POST /v1/chat/completions`: its request read as llama-server reads it, its answer written as llama-server
writes it; everything between is the answer pipeline (gateway/serving/answer.py).

- the body (off the loop) and `model` resolved (resolve.py: absent or empty, the startup model; a name
  that does not resolve, 404 unless the server has one model); a derived model's layer over the body;
- the fields (chat_request.parse_chat_request, with the model's sampling defaults): llama-server's 400s
  (and 500s) before any model work, then ours;
- on the leased model: `n` against the engine's sequences, the tools' plan and the prompt's tokens;
- written (chat_writer.py, one `id` for the answer): one JSON body (`n` > 1: its choices by `index`,
  each with its own receipt), or SSE chunks as the pieces form (each choice's role delta first,
  held-back text never sent, as llama-server; with tools, content once it is sure to be and each call
  once whole; `timings` on each with timings_per_token), each choice's receipt after its last chunk,
  then `[DONE]`.
"""

from __future__ import annotations

import time
import uuid

from gateway.http.body import parse_body
from gateway.http.errors import json_response, stream_error
from gateway.openai.chat_request import ChatRequest, parse_chat_request
from gateway.openai.chat_writer import (
    DONE_EVENT,
    ChatCompletion,
    finish_reason,
    logprob_entry,
)
from gateway.openai.completion_request import N_UNBOUNDED, check_n
from gateway.openai.resolve import resolve_for, shown_name
from gateway.serving.answer import Run, Work, answer, off_loop, open_sse
from gateway.serving.request_fields import gguf_defaults
from gateway.serving.residency import FOREVER
from gateway.serving.tool_calls import ToolPlan, ToolStream
from gateway.serving.tool_calls import parse as parse_calls
from gateway.serving.tool_calls import plan as tool_plan
from model.messages import StepOutput


async def chat_completions(request, state):
    doc = await off_loop(parse_body, request.body)  # a 16 MiB body takes a while to parse
    resolved, doc, n_ctx = resolve_for(state, doc, by_name=True)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    chat = await off_loop(parse_chat_request, doc, defaults, N_UNBOUNDED)

    async def work(held) -> Work:
        loaded = held.loaded
        check_n(chat.n, loaded.client.max_seqs)
        plan, prompt = await off_loop(_prompt, loaded.model, chat)
        completion = ChatCompletion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), shown_name(loaded, resolved),
                                    include_usage=chat.include_usage)
        ids = [completion.id] if chat.n == 1 else [f"{completion.id}-{j}" for j in range(chat.n)]
        return Work([prompt], chat.params, ids, ChatWriter(completion, chat.timings_per_token, plan, chat.n),
                    chat.stream, n=chat.n, grammar=chat.grammar if plan is None else plan.grammar, n_ctx=n_ctx,
                    progress=chat.return_progress and chat.stream, id_slot=chat.id_slot)

    return await answer(request, state, pin, FOREVER, work)  # spec §2: /v1 keeps its model forever


def _prompt(model, chat: ChatRequest) -> tuple[ToolPlan | None, list[int]]:
    """The tools' plan (gateway/serving/tool_calls.py: the template's messages and tools, the grammar of
    a call) and the prompt's tokens."""
    plan = tool_plan(chat.tools, chat.messages, model.chat_template, chat.response_schema)
    if plan is None:
        return None, model.prompt(chat.messages, chat.add_generation_prompt)
    return plan, model.prompt(plan.messages, chat.add_generation_prompt, plan.template_tools)


class ChatWriter:
    """A chat completion's answer (serving/answer.py `Writer`): `n` choices, with or without tools."""

    def __init__(self, completion: ChatCompletion, timed: bool, plan: ToolPlan | None, n: int):
        self.completion, self.timed, self.plan, self.n = completion, timed, plan, n
        self.calls = [None if plan is None else ToolStream(plan) for _ in range(n)]  # deltas of content and calls
        self.opened = [False] * n

    async def whole(self, run: Run):
        c = self.completion
        done = await run.whole(lambda out: logprob_entry(out.logprobs))
        parsed = [None if self.plan is None else parse_calls(self.plan, f.text) for f in done]
        if len(done) == 1:
            f = done[0]
            return json_response(c.body(f.text, f.last, run.receipt(0, f.text, f.last, f.entries), f.entries,
                                        parsed[0]))
        choices = []
        for j, f in enumerate(done):  # n > 1: each choice is an answer, with its own receipt
            choice = c.choice(j, f.text, f.last, f.entries, parsed[j])
            choice["bankml_receipt"] = run.receipt(j, f.text, f.last, f.entries)
            choices.append(choice)
        return json_response(c.body_of(choices, done[0].last, None))

    async def open(self, request):
        return await open_sse(request)

    async def output(self, response, run: Run, j: int, out: StepOutput) -> None:
        c, timed = self.completion, self.timed
        entry = [logprob_entry(out.logprobs)] if out.logprobs is not None else None
        if out.progress is not None:  # return_progress: a role delta with the prompt's progress (b11434)
            await response.send(c.progress_chunk(j, out.progress.to_json()))
            return
        if not self.opened[j]:
            self.opened[j] = True
            # the role delta opens the choice; the first token's entry rides on it when it has no text
            rides = entry if entry is not None and not out.text else None
            await response.send(c.chunk(None, rides, j, out if timed and not out.text else None))
            if rides:
                run.sent(j, "", rides)
                entry = None
        calls = self.calls[j]
        if out.text and calls is not None:  # tools: content once it is sure to be, calls once whole
            run.sent(j, out.text)
            for kind, delta in calls.feed(out.text):
                await response.send(c.delta_chunk(kind, delta, j, out if timed else None))
        elif out.text:
            await response.send(c.chunk(out.text, entry, j, out if timed else None))
            run.sent(j, out.text, entry)

    async def last(self, response, run: Run, j: int, out: StepOutput, receipt: dict) -> None:
        c, timed = self.completion, self.timed
        finish = None
        if self.calls[j] is not None:
            deltas, parsed = self.calls[j].finish()
            for kind, delta in deltas:
                await response.send(c.delta_chunk(kind, delta, j, out if timed else None))
            finish = finish_reason(out, parsed)
        await response.send(c.final_chunks(out, j, finish))
        await response.send(c.receipt_chunk(receipt, out, None if self.n == 1 else j))

    async def failed(self, response, error: Exception) -> None:
        await response.send(stream_error(error))

    async def close(self, response) -> None:
        await response.send(DONE_EVENT)
