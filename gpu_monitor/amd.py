"""AMD GPUs through amdsmi (ROCm's Python binding), as a fallback and for the additive fields.

`import amdsmi` raises (not only ImportError) when no matching ROCm library is installed, so the import
is guarded by `except Exception` and the reason kept. sysfs stays primary for busy/VRAM/GTT: APUs
(gfx1103, gfx1151) often read "N/A" here while sysfs works. Keys, units and support drift between amdsmi
versions: a value that reads "N/A", holds a UINT-max sentinel or raises
AmdSmiLibraryException (code 2 = not supported) is null with the reason; power keys are probed in
order and the unit of `power_limit` (W, or µW in some versions) is decided by plausibility.
"""

from __future__ import annotations

from typing import Any

from gpu_monitor.readings import GPU_VALUE_KEYS, GpuReading, normalize_pci
from gpu_monitor.vendor_lib import VendorLibrary

_SENTINELS = {0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF}
_NOT_SUPPORTED = 2  # AMDSMI_STATUS_NOT_SUPPORTED

# indep_throttle_status bit groups, per the kernel's amdgpu_smu.h (SMU_THROTTLER_*_BIT). Unverified on
# hardware here: the mask is reported raw beside the group names, so a client can decode it itself.
_THROTTLE_GROUPS = ((0, 16, "power"), (16, 32, "current"), (32, 48, "temperature"), (48, 64, "other"))


def throttle_json(mask: int) -> dict[str, Any]:
    reasons = [name for lo, hi, name in _THROTTLE_GROUPS if mask & (((1 << (hi - lo)) - 1) << lo)]
    return {"mask": int(mask), "reasons": reasons, "throttled": mask != 0, "source": "amdsmi"}


def _watts(v: Any) -> float | None:
    """W as amdsmi documents it, µW where a version reports that (any value above 100 kW)."""
    if v is None:
        return None
    v = float(v)
    if v > 100_000:
        v /= 1e6
    return round(v, 2) if 0 <= v <= 5000 else None


class AmdsmiBackend(VendorLibrary):
    """All AMD GPUs amdsmi sees. `module`: AUTO (import amdsmi), None (off) or a module-like object."""

    import_name = "amdsmi"
    off_reason = "amdsmi is switched off"
    init_call = "amdsmi_init"

    def _start(self, smi: Any) -> list:
        flags = getattr(getattr(smi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
        smi.amdsmi_init(flags) if flags is not None else smi.amdsmi_init()
        return list(smi.amdsmi_get_processor_handles())

    def _enumerate(self, smi: Any, handles: list) -> list[tuple[int, Any, str | None, str | None]]:
        devices = []  # index, handle, pci, name
        for i, h in enumerate(handles):
            bdf, _ = self._call("amdsmi_get_gpu_device_bdf", h)
            info, _ = self._call("amdsmi_get_gpu_asic_info", h)
            name = info.get("market_name") if isinstance(info, dict) else None
            devices.append(
                (
                    i,
                    h,
                    normalize_pci(bdf) if isinstance(bdf, str | bytes) else None,
                    name if isinstance(name, str) and name not in ("", "N/A") else None,
                )
            )
        return devices

    def _shutdown(self, smi: Any) -> None:
        smi.amdsmi_shut_down()

    def _describe(self, e: BaseException) -> str:
        code = _error_code(e)
        if code == _NOT_SUPPORTED:
            return f"not supported (code {code})"
        return f"{type(e).__name__}: {e}" + (f" (code {code})" if code is not None else "")

    def _call(self, fn: str, *args: Any) -> tuple[Any, str | None]:
        f = getattr(self._lib, fn, None)
        if f is None:
            return None, f"{fn} is not in this amdsmi"
        try:
            return f(*args), None
        except Exception as e:
            return None, f"amdsmi {fn}: {self._describe(e)}"

    def readings(self) -> list[GpuReading]:
        with self._lock:
            out = []
            for i, h, pci, name in self._ensure():
                r = GpuReading(
                    source="amdsmi", index=i, pci_bus_id=pci, vendor="amd", name=name, driver="amdgpu"
                )
                try:
                    self._read(r, h)
                except (
                    Exception
                ) as e:  # amdsmi's shapes drift between versions: a reason, not a failed sample
                    for key in GPU_VALUE_KEYS:
                        if key not in r.values:
                            r.put(key, None, f"amdsmi binding error: {type(e).__name__}: {e}")
                out.append(r)
            return out

    def _read(self, r: GpuReading, h: Any) -> None:
        smi = self._lib
        act, why = self._call("amdsmi_get_gpu_activity", h)
        r.put("busy_percent", *_field(act, "gfx_activity", why, hi=100))
        mtype = getattr(smi, "AmdSmiMemoryType", None)
        for pool in ("VRAM", "GTT"):
            kind = getattr(mtype, pool, None)
            if kind is None:
                for k in ("used", "total"):
                    r.put(f"{pool.lower()}_{k}_bytes", None, f"AmdSmiMemoryType.{pool} is not in this amdsmi")
                continue
            for k, fn in (("used", "amdsmi_get_gpu_memory_usage"), ("total", "amdsmi_get_gpu_memory_total")):
                v, why = self._call(fn, h, kind)
                r.put(f"{pool.lower()}_{k}_bytes", *_clean(v, why))
        power, why = self._call("amdsmi_get_power_info", h)
        watts, pwhy = None, why
        if isinstance(power, dict):
            for key in ("current_socket_power", "average_socket_power", "socket_power"):
                v, pwhy = _clean(power.get(key), f"no usable {key} in amdsmi_get_power_info")
                watts = _watts(v)
                if watts is not None:
                    break
            limit, lwhy = _clean(power.get("power_limit"), "no power_limit in amdsmi_get_power_info")
            r.put("power_limit_watts", _watts(limit), lwhy or "implausible power_limit")
        else:
            r.put("power_limit_watts", None, why)
        r.put("power_watts", watts, pwhy or "no plausible socket power in amdsmi_get_power_info")
        r.put("temperature_c", *self._temperature(h))
        energy, why = self._call("amdsmi_get_energy_count", h)
        r.put("energy_j", *_energy_j(energy, why))
        metrics, why = self._call("amdsmi_get_gpu_metrics_info", h)
        mask, why = _field(metrics, "indep_throttle_status", why)
        r.put("throttle", throttle_json(int(mask)) if mask is not None else None, why)

    def _temperature(self, h: Any) -> tuple[float | None, str | None]:
        """Edge, else hotspot (MI300 has no edge sensor)."""
        smi = self._lib
        ttype, metric = (
            getattr(smi, "AmdSmiTemperatureType", None),
            getattr(smi, "AmdSmiTemperatureMetric", None),
        )
        current = getattr(metric, "CURRENT", None)
        why = "AmdSmiTemperatureType/Metric are not in this amdsmi"
        for sensor in ("EDGE", "HOTSPOT"):
            kind = getattr(ttype, sensor, None)
            if kind is None or current is None:
                continue
            v, why = self._call("amdsmi_get_temp_metric", h, kind, current)
            v, why = _clean(v, why)
            if v is not None:
                v = float(v) / 1000 if v > 1000 else float(v)  # m°C in some versions
                return round(v, 1), None
        return None, why


def _error_code(e: BaseException) -> int | None:
    for attr in ("get_error_code", "err_code"):
        v = getattr(e, attr, None)
        try:
            v = v() if callable(v) else v
        except Exception:
            v = None
        if isinstance(v, int):
            return v
    return None


def _clean(v: Any, why: str | None) -> tuple[Any, str | None]:
    """'N/A', None and UINT-max sentinels -> (None, reason)."""
    if v is None:
        return None, why or "not reported"
    if isinstance(v, str):
        if v.strip().upper() in ("N/A", "NA", ""):
            return None, "amdsmi reads N/A"
        try:
            v = float(v) if "." in v else int(v)
        except ValueError:
            return None, f"amdsmi gave {v[:40]!r}"
    if isinstance(v, int) and v in _SENTINELS:
        return None, "amdsmi reads UINT max (not supported)"
    return v, None


def _field(d: Any, key: str, why: str | None, hi: float | None = None) -> tuple[Any, str | None]:
    if not isinstance(d, dict):
        return None, why or "not reported"
    v, w = _clean(d.get(key), f"no {key} in amdsmi's answer")
    if v is not None and (v < 0 or (hi is not None and v > hi)):
        return None, f"implausible {key} {v}"
    return v, w


def _energy_j(d: Any, why: str | None) -> tuple[float | None, str | None]:
    """`energy_accumulator` (new) or `power` (old) × `counter_resolution` µJ. Frozen or wrong on some
    parts and VMs, so it is shown, never used for an answer's energy (energy.py reads NVML and RAPL)."""
    if not isinstance(d, dict):
        return None, why or "not reported"
    acc, w = _clean(d.get("energy_accumulator", d.get("power")), "no energy_accumulator in amdsmi's answer")
    res, w2 = _clean(d.get("counter_resolution"), "no counter_resolution in amdsmi's answer")
    if acc is None or res is None:
        return None, w or w2
    return round(float(acc) * float(res) / 1e6, 3), None
