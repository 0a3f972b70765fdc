"""`POST /api/chat` and `POST /api/generate`, top to bottom (spec §1.1-§1.4); and the /api routes bankML
refuses with a reason (/api/embed and /api/embeddings are served: gateway/ollama/embed.py).

1. the body read once, off the loop (ollama_request.parse_ollama): the model resolved (404), a derived
   model's layer applied, keep_alive and stream read; every refusal and option check comes before any load;
2. an empty prompt only loads (lease, record what /api/ps shows, touch) or, with keep_alive 0, unloads:
   one final object with done_reason "load"/"unload", no counts, no receipt;
3. otherwise the model is leased for the answer (residency.py: verified and loaded if it was not
   resident; `load_ns` is what this request waited for), /api/ps's record is updated, and the prompt is
   built off the loop (prompt_fit.py: the template fitted to num_ctx, or a raw prompt);
4. the request goes to this model's own engine thread (held.loaded.client); its outputs are written as
   NDJSON lines (one per non-empty piece; the first token's line even without text when logprobs are on,
   as its entry rides there) and the final object, or as one JSON body (ollama_shapes.py). An engine
   failure after the head went out is an `{"error"}` line; before it, its status (500, or 503 when the
   engine thread is gone);
5. a completed answer's /bankml/metrics record goes to the monitor, the receipt covers the text as
   sent; then touch(keep_alive) once the lease is given back (0 unloads the model once it is idle).
A client that goes away cancels the handler; leaving the `async with` aborts the generation.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from sanic import HTTPResponse

from bankml.errors import InvalidRequest
from gateway.http.errors import Api, error_body, json_response
from gateway.monitor.monitoring import Answer
from gateway.ollama.request import OllamaRequest, parse_ollama
from gateway.ollama.shapes import NDJSON, final_line, final_object, logprob_entry, piece_line
from gateway.serving.constraints import attach_constraints
from gateway.serving.engine_client import engine_error
from gateway.serving.prompt_fit import chat_prompt, raw_prompt
from gateway.serving.receipt import Tally
from gateway.serving.tool_calls import ToolPlan, ToolStream, ollama_calls
from gateway.serving.tool_calls import parse as parse_calls
from gateway.serving.tool_calls import plan as tool_plan
from model.messages import FinishReason, GenerateRequest, StepOutput

REFUSED = {
    "/api/pull": "models are imported sha256-pinned: put the GGUF and its FORK.json in the registry directory "
                 "(`bankml fork FILE`)",
    "/api/push": "bankml publishes nothing: a model is shared by its pinned file and its FORK.json",
}


async def refused(request, state):
    """/api/pull, /api/push: 400 with the reason."""
    raise InvalidRequest(REFUSED[request.path])


async def chat(request, state):
    return await _answer(request, state, "chat")


async def generate(request, state):
    return await _answer(request, state, "generate")


def server_ctx(state) -> int:
    """--ctx: what every resident model's engine holds, and the most num_ctx may ask for."""
    return state.residency.ctx


async def _answer(request, state, kind: str):
    t0_ns = time.perf_counter_ns()
    body = request.body
    n_ctx = server_ctx(state)
    residency = state.residency
    # off the loop: a 16 MiB body takes a while to parse, and other clients must not wait for it
    req = await asyncio.to_thread(parse_ollama, body, kind, state.registry, n_ctx, residency.default_keep_alive_s)
    if req.empty:
        return await _load_or_unload(state, req, t0_ns, n_ctx)
    name = req.pin.name
    try:
        async with residency.lease(req.pin) as held:
            residency.record_shown(name, req.tag, req.num_ctx or n_ctx, held.reloaded)
            plan, prompt = await asyncio.to_thread(_prompt, held.loaded.model, req)
            engine_request = GenerateRequest(prompt, req.params, request_id=f"ollama-{uuid.uuid4().hex}")
            grammar = req.grammar if plan is None else plan.grammar
            await attach_constraints(held.loaded, [engine_request], grammar)  # a 400 before any model work
            with state.monitoring.answer() as answer:
                run = _Run(req, held, Tally.start(body, state.receipt_key), answer, t0_ns, plan)
                if req.stream:
                    return await run.streamed(request, engine_request)
                return await run.whole(engine_request)
    finally:
        residency.touch(name, req.keep_alive_s)  # after the answer, as Ollama's scheduler does


def _prompt(model, req: OllamaRequest) -> tuple[ToolPlan | None, list[int]]:
    """The tools' plan (gateway/serving/tool_calls.py: the template's messages and tools, the grammar of the
    format), and the prompt's tokens."""
    if req.raw_prompt is not None:
        return None, raw_prompt(model, req.raw_prompt, req.num_ctx)
    if req.tools is None:
        return None, chat_prompt(model, req.messages, req.num_ctx)
    plan = tool_plan(req.tools, req.messages, model.chat_template, req.response_schema)
    if plan is None:
        return None, chat_prompt(model, req.messages, req.num_ctx)
    return plan, chat_prompt(model, plan.messages, req.num_ctx, plan.template_tools)


async def _load_or_unload(state, req: OllamaRequest, t0_ns: int, n_ctx: int) -> HTTPResponse:
    """An empty prompt: load (and keep for keep_alive) or, with keep_alive 0, unload; nothing is checked."""
    residency = state.residency
    name = req.pin.name
    if req.keep_alive_s == 0:
        await residency.unload(name)
        reason, load_ns = "unload", 0
    else:
        async with residency.lease(req.pin) as held:
            load_ns = held.load_ns
            residency.record_shown(name, req.tag, req.num_ctx or n_ctx, held.reloaded)
        residency.touch(name, req.keep_alive_s)
        reason = "load"
    text = final_object(req.tag, req.kind, "", reason, time.perf_counter_ns() - t0_ns, load_ns)
    if req.stream:
        return HTTPResponse(final_line(text), content_type=NDJSON)
    return json_response(text)


class _Run:
    """One answer being written: the request, the leased model, the receipt's tally, the monitor's record."""

    def __init__(self, req: OllamaRequest, held, tally: Tally, answer: Answer, t0_ns: int, plan: ToolPlan | None):
        self.req, self.held, self.tally, self.answer, self.t0_ns = req, held, tally, answer, t0_ns
        self.loaded = held.loaded
        self.plan = plan

    def _entry(self, out: StepOutput) -> dict | None:
        return logprob_entry(out.logprobs, self.req.top_logprobs) if out.logprobs is not None else None

    def _finish(self, last: StepOutput, text: str, entries: list[dict], streamed: bool,
                calls: list[dict] | None = None) -> str:
        """The final object: the monitor's record, the receipt over the text as generated (with tools, the
        content and calls are parsed from it)."""
        self.answer.record(self.loaded.file_name.removesuffix(".gguf"), last)  # the metrics keep the file's case
        self.tally.answered(last)
        if entries:
            self.tally.logprobs(entries)
        receipt = self.tally.receipt_for(self.loaded)
        return final_object(self.req.tag, self.req.kind, "" if streamed else text, last.finish_reason.value,
                            time.perf_counter_ns() - self.t0_ns, self.held.load_ns, last,
                            None if streamed else entries, receipt, calls)

    async def whole(self, engine_request: GenerateRequest) -> HTTPResponse:
        pieces: list[str] = []
        entries: list[dict] = []
        last: StepOutput | None = None
        async with self.loaded.client.generate(engine_request) as generation:
            async for out in generation:
                pieces.append(out.text)
                entry = self._entry(out)
                if entry is not None:
                    entries.append(entry)
                last = out
        if last is None or last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            raise engine_error(self.loaded.client, last or StepOutput(token=None))
        # what the stop filter held back and the end released is part of the answer (a possible stop that
        # was not one), as the Rust bankml's StopFilter.finish gives it
        text = "".join(pieces) + last.held_text
        if last.logprobs_trim:  # the stop word's own tokens, as llama-server trims them
            entries = entries[:max(0, len(entries) - last.logprobs_trim)]
        self.tally.sent(text)
        if self.plan is None:
            return json_response(self._finish(last, text, entries, streamed=False))
        parsed = parse_calls(self.plan, text)
        return json_response(self._finish(last, parsed.content or "", entries, streamed=False,
                                          calls=ollama_calls(parsed.calls)))

    async def streamed(self, request, engine_request: GenerateRequest) -> None:
        req = self.req
        response = None
        sent_entries: list[dict] = []
        pending: list[dict] = []  # with tools: entries not yet on a line
        calls = None if self.plan is None else ToolStream(self.plan)
        first = True
        async with self.loaded.client.generate(engine_request) as generation:
            async for out in generation:
                if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    if response is None:
                        raise engine_error(self.loaded.client, out)
                    # the status went out with the head: the failure is the stream's last line, no receipt
                    await response.send((error_body(engine_error(self.loaded.client, out), Api.OLLAMA) + "\n").encode())
                    await response.eof()
                    return None
                if response is None:
                    response = await request.respond(content_type=NDJSON, headers={"Cache-Control": "no-cache"})
                entry = self._entry(out)
                text = out.text + (out.held_text if out.finish_reason is not None else "")
                if calls is not None:  # tools: content once it is sure to be, the calls once whole
                    pending += [entry] if entry is not None else []
                    self.tally.sent(text)
                    deltas = calls.feed(text)
                    if out.finish_reason is not None:
                        more, _ = calls.finish()
                        deltas += more
                    for line in _tool_lines(req, deltas, pending):
                        sent_entries += pending
                        pending = []
                        await response.send(line)
                elif text or (first and entry is not None):
                    line_entries = [entry] if entry is not None else None
                    await response.send(piece_line(req.tag, req.kind, text, line_entries))
                    self.tally.sent(text)
                    sent_entries += line_entries or []
                first = False
                if out.finish_reason is not None:
                    if pending:  # with tools, entries no delta carried: a line of their own
                        await response.send(piece_line(req.tag, req.kind, "", pending))
                        sent_entries += pending
                    await response.send(final_line(self._finish(out, "", sent_entries, streamed=True)))
                    await response.eof()
        return None  # the answer went out through `response`



def _tool_lines(req: OllamaRequest, deltas: list, entries: list[dict]):
    """NDJSON lines for ToolStream deltas: content pieces, then the calls on one line (Ollama's form);
    the first line carries the entries not yet sent."""
    content = "".join(d for kind, d in deltas if kind == "content")
    calls = [{k: v for k, v in d.items() if k != "index"} for kind, d in deltas if kind == "call"]
    if content:
        yield piece_line(req.tag, req.kind, content, entries or None)
        entries = []
    if calls:
        yield piece_line(req.tag, req.kind, "", entries or None, ollama_calls(calls))
