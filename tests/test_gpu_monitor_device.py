"""gpu_monitor against a real NVIDIA GPU (marker `gpu`; skipped unless nvmlInit succeeds)."""

from __future__ import annotations

import time

import pytest

from gpu_monitor.nvml import NvmlBackend
from gpu_monitor.sample import Monitor

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def monitor():
    probe = NvmlBackend()
    if not probe.readings():
        pytest.skip(f"no NVML GPU: {probe.reason}")
    probe.close()
    m = Monitor(amdsmi=None)
    yield m
    m.close()


def test_real_gpu_fields_are_plausible(monitor):
    u = monitor.get_usage_sync()
    nv = [g for g in u["gpus"] if "nvml" in g["source"]]
    assert nv, u["gpus"]
    for g in nv:
        assert 0 <= g["busy_percent"] <= 100
        assert 0 < g["vram_used_bytes"] <= g["vram_total_bytes"]
        assert g["power_watts"] > 0 and g["power_limit_watts"] > 0
        assert isinstance(g["throttle"]["mask"], int)
        assert g["pci_bus_id"] and g["name"]
    # A DRM card driven by nvidia must be the same device NVML lists (matched by PCI address).
    for g in u["gpus"]:
        if g["driver"] == "nvidia" and g["card"].startswith("card"):
            assert "nvml" in g["source"], g


def test_real_energy_counter_rises(monitor):
    meter = monitor.energy_meter("gpu")
    mark = meter.start()
    time.sleep(1.0)  # an idle H200 still draws tens of watts
    r = meter.stop(mark)
    assert r.energy_j is not None and r.energy_j > 0, r.unavailable
