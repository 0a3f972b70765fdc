"""The HTTP edge under attack: what a hostile client sends over loopback, and what it gets back.

Each test talks to a real gateway process (tests/gateway_fake_server.py: the real gate, loopback rules
and routes over the fake engine) over raw sockets, since a client library would refuse to send most of
these bytes. Each is bounded by its socket timeouts and the module's timeout.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import sys
import time

import pytest
from fake_engine import REPLY, REPLY_PIECES
from gateway_helpers import (
    HERE,
    FakeServer,
    _Server,
    connect,
    exchange,
    free_port,
    read_all,
    request_bytes,
    split_response,
    status_of,
    tiny_model,
)
from p0_helpers import Engine, Gateway, configure, wait_gone

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("edge"))
    s = FakeServer(model, fork)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow_limits(tmp_path_factory):
    """A server whose head deadline is 1 s, whose bodies must come at 1000 bytes/s after 0.5 s, and be
    in within 2 s."""
    model, fork = tiny_model(tmp_path_factory.mktemp("slow"))
    s = FakeServer(model, fork, limits={"head_timeout_s": 1.0, "body_grace_s": 0.5, "min_body_bytes_per_s": 1000,
                                        "body_timeout_s": 2.0})
    yield s
    s.stop()


def answer(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    return split_response(exchange(port, raw))


# --- item: lengths, targets and methods that used to drop the connection --------------------------


# "²" as one latin-1 byte is what str.isdigit() took and int() refused: the connection dropped unanswered
@pytest.mark.parametrize("length", [b"\xb2", "١٢".encode(), b"1" * 5000, b"0" * 20 + b"1", b"+1"])
def test_a_length_that_is_not_ascii_digits_or_has_too_many_is_400(server, length):
    raw = request_bytes("POST", "/tokenize", body=b"").replace(b"Content-Length: 0", b"Content-Length: " + length)
    status, headers, body = answer(server.port, raw)
    assert (status, body) == (400, b"bad Content-Length")
    assert headers["connection"] == "close" and headers["content-type"].startswith("text/plain")


def test_a_length_of_ascii_digits_still_passes(server):
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "hi"}')
    assert answer(server.port, raw)[:3:2] == (200, b'{"tokens": [104,105]}')


def test_connect_is_400_not_a_dropped_connection(server):
    status, headers, body = answer(server.port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (status, body) == (400, b"CONNECT is not supported: bankml serve is not a proxy")
    assert headers["connection"] == "close"


@pytest.mark.parametrize("target", [b"/health\x00", b"/he\x00alth", b"/\x01", b"/health\x7f"])
def test_a_control_byte_in_the_target_is_400(server, target):
    status, _, body = answer(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (status, body) == (400, b"malformed request target")


# httptools (Sanic's URL parser) refused each of these with a traceback in the log and no answer, or
# (`{`, `|`, `"`, `#`, a bad %-escape after a "/") took what RFC 3986 does not allow in a path or query
@pytest.mark.parametrize("target", [b"health", b"?", b"http://", b"a:b", b"%zz", b"{", b"*", b"/{", b"/a|b", b'/"',
                                    b"/caf\xe9", b"/a#b", b"/a%zz", b"/a?%4", b"http://a:b:c/", b"https://x/"])
def test_a_target_that_is_not_origin_form_is_400(server, target):
    status, headers, body = answer(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (status, body) == (400, b"malformed request target")
    assert headers["connection"] == "close"


@pytest.mark.parametrize("target", ["/health?x=1&y=%20z", "/health;a=b", "/health/~:@!$'()*+,=", "//health?a/?"])
def test_an_origin_form_target_with_what_rfc_3986_allows_reaches_the_routes(server, target):
    status, _, body = answer(server.port, request_bytes("GET", target))
    assert status in (200, 404) and not body.startswith(b"malformed")


def test_options_star_is_still_the_preflight_403(server):
    status, _, body = answer(server.port, b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (status, body) == (403, b"bankml serve: cross-origin requests are refused (no --allow-origin)")


def test_a_bare_cr_in_the_request_line_is_400(server):
    status, _, body = answer(server.port, b"GET /a\rb HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (status, body) == (400, b"malformed request head")  # a CR splits the line: four parts, not three


# --- item: Host, header values and Content-Type --------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1:evil.example", "localhost:80:81", "[::1]:x", "127.0.0.1:123456",
                                  "localhost:²"])
def test_a_loopback_name_with_a_port_that_is_not_digits_is_403(server, host):
    status, _, body = answer(server.port, request_bytes("GET", "/health", host=host))
    assert status == 403 and body.startswith(b"bankml serve answers loopback clients only")


def test_a_loopback_name_with_a_port_of_digits_or_none_passes(server):
    for host in ("127.0.0.1:1", "localhost", "[::1]:18093"):
        assert status_of(exchange(server.port, request_bytes("GET", "/health", host=host))) == 200, host


@pytest.mark.parametrize("second", ["127.0.0.1", "evil.example"])
def test_two_host_headers_are_400(server, second):
    raw = request_bytes("GET", "/health", headers={"Host": second})
    status, _, body = answer(server.port, raw)
    assert (status, body) == (400, b"more than one Host header")


@pytest.mark.parametrize("value", [b"a\rb", b"a\x00b", b"a\x01", b"\x7f"])
def test_a_control_byte_in_a_header_value_is_400(server, value):
    raw = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trace: " + value + b"\r\n\r\n"
    status, _, body = answer(server.port, raw)
    assert (status, body) == (400, b"control character in a header field")


# each passed as a header named "host" (or an X- header): a 200
@pytest.mark.parametrize("line", [b"Host : 127.0.0.1", b"Host\t: 127.0.0.1", b" Host: 127.0.0.1", b"Ho st: 127.0.0.1",
                                  b"X(a): b", b"X-Caf\xe9: b", b"X/a: b"])
def test_a_header_name_that_is_not_a_token_is_400(server, line):
    host = b"" if b"ost" in line else b"Host: 127.0.0.1\r\n"
    status, _, body = answer(server.port, b"GET /health HTTP/1.1\r\n" + host + line + b"\r\n\r\n")
    assert (status, body) == (400, b"malformed request head")


@pytest.mark.parametrize("pad", [b"\x85", b"\xa0"])
def test_only_spaces_and_tabs_are_trimmed_from_a_value(server, pad):
    # str.strip() took \x85 and \xa0 as whitespace: the Host passed as 127.0.0.1
    status, _, body = answer(server.port, b"GET /health HTTP/1.1\r\nHost: " + pad + b"127.0.0.1" + pad + b"\r\n\r\n")
    assert status == 403 and body.startswith(b"bankml serve answers loopback clients only")
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "a"}', content_type="application/json\xa0")
    assert answer(server.port, raw)[::2] == (415, b"POST bodies must be Content-Type: application/json")
    assert status_of(exchange(server.port, b"GET /health HTTP/1.1\r\nHost: \t 127.0.0.1 \t\r\n\r\n")) == 200


@pytest.mark.parametrize("second", ["text/plain", "application/json"])
def test_two_content_type_headers_are_400(server, second):
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "a"}', headers={"Content-Type": second})
    status, _, body = answer(server.port, raw)
    assert (status, body) == (400, b"more than one Content-Type header")


def test_a_tab_in_a_header_value_is_still_fine(server):
    raw = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trace: a\tb\r\n\r\n"
    assert status_of(exchange(server.port, raw)) == 200


@pytest.mark.parametrize("content_type", ["application/jsonx", "application/json-patch+json",
                                          "application/json5", "application/jsonl; charset=utf-8"])
def test_a_media_type_that_only_starts_with_application_json_is_415(server, content_type):
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "a"}', content_type=content_type)
    status, _, body = answer(server.port, raw)
    assert (status, body) == (415, b"POST bodies must be Content-Type: application/json")


@pytest.mark.parametrize("content_type", ["APPLICATION/JSON", "application/json;charset=utf-8",
                                          "application/json ; charset=utf-8"])
def test_application_json_with_parameters_passes(server, content_type):
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "a"}', content_type=content_type)
    assert status_of(exchange(server.port, raw)) == 200


# --- item: a client that half-closes mid-head ---------------------------------------------------


@pytest.mark.parametrize("sent", [b"GET /health HTTP/1.1\r\n", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_a_head_cut_short_by_a_half_close_is_answered_400(server, sent):
    with connect(server.port) as s:
        s.sendall(sent)
        s.shutdown(socket.SHUT_WR)
        status, headers, body = split_response(read_all(s))
    assert (status, body) == (400, b"incomplete request head")
    assert headers["connection"] == "close"


def test_a_connection_that_sends_nothing_and_half_closes_gets_nothing(server):
    with connect(server.port) as s:
        s.shutdown(socket.SHUT_WR)
        assert read_all(s) == b""
    assert status_of(exchange(server.port, request_bytes("GET", "/health"))) == 200


# --- item: HEAD /health ---------------------------------------------------------------------------


def test_head_health_is_gets_answer_without_the_body(server):
    get_status, get_headers, get_body = answer(server.port, request_bytes("GET", "/health"))
    status, headers, body = answer(server.port, request_bytes("HEAD", "/health"))
    assert (get_status, get_body) == (200, b'{"status": "ok"}')
    assert (status, body) == (200, b"")
    assert headers["content-type"] == get_headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(get_body))


# --- item: slowloris ------------------------------------------------------------------------------


def _dribble_until_answered(socks: list[socket.socket], piece: bytes, every_s: float, limit_s: float) -> dict:
    """Send `piece` on every socket each `every_s` until each has something to read; their answers."""
    answers: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + limit_s
    while len(answers) < len(socks) and time.monotonic() < deadline:
        for s in socks:
            if s not in answers:
                try:
                    s.sendall(piece)
                except OSError:
                    pass
        ready, _, _ = select.select([s for s in socks if s not in answers], [], [], every_s)
        for s in ready:
            answers[s] = read_all(s)
    return answers


def test_heads_sent_a_byte_at_a_time_get_408_and_free_every_slot(slow_limits):
    # 32 connections, each trickling a header line a byte every 0.1 s (never silent, so the read
    # timeout never fires): each is answered 408 once its head deadline passes, and the server serves
    # again. Before, they held all 32 slots for as long as they kept sending.
    socks = [connect(slow_limits.port, timeout_s=10) for _ in range(32)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        answers = _dribble_until_answered(socks, b"a", every_s=0.1, limit_s=30)
        assert len(answers) == 32
        for raw in answers.values():
            status, headers, body = split_response(raw)
            assert (status, body) == (408, b"request head not complete within 1 s")
            assert headers["connection"] == "close" and headers["content-type"].startswith("text/plain")
    finally:
        for s in socks:
            s.close()
    assert status_of(exchange(slow_limits.port, request_bytes("GET", "/health"))) == 200


def test_a_body_slower_than_the_minimum_rate_gets_408(slow_limits):
    raw = request_bytes("POST", "/tokenize", body=b"").replace(b"Content-Length: 0", b"Content-Length: 100000")
    with connect(slow_limits.port, timeout_s=10) as s:
        s.sendall(raw + b'{"content": "')
        answers = _dribble_until_answered([s], b"a" * 10, every_s=0.1, limit_s=30)  # 100 bytes/s
    status, headers, body = split_response(answers[s])
    assert (status, body) == (408, b"request body slower than 1000 bytes/s")
    assert headers["connection"] == "close"


def test_a_body_at_the_minimum_rate_but_not_in_by_the_body_deadline_gets_408(slow_limits):
    # 5000 bytes/s, five times the minimum: the 100 kB body would take 20 s, past the 2 s deadline.
    # Before, only the rate counted: 16 MiB at 1.1 KiB/s held a slot for about 4 hours.
    raw = request_bytes("POST", "/tokenize", body=b"").replace(b"Content-Length: 0", b"Content-Length: 100000")
    with connect(slow_limits.port, timeout_s=10) as s:
        s.sendall(raw + b'{"content": "')
        start = time.monotonic()
        answers = _dribble_until_answered([s], b"a" * 500, every_s=0.1, limit_s=10)
    assert s in answers and 1.5 < time.monotonic() - start < 5
    status, headers, body = split_response(answers[s])
    assert (status, body) == (408, b"request body not complete within 2 s")
    assert headers["connection"] == "close"


def test_a_body_at_a_decent_rate_is_taken_on_a_server_with_a_minimum(slow_limits):
    # 4000 bytes in pieces of 1000 every 0.2 s (5000 bytes/s): past the grace, never under the rate
    text = "a" * 4000
    body = json.dumps({"content": text}).encode()
    raw = request_bytes("POST", "/tokenize", body=body)
    head, rest = raw[:len(raw) - len(body)], body
    with connect(slow_limits.port, timeout_s=10) as s:
        s.sendall(head)
        for i in range(0, len(rest), 1000):
            s.sendall(rest[i:i + 1000])
            time.sleep(0.2)
        status, _, answer_body = split_response(read_all(s))
    assert status == 200 and json.loads(answer_body)["tokens"] == [97] * 4000


# --- item: SIGTERM and SIGINT ---------------------------------------------------------------------


class ConfiguredServer(_Server):
    """The fake-engine gateway with a [serve] table of its own (--config FILE) and slow steps."""

    def __init__(self, model, fork, config: str, step_ms: float, directory):
        path = directory / "edge.toml"
        path.write_text(config)
        super().__init__([sys.executable, str(HERE / "gateway_fake_server.py"), str(model), "--fork", str(fork),
                          "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:0", "--step-ms", str(step_ms),
                          "--config", str(path)], 60)

    def exit_code(self, timeout_s: float = 30) -> int:
        return self.proc.wait(timeout_s)


def chat(stream: bool, content: str = "hello") -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "stream": stream}).encode()
    return request_bytes("POST", "/v1/chat/completions", body=body)


def dechunk(body: bytes) -> bytes:
    """A chunked body's data (Sanic frames streams so); what follows a cut is dropped."""
    out, rest = bytearray(), body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return bytes(out) + b"<end>"
        out += rest[:size]
        rest = rest[size + 2:]
    return bytes(out)


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def wait_refused(port: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if refused(port):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_lets_answers_in_flight_finish_and_refuses_new_connections(tmp_path, sig):
    model, fork = tiny_model(tmp_path)
    # 9 pieces of 300 ms each: about 2.7 s per answer, well inside a 30 s grace
    g = ConfiguredServer(model, fork, "[serve]\nshutdown_grace_s = 30.0\n", step_ms=300, directory=tmp_path)
    try:
        stream, plain = connect(g.port, timeout_s=20), connect(g.port, timeout_s=20)
        stream.sendall(chat(True))
        first = stream.recv(65536)  # the stream has begun: its head and first piece are out
        assert status_of(first) == 200
        plain.sendall(chat(False))
        g.proc.send_signal(sig)
        assert wait_refused(g.port) and refused(g.upstream_port)  # both addresses stop listening
        streamed = first + read_all(stream)
        status, _, body = split_response(streamed)
        events = dechunk(body)
        assert status == 200 and events.endswith(b"data: [DONE]\n\n<end>"), streamed[-400:]
        assert b'"error"' not in events and events.count(b'"delta": {"content": ') == len(REPLY_PIECES)
        status, _, body = split_response(read_all(plain))
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == REPLY
        assert g.exit_code() == 0
    finally:
        stream.close()
        plain.close()
        g.stop()


def test_answers_still_running_when_the_grace_ends_get_an_error_event_or_a_503(tmp_path):
    model, fork = tiny_model(tmp_path)
    # LONG is 5000 pieces of 20 ms (100 s): far past a 1 s grace
    g = ConfiguredServer(model, fork, "[serve]\nshutdown_grace_s = 1.0\n", step_ms=20, directory=tmp_path)
    try:
        stream, plain = connect(g.port, timeout_s=20), connect(g.port, timeout_s=20)
        stream.sendall(chat(True, "LONG"))
        first = stream.recv(65536)
        assert status_of(first) == 200
        plain.sendall(chat(False, "LONG"))
        time.sleep(0.2)  # the plain request is read and waits for the engine (one slot, taken)
        g.proc.send_signal(signal.SIGTERM)
        streamed = first + read_all(stream)
        status, headers, body = split_response(streamed)
        events = dechunk(body)
        assert status == 200 and events.endswith(b"\n\n<end>"), streamed[-400:]  # a whole stream, ended
        last = events.removesuffix(b"<end>").rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b"data: ")
        error = json.loads(last[len(b"data: "):])["error"]
        assert error["code"] == 503 and error["message"].startswith("bankml serve is shutting down")
        status, _, body = split_response(read_all(plain))
        assert (status, body) == (503, b"bankml serve is shutting down")
        assert g.exit_code() == 0
        assert "aborted" in g.log()  # the engine stopped generating for them
    finally:
        stream.close()
        plain.close()
        g.stop()


# --- P0: the same edge in front of llama-server (the mock) ----------------------------------------


def test_p0_head_health_and_a_stop_signal_that_lets_the_stream_in_flight_finish(tmp_path):
    model, fork = tiny_model(tmp_path / "models")
    engine = Engine(tmp_path / "engine")
    up = free_port()
    config = tmp_path / "p0.toml"
    config.write_text("[serve]\nshutdown_grace_s = 30.0\n")
    g = Gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{up}", "--config", str(config))
    try:
        assert g.ready, g.log()
        status, headers, body = answer(g.port, request_bytes("HEAD", "/health"))
        assert (status, body) == (200, b"") and headers["content-length"] == str(len(b'{"status":"ok"}'))
        configure(up, stream_delay_ms=700)  # two pieces: about 1.4 s
        with connect(g.port, timeout_s=20) as s:
            s.sendall(chat(True))
            first = s.recv(65536)
            assert status_of(first) == 200
            g.proc.send_signal(signal.SIGTERM)
            assert wait_refused(g.port)
            events = dechunk(split_response(first + read_all(s))[2])
        assert events.endswith(b"data: [DONE]\n\n<end>") and b'"bankml_receipt"' in events, events[-300:]
        assert g.exit_code() == 128 + signal.SIGTERM
        assert wait_gone(engine.recorded()["pid"])  # llama-server does not outlive the gateway
    finally:
        g.stop()
