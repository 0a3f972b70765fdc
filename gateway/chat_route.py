"""`POST /v1/chat/completions`, top to bottom.

1. read the JSON (off the loop) and resolve `model` in the registry (absent or empty: the startup
   model; a name that does not resolve: 404); a derived model's layer goes over the body (its
   num_ctx above --ctx is a 400; under it, the prompt must fit in it);
2. read the fields as llama-server reads them (chat_request.parse_chat_request, with the model's
   sampling defaults): its 400 (or 500) before any model work, then ours for what this engine cannot do;
3. lease the model for the whole answer: loaded if it is not resident (verified first), its file
   still the verified one, or 503 and no receipt (residency.py); it stays resident forever after;
4. template and tokens (off the loop); a prompt of n_ctx tokens or more is llama-server's 400;
5. hand the request to the model's own engine queue (engine_client.py) and read this request's outputs; the
   last one carries the engine thread's timeline and energy of the answer. A queue already holding
   `[engine] max_waiting` requests refuses it (Overloaded): 503 with Retry-After, nothing sent yet;
6. write them (openai_chat.py, one `id` for the answer): one JSON answer (the text released, then
   what was held back at the end, and the logprob entries less the stop word's), or SSE chunks as
   the pieces form (the role delta first, held-back text never sent, as llama-server); the head of
   a stream goes out with the first token, so a failure before it is still an ordinary error status;
7. a completed answer's /bankml/metrics record goes to the monitor (before the answer goes out, so
   a client that asks next sees it); the receipt over the text exactly as sent, then `[DONE]`.
A client that goes away cancels the handler; leaving the `async with` aborts the generation before
the engine's next decode step, and the monitor counts the answer as abandoned.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from bankml.errors import InvalidRequest
from gateway.chat_request import parse_body, parse_chat_request
from gateway.derived import apply_openai, layer_num_ctx
from gateway.engine_client import engine_error
from gateway.errors import exceed_context, json_response, stream_error
from gateway.monitoring import Answer
from gateway.openai_chat import DONE_EVENT, Completion, logprob_entry, receipt_event
from gateway.receipt import Tally
from gateway.request_fields import gguf_defaults
from gateway.residency import FOREVER
from model.messages import FinishReason, GenerateRequest, StepOutput


async def chat_completions(request, state):
    body = request.body
    # off the loop: a 16 MiB body takes a while to parse, and other clients must not wait for it
    doc = await asyncio.to_thread(parse_body, body)
    resolved = state.registry.resolve(doc.get("model") if isinstance(doc, dict) else None)
    n_ctx = state.residency.ctx  # what every engine holds
    if resolved.derived is not None:
        layer = resolved.derived.layer
        doc = apply_openai(layer, doc)
        num_ctx = layer_num_ctx(layer)
        if num_ctx is not None and num_ctx > n_ctx:
            raise InvalidRequest(f"num_ctx {num_ctx} is larger than the context this server holds ({n_ctx}); "
                                 f"restart bankml serve with --ctx {num_ctx} if it fits in memory")
        n_ctx = min(n_ctx, num_ctx or n_ctx)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    chat = await asyncio.to_thread(parse_chat_request, doc, defaults)
    async with state.residency.lease(pin) as held:
        loaded = held.loaded
        prompt = await asyncio.to_thread(loaded.model.prompt, chat.messages, chat.add_generation_prompt)
        n_ctx = min(n_ctx, loaded.model.n_ctx)  # a derived model's num_ctx: its prompt must fit in that
        if len(prompt) >= n_ctx:
            raise exceed_context(len(prompt), n_ctx)
        shown = loaded.file_name if resolved.derived is None else resolved.tag
        completion = Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), shown,
                                include_usage=chat.include_usage)
        engine_request = GenerateRequest(prompt, chat.params, request_id=completion.id)
        tally = Tally.start(body)
        try:
            with state.monitoring.answer() as answer:
                if chat.stream:
                    return await _streamed(request, loaded, engine_request, tally, completion, answer)
                return await _whole(loaded, engine_request, tally, completion, answer)
        finally:
            state.residency.touch(pin.name, FOREVER)  # spec §2: /v1 keeps its model forever


def _stem(loaded) -> str:
    return loaded.file_name.removesuffix(".gguf")  # the metrics record's model: the file stem, its case kept


async def _whole(loaded, engine_request: GenerateRequest, tally: Tally, completion: Completion,
                 answer: Answer):
    pieces: list[str] = []
    entries: list[dict] = []
    last: StepOutput | None = None
    async with loaded.client.generate(engine_request) as generation:
        async for out in generation:
            pieces.append(out.text)
            if out.logprobs is not None:
                entries.append(logprob_entry(out.logprobs))
            last = out
    if last is None or last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise engine_error(loaded.client, last or StepOutput(token=None))
    answer.record(_stem(loaded), last)
    # llama-server's non-streamed content is all it generated: what was held back at the end too
    text = "".join(pieces) + last.held_text
    if last.logprobs_trim:  # the stop word's own tokens, as llama-server trims them
        entries = entries[:max(0, len(entries) - last.logprobs_trim)]
    tally.sent(text)
    if entries:
        tally.logprobs(entries)
    tally.answered(last)
    receipt = tally.receipt_for(loaded)
    return json_response(completion.body(text, last, receipt, entries))


async def _streamed(request, loaded, engine_request: GenerateRequest, tally: Tally,
                    completion: Completion, answer: Answer):
    response = None
    sent_entries: list[dict] = []
    async with loaded.client.generate(engine_request) as generation:
        async for out in generation:
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                if response is None:
                    raise engine_error(loaded.client, out)
                await response.send(stream_error(engine_error(loaded.client, out)))  # no receipt for a failed answer
                await response.eof()
                return None  # the answer went out through `response`
            entry = [logprob_entry(out.logprobs)] if out.logprobs is not None else None
            if response is None:
                response = await request.respond(content_type="text/event-stream",
                                                  headers={"Cache-Control": "no-cache"})
                # the role delta opens the stream; the first token's entry rides on it when it has no text
                rides = entry if entry is not None and not out.text else None
                await response.send(completion.chunk(None, rides))
                if rides:
                    sent_entries += rides
                    entry = None
            if out.text:
                await response.send(completion.chunk(out.text, entry))
                tally.sent(out.text)
                sent_entries += entry or []
            if out.finish_reason is not None:
                tally.answered(out)
                if sent_entries:
                    tally.logprobs(sent_entries)
                answer.record(_stem(loaded), out)
                await response.send(completion.final_chunks(out))
                await response.send(receipt_event(tally.receipt_for(loaded)))
                await response.send(DONE_EVENT)
                await response.eof()
    return None  # the answer went out through `response`
