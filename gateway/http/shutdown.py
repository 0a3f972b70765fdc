"""How a server stops (SIGTERM, SIGINT): no new connections, the answers in flight finish within a
grace period, and those still running then are ended as well as their state allows.

`Shutdown` is shared by the listeners of one server (loopback.make_protocol); every connection
registers with it, and the app's before-stop listener awaits `stop()` (sanic_app.py, p0/app.py), before
Sanic's own shutdown, which then finds nothing left to wait for.

A stop always ends the process (issue 28: "Server Stopped", then the process went on until SIGKILL).
Threads may still be busy when the loop is done: a worker of the loop's executor inside a request's
preparation nobody awaits any more, an engine thread inside a step. concurrent.futures joins every
worker of every ThreadPoolExecutor at interpreter exit, daemon or not, so no executor setting can let
the process go; and the engine's native code cannot be interrupted. So `stop()` arms the process's
`ExitWatchdog`: one daemon thread that, unless the process has ended by then, logs which threads are
still busy, flushes the logs and `os._exit`s at the grace period plus ENDED_CLOSE_S plus EXIT_MARGIN_S
after the signal. Nothing is lost that would not be lost anyway: every answer has ended by then, and
the receipts went out with them. A stop that ends normally never sees it (the thread is a daemon).

The stop signals are the Shutdown's own (`take_signals`, from an after-start listener, before the
server says it listens): Sanic runs its after-start listeners inside `loop.run_until_complete`, where
the `loop.stop()` of its `app.stop()` ends that run, not the server's: the server then crashed ("Event
loop stopped before Future completed") or served on as if never signalled (CI: a SIGTERM sent on the
"listening on" line waited 15 s). So a stop waits until Sanic serves (looked at every STOP_RETRY_S),
and is asked once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

log = logging.getLogger("bankml.gateway")

SHUTTING_DOWN = "bankml serve is shutting down"
ENDED_CLOSE_S = 1.0  # how long the ended answers (and refusals, drained for 200 ms) get to reach the wire
# after the grace and ENDED_CLOSE_S: Sanic's own stop (GRACEFUL_SHUTDOWN_TIMEOUT, 2 s), then the engine
# threads' stop (a 5 s join each) or P0's llama-server's (SIGKILL after 5 s), the monitor's close and the
# interpreter's exit; past it, the watchdog ends the process
EXIT_MARGIN_S = 10.0
FORCED_EXIT = 1  # the exit status of a process the watchdog ended (a normal stop exits 0, P0 128 + signal)
STOP_RETRY_S = 0.1  # a stop asked while the server still starts waits, looking this often, until it serves


class ExitWatchdog:
    """Ends the process with `os._exit` at a deadline, unless it has ended by then. `arm(within_s)`
    starts it, or brings its deadline nearer; the thread waits on a condition (no polling) and, being
    a daemon, never keeps the process alive itself. `clock` and `exit` are the tests'."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, exit: Callable[[int], object] = os._exit):
        self._clock = clock
        self._exit = exit
        self._cond = threading.Condition()
        self._deadline_s: float | None = None
        self._thread: threading.Thread | None = None
        self.fired = False

    def arm(self, within_s: float) -> None:
        with self._cond:
            deadline = self._clock() + within_s
            if self._deadline_s is None or deadline < self._deadline_s:
                self._deadline_s = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, args=(within_s,), name="bankml-exit-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _watch(self, armed_for_s: float) -> None:
        with self._cond:
            while (left := self._deadline_s - self._clock()) > 0:
                self._cond.wait(left)
        me = threading.current_thread()
        busy = sorted(t.name for t in threading.enumerate() if t is not me and t is not threading.main_thread())
        log.error("stopping: the process is still running %g s after the stop began (threads still busy: %s): "
                  "exiting now", armed_for_s, ", ".join(busy) or "none")
        _flush_logs()
        self.fired = True
        self._exit(FORCED_EXIT)


def _flush_logs() -> None:
    for handler in [*logging.getLogger().handlers, *log.handlers]:
        try:
            handler.flush()
        except Exception:  # a handler that cannot flush must not keep the process alive
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


PROCESS_WATCHDOG = ExitWatchdog()  # the process's: a server stopping in it ends it


class Connection(Protocol):
    """What a stop needs from a connection (loopback.LoopbackProtocol has it)."""

    @property
    def in_flight(self) -> bool: ...

    def refuse_head(self) -> None: ...

    def end_for_shutdown(self) -> None: ...


class Shutdown:
    """The open connections of a server's listeners, and how they end when it stops (SIGTERM, SIGINT).

    `stop()` runs once, before Sanic's own shutdown, so that one finds nothing left to wait for.
    """

    def __init__(self, grace_s: float = 10.0, watchdog: ExitWatchdog | None = PROCESS_WATCHDOG):
        self.grace_s = grace_s
        self.watchdog = watchdog  # None: a stop leaves the process alone
        self._listeners: list[tuple[int, int, tuple]] = []  # (fd, family, address) of each listening socket
        self.open: set[Connection] = set()
        self._none_open = asyncio.Event()
        self._stopping: asyncio.Future | None = None
        self._stop_asked = False  # a stop signal came (request_stop)

    def add_listener(self, sock: socket.socket) -> None:
        """Call before the server takes the socket: the event loop may detach it from its object."""
        self._listeners.append((sock.fileno(), sock.family, sock.getsockname()))

    def add(self, conn: Connection) -> None:
        self.open.add(conn)
        self._none_open.clear()

    def discard(self, conn: Connection) -> None:
        self.open.discard(conn)
        if not self.open:
            self._none_open.set()

    def take_signals(self, app: Any, signals: Iterable[int],
                     on_signal: Callable[[int], None] | None = None) -> None:
        """From an after-start listener (in the loop): each of `signals` stops `app` gracefully, after
        `on_signal(signum)`. Sanic's own handlers for SIGINT and SIGTERM, if any, are replaced."""
        loop = asyncio.get_running_loop()

        def stop(signum: int) -> None:
            if on_signal is not None:
                on_signal(signum)
            self.request_stop(app)

        for sig in signals:
            loop.add_signal_handler(sig, stop, sig)

    def request_stop(self, app: Any) -> None:
        """`app.stop()` once Sanic serves (`state.is_running`, set just before its loop runs for good),
        looked at again every STOP_RETRY_S until then (the module's text). Once: a second signal while
        the first waits or stops asks nothing more (a second `app.stop()` inside Sanic's own shutdown
        run would end that run early)."""
        if self._stop_asked:
            return
        self._stop_asked = True
        self._stop_when_serving(app)

    def _stop_when_serving(self, app: Any) -> None:
        if app.state.is_running:
            app.stop(terminate=False)
        elif self._stopping is None:
            asyncio.get_running_loop().call_later(STOP_RETRY_S, self._stop_when_serving, app)

    async def stop(self) -> None:
        # Sanic runs its stop listeners once per listener: the second call waits for the first
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        if self.watchdog is not None:  # from the signal on: the process ends within the grace and a margin
            self.watchdog.arm(self.grace_s + ENDED_CLOSE_S + EXIT_MARGIN_S)
        for fd, family, address in self._listeners:
            _stop_listening(fd, family, address)
        in_flight = sum(conn.in_flight for conn in self.open)
        log.info("stopping: no new connections; %d answer(s) in flight get up to %g s", in_flight, self.grace_s)
        for conn in list(self.open):
            conn.refuse_head()
        if not await self._none_open_within(self.grace_s):
            log.info("stopping: %d answer(s) still running after %g s are ended", len(self.open), self.grace_s)
            for conn in list(self.open):
                conn.end_for_shutdown()
            await self._none_open_within(ENDED_CLOSE_S)

    async def _none_open_within(self, timeout_s: float) -> bool:
        if not self.open:
            return True
        try:
            await asyncio.wait_for(self._none_open.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


def _stop_listening(fd: int, family: int, address: tuple) -> None:
    """Close a listening socket under the event loop's feet, safely: a fresh unbound socket is put in
    its place (dup2 is atomic), so the loop's watcher still names a valid fd, one that never fires, and
    the listener itself is gone, so connect() is refused at once. Sanic keeps the loop's server objects
    to itself (the first listener's in a local variable), so closing those is not an option; and the fd
    is checked first, so one the loop has already closed and reused is left alone."""
    try:
        with socket.fromfd(fd, family, socket.SOCK_STREAM) as probe:  # a dup: closing it leaves fd open
            if not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) or probe.getsockname() != address:
                return
    except OSError:
        return
    with socket.socket(family, socket.SOCK_STREAM) as blank:
        os.dup2(blank.fileno(), fd)
