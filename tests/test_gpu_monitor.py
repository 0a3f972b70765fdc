"""gpu_monitor on fake /proc and /sys trees: memory, processes, RAPL, DRM cards, the usage snapshot and
its cache. The NVML/amdsmi fakes, the energy meter and the limiter are in test_gpu_monitor_libs.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gpu_monitor_fakes import MEMINFO, FakeClock, add_card, add_rapl, set_energy, write, write_proc

from gpu_monitor.drm import read_cards
from gpu_monitor.procfs import ProcFS
from gpu_monitor.rapl import EnergyAccumulator, discover_zones, wrap_delta_uj
from gpu_monitor.readings import normalize_pci
from gpu_monitor.sample import Monitor

ORIGINAL_KEYS = [
    "source", "cores", "mem_total_bytes", "mem_available_bytes", "swap_total_bytes", "swap_free_bytes",
    "rss_bytes", "cpu_percent", "interval_ms", "processes", "package_watts", "gpus", "gpu_limiter",
]  # fmt: skip
ORIGINAL_GPU_KEYS = ["card", "driver", "busy_percent", "vram_used_bytes", "vram_total_bytes",
                     "gtt_used_bytes", "gtt_total_bytes"]  # fmt: skip


def deny(*paths_ending: str):
    """A reader that raises PermissionError for some files: CI runs as root, which ignores chmod."""

    def read(path: Path) -> str:
        if any(str(path).endswith(p) for p in paths_ending):
            raise PermissionError(13, "Permission denied", str(path))
        return path.read_text()

    return read


def offline_monitor(tmp_path: Path, clock: FakeClock | None = None, **kw) -> Monitor:
    """A Monitor that sees only the fake trees (no host psutil, no host NVML or amdsmi)."""
    clock = clock or FakeClock()
    kw.setdefault("nvml", None)
    kw.setdefault("amdsmi", None)
    kw.setdefault("limiter", lambda: (None, "no engine runs in this process"))
    return Monitor(proc_root=tmp_path / "proc", sys_root=tmp_path / "sys", clock=clock, sleep=clock.sleep,
                   wall=lambda: 1_700_000_000.0, use_psutil=False, affinity_count=lambda: 8, **kw)


# --- /proc ---------------------------------------------------------------------------------------------


def test_meminfo_in_bytes_and_zero_with_reason_when_missing(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "meminfo", "MemTotal:  1000 kB\nMemAvailable:  500 kB\nSwapTotal: 0 kB\n")
    mem = ProcFS(proc, tmp_path / "sys", use_psutil=False).memory()
    assert (mem.mem_total_bytes, mem.mem_available_bytes, mem.swap_total_bytes) == (1_024_000, 512_000, 0)
    assert mem.swap_free_bytes == 0 and "swap_free_bytes" in mem.unavailable
    assert "mem_total_bytes" not in mem.unavailable

    gone = ProcFS(tmp_path / "nowhere", tmp_path / "sys", use_psutil=False).memory()
    assert gone.mem_total_bytes == 0 and "ENOENT" in gone.unavailable["mem_total_bytes"]


def test_stat_fields_counted_after_the_last_paren_and_zombie_rss(tmp_path):
    proc = tmp_path / "proc"
    write_proc(proc, 77, "a (b) c", utime=200, stime=100, rss_kb=None)  # a zombie: no VmRSS
    fs = ProcFS(proc, tmp_path / "sys", use_psutil=False)
    seconds, why = fs.cpu_seconds(77)
    assert why is None and seconds == pytest.approx(300 / fs.clk_tck)
    rss, why = fs.rss_bytes(77)
    assert rss is None and "VmRSS" in why
    assert fs.exists(77) and not fs.exists(78) and not fs.exists(0)


def test_cores_capped_by_the_cgroup_quota_up_the_tree(tmp_path):
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    write(proc / "self" / "cgroup", "0::/kubepods/pod1/ctr\n")
    write(sys_root / "fs" / "cgroup" / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    write(sys_root / "fs" / "cgroup" / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")  # 2.5 CPUs
    assert ProcFS(proc, sys_root, affinity_count=lambda: 16).cores() == 3
    assert ProcFS(proc, tmp_path / "nosys", affinity_count=lambda: 16).cores() == 16
    assert ProcFS(proc, tmp_path / "nosys", affinity_count=lambda: None).cores() == (os.cpu_count() or 1)


# --- RAPL ----------------------------------------------------------------------------------------------


def test_wrap_delta():
    assert wrap_delta_uj(1_000_000, 3_500_000, 10_000_000) == 2_500_000  # 2.5 J
    assert wrap_delta_uj(9_500_000, 500_000, 10_000_000) == 1_000_001  # one wrap: range+1 values
    assert wrap_delta_uj(9_500_000, 500_000, None) is None  # a wrap cannot be told from a reset


def test_zones_package_only_no_subzones_no_psys_no_mmio_duplicate(tmp_path):
    s = tmp_path / "sys"
    add_rapl(s, "intel-rapl:0", "package-0", 1_000, 262_143_328_850)
    add_rapl(s, "intel-rapl:0:0", "core", 500, 262_143_328_850)
    add_rapl(s, "intel-rapl:0:1", "dram", 400, 262_143_328_850)
    add_rapl(s, "intel-rapl:1", "psys", 9_000, 262_143_328_850)
    add_rapl(s, "intel-rapl:2", "package-1", 2_000, 262_143_328_850)
    add_rapl(s, "intel-rapl-mmio:0", "package-0", 1_000, 262_143_328_850)
    zones, why = discover_zones(s)
    assert why is None
    assert [(z.path.name, z.name) for z in zones] == [("intel-rapl:0", "package-0"), ("intel-rapl:2", "package-1")]


def test_mirrored_die_counters_counted_once_distinct_dies_kept(tmp_path):
    s = tmp_path / "sys"
    add_rapl(s, "intel-rapl:0", "package-0-die-0", 5_000, 65_532_610_987)
    add_rapl(s, "intel-rapl:1", "package-0-die-1", 5_000, 65_532_610_987)  # the same package counter
    add_rapl(s, "intel-rapl:2", "package-1-die-0", 7_000, 65_532_610_987)
    add_rapl(s, "intel-rapl:3", "package-1-die-1", 90_000, 65_532_610_987)  # a real second die
    names = [z.name for z in discover_zones(s)[0]]
    assert names == ["package-0-die-0", "package-1-die-0", "package-1-die-1"]


def test_accumulator_sums_packages_and_survives_two_wraps(tmp_path):
    s = tmp_path / "sys"
    z0 = add_rapl(s, "intel-rapl:0", "package-0", 9_000_000, 9_999_999)  # range+1 = 10 M µJ
    z1 = add_rapl(s, "intel-rapl:1", "package-1", 100, 9_999_999)
    acc = EnergyAccumulator(s)
    assert acc.total_j() == (0.0, None)
    set_energy(z0, 2_000_000)  # wrapped: +3 J
    set_energy(z1, 1_100)
    assert acc.total_j()[0] == pytest.approx(3.001)
    set_energy(z0, 1_000_000)  # wrapped again: +9 J
    assert acc.total_j()[0] == pytest.approx(12.001)


def test_unreadable_energy_is_null_with_the_fix_named(tmp_path):
    s = tmp_path / "sys"
    add_rapl(s, "intel-rapl:0", "package-0", 1_000, 262_143_328_850)
    total, why = EnergyAccumulator(s, reader=deny("energy_uj")).total_j()
    assert total is None and "EACCES" in why and "udev" in why


def test_missing_range_is_null(tmp_path):
    s = tmp_path / "sys"
    add_rapl(s, "intel-rapl:0", "package-0", 1_000, None)
    total, why = EnergyAccumulator(s).total_j()
    assert total is None and "max_energy_range_uj" in why


# --- DRM -----------------------------------------------------------------------------------------------


def _cards(s: Path) -> None:
    add_card(s, "card0", driver="amdgpu", pci="0000:03:00.0", vendor="0x1002",
             files={"gpu_busy_percent": "42\n", "mem_info_vram_used": "1073741824\n",
                    "mem_info_vram_total": "17163091968\n", "mem_info_gtt_used": "garbage\n",
                    "mem_info_gtt_total": ""},
             hwmon={"power1_average": "35000000\n", "power1_cap": "150000000\n", "temp1_input": "48000\n"})
    add_card(s, "card1", driver="i915", pci="0000:00:02.0", vendor="0x8086")
    add_card(s, "card10", driver="ast", pci="0000:05:00.0", vendor="0x1a03")
    add_card(s, "card2", driver=None)
    (s / "class" / "drm" / "card0-eDP-1").mkdir()
    (s / "class" / "drm" / "renderD128").mkdir()


def test_cards_sorted_as_strings_amdgpu_values_others_null_with_reasons(tmp_path):
    s = tmp_path / "sys"
    _cards(s)
    cards, why = read_cards(s)
    assert why is None
    assert [f"card{c.index}" for c in cards] == ["card0", "card1", "card10", "card2"]
    amd, intel, ast, bare = cards
    assert (amd.driver, amd.pci_bus_id, amd.vendor) == ("amdgpu", "0000:03:00.0", "amd")
    assert amd.values["busy_percent"] == 42 and amd.values["vram_total_bytes"] == 17163091968
    assert amd.values["gtt_used_bytes"] is None and "garbage" in amd.unavailable["gtt_used_bytes"]
    assert amd.values["gtt_total_bytes"] is None and "gtt_total_bytes" in amd.unavailable
    assert (amd.values["power_watts"], amd.values["power_limit_watts"], amd.values["temperature_c"]) == (35.0, 150.0, 48.0)
    assert intel.driver == "i915" and all(intel.values[k] is None for k in ORIGINAL_GPU_KEYS[2:])
    assert "i915" in intel.unavailable["busy_percent"]
    assert ast.vendor == "aspeed"
    assert bare.driver == "" and bare.pci_bus_id is None


def test_pci_addresses_normalised():
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci(b"0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_pci("3b:00.0") == "0000:3b:00.0"
    assert normalize_pci("card0") is None and normalize_pci("0000:3b:00.9") is None


# --- the snapshot --------------------------------------------------------------------------------------


def _machine(tmp_path: Path, clock: FakeClock) -> dict:
    """Two processes whose CPU times and one RAPL package that move while the fake clock sleeps."""
    proc, s = tmp_path / "proc", tmp_path / "sys"
    write(proc / "meminfo", MEMINFO)
    write_proc(proc, 100, "bankml serve", utime=1000, stime=0, rss_kb=2048)
    write_proc(proc, 200, "llama-server", utime=0, stime=0, rss_kb=4096)
    zone = add_rapl(s, "intel-rapl:0", "package-0", 9_900_000, 9_999_999)
    _cards(s)

    def during_window():  # in the window: +50 ticks and +25 ticks, +5 J through a wrap
        write_proc(proc, 100, "bankml serve", utime=1050, stime=0, rss_kb=2048)
        write_proc(proc, 200, "llama-server", utime=20, stime=5, rss_kb=4096)
        set_energy(zone, 4_900_000)

    clock.hooks.append(during_window)
    return {"proc": proc, "sys": s, "zone": zone}


def test_usage_keys_in_order_values_from_the_fake_machine(tmp_path):
    clock = FakeClock()
    clock.advance_s = 0.5  # the window really took 0.5 s: rates use it, interval_ms stays 250
    _machine(tmp_path, clock)
    m = offline_monitor(tmp_path, clock, processes=[("bankml serve", 100), ("gone", 999), ("llama-server", 200),
                                                    ("none", 0)])
    u = m.get_usage_sync()
    assert list(u)[: len(ORIGINAL_KEYS)] == ORIGINAL_KEYS
    assert list(u)[len(ORIGINAL_KEYS):] == ["sampled_at", "package_energy_j", "unavailable"]
    assert u["interval_ms"] == 250 and clock.sleeps == [0.25]
    tck = m.procfs.clk_tck
    assert [p["name"] for p in u["processes"]] == ["bankml serve", "llama-server"]
    assert u["processes"][0]["cpu_percent"] == pytest.approx(round(50 / tck / 0.5 * 100, 1))
    assert u["processes"][1]["cpu_percent"] == pytest.approx(round(25 / tck / 0.5 * 100, 1))
    assert u["cpu_percent"] == pytest.approx(round(75 / tck / 0.5 * 100, 1))
    assert u["rss_bytes"] == (2048 + 4096) * 1024
    assert (u["mem_total_bytes"], u["swap_free_bytes"]) == (16384000 * 1024, 1024000 * 1024)
    assert u["package_watts"] == pytest.approx(5.0 / 0.5)  # 9.9 M -> 4.9 M µJ across a 10 M wrap
    assert u["cores"] == 8 and u["gpu_limiter"] is None
    assert u["unavailable"]["gpu_limiter"] == "no engine runs in this process"
    assert [g["card"] for g in u["gpus"]] == ["card0", "card1", "card10", "card2"]
    assert list(u["gpus"][0])[: len(ORIGINAL_GPU_KEYS)] == ORIGINAL_GPU_KEYS
    assert u["gpus"][0]["busy_percent"] == 42 and u["gpus"][0]["power_watts"] == 35.0
    json.dumps(u, allow_nan=False)


def test_every_null_has_a_reason(tmp_path):
    clock = FakeClock()
    _machine(tmp_path, clock)
    u = offline_monitor(tmp_path, clock, reader=deny("energy_uj"), processes=[("bankml serve", 100)]).get_usage_sync()
    assert u["package_watts"] is None and "EACCES" in u["unavailable"]["package_watts"]
    for key, value in u.items():
        if value is None:
            assert key in u["unavailable"], key
    for g in u["gpus"]:
        for key, value in g.items():
            if value is None:
                assert g["unavailable"].get(key), (g["card"], key)


def test_nothing_there_still_answers_every_key(tmp_path):
    u = offline_monitor(tmp_path).get_usage_sync()  # no /proc, no /sys at all
    assert list(u)[: len(ORIGINAL_KEYS)] == ORIGINAL_KEYS
    assert (u["mem_total_bytes"], u["processes"], u["gpus"], u["package_watts"]) == (0, [], [], None)
    assert {"package_watts", "gpus.sysfs", "mem_total_bytes"} <= set(u["unavailable"])


# --- cache and single flight ---------------------------------------------------------------------------


def test_cached_for_one_second_from_the_start_of_the_sample(tmp_path):
    clock = FakeClock()
    clock.advance_s = 0.25
    m = offline_monitor(tmp_path, clock)
    m.get_usage_sync()  # sample starts at 1000.0
    clock.t += 0.7
    m.get_usage_sync()
    assert m.samples_taken == 1
    clock.t = 1000.0 + 1.01
    m.get_usage_sync()
    assert m.samples_taken == 2


def test_callers_get_copies(tmp_path):
    m = offline_monitor(tmp_path)
    m.get_usage_sync()["gpus"].append("scribble")
    assert m.get_usage_sync()["gpus"] == []


def _slow_monitor(tmp_path: Path, gate: threading.Event) -> Monitor:
    clock = FakeClock()
    clock.hooks.append(lambda: gate.wait(5))  # the window lasts until the test opens the gate
    return offline_monitor(tmp_path, clock)


def test_ten_concurrent_async_pollers_cause_one_sample(tmp_path):
    gate = threading.Event()
    m = _slow_monitor(tmp_path, gate)

    async def main():
        tasks = [asyncio.create_task(m.get_usage()) for _ in range(10)]
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert m.samples_taken == 1 and not any(t.done() for t in tasks)  # all waiting on the one sample
        gate.set()
        return await asyncio.gather(*tasks)

    bodies = asyncio.run(main())
    assert m.samples_taken == 1 and len(bodies) == 10
    assert all(b == bodies[0] for b in bodies)
    m.close()


def test_ten_concurrent_threads_cause_one_sample(tmp_path):
    gate = threading.Event()
    m = _slow_monitor(tmp_path, gate)
    start = threading.Barrier(10)
    bodies = []

    def poll():
        start.wait()
        bodies.append(m.get_usage_sync())

    threads = [threading.Thread(target=poll) for _ in range(10)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)
    assert m.samples_taken == 1 and len(bodies) == 10


def test_a_cancelled_poller_does_not_cancel_the_shared_sample(tmp_path):
    gate = threading.Event()
    m = _slow_monitor(tmp_path, gate)

    async def main():
        a = asyncio.create_task(m.get_usage())
        b = asyncio.create_task(m.get_usage())
        await asyncio.sleep(0.02)
        a.cancel()
        await asyncio.sleep(0.02)
        gate.set()
        return await b

    assert asyncio.run(main())["source"]
    assert m.samples_taken == 1
    m.close()


def test_a_failing_sample_releases_its_waiters(tmp_path, monkeypatch):
    m = offline_monitor(tmp_path)
    monkeypatch.setattr(m, "sample", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        m.get_usage_sync()
    monkeypatch.undo()
    assert m.get_usage_sync()["source"]  # not stuck behind the failed flight


# --- the real machine ----------------------------------------------------------------------------------


def test_live_busy_child_shows_cpu_and_rss(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        m = Monitor(nvml=None, amdsmi=None, window_s=0.5,
                    processes=[("bankml serve", os.getpid()), ("busy", busy.pid), ("idle", idle.pid)])
        u = m.get_usage_sync()
        by = {p["name"]: p for p in u["processes"]}
        # This machine is shared and loaded: assert that the busy child ran, not how much.
        assert by["busy"]["cpu_percent"] > 0 and by["idle"]["cpu_percent"] == 0.0
        assert by["bankml serve"]["rss_bytes"] > 10 << 20 and u["mem_total_bytes"] > 0
        assert u["cores"] >= 1
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


def test_import_is_light_and_jax_free():
    code = ("import sys, gpu_monitor; gpu_monitor.Monitor; gpu_monitor.EnergyMeter; gpu_monitor.LimiterStatus; "
            "print(sorted(m for m in ('jax', 'pynvml', 'amdsmi', 'psutil', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"
    src = Path(__file__).resolve().parents[1] / "gpu_monitor"
    for f in src.glob("*.py"):
        assert "import jax" not in f.read_text() and "from jax" not in f.read_text(), f
