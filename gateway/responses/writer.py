"""`POST /v1/responses`: the answer written as OpenAI's Response object, whole or as its SSE events.

The model's text is read in two steps: the thought apart from the answer (gateway/serving/reasoning.py,
for a template that thinks), then the answer's tool calls (gateway/serving/tool_calls.py, when the request
has tools). That gives the output items, in order: a `reasoning` item (its `content` the thought as
`reasoning_text`; no summary), a `message` (one `output_text` part, `annotations: []`) unless the answer
is only calls, then one `function_call` item per call (`call_id` `call_...`, `arguments` JSON text).

Streamed: `response.created`, `response.in_progress`, then per item `response.output_item.added`, its
part (`response.content_part.added`), its deltas (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`s,
`response.content_part.done`, `response.output_item.done`; last `response.completed` (or
`response.incomplete` when the answer was cut at max_output_tokens), whose `response` is the object a
plain create returns. Every event has its `sequence_number`; an error after the head is an `error`
event. Text is sent once it is sure to be reasoning, content or a call (a partial tag is held back).

The receipt (`bankml_receipt`, in the object and in the last event's `response`) covers the text as the
model generated it (thought, tags and call JSON included), before it is split into items.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bankml import jstr
from bankml.errors import BankmlError
from gateway.http.errors import json_response, status_of
from gateway.responses.request import ResponsesRequest, new_id
from gateway.serving.answer import Run, open_sse
from gateway.serving.engine_client import engine_error
from gateway.serving.generation import outputs
from gateway.serving.reasoning import ThoughtStream, split
from gateway.serving.tool_calls import Parsed, ToolPlan, ToolStream
from gateway.serving.tool_calls import parse as parse_calls
from model.messages import FinishReason, StepOutput


@dataclass
class Shape:
    """One response's constants: its id, model, the request's echoed fields, and what its text means."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest
    plan: ToolPlan | None
    tags: tuple[str, str] | None  # the template's thought tags (None: it does not think)
    started: bool  # the prompt opened the thought

    def body(self, status: str, output: list[dict], last: StepOutput | None, reasoning_tokens: int = 0,
             receipt: dict | None = None) -> dict:
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "max_tool_calls": None, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.effort, "summary": None}, "service_tier": "default", "store": r.store,
            "temperature": r.params.temperature, "text": r.text, "tool_choice": r.tool_choice,
            "tools": r.tools_echo, "top_logprobs": 0, "top_p": r.params.top_p, "truncation": "disabled",
            "usage": None if last is None else usage(last, reasoning_tokens),
            "user": r.echoed.get("user"), "metadata": r.echoed.get("metadata") or {},
        }
        if last is not None:
            out["completed_at"] = int(time.time()) if status == "completed" else None
        if receipt is not None:
            out["bankml_receipt"] = receipt
        return out

    def thought_raw(self, text: str) -> str:
        """The part of the generated text that is the thought, tags included ("" when there is none)."""
        if self.tags is None:
            return ""
        thought, _ = split(text, self.tags, self.started)
        if not thought and not (self.started or text.lstrip().startswith(self.tags[0])):
            return ""
        end = text.find(self.tags[1])
        return text if end < 0 else text[:end + len(self.tags[1])]

    def items(self, text: str, last: StepOutput) -> list[dict]:
        """A whole answer's output items."""
        status = self.status(last)
        thought, content = split(text, self.tags, self.started) if self.tags is not None else ("", text)
        out = []
        if thought:
            out.append(reasoning_item(new_id("rs"), thought))
        parsed: Parsed | None = parse_calls(self.plan, content) if self.plan is not None else None
        message = parsed.content if parsed is not None else content
        calls = parsed.calls if parsed is not None else []
        if message or not calls:
            out.append(message_item(new_id("msg"), message or "", status))
        out += [call_item(new_id("fc"), c) for c in calls]
        return out

    def status(self, last: StepOutput) -> str:
        return "incomplete" if last.finish_reason is FinishReason.LENGTH else "completed"


def usage(last: StepOutput, reasoning_tokens: int) -> dict:
    return {"input_tokens": last.prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": last.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def thought_tokens(pieces: list[str], thought_chars: int) -> int:
    """The engine's outputs (a token each) that began inside the thought's first `thought_chars`."""
    n, at = 0, 0
    for piece in pieces:
        if at >= thought_chars:
            break
        n += 1
        at += len(piece)
    return n


def reasoning_item(item_id: str, text: str | None) -> dict:
    item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
    if text is not None:
        item["content"] = [{"type": "reasoning_text", "text": text}]
    return item


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}]
    return {"id": item_id, "type": "message", "status": status, "content": content, "role": "assistant"}


def call_item(item_id: str, call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    fn = call["function"]
    return {"id": item_id, "type": "function_call", "status": status,
            "arguments": fn["arguments"] if arguments is None else arguments,
            "call_id": f"call_{call['id']}", "name": fn["name"]}


@dataclass
class ResponsesWriter:
    """The Responses answer (serving/answer.py `Writer`); `keep(response_dict, output_items)` stores it."""

    shape: Shape
    keep: Any
    seq: int = 0
    items: list[dict] = field(default_factory=list)  # the items done, in order
    open_item: dict | None = None  # the item being streamed
    raw: str = ""  # the generated text so far
    pieces_seen: list[str] = field(default_factory=list)  # its pieces, an output each
    thoughts: ThoughtStream | None = None
    calls: ToolStream | None = None

    def __post_init__(self) -> None:
        self.thoughts = ThoughtStream(self.shape.tags, self.shape.started) if self.shape.tags is not None else None
        self.calls = ToolStream(self.shape.plan) if self.shape.plan is not None else None

    # --- whole ---------------------------------------------------------------------------------------

    async def whole(self, run: Run):
        """The sequence read to its end (as generation.whole reads it, each output's text kept: the
        thought's tokens are counted from them), its metrics record and receipt, the Response object."""
        pieces, last = [], None
        async with outputs(run.loaded, run.requests) as stream:
            async for _, out in stream:
                if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    raise engine_error(run.loaded.client, out)
                pieces.append(out.text)
                last = out
        text = "".join(pieces) + last.held_text  # what was held back at the end too, as a whole answer keeps it
        run.sent(0, text)
        receipt = run.finished(0, last)
        items = self.shape.items(text, last)
        body = self.shape.body(self.shape.status(last), items, last,
                               thought_tokens(pieces, len(self.shape.thought_raw(text))), receipt)
        self.keep(body, items)
        return json_response(jstr.dumps(body))

    # --- streamed ------------------------------------------------------------------------------------

    async def open(self, request):
        response = await open_sse(request)
        head = self.shape.body("in_progress", [], None)
        await response.send(self.event("response.created", response=head) +
                            self.event("response.in_progress", response=head))
        return response

    async def output(self, response, run: Run, i: int, out: StepOutput) -> None:
        if not out.text:
            return
        run.sent(i, out.text)
        self.raw += out.text
        self.pieces_seen.append(out.text)
        pieces = self.thoughts.feed(out.text) if self.thoughts is not None else [("content", out.text)]
        await response.send(self.pieces(pieces))

    async def last(self, response, run: Run, i: int, out: StepOutput, receipt: dict) -> None:
        status = self.shape.status(out)
        events = self.pieces(self.thoughts.finish() if self.thoughts is not None else [], final=True)
        if self.open_item is None and not any(item["type"] != "reasoning" for item in self.items):
            events += self.open_text("message")  # an answer of nothing: an empty message, as a whole one has
        events += self.close_item(status)
        reasoning_tokens = thought_tokens(self.pieces_seen, len(self.shape.thought_raw(self.raw)))
        body = self.shape.body(status, self.items, out, reasoning_tokens, receipt)
        self.keep(body, self.items)
        events += self.event("response.completed" if status == "completed" else "response.incomplete",
                             response=body)
        await response.send(events)

    async def failed(self, response, error: Exception) -> None:
        """The error event, then `response.failed` with the items done so far (no receipt: nothing was
        answered whole)."""
        code = "server_error" if not isinstance(error, BankmlError) or status_of(error) >= 500 else "invalid_prompt"
        message = error.message if isinstance(error, BankmlError) else str(error)
        events = self.event("error", code=code, message=message, param=None)
        body = self.shape.body("failed", self.items, None)
        body["error"] = {"code": code, "message": message}
        await response.send(events + self.event("response.failed", response=body))

    async def close(self, response) -> None:
        return None

    # --- the events ----------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + jstr.dumps(data).encode("utf-8") + b"\n\n"

    def pieces(self, pieces: list[tuple[str, str]], final: bool = False) -> bytes:
        """Reasoning and content deltas as events; content goes through the tools' stream first. `final`:
        the answer ended, so what the tools' stream held is sent (content, then each call whole)."""
        events = b""
        for kind, delta in pieces:
            if kind == "reasoning":
                if self.open_item is None or self.open_item["type"] != "reasoning":
                    delta = delta.lstrip()  # the thought starts at its first word, as `split` reads it
                    if not delta:
                        continue
                events += self.text_delta("reasoning", delta)
            elif self.calls is None:
                events += self.text_delta("message", delta)
            else:
                for k, d in self.calls.feed(delta):
                    events += self.text_delta("message", d) if k == "content" else b""
        if final and self.calls is not None:
            deltas, _ = self.calls.finish()
            for k, d in deltas:
                events += self.text_delta("message", d) if k == "content" else self.call(d)
        return events

    def text_delta(self, kind: str, delta: str) -> bytes:
        events = b""
        if self.open_item is not None and self.open_item["type"] != kind:
            events += self.close_item("completed")
        if self.open_item is None:
            events += self.open_text(kind)
        item = self.open_item
        item["_text"] += delta
        if kind == "reasoning":
            return events + self.event("response.reasoning_text.delta", item_id=item["id"],
                                       output_index=len(self.items), content_index=0, delta=delta)
        return events + self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items),
                                   content_index=0, delta=delta, logprobs=[])

    def open_text(self, kind: str) -> bytes:
        if kind == "reasoning":
            item = reasoning_item(new_id("rs"), None)
            added, part = {**item, "content": []}, {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(new_id("msg"), None, "in_progress")
            added, part = item, {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        self.open_item = {**item, "_text": ""}
        index = len(self.items)
        return (self.event("response.output_item.added", output_index=index, item=added) +
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=part))

    def close_item(self, status: str) -> bytes:
        item = self.open_item
        if item is None:
            return b""
        self.open_item = None
        text, index = item.pop("_text"), len(self.items)
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            part = done["content"][0]
            events = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text)
        else:
            done = message_item(item["id"], text, status)
            part = done["content"][0]
            events = self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text, logprobs=[])
        events += self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)
        events += self.event("response.output_item.done", output_index=index, item=done)
        self.items.append(done)
        return events

    def call(self, delta: dict) -> bytes:
        """One call, whole (the tools' stream gives it once it is complete): added, its arguments, done."""
        events = self.close_item("completed")
        index = len(self.items)
        item_id = new_id("fc")
        added = call_item(item_id, delta, "", "in_progress")
        args = delta["function"]["arguments"]
        done = call_item(item_id, delta)
        events += self.event("response.output_item.added", output_index=index, item=added)
        events += self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                             delta=args)
        events += self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                             arguments=args, name=done["name"])
        events += self.event("response.output_item.done", output_index=index, item=done)
        self.items.append(done)
        return events
