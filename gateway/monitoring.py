"""The monitor inside a running gateway: usage sampler, energy meter, the ring of answers, Prometheus.

One `Monitoring` per app. The native chat route measures each answer through `metered`:

    async with state.monitoring.metered(state.client, job) as answer:
        async for out in answer:          # the engine's outputs, timestamped as they arrive
            ...
        await answer.record(model, last)  # a completed answer: one /bankml/metrics record

How t0 is taken without touching the engine thread: `metered` queues three jobs back to back on the
engine thread's FIFO, with no await between them: a start mark (t0 and the energy counters), the
generation, an end mark. Each answer's span on the device is then exactly its own, time queued behind
other answers excluded (monitor.md §2, where t0 follows the slot's lock), and a second answer's marks
can never fall inside the first one's span. `_Submitted.__aenter__` (engine_client.py) submits
without suspending, which is what keeps the three jobs adjacent.

`record` waits for the end mark (it runs right after the last token), builds the record, appends it
to the ring, and feeds the lifetime Prometheus counters. Errors and abandoned answers push nothing
to the ring (as the original) and count in `bankml_answers_total{finish="error"|"abort"}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bankml import __version__
from gateway.answer_metrics import MetricsRing, answer_record
from gateway.prometheus import PromMetrics
from gpu_monitor.energy import EnergyMark, EnergyReading
from gpu_monitor.readings import rounded
from gpu_monitor.sample import Monitor
from model.messages import FinishReason, GenerateRequest, StepOutput

STATUS_RECORDS = 20  # the status page shows the last answers, not the whole ring


class Flights:
    """Answers queued for the engine and answers running on it; updated from both threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0

    def add(self, key: str, n: int) -> None:
        with self._lock:
            setattr(self, key, getattr(self, key) + n)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.running, self.waiting


@dataclass
class _Marks:
    """Written on the engine thread by the start and end jobs."""

    t0: float | None = None  # perf_counter at the answer's turn on the engine
    mark: EnergyMark | None = None
    reading: EnergyReading | None = None
    why: str | None = None  # why there is no reading


class MeteredAnswer:
    """One answer in flight: iterate its outputs; `record` it once it completed."""

    def __init__(self, monitoring: Monitoring, client: Any, job: GenerateRequest):
        self._monitoring = monitoring
        self._client = client
        self._submitted = client.generate(job)
        self._gen: Any = None
        self._outputs: Any = None
        self._marks = _Marks()
        self._start: concurrent.futures.Future | None = None
        self._end: concurrent.futures.Future | None = None
        self.queued_s = time.perf_counter()  # handed to the engine queue
        self.first_text_s: float | None = None  # perf_counter when the first non-empty piece arrived
        self.finish: FinishReason | None = None
        self.recorded = False

    # --- on the engine thread ------------------------------------------------------------------

    def _mark_start(self) -> None:
        m = self._marks
        m.t0 = time.perf_counter()
        try:
            m.mark = self._monitoring.meter.start()
        except Exception as e:  # a meter bug costs this answer its energy, never the answer
            m.why = f"the energy meter failed at the start: {type(e).__name__}: {e}"

    def _mark_end(self) -> None:
        m = self._marks
        if m.mark is None:
            return
        try:
            m.reading = self._monitoring.meter.stop(m.mark)
        except Exception as e:
            m.why = f"the energy meter failed at the end: {type(e).__name__}: {e}"

    # --- on the loop ---------------------------------------------------------------------------

    async def __aenter__(self) -> MeteredAnswer:
        flights = self._monitoring.flights
        thread = self._client.thread
        flights.add("waiting", 1)
        self._start = thread.call(self._mark_start)
        self._gen = await self._submitted.__aenter__()  # never suspends: the generation is queued next
        self._end = thread.call(self._mark_end)

        def started(f: concurrent.futures.Future) -> None:
            flights.add("waiting", -1)
            if f.exception() is None:
                flights.add("running", 1)
                self._end.add_done_callback(lambda _: flights.add("running", -1))

        self._start.add_done_callback(started)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._submitted.__aexit__(exc_type, exc, tb)
        if not self.recorded:
            failed = self.finish is FinishReason.ERROR or (
                self.finish is None and exc_type is not None and not issubclass(exc_type, asyncio.CancelledError))
            self._monitoring.prom.ended_unfinished("error" if failed else "abort")

    def __aiter__(self) -> MeteredAnswer:
        return self

    async def __anext__(self) -> StepOutput:
        if self._outputs is None:
            self._outputs = aiter(self._gen)
        out: StepOutput = await anext(self._outputs)  # StopAsyncIteration after the final output
        if out.text and self.first_text_s is None:
            self.first_text_s = time.perf_counter()
        if out.finish_reason is not None:
            self.finish = out.finish_reason
        return out

    async def record(self, model: str, last: StepOutput) -> dict[str, Any]:
        """Push the completed answer's record (ring and Prometheus) and return it."""
        m = self._marks
        try:
            await asyncio.wrap_future(self._end)
        except Exception as e:  # the engine thread died after the answer completed
            m.why = m.why or f"the end mark did not run: {e}"
        if m.reading is None and m.why is None:
            m.why = "the start mark did not run"
        ttft_ms = None
        if self.first_text_s is not None and m.t0 is not None:
            ttft_ms = max(0.0, (self.first_text_s - m.t0) * 1e3)
        rec = answer_record(model, last, ttft_ms=ttft_ms, energy=m.reading, energy_why=m.why)
        self._monitoring.ring.append(rec)
        now = time.perf_counter()
        ttft_s = self.first_text_s - self.queued_s if self.first_text_s is not None else None
        self._monitoring.prom.observe_answer(rec, ttft_s=ttft_s, latency_s=now - self.queued_s)
        self.recorded = True
        return rec


class Monitoring:
    """The monitor's state for one app. `whoami()` gives the /bankml body (what was verified)."""

    def __init__(self, monitor: Monitor, *, whoami: Callable[[], Mapping[str, Any]], mode: str,
                 root_text: str, energy_device: str = "cpu"):
        self.monitor = monitor
        self.whoami = whoami
        self.mode = mode  # "native" or "p0"
        self.root_text = root_text  # GET / for clients that are not browsers
        self.meter = monitor.energy_meter(device=energy_device)
        self.ring = MetricsRing()
        self.flights = Flights()
        self.prom = PromMetrics(self.flights.counts, self._model_info)
        self.started_s = time.monotonic()

    def set_energy_device(self, device: str) -> None:
        """"cpu" or "gpu": where the engine runs, hence which counter an answer's energy_j reads."""
        self.meter = self.monitor.energy_meter(device=device)

    def metered(self, client: Any, job: GenerateRequest) -> MeteredAnswer:
        return MeteredAnswer(self, client, job)

    def _model_info(self) -> dict[str, str]:
        try:
            info = self.whoami()
        except Exception:
            return {}
        verified = info.get("verified") or {}
        if not verified:
            return {}
        return {"model": os.path.basename(str(info.get("model") or "")), "sha256": verified.get("model_sha256", ""),
                "arch": verified.get("arch") or "", "engine": str(info.get("engine") or "")}

    async def status(self) -> dict[str, Any]:
        """`GET /bankml/status`: what the status page shows, in one answer."""
        usage = await self.monitor.get_usage()
        metrics = self.ring.json_dict()
        kept = metrics["records"]
        metrics["records"] = kept[-STATUS_RECORDS:]
        running, waiting = self.flights.counts()
        return {
            "bankml": __version__,
            "at": rounded(time.time(), 3),
            **self.whoami(),
            "serve": {"mode": self.mode, "pid": os.getpid(),
                      "uptime_s": rounded(time.monotonic() - self.started_s, 1),
                      "energy_device": self.meter.device, "requests_running": running, "requests_waiting": waiting},
            "usage": usage,
            "metrics": metrics,
        }

    def close(self) -> None:
        self.monitor.close()
