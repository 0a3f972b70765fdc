"""RAPL package energy from powercap sysfs: the zones to sum, wrap-safe deltas, a monotonic joule total.

Which zones: the top-level `intel-rapl:N` (and `intel-rapl-mmio:N`) whose `name` is `package-*`.
Summing every zone double-counts (codecarbon shipped these bugs): sub-zones `intel-rapl:0:0`
(core, uncore, dram) are inside their package, `psys` covers the platform, an MMIO zone mirrors the MSR
zone of the same name, and some multi-die AMD parts list per-die zones that all read the one package
counter. AMD Zen exposes the same zones (package only).

Counters wrap at `max_energy_range_uj` (AMD ≈65.5 kJ: about every 11 min at 100 W; Intel ≈262 kJ:
about 44 min), so `EnergyAccumulator` reads every zone at each mark and at least every `poll_every_s`
and adds `(b - a) mod (range + 1)`. Without the range a wrap cannot be told from a reset: null, never
the Rust bankml's u64::MAX guess. `energy_uj` has been root-only since Linux 5.10 (CVE-2020-8694).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from gpu_monitor.readings import Reader, os_reason, read_int, read_text

_TOP_ZONE = re.compile(r"^intel-rapl(-mmio)?:(\d+)$")
_PACKAGE = re.compile(r"^package-(\d+)(?:-die-(\d+))?$")

PERMISSION_HINT = (
    "RAPL energy is root-only since Linux 5.10; to measure as a user, make energy_uj readable with a "
    'udev rule (SUBSYSTEM=="powercap", RUN+="/bin/chmod o+r /sys%p/energy_uj")'
)


@dataclass(frozen=True)
class RaplZone:
    path: Path  # …/class/powercap/intel-rapl:0
    name: str  # package-0
    max_energy_range_uj: int | None

    @property
    def energy_path(self) -> Path:
        return self.path / "energy_uj"


def wrap_delta_uj(before_uj: int, after_uj: int, max_energy_range_uj: int | None) -> int | None:
    """Energy between two reads of one counter, one wrap allowed; None when a wrap cannot be handled."""
    if max_energy_range_uj is None or max_energy_range_uj <= 0:
        return None
    return (after_uj - before_uj) % (max_energy_range_uj + 1)


def read_energy_uj(zone: RaplZone, reader: Reader = read_text) -> tuple[int | None, str | None]:
    try:
        text = reader(zone.energy_path)
    except PermissionError as e:
        return None, f"{os_reason(e, zone.energy_path)}: {PERMISSION_HINT}"
    except (OSError, ValueError) as e:
        return None, os_reason(e, zone.energy_path)
    try:
        return int(text.strip()), None
    except ValueError:
        return None, f"not an integer in {zone.energy_path}: {text.strip()[:40]!r}"


def discover_zones(
    sys_root: str | Path = "/sys", reader: Reader = read_text
) -> tuple[list[RaplZone], str | None]:
    """The package zones whose sum is the CPU packages' energy, and why there are none (if so)."""
    base = Path(sys_root) / "class" / "powercap"
    try:
        entries = [p for p in base.iterdir() if _TOP_ZONE.match(p.name)]
    except OSError as e:
        return [], f"no RAPL: {os_reason(e, base)}"
    msr: list[RaplZone] = []
    mmio: list[RaplZone] = []
    for p in sorted(
        entries, key=lambda p: (p.name.startswith("intel-rapl-mmio"), int(p.name.rsplit(":", 1)[1]))
    ):
        try:
            name = reader(p / "name").strip()
        except (OSError, ValueError):
            continue
        if not _PACKAGE.match(name):
            continue  # psys, dram at top level on some servers, …: not CPU package energy
        rng, _ = read_int(p / "max_energy_range_uj", reader)
        (mmio if p.name.startswith("intel-rapl-mmio") else msr).append(RaplZone(p, name, rng))
    names = {z.name for z in msr}
    zones = msr + [z for z in mmio if z.name not in names]  # an MMIO zone mirrors the MSR one
    zones = _drop_mirrored_dies(zones, reader)
    if not zones:
        return [], f"no RAPL package zone under {base}"
    return zones, None


def _drop_mirrored_dies(zones: list[RaplZone], reader: Reader) -> list[RaplZone]:
    """Per-die zones of one package that read the same counter: keep the first. A die zone counts as a
    mirror when its value lies between two reads of the first die's (a distinct counter would not land
    in a window of a few µJ), which also holds when the counter ticks between the reads."""
    kept: list[RaplZone] = []
    first_die: dict[str, RaplZone] = {}
    for z in zones:
        m = _PACKAGE.match(z.name)
        if m is None or m.group(2) is None:
            kept.append(z)
            continue
        pkg = m.group(1)
        if pkg not in first_die:
            first_die[pkg] = z
            kept.append(z)
            continue
        a1, _ = read_energy_uj(first_die[pkg], reader)
        b, _ = read_energy_uj(z, reader)
        a2, _ = read_energy_uj(first_die[pkg], reader)
        if None not in (a1, b, a2) and a1 <= b <= a2:
            continue
        kept.append(z)
    return kept


class EnergyAccumulator:
    """Joules used by the CPU packages since this accumulator first read them, summed over zones.

    Thread-safe. `total_j()` is what `package_watts` and the per-answer energy meter read; a keepalive
    thread (`start()`) reads every `poll_every_s` so that a long answer survives several wraps.
    """

    def __init__(
        self,
        sys_root: str | Path = "/sys",
        *,
        reader: Reader = read_text,
        poll_every_s: float = 10.0,
        zones: list[RaplZone] | None = None,
    ) -> None:
        self._sys_root = sys_root
        self._read = reader
        self.poll_every_s = poll_every_s
        self._zones = zones
        self._why_none: str | None = None
        self._last_uj: dict[Path, int] = {}
        self._total_uj: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def zones(self) -> list[RaplZone]:
        with self._lock:
            return list(self._ensure_zones())

    def _ensure_zones(self) -> list[RaplZone]:
        if self._zones is None:
            self._zones, self._why_none = discover_zones(self._sys_root, self._read)
        return self._zones

    def total_j(self) -> tuple[float | None, str | None]:
        """(joules since the first read, None) or (None, reason). Any zone failing makes the whole
        total null: a partial sum would be silently wrong."""
        with self._lock:
            zones = self._ensure_zones()
            if not zones:
                return None, self._why_none
            why: list[str] = []
            for z in zones:
                if z.max_energy_range_uj is None:
                    why.append(f"no max_energy_range_uj for {z.path}: a wrap cannot be detected")
                    continue
                raw, err = read_energy_uj(z, self._read)
                if raw is None:
                    why.append(err or "unreadable")
                    continue
                last = self._last_uj.get(z.path)
                if last is not None:
                    self._total_uj[z.path] = self._total_uj.get(z.path, 0) + wrap_delta_uj(
                        last, raw, z.max_energy_range_uj
                    )
                else:
                    self._total_uj.setdefault(z.path, 0)
                self._last_uj[z.path] = raw
            if why:
                return None, "; ".join(why)
            return sum(self._total_uj[z.path] for z in zones) / 1e6, None

    def start(self) -> None:
        """A daemon thread that keeps the total current; idempotent."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self.poll_every_s):
                self.total_j()

        self._thread = threading.Thread(target=loop, name="bankml-rapl", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
