"""Settings applied before JAX starts its backends: XLA:CPU's code generation, and quiet platform probes.

`--xla_cpu_prefer_vector_width=512`: on a CPU with AVX-512, XLA otherwise emits 256-bit loops. The
decode step is mostly loops that widen packed weight codes to f32 (model/packed.py); 512-bit ones
take 7-12% off a SmolLM2 decode step on this 2-core Xeon (A/B, 4 alternating runs, medians
25.7/27.4 ms -> 23.8/24.1 ms). An operator's own setting of the flag wins.

JAX probes every platform it knows when it starts (jax/_src/xla_bridge.py) and logs each one that is
absent ("Unable to initialize backend 'tpu': ... libtpu.so: cannot open shared object file") at INFO,
which `bankml serve`'s INFO log would print on every start. `quiet_platform_probes` drops exactly
those records: a non-GPU backend whose library is missing. A GPU backend that fails (it explains a
fall-back to the CPU) and any backend that is there and fails still log their reason, and no
platform is forced (JAX still picks a GPU when it finds one).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

WIDE_FLAG = "--xla_cpu_prefer_vector_width"


def has_avx512(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    return any(line.startswith("flags") and "avx512f" in line.split() for line in cpuinfo.splitlines())


def prefer_wide_vectors(environ: MutableMapping[str, str] = os.environ, cpuinfo: str | None = None) -> bool:
    """Add the 512-bit preference to XLA_FLAGS on AVX-512 CPUs; returns whether it was added."""
    flags = environ.get("XLA_FLAGS", "")
    if WIDE_FLAG in flags or not has_avx512(cpuinfo):
        return False
    environ["XLA_FLAGS"] = f"{flags} {WIDE_FLAG}=512".strip()
    return True


# the reasons JAX gives for a platform that is simply not on this machine
_ABSENT = ("cannot open shared object file", "No such file or directory", "not found")
# a GPU platform that fails explains why the engine fell back to the CPU: always kept
_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


class _AbsentPlatformFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or not str(record.msg).startswith("Unable to initialize backend"):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if args and str(args[0]) in _GPU_PLATFORMS:
            return True
        message = record.getMessage()
        return not any(reason in message for reason in _ABSENT)


def quiet_platform_probes() -> None:
    """Drop JAX's INFO lines about platforms this machine does not have (idempotent)."""
    logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _AbsentPlatformFilter) for f in logger.filters):
        logger.addFilter(_AbsentPlatformFilter())
