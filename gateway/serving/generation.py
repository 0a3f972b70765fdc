"""Reading the engine: the sequences of one answer (serving/answer.py, the pipeline every text route runs).

The pipeline hands one or more `GenerateRequest`s to the model's engine queue (engine_client.py), all of
them at once, so the engine batches them as sequences of one decode step (llama-server posts one task
per prompt and per `n`, server-context.cpp `handle_completions_impl`). Then either
- `whole(...)`: each sequence read to its end (`Finished`: the text llama-server's non-streamed
  content holds, i.e. what was released and then what was held back at the end; the logprob entries
  less the stop word's own; the token ids; the last output), in request order; or
- `outputs(...)`: every sequence's outputs as they come, tagged with the sequence's index, for a
  route that writes them as SSE events.
A failed sequence is the engine's error (engine_error: 503 when its thread is gone, else 500); leaving
either one cancels every sequence still running, before the engine's next decode step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from gateway.serving.engine_client import engine_error
from model.messages import FinishReason, GenerateRequest, StepOutput

Entry = Callable[[StepOutput], dict]  # a logprob entry as the route writes it


@dataclass
class Finished:
    """One sequence read to its end."""

    text: str
    last: StepOutput
    tokens: list[int] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    has_new_line: bool = False  # llama-server's: a released piece held a newline
    pieces: list[str] = field(default_factory=list)  # each output's text, in order (a thought's tokens are counted by it)


def completed(out: StepOutput | None) -> bool:
    return out is not None and out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def empty_answer() -> StepOutput:
    """llama-server's answer to an empty prompt (server-context.cpp: "empty prompt - releasing slot"):
    nothing generated, stop_type "none", never handed to the engine (a sequence needs a token)."""
    return StepOutput(token=None, finish_reason=FinishReason.LENGTH, stop_type="none", utf8_complete=False)


async def _read(loaded, generation, entry: Entry | None) -> Finished:
    pieces: list[str] = []
    tokens: list[int] = []
    entries: list[dict] = []
    last: StepOutput | None = None
    async for out in generation:
        pieces.append(out.text)
        if out.token is not None:
            tokens.append(out.token)
        if entry is not None and out.logprobs is not None:
            entries.append(entry(out))
        last = out
    if not completed(last):
        raise engine_error(loaded.client, last or StepOutput(token=None))
    if last.logprobs_trim:  # the stop word's own tokens, as llama-server trims them
        entries = entries[:max(0, len(entries) - last.logprobs_trim)]
    released = "".join(pieces)
    return Finished(released + last.held_text, last, tokens, entries, "\n" in released, pieces)


async def whole(loaded, requests: list[GenerateRequest], entry: Entry | None = None) -> list[Finished]:
    """Every sequence to its end, submitted together (all or none: the engine's queue refuses a list it
    has no room for before any is queued); the first failure fails the answer (and cancels the others:
    gather cancels its tasks, and leaving `generate_all` cancels every sequence not done)."""
    live = [r for r in requests if r.prompt_tokens]  # an empty prompt is answered here, never queued
    async with loaded.client.generate_all(live) as generations:
        queued = iter(generations)

        async def empty() -> Finished:
            return Finished("", empty_answer())

        tasks = [asyncio.ensure_future(_read(loaded, next(queued), entry) if r.prompt_tokens else empty())
                 for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()


@asynccontextmanager
async def outputs(loaded, requests: list[GenerateRequest]) -> AsyncIterator[AsyncIterator[tuple[int, StepOutput]]]:
    """`async with outputs(loaded, reqs) as stream: async for index, out in stream: ...` (each
    sequence's outputs in order, the sequences interleaved as the engine makes them; the stream ends
    when every sequence has its last output)."""
    indices = [i for i, r in enumerate(requests) if r.prompt_tokens]
    async with loaded.client.generate_all([requests[i] for i in indices]) as queued:
        generations = dict(zip(indices, queued, strict=True))
        if len(requests) == 1 and generations:  # the common case: no merging task
            async def single() -> AsyncIterator[tuple[int, StepOutput]]:
                async for out in generations[0]:
                    yield 0, out

            yield single()
            return
        queue: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(requests):
            if not r.prompt_tokens:  # answered at once, first (llama-server releases its slot at once)
                queue.put_nowait((i, empty_answer()))

        async def pump(i: int, generation) -> None:
            async for out in generation:
                queue.put_nowait((i, out))

        pumps = [asyncio.ensure_future(pump(i, g)) for i, g in generations.items()]

        async def merged() -> AsyncIterator[tuple[int, StepOutput]]:
            left = len(requests)
            while left:
                i, out = await queue.get()
                if out.finish_reason is not None:
                    left -= 1
                yield i, out

        try:
            yield merged()
        finally:
            for p in pumps:
                p.cancel()
