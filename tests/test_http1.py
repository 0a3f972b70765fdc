"""gateway/p0/http1.py (P0's client to llama-server) and Upstream's limits, against scripted servers.

Each test runs a tiny asyncio server whose answers are written byte by byte, so the framing,
reuse and refusal rules are seen on the wire: how many connections were opened, what was read.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.p0.http1 import HttpError, Pool, TooLarge
from gateway.p0.upstream import Upstream, UpstreamTooLarge

pytestmark = pytest.mark.timeout(60)


class Scripted:
    """Answers each request with the next of `answers` (bytes, or a callable(writer) coroutine);
    `close_after` closes the connection after that answer. Counts connections and requests."""

    def __init__(self, answers: list, close_after: set[int] | None = None):
        self.answers = list(answers)
        self.close_after = close_after or set()
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(n)
                i = len(self.requests)
                self.requests.append(head + body)
                answer = self.answers[i]
                if callable(answer):
                    await answer(writer)
                else:
                    writer.write(answer)
                    await writer.drain()
                if i in self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def run(coro):
    return asyncio.run(coro)


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"status\":\"ok\"}"


def test_sized_answers_reuse_one_connection():
    async def main():
        async with Scripted([OK, OK, OK]) as s:
            pool = Pool("127.0.0.1", s.port)
            for _ in range(3):
                r = await pool.request("GET", "/health")
                assert (r.status_code, await r.read()) == (200, b'{"status":"ok"}')
            await pool.aclose()
            assert s.connections == 1
            assert s.requests[0].startswith(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:")

    run(main())


def test_chunked_bodies_are_dechunked_with_extensions_and_trailers():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n")

    async def main():
        async with Scripted([chunked, OK]) as s:
            pool = Pool("127.0.0.1", s.port)
            r = await pool.request("GET", "/x")
            assert await r.read() == b"hello world"
            r = await pool.request("GET", "/health")  # the same connection, read to its end
            assert await r.read() == b'{"status":"ok"}'
            assert s.connections == 1

    run(main())


def test_a_body_until_close_and_a_close_header_are_not_reused():
    until_close = b"HTTP/1.0 200 OK\r\n\r\nall of it"
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"

    async def main():
        async with Scripted([until_close, closing, OK], close_after={0}) as s:
            pool = Pool("127.0.0.1", s.port)
            assert await (await pool.request("GET", "/a")).read() == b"all of it"
            assert await (await pool.request("GET", "/b")).read() == b"ok"
            assert await (await pool.request("GET", "/c")).read() == b'{"status":"ok"}'
        return s.connections

    # three connections: the first ended with the close, the second said close
    assert run(main()) == 3


def test_a_pooled_connection_the_server_closed_is_retried_once_for_a_get():
    async def main():
        async with Scripted([OK, OK], close_after={0}) as s:
            pool = Pool("127.0.0.1", s.port)
            assert (await pool.request("GET", "/health")).status_code == 200
            await asyncio.sleep(0.05)  # the server has closed it by now
            r = await pool.request("GET", "/health")
            assert await r.read() == b'{"status":"ok"}'
            return s.connections

    assert run(main()) == 2


def test_a_post_always_gets_a_new_connection():
    async def main():
        async with Scripted([OK, OK, OK]) as s:
            pool = Pool("127.0.0.1", s.port)
            await (await pool.request("GET", "/health")).read()
            r = await pool.request("POST", "/v1/chat/completions", b'{"a":1}', {"Content-Type": "application/json"})
            await r.read()
            assert s.requests[1].endswith(b'\r\n\r\n{"a":1}') and b"Content-Length: 7\r\n" in s.requests[1]
            return s.connections

    assert run(main()) == 2


def test_a_chunk_announced_over_the_limit_is_refused_before_it_is_read():
    async def huge(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4000001\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # never sends it: a client that waited for it would time out the test

    async def main():
        async with Scripted([huge]) as s:
            pool = Pool("127.0.0.1", s.port, max_chunk_bytes=64 << 20)
            r = await pool.request("GET", "/x")
            with pytest.raises(TooLarge):
                await r.read()

    run(main())


def test_an_announced_body_over_the_limit_is_refused_before_it_is_read():
    async def announce(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 67108865\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(30)

    async def main():
        async with Scripted([announce]) as s:
            up = Upstream("127.0.0.1", s.port)
            with pytest.raises(UpstreamTooLarge, match="larger than 64 MiB"):
                await up.get("/health")
            await up.aclose()

    run(main())


def test_a_stream_line_over_the_limit_is_refused_as_it_grows():
    async def stream(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"8\r\ndata: a\n\r\n")
        for _ in range(20):
            writer.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    async def main():
        async with Scripted([stream]) as s:
            up = Upstream("127.0.0.1", s.port, max_body_bytes=8 << 10)
            seen = []
            with pytest.raises(UpstreamTooLarge, match="line larger than 8192 bytes"):
                async with up.post("/v1/chat/completions", b"{}") as r:
                    async for batch in up.lines(r):
                        seen += batch
            assert seen == [b"data: a\n"]

    run(main())


def test_garbage_heads_and_refused_connections_are_http_errors():
    async def main():
        async with Scripted([b"SPDY/9 hello\r\n\r\n"]) as s:
            with pytest.raises(HttpError, match="malformed status line"):
                await Pool("127.0.0.1", s.port).request("GET", "/")
        async with Scripted([b"HTTP/1.1 200 OK\r\nX: " + b"a" * (70 << 10) + b"\r\n\r\n"]) as s:
            with pytest.raises(HttpError, match="head over"):
                await Pool("127.0.0.1", s.port).request("GET", "/")
        port = s.port  # closed now
        with pytest.raises(HttpError, match="connecting to"):
            await Pool("127.0.0.1", port).request("GET", "/")

    run(main())
