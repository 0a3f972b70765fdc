"""DRM sysfs: one reading per `/sys/class/drm/card<N>`, listed exactly as the Rust bankml's `sys.rs` lists them.

Only amdgpu exposes `gpu_busy_percent` and `mem_info_{vram,gtt}_{used,total}`, so an i915, nvidia or
ast (BMC) card is still listed, with those values null and the reason given. On an APU the VRAM
numbers are the small carve-out and GTT is the real pool. The card's PCI address (the basename of the
`device` link) is what NVML and amdsmi devices are merged by. hwmon power, power cap and temperature
are read as fallbacks for what the libraries do not give (APUs often read N/A in amdsmi).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpu_monitor.readings import (
    PCI_VENDORS,
    GpuReading,
    Reader,
    normalize_pci,
    os_reason,
    read_int,
    read_text,
)

_CARD = re.compile(r"^card(\d+)$")  # skips connectors (card0-eDP-1) and renderD*

_SYSFS_FILES = {
    "busy_percent": "gpu_busy_percent",
    "vram_used_bytes": "mem_info_vram_used",
    "vram_total_bytes": "mem_info_vram_total",
    "gtt_used_bytes": "mem_info_gtt_used",
    "gtt_total_bytes": "mem_info_gtt_total",
}


def list_cards(sys_root: str | Path = "/sys") -> tuple[list[Path], str | None]:
    """Card directories sorted *as strings* (card0, card1, card10, card2), as the Rust bankml does (its status page keeps that order)."""
    base = Path(sys_root) / "class" / "drm"
    try:
        names = sorted(p.name for p in base.iterdir() if _CARD.match(p.name))
    except OSError as e:
        return [], f"no DRM cards: {os_reason(e, base)}"
    return [base / n for n in names], None


def _link_basename(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path).rstrip("/"))
    except OSError:
        return None


def read_card(card: Path, reader: Reader = read_text) -> GpuReading:
    dev = card / "device"
    driver = _link_basename(dev / "driver") or ""
    r = GpuReading(
        source="sysfs",
        index=int(_CARD.match(card.name).group(1)),
        pci_bus_id=normalize_pci(_link_basename(dev) or ""),
        driver=driver,
    )
    vendor_id, _ = read_int(dev / "vendor", _hex_reader(reader))
    r.vendor = PCI_VENDORS.get(vendor_id) if vendor_id is not None else None
    for key, fname in _SYSFS_FILES.items():
        value, why = read_int(dev / fname, reader)
        if value is not None and (value < 0 or (key == "busy_percent" and value > 100)):
            value, why = None, f"implausible {value} in {dev / fname}"
        if value is None and driver and driver != "amdgpu":
            why = f"{why} (driver {driver} exposes no amdgpu counters)"
        r.put(key, value, why)
    _read_hwmon(r, dev, reader)
    return r


def _read_hwmon(r: GpuReading, dev: Path, reader: Reader) -> None:
    """µW and m°C files of the card's hwmon; only filled where a file answers (fallback values)."""
    try:
        mons = sorted((dev / "hwmon").iterdir())
    except OSError:
        return
    for mon in mons:
        for key, files, scale in (
            ("power_watts", ("power1_average", "power1_input"), 1e-6),
            ("power_limit_watts", ("power1_cap",), 1e-6),
            ("temperature_c", ("temp1_input",), 1e-3),
        ):
            if r.has(key):
                continue
            for f in files:
                value, _ = read_int(mon / f, reader)
                if value is not None and value >= 0:
                    r.put(key, round(value * scale, 3))
                    break


def _hex_reader(reader: Reader) -> Reader:
    """sysfs writes ids as `0x1002`; read_int wants decimal."""

    def read(path: Path) -> str:
        text = reader(path).strip()
        return str(int(text, 16)) if text.lower().startswith("0x") else text

    return read


def read_cards(
    sys_root: str | Path = "/sys", reader: Reader = read_text
) -> tuple[list[GpuReading], str | None]:
    cards, why = list_cards(sys_root)
    return [read_card(c, reader) for c in cards], why
