"""`POST /v1/messages`: the answer written in Anthropic's shapes (the request is read by request.py).

The model's text is cut into content blocks: its thought (reasoning.py's tags) a `thinking` block, the
rest a `text` block, and with tools the calls parsed out of it (tool_calls.py) `tool_use` blocks, in
that order. A whole answer is one `message` object; a stream is Anthropic's events:

    message_start (usage: the prompt's tokens), ping (and one per prefill chunk of a long prompt)
    content_block_start / content_block_delta (thinking_delta, then signature_delta; text_delta;
        input_json_delta, one per call, whole) / content_block_stop, per block
    message_delta (stop_reason, stop_sequence, usage, and bankml_receipt), message_stop

so the SDK's stream helper accumulates the same message a plain call returns. The receipt rides as a
top-level `bankml_receipt` of the message, and of the stream's `message_delta` (a field the SDK keeps
on the event). Its `response_sha256` covers the model's text as it wrote it (the thought with its tags,
a call's JSON), before it is cut into blocks. A `thinking` block's `signature` is the sha256 of its
text: the receipt is what signs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from bankml import jstr
from gateway.http.errors import Api, error_body, json_response
from gateway.serving.answer import Run, open_sse
from gateway.serving.reasoning import ThoughtStream, split
from gateway.serving.tool_calls import Parsed, ToolPlan, ToolStream
from gateway.serving.tool_calls import parse as parse_calls
from model.messages import FinishReason, StepOutput


def usage(out: StepOutput) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt's tokens the prefix cache did not serve (its
    `cache_read_input_tokens`); nothing is written to a cache on request, so creation is 0."""
    cached = min(out.cached_tokens, out.prompt_tokens)
    return {"input_tokens": out.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": out.completion_tokens}


def stop_reason(last: StepOutput, parsed: Parsed | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the limit, the calls, a stop sequence, or the model's own end."""
    if last.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if parsed is not None and parsed.calls:
        return "tool_use", None
    if last.stop_type == "word" and last.stopping_word:
        return "stop_sequence", last.stopping_word
    return "end_turn", None


def signature(thought: str) -> str:
    return hashlib.sha256(thought.encode("utf-8", "replace")).hexdigest()


def tool_use(call: dict) -> dict:
    """An OpenAI tool call as Anthropic's tool_use block (its `input` an object)."""
    fn = call["function"]
    try:
        value = json.loads(fn["arguments"])
    except ValueError:
        value = fn["arguments"]
    return {"type": "tool_use", "id": "toolu_" + call["id"], "name": fn["name"],
            "input": value if isinstance(value, dict) else {"value": value}}


@dataclass(frozen=True)
class Cut:
    """How one answer's text is cut into blocks: the thought's tags (None: no thought is split), whether the
    prompt opened the thought, and the tools' plan."""

    tags: tuple[str, str] | None
    started: bool
    plan: ToolPlan | None
    omit_thought: bool = False  # thinking.display "omitted": the thinking block's text is empty

    def blocks(self, text: str) -> tuple[list[dict], Parsed | None]:
        thought, content = split(text, self.tags, self.started)
        out: list[dict] = []
        if thought:
            out.append({"type": "thinking", "thinking": "" if self.omit_thought else thought,
                        "signature": signature(thought)})
        parsed = None if self.plan is None else parse_calls(self.plan, content)
        if parsed is not None:
            content = parsed.content or ""
        if content:
            out.append({"type": "text", "text": content})
        for call in parsed.calls if parsed is not None else ():
            out.append(tool_use(call))
        return out, parsed


@dataclass(frozen=True)
class Message:
    """One message's constants."""

    id: str  # "msg_<hex>"
    model: str

    def head(self, content: list[dict], stop: str | None, stop_sequence: str | None, use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": stop_sequence, "stop_details": None, "usage": use}


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + jstr.dumps({"type": kind, **data}).encode("utf-8") + b"\n\n"


PING = event("ping", {})


class MessagesWriter:
    """A /v1/messages answer (serving/answer.py `Writer`): one message, or its events."""

    def __init__(self, message: Message, cut: Cut, prompt_n: int):
        self.message, self.cut, self.prompt_n = message, cut, prompt_n
        self.thoughts = None if cut.tags is None else ThoughtStream(cut.tags, cut.started)
        self.calls = None if cut.plan is None else ToolStream(cut.plan)
        self.started = False
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's type
        self.thought: list[str] = []  # the thought's text as sent
        self.thought_ws = ""  # whitespace at the thought's end so far: sent only if more thought follows

    async def whole(self, run: Run):
        f = (await run.whole())[0]
        blocks, parsed = self.cut.blocks(f.text)
        stop, sequence = stop_reason(f.last, parsed)
        body = self.message.head(blocks, stop, sequence, usage(f.last))
        body["bankml_receipt"] = run.receipt(0, f.text, f.last)  # over the text as the model wrote it
        return json_response(jstr.dumps(body))

    async def open(self, request):
        return await open_sse(request)

    async def output(self, response, run: Run, i: int, out: StepOutput) -> None:
        if not self.started:  # the head: the prompt's tokens (a progress output says what was cached)
            self.started = True
            first = out
            if out.progress is not None:
                first = StepOutput(None, prompt_tokens=out.progress.total, cached_tokens=out.progress.cache)
            elif not out.prompt_tokens:
                first = StepOutput(None, prompt_tokens=self.prompt_n)
            use = {**usage(first), "output_tokens": 0}
            await response.send(event("message_start", {"message": self.message.head([], None, None, use)}) + PING)
            if out.progress is not None:
                return
        if out.progress is not None:  # a long prompt's prefill goes on: the client hears from us
            await response.send(PING)
            return
        if out.text:
            run.sent(i, out.text)
            await self._pieces(response, out.text)

    async def _pieces(self, response, text: str) -> None:
        parts = self.thoughts.feed(text) if self.thoughts is not None else [("content", text)]
        for kind, delta in parts:
            if kind == "reasoning":
                await self._delta(response, "thinking", delta)
            else:
                await self._content(response, self.calls.feed(delta) if self.calls is not None else [("content", delta)])

    async def _content(self, response, deltas: list[tuple[str, Any]]) -> None:
        for kind, delta in deltas:
            if kind == "content":
                await self._delta(response, "text", delta)
            else:
                await self._call(response, delta)

    async def _delta(self, response, kind: str, text: str) -> None:
        if kind == "thinking":  # the thought stripped, as `split` strips it: edge whitespace waits
            if not self.thought:
                text = text.lstrip()
            text = self.thought_ws + text
            body = text.rstrip()
            self.thought_ws, text = text[len(body):], body
        if not text:
            return
        if self.kind != kind:
            await self._start(response, kind, {"type": "thinking", "thinking": "", "signature": ""}
                              if kind == "thinking" else {"type": "text", "text": ""})
        if kind == "thinking":
            self.thought.append(text)
            if self.cut.omit_thought:
                return  # the block opens and closes with its signature, its text never sent
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        await response.send(event("content_block_delta", {"index": self.index, "delta": delta}))

    async def _call(self, response, call: dict) -> None:
        block = tool_use(call)
        await self._start(response, "tool_use", {**block, "input": {}})
        partial = json.dumps(block["input"], ensure_ascii=False)
        await response.send(event("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": partial}}))
        await self._stop(response)

    async def _start(self, response, kind: str, block: dict) -> None:
        await self._stop(response)
        self.index += 1
        self.kind = kind
        await response.send(event("content_block_start", {"index": self.index, "content_block": block}))

    async def _stop(self, response) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            await response.send(event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": signature("".join(self.thought))}}))
        await response.send(event("content_block_stop", {"index": self.index}))
        self.kind = None

    async def last(self, response, run: Run, i: int, out: StepOutput, receipt: dict) -> None:
        for kind, delta in self.thoughts.finish() if self.thoughts is not None else ():
            if kind == "reasoning":
                await self._delta(response, "thinking", delta)
            elif self.calls is not None:
                await self._content(response, self.calls.feed(delta))
            else:
                await self._delta(response, "text", delta)
        parsed = None
        if self.calls is not None:
            deltas, parsed = self.calls.finish()
            await self._content(response, deltas)
        await self._stop(response)
        stop, sequence = stop_reason(out, parsed)
        await response.send(event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": sequence,
                                                               "stop_details": None},
                                                     "usage": usage(out), "bankml_receipt": receipt}))
        await response.send(event("message_stop", {}))

    async def failed(self, response, error: Exception) -> None:
        # after the head: Anthropic's error event (its SDK raises it), then the stream ends
        await response.send(f"event: error\ndata: {error_body(error, Api.ANTHROPIC)}\n\n".encode())

    async def close(self, response) -> None:
        return None
