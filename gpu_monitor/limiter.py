"""The GPU limiter's fields (spec/README.md §7): data only; the engine fills them, the monitor shows them.

Ours is the server's own budget, not a hardware throttle (that is per GPU, beside it, in `gpus[]`):
the share of device memory the server may take (`[engine] memory_fraction`, applied to JAX's allocator
before the backend starts) and the number of sequences it decodes at once (`[engine] max_seqs`), each
with how much is in use. Null where no engine runs in this process (P0 behind llama-server).

The engine (model/, the only place that touches JAX's allocator) registers a provider once its device
is up, and unregisters it when it stops:

    from gpu_monitor import limiter
    dev = jax.local_devices()[0]
    limiter.register(lambda: limiter.LimiterStatus.from_memory_stats(
        dev.memory_stats(),            # dict on GPU, None on CPU
        memory_fraction=cfg.engine.memory_fraction,
        sequences_max=cfg.engine.max_seqs,
        sequences_in_use=scheduler.active_count(),   # a plain int read, no lock needed
        device=f"{dev.platform}:{dev.id}",
        heap_bytes=nvml_total_or_None))  # device memory, if the engine knows it
    ...
    limiter.unregister()

The monitor calls the provider at most once per usage sample (≤ 1/s), never per decode step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LimiterStatus:
    memory_fraction: float  # the share of device memory the server may take (config)
    sequences_max: int  # sequences decoded at once (config max_seqs)
    sequences_in_use: int  # sequences decoding now
    allocated_bytes: int | None = None  # held by the allocator now (bytes_in_use)
    limit_bytes: int | None = None  # the allocator's ceiling (bytes_limit ≈ fraction × device memory)
    peak_bytes: int | None = None  # the most held since start
    heap_bytes: int | None = None  # the device's whole memory
    device: str = ""  # "cuda:0", "cpu:0"
    source: str = "jax memory_stats"
    unavailable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_memory_stats(
        cls,
        stats: Mapping[str, Any] | None,
        *,
        memory_fraction: float,
        sequences_max: int,
        sequences_in_use: int,
        device: str = "",
        heap_bytes: int | None = None,
    ) -> LimiterStatus:
        """Build from `jax.Device.memory_stats()` (a plain dict; None on CPU backends)."""
        why: dict[str, str] = {}
        got: dict[str, int | None] = {}
        for ours, theirs in (
            ("allocated_bytes", "bytes_in_use"),
            ("limit_bytes", "bytes_limit"),
            ("peak_bytes", "peak_bytes_in_use"),
        ):
            v = stats.get(theirs) if stats is not None else None
            got[ours] = int(v) if isinstance(v, int | float) and v >= 0 else None
            if got[ours] is None:
                why[ours] = (
                    f"{device or 'this device'} reports no memory_stats"
                    if stats is None
                    else f"no {theirs} in memory_stats"
                )
        if heap_bytes is None:
            why["heap_bytes"] = "the engine did not give the device's memory size"
        return cls(
            memory_fraction=float(memory_fraction),
            sequences_max=int(sequences_max),
            sequences_in_use=int(sequences_in_use),
            heap_bytes=heap_bytes,
            device=device,
            unavailable=why,
            **got,
        )

    def to_json(self) -> dict[str, Any]:
        """`limit`, `allocated_bytes` and `heap_bytes` keep the Rust bankml's names (its status page reads
        `gpu_limiter.limit` and `allocated_bytes`); the rest is ours."""
        return {
            "limit": round(self.memory_fraction, 2),
            "allocated_bytes": self.allocated_bytes,
            "heap_bytes": self.heap_bytes,
            "limit_bytes": self.limit_bytes,
            "peak_bytes": self.peak_bytes,
            "sequences_max": self.sequences_max,
            "sequences_in_use": self.sequences_in_use,
            "device": self.device,
            "source": self.source,
            "unavailable": dict(self.unavailable),
        }


_lock = threading.Lock()
_provider: Callable[[], LimiterStatus] | None = None

NO_ENGINE = "no engine runs in this process"


def register(provider: Callable[[], LimiterStatus]) -> None:
    global _provider
    with _lock:
        _provider = provider


def unregister() -> None:
    global _provider
    with _lock:
        _provider = None


def current_json() -> tuple[dict[str, Any] | None, str | None]:
    """(the limiter's JSON, None), or (None, why it is null). A failing provider is a reason, not a crash."""
    with _lock:
        provider = _provider
    if provider is None:
        return None, NO_ENGINE
    try:
        return provider().to_json(), None
    except Exception as e:
        return None, f"the engine's limiter provider failed: {type(e).__name__}: {e}"
