"""Energy of one answer: counters read at its start and its end, nothing estimated.

The engine takes a mark right after its slot is acquired (queueing excluded, as llama-server's timings) and
stops it when the answer completes; errors and client-gone runs `cancel()` their mark and record nothing.

- `package_energy_j`: RAPL, all CPU packages summed (the whole package: other processes and an APU's
  GPU included, never a discrete GPU), through the wrap-safe accumulator.
- `gpu_energy_j`: NVML's total-energy counter (mJ since the driver loaded, Volta+), summed over the
  engine's GPUs. amdsmi's counter is frozen or wrong on some parts, so it is not used here.
- `energy_j`: the energy of the device the engine runs on: the packages when it runs on the CPU, the
  GPUs when it runs on NVIDIA GPUs. Null where that device's counter is unmeasured.

The counters are device-wide: when two answers overlap, each is charged the device's whole energy
over its span, and `overlapped` says so (the Rust bankml has one slot and never overlaps).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpu_monitor.nvml import NvmlBackend
from gpu_monitor.rapl import EnergyAccumulator


@dataclass(frozen=True)
class EnergyMark:
    at_s: float
    package_j: float | None
    package_why: str | None
    gpu_mj: dict[int, int | None]
    gpu_why: str | None
    token: int


@dataclass(frozen=True)
class EnergyReading:
    energy_j: float | None
    package_energy_j: float | None
    gpu_energy_j: float | None
    elapsed_s: float
    overlapped: bool
    unavailable: dict[str, str] = field(default_factory=dict)

    def joules_per_token(self, completion_tokens: int) -> float | None:
        """`energy_j / completion_tokens` (the end-of-generation token counts, as llama-server counts it)."""
        if self.energy_j is None or completion_tokens <= 0:
            return None
        return self.energy_j / completion_tokens


class EnergyMeter:
    """Start/stop marks over RAPL and NVML. `device`: "cpu" or "gpu" (what `energy_j` means);
    `gpu_indices`: the NVML indices the engine uses (None: every NVML GPU)."""

    def __init__(
        self,
        rapl: EnergyAccumulator | None = None,
        nvml: NvmlBackend | None = None,
        *,
        device: str = "cpu",
        gpu_indices: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', not {device!r}")
        self.rapl, self.nvml, self.device = rapl, nvml, device
        self.gpu_indices = None if gpu_indices is None else list(gpu_indices)
        self._clock = clock
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._active: dict[int, bool] = {}  # mark token -> overlapped so far

    def _read_gpus(self) -> tuple[dict[int, int | None], str | None]:
        if self.nvml is None:
            return {}, "no NVML backend"
        counters = self.nvml.energy_mj()
        if not counters:
            return {}, self.nvml.reason or "NVML lists no GPU"
        if self.gpu_indices is not None:
            counters = {i: counters.get(i) for i in self.gpu_indices}
        return counters, None

    def start(self) -> EnergyMark:
        package_j, package_why = self.rapl.total_j() if self.rapl is not None else (None, "no RAPL backend")
        gpu_mj, gpu_why = self._read_gpus()
        with self._lock:
            token = next(self._tokens)
            overlapped = bool(self._active)
            for t in self._active:
                self._active[t] = True
            self._active[token] = overlapped
        return EnergyMark(self._clock(), package_j, package_why, gpu_mj, gpu_why, token)

    def cancel(self, mark: EnergyMark) -> None:
        """For an answer that records nothing (error, client gone): forget its mark."""
        with self._lock:
            self._active.pop(mark.token, None)

    def stop(self, mark: EnergyMark) -> EnergyReading:
        package_j, package_why = self.rapl.total_j() if self.rapl is not None else (None, "no RAPL backend")
        gpu_mj, gpu_why = self._read_gpus()
        elapsed_s = max(0.0, self._clock() - mark.at_s)
        with self._lock:
            overlapped = self._active.pop(mark.token, False)
        why: dict[str, str] = {}

        package_energy_j = None
        if mark.package_j is not None and package_j is not None:
            package_energy_j = package_j - mark.package_j
        else:
            why["package_energy_j"] = mark.package_why or package_why or "RAPL unread"

        gpu_energy_j = None
        if mark.gpu_why or gpu_why:
            why["gpu_energy_j"] = mark.gpu_why or gpu_why or ""
        else:
            total_mj = 0
            for i, before in mark.gpu_mj.items():
                after = gpu_mj.get(i)
                if before is None or after is None:
                    why["gpu_energy_j"] = f"NVML GPU {i} has no total-energy counter (Volta+ only) or is lost"
                    break
                if after < before:
                    why["gpu_energy_j"] = f"NVML GPU {i}'s energy counter went back (driver reloaded?)"
                    break
                total_mj += after - before
            else:
                gpu_energy_j = total_mj / 1000 if mark.gpu_mj else None
                if not mark.gpu_mj:
                    why["gpu_energy_j"] = "no NVML GPU selected"

        if self.device == "cpu":
            energy_j = package_energy_j
            if energy_j is None:
                why["energy_j"] = (
                    f"the engine runs on the CPU and RAPL is unmeasured: {why['package_energy_j']}"
                )
        else:
            energy_j = gpu_energy_j
            if energy_j is None:
                why["energy_j"] = (
                    f"the engine runs on a GPU and NVML energy is unmeasured: {why['gpu_energy_j']}"
                )
        return EnergyReading(energy_j, package_energy_j, gpu_energy_j, elapsed_s, overlapped, why)
