"""NVIDIA GPUs through NVML (module `pynvml`, shipped by pip `nvidia-ml-py`; imported lazily).

`nvmlInit()` runs once, on first use. If it fails (no library, no driver, no permission) the reason is
kept, no GPU is listed, and init is retried at most every `retry_s`. Every field has its own try: a
`NotSupported` field is null with the reason, a lost GPU keeps its slot (by PCI address) with every
field null and "GPU is lost". Watts come from the total-energy counter's ΔE/Δt over the sample window
when the caller has one (Volta+; better than the 1 s averaged power on Ampere and newer), otherwise from
`nvmlDeviceGetPowerUsage`. NVML order is PCI order and ignores CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

from typing import Any

from gpu_monitor.readings import GpuReading, normalize_pci
from gpu_monitor.vendor_lib import VendorLibrary

# nvmlClocksEventReasons bits (nvml.h). "Throttled" is any bit but gpu_idle.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}

# NVML return codes, for modules whose exceptions carry `.value` but not the named subclasses.
_CODES = {
    "NoPermission": 4,
    "DriverNotLoaded": 9,
    "LibraryNotFound": 12,
    "FunctionNotFound": 13,
    "NotSupported": 3,
    "GpuIsLost": 15,
}


def throttle_json(mask: int, source: str) -> dict[str, Any]:
    reasons = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    reasons += [f"bit_{i}" for i in range(9, 64) if mask & (1 << i)]
    return {"mask": int(mask), "reasons": reasons, "throttled": bool(mask & ~0x1), "source": source}


_FIELDS = (
    "busy_percent",
    "vram_used_bytes",
    "vram_total_bytes",
    "power_watts",
    "power_limit_watts",
    "temperature_c",
    "energy_j",
    "throttle",
)


class _Lost(Exception):
    pass


class _Device:
    __slots__ = ("index", "handle", "pci_bus_id", "name", "lost")

    def __init__(self, index: int, handle: Any, pci_bus_id: str | None, name: str | None, lost: str | None):
        self.index, self.handle, self.pci_bus_id, self.name, self.lost = index, handle, pci_bus_id, name, lost


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


class NvmlBackend(VendorLibrary):
    """All NVIDIA GPUs NVML sees. `module`: AUTO (import pynvml), None (off) or a module-like object."""

    import_name = "pynvml"  # pip nvidia-ml-py
    off_reason = "NVML is switched off"
    init_call = "nvmlInit"

    def _kind(self, e: BaseException) -> str | None:
        for name, code in _CODES.items():
            cls = getattr(self._lib, f"NVMLError_{name}", None)
            if (isinstance(cls, type) and isinstance(e, cls)) or getattr(e, "value", None) == code:
                return name
        return None

    def _start(self, nv: Any) -> int:
        nv.nvmlInit()  # raises LibraryNotFound, DriverNotLoaded, NoPermission, …
        return int(nv.nvmlDeviceGetCount())

    def _enumerate(self, nv: Any, count: int) -> list[_Device]:
        return [self._open(i) for i in range(count)]

    def _shutdown(self, nv: Any) -> None:
        nv.nvmlShutdown()

    def _open(self, i: int) -> _Device:
        nv = self._lib
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
        except Exception as e:
            return _Device(i, None, None, None, f"no handle: {self._describe(e)}")
        try:
            pci = normalize_pci(_text(nv.nvmlDeviceGetPciInfo(h).busId))
        except Exception:  # appended as nvml<i> without an address
            pci = None
        try:
            name = _text(nv.nvmlDeviceGetName(h))
        except Exception:
            name = None
        return _Device(i, h, pci, name, None)

    def _describe(self, e: BaseException) -> str:
        kind = self._kind(e)
        msg = str(e) or type(e).__name__
        return f"{msg} ({kind})" if kind and kind.lower() not in msg.replace(" ", "").lower() else msg

    # --- reads ---------------------------------------------------------------------------------------

    def _call(self, dev: _Device, fn: str, *args: Any) -> tuple[Any, str | None]:
        """One NVML call for one field. NotSupported and friends -> (None, reason); lost -> _Lost."""
        f = getattr(self._lib, fn, None)
        if f is None:
            return None, f"{fn} is not in this NVML binding"
        try:
            return f(dev.handle, *args), None
        except Exception as e:
            if self._kind(e) == "GpuIsLost":
                dev.lost = f"{fn}: {self._describe(e)}"
                raise _Lost from e
            return None, f"NVML {fn}: {self._describe(e)}"

    def energy_mj(self) -> dict[int, int | None]:
        """Each GPU's total-energy counter (mJ since the driver loaded); None where unsupported or lost."""
        with self._lock:
            out: dict[int, int | None] = {}
            for dev in self._ensure():
                if dev.lost:
                    out[dev.index] = None
                    continue
                try:
                    v, _ = self._call(dev, "nvmlDeviceGetTotalEnergyConsumption")
                except _Lost:
                    v = None
                out[dev.index] = int(v) if v is not None else None
            return out

    def readings(
        self,
        *,
        energy_mj: dict[int, int | None] | None = None,
        window_power_watts: dict[int, float] | None = None,
    ) -> list[GpuReading]:
        """One reading per NVML device. `energy_mj`: counters the caller just read (saves a call);
        `window_power_watts`: ΔE/Δt the caller measured over its window, preferred to the averaged power."""
        with self._lock:
            out = []
            for dev in self._ensure():
                r = GpuReading(
                    source="nvml",
                    index=dev.index,
                    pci_bus_id=dev.pci_bus_id,
                    vendor="nvidia",
                    name=dev.name,
                    driver="nvidia",
                )
                try:
                    if dev.lost:
                        raise _Lost
                    self._fill(dev, r, energy_mj or {}, window_power_watts or {})
                except _Lost:
                    for key in _FIELDS:
                        r.put(key, None, f"GPU is lost (NVML {dev.lost})")
                except Exception as e:  # a binding whose types changed: a reason, not a failed sample
                    for key in _FIELDS:
                        if key not in r.values:
                            r.put(key, None, f"NVML binding error: {type(e).__name__}: {e}")
                out.append(r)
            return out

    def _fill(
        self, dev: _Device, r: GpuReading, energy_mj: dict[int, int | None], power_w: dict[int, float]
    ) -> None:
        nv = self._lib
        util, why = self._call(dev, "nvmlDeviceGetUtilizationRates")
        r.put("busy_percent", int(util.gpu) if util is not None else None, why)
        mem, why = self._call(dev, "nvmlDeviceGetMemoryInfo")
        r.put("vram_used_bytes", int(mem.used) if mem is not None else None, why)
        r.put("vram_total_bytes", int(mem.total) if mem is not None else None, why)
        if dev.index in power_w:
            r.put("power_watts", round(power_w[dev.index], 2))
        else:
            mw, why = self._call(dev, "nvmlDeviceGetPowerUsage")
            r.put("power_watts", round(mw / 1000, 2) if mw is not None else None, why)
        mw, why = self._call(dev, "nvmlDeviceGetEnforcedPowerLimit")
        r.put("power_limit_watts", round(mw / 1000, 2) if mw is not None else None, why)
        c, why = self._call(dev, "nvmlDeviceGetTemperature", getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        r.put("temperature_c", c if c is None else int(c), why)
        if dev.index in energy_mj and energy_mj[dev.index] is not None:
            r.put("energy_j", round(energy_mj[dev.index] / 1000, 3))
        else:
            mj, why = self._call(dev, "nvmlDeviceGetTotalEnergyConsumption")
            r.put("energy_j", round(mj / 1000, 3) if mj is not None else None, why)
        r.put("throttle", *self._throttle(dev))

    def _throttle(self, dev: _Device) -> tuple[dict[str, Any] | None, str | None]:
        """`…ClocksEventReasons` (new name), else `…ClocksThrottleReasons` (old drivers and bindings)."""
        mask, why = None, None
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if getattr(self._lib, fn, None) is None:
                continue
            try:
                mask = getattr(self._lib, fn)(dev.handle)
                break
            except Exception as e:
                kind = self._kind(e)
                if kind == "GpuIsLost":
                    dev.lost = f"{fn}: {self._describe(e)}"
                    raise _Lost from e
                why = f"NVML {fn}: {self._describe(e)}"
                if kind != "FunctionNotFound":
                    break
        if mask is None:
            return None, why or "no clocks-event-reasons call in this NVML binding"
        return throttle_json(int(mask), "nvml"), None
