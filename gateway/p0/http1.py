"""A small pooled HTTP/1.1 client on asyncio streams: just what P0 needs to talk to llama-server.

Why not httpx: on the hot path (a proxied /health, the /props check before every answer) httpx
costs about 0.8 ms a request on the 2-core dev machine and httpcore 0.4 ms, against 0.1 ms here,
and the gateway's whole budget is 0.5 ms (bench/gateway_upstream.py). llama-server speaks plain
HTTP/1.1 on loopback, so little is needed:
- a request is written in one write: request line, Host, Content-Length (always), the caller's
  headers, and the body;
- a response body is framed by chunked encoding, Content-Length, or the close, and read in pieces
  as they arrive (`Response.pieces`), so a caller can bound what it keeps; a chunk announced larger
  than `max_chunk_bytes` is refused before it is read;
- a connection whose body was read to its end goes back to the pool (unless either side said
  close); idle ones are dropped after `idle_s` (llama-server's own keep-alive is 5 s), and a
  connection that fails before any byte of the answer came back is retried once on a new one
  when it was a pooled one and the request was a GET. A POST always gets a new connection, so it
  is never sent twice;
- heads are bounded (`max_head_bytes`); every wait has a time limit.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

READ_PIECE_BYTES = 1 << 16


class HttpError(Exception):
    """The server could not be reached, or broke the protocol, or took too long."""


class TooLarge(HttpError):
    pass


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def usable(self, idle_s: float) -> bool:
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and time.monotonic() - self.idle_since < idle_s)

    def close(self) -> None:
        self.writer.close()


@dataclass
class Response:
    status_code: int
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value
    _conn: _Conn | None
    _pool: Pool
    _framing: str  # "chunked", "length", "close" or "none"
    _left: int = 0  # bytes left in the current chunk or in the sized body
    _done: bool = False
    _keep: bool = True
    _read_timeout_s: float = field(default=3600.0)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body, de-chunked, in pieces as they arrive."""
        try:
            while not self._done:
                async with asyncio.timeout(self._read_timeout_s):  # around the read only, never a yield
                    piece = await self._next()
                if piece:
                    yield piece
        except TimeoutError:
            self._fail()
            raise HttpError(f"no bytes from the server for {self._read_timeout_s:g} s") from None
        except HttpError:
            self._fail()
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            self._fail()
            raise HttpError(f"reading the body: {type(e).__name__}: {e}") from None
        self._finish()

    async def _next(self) -> bytes:
        reader = self._conn.reader
        if self._framing == "none":
            self._done = True
            return b""
        if self._framing == "close":
            piece = await reader.read(READ_PIECE_BYTES)
            self._done = not piece
            return piece
        if self._framing == "chunked" and self._left == 0:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)  # ValueError on garbage
            if size > self._pool.max_chunk_bytes:
                raise TooLarge(f"chunk of {size} bytes announced")
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                self._done = True
                return b""
            self._left = size
        piece = await reader.read(min(self._left, READ_PIECE_BYTES))
        if not piece:
            raise asyncio.IncompleteReadError(b"", self._left)
        self._left -= len(piece)
        if self._left == 0:
            if self._framing == "chunked":
                if await reader.readexactly(2) != b"\r\n":
                    raise ValueError("a chunk does not end in CRLF")
            else:
                self._done = True
        return piece

    async def read(self) -> bytes:
        return b"".join([p async for p in self.pieces()])

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn, self._keep and self._framing != "close")

    def _fail(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        """Done with it: a body not read to its end closes the connection (the server sees the client go)."""
        if self._done:
            self._finish()
        else:
            self._fail()


class Pool:
    """Connections to one host:port, reused while idle."""

    def __init__(self, host: str, port: int, *, max_idle: int = 16, idle_s: float = 2.0,
                 connect_timeout_s: float = 10.0, max_head_bytes: int = 64 << 10,
                 max_chunk_bytes: int = 64 << 20):
        self.host, self.port = host, port
        self.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.max_idle, self.idle_s = max_idle, idle_s
        self.connect_timeout_s = connect_timeout_s
        self.max_head_bytes, self.max_chunk_bytes = max_head_bytes, max_chunk_bytes
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=self.max_head_bytes)
        except TimeoutError:
            raise HttpError(f"connecting to {self.host_header}: timed out") from None
        except OSError as e:
            raise HttpError(f"connecting to {self.host_header}: {e.strerror or e}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(reader, writer)

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(self.idle_s):
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn, keep: bool) -> None:
        if keep and len(self._idle) < self.max_idle and not conn.writer.is_closing():
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    async def request(self, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None,
                      timeout_s: float = 3600.0) -> Response:
        """Send the request and read the response head; the body is read from the Response."""
        head = [f"{method} {target} HTTP/1.1", f"Host: {self.host_header}", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in (headers or {}).items())]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        pooled = self._take_idle() if method == "GET" else None
        try:
            return await self._exchange(pooled or await self._connect(), data, method, timeout_s)
        except _Stale:
            return await self._exchange(await self._connect(), data, method, timeout_s)

    async def _exchange(self, conn: _Conn, data: bytes, method: str, timeout_s: float) -> Response:
        reused = conn.idle_since != 0.0
        try:
            async with asyncio.timeout(timeout_s):
                conn.writer.write(data)
                await conn.writer.drain()
                try:
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as e:
                    if reused and not e.partial:
                        raise _Stale() from None
                    raise
        except _Stale:
            conn.close()
            raise
        except TimeoutError:
            conn.close()
            raise HttpError(f"no answer from {self.host_header} within {timeout_s:g} s") from None
        except asyncio.LimitOverrunError:
            conn.close()
            raise HttpError(f"{self.host_header} sent a head over {self.max_head_bytes} bytes") from None
        except (OSError, asyncio.IncompleteReadError) as e:
            conn.close()
            if reused and isinstance(e, ConnectionError):
                raise _Stale() from None
            raise HttpError(f"{self.host_header}: {type(e).__name__}: {e}") from None
        return self._response(conn, raw, method, timeout_s)

    def _response(self, conn: _Conn, raw: bytes, method: str, timeout_s: float) -> Response:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            conn.close()
            raise HttpError(f"{self.host_header} answered a malformed status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            framing, left = "none", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            framing, left = "chunked", 0
        elif "content-length" in headers:
            n = headers["content-length"]
            if not n.isdigit():
                conn.close()
                raise HttpError(f"{self.host_header} sent Content-Length {n[:40]!r}")
            framing, left = ("length", int(n)) if int(n) else ("none", 0)
        else:
            framing, left = "close", 0
        return Response(status, headers, conn, self, framing, left, framing == "none", keep, timeout_s)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()


class _Stale(Exception):
    """A pooled connection the server had closed: the request never reached it."""
