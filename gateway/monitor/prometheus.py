"""`GET /metrics`: Prometheus text, `bankml_*` names, one registry per app (never the global one).

Two kinds of series:
- lifetime, pushed as answers complete (`observe_answer`): counters of answers, prompt, cached and
  completion tokens, and measured joules with the tokens they paid for; histograms of time to first token,
  inter-token latency, request latency (vLLM's buckets) and generation speed. Counters never fall (the /bankml/metrics ring's totals do, as records age out).
- sampled at scrape time (`UsageCollector`): from the scheduler's last snapshot (EngineStats), the
  requests running and waiting, the KV pool's use, and its cumulative prefix-cache and preemption
  counters (vLLM's names, in our prefix: `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries`,
  `vllm:prefix_cache_hits`, `vllm:num_preemptions`) and speculative decoding's (`vllm:spec_decode_num_drafts`,
  `_num_draft_tokens`, `_num_accepted_tokens`, our verify steps, and the acceptance ratio while something
  was drafted); from one /bankml/usage snapshot, this process's
  memory and CPU, RAPL package energy, per-GPU busy, memory, power, temperature and energy, the
  limiter. A value the monitor could not read is left out, not written as 0: an absent series is
  Prometheus's "unknown". In front of llama-server (P0) no engine runs here, so the engine's series
  are absent (llama-server's own /metrics has them).
- beside them, under vLLM's exact names, what an inference router's endpoint picker scrapes (GAIE's
  model-server protocol): `vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc` (a 0..1 fraction, as vLLM's), `vllm:cache_config_info{block_size,num_gpu_blocks}`
  and `vllm:lora_requests_info` (no adapters); the same readings as the `bankml_*` gauges, on by default.
Chart `rate()` of the joule counters rather than the sampled watts.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from model.messages import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so a dashboard made for its histograms reads ours alike
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)


class UsageCollector:
    """Series read from the latest usage snapshot, which the scrape handler sets just before encoding."""

    def __init__(self, flights: Callable[[], tuple[int, int] | None], info: Callable[[], Mapping[str, str]],
                 energy: Callable[[], tuple[float, int] | None],
                 engine: Callable[[], EngineStats | None] = lambda: None):
        self.snapshot: dict[str, Any] = {}
        self._flights = flights
        self._info = info
        self._energy = energy
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # unchecked: the set of series depends on the machine

    def collect(self) -> Iterable[Metric]:
        flights = self._flights()
        stats = self._engine()
        info = dict(self._info())
        if flights is not None:  # None: no engine in this process (P0)
            running, waiting = flights
            yield GaugeMetricFamily("bankml_requests_running", "Requests holding a sequence on the engine now.",
                                    running)
            yield GaugeMetricFamily("bankml_requests_waiting", "Requests queued for a sequence (FIFO).", waiting)
            yield from _routing_signals(running, waiting, stats, info.get("model", ""))
        yield from self._scheduler(stats)
        energy = self._energy()
        if energy is not None:  # absent until an answer's energy was measured: never a fake 0 J
            yield CounterMetricFamily("bankml_answer_energy_joules",
                                      "Measured energy of completed answers (their energy_j).", energy[0])
            yield CounterMetricFamily("bankml_answer_energy_tokens",
                                      "Completion tokens of the answers whose energy was measured "
                                      "(J/token = rate of the joules / rate of these).", energy[1])
        if info:
            g = GaugeMetricFamily("bankml_model_info", "The verified model being served (always 1).",
                                  labels=list(info))
            g.add_metric(list(info.values()), 1)
            yield g
        u = self.snapshot
        if not u:
            return
        rss = GaugeMetricFamily("bankml_process_resident_memory_bytes",
                                "Resident memory of the server and its engine process.", labels=["name", "pid"])
        cpu = GaugeMetricFamily("bankml_process_cpu_percent",
                                "CPU over the last usage window; 100 is one core busy.", labels=["name", "pid"])
        for p in u.get("processes", []):
            rss.add_metric([p["name"], str(p["pid"])], p["rss_bytes"])
            cpu.add_metric([p["name"], str(p["pid"])], p["cpu_percent"])
        yield rss
        yield cpu
        if u.get("package_energy_j") is not None:
            yield CounterMetricFamily("bankml_package_energy_joules",
                                      "CPU package energy (RAPL, all packages) since the server started.",
                                      u["package_energy_j"])
        if u.get("package_watts") is not None:
            yield GaugeMetricFamily("bankml_package_power_watts",
                                    "CPU package power over the last usage window (RAPL).", u["package_watts"])
        yield from self._gpus(u.get("gpus", []))
        yield from self._engine_devices(u.get("engine_devices", []))
        yield from self._limiter(u.get("gpu_limiter"))

    @staticmethod
    def _scheduler(stats: EngineStats | None) -> Iterable[Metric]:
        if stats is None:  # no engine has run yet, or none runs here
            return
        if stats.pages_total > 0:  # an engine without a paged pool (a test's fake) reports none
            yield GaugeMetricFamily("bankml_kv_cache_usage_ratio",
                                    "KV cache pages held by running sequences over the pool's pages (0..1).",
                                    stats.kv_usage_ratio)
            pages = GaugeMetricFamily("bankml_kv_cache_pages",
                                      f"KV cache pages of {stats.page_size} tokens, by state: used by running "
                                      "sequences, cached (free, holding a reusable prefix), free.", labels=["state"])
            pages.add_metric(["used"], stats.pages_used)
            pages.add_metric(["cached"], stats.pages_cached)
            pages.add_metric(["free"], stats.pages_total - stats.pages_used - stats.pages_cached)
            yield pages
        yield CounterMetricFamily("bankml_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.", stats.prefix_queries_tokens)
        yield CounterMetricFamily("bankml_prefix_cache_hits",
                                  "Prompt tokens served from the prefix cache (hit rate = rate of these / rate of "
                                  "the queries).", stats.prefix_hits_tokens)
        yield CounterMetricFamily("bankml_num_preemptions",
                                  "Sequences preempted when the KV pool ran out of pages (computed again later).",
                                  stats.preemptions)
        yield from UsageCollector._speculation(stats)

    @staticmethod
    def _speculation(stats: EngineStats) -> Iterable[Metric]:
        """Speculative decoding (--spec-type; 0 while nothing is drafted), vLLM's spec_decode names in our prefix."""
        yield CounterMetricFamily("bankml_spec_decode_num_verify_steps",
                                  "Engine steps that verified drafts (one forward of 1 + k tokens per drafting row).",
                                  stats.spec_steps)
        yield CounterMetricFamily("bankml_spec_decode_num_drafts",
                                  "Drafts verified (one per drafting sequence of a verify step).", stats.spec_drafts)
        yield CounterMetricFamily("bankml_spec_decode_num_draft_tokens", "Drafted tokens the model verified.",
                                  stats.spec_draft_tokens)
        yield CounterMetricFamily("bankml_spec_decode_num_accepted_tokens",
                                  "Of the drafted tokens, those the model's own samples agreed with (kept).",
                                  stats.spec_accepted_tokens)
        if stats.spec_draft_tokens > 0:  # nothing drafted yet: no rate (absent, not 0)
            yield GaugeMetricFamily("bankml_spec_decode_acceptance_ratio",
                                    "Accepted over drafted tokens since the engine started (0..1; for a recent "
                                    "rate, divide the rates of the two counters).",
                                    stats.spec_accepted_tokens / stats.spec_draft_tokens)

    @staticmethod
    def _engine_devices(devices: list[dict[str, Any]]) -> Iterable[Metric]:
        """Per device of the engine's mesh (model/parallel.py: a model split over N devices has N)."""
        if not devices:
            return
        for key, name, doc in (("weight_bytes", "bankml_device_weight_bytes", "The model's weights on the device."),
                               ("kv_bytes", "bankml_device_kv_cache_bytes", "The KV cache pool on the device."),
                               ("memory_in_use_bytes", "bankml_device_memory_in_use_bytes",
                                "What JAX's allocator holds on the device (GPUs).")):
            g = GaugeMetricFamily(name, doc, labels=["device"])
            for d in devices:
                if d.get(key) is not None:
                    g.add_metric([d["device"]], d[key])
            yield g

    @staticmethod
    def _gpus(gpus: list[dict[str, Any]]) -> Iterable[Metric]:
        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["card"])
            for gpu in gpus:
                if gpu.get(key) is not None:
                    g.add_metric([gpu["card"]], gpu[key])
            return g

        yield gauge("bankml_gpu_busy_percent", "GPU busy percent (sysfs gpu_busy_percent, NVML, amdsmi).",
                    "busy_percent")
        used = GaugeMetricFamily("bankml_gpu_memory_used_bytes", "GPU memory in use, by pool.",
                                 labels=["card", "pool"])
        total = GaugeMetricFamily("bankml_gpu_memory_total_bytes", "GPU memory size, by pool.",
                                  labels=["card", "pool"])
        for gpu in gpus:
            for pool in ("vram", "gtt"):
                if gpu.get(f"{pool}_used_bytes") is not None:
                    used.add_metric([gpu["card"], pool], gpu[f"{pool}_used_bytes"])
                if gpu.get(f"{pool}_total_bytes") is not None:
                    total.add_metric([gpu["card"], pool], gpu[f"{pool}_total_bytes"])
        yield used
        yield total
        yield gauge("bankml_gpu_power_watts", "GPU board power.", "power_watts")
        yield gauge("bankml_gpu_power_limit_watts", "GPU enforced power limit.", "power_limit_watts")
        yield gauge("bankml_gpu_temperature_celsius", "GPU temperature.", "temperature_c")
        energy = CounterMetricFamily("bankml_gpu_energy_joules",
                                     "GPU energy counter (NVML: since the driver loaded).", labels=["card"])
        for gpu in gpus:
            if gpu.get("energy_j") is not None:
                energy.add_metric([gpu["card"]], gpu["energy_j"])
        yield energy

    @staticmethod
    def _limiter(lim: dict[str, Any] | None) -> Iterable[Metric]:
        if not lim:
            return
        labels = [lim.get("device") or ""]
        for name, doc, key in (
            ("bankml_limiter_memory_fraction", "Share of device memory the server may take.", "limit"),
            ("bankml_limiter_allocated_bytes", "Device memory the engine's allocator holds.", "allocated_bytes"),
            ("bankml_limiter_limit_bytes", "The engine allocator's ceiling.", "limit_bytes"),
            ("bankml_limiter_sequences_max", "Sequences the engine decodes at once (max_seqs).", "sequences_max"),
            ("bankml_limiter_sequences_in_use", "Sequences decoding now.", "sequences_in_use"),
        ):
            if lim.get(key) is not None:
                g = GaugeMetricFamily(name, doc, labels=["device"])
                g.add_metric(labels, lim[key])
                yield g


def _routing_signals(running: int, waiting: int, stats: EngineStats | None, model: str) -> Iterable[Metric]:
    """The gauges an inference router scrapes (the Gateway API Inference Extension's model-server protocol,
    docs/proposals/003-model-server-protocol, and llm-d's scorers), under vLLM's own names and labels
    (vllm/v1/metrics/loggers.py), so an endpoint picker's defaults find them: the same readings as the
    `bankml_*` series beside them, never a second source. docs/routing-signals.md has a configuration."""
    labels, values = ["model_name", "engine"], [model, "0"]  # vLLM's: served model, engine index

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(values, value)
        return g

    yield gauge("vllm:num_requests_running", "bankml_requests_running, under vLLM's name.", running)
    yield gauge("vllm:num_requests_waiting", "bankml_requests_waiting, under vLLM's name.", waiting)
    if stats is not None and stats.pages_total > 0:
        # a fraction, 0..1, as vLLM exports it despite the name (GAIE's KVCacheUtilization)
        yield gauge("vllm:kv_cache_usage_perc", "bankml_kv_cache_usage_ratio, under vLLM's name (0..1).",
                    stats.kv_usage_ratio)
        # GAIE's optional BlockSize and NumGPUBlocks, for its prefix-cache scorer (an info gauge: always 1)
        cache = GaugeMetricFamily("vllm:cache_config_info", "The KV pool's page size and pages, as vLLM's "
                                  "CacheConfig labels (always 1).", labels=["block_size", "num_gpu_blocks", "engine"])
        cache.add_metric([str(stats.page_size), str(stats.pages_total), "0"], 1)
        yield cache
    # no adapters are served: empty lists and no room for one; the value is the scrape's time, as vLLM's
    # set_to_current_time, so a picker that takes the newest sample reads this one
    lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters running and waiting (none: bankML serves "
                             "no adapters).", labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    lora.add_metric(["0", "", ""], time.time())
    yield lora


class GapHistogram:
    """A histogram that takes n equal observations at once (an answer's token gaps at their mean): O(buckets)
    per answer, whatever its length."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, (*buckets, math.inf)
        self._counts = [0] * len(self.bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, n: int = 1) -> None:
        with self._lock:
            self._counts[next(i for i, b in enumerate(self.bounds) if value <= b)] += n
            self._sum += value * n

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = list(itertools.accumulate(counts))
        yield HistogramMetricFamily(self.name, self.doc, sum_value=total, buckets=[
            ("+Inf" if b == math.inf else floatToGoString(b), c) for b, c in zip(self.bounds, cumulative, strict=True)])


class PromMetrics:
    """The lifetime series and the sampled ones, in a registry of this app's own."""

    def __init__(self, flights: Callable[[], tuple[int, int] | None], info: Callable[[], Mapping[str, str]],
                 engine: Callable[[], EngineStats | None] = lambda: None):
        disable_created_metrics()  # process-wide: no `*_created` series, which only repeat the start time
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.answers = Counter("bankml_answers", "Answers that ended, by how they ended.", ["finish"], registry=r)
        self.prompt_tokens = Counter("bankml_prompt_tokens", "Prompt tokens of completed answers (cached included).",
                                     registry=r)
        self.cached_tokens = Counter("bankml_prompt_cached_tokens", "Prompt tokens reused from the cache.",
                                     registry=r)
        self.completion_tokens = Counter("bankml_completion_tokens",
                                         "Generated tokens of completed answers (end-of-generation included).",
                                         registry=r)
        self.overloaded = Counter("bankml_requests_overloaded",
                                  "Requests refused with 503 and Retry-After: [engine] max_waiting requests "
                                  "already waited for a sequence.", registry=r)
        self._energy: tuple[float, int] | None = None  # (joules, completion tokens) of measured answers
        self.ttft = Histogram("bankml_ttft_seconds",
                              "From the answer's turn on the engine to its first text (time queued excluded; "
                              "the ttft_ms of /bankml/metrics and of the receipt).",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.latency = Histogram("bankml_request_duration_seconds",
                                 "From the request handed to the engine queue to its last token.",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = GapHistogram("bankml_inter_token_latency_seconds",
                                "Between two generated tokens of an answer. Each answer counts its gaps at its "
                                "mean gap (the engine stamps its first and last token), so _sum and _count are "
                                "exact and an answer's gaps fall in one bucket.", ITL_BUCKETS_S)
        r.register(self.itl)
        self.eval_tps = Histogram("bankml_generation_tokens_per_second", "eval_tps of completed answers.",
                                  buckets=TPS_BUCKETS, registry=r)
        self.usage = UsageCollector(flights, info, lambda: self._energy, engine)
        r.register(self.usage)

    def observe_answer(self, record: Mapping[str, Any], *, ttft_s: float | None, latency_s: float) -> None:
        """A completed answer (its /bankml/metrics record): its `eval_ms` spans its tokens after the first."""
        self.answers.labels(record["finish"] or "stop").inc()
        self.prompt_tokens.inc(record["prompt_tokens"])
        self.cached_tokens.inc(record["cached_tokens"])
        self.completion_tokens.inc(record["completion_tokens"])
        if record["energy_j"] is not None:
            j, n = self._energy or (0.0, 0)
            self._energy = (j + max(0.0, record["energy_j"]), n + record["completion_tokens"])
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(latency_s)
        gaps = record["completion_tokens"] - 1
        if gaps > 0 and record["eval_ms"]:
            self.itl.observe(record["eval_ms"] / 1e3 / gaps, gaps)
        if record["eval_tps"] is not None:
            self.eval_tps.observe(record["eval_tps"])

    def ended_unfinished(self, finish: str) -> None:
        """An answer that ended without completing ("abort": the client went away; "error")."""
        self.answers.labels(finish).inc()

    def exposition(self, usage: dict[str, Any], accept: str | None) -> tuple[bytes, str]:
        """(body, content type) in the format the scraper asked for (Prometheus text by default).
        Synchronous from setting the snapshot to encoding it, so two scrapes on one loop never mix."""
        encoder, content_type = choose_encoder(accept or "")
        self.usage.snapshot = usage
        return encoder(self.registry), content_type
