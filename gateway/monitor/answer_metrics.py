"""`GET /bankml/metrics`: one record per completed answer, in a ring of 256 (README, "Monitoring").

The record is the Rust bankml's (metrics.rs), key for key and rounded as it rounds, then ours (`queue_ms`
onwards). Times are the engine thread's timeline (model/messages.py `Timeline`) from t0, the answer's turn
on the engine, so queueing is excluded; `ttft_ms` is to the first token that released text (the same as
the receipt's and Prometheus' bankml_ttft_seconds). Rates use the end-of-generation counts, as
llama-server counts them, and are null unless both terms are > 0. `grammar_ms` is the host time of the
answer's grammar (model/constraint.py); `resampled` is always 0: the mask applies before the sampler
chain, so nothing is drawn twice. `energy_j` is the engine device's counter over t0..end (RAPL on a CPU,
NVML on NVIDIA GPUs), null where unmeasured with the reason in `unavailable`: nothing is estimated;
`energy_overlapped` says another answer ran meanwhile, which device counters cannot split. An answer
that speculative decoding drafted for ends with `draft_n` and `draft_n_accepted` (llama-server's timings:
tokens drafted and checked, and of those kept).

Totals are sums over the kept records (energy over the measured ones), so they fall as records age out;
lifetime counters live in Prometheus (gateway/monitor/prometheus.py). `ttft_percentiles` gives the status
page's time-to-first-token chart its p50 and p95 over the answers of the last minute.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any

from gpu_monitor.readings import rounded
from model.messages import StepOutput

KEEP = 256
SOURCE = "bankml metrics.rs (measured in the engine)"  # the Rust bankml's constant, kept for its clients


def _rate(n: int, ms: float) -> float | None:
    return rounded(n / (ms / 1e3), 2) if n > 0 and ms > 0 else None


def answer_record(model: str, last: StepOutput, *, at: float | None = None) -> dict[str, Any]:
    """The record of one completed answer, from its final StepOutput (its timeline and energy)."""
    why: dict[str, str] = {}
    energy, energy_why, ttft_ms = last.energy, last.energy_why, last.ttft_ms
    if energy is None:
        energy_j = package_j = gpu_j = None
        overlapped = False
        for key in ("energy_j", "package_energy_j", "gpu_energy_j"):
            why[key] = energy_why or "no energy reading"
    else:
        energy_j, package_j, gpu_j = energy.energy_j, energy.package_energy_j, energy.gpu_energy_j
        overlapped = energy.overlapped
        why.update(energy.unavailable)
    per_token = None
    if energy_j is not None and last.completion_tokens > 0:
        per_token = energy_j / last.completion_tokens
    elif energy_j is not None:
        why["joules_per_token"] = "no completion tokens"
    if ttft_ms is None:
        why["ttft_ms"] = "the answer has no text"
    if last.timeline is None:
        why["queue_ms"] = "the engine stamped no timeline"
    record = {
        "at": rounded(time.time() if at is None else at, 3),
        "model": model,
        "prompt_tokens": last.prompt_tokens,
        "cached_tokens": last.cached_tokens,
        "completion_tokens": last.completion_tokens,
        "prompt_ms": rounded(last.prompt_ms, 1),
        "ttft_ms": rounded(ttft_ms, 1),
        "eval_ms": rounded(last.predicted_ms, 1),
        "prompt_tps": _rate(last.prompt_tokens - last.cached_tokens, last.prompt_ms),
        "eval_tps": _rate(last.completion_tokens, last.predicted_ms),
        "finish": last.finish_reason.value if last.finish_reason else None,
        "grammar_ms": rounded(float(last.grammar_ms), 3),
        "resampled": 0,
        "energy_j": rounded(energy_j, 3),
        "joules_per_token": rounded(per_token, 4),
        "queue_ms": rounded(last.timeline.queue_ms, 1) if last.timeline is not None else None,
        "package_energy_j": rounded(package_j, 3),
        "gpu_energy_j": rounded(gpu_j, 3),
        "energy_overlapped": overlapped,
        "unavailable": why,
    }
    if last.draft_n > 0:  # speculative decoding drafted for it: as its timings say (chat_writer.py)
        record["draft_n"] = last.draft_n
        record["draft_n_accepted"] = last.draft_n_accepted
    return record


class MetricsRing:
    """The last KEEP records, oldest first. Appended on the event loop, read by the routes."""

    def __init__(self, keep: int = KEEP):
        self.records: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()  # P0 or a test may append from another thread

    def append(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)

    def json_dict(self, source: str = SOURCE) -> dict[str, Any]:
        with self._lock:
            records = list(self.records)
        measured = [r for r in records if r["energy_j"] is not None]
        energy_j = sum(r["energy_j"] for r in measured) if measured else None
        measured_tokens = sum(r["completion_tokens"] for r in measured)
        return {
            "source": source,
            "kept": len(records),
            "keep": self.records.maxlen,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "energy_j": rounded(energy_j, 3),
            "joules_per_token": rounded(energy_j / measured_tokens, 4) if energy_j is not None and measured_tokens
            else None,
            "records": records,
        }

    def ttft_percentiles(self, now: float, window_s: float) -> dict[str, Any]:
        """p50 and p95 of `ttft_ms` over the kept answers that completed in the last `window_s` seconds
        (nearest rank, so each is a measured value); null with the reason when none had a first token."""
        with self._lock:
            ttfts = sorted(r["ttft_ms"] for r in self.records
                           if r["at"] >= now - window_s and r["ttft_ms"] is not None)
        out: dict[str, Any] = {"window_s": window_s, "answers": len(ttfts), "p50_ms": None, "p95_ms": None}
        if not ttfts:
            out["unavailable"] = f"no answer with text completed in the last {window_s:g} s"
            return out
        for key, q in (("p50_ms", 0.50), ("p95_ms", 0.95)):
            out[key] = ttfts[max(0, math.ceil(q * len(ttfts)) - 1)]
        return out
