"""Helpers for the P0 tests: the gateway (tests/p0_launch.py) and the mock engine, each in its own process.

`Gateway` runs `bankml serve MODEL --fork F ... --listen 127.0.0.1:<free>` in P0 mode and collects its
stderr; `Engine` is an executable wrapper that launches tests/mock_llama_server.py as `--spawn BIN`
launches llama-server (it records its pid and argv); `StandaloneMock` is the mock started by a test,
for `--upstream`. Processes are stopped by their own pid.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from gateway_helpers import free_port

HERE = Path(__file__).resolve().parent
LAUNCH = HERE / "p0_launch.py"
MOCK = HERE / "mock_llama_server.py"
REPLY = "Savante knows."
MIB = 1 << 20


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def chat_body(stream: bool = False, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Who knows? /no_think"}], "stream": stream,
                       **extra}).encode()


# --- processes ---------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


class Gateway:
    """`bankml serve MODEL --fork F ARGS --listen 127.0.0.1:<free>` (P0), its stderr collected."""

    def __init__(self, model: Path, fork: Path, *args: str, timeout_s: float = 60, env: dict | None = None):
        self.port = free_port()
        self.lines: list[str] = []
        self._done = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, str(LAUNCH), str(model), "--fork", str(fork), *args,
             "--listen", f"127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = wait_for(lambda: "listening on http://" in self.log() or self._done.is_set(), timeout_s)
        self.ready = self.ready and "listening on http://" in self.log()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
        self._done.set()

    def log(self) -> str:
        return "".join(self.lines)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, body: bytes, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
        return httpx.post(self.url(path), content=body, headers={"Content-Type": "application/json"},
                          timeout=60, **kw)

    def exit_code(self, timeout_s: float = 30) -> int:
        code = self.proc.wait(timeout_s)
        self._done.wait(5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Engine:
    """The mock llama-server as `--spawn BIN` launches it: an executable wrapper, extra mock flags
    first; it records its pid and full argv."""

    def __init__(self, directory: Path, *mock_args: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.record = directory / "engine.json"
        self.bin = directory / "llama-server"
        flags = " ".join(f"'{a}'" for a in ("--mock-record", str(self.record), *mock_args))
        self.bin.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{MOCK}" {flags} "$@"\n')
        self.bin.chmod(0o755)

    def recorded(self) -> dict:
        assert wait_for(self.record.exists, 10), "the engine was never launched"
        return json.loads(self.record.read_text())


class StandaloneMock:
    """The mock started by the test, for `--upstream`."""

    def __init__(self, model: Path | str, *mock_args: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, str(MOCK), "-m", str(model), "--port", str(self.port),
                                      *mock_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_for(self._answers, 20), "the mock did not start"

    def _answers(self) -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def configure(port: int, **cfg) -> None:
    httpx.post(f"http://127.0.0.1:{port}/mock/config", json=cfg, timeout=10).raise_for_status()


def last_upstream_body(port: int) -> bytes:
    return httpx.get(f"http://127.0.0.1:{port}/mock/last", timeout=10).content


def receipt_event(sse: str) -> dict | None:
    for line in sse.splitlines():
        if line.startswith("data: {") and '"bankml_receipt"' in line:
            return json.loads(line[6:])["bankml_receipt"]
    return None


def stream_text(sse: str) -> str:
    out = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            out.append(choices[0].get("delta", {}).get("content") or "")
    return "".join(out)
