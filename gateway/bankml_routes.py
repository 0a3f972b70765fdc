"""bankML's own routes: `GET /bankml` (gate.md §5, native keys), `/bankml/usage`, `/bankml/metrics`.

/bankml answers from the most recent verification, so a client (sAGI's models.py reads
`verified.model_sha256` and `model`) can check what it is talking to before it asks anything.
/bankml/usage and /bankml/metrics answer with what exists now: this process's memory and CPU time
from /proc, and one record per completed answer in a ring of 256; their full content (GPUs, energy,
the limiter) is monitor.md's, a later issue.
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from dataclasses import dataclass, field

from bankml import jstr
from gateway.errors import json_response
from model.messages import StepOutput

KEEP = 256


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


@dataclass
class MetricsRing:
    """One record per completed answer, oldest first (serving.md §5), energy unmeasured (null)."""

    records: deque = field(default_factory=lambda: deque(maxlen=KEEP))

    def add(self, model: str, last: StepOutput, ttft_ms: float | None) -> None:
        prompt_n = max(0, last.prompt_tokens - last.cached_tokens)
        self.records.append({
            "at": round(time.time(), 3),
            "model": model,
            "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens,
            "completion_tokens": last.completion_tokens,
            "prompt_ms": round(last.prompt_ms, 1),
            "ttft_ms": _round(ttft_ms, 1),
            "eval_ms": round(last.predicted_ms, 1),
            "prompt_tps": round(prompt_n / (last.prompt_ms / 1e3), 2) if prompt_n and last.prompt_ms > 0 else None,
            "eval_tps": (round(last.completion_tokens / (last.predicted_ms / 1e3), 2)
                         if last.completion_tokens and last.predicted_ms > 0 else None),
            "finish": last.finish_reason.value if last.finish_reason else None,
            "energy_j": None,
            "joules_per_token": None,
        })

    def json(self) -> str:
        records = list(self.records)
        return jstr.dumps({
            "source": "bankml serve --native",
            "kept": len(records),
            "keep": KEEP,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "energy_j": None,
            "joules_per_token": None,
            "records": records,
        })


async def bankml(request, state):
    res = state.residency
    last = res.last
    return json_response(jstr.dumps({
        "verified": last.verified.as_dict() if last else None,
        "model": last.path if last else None,
        "upstream": state.upstream,
        "engine": last.engine if last else None,
        "hashed_at": last.hashed_at if last else 0,
        "resident": res.resident.name if res.resident else None,
        "models": res.names,
    }))


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def usage(request, state):
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rss = _rss_bytes()
    return json_response(jstr.dumps({
        "source": "bankml serve (/proc)",
        "rss_bytes": rss,
        "processes": [{"name": "bankml serve", "pid": os.getpid(), "rss_bytes": rss,
                       "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 3)}],
    }))


async def metrics(request, state):
    return json_response(state.metrics.json())
