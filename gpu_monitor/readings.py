"""Shared shapes for the samplers: one GPU's reading from one backend, and failures turned into reasons.

Every backend answers with values and, for each value it could not get, a reason; nothing here raises
for an unreadable file. `sample.py` merges the readings and renders them with the Rust bankml's keys.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class _Auto:
    """Sentinel for "find the library yourself" (`Monitor(nvml=AUTO)`), distinct from None (= off)."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _Auto()

Reader = Callable[[Path], str]

# The per-GPU keys a backend may fill, in the order they are rendered (the Rust bankml's keys, then ours).
GPU_VALUE_KEYS = (
    "busy_percent",
    "vram_used_bytes",
    "vram_total_bytes",
    "gtt_used_bytes",
    "gtt_total_bytes",
    "power_watts",
    "power_limit_watts",
    "temperature_c",
    "energy_j",
    "throttle",
)


def read_text(path: Path) -> str:
    return path.read_text()


def os_reason(exc: BaseException, path: Path | str) -> str:
    """`ENOENT on /sys/…/gpu_busy_percent`: the errno name says more than the message in a dashboard."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, str(exc.errno))} on {path}"
    return f"{type(exc).__name__} on {path}: {exc}"


def read_int(path: Path, reader: Reader = read_text) -> tuple[int | None, str | None]:
    """An integer file (sysfs style). Missing, unreadable, empty or garbage -> (None, reason)."""
    try:
        text = reader(path)
    except (OSError, ValueError) as e:  # ValueError: undecodable bytes
        return None, os_reason(e, path)
    try:
        return int(text.strip()), None
    except ValueError:
        return None, f"not an integer in {path}: {text.strip()[:40]!r}"


def finite(x: float | int | None) -> float | int | None:
    """NaN and infinities become None: the JSON is written with allow_nan=False."""
    if x is None:
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def rounded(x: float | None, digits: int) -> float | None:
    x = finite(x)
    return None if x is None else round(float(x), digits)


@dataclass
class GpuReading:
    """What one backend (sysfs, NVML or amdsmi) saw of one GPU.

    `values` holds only the keys this backend tried; a key set to None has its reason in `unavailable`.
    `pci_bus_id` is normalised to sysfs's form (`0000:3b:00.0`) so readings merge by it.
    """

    source: str  # "sysfs" | "nvml" | "amdsmi"
    index: int  # the card number for sysfs, the library's device index otherwise
    pci_bus_id: str | None = None
    vendor: str | None = None
    name: str | None = None
    driver: str | None = None
    values: dict[str, object] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def put(self, key: str, value: object, reason: str | None = None) -> None:
        value = finite(value) if isinstance(value, float) else value
        self.values[key] = value
        if value is None:
            self.unavailable[key] = reason or "not measured"
        else:
            self.unavailable.pop(key, None)

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None


def normalize_pci(bus_id: str | bytes | None) -> str | None:
    """`00000000:3B:00.0` (NVML) or `0000:3b:00.0` (sysfs) -> `0000:3b:00.0`; anything else -> None."""
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    s = bus_id.strip().lower()
    parts = s.split(":")
    if len(parts) == 2:  # no domain: "3b:00.0"
        parts = ["0000", *parts]
    if len(parts) != 3 or "." not in parts[2]:
        return None
    domain, bus, devfn = parts
    dev, _, fn = devfn.partition(".")
    try:
        d, b, v, f = int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        return None
    if d > 0xFFFF or b > 0xFF or v > 0x1F or f > 7:
        return None
    return f"{d:04x}:{b:02x}:{v:02x}.{f}"


# PCI vendor ids seen on GPUs and BMCs: the `vendor` field of a sysfs card.
PCI_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel", 0x1A03: "aspeed", 0x102B: "matrox"}
