"""Whether the server is moving, not only answering: /health's wedge check, and /bankml's "health".

A loop that answers /health proves little (issue 28: six abandoned requests held every worker thread,
each chat, /api/tags and /api/chat timed out for minutes, and /health said 200). Work waits in two
places, and each is watched by what it has completed, never by how busy it looks:

- the loop's worker threads (`WorkerPool`, the loop's default executor: every `asyncio.to_thread`, a
  request's parsing, templating and tokenizing): wedged when every worker is busy, work is queued
  behind them, and none has started or finished a task for `[limits] wedged_after_s`;
- each resident model's engine thread (model/engine_thread.py `stalled_s`): wedged when it has had
  work (a request queued or running, a call) that long without completing an iteration or a job.

A wedge is a 503 with the reason, in llama-server's shape (its "Loading model" 503 is the same
unavailable_error), so a balancer routes away; /health is 200 again as soon as the work moves.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from bankml.errors import EngineGone

_serving: Liveness | None = None  # the server's in this process, once it started (Liveness.install)


def serving() -> Liveness | None:
    """The Liveness of the server running in this process; None before one started."""
    return _serving


class Wedged(EngineGone):
    """The server answers, but its work does not move (an engine or every worker thread is stuck): a
    503 that names where, and goes away by itself once it moves."""


class WorkerPool(ThreadPoolExecutor):
    """The loop's default executor (sanic_app.py installs it), sized as asyncio's own, counting its
    work: how many tasks run, how many wait, and when one last started or finished."""

    def __init__(self, max_workers: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.workers = max_workers or min(32, (os.cpu_count() or 1) + 4)  # asyncio's default pool size
        super().__init__(self.workers, thread_name_prefix="bankml-worker")
        self._clock = clock
        self._count_lock = threading.Lock()
        self._queued = 0  # submitted, not started
        self._busy = 0  # started, not finished
        self._moved_s = clock()  # a task last started or finished
        self._queued_s = self._moved_s  # the queue last became non-empty

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._count_lock:
            if self._queued == 0:
                self._queued_s = self._clock()
            self._queued += 1

        def run() -> Any:
            self._count(queued=-1, busy=1)
            try:
                return fn(*args, **kwargs)
            finally:
                self._count(busy=-1)

        try:
            future = super().submit(run)
        except BaseException:  # the pool is shut down: nothing was queued
            self._count(queued=-1, moved=False)
            raise
        future.add_done_callback(self._never_ran)
        return future

    def _never_ran(self, future: Future) -> None:
        if future.cancelled():  # cancelled while it waited (its awaiting task was): it leaves the queue
            self._count(queued=-1, moved=False)

    def _count(self, queued: int = 0, busy: int = 0, moved: bool = True) -> None:
        with self._count_lock:
            self._queued += queued
            self._busy += busy
            if moved:
                self._moved_s = self._clock()

    def counts(self) -> tuple[int, int]:
        """(busy, queued) tasks now."""
        with self._count_lock:
            return self._busy, self._queued

    def stalled_s(self) -> float:
        """How long work has waited behind busy workers of which none started or finished a task; 0
        while a worker is free or nothing waits."""
        with self._count_lock:
            if self._queued == 0 or self._busy < self.workers:
                return 0.0
            return max(0.0, self._clock() - max(self._moved_s, self._queued_s))


class _Engine(Protocol):
    """What the check reads of an engine handle (gateway/serving/engine_handle.py has it)."""

    def stalled_s(self) -> float: ...

    def in_flight(self) -> tuple[int, int]: ...


class _Resident(Protocol):
    name: str
    client: _Engine


class Liveness:
    """The wedge check over the loop's workers (None: not installed, as before the server starts) and
    the resident models' engines, with the bound of `[limits] wedged_after_s`."""

    def __init__(self, pool: WorkerPool | None, wedged_after_s: float):
        self.pool = pool
        self.wedged_after_s = wedged_after_s

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """As the server starts: its pool becomes the loop's default executor, and this the process's
        `serving()` (what /bankml's "health" and the status page report)."""
        global _serving
        if self.pool is not None:
            loop.set_default_executor(self.pool)
        _serving = self

    def problems(self, resident: Iterable[_Resident]) -> list[str]:
        """Why the server is wedged, one line per stuck place; [] when everything moves."""
        bound = self.wedged_after_s
        out = []
        for r in resident:
            stalled = r.client.stalled_s()
            if stalled > bound:
                running, waiting = r.client.in_flight()
                out.append(f"the engine of {r.name} has completed no step for {stalled:.1f} s while {running} "
                           f"request(s) run and {waiting} wait ([limits] wedged_after_s = {bound:g})")
        pool = self.pool
        if pool is not None:
            stalled = pool.stalled_s()
            if stalled > bound:
                busy, queued = pool.counts()
                out.append(f"all {busy} worker threads have been busy for {stalled:.1f} s with {queued} task(s) "
                           f"queued behind them ([limits] wedged_after_s = {bound:g})")
        return out

    def check(self, resident: Iterable[_Resident]) -> None:
        """/health's: Wedged (503) naming every stuck place."""
        problems = self.problems(resident)
        if problems:
            raise Wedged("the server is wedged: " + "; ".join(problems))

    def report(self, resident: Iterable[_Resident]) -> dict[str, Any]:
        """/bankml's "health": "ok" or "wedged" with the reasons, and the workers' counts."""
        problems = self.problems(resident)
        out: dict[str, Any] = {"status": "wedged" if problems else "ok", "wedged_after_s": self.wedged_after_s}
        if problems:
            out["reasons"] = problems
        if self.pool is not None:
            busy, queued = self.pool.counts()
            out["workers"] = {"threads": self.pool.workers, "busy": busy, "queued": queued}
        return out
