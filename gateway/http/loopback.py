"""The loopback rules (README, "Serving": every limit and message), enforced before Sanic parses anything.

The checks run in the Rust bankml's order (its serve.rs); the first that fails answers:
1. while the head is read: a line over 16 KiB, over 100 header lines, a head cut by a half-close; then
   the request line and header syntax (origin- or absolute-form target, RFC 9112 §3.2; token names,
   RFC 9110 §5.1; no control byte; no CONNECT) -> 400;
2. two Host headers -> 400 (RFC 9112 §3.2); a Host that is not loopback -> 403;
3. the Origin rule and preflights (access.py) -> 204 or 403;
4. any Transfer-Encoding -> 400 ("send Content-Length");
5. a Content-Length that is not 1-19 ASCII digits -> 400, over 16 MiB -> 413;
6. two Content-Types -> 400, a POST with a body that is not application/json -> 415;
7. over 32 open connections on a listener -> 503, decided at accept;
8. API keys (access.py) -> 401, before the body is read.
A refusal is written at once, then the client's bytes are drained (200 ms at most) before the close, so
it reads the answer, not a reset. The head and body deadlines ([limits]) exist because a client that
trickles a byte now and then is never silent. On shutdown a head still coming in gets 503 (shutdown.py).

Why not Sanic's limits: its head cap is on the whole head, not a line, and answers 413 where the Rust
bankml answers 400; it takes chunked bodies, has no connection limit nor write timeout, and checks in
another order. They stay on behind ours as a second line. A head that passes reaches Sanic re-serialized
with CRLF endings (Sanic's parser needs them; a bare LF is accepted here, as by the Rust bankml).
The pure parts (`HeadReader`, `check_head`, `loopback_host`, `plain_response`) and `make_protocol` hold
no Sanic state, so P0 reuses them unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, replace
from time import monotonic
from typing import Any

from sanic.exceptions import ServiceUnavailable
from sanic.http import Http, Stage
from sanic.models.server_types import ConnInfo
from sanic.server.protocols.http_protocol import HttpProtocol

from bankml.config import LimitsConfig
from gateway.http.errors import Api, anthropic_error, api_of, sse_error_event
from gateway.http.shutdown import SHUTTING_DOWN, Shutdown

log = logging.getLogger("bankml.gateway")

HOST_REFUSED = "bankml serve answers loopback clients only (Host must be 127.0.0.1, localhost or [::1])"
CHUNKED_REFUSED = "chunked requests are not accepted; send Content-Length"
TOO_LARGE = "request too large"
NOT_JSON = "POST bodies must be Content-Type: application/json"
LINE_TOO_LONG = "request line too long"
HEAD_TOO_LARGE = "request head too large"
BAD_HEAD = "malformed request head"
PREFLIGHT_REFUSED = "bankml serve: cross-origin requests are refused (no --allow-origin)"  # without an Access
TOO_MANY = "bankml serve: too many connections"
BAD_TARGET = "malformed request target"
CONNECT_REFUSED = "CONNECT is not supported: bankml serve is not a proxy"
BAD_FIELD = "control character in a header field"
TWO_HOSTS = "more than one Host header"
BAD_LENGTH = "bad Content-Length"
TWO_TYPES = "more than one Content-Type header"
INCOMPLETE_HEAD = "incomplete request head"

QUIET_MS = 50  # a drain with no announced length stops after this long without a byte


Limits = LimitsConfig  # the [limits] table is the loopback rules


@dataclass(frozen=True)
class Refusal:
    """An answer the protocol writes itself, then drains and closes (a preflight's 204 is one too)."""

    status: int
    text: str
    drain_bytes: int | None = None  # the body still to come, if announced; None: drain until quiet
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Head:
    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]  # (lower-cased name, trimmed value), in order
    body_start: bytes  # whatever followed the blank line in the same reads

    def header(self, name: str) -> str | None:
        """The first value of `name` (lower case), as the Rust bankml looks headers up."""
        return next((v for k, v in self.headers if k == name), None)

    def serialized(self) -> bytes:
        lines = [f"{self.method} {self.target} {self.version}", *(f"{k}: {v}" for k, v in self.headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body_start


class HeadReader:
    """Reads an HTTP/1 head incrementally, one bounded line at a time.

    `feed(data)` returns None while the head is incomplete, a `Refusal` as soon as a line or the line
    count is over its limit (without waiting for the rest), or the `Head` once the blank line arrives.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self._buf = bytearray()
        self._pos = 0  # start of the line being read
        self._lines: list[bytes] = []

    @property
    def started(self) -> bool:
        """Whether any byte of a head has come in."""
        return bool(self._buf)

    def feed(self, data: bytes) -> Head | Refusal | None:
        self._buf += data
        max_line = self.limits.max_line_bytes
        while True:
            nl = self._buf.find(b"\n", self._pos, self._pos + max_line)
            if nl == -1:
                if len(self._buf) - self._pos >= max_line:  # its first 16 KiB hold no line end
                    return Refusal(400, LINE_TOO_LONG if not self._lines else HEAD_TOO_LARGE)
                return None
            line = bytes(self._buf[self._pos:nl])
            self._pos = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if not self._lines:
                    return Refusal(400, BAD_HEAD)  # a head that starts with a blank line
                return _parse_head(self._lines, bytes(self._buf[self._pos:]))
            if len(self._lines) > self.limits.max_header_lines:  # the request line plus 100 headers
                return Refusal(400, HEAD_TOO_LARGE)
            self._lines.append(line)


# A control byte (HTAB aside) has no place in a request or header line (RFC 9112 §3, RFC 9110 §5.5); a
# NUL or a bare CR passed on could split a line differently downstream than here.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_ASCII_DIGITS = re.compile(r"[0-9]+")
MAX_LENGTH_DIGITS = 19  # any length this server takes has far fewer; more is no number int() should see
# RFC 9110 §5.1: a field name is a token
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9112 §3.2.1 origin-form: absolute-path [ "?" query ], with RFC 3986's pchar. httptools (Sanic's URL
# parser) drops the connection with a traceback on a target that starts otherwise, or on a control or
# non-ASCII byte after the "/"; what it takes beyond RFC 3986 (`{`, `|`, `"`, `#`, a bad %-escape) is
# refused here too, so only this grammar reaches Sanic.
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_ORIGIN_FORM = rf"/(?:{_PCHAR}|/)*(?:\?(?:{_PCHAR}|[/?])*)?"
# absolute-form with an authority httptools takes (a name or an IP literal, an optional port of digits)
_TARGET = re.compile(rf"(?:http://(?:[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?)?{_ORIGIN_FORM}",
                     re.IGNORECASE)
_JSON_TYPE = re.compile(r"application/json[ \t]*(;.*)?", re.IGNORECASE | re.DOTALL)


def _parse_head(lines: list[bytes], body_start: bytes) -> Head | Refusal:
    # latin-1 keeps every byte as one character, so nothing is lost before Sanic sees it
    line = lines[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        return Refusal(400, BAD_HEAD)
    if _CONTROL.search(parts[1]):
        return Refusal(400, BAD_TARGET)
    if _CONTROL.search(line):
        return Refusal(400, BAD_HEAD)
    if parts[0] == "CONNECT":  # a tunnel to host:port; nothing here routes it
        return Refusal(400, CONNECT_REFUSED)
    # OPTIONS * (asterisk-form) is well formed: it goes on to its 403
    if not _TARGET.fullmatch(parts[1]) and not (parts[0] == "OPTIONS" and parts[1] == "*"):
        return Refusal(400, BAD_TARGET)
    headers = []
    for raw in lines[1:]:
        text = raw.decode("latin-1")
        if _CONTROL.search(text):
            return Refusal(400, BAD_FIELD)
        name, sep, value = text.partition(":")
        if not sep or not _TOKEN.fullmatch(name):  # `Host : x` and a folded ` Host: x` included
            return Refusal(400, BAD_HEAD)
        # only SP and HTAB are optional whitespace (RFC 9110 §5.6.3); str.strip() also takes \x85, \xa0
        headers.append((name.lower(), value.strip(" \t")))
    return Head(parts[0], parts[1], parts[2], tuple(headers), body_start)


def loopback_host(value: str) -> bool:
    """127.0.0.1, localhost or [::1], with or without a port of ASCII digits; anything else (an empty
    one too, or `127.0.0.1:evil.example`) is not."""
    h = value.strip(" \t").lower()
    if h.startswith("["):
        host, _, rest = h.partition("]")
        return host == "[::1" and (rest == "" or (rest.startswith(":") and _port(rest[1:])))
    host, sep, port = h.partition(":")
    return host in ("127.0.0.1", "localhost") and (not sep or _port(port))


def _port(text: str) -> bool:
    # RFC 3986's port = *DIGIT (an empty one included), and no port has more than 5
    return len(text) <= 5 and (text == "" or _ASCII_DIGITS.fullmatch(text) is not None)


def content_length(head: Head) -> int | Refusal:
    values = {v for k, v in head.headers if k == "content-length"}
    if not values:
        return 0
    value = next(iter(values))
    # str.isdigit() takes "²" and int() takes "١٢"; only ASCII digits are a length, and only so many
    if len(values) > 1 or len(value) > MAX_LENGTH_DIGITS or not _ASCII_DIGITS.fullmatch(value):
        return Refusal(400, BAD_LENGTH)
    return int(value)


def check_head(head: Head, limits: Limits, access: Any = None, port: int = 0) -> Refusal | None:
    """Rules 2-6 and 8 on a complete head, that came in at `port`; None when the request may go on.
    `access` (access.Access) holds the origin and key rules; without one, every OPTIONS is 403."""
    refusal = _check_head(head, limits, access, port)
    if refusal is not None and refusal.status != 204 and refusal.content_type.startswith("text/plain") \
            and api_of(head.target.partition("?")[0]) is Api.ANTHROPIC:  # its SDK reads JSON errors only
        refusal = replace(refusal, text=anthropic_error(refusal.status, refusal.text),
                          content_type="application/json; charset=utf-8")
    if refusal is not None and refusal.drain_bytes is None:
        n = content_length(head)
        if not isinstance(n, Refusal):
            refusal = replace(refusal, drain_bytes=min(n, limits.max_body_bytes))
    return refusal


def _check_head(head: Head, limits: Limits, access: Any, port: int) -> Refusal | None:
    n = content_length(head)
    drain = None if isinstance(n, Refusal) else min(n, limits.max_body_bytes)
    if sum(k == "host" for k, _ in head.headers) > 1:  # RFC 9112 §3.2: a 400, whichever is first
        return Refusal(400, TWO_HOSTS, drain)
    if not loopback_host(head.header("host") or ""):
        return Refusal(403, HOST_REFUSED, drain)
    if access is None:
        if head.method == "OPTIONS":
            return Refusal(403, PREFLIGHT_REFUSED, drain)
    else:
        refusal = access.origin_refusal(head, port)
        if refusal is not None:
            return refusal
    if head.header("transfer-encoding") is not None:
        return Refusal(400, CHUNKED_REFUSED, drain)
    if isinstance(n, Refusal):
        return n
    if n > limits.max_body_bytes:
        return Refusal(413, TOO_LARGE, drain)
    if sum(k == "content-type" for k, _ in head.headers) > 1:  # which one would the handler believe?
        return Refusal(400, TWO_TYPES, drain)
    # a POST with no body has no media type to refuse (POST /slots/{id}?action=erase takes none)
    if head.method == "POST" and n and not _JSON_TYPE.fullmatch(head.header("content-type") or ""):
        return Refusal(415, NOT_JSON, drain)
    return access.key_refusal(head) if access is not None else None


_REASONS = {204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            408: "Request Timeout", 413: "Payload Too Large", 415: "Unsupported Media Type",
            503: "Service Unavailable"}


def plain_response(status: int, text: str) -> bytes:
    return refusal_response(Refusal(status, text))


def refusal_response(refusal: Refusal) -> bytes:
    """The bytes of a refusal; a 204 has no body and says no length (RFC 9110 §8.6)."""
    lines = [f"HTTP/1.1 {refusal.status} {_REASONS.get(refusal.status, 'Error')}"]
    body = refusal.text.encode("utf-8")
    if refusal.status != 204:
        lines += [f"Content-Type: {refusal.content_type}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in refusal.headers] + ["Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _LoopbackHttp(Http):
    # Sanic caps a head at 16 KiB in all (Http.HEADER_CEILING); ours is bounded per line and by line
    # count before it gets here, so Sanic's cap is raised to that bound.
    HEADER_MAX_SIZE = Limits().max_head_bytes


class LoopbackProtocol(HttpProtocol):
    """Sanic's HTTP/1 protocol behind the loopback rules; `make_protocol` binds it to limits.

    A connection starts in "head" mode: bytes go to a `HeadReader`, not to Sanic, and Sanic's
    connection task is not started. A head that passes switches it to "pass" mode (Sanic from then
    on); a refusal to "drain" mode; a connection over the limit starts in "over" mode.
    """

    limits: Limits = Limits()
    access: Any = None  # access.Access: the origin and API key rules (None: OPTIONS refused, nothing else)
    cors_origin: str | None = None  # a listed Origin this connection's answer echoes (sanic_app.py)
    _live: list[int] = [0]  # open connections on this listener (one class per listener)
    shutdown: Shutdown = Shutdown()  # shared by the listeners of one server
    HTTP_CLASS = _LoopbackHttp

    def connection_made(self, transport):
        transport.set_write_buffer_limits(low=16384, high=65536)
        self.transport = transport
        self.recv_buffer = bytearray()
        self.conn_info = ConnInfo(transport, unix=self._unix)
        self._mode = "head"
        self._counted = False
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._drain_left: int | None = None
        self._body_left = 0
        self._drain_event = asyncio.Event()
        self._closed = False
        self._last_rx = monotonic()
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._body_got = 0  # body bytes in so far, and since when (the minimum rate's clock)
        self._body_since = 0.0
        if self._live[0] >= self.limits.max_connections:
            self._mode = "over"
            self._drain_task = self.loop.create_task(self._answer_over_limit())
            return
        self._live[0] += 1
        self._counted = True
        self._head = HeadReader(self.limits)
        self._arm_read_timer()
        # the read timer only measures silence: a head sent a byte a second would hold a slot for ever
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
        self.shutdown.add(self)

    # --- reading -------------------------------------------------------------------------------

    def data_received(self, data: bytes):
        if self._mode == "pass":
            if self._body_left > 0:
                self._body_left -= len(data)
                self._body_got += len(data)
                self._last_rx = monotonic()
                if self._body_left <= 0:
                    self._cancel_read_timer()
                    self._cancel_body_timer()
            return super().data_received(data)
        self._last_rx = monotonic()
        self._time = self._last_rx
        if self._mode != "head":  # over or drain: read and discard
            if self._drain_left is not None:
                self._drain_left -= len(data)
            self._drain_event.set()
            return
        result = self._head.feed(data)
        if result is None:
            return
        if isinstance(result, Refusal):
            return self._refuse(result)
        refusal = check_head(result, self.limits, self.access, self._local_port())
        if refusal is not None:
            if refusal.drain_bytes is not None:
                refusal = replace(refusal, drain_bytes=refusal.drain_bytes - len(result.body_start))
            return self._refuse(refusal)
        if self.access is not None:
            self.cors_origin = self.access.listed(result)
        self._pass(result)

    def _local_port(self) -> int:
        sockname = self.transport.get_extra_info("sockname") if self.transport is not None else None
        return int(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else 0

    def _pass(self, head: Head) -> None:
        """Hand the connection to Sanic: start its connection task and give it the normalized head."""
        self._mode = "pass"
        self._head = None
        # Sanic reads the body in its handler stage, where only its whole-response timeout applies; the
        # read timeout stays ours until the announced body is in
        n = content_length(head)
        self._body_left = (n if isinstance(n, int) else 0) - len(head.body_start)
        self._cancel_head_timer()
        if self._body_left <= 0:
            self._cancel_read_timer()
        else:
            self._body_since, self._body_got = monotonic(), len(head.body_start)
            # the rate alone lets a body of 16 MiB at 1 KiB/s hold a slot for hours
            self._body_deadline = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            if self.limits.min_body_bytes_per_s > 0:  # 0: no minimum rate
                self._body_timer = self.loop.call_later(self.limits.body_grace_s, self._body_rate_check)
        self.connections.add(self)
        self._task = self.loop.create_task(self.connection_task())
        super().data_received(head.serialized())

    def eof_received(self):
        if self._mode == "head" and self._head.started:  # half-closed mid-head: it can still read an answer
            self._refuse(Refusal(400, INCOMPLETE_HEAD))
        if self._mode in ("over", "drain"):
            self._closed = True
            self._drain_event.set()
        return None  # close our side too: in "pass" mode Sanic then cancels the request

    def connection_lost(self, exc):
        self._closed = True
        self._cancel_read_timer()
        self._cancel_head_timer()
        self._cancel_body_timer()
        self.shutdown.discard(self)
        if self._write_timer is not None:
            self._write_timer.cancel()
        if self._counted:
            self._counted = False
            self._live[0] -= 1
        self._drain_event.set()
        super().connection_lost(exc)

    # --- refusals ------------------------------------------------------------------------------

    def _refuse(self, refusal: Refusal) -> None:
        self._mode = "drain"
        self._cancel_read_timer()
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._head = None
        if refusal.status != 204:  # a key is never in what is logged: the 401's text is its JSON body
            log.info("refused %d: %s", refusal.status, refusal.text)
        self._drain_left = refusal.drain_bytes
        self.transport.write(refusal_response(refusal))
        self._drain_task = self.loop.create_task(self._drain_then_close())

    async def _drain(self) -> None:
        """Discard what the client sends for at most drain_ms: its announced body, or until it pauses."""
        deadline = monotonic() + self.limits.drain_ms / 1e3
        while not self._closed and (self._drain_left is None or self._drain_left > 0):
            left = deadline - monotonic()
            if left <= 0:
                return
            self._drain_event.clear()
            wait = left if self._drain_left is not None else min(left, QUIET_MS / 1e3)
            try:
                await asyncio.wait_for(self._drain_event.wait(), wait)
            except TimeoutError:
                return

    async def _drain_then_close(self) -> None:
        await self._drain()
        self._close_transport()

    async def _answer_over_limit(self) -> None:
        # off the accept path, and never more than drain_ms: a slow client cannot hold anyone else up
        self.transport.write(plain_response(503, TOO_MANY))
        await self._drain()
        self._close_transport()

    def _close_transport(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # --- shutdown ------------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        return self._mode == "pass"

    def refuse_head(self) -> None:
        """The server stops: a request still coming in is not taken."""
        if self._mode == "head":
            self._refuse(Refusal(503, SHUTTING_DOWN))

    def end_for_shutdown(self) -> None:
        """The grace period is over and this answer still runs: end it as well as its state allows."""
        http, task = getattr(self, "_http", None), getattr(self, "_task", None)
        if self._mode != "pass" or http is None or task is None:
            return self._close_transport()  # a refusal being drained: answered already
        if http.stage is Stage.HANDLER:  # nothing written yet: Sanic answers the exception (a 503)
            http.exception = ServiceUnavailable(SHUTTING_DOWN)
            task.cancel()
            return
        response = http.response
        stream = http.stage is Stage.RESPONSE and "text/event-stream" in (getattr(response, "content_type", "") or "")
        if not stream:
            self.transport.abort()  # a plain answer half written cannot be ended well
            return
        # every send of the handler went to the transport whole, so the stream stands at an event's end:
        # stop the handler, then end the body with the error event, in Sanic's chunked framing if it used it
        task.cancel()
        path = getattr(getattr(http, "request", None), "path", "") or ""
        event = sse_error_event(503, SHUTTING_DOWN + "; the answer was cut short", api_of(path))
        chunked = http.response_func == http.http1_response_chunked
        self.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event) if chunked else event)
        self._close_transport()

    # --- timeouts ------------------------------------------------------------------------------

    def _arm_read_timer(self) -> None:
        due = self._last_rx + self.limits.read_timeout_s
        self._timer = self.loop.call_later(max(0.0, due - monotonic()), self._read_timer_fired)

    def _cancel_read_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _read_timer_fired(self) -> None:
        self._timer = None
        if self._mode not in ("head", "pass") or (self._mode == "pass" and self._body_left <= 0):
            return
        if monotonic() - self._last_rx < self.limits.read_timeout_s:
            return self._arm_read_timer()
        log.info("read timeout: nothing from the client for %.0f s; closing", self.limits.read_timeout_s)
        self.transport.abort()  # in "pass" mode connection_lost follows, and Sanic cancels the request

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._mode == "head":
            self._refuse(Refusal(408, f"request head not complete within {self.limits.head_timeout_s:g} s"))

    def _body_rate_check(self) -> None:
        """After body_grace_s, the body must have come at min_body_bytes_per_s on average: each byte
        buys 1/rate s more (the rule of Apache httpd's modules/filters/mod_reqtimeout.c, MinRate)."""
        self._body_timer = None
        if self._mode != "pass" or self._body_left <= 0:
            return
        rate = self.limits.min_body_bytes_per_s
        due = self._body_since + self.limits.body_grace_s + self._body_got / rate
        if monotonic() < due:
            self._body_timer = self.loop.call_later(due - monotonic(), self._body_rate_check)
            return
        # Sanic is still waiting for the body, and nothing has been written: the answer is ours, and the
        # rest of the body is drained, not passed on; Sanic's request task ends when the socket closes
        self._refuse(Refusal(408, f"request body slower than {rate} bytes/s", self._body_left))

    def _body_timed_out(self) -> None:
        self._body_deadline = None
        if self._mode == "pass" and self._body_left > 0:  # as in _body_rate_check: the answer is ours
            self._refuse(Refusal(408, f"request body not complete within {self.limits.body_timeout_s:g} s",
                                 self._body_left))

    def pause_writing(self):
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self):
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        log.info("write timeout: the client read nothing for %.0f s; closing", self.limits.write_timeout_s)
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows, and Sanic cancels the request


def make_protocol(limits: Limits, shutdown: Shutdown | None = None, access: Any = None) -> type[LoopbackProtocol]:
    """A protocol class for one listener: these limits, its own connection count, the server's
    shutdown (one for all its listeners) and its origin and key rules (access.Access)."""
    http_class = type("LoopbackHttp", (_LoopbackHttp,), {"HEADER_MAX_SIZE": limits.max_head_bytes})
    return type("LoopbackProtocol", (LoopbackProtocol,), {"limits": limits, "_live": [0],
                                                          "shutdown": shutdown or Shutdown(),
                                                          "HTTP_CLASS": http_class, "access": access})
