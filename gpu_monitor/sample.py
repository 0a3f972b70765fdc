"""The usage snapshot behind `GET /bankml/usage`: one 250 ms sample, at most once a second, shared.

A sample reads CPU times, RAPL and NVML energy, sleeps one window, reads them again, then reads memory
and GPUs (as bankML `sys.rs`). GPUs are listed as DRM cards, exactly as the Rust bankml lists them, then
NVML and amdsmi devices are merged into their card by PCI address; a library device with no card is
appended as `nvml<i>` / `amdsmi<i>`. Keys and order are the Rust bankml's, then ours
(§4): `sampled_at`, `package_energy_j`, `unavailable`.

Caching: a sample is reused until `min_interval_s` after its *start*. It is single-flight: whoever
finds the cache stale and no sample running starts one; everyone else (threads and coroutines alike)
waits on that same future. The async path runs the sample in a worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_monitor import limiter as limiter_mod
from gpu_monitor.amd import AmdsmiBackend
from gpu_monitor.drm import read_cards
from gpu_monitor.energy import EnergyMeter
from gpu_monitor.nvml import NvmlBackend
from gpu_monitor.procfs import ProcFS
from gpu_monitor.rapl import EnergyAccumulator
from gpu_monitor.readings import AUTO, GpuReading, Reader, read_text, rounded

USAGE_SOURCE = "bankml sys.rs (/proc)"  # the Rust bankml's constant, kept for its clients

# Which backend wins per GPU key: sysfs is primary for the Rust bankml's fields (APUs read N/A in amdsmi),
# the libraries for the additive ones (sysfs only has hwmon as a fallback there).
_PRIORITY = {
    "busy_percent": ("sysfs", "nvml", "amdsmi"),
    "vram_used_bytes": ("sysfs", "nvml", "amdsmi"),
    "vram_total_bytes": ("sysfs", "nvml", "amdsmi"),
    "gtt_used_bytes": ("sysfs", "amdsmi"),
    "gtt_total_bytes": ("sysfs", "amdsmi"),
    "power_watts": ("nvml", "amdsmi", "sysfs"),
    "power_limit_watts": ("nvml", "amdsmi", "sysfs"),
    "temperature_c": ("nvml", "amdsmi", "sysfs"),
    "energy_j": ("nvml", "amdsmi"),
    "throttle": ("nvml", "amdsmi"),
}
_ORIGINAL_GPU_KEYS = (
    "busy_percent",
    "vram_used_bytes",
    "vram_total_bytes",
    "gtt_used_bytes",
    "gtt_total_bytes",
)
_ADDED_GPU_KEYS = ("power_watts", "power_limit_watts", "temperature_c", "energy_j", "throttle")

Processes = Sequence[tuple[str, int]] | Callable[[], Sequence[tuple[str, int]]]


def merge_gpus(cards: list[GpuReading], libs: list[GpuReading]) -> list[dict[str, Any]]:
    """Cards in their sysfs order, each with the library readings that share its PCI address; then
    library devices without a card. Per key the first backend in `_PRIORITY` that measured it wins."""
    groups: list[tuple[str, list[GpuReading]]] = [(f"card{c.index}", [c]) for c in cards]
    where = {c.pci_bus_id: k for k, c in enumerate(cards) if c.pci_bus_id}
    for r in libs:
        k = where.get(r.pci_bus_id) if r.pci_bus_id else None
        if k is None:
            k = len(groups)
            groups.append((f"{r.source}{r.index}", []))
            if r.pci_bus_id:
                where[r.pci_bus_id] = k
        groups[k][1].append(r)
    return [_render_gpu(card, readings) for card, readings in groups]


def _first(readings: list[GpuReading], attr: str) -> Any:
    return next((getattr(r, attr) for r in readings if getattr(r, attr)), None)


def _render_gpu(card: str, readings: list[GpuReading]) -> dict[str, Any]:
    by_source = {r.source: r for r in readings}
    sysfs = by_source.get("sysfs")
    values: dict[str, Any] = {}
    why: dict[str, str] = {}
    for key in _ORIGINAL_GPU_KEYS + _ADDED_GPU_KEYS:
        tried = [by_source[s] for s in _PRIORITY[key] if s in by_source and key in by_source[s].values]
        got = next((r.values[key] for r in tried if r.values[key] is not None), None)
        values[key] = got
        if got is None:
            why[key] = "; ".join(f"{r.source}: {r.unavailable.get(key, 'not read')}" for r in tried) or (
                f"no backend reads {key} for this card ({'+'.join(by_source)})"
            )
    out: dict[str, Any] = {
        "card": card,
        "driver": sysfs.driver if sysfs is not None else (_first(readings, "driver") or ""),
    }
    out.update({k: values[k] for k in _ORIGINAL_GPU_KEYS})
    out["pci_bus_id"] = _first(readings, "pci_bus_id")
    out["vendor"] = _first(readings, "vendor")
    out["name"] = _first(readings, "name")
    out["source"] = "+".join(r.source for r in readings)
    out.update({k: values[k] for k in _ADDED_GPU_KEYS})
    for key, reason in (
        ("pci_bus_id", "the device link names no PCI address"),
        ("vendor", "no PCI vendor id"),
        ("name", "no library names this card"),
    ):
        if out[key] is None:
            why[key] = reason
    out["unavailable"] = why
    return out


class Monitor:
    """Samples this machine. Every root and clock is injectable; `nvml`/`amdsmi`: AUTO, None or a module."""

    def __init__(
        self,
        *,
        proc_root: str | Path = "/proc",
        sys_root: str | Path = "/sys",
        nvml: Any = AUTO,
        amdsmi: Any = AUTO,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
        window_s: float = 0.25,
        min_interval_s: float = 1.0,
        processes: Processes | None = None,
        limiter: Callable[[], tuple[dict[str, Any] | None, str | None]] = limiter_mod.current_json,
        reader: Reader = read_text,
        use_psutil: bool | None = None,
        affinity_count: Callable[[], int | None] | None = None,
    ) -> None:
        kw = {} if affinity_count is None else {"affinity_count": affinity_count}
        self.procfs = ProcFS(proc_root, sys_root, reader=reader, use_psutil=use_psutil, **kw)
        self.rapl = EnergyAccumulator(sys_root, reader=reader)
        self.nvml = NvmlBackend(nvml, clock=clock)
        self.amdsmi = AmdsmiBackend(amdsmi, clock=clock)
        self.sys_root = sys_root
        self._read = reader
        self._clock, self._sleep, self._wall = clock, sleep, wall
        self.window_s, self.min_interval_s = window_s, min_interval_s
        self._limiter = limiter
        self.set_processes(processes if processes is not None else [("bankml serve", os.getpid())])
        self.samples_taken = 0
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None  # (start of its sample, body)
        self._inflight: concurrent.futures.Future[dict[str, Any]] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()

    def set_processes(self, processes: Processes) -> None:
        """`[("bankml serve", own pid), ("llama-server", child pid or 0)]`, or a callable giving it."""
        self._processes = processes if callable(processes) else (lambda p=list(processes): p)

    # --- one sample ----------------------------------------------------------------------------------

    def sample(self) -> dict[str, Any]:
        """Measure now (blocks for `window_s`), bypassing the cache. Never raises for a missing value."""
        with self._lock:
            self.samples_taken += 1
        why: dict[str, str] = {}
        procs = self._guard(
            why,
            "processes",
            lambda: [(n, int(p)) for n, p in self._processes() if int(p) > 0 and self.procfs.exists(int(p))],
            [],
        )
        t0 = self._clock()
        cpu0 = [self.procfs.cpu_seconds(p) for _, p in procs]
        pkg0, _ = self.rapl.total_j()
        tr0 = self._clock()
        gpu0 = self._guard(why, "gpus.nvml", self.nvml.energy_mj, {})
        tg0 = self._clock()
        self._sleep(self.window_s)
        t1 = self._clock()
        cpu1 = [self.procfs.cpu_seconds(p) for _, p in procs]
        pkg1, pkg_why = self.rapl.total_j()
        tr1 = self._clock()
        gpu1 = self._guard(why, "gpus.nvml", self.nvml.energy_mj, {})
        tg1 = self._clock()
        mem = self.procfs.memory()
        why.update(mem.unavailable)

        rows = []
        for i, ((name, pid), (a, awhy), (b, bwhy)) in enumerate(zip(procs, cpu0, cpu1, strict=True)):
            rss, rwhy = self.procfs.rss_bytes(pid)
            if rss is None:
                why[f"processes[{i}].rss_bytes"] = f"{rwhy} (reads 0)"
            cpu = None
            if a is not None and b is not None and t1 > t0:
                cpu = max(0.0, (b - a) / (t1 - t0) * 100)
            else:
                why[f"processes[{i}].cpu_percent"] = (
                    awhy or bwhy or "the window measured 0 s"
                ) + " (reads 0)"
            rows.append(
                {"name": name, "pid": pid, "rss_bytes": rss or 0, "cpu_percent": rounded(cpu or 0.0, 1)}
            )

        package_watts = None
        if pkg0 is not None and pkg1 is not None and tr1 > tr0:
            package_watts = rounded((pkg1 - pkg0) / (tr1 - tr0), 2)
        else:
            why["package_watts"] = pkg_why or "the window measured 0 s"
        if pkg1 is None:
            why["package_energy_j"] = pkg_why or "RAPL unread"

        window_power = {}
        for idx, after in gpu1.items():
            before = gpu0.get(idx)
            # A powered GPU never draws 0 W: an unmoved counter means it ticks coarser than the window,
            # so the averaged reading is used instead.
            if before is not None and after is not None and after > before and tg1 > tg0:
                window_power[idx] = (after - before) / 1000 / (tg1 - tg0)
        cards, drm_why = read_cards(self.sys_root, self._read)
        libs = self._guard(
            why, "gpus.nvml", lambda: self.nvml.readings(energy_mj=gpu1, window_power_watts=window_power), []
        ) + self._guard(why, "gpus.amdsmi", self.amdsmi.readings, [])
        for key, reason in (
            ("gpus.sysfs", drm_why),
            ("gpus.nvml", self.nvml.reason),
            ("gpus.amdsmi", self.amdsmi.reason),
        ):
            if reason:
                why.setdefault(key, reason)
        gpu_limiter, lim_why = self._guard(why, "gpu_limiter", self._limiter, (None, None))
        if gpu_limiter is None:
            why.setdefault("gpu_limiter", lim_why or "no limiter")

        return {
            "source": USAGE_SOURCE,
            "cores": self.procfs.cores(),
            "mem_total_bytes": mem.mem_total_bytes,
            "mem_available_bytes": mem.mem_available_bytes,
            "swap_total_bytes": mem.swap_total_bytes,
            "swap_free_bytes": mem.swap_free_bytes,
            "rss_bytes": sum(r["rss_bytes"] for r in rows),
            "cpu_percent": rounded(sum(r["cpu_percent"] for r in rows), 1),
            "interval_ms": int(round(self.window_s * 1000)),
            "processes": rows,
            "package_watts": package_watts,
            "gpus": merge_gpus(cards, libs),
            "gpu_limiter": gpu_limiter,
            "sampled_at": rounded(self._wall(), 3),
            "package_energy_j": rounded(pkg1, 3),
            "unavailable": why,
        }

    @staticmethod
    def _guard(why: dict[str, str], key: str, fn: Callable[[], Any], default: Any) -> Any:
        """A library binding that misbehaves (an attribute missing, a type changed) becomes a reason:
        /bankml/usage must answer even then."""
        try:
            return fn()
        except Exception as e:
            why[key] = f"internal error reading {key}: {type(e).__name__}: {e}"
            return default

    # --- cached, single-flight -----------------------------------------------------------------------

    def _claim(self) -> tuple[dict[str, Any] | None, concurrent.futures.Future | None, bool]:
        with self._lock:
            if self._cached is not None and self._clock() - self._cached[0] < self.min_interval_s:
                return self._cached[1], None, False
            if self._inflight is not None:
                return None, self._inflight, False
            fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
            # RUNNING: a cancelled waiter can then never cancel the sample the others wait on.
            fut.set_running_or_notify_cancel()
            self._inflight = fut
            return None, fut, True

    def _run(self, fut: concurrent.futures.Future) -> None:
        started = self._clock()
        try:
            body = self.sample()
        except BaseException as e:  # a bug must not leave every poller waiting forever
            with self._lock:
                self._inflight = None
            fut.set_exception(e)
            return
        with self._lock:
            self._cached = (started, body)
            self._inflight = None
        fut.set_result(body)

    def get_usage_sync(self) -> dict[str, Any]:
        """The usage snapshot; blocks up to one window when the cache is stale. A private copy."""
        body, fut, owner = self._claim()
        if body is None:
            if owner:
                self._run(fut)
            body = fut.result()
        return copy.deepcopy(body)

    async def get_usage(self) -> dict[str, Any]:
        """The usage snapshot, for the event loop: the sample runs in a worker thread."""
        body, fut, owner = self._claim()
        if body is None:
            if owner:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="bankml-usage"
                    )
                self._executor.submit(self._run, fut)
            body = await asyncio.wrap_future(fut)
        return copy.deepcopy(body)

    # --- energy, background, shutdown ----------------------------------------------------------------

    def energy_meter(self, device: str = "cpu", gpu_indices: Sequence[int] | None = None) -> EnergyMeter:
        """A meter over this monitor's RAPL accumulator and NVML backend (shared counters, one init)."""
        return EnergyMeter(self.rapl, self.nvml, device=device, gpu_indices=gpu_indices, clock=self._clock)

    def start(self, *, refresh: bool = False) -> None:
        """Keep RAPL's wrap accounting current (every 10 s); with `refresh`, also keep the usage cache
        warm so that no poll waits for a window."""
        self.rapl.start()
        self.nvml.energy_mj()  # nvmlInit now, not in the first answer's energy mark
        if refresh and self._refresher is None:
            self._stop.clear()

            def loop() -> None:
                while not self._stop.is_set():
                    try:
                        self.get_usage_sync()
                    except Exception:  # a bug in a sample must not end the refresher
                        pass
                    self._stop.wait(self.min_interval_s)

            self._refresher = threading.Thread(target=loop, name="bankml-usage-refresh", daemon=True)
            self._refresher.start()

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=2.0)
            self._refresher = None
        self.rapl.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        self.nvml.close()
        self.amdsmi.close()
