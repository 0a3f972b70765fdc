"""`POST /completion` (and its alias `/completions`), `/v1/completions`, `/infill`, top to bottom.

1. read the JSON (off the loop) and resolve the model: `/completion` and `/infill` name none (the
   startup model, as llama-server serves its one model; `/completions` is llama-server's alias of
   /completion, not OpenAI's route); `/v1/completions` resolves `model` as
   `/v1/chat/completions` does (404 for an unknown name; a derived model's parameters fill the body);
2. read the fields as llama-server reads them (completion_request.parse_completion): its 400s (and
   its 500s for the OpenAI layer's refusals) before any model work, then ours; `n` against the
   engine's sequences, and the prompts x `n` against what one request may hand the engine
   ([engine] max_seqs + max_waiting, counted on the JSON: a 400 naming the limit);
3. lease the model for the whole answer (residency.py);
4. the prompts' tokens (off the loop): /infill's FIM layout (gateway/openai/infill.py, whose refusal of a
   model without FIM tokens comes first), else `prompt_tokens`; a prompt of n_ctx tokens or more is
   llama-server's exceed-context 400;
5. one sequence per prompt and per `n` (index `prompt * n + j`), all handed to the engine at once,
   all or none (generation.py: a queue without room for all is a 503 with nothing queued), so they
   decode together;
6. written as llama-server writes them (completion_writer.py): one object, or a list for several
   sequences (the OpenAI route: one object whose `choices` hold them all, as llama-server merges
   them), or SSE events as the tokens come; each sequence's receipt over the text exactly as sent
   (streamed: a key of its final event, which has no text).
A client that goes away cancels the handler, and leaving the generations cancels every sequence.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass
from functools import partial

from bankml import jstr
from bankml.errors import InvalidRequest
from gateway.http.body import parse_body
from gateway.http.errors import exceed_context, json_response
from gateway.openai import completion_writer as w
from gateway.openai.chat_writer import DONE_EVENT, logprob_entry
from gateway.openai.completion_request import (
    CompletionRequest,
    check_n,
    check_sequences,
    parse_completion,
    prompt_tokens,
)
from gateway.openai.echo import legacy_logprobs, prompt_texts
from gateway.openai.params_json import params_json
from gateway.serving.constraints import attach_constraints
from gateway.serving.derived import apply_openai, layer_num_ctx
from gateway.serving.generation import (
    Finished,
    answer_receipt,
    end_failed,
    metrics_model,
    open_sse,
    outputs,
    whole,
)
from gateway.serving.receipt import Tally
from gateway.serving.request_fields import gguf_defaults
from gateway.serving.residency import FOREVER
from model.messages import FinishReason, GenerateRequest, StepOutput

# llama-server's defaults that /infill's budget reads (its --batch-size and --n-predict)
SERVER_N_BATCH = 2048
SERVER_N_PREDICT = -1


class Kind(enum.Enum):
    LLAMA = "completion"  # llama-server's /completion
    OAI = "oai"  # /v1/completions
    INFILL = "infill"  # /infill: /completion's answer on a FIM prompt


async def completion(request, state):
    return await _complete(request, state, Kind.LLAMA)


async def completions_oai(request, state):
    return await _complete(request, state, Kind.OAI)


async def infill(request, state):
    return await _complete(request, state, Kind.INFILL)


def resolve_for(state, doc, by_name: bool):
    """The model a request is for, the body with a derived model's layer over it, and the context its
    prompt must fit in (a derived model's num_ctx above --ctx is a 400)."""
    resolved = state.registry.resolve_openai(doc.get("model") if by_name and isinstance(doc, dict) else None)
    n_ctx = state.residency.ctx
    if resolved.derived is not None and isinstance(doc, dict):
        layer = resolved.derived.layer
        doc = apply_openai(layer, doc)
        num_ctx = layer_num_ctx(layer)
        if num_ctx is not None and num_ctx > n_ctx:
            raise InvalidRequest(f"num_ctx {num_ctx} is larger than the context this server holds ({n_ctx}); "
                                 f"restart bankml serve with --ctx {num_ctx} if it fits in memory")
        n_ctx = min(n_ctx, num_ctx or n_ctx)
    return resolved, doc, n_ctx


def engine_sequences(loaded) -> int:
    """llama-server's n_parallel here: the sequences the model's engine decodes at once ([engine] max_seqs)."""
    engine = getattr(loaded.client.thread, "engine", None)
    return int(getattr(engine, "max_seqs", 1) or 1)


@dataclass(frozen=True)
class Answer:
    """One request's constants, repeated by each answer object or event."""

    kind: Kind
    id: str
    created: int
    model: str
    req: CompletionRequest
    settings: dict  # generation_settings (llama-server's task params, as written)


async def _complete(request, state, kind: Kind):
    body = request.body
    doc = await asyncio.to_thread(parse_body, body)  # off the loop: a 16 MiB body takes a while
    resolved, doc, n_ctx = resolve_for(state, doc, by_name=kind is Kind.OAI)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    req = None
    if kind is not Kind.INFILL:  # /infill's checks come after the model's own (gateway/openai/infill.py)
        req = await asyncio.to_thread(parse_completion, doc, defaults, oai=kind is Kind.OAI)
        check_n(req.n, state.residency.max_seqs)  # before the lease: a bad request loads nothing
        check_sequences(req.prompt, req.n, state.residency.max_sequences)
    async with state.residency.lease(pin) as held:
        loaded = held.loaded
        model = loaded.model
        n_ctx = min(n_ctx, model.n_ctx)
        if kind is Kind.INFILL:
            req, prompts = await asyncio.to_thread(_infill_prompts, model, doc, defaults, n_ctx)
        check_n(req.n, engine_sequences(loaded))
        if kind is not Kind.INFILL:
            prompts = await asyncio.to_thread(prompt_tokens, model, req.prompt)
        for ids in prompts:
            if len(ids) >= n_ctx:
                raise exceed_context(len(ids), n_ctx)
        shown = loaded.file_name if resolved.derived is None else resolved.tag
        prefix = "cmpl" if kind is Kind.OAI else "cmpl"
        answer = Answer(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), shown, req,
                        params_json(req.params, stream=req.stream, timings_per_token=req.timings_per_token))
        progress = req.return_progress and req.stream  # llama-server: progress is for streams only
        requests = [GenerateRequest(ids, req.params, request_id=f"{answer.id}-{i * req.n + j}",
                                    return_progress=progress, id_slot=req.id_slot)
                    for i, ids in enumerate(prompts) for j in range(req.n)]
        await attach_constraints(loaded, requests, req.grammar)  # a 400 before any model work
        texts = [model.tokenizer.decode(ids, True) for ids in prompts] if kind is not Kind.OAI else []
        # each clock starts as its sequence is handed over
        tallies = [Tally.start(body, state.receipt_key) for _ in requests]
        try:
            with state.monitoring.answer() as monitored:
                if req.echo:
                    return await _echoed(loaded, requests, answer, prompts, tallies, monitored)
                if req.stream:
                    return await _streamed(request, loaded, requests, answer, texts, tallies, monitored)
                return await _whole(loaded, requests, answer, texts, tallies, monitored)
        finally:
            state.residency.touch(pin.name, FOREVER)  # as /v1: kept resident


def _infill_prompts(model, doc, defaults, n_ctx: int) -> tuple[CompletionRequest, list[list[int]]]:
    from gateway.openai.infill import check_infill_body, infill_prompt, require_fim

    require_fim(model)
    if not isinstance(doc, dict):
        raise InvalidRequest("body is not a JSON object")
    check_infill_body(doc)
    req = parse_completion({"prompt": "", **doc}, defaults, oai=False)
    ids = infill_prompt(model, doc, n_ctx=n_ctx, n_batch=SERVER_N_BATCH, n_predict=SERVER_N_PREDICT)
    return req, [ids]


def _entry(out: StepOutput) -> dict:
    return logprob_entry(out.logprobs)


async def _whole(loaded, requests: list[GenerateRequest], a: Answer, texts: list[str], tallies: list[Tally],
                 monitored):
    done: list[Finished] = await whole(loaded, requests, _entry if a.req.params.n_probs > 0 else None)
    for f in done:
        monitored.record(metrics_model(loaded), f.last)
    n = a.req.n
    if a.kind is Kind.OAI:
        choices = []
        for j, f in enumerate(done):
            choice = w.oai_choice(j, f.text, f.last, f.entries)
            choice["bankml_receipt"] = answer_receipt(loaded, tallies[j], f.text, f.last, f.entries)
            choices.append(choice)
        res = w.oai_body(a.id, a.created, a.model, choices, done[0].last)
        if len(done) == 1:  # one answer: its receipt where every /v1 answer has it
            res["bankml_receipt"] = choices[0].pop("bankml_receipt")
        return json_response(jstr.dumps(res))
    objs = []
    for j, f in enumerate(done):
        obj = w.llama_final(j, f.last, content=f.text, tokens=f.tokens if a.req.return_tokens else [],
                            model=a.model, settings=a.settings, prompt=texts[j // n], has_new_line=f.has_new_line,
                            entries=f.entries)
        if a.req.response_fields:
            obj = w.nested_values(a.req.response_fields, obj)
        obj["bankml_receipt"] = answer_receipt(loaded, tallies[j], f.text, f.last, f.entries)
        objs.append(obj)
    return json_response(jstr.dumps(objs[0] if len(objs) == 1 else objs))


async def _echoed(loaded, requests: list[GenerateRequest], a: Answer, prompts: list[list[int]],
                  tallies: list[Tally], monitored):
    """/v1/completions with `echo` (gateway/openai/echo.py): each choice's text is its prompt's, then what was
    generated (nothing for max_tokens 0); with logprobs, the prompt's are scored by the engine first."""
    tokenizer = loaded.model.tokenizer
    echoed = prompt_texts(a.req.prompt, prompts, tokenizer)
    n_probs = a.req.params.n_probs
    scored: list[list] = []
    if n_probs > 0:
        engine_thread = loaded.client.thread
        for ids in prompts:
            scored.append(await loaded.client.call(partial(_score, engine_thread, ids, n_probs)))
    if a.req.params.max_tokens == 0:
        done = [Finished("", StepOutput(token=None, finish_reason=FinishReason.LENGTH,
                                        prompt_tokens=len(r.prompt_tokens))) for r in requests]
    else:
        done = await whole(loaded, requests, _entry if n_probs > 0 else None)
        for f in done:
            monitored.record(metrics_model(loaded), f.last)
    choices = []
    for j, f in enumerate(done):
        i = j // a.req.n  # its prompt
        text = echoed[i] + f.text
        logprobs = legacy_logprobs(tokenizer, prompts[i], scored[i], f.entries) if n_probs > 0 else None
        choice = {**w.oai_choice(j, text, f.last, None), "logprobs": logprobs}
        # the receipt hashes the legacy logprobs object, as sent
        choice["bankml_receipt"] = answer_receipt(loaded, tallies[j], text, f.last, [logprobs] if logprobs else [])
        choices.append(choice)
    res = w.oai_body(a.id, a.created, a.model, choices, done[0].last)
    if len(done) == 1:
        res["bankml_receipt"] = choices[0].pop("bankml_receipt")
    return json_response(jstr.dumps(res))


def _score(engine_thread, ids: list[int], n_probs: int) -> list:
    """On the engine thread: the prompt's teacher-forced logprobs (model/score.py)."""
    return engine_thread.engine.prompt_logprobs(ids, n_probs)


async def _streamed(request, loaded, requests: list[GenerateRequest], a: Answer, texts: list[str],
                    tallies: list[Tally], monitored):
    response = None
    n = a.req.n
    sent_entries: list[list[dict]] = [[] for _ in requests]
    has_new_line = [False] * len(requests)
    with_probs = a.req.params.n_probs > 0
    async with outputs(loaded, requests) as stream:
        async for i, out in stream:
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                await end_failed(response, loaded, out)
                return None  # the answer went out through `response`
            if response is None:
                response = await open_sse(request)
            if out.progress is not None:  # return_progress: how far the prompt has come
                await response.send(w.event(w.oai_progress(a.id, a.created, a.model, i, out) if a.kind is Kind.OAI
                                            else w.llama_progress(i, out)))
                continue
            if out.utf8_complete:  # llama-server's partial result for this token
                entries = [_entry(out)] if with_probs and out.logprobs is not None else []
                await response.send(w.event(_partial(a, i, out, entries)))
                tallies[i].sent(out.text)
                sent_entries[i] += entries
                has_new_line[i] = has_new_line[i] or "\n" in out.text
            if out.finish_reason is not None:
                tally = tallies[i]
                tally.answered(out)
                if sent_entries[i]:
                    tally.logprobs(sent_entries[i])
                monitored.record(metrics_model(loaded), out)
                # the receipt rides on the sequence's final event, which carries no text: after all of
                # it, and no event of its own (llama-server's clients read `stop` on every /completion
                # event, and `choices[0]` on every /v1/completions chunk)
                final = _final_event(a, i, out, texts, n, has_new_line[i])
                final["bankml_receipt"] = tally.receipt_for(loaded)
                await response.send(w.event(final))
        if response is not None:
            if a.kind is Kind.OAI:
                await response.send(DONE_EVENT)
            await response.eof()
    return None


def _partial(a: Answer, i: int, out: StepOutput, entries: list[dict]) -> dict:
    if a.kind is Kind.OAI:
        choice = w.oai_choice(i, out.text, None, entries)
        timed = w.partial_timings(out, a.req.timings_per_token)
        return w.oai_chunk(a.id, a.created, a.model, choice, out if timed else None)
    return w.llama_partial(i, out, with_timings=w.partial_timings(out, a.req.timings_per_token), entries=entries)


def _final_event(a: Answer, i: int, last: StepOutput, texts: list[str], n: int, has_new_line: bool) -> dict:
    if a.kind is Kind.OAI:
        return w.oai_body(a.id, a.created, a.model, [w.oai_choice(i, "", last, None)], last)
    obj = w.llama_final(i, last, content="", tokens=[], model=a.model, settings=a.settings,
                        prompt=texts[i // n], has_new_line=has_new_line, entries=None)
    return w.nested_values(a.req.response_fields, obj) if a.req.response_fields else obj
