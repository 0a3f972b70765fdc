"""Fakes for the gpu_monitor tests: /proc and /sys trees under tmp_path, a clock, pynvml and amdsmi.

The library fakes are module objects with their own exception trees, injected through `sys.modules`
by the tests, so the code under test imports them exactly as it imports the real ones.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from pathlib import Path


class FakeClock:
    """`clock()` returns the fake time; `sleep(s)` advances it by `advance_s` (default: s) and runs hooks
    (which move counters as the real machine would during the window)."""

    def __init__(self, t: float = 1000.0):
        self.t = t
        self.advance_s: float | None = None
        self.hooks: list = []
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += self.advance_s if self.advance_s is not None else s
        for hook in self.hooks:
            hook()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- /proc ---------------------------------------------------------------------------------------------

MEMINFO = """MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:    8192000 kB
SwapTotal:       2048000 kB
SwapFree:        1024000 kB
"""


def stat_line(pid: int, comm: str, utime: int, stime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime …
    return f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194304 100 0 0 0 {utime} {stime} 0 0 20 0 1 0 100 0 0\n"


def write_proc(proc: Path, pid: int, comm: str, utime: int, stime: int, rss_kb: int | None) -> None:
    write(proc / str(pid) / "stat", stat_line(pid, comm, utime, stime))
    status = f"Name:\t{comm}\nState:\tS (sleeping)\n"
    if rss_kb is not None:
        status += f"VmRSS:\t{rss_kb} kB\n"
    write(proc / str(pid) / "status", status)


# --- /sys ----------------------------------------------------------------------------------------------


def add_card(
    sys_root: Path,
    name: str,
    *,
    driver: str | None,
    pci: str | None = None,
    vendor: str | None = None,
    files: dict[str, str] | None = None,
    hwmon: dict[str, str] | None = None,
) -> Path:
    """`/sys/class/drm/<name>` -> a device dir named by its PCI address, with a `driver` link."""
    devdir = sys_root / "devices" / "pci0000:00" / (pci or f"platform-{name}")
    devdir.mkdir(parents=True, exist_ok=True)
    if driver:
        drv = sys_root / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        if not (devdir / "driver").exists():
            os.symlink(drv, devdir / "driver")
    if vendor:
        write(devdir / "vendor", vendor + "\n")
    for fname, text in (files or {}).items():
        write(devdir / fname, text)
    for fname, text in (hwmon or {}).items():
        write(devdir / "hwmon" / "hwmon3" / fname, text)
    card = sys_root / "class" / "drm" / name
    card.mkdir(parents=True, exist_ok=True)
    os.symlink(devdir, card / "device")
    return card


def add_rapl(sys_root: Path, zone: str, name: str, energy_uj: int | None, max_range_uj: int | None) -> Path:
    d = sys_root / "class" / "powercap" / zone
    write(d / "name", name + "\n")
    if energy_uj is not None:
        write(d / "energy_uj", f"{energy_uj}\n")
    if max_range_uj is not None:
        write(d / "max_energy_range_uj", f"{max_range_uj}\n")
    return d


def set_energy(zone_dir: Path, energy_uj: int) -> None:
    write(zone_dir / "energy_uj", f"{energy_uj}\n")


# --- pynvml --------------------------------------------------------------------------------------------


@dataclass
class FakeGpu:
    pci: str = "00000000:3B:00.0"
    name: str = "NVIDIA H200"
    util: int | str = 37  # "NotSupported" -> raises
    mem_used: int = 10 << 30
    mem_total: int = 140 << 30
    mem: str = "ok"  # "NotSupported" -> raises
    power_mw: int = 250_000
    limit_mw: int = 700_000
    temp_c: int = 41
    energy_mj: int | str = 5_000_000  # "NotSupported" -> raises
    throttle_mask: int = 0x4 | 0x1
    lost: bool = False
    lose_at: str | None = None  # the call at which the GPU falls off the bus
    calls: list[str] = field(default_factory=list)


def make_pynvml(gpus: list[FakeGpu], *, init_error: str | None = None, event_reasons: bool = True):
    """A pynvml-shaped module. `init_error`: an NVMLError_<name> that nvmlInit raises.
    `event_reasons=False`: only the old `…ClocksThrottleReasons` name exists (older bindings)."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int, msg: str):
            super().__init__(msg)
            self.value = value

    m.NVMLError = NVMLError
    for cls_name, code, msg in (
        ("NotSupported", 3, "Not Supported"),
        ("NoPermission", 4, "Insufficient Permissions"),
        ("DriverNotLoaded", 9, "Driver Not Loaded"),
        ("LibraryNotFound", 12, "NVML Shared Library Not Found"),
        ("FunctionNotFound", 13, "Function Not Found"),
        ("GpuIsLost", 15, "GPU is lost"),
    ):
        cls = type(f"NVMLError_{cls_name}", (NVMLError,), {})
        cls.__init__ = (lambda c, m_: lambda self: NVMLError.__init__(self, c, m_))(code, msg)
        setattr(m, f"NVMLError_{cls_name}", cls)
    m.NVML_TEMPERATURE_GPU = 0
    m.init_calls = 0
    m.shutdown_calls = 0

    def init():
        m.init_calls += 1
        if init_error:
            raise getattr(m, f"NVMLError_{init_error}")()

    def shutdown():
        m.shutdown_calls += 1

    def guard(g: FakeGpu, what: str):
        g.calls.append(what)
        if what == g.lose_at:
            g.lost = True
        if g.lost:
            raise m.NVMLError_GpuIsLost()

    def util(h):
        guard(h, "util")
        if h.util == "NotSupported":
            raise m.NVMLError_NotSupported()
        return types.SimpleNamespace(gpu=h.util, memory=5)

    def mem(h):
        guard(h, "mem")
        if h.mem == "NotSupported":
            raise m.NVMLError_NotSupported()
        return types.SimpleNamespace(used=h.mem_used, total=h.mem_total, free=h.mem_total - h.mem_used)

    def energy(h):
        guard(h, "energy")
        if h.energy_mj == "NotSupported":
            raise m.NVMLError_NotSupported()
        return h.energy_mj

    def throttle(h):
        guard(h, "throttle")
        return h.throttle_mask

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h.pci.encode())  # bytes, as old bindings
    m.nvmlDeviceGetName = lambda h: h.name
    m.nvmlDeviceGetUtilizationRates = util
    m.nvmlDeviceGetMemoryInfo = mem
    m.nvmlDeviceGetPowerUsage = lambda h: (guard(h, "power"), h.power_mw)[1]
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: (guard(h, "limit"), h.limit_mw)[1]
    m.nvmlDeviceGetTemperature = lambda h, sensor: (guard(h, "temp"), h.temp_c)[1]
    m.nvmlDeviceGetTotalEnergyConsumption = energy
    m.nvmlDeviceGetCurrentClocksThrottleReasons = throttle
    if event_reasons:
        m.nvmlDeviceGetCurrentClocksEventReasons = throttle
    return m


# --- amdsmi --------------------------------------------------------------------------------------------


@dataclass
class FakeAmd:
    bdf: str = "0000:03:00.0"
    market_name: str = "AMD Instinct MI300X"
    activity: object = "N/A"
    vram: tuple = (1 << 30, 192 << 30)
    gtt: tuple | str = (256 << 20, 64 << 30)  # "unsupported" -> error code 2
    power: dict = field(default_factory=lambda: {"current_socket_power": "N/A", "average_socket_power": 180,
                                                 "power_limit": 750_000_000})  # µW, as some versions report
    temp: object = 55
    energy: dict = field(default_factory=lambda: {"power": 1_000_000, "counter_resolution": 15.3})
    throttle: int = 1 << 33


def make_amdsmi(devices: list[FakeAmd], *, init_error: bool = False):
    m = types.ModuleType("amdsmi")

    class AmdSmiException(Exception):
        pass

    class AmdSmiLibraryException(AmdSmiException):
        def __init__(self, code: int):
            super().__init__(f"amdsmi error {code}")
            self.err_code = code

        def get_error_code(self):
            return self.err_code

    m.AmdSmiException, m.AmdSmiLibraryException = AmdSmiException, AmdSmiLibraryException
    m.AmdSmiInitFlags = types.SimpleNamespace(INIT_AMD_GPUS=2)
    m.AmdSmiMemoryType = types.SimpleNamespace(VRAM=0, VIS_VRAM=1, GTT=2)
    m.AmdSmiTemperatureType = types.SimpleNamespace(EDGE=0, HOTSPOT=1)
    m.AmdSmiTemperatureMetric = types.SimpleNamespace(CURRENT=0)
    m.shutdown_calls = 0

    def init(flags=None):
        if init_error:
            raise AmdSmiLibraryException(8)

    def memory(h, kind, which):
        pool = h.vram if kind == 0 else h.gtt
        if pool == "unsupported":
            raise AmdSmiLibraryException(2)
        return pool[which]

    def shut():
        m.shutdown_calls += 1

    m.amdsmi_init = init
    m.amdsmi_shut_down = shut
    m.amdsmi_get_processor_handles = lambda: list(devices)
    m.amdsmi_get_gpu_device_bdf = lambda h: h.bdf
    m.amdsmi_get_gpu_asic_info = lambda h: {"market_name": h.market_name}
    m.amdsmi_get_gpu_activity = lambda h: {"gfx_activity": h.activity, "umc_activity": "N/A"}
    m.amdsmi_get_gpu_memory_usage = lambda h, kind: memory(h, kind, 0)
    m.amdsmi_get_gpu_memory_total = lambda h, kind: memory(h, kind, 1)
    m.amdsmi_get_power_info = lambda h: dict(h.power)
    m.amdsmi_get_temp_metric = lambda h, t, metric: h.temp
    m.amdsmi_get_energy_count = lambda h: dict(h.energy)
    m.amdsmi_get_gpu_metrics_info = lambda h: {"indep_throttle_status": h.throttle}
    return m
