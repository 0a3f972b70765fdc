"""Progress lines for the long steps of start-up (fetch, hash, load, compile), on a terminal only.

A step is one line on stderr, rewritten in place as it advances ("bankml: compiling 12/27 programs"),
at most every `interval_s`, and shown only once it has run for `delay_s` (a step that ends sooner
leaves nothing behind). It ends with a final line that gives the time, or, for a step whose log line
already gives it (loading, compiling), by clearing itself. When stderr is not a terminal (a pipe, a
log file, a service manager) nothing is written at all: the log lines say what happened.

No jax and no sanic: the gate uses it before either is imported. Steps may be advanced from several
threads at once (the compile pool).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

CLEAR = "\r\x1b[K"  # back to the line's start and erase it (ANSI, which every terminal we draw on has)


class Progress:
    """Where steps draw: a write function, and whether to draw at all."""

    def __init__(self, write: Callable[[str], object], *, enabled: bool = True, delay_s: float = 0.5,
                 interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.write = write
        self.enabled = enabled
        self.delay_s = delay_s
        self.interval_s = interval_s
        self.clock = clock

    @classmethod
    def to(cls, stream, **kw) -> Progress:
        """Progress on `stream`, drawn only if it is a terminal."""
        isatty = getattr(stream, "isatty", None)
        tty = bool(isatty and isatty())

        def write(text: str) -> None:
            stream.write(text)
            stream.flush()

        return cls(write, enabled=tty, **kw)

    def step(self, label: str, total: float | None = None, unit: str = "", *, final: bool = True) -> Step:
        """A step named `label` ("bankml: hashing x.gguf"); `unit` "bytes" shows MB and a percentage,
        any other unit a count ("12/27 programs"). final=False: the line is cleared at the end."""
        return Step(self, label, total, unit, final)


def stderr_progress() -> Progress:
    """Progress on the process's stderr as it is now (so a test's capture of stderr is honoured)."""
    return Progress.to(sys.stderr)


class Step:
    def __init__(self, progress: Progress, label: str, total: float | None, unit: str, final: bool):
        self._p = progress
        self.label, self.total, self.unit, self.final = label, total, unit, final
        self.done = 0.0
        self._t0 = progress.clock()
        self._drawn_at: float | None = None  # when the line was last drawn; None: not shown yet
        self._closed = False
        self._last = ""
        self._lock = threading.Lock()

    def __enter__(self) -> Step:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(failed=kind is not None)

    def advance(self, n: float = 1) -> None:
        with self._lock:
            self.done += n
            self._draw()

    def update(self, done: float) -> None:
        with self._lock:
            self.done = done
            self._draw()

    def text(self) -> str:
        if self.unit == "bytes":
            if self.total:
                return f"{self.label}: {100 * self.done // self.total:.0f}% of {_mb(self.total)}"
            return f"{self.label}: {_mb(self.done)}"
        count = f"{self.done:.0f}/{self.total:.0f}" if self.total is not None else f"{self.done:.0f}"
        return f"{self.label} {count} {self.unit}".rstrip()

    def close(self, failed: bool = False) -> None:
        """End the step: its final line with the time, or (not final, or failed) a cleared line, so
        whatever is printed next (the log line, a refusal) starts at the line's beginning."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._p.enabled:
                return
            if self._drawn_at is None and not self.final:
                return
            now = self._p.clock()
            if self._drawn_at is None and now - self._t0 < self._p.delay_s:
                return  # too quick to be worth a line
            if failed or not self.final:
                self._p.write(CLEAR)
            else:
                self._p.write(f"{CLEAR}{self.text()} in {now - self._t0:.1f} s\n")

    def _draw(self) -> None:
        if not self._p.enabled or self._closed:
            return
        now = self._p.clock()
        if now - self._t0 < self._p.delay_s:
            return
        if self._drawn_at is not None and now - self._drawn_at < self._p.interval_s:
            return
        text = self.text()
        if text != self._last:  # a wait with nothing new to say draws nothing
            self._drawn_at, self._last = now, text
            self._p.write(CLEAR + text)


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
