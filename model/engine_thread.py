"""The thread that owns one model's engine on the device, and drives its scheduler.

Each resident model has its own (gateway/serving/residency.py starts one per load and stops it on a drop), so
answers from one model go on while another loads; nothing but this thread touches its engine.

A request's path through it: the gateway calls `submit(request, emit)`; the request waits in a FIFO
queue; the thread hands it to the engine (`engine.add`, which checks it and queues it for a sequence),
then runs `engine.iterate()` again and again -- each iteration admits what fits, runs a bounded chunk
of prefill and one decode step for every running sequence (model/scheduler.py) -- and hands each
`StepOutput` to its request's `emit` (the gateway's emit puts it on that request's own asyncio queue
with `call_soon_threadsafe`). Before each iteration the thread looks at every live request's cancel
flag, so a client that went away frees its sequence before the next step. Loading, warming and
unloading a model run on this thread too (`call`), between iterations, so nothing else ever touches
device memory.

The thread also measures: it stamps each request's `Timeline` (queued, admitted to a sequence, first
token, first text, end) and reads the energy `meter` from admission to the end; every output carries
the timeline up to it (llama-server's `timings_per_token`), the final one the whole of it and the
energy, so the gateway's monitor never queues work here. `in_flight()` counts the requests
running and waiting; `stats()` is the scheduler's last snapshot (`EngineStats`).

Failures never hang a client: a request the engine refuses ends at once with `FinishReason.ERROR` and
the reason; an exception inside an iteration ends every request that iteration touched with it (the
engine drops their sequences, `reset`, and serves the next ones); a second failed iteration in a row
(no iteration completed between them: the engine is broken, not one request) marks the thread failed,
as anything that kills the thread itself does, and every waiting and later job is answered with that
reason at once (the gateway's 503). Never a retry loop: at most two failures, each logged once.

The thread is watched too: `stalled_s()` says how long it has had generations in flight without
completing an iteration or a job, so /health can tell a wedged engine from a busy one.

No sanic here, and no jax import at module level: the gateway imports this module, and JAX is only
imported by the engine the loader (model/loading.py) builds.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bankml.errors import InvalidRequest, Overloaded
from model.messages import EngineStats, FinishReason, GenerateRequest, Iteration, StepOutput, Timeline

log = logging.getLogger(__name__)


class BatchEngine(Protocol):
    """What the thread needs from an engine (model.engine.Engine has it)."""

    max_seqs: int

    def add(self, request: GenerateRequest) -> int:
        """Check `request` (InvalidRequest: refused, the message says why) and queue it; its task id."""

    def cancel(self, task: int) -> StepOutput | None:
        """Drop the task wherever it is; its final "abort" output, or None when it is not live."""

    def has_work(self) -> bool: ...

    def iterate(self) -> Iteration: ...

    def reset(self) -> list[int]:
        """After an iteration failed: drop the running tasks (returned; their pages and slots are free
        again) and keep the waiting ones."""

    def stats(self) -> EngineStats: ...


class EnergyMeter(Protocol):
    """What the thread needs from an energy meter (gpu_monitor.energy.EnergyMeter has it)."""

    def start(self) -> Any: ...

    def stop(self, mark: Any) -> Any: ...

    def cancel(self, mark: Any) -> None: ...


class EngineThreadFailed(RuntimeError):
    """The engine thread is gone; the message says why."""


FAILED_IN_A_ROW = 2  # failed iterations, none completed between them, that mark the engine failed


Emit = Callable[[StepOutput], None]


@dataclass
class _Generate:
    request: GenerateRequest
    emit: Emit
    queued_s: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # set on the thread once the engine has it
    task: int = -1
    started_s: float | None = None
    first_token_s: float | None = None
    first_text_s: float | None = None
    meter: _Metering | None = None


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future
    ready: Callable[[], bool] | None = None  # run only once this holds (checked after each iteration)


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
    """Jobs from a FIFO, run on a single daemon thread: calls one at a time, generations batched by the
    engine's scheduler.

    `engine` is whatever the last `call` installed with `set_engine` (None: no model loaded); a
    generation submitted while it is None ends at once with an ERROR output. `meter` (None: energy
    unmeasured) is set once, before the first request. `max_waiting`: generations queued for a sequence
    beyond those running; `submit` refuses one more with `Overloaded`.
    """

    def __init__(self, name: str = "bankml-engine", max_waiting: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `failure` against enqueueing; guards the counts
        self.engine: BatchEngine | None = None
        self.meter: EnergyMeter | None = None
        self.failure: str | None = None
        self.max_waiting = max_waiting
        self._live: dict[int, _Generate] = {}  # by task id: handed to the engine, not finished (thread only)
        self._pending = 0  # submitted, not yet handed to the engine
        self._deferred: list[_Call] = []  # calls waiting for their `ready` (thread only)
        self._stats: EngineStats | None = None
        self._failed_in_a_row = 0  # iterations that raised since the last one that completed (thread only)
        # the heartbeat: when the thread last completed something, and whether it sleeps for want of work
        self._clock = clock
        self._moved_s = clock()
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- called from any thread ------------------------------------------------------------------

    def submit(self, request: GenerateRequest, emit: Emit) -> Ticket:
        """Queue a generation. Raises Overloaded when `max_waiting` requests already wait."""
        return self.submit_all([(request, emit)])[0]

    def submit_all(self, jobs: list[tuple[GenerateRequest, Emit]]) -> list[Ticket]:
        """Queue several generations (one request's prompts x n) all or none: Overloaded, with nothing
        queued, when the last of them would find `max_waiting` requests already waiting (a list bigger
        than the room is refused up front, never half-submitted and then cancelled)."""
        made = [_Generate(request, emit) for request, emit in jobs]
        with self._lock:
            failure = self.failure
            if failure is None and made:
                waiting = self._beyond_slots_locked(len(made) - 1)
                if waiting >= self.max_waiting:
                    raise Overloaded(f"the server is busy: {waiting} requests are waiting for a sequence "
                                     f"([engine] max_waiting = {self.max_waiting}); try again shortly")
                self._pending += len(made)
                self._work_arrives_locked()
                for job in made:
                    self._jobs.put(job)
        if failure is not None:
            for job in made:
                job.emit(_error(job.request, f"the engine thread stopped: {failure}"))
        return [Ticket(job) for job in made]

    def _waiting_locked(self) -> int:
        stats = self._stats
        return self._pending + (stats.waiting if stats is not None else 0)

    def _beyond_slots_locked(self, more: int = 0) -> int:
        """The requests that will wait for a sequence: those queued here or in the engine (and `more`
        about to be), less the free sequences the next admission gives them (a burst is not refused
        for the running iteration's sake)."""
        stats = self._stats
        free = stats.max_seqs - stats.running if stats is not None else 0
        return max(0, self._waiting_locked() + more - free)

    def in_flight(self) -> tuple[int, int]:
        """(running, waiting) generations; (0, 0) once the thread is gone (everything it held was answered
        with the failure). A request's final output is emitted after it left them."""
        with self._lock:
            if self.failure is not None:
                return 0, 0
            stats = self._stats
            return (stats.running if stats is not None else 0), self._waiting_locked()

    def stalled_s(self) -> float:
        """How long the thread has had generations in flight (queued here, waiting for a sequence or
        running) without completing an iteration or a job: 0 while none is, or while it sleeps for want
        of work. A healthy thread stays within one iteration's (or one call's) time; /health compares
        it with `[limits] wedged_after_s` (gateway/http/liveness.py)."""
        with self._lock:
            stats = self._stats
            in_flight = self._pending + (stats.running + stats.waiting if stats is not None else 0)
            if self._idle or self.failure is not None or in_flight == 0:
                return 0.0
            return max(0.0, self._clock() - self._moved_s)

    def _work_arrives_locked(self) -> None:
        # a thread asleep for want of work has not been stalled while it slept: the wait starts now
        if self._idle:
            self._moved_s = self._clock()

    def _beat(self, idle: bool = False) -> None:
        """The thread completed something (an iteration, a job), or is about to sleep for want of work."""
        with self._lock:
            self._moved_s = self._clock()
            self._idle = idle

    def stats(self) -> EngineStats | None:
        """The scheduler's snapshot after its last iteration (None: no engine has run yet, or the thread
        is gone)."""
        return self._stats

    def call(self, fn: Callable[[], Any], ready: Callable[[], bool] | None = None) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread, between two iterations; its result in a Future. With
        `ready` (called on the engine thread), not before `ready()` holds: it is checked when the call
        is taken and after each iteration (a slot action waits for its slot's sequence to end, as
        llama-server defers the task). When nothing runs, it is not waited for."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            failure = self.failure
            if failure is None:
                self._work_arrives_locked()
                self._jobs.put(_Call(fn, future, ready))
        if failure is not None:
            future.set_exception(EngineThreadFailed(failure))
        return future

    def set_engine(self, engine: BatchEngine | None) -> None:
        """Install (or drop, with None) the engine; only from a function passed to `call`. The requests
        the old engine was serving end with an error."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("set_engine runs on the engine thread (pass it to call)")
        if engine is not self.engine:
            for job in list(self._live.values()):
                self._finish(job, _error(job.request, "the model was unloaded while it answered"))
        self.engine = engine
        self._publish(engine)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the running iteration, drop the engine, end the thread."""
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
                busy = self._busy()
                while True:  # everything queued now; when idle, wait for the next job
                    try:
                        if busy:
                            job = self._jobs.get_nowait()
                        else:
                            self._beat(idle=True)
                            job = self._jobs.get()
                    except queue.Empty:
                        break
                    if job is _STOP:
                        self._stop_live("the server is stopping")
                        self.engine = None
                        self._fail_waiting("the server is stopping")
                        return
                    if isinstance(job, _Call):
                        self._deferred.append(job)
                        self._run_ready()
                    else:
                        self._take(job)
                    job = None
                    self._beat()
                    busy = self._busy()
                    if not busy:
                        break
                if busy:
                    self._iterate(self.engine)
                self._run_ready()
        except BaseException as e:  # the thread is dying: answer everyone, never leave them waiting
            why = str(e) if isinstance(e, EngineThreadFailed) else _why(e)
            log.error("the engine thread stopped: %s", why)
            with self._lock:
                self.failure = why
                self._stats = None  # nothing runs or waits on a dead thread
            if isinstance(job, _Call) and not job.future.done():
                job.future.set_exception(EngineThreadFailed(why))
            elif isinstance(job, _Generate) and job.task < 0:
                job.emit(_error(job.request, why))
            self._stop_live(why)
            self.engine = None
            self._fail_waiting(why)

    def _busy(self) -> bool:
        """Whether an iteration has something to do (else the thread sleeps until the next job)."""
        return self.engine is not None and bool(self._live or self.engine.has_work())

    def _take(self, job: _Generate) -> None:
        """Hand a submitted job to the engine, or answer it at once."""
        engine = self.engine
        if job.cancelled.is_set() or engine is None:
            self._count_taken(None)
            job.emit(StepOutput(token=None, finish_reason=FinishReason.ABORT) if job.cancelled.is_set()
                     else _error(job.request, "no model is loaded"))
            return
        try:
            job.task = engine.add(job.request)
        except Exception as e:
            self._count_taken(None)
            job.emit(_error(job.request, _why(e)))
            return
        self._live[job.task] = job
        self._count_taken(engine)

    def _count_taken(self, engine: BatchEngine | None) -> None:
        """A job left the queue: with the engine's new snapshot (which counts it, if it took it) in the
        same step, so `submit` never sees it in neither count."""
        stats = engine.stats() if engine is not None else self._stats
        with self._lock:
            self._pending -= 1
            self._stats = stats

    def _iterate(self, engine: BatchEngine) -> None:
        """Cancel what was cancelled, run one iteration, hand out what it produced."""
        aborted = []
        for task, job in list(self._live.items()):
            if job.cancelled.is_set():
                out = engine.cancel(task) or StepOutput(token=None, finish_reason=FinishReason.ABORT)
                log.info("%s aborted after %d tokens: its client went away", job.request.request_id,
                         out.completion_tokens)
                aborted.append((job, replace(out, token=None, text="", finish_reason=FinishReason.ABORT)))
        if aborted:
            self._publish(engine)
            for job, out in aborted:
                self._finish(job, out)
        if not engine.has_work():
            self._publish(engine)
            return
        try:
            it = engine.iterate()
        except Exception as e:
            self._beat()
            self._failed(engine, e)
            return
        self._beat()
        self._failed_in_a_row = 0
        for task, at in it.admitted:
            job = self._live.get(task)
            if job is not None and job.started_s is None:
                job.started_s = at
                job.meter = _Metering(self.meter)
        self._publish(engine)  # before the outputs: a client that saw its end never reads a snapshot counting it
        for task, out in it.outputs:
            job = self._live.get(task)
            if job is None:
                continue
            if out.progress is not None:  # a prefill chunk's progress: no token yet, nothing to stamp
                job.emit(out)
                continue
            now = time.perf_counter()
            if job.first_token_s is None:
                job.first_token_s = now
            if out.text and job.first_text_s is None:
                job.first_text_s = now
            if out.finish_reason is None:
                # each token's own timeline (to now): llama-server's timings_per_token, measured here
                job.emit(replace(out, timeline=Timeline(job.queued_s, job.started_s or now, job.first_token_s,
                                                        job.first_text_s, now)))
            else:
                self._finish(job, out)

    def _failed(self, engine: BatchEngine, e: Exception) -> None:
        """An iteration raised: the requests it touched end with the error (the engine drops their
        sequences; the ones it never reached wait on). The second failure in a row is the engine's, not
        a request's: the thread stops (EngineThreadFailed, answered in `_run`), never retrying in a loop."""
        why = _why(e)
        self._failed_in_a_row += 1
        log.error("an engine iteration failed (%d in a row): its requests end with the error", self._failed_in_a_row,
                  exc_info=e)
        if getattr(getattr(engine, "runner", None), "out_of_step", False):
            # a device program failed across processes (one may be gone): they no longer run the same
            # steps, so every answer ends with the error and the server stops (model/distributed.py)
            for job in list(self._live.values()):
                self._finish(job, _error(job.request, why))
            from model import distributed

            distributed.abandon(why)
            raise EngineThreadFailed(f"{why} (a step of the model split across processes failed: the server "
                                     "stops)") from e
        dropped = engine.reset()
        if self._failed_in_a_row >= FAILED_IN_A_ROW:
            raise EngineThreadFailed(f"{why} (the engine failed {self._failed_in_a_row} iterations in a row)") from e
        for task in dropped:
            job = self._live.get(task)
            if job is not None:
                self._finish(job, _error(job.request, why))
        self._publish(engine)

    def _finish(self, job: _Generate, out: StepOutput) -> None:
        """The job's last output, stamped with its timeline and, when it completed, its energy."""
        self._live.pop(job.task, None)
        meter = job.meter or _Metering(None)
        if job.started_s is not None:
            now = time.perf_counter()
            timeline = Timeline(job.queued_s, job.started_s, job.first_token_s or now, job.first_text_s, now)
            if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                energy, why = meter.stop()
                out = replace(out, timeline=timeline, energy=energy, energy_why=why)
            else:
                meter.cancel()
                out = replace(out, timeline=timeline)
        job.emit(out)

    def _stop_live(self, why: str) -> None:
        for job in list(self._live.values()):
            self._finish(job, _error(job.request, why))

    def _publish(self, engine: BatchEngine | None) -> None:
        stats = engine.stats() if engine is not None else None
        with self._lock:
            self._stats = stats

    def _fail_waiting(self, why: str) -> None:
        for job in self._deferred:
            if not job.future.done():
                job.future.set_exception(EngineThreadFailed(why))
        self._deferred = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Call):
                job.future.set_exception(EngineThreadFailed(why))
            elif isinstance(job, _Generate):
                with self._lock:
                    self._pending -= 1
                job.emit(_error(job.request, f"the engine thread stopped: {why}"))

    def _run_ready(self) -> None:
        """The deferred calls whose `ready` holds (all of them once nothing runs), in order; the stats
        published after them (a slot action changes what GET /slots shows)."""
        if not self._deferred:
            return
        idle = not self._busy()
        waiting, waited = [], False
        for job in self._deferred:
            if idle or job.ready is None or _holds(job.ready):
                self._run_call(job)
                waited |= job.ready is not None
            else:
                waiting.append(job)
        self._deferred = waiting
        if waited:
            self._publish(self.engine)

    @staticmethod
    def _run_call(job: _Call) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn())
        except Exception as e:
            job.future.set_exception(e)


def _holds(ready: Callable[[], bool]) -> bool:
    """A deferred call's condition; one that fails lets the call run, and fail on its own."""
    try:
        return bool(ready())
    except Exception:
        return True


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
