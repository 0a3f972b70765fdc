"""The one thread that owns the device.

A request's path through it: the gateway calls `submit(request, emit)`; the request waits in a FIFO
queue; the thread runs `engine.generate(...)` one step at a time and hands each `StepOutput` to `emit`
(the gateway's emit puts it on that request's own asyncio queue with `call_soon_threadsafe`). Between
two steps the thread looks at the request's cancel flag, so a client that went away stops its
generation within one decode step and frees the engine for the next request. Loading, warming and
unloading a model run on this thread too (`call`), so nothing else ever touches device memory.

The thread also measures: it stamps each request's `Timeline` (queued, its turn, first token, first
text, end) and reads the energy `meter` around each generation, and puts both on the final output, so
the gateway's monitor never queues work here. `in_flight()` counts the requests running and waiting.

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
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput, Timeline

log = logging.getLogger(__name__)


class GeneratingEngine(Protocol):
    """What the thread needs from an engine (model.engine.Engine has it)."""

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]: ...


class EnergyMeter(Protocol):
    """What the thread needs from an energy meter (gpu_monitor.energy.EnergyMeter has it)."""

    def start(self) -> Any: ...

    def stop(self, mark: Any) -> Any: ...

    def cancel(self, mark: Any) -> None: ...


class EngineThreadFailed(RuntimeError):
    """The engine thread is gone; the message says why."""


Emit = Callable[[StepOutput], None]


@dataclass
class _Generate:
    request: GenerateRequest
    emit: Emit
    queued_s: float = field(default_factory=time.perf_counter)
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
    generation submitted while it is None ends at once with an ERROR output. `meter` (None: energy
    unmeasured) is set once, before the first request.
    """

    def __init__(self, name: str = "bankml-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `failure` against enqueueing; guards the counts
        self.engine: GeneratingEngine | None = None
        self.meter: EnergyMeter | None = None
        self.failure: str | None = None
        self._running = 0
        self._waiting = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- called from any thread ------------------------------------------------------------------

    def submit(self, request: GenerateRequest, emit: Emit) -> Ticket:
        job = _Generate(request, emit)
        with self._lock:
            failure = self.failure
            if failure is None:
                self._waiting += 1
                self._jobs.put(job)
        if failure is not None:
            emit(_error(request, f"the engine thread stopped: {failure}"))
        return Ticket(job)

    def in_flight(self) -> tuple[int, int]:
        """(running, waiting) generations. A request's final output is emitted after it left them."""
        with self._lock:
            return self._running, self._waiting

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
                if isinstance(job, _Call):
                    self._run_call(job)
                else:
                    self._run_generate(job)
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
                self._count(waiting=-1)
                job.emit(_error(job.request, f"the engine thread stopped: {why}"))

    def _count(self, *, running: int = 0, waiting: int = 0) -> None:
        with self._lock:
            self._running += running
            self._waiting += waiting

    @staticmethod
    def _run_call(job: _Call) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn())
        except Exception as e:
            job.future.set_exception(e)

    def _run_generate(self, job: _Generate) -> None:
        self._count(waiting=-1)
        if job.cancelled.is_set():
            job.emit(StepOutput(token=None, finish_reason=FinishReason.ABORT))
            return
        engine = self.engine
        if engine is None:
            job.emit(_error(job.request, "no model is loaded"))
            return
        self._count(running=1)
        try:  # leaves the count before the final output goes out, and when the thread dies
            last = self._generate(job, engine)
        finally:
            self._count(running=-1)
        job.emit(last)

    def _generate(self, job: _Generate, engine: GeneratingEngine) -> StepOutput:
        """Emit a generation's outputs but the last, which it returns stamped with its timeline and,
        when it completed, its energy."""
        request = job.request
        started_s = time.perf_counter()
        meter = _Metering(self.meter)
        try:
            steps = engine.generate(request.prompt_tokens, request.params,
                                    request_id=request.request_id or "generate")
        except Exception as e:
            meter.cancel()
            return _error(request, _why(e))
        first_token_s: float | None = None
        first_text_s: float | None = None
        try:
            while True:
                try:
                    out = next(steps)
                except StopIteration:
                    # a generator that ends without a finish reason is an engine bug: say so
                    meter.cancel()
                    return _error(request, "the engine ended the generation without a finish reason")
                except Exception as e:
                    log.exception("generation failed")
                    meter.cancel()
                    return _error(request, _why(e))
                now = time.perf_counter()
                if first_token_s is None:
                    first_token_s = now
                if out.text and first_text_s is None:
                    first_text_s = now
                if out.finish_reason is None and job.cancelled.is_set():
                    job.emit(out)
                    log.info("%s aborted after %d tokens: its client went away", request.request_id,
                             out.completion_tokens)
                    out = replace(out, token=None, text="", finish_reason=FinishReason.ABORT)
                if out.finish_reason is not None:
                    timeline = Timeline(job.queued_s, started_s, first_token_s, first_text_s, now)
                    if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                        energy, why = meter.stop()
                        return replace(out, timeline=timeline, energy=energy, energy_why=why)
                    meter.cancel()
                    return replace(out, timeline=timeline)
                job.emit(out)
        finally:
            steps.close()  # frees the engine's slot (Engine.generate cancels in its finally)


class _Metering:
    """One generation's energy mark; a meter that fails costs the answer its energy, never the answer."""

    def __init__(self, meter: EnergyMeter | None):
        self._meter = meter
        self._mark: Any = None
        self.why: str | None = "no energy meter" if meter is None else None
        if meter is not None:
            try:
                self._mark = meter.start()
            except Exception as e:
                self.why = f"the energy meter failed at the start: {type(e).__name__}: {e}"

    def stop(self) -> tuple[Any, str | None]:
        """The reading (or None) and why there is none."""
        if self._mark is None:
            return None, self.why
        try:
            return self._meter.stop(self._mark), None
        except Exception as e:
            return None, f"the energy meter failed at the end: {type(e).__name__}: {e}"

    def cancel(self) -> None:
        """An answer that records nothing: its mark must not count as overlapping the next one's."""
        if self._mark is not None:
            try:
                self._meter.cancel(self._mark)
            except Exception:
                log.exception("the energy meter failed to cancel a mark")


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
