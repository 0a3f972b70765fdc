"""The engine handle (engine_handle.EngineHandle) over the engine thread: the bridge from the event loop.

Each generation gets its own asyncio.Queue. The engine thread's emit callback puts each `StepOutput`
on it with `loop.call_soon_threadsafe`, so the handler awaits its outputs without polling and without
ever blocking the loop. Leaving the `async with` block (the answer is complete, the client went away
and Sanic cancelled the handler, or the handler failed) cancels the generation: the engine thread
sees the flag before its next decode step. Everything else that touches the engine (loading and
warming it, a prompt's logprobs, embeddings, slot files) runs on its thread through `call`, between
two iterations; this class is the only gateway code that holds the engine.

No jax here: the thread and the engine live in model/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TypeVar

import numpy as np

from bankml.errors import EngineFailed, EngineGone
from gateway.serving.engine_handle import Build, EmbeddingShape, EngineHandle, EngineLoad, ServedEngine
from model import device_budget
from model.engine_thread import EnergyMeter, EngineThread, Ticket
from model.messages import EngineStats, GenerateRequest, StepOutput
from model.slot_file import Expect, Slot
from model.speculative import Speculation

T = TypeVar("T")


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
    """The engine handle (engine_handle.EngineHandle) over the engine thread it owns."""

    def __init__(self, thread: EngineThread):
        self._thread = thread
        self._max_seqs: int | None = None  # the installed engine's, kept once it is gone (/props still says)

    @classmethod
    def start(cls, name: str, max_waiting: int) -> EngineClient:
        """A new engine thread, with no engine yet (`load` installs one)."""
        return cls(EngineThread(name=name, max_waiting=max_waiting))

    @property
    def thread(self) -> EngineThread:
        """The thread itself: for the tests, and gateway/monitor/monitoring.py until it asks `stats()` here."""
        return self._thread

    # --- generations -------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> _Submitted:
        """`async with client.generate(req) as gen: async for out in gen: ...`"""
        return _Submitted(self._thread, request)

    def generate_all(self, requests: list[GenerateRequest]) -> _SubmittedAll:
        """`async with client.generate_all(reqs) as gens:` every request queued at once, or none
        (Overloaded when the engine's queue has no room for all of them)."""
        return _SubmittedAll(self._thread, requests)

    # --- the thread's state ------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        return self._thread.failure

    def stats(self) -> EngineStats | None:
        """The scheduler's last snapshot, or None: no engine has run, or the thread is gone."""
        return self._thread.stats()

    def stalled_s(self) -> float:
        """How long the engine thread has had work without completing a step or a job (0: idle or moving)."""
        return self._thread.stalled_s()

    def in_flight(self) -> tuple[int, int]:
        return self._thread.in_flight()

    @property
    def max_seqs(self) -> int:
        engine = self._thread.engine
        if engine is not None:
            self._max_seqs = int(engine.max_seqs)
        if self._max_seqs is None:
            raise RuntimeError("no engine was ever installed on this thread")
        return self._max_seqs

    def free_slots(self) -> int:
        return self._engine().free_slots()

    @property
    def has_engine(self) -> bool:
        return self._thread.engine is not None

    def set_meter(self, meter: EnergyMeter | None) -> None:
        self._thread.meter = meter

    # --- work on the engine thread -----------------------------------------------------------------

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, between two iterations, and await its result (EngineThreadFailed:
        the thread is gone)."""
        return await asyncio.wrap_future(self._thread.call(fn))

    async def call_when(self, fn: Callable[[], T], ready: Callable[[], bool]) -> T:
        """`call`, run once `ready()` holds on the engine thread (EngineThread.call)."""
        return await asyncio.wrap_future(self._thread.call(fn, ready))

    async def prompt_logprobs(self, ids: list[int], n_probs: int) -> list:
        return await self.call(lambda: self._engine().prompt_logprobs(ids, n_probs))

    async def embedding_shape(self) -> EmbeddingShape:
        def read() -> EmbeddingShape:
            engine = self._engine()
            return EmbeddingShape(engine.pooling, engine.n_embd, engine.n_vocab)

        return await self.call(read)

    async def embed(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        return await self.call(lambda: self._engine().embed(token_lists))

    def slot_busy(self, slot: int) -> bool:
        return self._engine().scheduler.slot_busy(slot)

    async def slot_expect(self, model_sha256: str) -> Expect:
        return await self.call(lambda: self._engine().slot_expect(model_sha256))

    async def save_slot(self, slot: int) -> Slot:
        return await self._when_idle(slot, lambda: self._engine().save_slot(slot))

    async def restore_slot(self, slot: int, restored: Slot | None) -> int:
        return await self._when_idle(slot, lambda: self._engine().restore_slot(slot, restored))

    async def erase_slot(self, slot: int) -> int:
        return await self._when_idle(slot, lambda: self._engine().erase_slot(slot))

    async def _when_idle(self, slot: int, fn: Callable[[], T]) -> T:
        # llama-server defers a slot's task until its sequence ends: the thread runs it once the slot is idle
        return await self.call_when(fn, lambda: not self.slot_busy(slot))

    def _engine(self) -> ServedEngine:
        engine = self._thread.engine
        if engine is None:  # unloaded meanwhile (only a changed file drops a held model): a 500, as before
            raise RuntimeError("no model is loaded on this engine thread")
        return engine  # type: ignore[return-value]  (the thread's BatchEngine is the ServedEngine we installed)

    # --- reports -----------------------------------------------------------------------------------

    @property
    def cache_type(self) -> str | None:
        engine = self._thread.engine
        return str(engine.cache_type) if engine is not None else None  # type: ignore[union-attr]

    @property
    def speculation(self) -> Speculation | None:
        engine = self._thread.engine
        return engine.speculation if engine is not None else None  # type: ignore[union-attr]

    def weights_report(self) -> dict | None:
        engine = self._thread.engine
        return engine.weights_report() if engine is not None else None  # type: ignore[union-attr]

    # --- its life ------------------------------------------------------------------------------------

    async def load(self, build: Build) -> EngineLoad:
        return await self.call(partial(self._install, build))

    def load_blocking(self, build: Build) -> EngineLoad:
        return self._thread.call(partial(self._install, build)).result()

    def _install(self, build: Build) -> EngineLoad:
        """On the engine thread: build, install, warm, and read what the engine holds."""
        engine, backend = build()
        self._thread.set_engine(engine)
        self._max_seqs = int(engine.max_seqs)
        compile_s = float(engine.warmup())
        size = int(engine.memory_bytes())
        return EngineLoad(backend, compile_s, size, _on_accelerator(engine), engine.tokenizer, int(engine.n_ctx))

    def compile_rest(self) -> None:
        engine = self._thread.engine
        if engine is not None:
            engine.compile_in_background()  # type: ignore[union-attr]

    async def unload(self) -> None:
        thread = self._thread
        thread.call(partial(thread.set_engine, None))
        await asyncio.to_thread(thread.stop)

    def stop(self) -> None:
        self._thread.stop()


def _on_accelerator(engine: ServedEngine) -> bool:
    """Whether the engine's arrays live on a GPU. model.engine.Engine does not say (JAX's device does);
    an engine that says so itself is believed: the tests' fakes run on the CPU, whatever device a JAX
    imported by another test in the process found."""
    flag = getattr(engine, "on_accelerator", None)
    if flag is not None:
        return bool(flag)
    return device_budget.engine_platform() == "gpu"


def engine_error(client: EngineHandle, out: StepOutput) -> EngineFailed | EngineGone:
    """An answer's engine failure: 503 when the model's engine thread is gone (nothing will answer), else
    500; with the reason."""
    why = out.error or "the engine failed"
    if client.failure is not None:
        return EngineGone(why)
    return EngineFailed(why)
