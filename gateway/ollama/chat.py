"""`POST /api/chat` and `POST /api/generate`, top to bottom (spec §1.1-§1.4); and the /api routes bankML
refuses with a reason (/api/embed and /api/embeddings are served: gateway/ollama/embed.py).

1. the body read once, off the loop (ollama_request.parse_ollama): the model resolved (404), a derived
   model's layer applied, keep_alive and stream read; every refusal and option check comes before any load;
2. an empty prompt only loads (lease, record what /api/ps shows, touch) or, with keep_alive 0, unloads:
   one final object with done_reason "load"/"unload", no counts, no receipt;
3. otherwise the answer pipeline (gateway/serving/answer.py) leases the model (`load_ns` is what this
   request waited for); on it, /api/ps's record is updated and the prompt built off the loop
   (prompt_fit.py: the template fitted to num_ctx, or a raw prompt);
4. written (shapes.py) as NDJSON lines (one per non-empty piece; the first token's line even without
   text when logprobs are on, as its entry rides there; a thinking template's thought as `thinking`
   unless `think` is false, gateway/serving/reasoning.py) and the final object, or as one JSON body; an
   engine failure after the head went out is an `{"error"}` line; then touch(keep_alive) (0 unloads
   the model once no answer holds it).
A client that goes away cancels the handler; leaving the `async with` aborts the generation.
"""

from __future__ import annotations

import time
import uuid

from sanic import HTTPResponse

from bankml.errors import InvalidRequest
from gateway.http.errors import Api, error_body, json_response
from gateway.ollama.request import OllamaRequest, parse_ollama
from gateway.ollama.shapes import NDJSON, final_line, final_object, logprob_entry, piece_line
from gateway.serving.answer import Run, Work, answer, off_loop
from gateway.serving.prompt_fit import chat_prompt, raw_prompt
from gateway.serving.reasoning import ThoughtStream, opened, split, thought_tags
from gateway.serving.tool_calls import ToolPlan, ToolStream, ollama_calls
from gateway.serving.tool_calls import parse as parse_calls
from gateway.serving.tool_calls import plan as tool_plan
from model.messages import StepOutput

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
    n_ctx = server_ctx(state)
    residency = state.residency
    # off the loop: a 16 MiB body takes a while to parse, and other clients must not wait for it
    req = await off_loop(parse_ollama, request.body, kind, state.registry, n_ctx, residency.default_keep_alive_s)
    if req.empty:
        return await _load_or_unload(state, req, t0_ns, n_ctx)

    async def work(held) -> Work:
        residency.record_shown(req.pin.name, req.tag, req.num_ctx or n_ctx, held.reloaded)
        model = held.loaded.model
        plan, prompt = await off_loop(_prompt, model, req)
        tags = thought_tags(model.chat_template) if req.reasoning.split else None
        writer = OllamaWriter(req, held, t0_ns, plan, tags, tags is not None and opened(model.tokenizer, prompt, tags))
        return Work([prompt], req.params, [f"ollama-{uuid.uuid4().hex}"], writer, req.stream,
                    grammar=req.grammar if plan is None else plan.grammar, reasoning=req.reasoning)

    # keep_alive after the answer, as Ollama's scheduler does (0: unloaded once no answer holds it)
    return await answer(request, state, req.pin, req.keep_alive_s, work)


def _prompt(model, req: OllamaRequest) -> tuple[ToolPlan | None, list[int]]:
    """The tools' plan (gateway/serving/tool_calls.py: the template's messages and tools, the grammar of the
    format), and the prompt's tokens."""
    if req.raw_prompt is not None:
        return None, raw_prompt(model, req.raw_prompt, req.num_ctx)
    kwargs = req.reasoning.template_kwargs() or None
    if req.tools is None:
        return None, chat_prompt(model, req.messages, req.num_ctx, None, kwargs)
    plan = tool_plan(req.tools, req.messages, model.chat_template, req.response_schema)
    if plan is None:
        return None, chat_prompt(model, req.messages, req.num_ctx, None, kwargs)
    return plan, chat_prompt(model, plan.messages, req.num_ctx, plan.template_tools, kwargs)


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


class OllamaWriter:
    """One /api/chat or /api/generate answer (serving/answer.py `Writer`): NDJSON lines or one JSON body."""

    def __init__(self, req: OllamaRequest, held, t0_ns: int, plan: ToolPlan | None,
                 tags: tuple[str, str] | None = None, started: bool = False):
        self.req, self.held, self.t0_ns, self.plan = req, held, t0_ns, plan
        self.tags, self.started = tags, started  # the thought's tags (None: nothing cut out), the prompt opened it
        self.calls = None if plan is None else ToolStream(plan)
        self.thought = None if tags is None else ThoughtStream(tags, started)
        self.pending: list[dict] = []  # streamed with tools: entries not yet on a line
        self.first = True

    def _entry(self, out: StepOutput) -> dict | None:
        return logprob_entry(out.logprobs, self.req.top_logprobs) if out.logprobs is not None else None

    def _final(self, last: StepOutput, text: str, receipt: dict, entries: list[dict] | None = None,
               calls: list[dict] | None = None, thinking: str = "") -> str:
        return final_object(self.req.tag, self.req.kind, text, last.finish_reason.value,
                            time.perf_counter_ns() - self.t0_ns, self.held.load_ns, last, entries, receipt, calls,
                            thinking)

    async def whole(self, run: Run) -> HTTPResponse:
        # what the stop filter held back and the end released is part of the answer (a possible stop that
        # was not one), as the Rust bankml's StopFilter.finish gives it
        f = (await run.whole(self._entry))[0]
        receipt = run.receipt(0, f.text, f.last, f.entries)  # over the text as generated
        thinking, text = split(f.text, self.tags, self.started)
        if self.plan is None:
            return json_response(self._final(f.last, text, receipt, f.entries, None, thinking))
        parsed = parse_calls(self.plan, text)
        return json_response(self._final(f.last, parsed.content or "", receipt, f.entries, ollama_calls(parsed.calls),
                                         thinking))

    async def open(self, request):
        return await request.respond(content_type=NDJSON, headers={"Cache-Control": "no-cache"})

    async def output(self, response, run: Run, i: int, out: StepOutput) -> None:
        req = self.req
        entry = self._entry(out)
        generated = out.text + (out.held_text if out.finish_reason is not None else "")
        run.sent(i, generated)  # the receipt covers the text as generated, thought and tags included
        text = generated
        if self.thought is not None:  # the thought on lines of its own (`thinking`), the rest as below
            deltas = self.thought.feed(generated) + (self.thought.finish() if out.finish_reason is not None else [])
            thinking = "".join(d for kind, d in deltas if kind == "reasoning")
            text = "".join(d for kind, d in deltas if kind == "content")
            if thinking:
                line_entries = [entry] if entry is not None else None
                await response.send(piece_line(req.tag, req.kind, "", line_entries, None, thinking))
                run.sent(i, "", line_entries)
                entry, self.first = None, False
        if self.calls is not None:  # tools: content once it is sure to be, the calls once whole
            self.pending += [entry] if entry is not None else []
            deltas = self.calls.feed(text)
            if out.finish_reason is not None:
                more, _ = self.calls.finish()
                deltas += more
            for line in _tool_lines(req, deltas, self.pending):
                run.sent(i, "", self.pending)
                self.pending = []
                await response.send(line)
        elif text or (self.first and entry is not None):
            line_entries = [entry] if entry is not None else None
            await response.send(piece_line(req.tag, req.kind, text, line_entries))
            run.sent(i, "", line_entries)
        elif entry is not None and self.thought is not None:  # a token whose text is held back (a thought's tag)
            self.pending.append(entry)
        self.first = False
        if out.finish_reason is not None and self.pending:  # entries no line carried
            await response.send(piece_line(req.tag, req.kind, "", self.pending))
            run.sent(i, "", self.pending)
            self.pending = []

    async def last(self, response, run: Run, i: int, out: StepOutput, receipt: dict) -> None:
        await response.send(final_line(self._final(out, "", receipt)))

    async def failed(self, response, error: Exception) -> None:
        # the status went out with the head: the failure is the stream's last line, no receipt
        await response.send((error_body(error, Api.OLLAMA) + "\n").encode())

    async def close(self, response) -> None:
        return None


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
