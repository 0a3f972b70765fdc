"""Cores, memory, swap and a process's RSS and CPU time, from /proc (psutil where /proc is not there).

Mirrors bankML `sys.rs`: memory fields that cannot be read are 0, not null (as `sys.rs` writes them, kept for the
original's clients), but the reason still lands in `unavailable`. psutil is only a fallback for the
real /proc (a fake root in tests must never leak the host's numbers), and it is imported lazily.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpu_monitor.readings import Reader, os_reason, read_text

_MEMINFO_KEYS = {
    "MemTotal": "mem_total_bytes",
    "MemAvailable": "mem_available_bytes",
    "SwapTotal": "swap_total_bytes",
    "SwapFree": "swap_free_bytes",
}


@dataclass(frozen=True)
class MemoryReading:
    mem_total_bytes: int = 0
    mem_available_bytes: int = 0
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    unavailable: dict[str, str] = field(default_factory=dict)


def _affinity_count() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return None


class ProcFS:
    """Reads under `proc_root` and `sys_root` (both injectable, so tests build fake trees in tmp_path)."""

    def __init__(
        self,
        proc_root: str | Path = "/proc",
        sys_root: str | Path = "/sys",
        *,
        reader: Reader = read_text,
        use_psutil: bool | None = None,
        affinity_count: Callable[[], int | None] = _affinity_count,
    ) -> None:
        self.proc_root = Path(proc_root)
        self.sys_root = Path(sys_root)
        self._read = reader
        self._use_psutil = (str(proc_root) == "/proc") if use_psutil is None else use_psutil
        self._affinity_count = affinity_count
        try:
            self.clk_tck = os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):
            self.clk_tck = 100

    # --- cores ---------------------------------------------------------------------------------------

    def cores(self) -> int:
        """CPUs this process may use: affinity, capped by the cgroup CPU quota (as Rust's
        `available_parallelism`, which the Rust bankml calls); `os.cpu_count()`, then 1, when unknown."""
        n = self._affinity_count() or os.cpu_count() or 1
        quota = self.cgroup_cpu_quota()
        if quota is not None:
            n = min(n, max(1, math.ceil(quota)))
        return max(1, n)

    def cgroup_cpu_quota(self) -> float | None:
        """The tightest CPU quota (in CPUs) on this process's cgroup path, v2 or v1; None if unlimited."""
        cg = self.sys_root / "fs" / "cgroup"
        rel = "/"
        try:
            for line in self._read(self.proc_root / "self" / "cgroup").splitlines():
                hier, _, rest = line.partition(":")
                controllers, _, path = rest.partition(":")
                if hier == "0" and controllers == "":
                    rel = path or "/"
        except (OSError, ValueError):
            pass
        best: float | None = None
        # v2: walk from our cgroup up to the root; a parent's limit binds its children too.
        d = cg / rel.strip("/") if rel.strip("/") else cg
        while True:
            q = self._cpu_max(d / "cpu.max")
            if q is not None:
                best = q if best is None else min(best, q)
            if d == cg or cg not in d.parents:
                break
            d = d.parent
        # v1: only the mount root is looked at (inside a container that is the container's group).
        for ctl in ("cpu", "cpu,cpuacct"):
            q = self._cfs_quota(cg / ctl)
            if q is not None:
                best = q if best is None else min(best, q)
        return best

    def _cpu_max(self, path: Path) -> float | None:
        try:
            fields = self._read(path).split()
        except (OSError, ValueError):
            return None
        if len(fields) != 2 or fields[0] == "max":
            return None
        try:
            quota, period = int(fields[0]), int(fields[1])
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None

    def _cfs_quota(self, d: Path) -> float | None:
        try:
            quota = int(self._read(d / "cpu.cfs_quota_us").strip())
            period = int(self._read(d / "cpu.cfs_period_us").strip())
        except (OSError, ValueError):
            return None
        return quota / period if quota > 0 and period > 0 else None

    # --- memory --------------------------------------------------------------------------------------

    def memory(self) -> MemoryReading:
        path = self.proc_root / "meminfo"
        found: dict[str, int] = {}
        unavailable: dict[str, str] = {}
        try:
            text = self._read(path)
        except (OSError, ValueError) as e:
            text = None
            why = os_reason(e, path)
        if text is not None:
            for line in text.splitlines():
                key, _, rest = line.partition(":")
                if key in _MEMINFO_KEYS:
                    parts = rest.split()
                    try:
                        found[_MEMINFO_KEYS[key]] = int(parts[0]) * 1024  # kB, as the kernel prints it
                    except (IndexError, ValueError):
                        pass
            why = f"missing from {path}"
        missing = [k for k in _MEMINFO_KEYS.values() if k not in found]
        if missing and self._use_psutil:
            found.update({k: v for k, v in _psutil_memory().items() if k in missing})
            missing = [k for k in missing if k not in found]
        for k in missing:
            unavailable[k] = f"{why} (reads 0, as the Rust bankml)"
        return MemoryReading(**{k: found.get(k, 0) for k in _MEMINFO_KEYS.values()}, unavailable=unavailable)

    # --- processes -----------------------------------------------------------------------------------

    def exists(self, pid: int) -> bool:
        if pid <= 0:
            return False
        if (self.proc_root / str(pid)).is_dir():
            return True
        if self._use_psutil and not (self.proc_root / "self").exists():
            ps = _psutil()
            return bool(ps and ps.pid_exists(pid))
        return False

    def cpu_seconds(self, pid: int) -> tuple[float | None, str | None]:
        """utime+stime of `pid` in seconds. The fields are counted after the *last* `)`, because the
        command name in parentheses may itself hold spaces and parentheses."""
        path = self.proc_root / str(pid) / "stat"
        try:
            text = self._read(path)
            rest = text[text.rindex(")") + 1 :].split()
            ticks = int(rest[11]) + int(rest[12])
            return ticks / self.clk_tck, None
        except (OSError, ValueError, IndexError) as e:
            why = os_reason(e, path) if isinstance(e, OSError) else f"unparsable {path}"
        if self._use_psutil:
            ps = _psutil()
            if ps is not None:
                try:
                    t = ps.Process(pid).cpu_times()
                    return t.user + t.system, None
                except Exception as e:  # NoSuchProcess, AccessDenied, …: a reason, not a crash
                    why = f"{why}; psutil: {type(e).__name__}"
        return None, why

    def rss_bytes(self, pid: int) -> tuple[int | None, str | None]:
        """VmRSS of `pid`. A zombie keeps /proc/<pid> but has no VmRSS: (None, reason), rendered 0."""
        path = self.proc_root / str(pid) / "status"
        try:
            for line in self._read(path).splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, None
            why = f"no VmRSS in {path}"
        except (OSError, ValueError, IndexError) as e:
            why = os_reason(e, path) if isinstance(e, OSError) else f"unparsable {path}"
            if self._use_psutil:
                ps = _psutil()
                if ps is not None:
                    try:
                        return int(ps.Process(pid).memory_info().rss), None
                    except Exception as e2:
                        why = f"{why}; psutil: {type(e2).__name__}"
        return None, why


def _psutil():
    try:
        import psutil  # lazy: optional, and a fake /proc must not need it
    except ImportError:
        return None
    return psutil


def _psutil_memory() -> dict[str, int]:
    ps = _psutil()
    if ps is None:
        return {}
    try:
        vm, sm = ps.virtual_memory(), ps.swap_memory()
    except Exception:
        return {}
    return {
        "mem_total_bytes": int(vm.total),
        "mem_available_bytes": int(vm.available),
        "swap_total_bytes": int(sm.total),
        "swap_free_bytes": int(sm.free),
    }
