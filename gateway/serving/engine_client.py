"""The bridge from the event loop to the engine thread.

Each generation gets its own asyncio.Queue. The engine thread's emit callback puts each `StepOutput`
on it with `loop.call_soon_threadsafe`, so the handler awaits its outputs without polling and without
ever blocking the loop. Leaving the `async with` block (the answer is complete, the client went away
and Sanic cancelled the handler, or the handler failed) cancels the generation: the engine thread
sees the flag before its next decode step.

No jax here: the thread and the engine live in model/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from bankml.errors import EngineFailed, EngineGone
from model.engine_thread import EngineThread, Ticket
from model.messages import EngineStats, GenerateRequest, StepOutput


class Generation:
    """One submitted request: iterate its outputs; the last one has a finish_reason."""

    def __init__(self, queue: asyncio.Queue, ticket: Ticket):
        self._queue = queue
        self._ticket = ticket
        self.done = False

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[StepOutput]:
        while not self.done:
            out: StepOutput = await self._queue.get()
            if out.finish_reason is not None:
                self.done = True
            yield out

    def cancel(self) -> None:
        self._ticket.cancel()


class _Submitted:
    def __init__(self, thread: EngineThread, request: GenerateRequest):
        self._thread = thread
        self._request = request
        self._generation: Generation | None = None

    async def __aenter__(self) -> Generation:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(out: StepOutput) -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the loop is closed: the server is stopping, nobody is listening
                pass

        self._generation = Generation(queue, self._thread.submit(self._request, emit))
        return self._generation

    async def __aexit__(self, *exc) -> None:
        if self._generation is not None and not self._generation.done:
            self._generation.cancel()


class _SubmittedAll:
    """Several generations submitted together (engine_thread.submit_all: all or none); leaving the block
    cancels every one not done."""

    def __init__(self, thread: EngineThread, requests: list[GenerateRequest]):
        self._thread = thread
        self._requests = requests
        self._generations: list[Generation] = []

    async def __aenter__(self) -> list[Generation]:
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in self._requests]

        def emitter(queue: asyncio.Queue) -> Callable[[StepOutput], None]:
            def emit(out: StepOutput) -> None:  # runs on the engine thread
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                except RuntimeError:  # the loop is closed: the server is stopping
                    pass
            return emit

        tickets = self._thread.submit_all([(r, emitter(q)) for r, q in zip(self._requests, queues, strict=True)])
        self._generations = [Generation(q, t) for q, t in zip(queues, tickets, strict=True)]
        return self._generations

    async def __aexit__(self, *exc) -> None:
        for generation in self._generations:
            if not generation.done:
                generation.cancel()


class EngineClient:
    def __init__(self, thread: EngineThread):
        self.thread = thread

    def generate(self, request: GenerateRequest) -> _Submitted:
        """`async with client.generate(req) as gen: async for out in gen: ...`"""
        return _Submitted(self.thread, request)

    def generate_all(self, requests: list[GenerateRequest]) -> _SubmittedAll:
        """`async with client.generate_all(reqs) as gens:` every request queued at once, or none
        (Overloaded when the engine's queue has no room for all of them)."""
        return _SubmittedAll(self.thread, requests)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (load, warm, unload) and await its result."""
        return await asyncio.wrap_future(self.thread.call(fn))

    async def call_when(self, fn: Callable[[], Any], ready: Callable[[], bool]) -> Any:
        """`call`, run once `ready()` holds on the engine thread (EngineThread.call)."""
        return await asyncio.wrap_future(self.thread.call(fn, ready))

    @property
    def failure(self) -> str | None:
        return self.thread.failure

    def stats(self) -> EngineStats | None:
        """The scheduler's last snapshot, or None: no engine has run, or the thread is gone."""
        return self.thread.stats()


def engine_error(client: EngineClient, out: StepOutput) -> EngineFailed | EngineGone:
    """An answer's engine failure: 503 when the model's engine thread is gone (nothing will answer), else
    500; with the reason."""
    why = out.error or "the engine failed"
    if client.failure is not None:
        return EngineGone(why)
    return EngineFailed(why)
