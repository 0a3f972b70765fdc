"""The one thread that owns the device.

A request's path through it: the gateway calls `submit(request, emit)`; the job waits in a FIFO queue;
the thread runs `engine.generate(...)` one step at a time and hands each `StepOutput` to `emit` (the
gateway's emit puts it on that request's own asyncio queue with `call_soon_threadsafe`). Between two
steps the thread looks at the job's cancel flag, so a client that went away stops its generation within
one decode step and frees the engine for the next request. Loading, warming and unloading a model run
on this thread too (`call`), so nothing else ever touches device memory.

Failures never hang a client: an exception inside one generation ends that request with
`FinishReason.ERROR` and the reason; anything that kills the thread itself marks it failed, and every
waiting and later job is answered with that reason at once.

No sanic here, and no jax import at module level: the gateway imports this module, and JAX is only
imported by the engine the loader builds.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bankml.errors import InvalidRequest
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput

log = logging.getLogger(__name__)


class GeneratingEngine(Protocol):
    """What the thread needs from an engine (model.engine.Engine has it)."""

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]: ...


class EngineThreadFailed(RuntimeError):
    """The engine thread is gone; the message says why."""


Emit = Callable[[StepOutput], None]


@dataclass
class _Generate:
    request: GenerateRequest
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


_STOP = object()


class Ticket:
    """A submitted generation; `cancel()` aborts it before its next decode step (or before it starts)."""

    def __init__(self, job: _Generate):
        self._job = job

    def cancel(self) -> None:
        self._job.cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._job.cancelled.is_set()


class EngineThread:
    """A FIFO of jobs run one at a time on a single daemon thread.

    `engine` is whatever the last `call` installed with `set_engine` (None: no model loaded); a
    generation submitted while it is None ends at once with an ERROR output.
    """

    def __init__(self, name: str = "bankml-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `failure` against enqueueing
        self.engine: GeneratingEngine | None = None
        self.failure: str | None = None
        self.busy_since: float | None = None  # perf_counter() when the running job started
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- called from any thread ------------------------------------------------------------------

    def submit(self, request: GenerateRequest, emit: Emit) -> Ticket:
        job = _Generate(request, emit)
        with self._lock:
            failure = self.failure
            if failure is None:
                self._jobs.put(job)
        if failure is not None:
            emit(_error(request, f"the engine thread stopped: {failure}"))
        return Ticket(job)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread, after the jobs already queued; its result in a Future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            failure = self.failure
            if failure is None:
                self._jobs.put(_Call(fn, future))
        if failure is not None:
            future.set_exception(EngineThreadFailed(failure))
        return future

    def set_engine(self, engine: GeneratingEngine | None) -> None:
        """Install (or drop, with None) the engine; only from a function passed to `call`."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("set_engine runs on the engine thread (pass it to call)")
        self.engine = engine

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the running job, drop the engine, end the thread."""
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    # --- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        job = None
        try:
            while True:
                job = None
                job = self._jobs.get()
                if job is _STOP:
                    self.engine = None
                    return
                self.busy_since = time.perf_counter()
                try:
                    if isinstance(job, _Call):
                        self._run_call(job)
                    else:
                        self._run_generate(job)
                finally:
                    self.busy_since = None
        except BaseException as e:  # the thread is dying: answer everyone, never leave them waiting
            why = _why(e)
            log.error("the engine thread stopped: %s", why)
            with self._lock:
                self.failure = why
            self.engine = None
            if isinstance(job, _Call) and not job.future.done():
                job.future.set_exception(EngineThreadFailed(why))
            elif isinstance(job, _Generate):
                job.emit(_error(job.request, why))
            self._fail_waiting(why)

    def _fail_waiting(self, why: str) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Call):
                job.future.set_exception(EngineThreadFailed(why))
            elif isinstance(job, _Generate):
                job.emit(_error(job.request, f"the engine thread stopped: {why}"))

    @staticmethod
    def _run_call(job: _Call) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn())
        except Exception as e:
            job.future.set_exception(e)

    def _run_generate(self, job: _Generate) -> None:
        request = job.request
        if job.cancelled.is_set():
            job.emit(StepOutput(token=None, finish_reason=FinishReason.ABORT))
            return
        engine = self.engine
        if engine is None:
            job.emit(_error(request, "no model is loaded"))
            return
        t0 = time.perf_counter()
        t_first: float | None = None
        try:
            steps = engine.generate(request.prompt_tokens, request.params,
                                    request_id=request.request_id or "generate")
        except Exception as e:
            job.emit(_error(request, _why(e)))
            return
        try:
            while True:
                try:
                    out = next(steps)
                except StopIteration:
                    # a generator that ends without a finish reason is an engine bug: say so
                    job.emit(_error(request, "the engine ended the generation without a finish reason"))
                    return
                except Exception as e:
                    log.exception("generation failed")
                    job.emit(_error(request, _why(e)))
                    return
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                if out.finish_reason is not None:
                    job.emit(replace(out, prompt_ms=(t_first - t0) * 1e3, predicted_ms=(now - t_first) * 1e3))
                    return
                job.emit(out)
                if job.cancelled.is_set():
                    log.info("%s aborted after %d tokens: its client went away", request.request_id,
                             out.completion_tokens)
                    job.emit(replace(out, token=None, text="", finish_reason=FinishReason.ABORT,
                                     prompt_ms=(t_first - t0) * 1e3, predicted_ms=(now - t_first) * 1e3))
                    return
        finally:
            steps.close()  # frees the engine's slot (Engine.generate cancels in its finally)


def _error(request: GenerateRequest, why: str) -> StepOutput:
    return StepOutput(token=None, finish_reason=FinishReason.ERROR, error=why,
                      prompt_tokens=len(request.prompt_tokens))


def _why(e: BaseException) -> str:
    # an InvalidRequest (model.engine.EngineError is one) is the engine refusing a request: its message
    # is the reason; anything else (a ValueError from numpy or jax included) is a failure, named by its type
    if isinstance(e, InvalidRequest) and str(e):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def load_engine(path: str, *, n_ctx: int, n_slots: int, prefill_chunk: int,
                compile_cache_dir: str | None) -> tuple[Any, str]:
    """`Engine.load` on a verified file, unwarmed (the caller warms it and logs the time); call it on the
    engine thread. Returns the engine and a few words on the backend for the receipts' "engine"."""
    import jax

    from model.engine import Engine

    engine = Engine.load(path, verified=True, n_ctx=n_ctx, n_slots=n_slots, warmup=False,
                         prefill_chunk=prefill_chunk, compile_cache_dir=compile_cache_dir)
    return engine, f"JAX {jax.__version__} on {jax.default_backend()}"
