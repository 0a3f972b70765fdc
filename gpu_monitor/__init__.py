"""What the machine is doing, with units in every name: /proc, RAPL, DRM sysfs, NVML and amdsmi.

Behind `GET /bankml/usage` (`Monitor.get_usage()`) and the energy of `/bankml/metrics`
(`Monitor.energy_meter()`). Every value that cannot be read is null (memory: 0, as the Rust bankml) with
its reason in an `unavailable` map; nothing here raises for a missing device or file. Importing this
package is cheap: pynvml, amdsmi and psutil are imported on first use, jax never.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_monitor.energy import EnergyMark, EnergyMeter, EnergyReading
    from gpu_monitor.limiter import LimiterStatus
    from gpu_monitor.readings import AUTO
    from gpu_monitor.sample import Monitor

__all__ = ["AUTO", "EnergyMark", "EnergyMeter", "EnergyReading", "LimiterStatus", "Monitor"]

_WHERE = {
    "AUTO": "gpu_monitor.readings",
    "EnergyMark": "gpu_monitor.energy",
    "EnergyMeter": "gpu_monitor.energy",
    "EnergyReading": "gpu_monitor.energy",
    "LimiterStatus": "gpu_monitor.limiter",
    "Monitor": "gpu_monitor.sample",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'gpu_monitor' has no attribute {name!r}")
