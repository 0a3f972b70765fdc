"""gpu_monitor with fake `pynvml` and `amdsmi` modules (injected through sys.modules), the merge by PCI
address, the per-answer energy meter and the limiter's fields."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpu_monitor_fakes import (
    FakeAmd,
    FakeClock,
    FakeGpu,
    add_card,
    add_rapl,
    make_amdsmi,
    make_pynvml,
    set_energy,
)

from gpu_monitor import limiter
from gpu_monitor.energy import EnergyMeter
from gpu_monitor.nvml import NvmlBackend
from gpu_monitor.readings import AUTO
from gpu_monitor.sample import Monitor


def monitor(tmp_path: Path, clock: FakeClock, **kw) -> Monitor:
    kw.setdefault("nvml", AUTO)
    kw.setdefault("amdsmi", None)
    kw.setdefault("limiter", lambda: (None, "no engine runs in this process"))
    return Monitor(proc_root=tmp_path / "proc", sys_root=tmp_path / "sys", clock=clock, sleep=clock.sleep,
                   use_psutil=False, affinity_count=lambda: 4, **kw)


def by_card(usage: dict) -> dict[str, dict]:
    return {g["card"]: g for g in usage["gpus"]}


def assert_nulls_explained(usage: dict) -> None:
    for g in usage["gpus"]:
        for key, value in g.items():
            if value is None:
                assert g["unavailable"].get(key), (g["card"], key)


# --- NVML ----------------------------------------------------------------------------------------------


@pytest.fixture
def nvidia_box(tmp_path, monkeypatch):
    """An H200 behind nvidia-drm (card0), a BMC (card1), a GPU without a DRM card, and a lost GPU."""
    s = tmp_path / "sys"
    add_card(s, "card0", driver="nvidia", pci="0000:3b:00.0", vendor="0x10de")
    add_card(s, "card1", driver="ast", pci="0000:02:00.0", vendor="0x1a03")
    gpus = [
        FakeGpu(pci="00000000:3B:00.0"),
        FakeGpu(pci="00000000:86:00.0", name="NVIDIA A100", util="NotSupported", mem="NotSupported",
                energy_mj="NotSupported", throttle_mask=0x1),
        FakeGpu(pci="00000000:C1:00.0", lost=True),
    ]
    nv = make_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    clock = FakeClock()
    clock.advance_s = 0.5

    def window():  # GPU0 draws 100 J during the 0.5 s window: 200 W, not the 250 W averaged reading
        gpus[0].energy_mj += 100_000

    clock.hooks.append(window)
    return tmp_path, clock, gpus, nv


def test_nvml_gpu_merged_into_its_drm_card_by_pci_address(nvidia_box):
    tmp_path, clock, gpus, _ = nvidia_box
    u = monitor(tmp_path, clock).get_usage_sync()
    cards = by_card(u)
    assert list(cards) == ["card0", "card1", "nvml1", "nvml2"]
    h200 = cards["card0"]
    assert (h200["driver"], h200["source"], h200["pci_bus_id"]) == ("nvidia", "sysfs+nvml", "0000:3b:00.0")
    assert (h200["name"], h200["vendor"]) == ("NVIDIA H200", "nvidia")
    assert h200["busy_percent"] == 37 and h200["vram_total_bytes"] == 140 << 30
    assert h200["power_watts"] == 200.0 and h200["power_limit_watts"] == 700.0 and h200["temperature_c"] == 41
    assert h200["energy_j"] == 5100.0
    assert h200["throttle"] == {"mask": 5, "reasons": ["gpu_idle", "sw_power_cap"], "throttled": True,
                                "source": "nvml"}
    assert h200["gtt_used_bytes"] is None and "nvidia" in h200["unavailable"]["gtt_used_bytes"]
    assert cards["card1"]["source"] == "sysfs" and cards["card1"]["busy_percent"] is None  # the BMC stays
    assert_nulls_explained(u)


def test_gpu_without_drm_card_notsupported_fields_and_lost_gpu(nvidia_box):
    tmp_path, clock, gpus, _ = nvidia_box
    cards = by_card(monitor(tmp_path, clock).get_usage_sync())
    a100 = cards["nvml1"]
    assert (a100["driver"], a100["source"], a100["pci_bus_id"]) == ("nvidia", "nvml", "0000:86:00.0")
    assert a100["busy_percent"] is None and "Not Supported" in a100["unavailable"]["busy_percent"]
    assert a100["vram_used_bytes"] is None and "Not Supported" in a100["unavailable"]["vram_used_bytes"]
    assert a100["power_watts"] == 250.0  # no energy counter: the averaged reading
    assert a100["energy_j"] is None and a100["throttle"]["throttled"] is False
    lost = cards["nvml2"]
    assert all(lost[k] is None for k in ("busy_percent", "vram_used_bytes", "power_watts", "throttle"))
    assert "GPU is lost" in lost["unavailable"]["busy_percent"]
    assert lost["pci_bus_id"] == "0000:c1:00.0"  # its slot is kept


def test_an_energy_counter_that_did_not_tick_in_the_window_falls_back_to_averaged_power(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", make_pynvml([FakeGpu(power_mw=123_456)]))
    u = monitor(tmp_path, FakeClock()).get_usage_sync()  # the counter stays at 5 000 000 mJ
    assert u["gpus"][0]["power_watts"] == 123.46


def test_a_gpu_lost_after_start_keeps_its_card(nvidia_box):
    tmp_path, clock, gpus, _ = nvidia_box
    m = monitor(tmp_path, clock)
    assert by_card(m.get_usage_sync())["card0"]["busy_percent"] == 37
    gpus[0].lost = True
    clock.t += 2
    h200 = by_card(m.get_usage_sync())["card0"]
    assert h200["busy_percent"] is None and "GPU is lost" in h200["unavailable"]["busy_percent"]


def test_a_gpu_lost_mid_read_is_dropped_not_half_reported(monkeypatch):
    gpu = FakeGpu(lose_at="mem")
    backend = NvmlBackend(make_pynvml([gpu]))
    r = backend.readings()[0]
    assert r.values["busy_percent"] is None and "GPU is lost" in r.unavailable["busy_percent"]
    assert gpu.calls == ["util", "mem"]  # no call after the loss
    backend.readings()
    assert gpu.calls == ["util", "mem"]  # the handle is dropped


def test_a_binding_whose_shapes_changed_is_a_reason_not_a_failed_sample(tmp_path, monkeypatch):
    nv = make_pynvml([FakeGpu(), FakeGpu(pci="00000000:86:00.0")])
    nv.nvmlDeviceGetUtilizationRates = lambda h: {"gpu": 1} if h.pci.endswith("3B:00.0") else SimpleNamespace(gpu=9)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    amd = FakeAmd(power={"current_socket_power": {"value": 3}, "power_limit": 1})
    monkeypatch.setitem(sys.modules, "amdsmi", make_amdsmi([amd]))
    u = monitor(tmp_path, FakeClock(), amdsmi=AUTO).get_usage_sync()
    cards = by_card(u)
    assert cards["nvml0"]["busy_percent"] is None and "binding error" in cards["nvml0"]["unavailable"]["busy_percent"]
    assert cards["nvml1"]["busy_percent"] == 9
    assert cards["amdsmi0"]["power_watts"] is None and "binding error" in cards["amdsmi0"]["unavailable"]["power_watts"]
    assert cards["amdsmi0"]["vram_total_bytes"] == 192 << 30  # read before the failure, kept
    assert_nulls_explained(u)


def test_throttle_falls_back_to_the_old_name(tmp_path, monkeypatch):
    gpu = FakeGpu(throttle_mask=0x40)
    monkeypatch.setitem(sys.modules, "pynvml", make_pynvml([gpu], event_reasons=False))
    r = NvmlBackend(AUTO).readings()[0]
    assert r.values["throttle"]["reasons"] == ["hw_thermal"]

    nv = make_pynvml([gpu])

    def not_in_driver(h):
        raise nv.NVMLError_FunctionNotFound()

    nv.nvmlDeviceGetCurrentClocksEventReasons = not_in_driver  # new binding, old driver
    assert NvmlBackend(nv).readings()[0].values["throttle"]["mask"] == 0x40


def test_nvml_init_failure_is_a_reason_and_retried_once_a_minute(tmp_path, monkeypatch):
    nv = make_pynvml([FakeGpu()], init_error="LibraryNotFound")
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    clock = FakeClock()
    m = monitor(tmp_path, clock)
    u = m.get_usage_sync()
    assert u["gpus"] == [] and "Library Not Found" in u["unavailable"]["gpus.nvml"]
    clock.t += 30
    m.get_usage_sync()
    assert nv.init_calls == 1
    clock.t += 31
    m.get_usage_sync()
    assert nv.init_calls == 2


def test_nvml_shut_down_on_close(nvidia_box):
    tmp_path, clock, _, nv = nvidia_box
    m = monitor(tmp_path, clock)
    m.get_usage_sync()
    m.close()
    assert nv.shutdown_calls == 1


# --- amdsmi --------------------------------------------------------------------------------------------


def test_amdsmi_fills_what_sysfs_lacks_and_sysfs_stays_primary(tmp_path, monkeypatch):
    s = tmp_path / "sys"
    add_card(s, "card0", driver="amdgpu", pci="0000:03:00.0", vendor="0x1002",
             files={"gpu_busy_percent": "42\n", "mem_info_vram_used": "1000\n", "mem_info_vram_total": "2000\n"})
    devices = [
        FakeAmd(),  # old energy key, N/A busy, µW power limit
        FakeAmd(bdf="0000:83:00.0", activity=0xFFFF, gtt="unsupported", temp="N/A",
                power={"socket_power": 300, "power_limit": 550},
                energy={"energy_accumulator": 2_000_000, "counter_resolution": 15.3}, throttle=0xFFFFFFFFFFFFFFFF),
    ]
    monkeypatch.setitem(sys.modules, "amdsmi", make_amdsmi(devices))
    u = monitor(tmp_path, FakeClock(), nvml=None, amdsmi=AUTO).get_usage_sync()
    cards = by_card(u)
    assert list(cards) == ["card0", "amdsmi1"]
    mi = cards["card0"]
    assert mi["source"] == "sysfs+amdsmi" and mi["name"] == "AMD Instinct MI300X"
    assert mi["busy_percent"] == 42 and mi["vram_total_bytes"] == 2000  # sysfs, not amdsmi's 192 GiB
    assert mi["gtt_total_bytes"] == 64 << 30  # sysfs has no GTT file here: amdsmi fills it
    assert mi["power_watts"] == 180.0 and mi["power_limit_watts"] == 750.0 and mi["temperature_c"] == 55.0
    assert mi["energy_j"] == pytest.approx(15.3)
    assert mi["throttle"]["reasons"] == ["temperature"]
    other = cards["amdsmi1"]
    assert (other["driver"], other["source"]) == ("amdgpu", "amdsmi")
    assert other["busy_percent"] is None and "UINT max" in other["unavailable"]["busy_percent"]
    assert other["gtt_used_bytes"] is None and "not supported (code 2)" in other["unavailable"]["gtt_used_bytes"]
    assert other["temperature_c"] is None and "N/A" in other["unavailable"]["temperature_c"]
    assert other["power_watts"] == 300.0 and other["power_limit_watts"] == 550.0
    assert other["energy_j"] == pytest.approx(30.6) and other["throttle"] is None
    assert_nulls_explained(u)


def test_amdsmi_import_that_raises_is_a_reason(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_site"
    pkg.mkdir()
    (pkg / "amdsmi.py").write_text("raise KeyError('ROCM_PATH')  # what a mismatched ROCm does\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    u = monitor(tmp_path, FakeClock(), nvml=None, amdsmi=AUTO).get_usage_sync()
    assert u["gpus"] == [] and "KeyError" in u["unavailable"]["gpus.amdsmi"]


def test_amdsmi_init_failure_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", make_amdsmi([FakeAmd()], init_error=True))
    u = monitor(tmp_path, FakeClock(), nvml=None, amdsmi=AUTO).get_usage_sync()
    assert u["gpus"] == [] and "amdsmi_init failed" in u["unavailable"]["gpus.amdsmi"]


# --- energy per answer ---------------------------------------------------------------------------------


def test_cpu_answer_energy_from_rapl_across_a_wrap(tmp_path):
    zone = add_rapl(tmp_path / "sys", "intel-rapl:0", "package-0", 9_000_000, 9_999_999)
    m = monitor(tmp_path, FakeClock(), nvml=None)
    meter = m.energy_meter("cpu")
    mark = meter.start()
    set_energy(zone, 1_500_000)  # +2.5 J through the wrap
    r = meter.stop(mark)
    assert r.energy_j == pytest.approx(2.5) and r.package_energy_j == pytest.approx(2.5)
    assert r.gpu_energy_j is None and "NVML" in r.unavailable["gpu_energy_j"]
    assert r.joules_per_token(50) == pytest.approx(0.05) and r.joules_per_token(0) is None
    assert r.overlapped is False


def test_gpu_answer_energy_from_the_nvml_counter(tmp_path, monkeypatch):
    gpus = [FakeGpu(energy_mj=5_000_000), FakeGpu(pci="00000000:86:00.0", energy_mj=7_000_000)]
    monkeypatch.setitem(sys.modules, "pynvml", make_pynvml(gpus))
    meter = monitor(tmp_path, FakeClock()).energy_meter("gpu", gpu_indices=[0])
    mark = meter.start()
    gpus[0].energy_mj += 12_345
    gpus[1].energy_mj += 99_999  # not the engine's GPU
    r = meter.stop(mark)
    assert r.energy_j == pytest.approx(12.345) and r.gpu_energy_j == pytest.approx(12.345)
    assert r.package_energy_j is None and "RAPL" in r.unavailable["package_energy_j"]


def test_unmeasured_energy_is_null_never_estimated(tmp_path, monkeypatch):
    gpus = [FakeGpu(energy_mj="NotSupported")]  # power is readable, energy is not: no Σ P·dt guess
    monkeypatch.setitem(sys.modules, "pynvml", make_pynvml(gpus))
    meter = monitor(tmp_path, FakeClock()).energy_meter("gpu")
    r = meter.stop(meter.start())
    assert r.energy_j is None and r.joules_per_token(10) is None
    assert "Volta" in r.unavailable["gpu_energy_j"] and r.unavailable["energy_j"]

    gpus[0].energy_mj = 9_000
    mark = meter.start()
    gpus[0].energy_mj = 10  # the driver reloaded: the counter restarted
    assert meter.stop(mark).energy_j is None


def test_overlapping_answers_are_flagged(tmp_path):
    add_rapl(tmp_path / "sys", "intel-rapl:0", "package-0", 1_000, 9_999_999)
    meter = EnergyMeter(monitor(tmp_path, FakeClock(), nvml=None).rapl)
    a = meter.start()
    b = meter.start()
    assert meter.stop(a).overlapped and meter.stop(b).overlapped
    c = meter.start()
    assert meter.stop(c).overlapped is False
    d = meter.start()
    meter.cancel(d)  # an answer that errored records nothing and taints no one
    assert meter.stop(meter.start()).overlapped is False


# --- the limiter ---------------------------------------------------------------------------------------


def test_limiter_from_memory_stats_and_in_usage(tmp_path):
    stats = {"bytes_in_use": 3 << 30, "peak_bytes_in_use": 4 << 30, "bytes_limit": 100 << 30}
    status = limiter.LimiterStatus.from_memory_stats(stats, memory_fraction=0.75, sequences_max=4,
                                                     sequences_in_use=1, device="cuda:0", heap_bytes=140 << 30)
    limiter.register(lambda: status)
    try:
        u = monitor(tmp_path, FakeClock(), nvml=None, limiter=limiter.current_json).get_usage_sync()
    finally:
        limiter.unregister()
    g = u["gpu_limiter"]
    assert list(g) == ["limit", "allocated_bytes", "heap_bytes", "limit_bytes", "peak_bytes", "sequences_max",
                       "sequences_in_use", "device", "source", "unavailable"]
    assert (g["limit"], g["allocated_bytes"], g["limit_bytes"], g["peak_bytes"]) == (0.75, 3 << 30, 100 << 30, 4 << 30)
    assert (g["sequences_max"], g["sequences_in_use"], g["unavailable"]) == (4, 1, {})
    assert "gpu_limiter" not in u["unavailable"]
    assert limiter.current_json() == (None, limiter.NO_ENGINE)


def test_limiter_on_cpu_and_a_failing_provider(tmp_path):
    cpu = limiter.LimiterStatus.from_memory_stats(None, memory_fraction=0.75, sequences_max=1,
                                                  sequences_in_use=0, device="cpu:0").to_json()
    assert cpu["allocated_bytes"] is None and "memory_stats" in cpu["unavailable"]["allocated_bytes"]
    assert cpu["heap_bytes"] is None and cpu["unavailable"]["heap_bytes"]

    def broken():
        raise RuntimeError("engine thread died")

    limiter.register(broken)
    try:
        u = monitor(tmp_path, FakeClock(), nvml=None, limiter=limiter.current_json).get_usage_sync()
    finally:
        limiter.unregister()
    assert u["gpu_limiter"] is None and "engine thread died" in u["unavailable"]["gpu_limiter"]
