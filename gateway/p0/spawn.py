"""`--spawn BIN`: launch llama-server on the verified path, and make sure it never outlives bankml serve.

The argv is the Rust bankml's (serve.rs, P0), with the canonical path of the file that was hashed.
Its stdout goes to /dev/null; its stderr is read by a thread that keeps the last lines, so a refusal
can say why the engine died (and the pipe never fills, which would stall llama-server).

Three ways the engine is stopped:
- bankml serve stops normally: `LlamaServer.stop()` (SIGTERM to its process group, then SIGKILL);
- SIGTERM, SIGINT or SIGHUP: `install_stop_signals` stops it, then exits 128 + the signal;
- bankml serve dies without running any code (SIGKILL, a crash): the kernel sends the engine SIGKILL,
  because the child asked for it with prctl(PR_SET_PDEATHSIG) between fork and exec.
The engine gets its own process group, so a Ctrl-C at the terminal reaches only bankml serve, which
then stops the engine itself (and so the order of the two shutdowns is ours).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TAIL_LINES = 20


def llama_server_argv(binary: str, model_path: str, host: str, port: int, threads: int, ctx: int,
                spec_ngram: bool = False, slot_dir: str | None = None, spec_sizes: Sequence[str] = ()) -> list[str]:
    """llama-server's command line for the verified file (bankML serve.rs, P0). `spec_sizes`: its draft
    flags (--draft-max 8 ...), given with --spec-type ngram-simple."""
    argv = [binary, "-m", model_path, "--host", host, "--port", str(port), "-t", str(threads), "-c", str(ctx),
            "-np", "1", "--jinja", "--reasoning", "off", "--no-webui"]
    if spec_ngram:
        argv += ["--spec-type", "ngram-simple", *spec_sizes]
    if slot_dir:
        argv += ["--slot-save-path", slot_dir]
    return argv


def exit_status_text(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "?"
        return f"killed by signal {-returncode} ({name})"
    return f"exit status {returncode}"


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn: own process group, and SIGKILL when the parent dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls into it

    def preexec() -> None:
        os.setpgid(0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody will stop us
            os._exit(1)

    return preexec


class LlamaServer:
    """A running llama-server child. Start it from the main thread: PDEATHSIG fires when the thread
    that forked the child ends, and only the main thread lives as long as the process."""

    def __init__(self, argv: list[str], tail_lines: int = TAIL_LINES):
        self.argv = argv
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=_die_with_parent(os.getpid()))
        self.stopping = False  # set once we stop it ourselves: its exit is then expected
        self._reader = threading.Thread(target=self._read_stderr, name="llama-server-stderr", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self.tail.append(line)

    def returncode(self) -> int | None:
        return self.proc.poll()

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code if the engine ends within `timeout_s` (at once when it has), else None."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def last_output(self) -> str:
        """Its last stderr lines, once the reader has seen the pipe close (or after 1 s)."""
        self._reader.join(1.0)
        return "\n".join(f"    {line}" for line in self.tail)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_s`; returns once it is gone."""
        self.stopping = True
        if self.proc.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        if self.wait_exit(grace_s) is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # not its own group after all: signal the process itself
            self.proc.send_signal(sig)


def install_stop_signals(llama_server: Callable[[], LlamaServer | None]) -> None:
    """SIGTERM, SIGINT and SIGHUP stop the spawned engine (if any), then exit 128 + the signal at once
    (the Rust bankml's start-up, step 5). Must run in the main thread; Sanic resets SIGINT and SIGTERM when it starts
    serving, so the P0 app installs these again then."""

    def on_signal(signum, frame) -> None:
        try:
            e = llama_server()
            if e is not None:
                try:
                    print(f"bankml serve: signal {signal.Signals(signum).name}: stopping llama-server "
                          f"(pid {e.pid})", file=sys.stderr, flush=True)
                except (OSError, ValueError):  # stderr is gone (a closed pipe): stop all the same
                    pass
                e.stop()
        finally:
            os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
