"""`POST /v1/chat/completions`: its request read as llama-server reads it, its answer written as llama-server
writes it; everything between is the answer pipeline (gateway/serving/answer.py).

- the body (off the loop) and `model` resolved (resolve.py: absent or empty, the startup model; a name
  that does not resolve, 404 unless the server has one model); a derived model's layer over the body;
- the fields (chat_request.parse_chat_request, with the model's sampling defaults): llama-server's 400s
  (and 500s) before any model work, then ours;
- on the leased model: `n` against the engine's sequences, the tools' plan and the prompt's tokens (the
  template's variables: chat_template_kwargs, reasoning_effort), and the thought's tags (reasoning.py);
- written (chat_writer.py, one `id` for the answer): one JSON body (`n` > 1: its choices by `index`,
  each with its own receipt), or SSE chunks as the pieces form (each choice's role delta first,
  held-back text never sent, as llama-server; a thinking template's thought as `reasoning_content`
  unless reasoning_format is none; with tools, content once it is sure to be and each call once whole,
  the calls parsed from the answer after the thought; `timings` on each with timings_per_token), each
  choice's receipt after its last chunk, then `[DONE]`. The receipt covers the model's text as
  generated: thought, tags, answer and call markup.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

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
from gateway.serving.reasoning import Reasoning, ThoughtStream, opened, split, thought_tags, thought_tokens
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
        tags = thought_tags(loaded.model.chat_template)
        thought = Thought(tags, tags is not None and opened(loaded.model.tokenizer, prompt, tags), chat.reasoning)
        writer = ChatWriter(completion, chat.timings_per_token, plan, chat.n, thought)
        return Work([prompt], chat.params, ids, writer, chat.stream, n=chat.n,
                    grammar=chat.grammar if plan is None else plan.grammar, n_ctx=n_ctx,
                    progress=chat.return_progress and chat.stream, id_slot=chat.id_slot, reasoning=chat.reasoning)

    return await answer(request, state, pin, FOREVER, work)  # spec §2: /v1 keeps its model forever


def _prompt(model, chat: ChatRequest) -> tuple[ToolPlan | None, list[int]]:
    """The tools' plan (gateway/serving/tool_calls.py: the template's messages and tools, the grammar of
    a call) and the prompt's tokens."""
    plan = tool_plan(chat.tools, chat.messages, model.chat_template, chat.response_schema)
    kwargs = chat.reasoning.template_kwargs() or None
    if plan is None:
        return None, model.prompt(chat.messages, chat.add_generation_prompt, None, kwargs, chat.continue_final)
    return plan, model.prompt(plan.messages, chat.add_generation_prompt, plan.template_tools, kwargs,
                              chat.continue_final)


@dataclass(frozen=True)
class Thought:
    """How an answer's thought is cut out: the template's tags (None: it does not think), whether the prompt
    opened it, and the request's reasoning_format (`reasoning.split`: none leaves it in the content;
    deepseek-legacy keeps it there too)."""

    tags: tuple[str, str] | None
    started: bool
    reasoning: Reasoning

    @property
    def cut(self) -> bool:
        return self.tags is not None and self.reasoning.split

    def tokens(self, pieces: list[str]) -> int | None:
        """usage's reasoning_tokens for an answer (its outputs' texts); None for a template that does not think."""
        return None if self.tags is None else thought_tokens(pieces, self.tags, self.started)

    def parts(self, text: str) -> tuple[str, str]:
        """The answer's (reasoning, content) as the choice shows them."""
        if not self.cut:
            return "", text
        thought, content = split(text, self.tags, self.started)
        return thought, text if self.reasoning.legacy else content


class ChatWriter:
    """A chat completion's answer (serving/answer.py `Writer`): `n` choices, with or without tools, a
    thinking template's thought cut out of each."""

    def __init__(self, completion: ChatCompletion, timed: bool, plan: ToolPlan | None, n: int,
                 thought: Thought | None = None):
        self.completion, self.timed, self.plan, self.n = completion, timed, plan, n
        self.thought = thought if thought is not None and thought.cut else None
        self.calls = [None if plan is None else ToolStream(plan) for _ in range(n)]  # deltas of content and calls
        self.thoughts = [None if self.thought is None else ThoughtStream(self.thought.tags, self.thought.started)
                         for _ in range(n)]
        self.pieces: list[list[str]] = [[] for _ in range(n)]  # each choice's outputs, for reasoning_tokens
        self.waiting: list[list[dict]] = [[] for _ in range(n)]  # logprob entries no chunk has carried yet
        self.opened = [False] * n

    async def whole(self, run: Run):
        c = self.completion
        done = await run.whole(lambda out: logprob_entry(out.logprobs))
        cut = [("", f.text) if self.thought is None else self.thought.parts(f.text) for f in done]
        parsed = [None if self.plan is None else parse_calls(self.plan, content) for _, content in cut]
        counted = None if self.thought is None else self.thought.tokens(done[0].pieces)
        if len(done) == 1:
            f = done[0]
            return json_response(c.body(cut[0][1], f.last, run.receipt(0, f.text, f.last, f.entries), f.entries,
                                        parsed[0], cut[0][0], counted))
        choices = []
        for j, f in enumerate(done):  # n > 1: each choice is an answer, with its own receipt
            choice = c.choice(j, cut[j][1], f.last, f.entries, parsed[j], cut[j][0])
            choice["bankml_receipt"] = run.receipt(j, f.text, f.last, f.entries)
            choices.append(choice)
        return json_response(c.body_of(choices, done[0].last, None, counted))

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
        calls, thoughts = self.calls[j], self.thoughts[j]
        if out.token is not None:
            self.pieces[j].append(out.text)
        if out.text and thoughts is not None:  # the thought as reasoning_content, the rest as below
            run.sent(j, out.text, entry)
            deltas = thoughts.feed(out.text)
            if self.thought.reasoning.legacy:  # deepseek-legacy: the content is the text as generated
                deltas = [(k, d) for k, d in deltas if k == "reasoning"] + [("content", out.text)]
            waiting = self.waiting[j] + (entry or [])  # entries of tokens whose text is held (a tag)
            self.waiting[j] = await self._send(response, j, out, deltas, waiting or None, calls) or []
        elif out.text and calls is not None:  # tools: content once it is sure to be, calls once whole
            run.sent(j, out.text)
            for kind, delta in calls.feed(out.text):
                await response.send(c.delta_chunk(kind, delta, j, out if timed else None))
        elif out.text:
            await response.send(c.chunk(out.text, entry, j, out if timed else None))
            run.sent(j, out.text, entry)

    async def _send(self, response, j: int, out: StepOutput, deltas: list[tuple[str, str]], entries: list | None,
                    calls: ToolStream | None) -> list | None:
        """A thinking answer's deltas: the thought's as they are, the content's through the tools' stream;
        the logprob entries ride on the first chunk. What no chunk carried is returned."""
        timed = out if self.timed else None
        for kind, delta in deltas:
            pieces = calls.feed(delta) if kind == "content" and calls is not None else [(kind, delta)]
            for k, d in pieces:
                await response.send(self.completion.delta_chunk(k, d, j, timed, entries))
                entries = None
        return entries

    async def last(self, response, run: Run, j: int, out: StepOutput, receipt: dict) -> None:
        c, timed = self.completion, self.timed
        finish = None
        if self.thoughts[j] is not None and not self.thought.reasoning.legacy:
            await self._send(response, j, out, self.thoughts[j].finish(), self.waiting[j] or None, self.calls[j])
        if self.calls[j] is not None:
            deltas, parsed = self.calls[j].finish()
            for kind, delta in deltas:
                await response.send(c.delta_chunk(kind, delta, j, out if timed else None))
            finish = finish_reason(out, parsed)
        counted = None if self.thought is None else self.thought.tokens(self.pieces[j])
        await response.send(c.final_chunks(out, j, finish, counted))
        await response.send(c.receipt_chunk(receipt, out, None if self.n == 1 else j, counted))

    async def failed(self, response, error: Exception) -> None:
        await response.send(stream_error(error))

    async def close(self, response) -> None:
        await response.send(DONE_EVENT)
