"""The monitor inside a running gateway: usage sampler, energy meter, the ring of answers, Prometheus.

One `Monitoring` per app. It measures nothing on the request path: each resident model's engine
thread holds its energy meter (`meter`, set on every thread by the residency) and stamps each
request's timeline and energy into the final `StepOutput` (model/engine_thread.py). The native chat
route reads the engine client directly and hands the monitor what came out:

    with state.monitoring.answer() as answer:
        async with held.loaded.client.generate(request) as generation:
            async for out in generation:
                ...
        answer.record(model, last)        # a completed answer: one /bankml/metrics record

`record` builds the record from the final output, appends it to the ring, and feeds the lifetime
Prometheus counters. Errors and abandoned answers push nothing to the ring (it holds completed
answers only) and count in `bankml_answers_total{finish="error"|"abort"}` when the `with` block is
left without a record. The running and waiting gauges are the engine threads' own counts, summed over
the resident models; the KV pool's and prefix cache's series are the most recently used model's
scheduler's last snapshot.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from bankml import __version__
from bankml.errors import Overloaded
from gateway.http import access_log
from gateway.monitor.answer_metrics import MetricsRing, answer_record
from gateway.monitor.prometheus import PromMetrics
from gpu_monitor.readings import rounded
from gpu_monitor.sample import Monitor
from model.messages import EngineStats, StepOutput

STATUS_RECORDS = 20  # the status page shows the last answers, not the whole ring
TTFT_WINDOW_S = 60.0  # the status page's TTFT percentiles: over the answers of the last minute


class Counted(Protocol):
    """What the monitor reads of an engine: its requests in flight and its scheduler's last snapshot (the
    engine handle, gateway/serving/engine_handle.py, or the tests' engine thread)."""

    def in_flight(self) -> tuple[int, int]: ...

    def stats(self) -> EngineStats | None: ...


class Engines(Protocol):
    """The resident models' engines (gateway.serving.residency.Residency has them)."""

    def threads(self) -> list[Counted]: ...

    def most_recent(self) -> Any: ...  # a Loaded (its `client`, a Counted), or None


class Totals:
    """What the completed answers add up to since the server started (never falls, as Prometheus' counters
    fed from the same records): the status page charts rates as their change from one poll to a later one."""

    def __init__(self) -> None:
        self.answers = self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.measured = 0  # answers whose energy was measured,
        self.energy_j = 0.0  # their energy,
        self.energy_tokens = 0  # and their completion tokens (J/token = the change of one over the other's)

    def add(self, rec: Mapping[str, Any]) -> None:
        self.answers += 1
        self.prompt_tokens += rec["prompt_tokens"]
        self.cached_tokens += rec["cached_tokens"]
        self.completion_tokens += rec["completion_tokens"]
        if rec["energy_j"] is not None:
            self.measured += 1
            self.energy_j += max(0.0, rec["energy_j"])
            self.energy_tokens += rec["completion_tokens"]

    def json_dict(self) -> dict[str, Any]:
        return {"answers": self.answers, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
                "energy_j": rounded(self.energy_j, 3) if self.measured else None,
                "energy_tokens": self.energy_tokens}


class Answer:
    """One answer, as the monitor counts it: `record` it once it completed; leaving the `with` block
    without a record counts it as abandoned (the handler was cancelled: its client went away) or as
    an error (anything else: the engine failed, or the handler did), except `Overloaded`: the request
    never queued (503), and counts in `bankml_requests_overloaded_total` alone."""

    def __init__(self, monitoring: Monitoring):
        self._monitoring = monitoring
        self.recorded = False

    def __enter__(self) -> Answer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, Overloaded):  # refused before it queued: no answer
            self._monitoring.prom.overloaded.inc()
            return
        if not self.recorded:
            abandoned = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
            self._monitoring.prom.ended_unfinished("abort" if abandoned else "error")

    def record(self, model: str, last: StepOutput) -> dict[str, Any]:
        """Push the completed answer's record (ring and Prometheus) and return it."""
        rec = answer_record(model, last)
        access_log.note_answer(model, last.prompt_tokens, last.completion_tokens)
        m = self._monitoring
        m.ring.append(rec)
        m.totals.add(rec)
        latency_ms = last.timeline.latency_ms if last.timeline else 0.0
        m.prom.observe_answer(rec, ttft_s=None if last.ttft_ms is None else last.ttft_ms / 1e3,
                              latency_s=latency_ms / 1e3)
        self.recorded = True
        return rec


class Monitoring:
    """The monitor's state for one app. `whoami()` gives the /bankml body (what was verified)."""

    def __init__(self, monitor: Monitor, *, whoami: Callable[[], Mapping[str, Any]], mode: str,
                 root_text: str, energy_device: str = "cpu", engine_thread: Counted | None = None,
                 engines: Engines | None = None):
        """engine_thread: one engine (the tests'); engines: the resident models' (native); neither: P0."""
        self.monitor = monitor
        self.whoami = whoami
        self.mode = mode  # "native" or "p0"
        self.root_text = root_text  # GET / for clients that are not browsers
        # energy_device: "cpu" or "gpu", where the engine runs, hence which counter energy_j reads
        self.meter = monitor.energy_meter(device=energy_device)
        self.engine_thread = engine_thread
        self.engines = engines  # neither: P0, no engine in this process
        if engine_thread is not None:
            engine_thread.meter = self.meter
        self.ring = MetricsRing()
        self.totals = Totals()
        self.prom = PromMetrics(self.flights, self._model_info, self.engine_stats)
        self.started_s = time.monotonic()

    def answer(self) -> Answer:
        return Answer(self)

    def flights(self) -> tuple[int, int] | None:
        """(running, waiting) requests on the engines, summed; None when no engine runs in this process (P0)."""
        threads = self._threads()
        if threads is None:
            return None
        counts = [t.in_flight() for t in threads]
        return sum(r for r, _ in counts), sum(w for _, w in counts)

    def engine_stats(self) -> EngineStats | None:
        """The most recently used model's scheduler's last snapshot (None: none yet, the engine thread is
        gone, or P0)."""
        if self.engines is not None:
            recent = self.engines.most_recent()
            return recent.client.stats() if recent is not None else None
        return self.engine_thread.stats() if self.engine_thread is not None else None

    def devices(self) -> list[dict[str, Any]] | None:
        """The most recently used model's devices (model/parallel.py's mesh), one entry each: its weight
        and KV bytes, and on a GPU the allocator's bytes in use; None: no engine here, or one that does not
        say (P0, the tests' fakes). A GPU board's busy share, power and memory are in "gpus" (NVML,
        amdsmi); simulated CPU devices share this process's cores (its cpu_percent)."""
        recent = self.engines.most_recent() if self.engines is not None else None
        report = recent.client.weights_report() if recent is not None else None
        mesh = report.get("mesh") if report else None
        if not mesh:
            return None
        out = []
        for name, weight_bytes in mesh["weight_bytes"].items():
            memory = mesh.get("memory", {}).get(name, {})
            out.append({"device": name, "weight_bytes": weight_bytes, "kv_bytes": mesh["kv_bytes"].get(name),
                        "memory_in_use_bytes": memory.get("in_use_bytes"),
                        "memory_limit_bytes": memory.get("limit_bytes"),
                        "busy": "gpus" if not name.startswith("cpu") else "process.cpu_percent: CPU devices share "
                                                                           "this process's cores"})
        return out

    def _threads(self) -> list[Counted] | None:
        if self.engines is not None:
            return self.engines.threads()
        return [self.engine_thread] if self.engine_thread is not None else None

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

    def _kv_cache(self) -> dict[str, Any]:
        """The KV pool and prefix cache, from the scheduler's last snapshot (the prefix counters are
        cumulative: the page charts the hit rate between two polls)."""
        stats = self.engine_stats()
        if stats is None:
            why = ("no engine runs in this process (llama-server has its own cache)" if self._threads() is None
                   else "no engine has run yet")
            return {"unavailable": why}
        out: dict[str, Any] = {"prefix_queries_tokens": stats.prefix_queries_tokens,
                               "prefix_hits_tokens": stats.prefix_hits_tokens}
        if stats.pages_total > 0:
            out.update(usage_ratio=rounded(stats.kv_usage_ratio, 4), page_size=stats.page_size,
                       pages_total=stats.pages_total, pages_used=stats.pages_used, pages_cached=stats.pages_cached)
        else:
            out["unavailable"] = "this engine keeps no paged KV pool"
        return out

    async def status(self) -> dict[str, Any]:
        """`GET /bankml/status`: what the status page shows, in one answer; `dashboard` is what its charts
        read beside the rest: lifetime totals, TTFT percentiles over the last minute, the KV cache."""
        usage = await self.monitor.get_usage()
        metrics = self.ring.json_dict()
        kept = metrics["records"]
        metrics["records"] = kept[-STATUS_RECORDS:]
        running, waiting = self.flights() or (None, None)
        now = time.time()
        return {
            "bankml": __version__,
            "at": rounded(now, 3),
            **self.whoami(),
            "serve": {"mode": self.mode, "pid": os.getpid(),
                      "uptime_s": rounded(time.monotonic() - self.started_s, 1),
                      "energy_device": self.meter.device, "requests_running": running, "requests_waiting": waiting},
            "usage": usage,
            "metrics": metrics,
            "dashboard": {"totals": self.totals.json_dict(), "ttft": self.ring.ttft_percentiles(now, TTFT_WINDOW_S),
                          "kv_cache": self._kv_cache()},
        }

    def close(self) -> None:
        self.monitor.close()
