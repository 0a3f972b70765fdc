"""`POST /v1/chat/completions`, top to bottom.

1. read the JSON (off the loop) and resolve `model` in the registry (absent or empty: the startup
   model; a name that does not resolve: 404, unless the server has one model, which answers any name
   as llama-server's does: Registry.resolve_openai); a derived model's layer goes over the body (its
   num_ctx above --ctx is a 400; under it, the prompt must fit in it);
2. read the fields as llama-server reads them (chat_request.parse_chat_request, with the model's
   sampling defaults): its 400 (or 500) before any model work, then ours for what this engine cannot do;
3. lease the model for the whole answer: loaded if it is not resident (verified first), its file
   still the verified one, or 503 and no receipt (residency.py); it stays resident forever after;
4. template and tokens (off the loop); a prompt of n_ctx tokens or more is llama-server's 400;
5. hand the request to the model's own engine queue (generation.py: one sequence per choice, `n` of
   them, at most the engine's sequences, all handed over at once) and read their outputs; the last
   one of each carries the engine thread's timeline and energy of that choice. A queue already holding
   `[engine] max_waiting` requests refuses it (Overloaded): 503 with Retry-After, nothing sent yet;
6. write them (openai_chat.py, one `id` for the answer): one JSON answer (the text released, then
   what was held back at the end, and the logprob entries less the stop word's; `n` > 1: its choices
   by `index`, each with its own receipt), or SSE chunks as the pieces form (each choice's role delta
   first, held-back text never sent, as llama-server; `timings` on each with timings_per_token); the
   head of a stream goes out with the first token, so a failure before it is still an ordinary error
   status;
7. a completed answer's /bankml/metrics record goes to the monitor (before the answer goes out, so
   a client that asks next sees it); the receipt over the text exactly as sent, then `[DONE]`.
A client that goes away cancels the handler; leaving the `async with` aborts the generation before
the engine's next decode step, and the monitor counts the answer as abandoned.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from gateway.http.errors import exceed_context, json_response
from gateway.monitor.monitoring import Answer
from gateway.openai.chat_request import parse_body, parse_chat_request
from gateway.openai.chat_writer import (
    DONE_EVENT,
    Completion,
    finish_reason,
    logprob_entry,
    receipt_event,
    timings,
)
from gateway.openai.completion import engine_sequences, resolve_for
from gateway.openai.completion_request import N_UNBOUNDED, check_n
from gateway.serving.constraints import attach_constraints
from gateway.serving.generation import answer_receipt, end_failed, metrics_model, open_sse, outputs, whole
from gateway.serving.receipt import Tally
from gateway.serving.request_fields import gguf_defaults
from gateway.serving.residency import FOREVER
from gateway.serving.tool_calls import ToolPlan, ToolStream
from gateway.serving.tool_calls import parse as parse_calls
from gateway.serving.tool_calls import plan as tool_plan
from model.messages import FinishReason, GenerateRequest


async def chat_completions(request, state):
    body = request.body
    # off the loop: a 16 MiB body takes a while to parse, and other clients must not wait for it
    doc = await asyncio.to_thread(parse_body, body)
    resolved, doc, n_ctx = resolve_for(state, doc, by_name=True)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    chat = await asyncio.to_thread(parse_chat_request, doc, defaults, N_UNBOUNDED)
    async with state.residency.lease(pin) as held:
        loaded = held.loaded
        check_n(chat.n, engine_sequences(loaded))
        plan, prompt = await asyncio.to_thread(_prompt, loaded.model, chat)
        n_ctx = min(n_ctx, loaded.model.n_ctx)  # a derived model's num_ctx: its prompt must fit in that
        if len(prompt) >= n_ctx:
            raise exceed_context(len(prompt), n_ctx)
        shown = loaded.file_name if resolved.derived is None else resolved.tag
        completion = Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), shown,
                                include_usage=chat.include_usage)
        requests = [GenerateRequest(prompt, chat.params, request_id=completion.id if chat.n == 1 else
                                    f"{completion.id}-{j}", return_progress=chat.return_progress and chat.stream,
                                    id_slot=chat.id_slot)
                    for j in range(chat.n)]
        grammar = chat.grammar if plan is None else plan.grammar
        await attach_constraints(loaded, requests, grammar)  # a 400 before any model work
        # each clock starts as its sequence is handed over
        tallies = [Tally.start(body, state.receipt_key) for _ in requests]
        try:
            with state.monitoring.answer() as answer:
                if chat.stream:
                    return await _streamed(request, loaded, requests, tallies, completion, answer,
                                           chat.timings_per_token, plan)
                return await _whole(loaded, requests, tallies, completion, answer, plan)
        finally:
            state.residency.touch(pin.name, FOREVER)  # spec §2: /v1 keeps its model forever


def _prompt(model, chat) -> tuple[ToolPlan | None, list[int]]:
    """The tools' plan (gateway/serving/tool_calls.py: the template's messages and tools, the grammar of a call)
    and the prompt's tokens; on a worker thread, as building a hundred tools' grammar takes a while."""
    plan = tool_plan(chat.tools, chat.messages, model.chat_template, chat.response_schema)
    if plan is None:
        return None, model.prompt(chat.messages, chat.add_generation_prompt)
    return plan, model.prompt(plan.messages, chat.add_generation_prompt, plan.template_tools)


async def _whole(loaded, requests: list[GenerateRequest], tallies: list[Tally], completion: Completion,
                 answer: Answer, plan: ToolPlan | None):
    done = await whole(loaded, requests, lambda out: logprob_entry(out.logprobs))
    for f in done:
        answer.record(metrics_model(loaded), f.last)
    parsed = [None if plan is None else parse_calls(plan, f.text) for f in done]
    if len(done) == 1:
        f = done[0]
        return json_response(completion.body(f.text, f.last, answer_receipt(loaded, tallies[0], f.text, f.last, f.entries),
                                             f.entries, parsed[0]))
    choices = []
    for j, f in enumerate(done):  # n > 1: each choice is an answer, with its own receipt
        choice = completion.choice(j, f.text, f.last, f.entries, parsed[j])
        choice["bankml_receipt"] = answer_receipt(loaded, tallies[j], f.text, f.last, f.entries)
        choices.append(choice)
    return json_response(completion.body_of(choices, done[0].last, None))


async def _streamed(request, loaded, requests: list[GenerateRequest], tallies: list[Tally],
                    completion: Completion, answer: Answer, timed: bool, plan: ToolPlan | None):
    response = None
    calls = [None if plan is None else ToolStream(plan) for _ in requests]  # deltas of content and calls
    sent_entries: list[list[dict]] = [[] for _ in requests]
    opened = [False] * len(requests)
    async with outputs(loaded, requests) as stream:
        async for j, out in stream:
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                await end_failed(response, loaded, out)
                return None  # the answer went out through `response`
            entry = [logprob_entry(out.logprobs)] if out.logprobs is not None else None
            if response is None:
                response = await open_sse(request)
            if out.progress is not None:  # return_progress: a role delta with the prompt's progress (b11434)
                await response.send(completion.progress_chunk(j, out.progress.to_json()))
                continue
            if not opened[j]:
                opened[j] = True
                # the role delta opens the choice; the first token's entry rides on it when it has no text
                rides = entry if entry is not None and not out.text else None
                await response.send(completion.chunk(None, rides, j, out if timed and not out.text else None))
                if rides:
                    sent_entries[j] += rides
                    entry = None
            if out.text and calls[j] is not None:  # tools: content once it is sure to be, calls once whole
                tallies[j].sent(out.text)
                for kind, delta in calls[j].feed(out.text):
                    await response.send(completion.delta_chunk(kind, delta, j, out if timed else None))
            elif out.text:
                await response.send(completion.chunk(out.text, entry, j, out if timed else None))
                tallies[j].sent(out.text)
                sent_entries[j] += entry or []
            if out.finish_reason is not None:
                tally = tallies[j]
                tally.answered(out)
                if sent_entries[j]:
                    tally.logprobs(sent_entries[j])
                answer.record(metrics_model(loaded), out)
                finish = None
                if calls[j] is not None:
                    deltas, parsed = calls[j].finish()
                    for kind, delta in deltas:
                        await response.send(completion.delta_chunk(kind, delta, j, out if timed else None))
                    finish = finish_reason(out, parsed)
                await response.send(completion.final_chunks(out, j, timed, finish))
                await response.send(receipt_event(tally.receipt_for(loaded), None if len(requests) == 1 else j,
                                                  timings(out) if timed else None))
        if response is not None:
            await response.send(DONE_EVENT)
            await response.eof()
    return None  # the answer went out through `response`
