"""The llama-server behind P0: the start-up checks (steps 6-8 of gateway/p0/app.py) and the one pooled client.

Start-up runs before any event loop, so it is synchronous: `already_answers` (with --spawn nothing may
answer on the upstream address yet), `wait_healthy` (poll /health every 500 ms; a spawned engine that
exits is noticed at once, not at the time limit), `served_model` (the engine's /props `model_path`,
canonicalised, must be the verified file).

While serving, `Upstream` holds one pool of keep-alive connections (http1.py; httpx alone costs
more than the gateway's whole latency budget), so a proxied /health costs no new connection. Every
body read from llama-server is bounded: an announced Content-Length or chunk over the limit
(64 MiB) is refused before a byte of it is read, and a body, or one line of a stream, that grows
past it is refused as it grows, so nothing is ever buffered beyond the limit. Responses are asked
for uncompressed (`Accept-Encoding: identity`) and nothing is decompressed here: the bytes passed
on are the bytes llama-server wrote, and no compressed bomb can slip under the limit.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from bankml.errors import Refused, StartFailed, UpstreamFailed
from gateway.p0.http1 import HttpError, Pool, Response, TooLarge
from gateway.p0.spawn import LlamaServer, exit_status_text

MAX_UPSTREAM_BODY_BYTES = 64 << 20
HEALTH_POLL_S = 0.5
CHECK_TIMEOUT_S = 10.0  # /props per answer, and start-up requests
ANSWER_TIMEOUT_S = 3600.0  # the Rust bankml waits an hour for an answer's next bytes: a long generation is not cut
HEADERS = {"Accept-Encoding": "identity"}


class UpstreamError(UpstreamFailed):
    """llama-server could not be asked, or its answer is unusable: a 502 for the client."""


class UpstreamTooLarge(UpstreamError):
    pass


def size_text(n_bytes: int) -> str:
    return f"{n_bytes >> 20} MiB" if n_bytes % (1 << 20) == 0 else f"{n_bytes} bytes"


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class ServedModel:
    path: str  # canonical
    build_info: str | None  # llama-server's /props build_info, e.g. "b6490-1d0125bc"


# --- start-up (synchronous) ----------------------------------------------------------------------


def already_answers(up: str) -> bool:
    """Does anything answer HTTP on `up`? (Any status counts: something is there.)"""
    try:
        with httpx.Client(timeout=2.0, headers=HEADERS) as c:
            c.get(f"http://{up}/health")
        return True
    except httpx.HTTPError:
        return False


def wait_healthy(up: str, limit_s: float, engine: LlamaServer | None = None) -> None:
    """Until GET /health is 200, for at most `limit_s`. Raises StartFailed."""
    deadline = time.monotonic() + limit_s
    with httpx.Client(timeout=min(CHECK_TIMEOUT_S, 2.0), headers=HEADERS) as c:
        while True:
            try:
                if c.get(f"http://{up}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet, or busy loading
            if engine is not None:
                code = engine.wait_exit(HEALTH_POLL_S)  # returns at once if the engine ends
                if code is not None:
                    tail = engine.last_output()
                    said = f"; its last lines:\n{tail}" if tail else " (it wrote nothing on stderr)"
                    raise StartFailed(f"the engine exited ({exit_status_text(code)}) before it was healthy{said}")
            else:
                time.sleep(HEALTH_POLL_S)
            if time.monotonic() > deadline:
                raise StartFailed(f"upstream {up} not healthy after {limit_s:g} s")


def _props(text: bytes, status: int, up: str) -> dict:
    try:
        v = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise UpstreamError(f"upstream {up}/props: not JSON (HTTP {status})") from None
    if not isinstance(v, dict) or not isinstance(v.get("model_path"), str):
        raise UpstreamError(f"upstream {up}/props names no model_path")
    return v


def served_model(up: str, verified_path: str) -> ServedModel:
    """llama-server's /props must name the verified file (both sides canonical). Raises UpstreamFailed,
    or Refused when it serves another file."""
    try:
        with httpx.Client(timeout=CHECK_TIMEOUT_S, headers=HEADERS) as c:
            r = c.get(f"http://{up}/props")
        props = _props(r.content, r.status_code, up)
    except httpx.HTTPError as e:
        raise UpstreamFailed(f"upstream {up}: {e}") from e
    served = props["model_path"]
    try:
        canonical = os.path.realpath(served, strict=True)
    except OSError as e:
        raise Refused(f"upstream serves {served}, which is not readable here: {e.strerror or e}") from e
    if canonical != verified_path:
        raise Refused(f"upstream {up} serves {canonical}, not the verified {verified_path}: refused")
    build = props.get("build_info")
    return ServedModel(canonical, build if isinstance(build, str) else None)


# --- serving (asynchronous) ----------------------------------------------------------------------


class Upstream:
    """The pooled client to llama-server (http1.Pool). Create it inside the serving event loop."""

    def __init__(self, host: str, port: int, max_body_bytes: int = MAX_UPSTREAM_BODY_BYTES):
        self.address = address(host, port)
        self.max_body_bytes = max_body_bytes
        self.pool = Pool(host, port, max_chunk_bytes=max_body_bytes)

    async def aclose(self) -> None:
        await self.pool.aclose()

    @asynccontextmanager
    async def _request(self, method: str, path: str, body: bytes, headers: dict[str, str],
                       timeout_s: float) -> AsyncIterator[Response]:
        try:
            response = await self.pool.request(method, path, body, headers, timeout_s)
        except HttpError as e:
            raise UpstreamError(f"upstream {self.address}: {e}") from None
        try:
            yield response
        finally:
            await response.aclose()

    async def get(self, path: str, timeout_s: float = ANSWER_TIMEOUT_S) -> tuple[int, str, bytes]:
        """(status, content type, body) of GET `path`."""
        async with self._request("GET", path, b"", HEADERS, timeout_s) as r:
            body = await self.read_body(r)
            return r.status_code, r.headers.get("content-type", "application/json"), body

    async def served_path(self) -> str:
        """The engine's /props model_path, canonicalised (per answer: the engine must still serve the file)."""
        status, _, body = await self.get("/props", CHECK_TIMEOUT_S)
        if status != 200:
            raise UpstreamError(f"upstream {self.address}/props: HTTP {status}")
        return os.path.realpath(_props(body, status, self.address)["model_path"])

    def post(self, path: str, body: bytes):
        """POST `body` as it came (an async context manager); the response is open inside the block."""
        return self._request("POST", path, body, {**HEADERS, "Content-Type": "application/json"},
                             ANSWER_TIMEOUT_S)

    def _refuse_announced(self, r: Response) -> None:
        n = r.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > self.max_body_bytes:
            raise UpstreamTooLarge(f"upstream body larger than {size_text(self.max_body_bytes)} "
                                   f"(Content-Length {int(n)}): refused")

    async def read_body(self, r: Response) -> bytes:
        """The whole body, refused (UpstreamTooLarge) as soon as it is known to pass the limit."""
        self._refuse_announced(r)
        out = bytearray()
        try:
            async for piece in r.pieces():
                out += piece
                if len(out) > self.max_body_bytes:
                    raise UpstreamTooLarge(f"upstream body larger than {size_text(self.max_body_bytes)}: refused")
        except TooLarge as e:
            raise UpstreamTooLarge(f"upstream body larger than {size_text(self.max_body_bytes)}: {e}") from None
        except HttpError as e:
            raise UpstreamError(f"upstream {self.address}: {e}") from None
        return bytes(out)

    async def lines(self, r: Response) -> AsyncIterator[list[bytes]]:
        """The body as lines (each with its b"\\n"), in batches: all complete lines of each piece as it
        arrives. A last line without a newline comes at the end. A line over the limit is refused."""
        self._refuse_announced(r)
        pending = bytearray()
        try:
            async for piece in r.pieces():
                pending += piece
                end = piece.rfind(b"\n")  # only the new bytes can hold a new line end
                if end >= 0:
                    cut = len(pending) - len(piece) + end + 1
                    batch = bytes(pending[:cut])
                    del pending[:cut]
                    yield [line + b"\n" for line in batch[:-1].split(b"\n")]
                if len(pending) > self.max_body_bytes:
                    raise UpstreamTooLarge(f"upstream line larger than {size_text(self.max_body_bytes)}: refused")
        except TooLarge as e:
            raise UpstreamTooLarge(f"upstream chunk larger than {size_text(self.max_body_bytes)}: {e}") from None
        except HttpError as e:
            raise UpstreamError(f"upstream {self.address}: {e}") from None
        if pending:
            yield [bytes(pending)]
