"""One replica's `bankml serve --native` child on loopback, and an HTTP exchange passed through to it.

bankml/ray_app.py's replicas are Ray actors; each runs this module's `ChildServer`: the ordinary
`bankml serve MODEL --fork FORK.json --native` as a child process, on loopback ports of its own. The
child gates the file (guard, then the sha256 pin: bankml/serve.py, the code every `bankml serve` runs)
before it loads the engine and binds; a refusal is its `bankml serve: refuse: <why>` line, raised here
as `ReplicaRefused` with that reason. The child watches its parent and stops when the parent is gone,
so a killed actor leaves no server behind.

`forward` passes one request to the child and yields its answer as it comes: a `Head` (status and
headers) first, then the body's bytes as the child writes them (SSE and NDJSON streams stay
incremental); a small whole answer comes in its Head alone (one item through Ray, not two). A child
that dies mid-answer ends a stream with an error event in the stream's own shape; every wait has a
timeout. `affinity_key` is what the router hashes: the first characters of the system prompt and the
first message. Imports neither ray nor jax: the tests and the bench use it without a cluster.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from gateway.http.errors import Api, anthropic_error, api_of, sse_error_event, unavailable_error

LISTENING = re.compile(r"listening on http://(\S+):(\d+) and, for llama-server's clients")
REFUSE = re.compile(r"bankml serve: refuse: (.*)")
WHOLE_BYTES = 1 << 20  # an answer this small with a Content-Length comes with its head (Head.body)
SSE, NDJSON = "text/event-stream", "application/x-ndjson"  # the streams' content types: never whole
# hop-by-hop headers (RFC 9110 §7.6.1) and the body's length: each hop writes its own
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "content-length"})
# the child, started by the actor: a thread that stops it (SIGTERM, the server's graceful stop) once the
# actor that started it is gone, whatever killed the actor; then bankml's own CLI
_WATCHED = """\
import os, signal, sys, threading, time
parent = int(sys.argv.pop(1))
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(15)
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
from bankml.cli import main
sys.exit(main(sys.argv[1:]))
"""


class ReplicaRefused(Exception):
    """A replica's child refused to start (the gate, or the load), or did not start in time."""


@dataclass(frozen=True)
class Head:
    """The first thing `forward` yields: the answer's status and headers (hop-by-hop ones dropped), and
    for a whole answer of at most WHOLE_BYTES (a Content-Length, not a stream) its body, and then
    nothing more: one item through Ray's streamed call instead of two (bench/replicas.py: each costs
    milliseconds)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes | None = None


@dataclass(frozen=True)
class Unavailable:
    """What `forward` yields, alone, when the child took no connection (it has exited): nothing was sent,
    so the ingress may send the request to another replica."""

    reason: str
    replica: str = ""


@dataclass(frozen=True)
class Forwarded:
    """A request as the ingress read it: the target exactly as sent (path and query, not decoded)."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """`bankml serve --native` in a child process, started (gated, loaded, bound) by `start`."""

    def __init__(self, proc: subprocess.Popen, port: int, lines: deque[str]):
        self.proc, self.port, self._lines = proc, port, lines

    @classmethod
    def start(cls, model: str, fork: str, receipt_key: str, flags: list[str], startup_timeout_s: float,
              tries: int = 2) -> ChildServer:
        """Start the child and wait for its listening line. ReplicaRefused with the child's own reason
        when it refuses; a port taken between the pick and the bind is tried again with others."""
        for attempt in range(tries):
            try:
                return cls._start_once(model, fork, receipt_key, flags, startup_timeout_s)
            except ReplicaRefused as e:
                if "cannot listen" not in str(e) or attempt == tries - 1:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, model: str, fork: str, receipt_key: str, flags: list[str],
                    startup_timeout_s: float) -> ChildServer:
        cmd = [sys.executable, "-c", _WATCHED, str(os.getpid()), "serve", model, "--fork", fork, "--native",
               "--listen", f"127.0.0.1:{free_port()}", "--upstream", f"127.0.0.1:{free_port()}",
               "--receipt-key", receipt_key, *flags]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, errors="replace")
        lines: deque[str] = deque(maxlen=200)
        listening = threading.Event()
        port: list[int] = []

        def read() -> None:
            for line in proc.stderr:
                lines.append(line)
                print(line, end="", file=sys.stderr, flush=True)  # into the actor's log
                if not port and (m := LISTENING.search(line)):
                    port.append(int(m.group(2)))
                    listening.set()
            listening.set()  # the child's stderr ended: it exited

        threading.Thread(target=read, daemon=True, name="bankml-child-stderr").start()
        if not listening.wait(startup_timeout_s):
            _stop(proc)
            raise ReplicaRefused(f"bankml serve did not start within {startup_timeout_s:.0f} s: "
                                 f"{_tail(lines)}")
        if not port:
            code = proc.wait(10)
            raise ReplicaRefused(_refusal(lines) or f"bankml serve exited ({code}): {_tail(lines)}")
        return cls(proc, port[0], lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> str | None:
        """None while the child runs; else how it ended."""
        code = self.proc.poll()
        return None if code is None else f"bankml serve (pid {self.proc.pid}) exited ({code}): {_tail(self._lines)}"

    def stop(self) -> None:
        _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _refusal(lines: deque[str]) -> str | None:
    for line in reversed(lines):
        if m := REFUSE.search(line):
            return m.group(1).strip()
    return None


def _tail(lines: deque[str], n: int = 3) -> str:
    return " | ".join(line.strip() for line in list(lines)[-n:]) or "(nothing on stderr)"


# --- one exchange ----------------------------------------------------------------------------------


def error_chunk(content_type: str, status: int, message: str, target: str = "/") -> bytes | None:
    """The in-band error that ends a stream whose head is already sent, in the stream's shape and its
    API's (the request's `target`, as gateway/http/errors.py's api_of reads it): an SSE event
    (llama-server's and OpenAI's error object; Anthropic's `event: error`, as its SDK reads one) or an
    NDJSON line (Ollama's `{"error": ...}`); None for any other body (it just ends short)."""
    if content_type.startswith(SSE):
        return sse_error_event(status, message, _api(target))
    if content_type.startswith(NDJSON):
        return json.dumps({"error": message}).encode() + b"\n"
    return None


def _failed(message: str, target: str) -> Head:
    """The whole 502 of a child that failed before anything of its answer went out."""
    return Head(502, [("content-type", "application/json")], error_body(502, message, target))


def error_body(status: int, message: str, target: str = "/") -> bytes:
    """A whole answer when nothing of the child's came, in the API's shape of the request's `target`
    (as the gateway renders its own: gateway/http/errors.py): Ollama's `{"error": ...}` for /api/*,
    Anthropic's error object for /v1/messages, else llama-server's (and OpenAI's)."""
    api = _api(target)
    if api is Api.OLLAMA:
        return json.dumps({"error": message}).encode()
    if api is Api.ANTHROPIC:
        return anthropic_error(status, message).encode()
    return unavailable_error(status, message).encode()


def _api(target: str) -> Api:
    return api_of(target.split("?", 1)[0])


async def forward(client: httpx.AsyncClient, base_url: str,
                  request: Forwarded) -> AsyncIterator[Head | bytes | Unavailable]:
    """Send `request` to the child at `base_url`; yield a Head, then the body as it arrives; or only a
    Head with the whole body (a small answer that is not a stream, or the 502 of a child that failed
    before its answer was whole); or only Unavailable, when the child took no connection. The Host
    header goes as the client sent it, so the child's loopback rules judge it as they would directly."""
    headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
    try:
        upstream = client.build_request(request.method, base_url + request.target, headers=headers,
                                        content=request.body)
        response = await client.send(upstream, stream=True)
    except httpx.ConnectError as e:
        yield Unavailable(f"the replica's server took no connection: {e}")
        return
    except httpx.HTTPError as e:
        yield _failed(f"the replica's server did not answer: {type(e).__name__}: {e}", request.target)
        return
    content_type = response.headers.get("content-type", "")
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in HOP_BY_HOP - {"content-length"}]
    length = response.headers.get("content-length", "")
    try:
        if (length.isdigit() and int(length) <= WHOLE_BYTES and "content-encoding" not in response.headers
                and not content_type.startswith((SSE, NDJSON))):
            try:
                body = await response.aread()
            except httpx.HTTPError as e:  # nothing went out yet: a whole 502 in the API's shape
                yield _failed(f"the replica's server stopped mid-answer: {type(e).__name__}: {e}", request.target)
                return
            yield Head(response.status_code, headers, body)
            return
        yield Head(response.status_code, headers)
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        chunk = error_chunk(content_type, 502, f"the replica's server stopped mid-answer: {type(e).__name__}: {e}",
                            request.target)
        if chunk is not None:
            yield chunk
    finally:
        await response.aclose()


# --- what the router hashes ------------------------------------------------------------------------


def affinity_key(body: bytes, chars: int) -> str | None:
    """The first `chars` characters of the request's system prompt and first message (a prompt's, for
    the completion routes), or None when the body has none (then any replica, the least loaded, takes
    it). Every dialect: OpenAI and llama-server (`messages`, `prompt`), Ollama (`system`, `prompt`),
    Anthropic (`system`), Responses (`instructions`, `input`)."""
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    parts: list[str] = [_text(doc.get("system")), _text(doc.get("instructions"))]
    messages = doc.get("messages")
    if isinstance(messages, list):
        system = [m for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")]
        rest = [m for m in messages if isinstance(m, dict) and m.get("role") not in ("system", "developer")]
        parts += [_text(m.get("content")) for m in system] + [_text(rest[0].get("content")) if rest else ""]
    else:
        parts += [_text(doc.get("prompt")), _text(doc.get("input"))]
    text = "\n".join(p for p in parts if p)
    return text[:chars] if text else None


def _text(value: object) -> str:
    """A content's text: a string, or the `text` of its parts (OpenAI's, Anthropic's)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(p.get("text") if isinstance(p, dict) else p) for p in value)
    return ""
