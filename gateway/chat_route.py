"""`POST /v1/chat/completions`, top to bottom.

1. read the body as llama-server reads it (chat_request.parse_chat, with the model's sampling
   defaults): its 400 (or 500) before any model work, then ours for what this engine cannot do;
2. resolve `model` (404) and acquire the model: its file must still be the verified one, or 503 and
   no receipt (residency.py);
3. template and tokens (off the loop); a prompt of n_ctx tokens or more is llama-server's 400;
4. hand the request to the engine queue (engine_client.py, metered by monitoring.py) and read this
   request's outputs;
5. write them: one JSON answer (the text released, then what was held back at the end, and the
   logprob entries less the stop word's), or SSE chunks as the pieces form (a role delta first when
   logprobs are asked; held-back text never sent, as llama-server); the head of a stream goes out
   with the first token, so a failure before it is still an ordinary error status;
6. a completed answer's /bankml/metrics record (before the answer goes out, so a client that asks
   next sees it); the receipt over the text exactly as sent, then `[DONE]`.
A client that goes away cancels the handler; leaving the `async with` aborts the generation before
the engine's next decode step.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from gateway.chat_request import parse_chat
from gateway.errors import ApiError, exceed_context, json_response
from gateway.openai_chat import (
    DONE_EVENT,
    chunk_event,
    completion_body,
    error_event,
    final_event,
    logprob_entry,
    receipt_event,
)
from gateway.receipt import Tally
from model.messages import FinishReason, GenerateRequest, StepOutput


def engine_error(state, out: StepOutput) -> ApiError:
    """An engine failure: 503 when the engine thread is gone (nothing will answer), else 500; with the reason."""
    why = out.error or "the engine failed"
    if state.client.failure is not None:
        return ApiError(503, why)
    return ApiError(500, why)


async def chat_completions(request, state):
    body = request.body
    chat = parse_chat(body, state.residency.sampling_defaults)
    state.residency.resolve(chat.model)
    loaded = await state.residency.acquire()
    prompt = await asyncio.to_thread(loaded.model.prompt, chat.messages, chat.add_generation_prompt)
    if len(prompt) >= loaded.model.n_ctx:
        raise exceed_context(len(prompt), loaded.model.n_ctx)
    job = GenerateRequest(prompt, chat.params, request_id=f"chatcmpl-{uuid.uuid4().hex[:16]}")
    created = int(time.time())
    tally = Tally.start(body)
    if chat.stream:
        return await _streamed(request, state, loaded, job, tally, created)
    return await _whole(state, loaded, job, tally, created)


def _stem(loaded) -> str:
    return loaded.file_name.removesuffix(".gguf")  # the metrics record's model: the file stem, its case kept


async def _whole(state, loaded, job: GenerateRequest, tally: Tally, created: int):
    pieces: list[str] = []
    entries: list[dict] = []
    last: StepOutput | None = None
    async with state.monitoring.metered(state.client, job) as answer:
        async for out in answer:
            if out.token is not None:
                tally.token()
            pieces.append(out.text)
            if out.logprobs is not None:
                entries.append(logprob_entry(out.logprobs))
            last = out
        completed = last is not None and last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if completed:
            await answer.record(_stem(loaded), last)
    if not completed:
        raise engine_error(state, last or StepOutput(token=None))
    # llama-server's non-streamed content is all it generated: what was held back at the end too
    text = "".join(pieces) + last.held_text
    if last.logprobs_trim:  # the stop word's own tokens, as llama-server trims them
        entries = entries[:max(0, len(entries) - last.logprobs_trim)]
    tally.sent(text)
    if entries:
        tally.logprobs(entries)
    tally.prompt_tokens, tally.completion_tokens = last.prompt_tokens, last.completion_tokens
    receipt = tally.receipt(loaded.backend, loaded.verified)
    return json_response(completion_body(text, last, created, loaded.file_name, receipt, entries))


async def _streamed(request, state, loaded, job: GenerateRequest, tally: Tally, created: int):
    response = None
    sent_entries: list[dict] = []
    async with state.monitoring.metered(state.client, job) as answer:
        async for out in answer:
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                if response is None:
                    raise engine_error(state, out)
                await response.send(error_event(engine_error(state, out)))  # no receipt for a failed answer
                await response.eof()
                return None  # the answer went out through `response`
            if response is None:
                response = await request.respond(content_type="text/event-stream",
                                                  headers={"Cache-Control": "no-cache"})
            if out.token is not None:
                tally.token()
            entry = [logprob_entry(out.logprobs)] if out.logprobs is not None else None
            if entry is not None and out.completion_tokens == 1:
                # the role delta opens the stream; the entry rides on it when the token has no text
                await response.send(chunk_event(None, created, loaded.file_name, None if out.text else entry))
                if not out.text:
                    sent_entries += entry
            if out.text:
                await response.send(chunk_event(out.text, created, loaded.file_name, entry))
                tally.sent(out.text)
                sent_entries += entry or []
            if out.finish_reason is not None:
                tally.prompt_tokens, tally.completion_tokens = out.prompt_tokens, out.completion_tokens
                if sent_entries:
                    tally.logprobs(sent_entries)
                await answer.record(_stem(loaded), out)
                await response.send(final_event(out, created, loaded.file_name))
                await response.send(receipt_event(tally.receipt(loaded.backend, loaded.verified)))
                await response.send(DONE_EVENT)
                await response.eof()
    return None  # the answer went out through `response`
