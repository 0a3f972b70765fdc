"""What the NVML and amdsmi backends share: a vendor library imported lazily (and guarded: amdsmi
raises at import without a matching ROCm), initialised at most once per `retry_s` until it works, and
shut down at exit. A failure is a reason, never an exception.
"""

from __future__ import annotations

import atexit
import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_monitor.readings import AUTO


class VendorLibrary:
    """Base of a backend over one vendor library. `module`: AUTO (import it), None (off) or a module-like object."""

    import_name = ""  # the module to import for AUTO
    off_reason = ""  # the reason when the backend is switched off
    init_call = ""  # how init failures are named: "<init_call> failed: …"

    def __init__(self, module: Any = AUTO, *, clock: Callable[[], float] = time.monotonic, retry_s: float = 60.0):
        self._module_arg = module
        self._lib: Any = None
        self._clock = clock
        self.retry_s = retry_s
        self.reason: str | None = None  # why there are no GPUs from this library (init failed, off, …)
        self._next_try_at: float | None = None
        self._devices: list | None = None
        self._lock = threading.Lock()
        self._atexit = False

    # --- what a backend says about its library ---

    def _start(self, lib: Any) -> Any:
        """Initialise the library; raise if it cannot. The result goes to `_enumerate`."""
        raise NotImplementedError

    def _enumerate(self, lib: Any, started: Any) -> list:
        raise NotImplementedError

    def _shutdown(self, lib: Any) -> None:
        raise NotImplementedError

    def _describe(self, e: BaseException) -> str:
        return f"{type(e).__name__}: {e}"

    # --- shared ---

    def _module(self) -> Any:
        if self._module_arg is None:
            self.reason = self.off_reason
            return None
        if self._module_arg is AUTO:
            try:
                return importlib.import_module(self.import_name)
            except Exception as e:  # ImportError, a broken install, or amdsmi without ROCm
                self.reason = f"{self.import_name} cannot be imported: {type(e).__name__}: {e}"
                return None
        return self._module_arg

    def _ensure(self) -> list:
        if self._devices is not None:
            return self._devices
        now = self._clock()
        if self._next_try_at is not None and now < self._next_try_at:
            return []
        self._next_try_at = now + self.retry_s
        lib = self._module()
        if lib is None:
            return []
        self._lib = lib
        try:
            started = self._start(lib)
        except Exception as e:
            self.reason = f"{self.init_call} failed: {self._describe(e)} (retried every {self.retry_s:g} s)"
            return []
        devices = self._enumerate(lib, started)
        self._devices = devices
        self.reason = None
        if not self._atexit:
            atexit.register(self.close)
            self._atexit = True
        return devices

    def close(self) -> None:
        with self._lock:
            if self._devices is not None and self._lib is not None:
                try:
                    self._shutdown(self._lib)
                except Exception:  # at exit, nothing to report to
                    pass
            self._devices = None
