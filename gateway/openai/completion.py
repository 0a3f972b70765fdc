"""`POST /completion` (and its alias `/completions`), `/v1/completions`, `/infill`: their requests read and
their answers written as llama-server's; everything between is the answer pipeline (serving/answer.py).

- the body (off the loop) and the model: `/completion` and `/infill` name none (the startup model, as
  llama-server serves its one model; `/completions` is llama-server's alias of /completion, not
  OpenAI's route); `/v1/completions` resolves `model` as `/v1/chat/completions` does (resolve.py);
- the fields (completion_request.parse_completion): llama-server's 400s (and its 500s for the OpenAI
  layer's refusals) before any model work, then ours; `n` against the engine's sequences, and the
  prompts x `n` against what one request may hand the engine ([engine] max_seqs + max_waiting);
- on the leased model, the prompts' tokens: /infill's FIM layout (infill.py, whose refusal of a model
  without FIM tokens comes first), else `prompt_tokens`; one sequence per prompt and per `n`;
- written as llama-server writes them (completion_writer.py): one object, or a list for several
  sequences (the OpenAI route: one object whose `choices` hold them all, as llama-server merges them),
  or SSE events as the tokens come; each sequence's receipt over the text exactly as sent (streamed: a
  key of its final event, which has no text).
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from functools import partial

from bankml import jstr
from bankml.errors import InvalidRequest
from gateway.http.body import parse_body
from gateway.http.errors import json_response, stream_error
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
from gateway.openai.resolve import resolve_for, shown_name
from gateway.serving.answer import Run, Work, answer, off_loop, open_sse
from gateway.serving.generation import Finished
from gateway.serving.request_fields import gguf_defaults
from gateway.serving.residency import FOREVER
from model.messages import FinishReason, StepOutput

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




async def _complete(request, state, kind: Kind):
    doc = await off_loop(parse_body, request.body)  # a 16 MiB body takes a while to parse
    resolved, doc, n_ctx = resolve_for(state, doc, by_name=kind is Kind.OAI)
    pin = resolved.pin
    defaults = pin.info.sampling if pin.info is not None else gguf_defaults({})
    req = None
    if kind is not Kind.INFILL:  # /infill's checks come after the model's own (infill.py)
        req = await off_loop(partial(parse_completion, oai=kind is Kind.OAI), doc, defaults)
        check_n(req.n, state.residency.max_seqs)  # before the lease: a bad request loads nothing
        check_sequences(req.prompt, req.n, state.residency.max_sequences)

    async def work(held) -> Work:
        loaded = held.loaded
        fitted = min(n_ctx, loaded.model.n_ctx)
        if kind is Kind.INFILL:
            r, prompts = await off_loop(_infill_prompts, loaded.model, doc, defaults, fitted)
            check_n(r.n, loaded.client.max_seqs)
        else:
            r = req
            check_n(r.n, loaded.client.max_seqs)
            prompts = await off_loop(prompt_tokens, loaded.model, r.prompt)
        texts = [] if kind is Kind.OAI else await off_loop(_decoded, loaded.model, prompts)
        writer = CompletionWriter(kind, f"cmpl-{uuid.uuid4().hex}", int(time.time()), shown_name(loaded, resolved), r,
                                  params_json(r.params, stream=r.stream, timings_per_token=r.timings_per_token,
                                              tokenizer=loaded.model.tokenizer,
                                              speculation=loaded.client.speculation),
                                  prompts, texts)
        ids = [f"{writer.id}-{k}" for k in range(len(prompts) * r.n)]
        return Work(prompts, r.params, ids, writer, r.stream and not r.echo, n=r.n, grammar=r.grammar, n_ctx=fitted,
                    progress=r.return_progress and r.stream,  # llama-server: progress is for streams only
                    id_slot=r.id_slot)

    return await answer(request, state, pin, FOREVER, work)  # as /v1: kept resident


def _infill_prompts(model, doc, defaults, n_ctx: int) -> tuple[CompletionRequest, list[list[int]]]:
    from gateway.openai.infill import check_infill_body, infill_prompt, require_fim

    require_fim(model)
    if not isinstance(doc, dict):
        raise InvalidRequest("body is not a JSON object")
    check_infill_body(doc)
    req = parse_completion({"prompt": "", **doc}, defaults, oai=False)
    ids = infill_prompt(model, doc, n_ctx=n_ctx, n_batch=SERVER_N_BATCH, n_predict=SERVER_N_PREDICT)
    return req, [ids]


def _decoded(model, prompts: list[list[int]]) -> list[str]:
    """Each prompt as llama-server's `prompt` field shows it (the OpenAI route has none)."""
    return [model.tokenizer.decode(ids, True) for ids in prompts]


def _entry(out: StepOutput) -> dict:
    return logprob_entry(out.logprobs)


@dataclass
class CompletionWriter:
    """One completion answer (serving/answer.py `Writer`): its constants, repeated by each object or event."""

    kind: Kind
    id: str
    created: int
    model: str
    req: CompletionRequest
    settings: dict  # generation_settings (llama-server's task params, as written)
    prompts: list[list[int]]
    texts: list[str]  # each prompt decoded, for llama-server's `prompt` field
    has_new_line: dict[int, bool] = field(default_factory=dict)  # streamed: a sent piece held a newline

    async def whole(self, run: Run):
        if self.req.echo:
            return await self._echoed(run)
        done: list[Finished] = await run.whole(_entry if self.req.params.n_probs > 0 else None)
        if self.kind is Kind.OAI:
            choices = []
            for j, f in enumerate(done):
                choice = w.oai_choice(j, f.text, f.last, f.entries)
                choice["bankml_receipt"] = run.receipt(j, f.text, f.last, f.entries)
                choices.append(choice)
            res = w.oai_body(self.id, self.created, self.model, choices, done[0].last)
            if len(done) == 1:  # one answer: its receipt where every /v1 answer has it
                res["bankml_receipt"] = choices[0].pop("bankml_receipt")
            return json_response(jstr.dumps(res))
        texts, n = self.texts, self.req.n
        objs = []
        for j, f in enumerate(done):
            obj = w.llama_final(j, f.last, content=f.text, tokens=f.tokens if self.req.return_tokens else [],
                                model=self.model, settings=self.settings, prompt=texts[j // n],
                                has_new_line=f.has_new_line, entries=f.entries)
            if self.req.response_fields:
                obj = w.nested_values(self.req.response_fields, obj)
            obj["bankml_receipt"] = run.receipt(j, f.text, f.last, f.entries)
            objs.append(obj)
        return json_response(jstr.dumps(objs[0] if len(objs) == 1 else objs))

    async def _echoed(self, run: Run):
        """/v1/completions with `echo` (echo.py): each choice's text is its prompt's, then what was
        generated (nothing for max_tokens 0); with logprobs, the prompt's are scored by the engine first."""
        tokenizer = run.loaded.model.tokenizer
        echoed = prompt_texts(self.req.prompt, self.prompts, tokenizer)
        n_probs = self.req.params.n_probs
        scored = [await run.loaded.client.prompt_logprobs(ids, n_probs) for ids in self.prompts] if n_probs > 0 else []
        if self.req.params.max_tokens == 0:
            done = [Finished("", StepOutput(token=None, finish_reason=FinishReason.LENGTH,
                                            prompt_tokens=len(r.prompt_tokens))) for r in run.requests]
        else:
            done = await run.whole(_entry if n_probs > 0 else None)
        choices = []
        for j, f in enumerate(done):
            i = j // self.req.n  # its prompt
            text = echoed[i] + f.text
            logprobs = legacy_logprobs(tokenizer, self.prompts[i], scored[i], f.entries) if n_probs > 0 else None
            choice = {**w.oai_choice(j, text, f.last, None), "logprobs": logprobs}
            # the receipt hashes the legacy logprobs object, as sent
            choice["bankml_receipt"] = run.receipt(j, text, f.last, [logprobs] if logprobs else [])
            choices.append(choice)
        res = w.oai_body(self.id, self.created, self.model, choices, done[0].last)
        if len(done) == 1:
            res["bankml_receipt"] = choices[0].pop("bankml_receipt")
        return json_response(jstr.dumps(res))

    async def open(self, request):
        return await open_sse(request)

    async def output(self, response, run: Run, i: int, out: StepOutput) -> None:
        if out.progress is not None:  # return_progress: how far the prompt has come
            await response.send(w.event(w.oai_progress(self.id, self.created, self.model, i, out)
                                        if self.kind is Kind.OAI else w.llama_progress(i, out)))
            return
        if out.utf8_complete:  # llama-server's partial result for this token
            entries = [_entry(out)] if self.req.params.n_probs > 0 and out.logprobs is not None else []
            await response.send(w.event(self._partial(i, out, entries)))
            run.sent(i, out.text, entries)
            self.has_new_line[i] = self.has_new_line.get(i, False) or "\n" in out.text

    async def last(self, response, run: Run, i: int, out: StepOutput, receipt: dict) -> None:
        # the receipt rides on the sequence's final event, which carries no text: after all of it, and no
        # event of its own (llama-server's clients read `stop` on every /completion event, and
        # `choices[0]` on every /v1/completions chunk)
        final = self._final_event(i, out)
        final["bankml_receipt"] = receipt
        await response.send(w.event(final))

    async def failed(self, response, error: Exception) -> None:
        await response.send(stream_error(error))

    async def close(self, response) -> None:
        if self.kind is Kind.OAI:
            await response.send(DONE_EVENT)

    def _partial(self, i: int, out: StepOutput, entries: list[dict]) -> dict:
        if self.kind is Kind.OAI:
            choice = w.oai_choice(i, out.text, None, entries)
            timed = w.partial_timings(out, self.req.timings_per_token)
            return w.oai_chunk(self.id, self.created, self.model, choice, out if timed else None)
        return w.llama_partial(i, out, with_timings=w.partial_timings(out, self.req.timings_per_token),
                               entries=entries)

    def _final_event(self, i: int, last: StepOutput) -> dict:
        if self.kind is Kind.OAI:
            return w.oai_body(self.id, self.created, self.model, [w.oai_choice(i, "", last, None)], last)
        obj = w.llama_final(i, last, content="", tokens=[], model=self.model, settings=self.settings,
                            prompt=self.texts[i // self.req.n], has_new_line=self.has_new_line.get(i, False),
                            entries=None)
        return w.nested_values(self.req.response_fields, obj) if self.req.response_fields else obj
