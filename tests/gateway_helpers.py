"""Start a gateway for a test and talk to it over raw sockets.

`FakeServer` runs tests/gateway_fake_server.py (the real gate, loopback rules, routes and receipts,
over the fake engine) in a subprocess on ports the system picks, and learns them from its start-up
line. `CliServer` runs the installed `bankml serve ... --native` on the real model. Both collect the
server's stderr, and stop their process (by its pid) when the test is done.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tiny_gguf import write_tiny_gguf

from bankml.pin import fork_record

HERE = Path(__file__).resolve().parent
LISTENING = re.compile(r"listening on http://(\S+):(\d+) and, for llama-server's clients, http://(\S+):(\d+)")


def tiny_model(directory: Path, name: str = "Tiny-Model.Q8_0.gguf") -> tuple[Path, Path]:
    """A tiny GGUF that passes the guard, and a FORK.json pinning it."""
    directory.mkdir(parents=True, exist_ok=True)
    model = write_tiny_gguf(directory / name)
    fork = directory / (name + ".FORK.json")
    fork.write_text(json.dumps(fork_record(model)))
    return model, fork


def registry_dir(directory: Path, names: list[str]) -> Path:
    """A registry directory: one tiny GGUF per name ("Model-A.Q8_0.gguf" is pinned as "model-a.q8_0"),
    each pinned by its own FORK.json in it."""
    for name in names:
        tiny_model(directory, name)
    return directory


class _Server:
    def __init__(self, cmd: list[str], timeout_s: float, env: dict | None = None, cwd: Path | None = None):
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.port = self.upstream_port = 0
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})}, cwd=cwd)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or not self.port:
            self.stop()
            raise RuntimeError("the server did not start:\n" + self.log())

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = LISTENING.search(line)
            if m:
                self.port, self.upstream_port = int(m.group(2)), int(m.group(4))
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def wait_for_log(self, pattern: str, timeout_s: float = 10.0) -> re.Match | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m
            time.sleep(0.02)
        return None

    def url(self, path: str = "", upstream: bool = False) -> str:
        return f"http://127.0.0.1:{self.upstream_port if upstream else self.port}{path}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class FakeServer(_Server):
    def __init__(self, model: Path, fork: Path, *, limits: dict | None = None, engine: dict | None = None,
                 step_ms: float = 2, ctx: int = 4096, timeout_s: float = 60, replay: bool = False,
                 registry: Path | None = None, max_loaded: int | None = None, keep_alive: str | None = None,
                 load_s: dict[str, float] | None = None, model_bytes: dict[str, int] | None = None,
                 budget_bytes: int | None = None, env: dict | None = None, flags: list[str] | None = None):
        """`engine`: keys of [engine] over the defaults; the fake engine serves one sequence at a time
        unless it names `max_seqs`. `registry`: a directory of pins (`registry_dir` writes one), each
        served by a fake engine of its own; `load_s` / `model_bytes`: per pin name, how long its load
        takes and what it holds; `budget_bytes`: what all resident models may hold together; `flags`:
        more of `bankml serve`'s own."""
        engine = {"max_seqs": 1, **(engine or {})}
        cmd = [sys.executable, str(HERE / "gateway_fake_server.py"), str(model), "--fork", str(fork),
               "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:0", "--ctx", str(ctx),
               "--step-ms", str(step_ms), "--limits", json.dumps(limits or {}), "--engine", json.dumps(engine),
               *(["--replay"] if replay else []),
               *(["--registry", str(registry)] if registry is not None else []),
               *(["--max-loaded", str(max_loaded)] if max_loaded is not None else []),
               *(["--keep-alive", keep_alive] if keep_alive is not None else []),
               "--load-s", json.dumps(load_s or {}), "--model-bytes", json.dumps(model_bytes or {}),
               *(["--budget-bytes", str(budget_bytes)] if budget_bytes is not None else []), *(flags or [])]
        super().__init__(cmd, timeout_s, env)


class CliServer(_Server):
    def __init__(self, bankml_cmd: list[str], *args: str, timeout_s: float = 600, env: dict | None = None):
        port, upstream = free_port(), free_port()
        super().__init__([*bankml_cmd, "serve", *args, "--native", "--listen", f"127.0.0.1:{port}",
                          "--upstream", f"127.0.0.1:{upstream}"], timeout_s, env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    s.settimeout(timeout_s)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset ends it too; what came before is kept)."""
    out = bytearray()
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    with connect(port, timeout_s) as s:
        s.sendall(data)
        return read_all(s)


def request_bytes(method: str, path: str, *, host: str = "127.0.0.1", headers: dict | None = None,
                  body: bytes = b"", content_type: str | None = "application/json") -> bytes:
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    if content_type is not None and method == "POST":
        lines.append(f"Content-Type: {content_type}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.") else 0


def split_response(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status_of(response), headers, body


class EdgeServer(_Server):
    """A FakeServer given serve flags of its own (--api-key, --allow-origin, --chat-template-file, ...),
    passed to `bankml serve`'s parser as the command line would."""

    def __init__(self, model: Path, fork: Path, *serve_args: str, timeout_s: float = 60, env: dict | None = None):
        cmd = [sys.executable, str(HERE / "gateway_fake_server.py"), str(model), "--fork", str(fork),
               "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:0", "--engine", json.dumps({"max_seqs": 1}),
               *serve_args]
        super().__init__(cmd, timeout_s, env)


def sse_data(text: str) -> list:
    """The `data:` payloads of an SSE body, each parsed as JSON but `[DONE]`."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
