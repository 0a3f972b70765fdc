"""The one answer pipeline: chat, /completion, /v1/completions, /infill, Ollama's chat and generate.

A dialect (gateway/openai, gateway/ollama) reads its request, off the loop, and hands `answer` the model,
how long to keep it, and `work`: what it asks of the leased model. The rest is here, once:

    lease the model (residency.py: verified, loaded if it was not resident; 503 and no receipt else)
    -> work(held): the dialect's checks against the engine, the prompts' tokens (off the loop), its writer
    -> every prompt shorter than the context (llama-server's exceed-context 400)
    -> the constraints attached (a 400 before any model work): on a thinking template, the request's grammar
       applies after the thought, and a reasoning budget closes it (reasoning.constrain)
    -> every sequence handed to the engine at once, all or none (generation.py), and read whole or as
       it comes; the writer writes (a JSON body, SSE events, NDJSON lines) and says what it sent
    -> each sequence's /bankml/metrics record and its receipt over exactly what was sent
    -> release, then touch (keep the model keep_s longer; 0 unloads it once no answer holds it).

A client that goes away cancels the handler; leaving the generations cancels every sequence before the
engine's next decode step, and the monitor counts the answer as abandoned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.http.errors import exceed_context
from gateway.monitor.monitoring import Answer
from gateway.serving.constraints import attach_constraints
from gateway.serving.engine_client import engine_error
from gateway.serving.generation import Entry, Finished, outputs, whole
from gateway.serving.reasoning import constrain, opened, thought_tags
from gateway.serving.receipt import Tally
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput


class Writer(Protocol):
    """A dialect's answer: one body, or a stream it opens, writes output by output, and closes."""

    async def whole(self, run: Run) -> Any: ...  # the response (it reads the sequences: run.whole)

    async def open(self, request) -> Any: ...  # the stream's head, sent with the first output

    async def output(self, response, run: Run, i: int, out: StepOutput) -> None: ...  # run.sent(...)

    async def last(self, response, run: Run, i: int, out: StepOutput, receipt: dict) -> None: ...

    async def failed(self, response, error: Exception) -> None: ...  # after the head: the error in-stream

    async def close(self, response) -> None: ...  # after every sequence's last output, before the end


@dataclass
class Work:
    """What a dialect asks of the leased model: one sequence per prompt and per `n` (index prompt * n + j)."""

    prompts: list[list[int]]
    params: SamplingParams
    ids: list[str]  # each sequence's request id
    writer: Writer
    stream: bool
    n: int = 1
    grammar: Any = None
    n_ctx: int | None = None  # every prompt must be shorter; None: the dialect fitted them itself
    progress: bool = False
    id_slot: int = -1  # llama-server's id_slot; -1: any free slot (what the scheduler reads)
    reasoning: Any = None  # reasoning.Reasoning: how the answer thinks (its budget enforced here); None: as the template

    def requests(self) -> list[GenerateRequest]:
        return [GenerateRequest(ids, self.params, request_id=self.ids[i * self.n + j], return_progress=self.progress,
                                id_slot=self.id_slot)
                for i, ids in enumerate(self.prompts) for j in range(self.n)]


@dataclass
class Run:
    """One answer on its way: the leased model, its sequences, their tallies, the monitor's record."""

    held: Any  # residency.Held
    requests: list[GenerateRequest]
    tallies: list[Tally]
    monitored: Answer
    sent_entries: list[list[dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sent_entries = [[] for _ in self.requests]

    @property
    def loaded(self):
        return self.held.loaded

    async def whole(self, entry: Entry | None = None) -> list[Finished]:
        """Every sequence to its end (generation.whole), each recorded for /bankml/metrics."""
        done = await whole(self.loaded, self.requests, entry)
        for f in done:
            self.monitored.record(metrics_model(self.loaded), f.last)
        return done

    def receipt(self, i: int, text: str, last: StepOutput, entries: list | None = None) -> dict:
        """A whole answer's receipt: the text as sent, its logprob entries (if any), the engine's counts."""
        tally = self.tallies[i]
        tally.sent(text)
        if entries:
            tally.logprobs(entries)
        tally.answered(last)
        return tally.receipt_for(self.loaded)

    def sent(self, i: int, text: str = "", entries: list[dict] | None = None) -> None:
        """A streamed piece of sequence `i` went out: its text and logprob entries, for its receipt."""
        self.tallies[i].sent(text)
        self.sent_entries[i] += entries or []

    def finished(self, i: int, last: StepOutput) -> dict:
        """Sequence `i` streamed to its end: its record for /bankml/metrics, and its receipt."""
        tally = self.tallies[i]
        tally.answered(last)
        if self.sent_entries[i]:
            tally.logprobs(self.sent_entries[i])
        self.monitored.record(metrics_model(self.loaded), last)
        return tally.receipt_for(self.loaded)


async def answer(request, state, pin, keep_s: float, work: Callable[[Any], Awaitable[Work]]):
    """The answer to one text request (the module's docstring); `work(held)` is the dialect's part."""
    residency = state.residency
    try:
        async with residency.lease(pin) as held:
            w = await work(held)
            n_ctx = None if w.n_ctx is None else min(w.n_ctx, held.loaded.model.n_ctx)
            for ids in w.prompts if n_ctx is not None else ():
                if len(ids) >= n_ctx:
                    raise exceed_context(len(ids), n_ctx)
            requests = w.requests()
            await attach_constraints(held.loaded, requests, _grammar(held.loaded, w))  # a 400 before any model work
            tallies = [Tally.start(request.body, state.receipt_key) for _ in requests]  # each clock starts now
            with state.monitoring.answer() as monitored:
                run = Run(held, requests, tallies, monitored)
                if w.stream:
                    return await _streamed(request, run, w.writer)
                return await w.writer.whole(run)
    finally:
        residency.touch(pin.name, keep_s)  # once the lease is given back, as Ollama's scheduler does


def _grammar(loaded, w: Work) -> str | None:
    """The work's grammar, after the thought of a thinking template and with its budget (reasoning.py)."""
    if w.reasoning is None:
        return w.grammar
    tags = thought_tags(loaded.model.chat_template)
    started = tags is not None and opened(loaded.model.tokenizer, w.prompts[0], tags)
    return constrain(w.reasoning, tags, started, w.grammar)


async def _streamed(request, run: Run, writer: Writer) -> None:
    """The sequences' outputs as they come; the head goes out with the first, so a failure before it is
    still an ordinary error status (503 when the engine thread is gone, else 500), and after it an error
    in the stream and its end (no receipt for a failed answer)."""
    response = None
    async with outputs(run.loaded, run.requests) as stream:
        async for i, out in stream:
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                error = engine_error(run.loaded.client, out)
                if response is None:
                    raise error
                await writer.failed(response, error)
                await response.eof()
                return None
            if response is None:
                response = await writer.open(request)
            await writer.output(response, run, i, out)
            if out.finish_reason is not None:
                await writer.last(response, run, i, out, run.finished(i, out))
        if response is not None:
            await writer.close(response)
            await response.eof()
    return None  # the answer went out through `response`


async def off_loop(fn: Callable, *args) -> Any:
    """`fn(*args)` on a worker thread: templates, tokens and a hundred tools' grammar take a while, and
    other clients must not wait for them."""
    return await asyncio.to_thread(fn, *args)


def metrics_model(loaded) -> str:
    """The /bankml/metrics record's model: the file stem, its case kept."""
    return loaded.file_name.removesuffix(".gguf")


async def open_sse(request):
    """The head of an SSE answer."""
    return await request.respond(content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
