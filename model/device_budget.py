"""The server's own device budget (spec/README.md §7), the "GPU limiter" that /bankml/usage shows.

Two halves, each with how much is in use:
- memory: `[engine] memory_fraction` is the share of device memory the server may take. JAX's GPU
  allocator reads it from XLA_PYTHON_CLIENT_MEM_FRACTION once, when its backend starts, so
  `apply_memory_fraction` runs before the engine first touches jax. The allocator then reports
  `bytes_in_use` and `bytes_limit` through `Device.memory_stats()`. A CPU backend has no such
  allocator: the fraction is reported as configured, its bytes null with the reason.
- sequences: the engine decodes up to `max_seqs` sequences at once; the running ones (the scheduler's
  last snapshot, `EngineStats.running`) are in use.

No jax import here: the gateway registers the provider (gateway/app.py), and a process whose engine
never imported jax (the tests' fake engine) holds no JAX device memory to report.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from typing import Any

from bankml.errors import ConfigInvalid
from gpu_monitor.limiter import LimiterStatus
from model.messages import EngineStats

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def _jax_started(jax: Any) -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # a private API that moved: assume the worst, the allocator may be up
        return True


def apply_memory_fraction(fraction: float, environ: MutableMapping[str, str] = os.environ) -> tuple[float, str | None]:
    """Hand `fraction` to JAX's allocator; returns (the fraction in force, why it is not `fraction`, or None).

    An operator's own XLA_PYTHON_CLIENT_MEM_FRACTION wins (it is the knob JAX documents). Once JAX's
    backend has started, the variable is no longer read, so the configured value is only reported."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigInvalid(f"[engine] memory_fraction must be in (0, 1], not {fraction}")
    given = environ.get(MEM_FRACTION_ENV)
    if given:
        try:
            effective = float(given)
        except ValueError:
            raise ConfigInvalid(f"{MEM_FRACTION_ENV}={given!r} is not a number") from None
        if effective != fraction:
            return effective, (f"{MEM_FRACTION_ENV}={given} in the environment wins over "
                               f"[engine] memory_fraction {fraction}")
        return effective, None
    jax = sys.modules.get("jax")
    if jax is not None and _jax_started(jax):
        return fraction, "JAX started before memory_fraction could be applied: its allocator keeps its default"
    environ[MEM_FRACTION_ENV] = f"{fraction:g}"
    return fraction, None


def _device() -> Any | None:
    """JAX's first local device, if this process imported jax (the engine did, when it loaded)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    return jax.local_devices()[0]


def engine_platform() -> str:
    """"gpu" when the engine's arrays live on a GPU, else "cpu": what an answer's energy_j measures."""
    dev = _device()
    return "gpu" if dev is not None and dev.platform in ("gpu", "cuda", "rocm") else "cpu"


def limiter_provider(engine: Callable[[], Any], *, memory_fraction: float, max_seqs: int,
                     stats: Callable[[], EngineStats | None] | None = None,
                     note: str | None = None) -> Callable[[], LimiterStatus]:
    """A provider for `gpu_monitor.limiter.register`. `engine()` gives the resident engine or None (the
    model was unloaded: nothing decodes); `stats()` the scheduler's last snapshot (the engine thread's
    `stats`), whose running sequences are the ones in use. An engine without a snapshot is asked for
    its `free_slots()`. Called at most once per usage sample, from the sampler thread; the reads are
    plain attribute reads, safe beside the engine thread."""

    def status() -> LimiterStatus:
        eng = engine()
        snapshot = stats() if stats is not None and eng is not None else None
        dev = _device()
        if snapshot is not None and snapshot.max_seqs > 0:
            seqs = snapshot.max_seqs
        else:
            seqs = int(getattr(eng, "max_seqs", max_seqs)) if eng is not None else max_seqs
        free = getattr(eng, "free_slots", None)
        if snapshot is not None:
            in_use = snapshot.running
        elif callable(free):
            in_use = seqs - int(free())
        else:
            in_use = 0
        out = LimiterStatus.from_memory_stats(
            dev.memory_stats() if dev is not None else None,
            memory_fraction=memory_fraction,
            sequences_max=seqs,
            sequences_in_use=in_use,
            device=f"{dev.platform}:{dev.id}" if dev is not None else "",
        )
        why = dict(out.unavailable)
        if dev is None:
            for key in ("allocated_bytes", "limit_bytes", "peak_bytes"):
                why[key] = "the engine holds no JAX device memory in this process"
        elif dev.platform == "cpu":
            for key in ("allocated_bytes", "limit_bytes", "peak_bytes"):
                why[key] = "JAX's CPU backend has no device allocator; memory_fraction applies to GPUs"
        if eng is None:
            why["sequences_in_use"] = "no model is resident"
        elif snapshot is None and not callable(free):
            why["sequences_in_use"] = "the engine does not say how many of its sequences run (reads 0)"
        if note:
            why["limit"] = note
        return replace(out, unavailable=why)

    return status


def memory_budget_bytes(cpu_share: float = 0.8) -> int:
    """What resident models may hold together: on an accelerator its allocator's limit (memory_fraction
    of the device), on a CPU `cpu_share` of the machine's RAM."""
    dev = _device()
    stats = dev.memory_stats() if dev is not None and dev.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    import psutil

    return int(cpu_share * psutil.virtual_memory().total)
