"""The loopback rules (the README's list), each over a raw socket against a running gateway.

The gateway here runs over the fake engine (tests/fake_engine.py): the rules sit in front of
everything, so the engine does not matter, and these tests stay fast.
"""

from __future__ import annotations

import socket
import time

import pytest
from gateway_helpers import (
    FakeServer,
    connect,
    exchange,
    read_all,
    request_bytes,
    split_response,
    status_of,
    tiny_model,
)

from gateway.http.loopback import (
    CHUNKED_REFUSED,
    Head,
    HeadReader,
    Limits,
    Refusal,
    check_head,
    loopback_host,
)

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
KIB = 1 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("loopback"))
    s = FakeServer(model, fork)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A server with 1 s read and write timeouts."""
    model, fork = tiny_model(tmp_path_factory.mktemp("quick"))
    s = FakeServer(model, fork, limits={"read_timeout_s": 1.0, "write_timeout_s": 1.0}, step_ms=1)
    yield s
    s.stop()


# --- the pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:18093", "localhost:18093", "LOCALHOST", "[::1]:18093",
                                  "[::1]", " localhost "])
def test_loopback_hosts_pass(host):
    assert loopback_host(host)


@pytest.mark.parametrize("host", ["", "evil.example", "evil.example:18093", "127.0.0.1.evil.example",
                                  "10.0.0.153:18093", "[::2]:1", "localhost.evil", "[::1]evil"])
def test_other_hosts_do_not(host):
    assert not loopback_host(host)


def _feed_all(data: bytes) -> Head | Refusal | None:
    return HeadReader(Limits()).feed(data)


def test_head_reader_reads_a_head_given_byte_by_byte():
    raw = b"POST /x HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}"
    reader = HeadReader(Limits())
    results = [reader.feed(raw[i:i + 1]) for i in range(len(raw) - 2)]
    head = results[-1]
    assert all(r is None for r in results[:-1])
    assert isinstance(head, Head) and head.method == "POST" and head.header("host") == "localhost"
    assert head.serialized().startswith(b"POST /x HTTP/1.1\r\nhost: localhost\r\ncontent-length: 2\r\n\r\n")


def test_bare_lf_heads_are_read_and_passed_on_with_crlf():
    head = _feed_all(b"GET /health HTTP/1.1\nHost: 127.0.0.1\n\n")
    assert isinstance(head, Head) and head.serialized() == b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


def test_a_line_is_refused_as_soon_as_its_first_16_kib_hold_no_end():
    # no need to wait for the rest: the refusal comes with byte 16384
    assert _feed_all(b"G" * (16 * KIB - 1)) is None
    assert _feed_all(b"G" * (16 * KIB)) == Refusal(400, "request line too long")


def test_check_order_host_before_chunked_before_size_before_type():
    limits = Limits()

    def head(*headers: str, method: str = "POST") -> Head:
        raw = f"{method} / HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
        return _feed_all(raw.encode())

    assert check_head(head("Host: evil", "Transfer-Encoding: chunked"), limits).status == 403
    assert check_head(head("Host: localhost", "Transfer-Encoding: chunked", "Content-Length: 99999999999"),
                      limits).status == 400
    assert check_head(head("Host: localhost", f"Content-Length: {16 * MIB + 1}"), limits).status == 413
    assert check_head(head("Host: localhost", "Content-Length: 3"), limits).status == 415
    assert check_head(head("Host: localhost", "Content-Type: application/json", "Content-Length: 3"), limits) is None
    assert check_head(head("Host: localhost", method="GET"), limits) is None


# --- over the wire -------------------------------------------------------------------------------


def test_every_answer_says_connection_close(server):
    for raw in (request_bytes("GET", "/health"), request_bytes("GET", "/nope"),
                request_bytes("GET", "/health", host="evil.example")):
        status, headers, _ = split_response(exchange(server.port, raw))
        assert status in (200, 403, 404)
        assert headers["connection"] == "close"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:18093", "127.0.0.1.evil.example", "10.1.2.3"])
def test_a_foreign_host_is_403(server, host):
    status, headers, body = split_response(exchange(server.port, request_bytes("GET", "/health", host=host)))
    assert status == 403 and body.startswith(b"bankml serve answers loopback clients only")
    assert headers["content-type"].startswith("text/plain")


def test_a_missing_host_is_403(server):
    assert status_of(exchange(server.port, b"GET /health HTTP/1.1\r\n\r\n")) == 403


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:9", "[::1]:18093"])
def test_loopback_hosts_are_answered(server, host):
    assert status_of(exchange(server.port, request_bytes("GET", "/health", host=host))) == 200


def test_transfer_encoding_is_400_send_content_length(server):
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    status, _, body = split_response(exchange(server.port, raw))
    assert status == 400 and body.decode() == CHUNKED_REFUSED


def test_a_body_of_exactly_16_mib_is_taken_and_one_byte_more_is_413(server):
    body = b'{"content": "hi"}'
    body += b" " * (16 * MIB - len(body))
    assert len(body) == 16 * MIB
    status, _, answer = split_response(exchange(server.port, request_bytes("POST", "/tokenize", body=body),
                                                timeout_s=30))
    assert (status, answer) == (200, b'{"tokens": [104,105]}')
    # one byte more is refused from the head alone, before any body is read
    over = request_bytes("POST", "/tokenize", body=b"").replace(b"Content-Length: 0", f"Content-Length: {16 * MIB + 1}".encode())
    status, _, answer = split_response(exchange(server.port, over))
    assert (status, answer) == (413, b"request too large")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "json"])
def test_a_post_without_json_content_type_is_415(server, content_type):
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "a"}', content_type=content_type)
    status, _, body = split_response(exchange(server.port, raw))
    assert status == 415 and body == b"POST bodies must be Content-Type: application/json"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_pass(server, content_type):
    raw = request_bytes("POST", "/tokenize", body=b'{"content": "a"}', content_type=content_type)
    assert status_of(exchange(server.port, raw)) == 200


def test_a_request_line_of_exactly_16_kib_passes_and_one_byte_more_is_400(server):
    # the limit counts the line with its CRLF, as the Rust bankml's take(16 KiB).read_line does
    prefix = b"GET /"
    suffix = b" HTTP/1.1\r\n"
    fill = 16 * KIB - len(prefix) - len(suffix)
    line = prefix + b"a" * fill + suffix
    assert len(line) == 16 * KIB
    assert status_of(exchange(server.port, line + b"Host: 127.0.0.1\r\n\r\n")) == 404  # read, then an unknown path
    longer = prefix + b"a" * (fill + 1) + suffix
    status, _, body = split_response(exchange(server.port, longer + b"Host: 127.0.0.1\r\n\r\n"))
    assert (status, body) == (400, b"request line too long")


def test_a_header_line_of_exactly_16_kib_passes_and_one_byte_more_is_400(server):
    def head(n: int) -> bytes:
        line = b"X-Pad: " + b"p" * (n - len(b"X-Pad: ") - 2) + b"\r\n"
        assert len(line) == n
        return b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + line + b"\r\n"

    assert status_of(exchange(server.port, head(16 * KIB))) == 200
    status, _, body = split_response(exchange(server.port, head(16 * KIB + 1)))
    assert (status, body) == (400, b"request head too large")


def test_100_header_lines_pass_and_101_are_400(server):
    def head(n: int) -> bytes:
        lines = [b"Host: 127.0.0.1"] + [b"X-N%d: %d" % (i, i) for i in range(n - 1)]
        return b"GET /health HTTP/1.1\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"

    assert status_of(exchange(server.port, head(100))) == 200
    status, _, body = split_response(exchange(server.port, head(101)))
    assert (status, body) == (400, b"request head too large")


def test_a_long_head_of_big_lines_reaches_the_routes(server):
    # 100 lines of almost 16 KiB: far over Sanic's own 16 KiB head cap, within the Rust bankml's rules
    lines = [b"Host: 127.0.0.1"] + [b"X-%02d: " % i + b"v" * 16000 for i in range(99)]
    raw = b"GET /health HTTP/1.1\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"
    assert len(raw) > 1_500_000
    assert status_of(exchange(server.port, raw, timeout_s=20)) == 200


def test_a_refusal_drains_the_body_so_the_client_reads_the_answer(server):
    # a foreign Host with a 4 MiB body sent in pieces: the server answers at once, keeps reading what
    # follows (up to 200 ms), and only then closes, so the client's sends never hit a reset
    body = b"x" * (4 * MIB)
    raw = request_bytes("POST", "/v1/chat/completions", host="evil.example", body=b"")
    raw = raw.replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode())
    with connect(server.port) as s:
        s.sendall(raw)
        for i in range(0, len(body), 256 * KIB):
            s.sendall(body[i:i + 256 * KIB])
            time.sleep(0.005)
        status, _, answer = split_response(read_all(s))
    assert status == 403 and answer.startswith(b"bankml serve answers loopback clients only")


def test_a_refusal_does_not_wait_longer_than_the_drain_limit(server):
    # a client that announces a body and never sends it is answered and let go after ~200 ms
    raw = request_bytes("GET", "/health", host="evil.example", headers={"Content-Length": "1000"})
    t0 = time.monotonic()
    with connect(server.port) as s:
        s.sendall(raw)
        status = status_of(read_all(s))
    assert status == 403 and time.monotonic() - t0 < 2.0


def test_more_than_32_connections_get_503_without_blocking_the_others(server):
    held = [connect(server.port) for _ in range(32)]
    try:
        time.sleep(0.5)  # all 32 accepted and counted
        # the 33rd: refused at once, even though it keeps sending (its drain is bounded and off the accept path)
        t0 = time.monotonic()
        with connect(server.port) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            status, headers, body = split_response(read_all(extra))
        assert (status, body) == (503, b"bankml serve: too many connections")
        assert time.monotonic() - t0 < 2.0
        assert headers["connection"] == "close"
        # the 32 held connections are still served, concurrently with a refusal in progress
        slow = connect(server.port)  # this one is refused too, while it dribbles its head
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        for s in held[:4]:
            s.sendall(request_bytes("GET", "/health"))
        assert all(status_of(read_all(s)) == 200 for s in held[:4])
        assert status_of(read_all(slow)) == 503
        slow.close()
        # the 4 answered ones closed: there is room again
        time.sleep(0.2)
        assert status_of(exchange(server.port, request_bytes("GET", "/health"))) == 200
    finally:
        for s in held:
            s.close()


def test_the_engine_address_applies_the_same_rules_and_counts_its_own_connections(server):
    assert status_of(exchange(server.upstream_port, request_bytes("GET", "/health"))) == 200
    assert status_of(exchange(server.upstream_port, request_bytes("GET", "/health", host="evil"))) == 403
    held = [connect(server.port) for _ in range(32)]
    try:
        time.sleep(0.2)
        assert status_of(exchange(server.upstream_port, request_bytes("GET", "/health"))) == 200
    finally:
        for s in held:
            s.close()


def test_a_silent_client_is_closed_after_the_read_timeout(quick):
    with connect(quick.port, timeout_s=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no end of head
        t0 = time.monotonic()
        read_all(s)
        assert 0.8 < time.monotonic() - t0 < 5


def test_a_body_that_stops_coming_is_timed_out(quick):
    raw = request_bytes("POST", "/tokenize", body=b"").replace(b"Content-Length: 0", b"Content-Length: 100")
    with connect(quick.port, timeout_s=10) as s:
        s.sendall(raw + b'{"content": ')
        t0 = time.monotonic()
        answer = read_all(s)
        assert 0.8 < time.monotonic() - t0 < 5
    assert answer == b"" or status_of(answer) == 408


def test_a_client_that_stops_reading_is_cut_off_after_the_write_timeout(quick):
    # a 40 MiB stream to a client that reads nothing: once the socket buffers are full the server's
    # writes block, and after 1 s it gives up; the generation stops with it (the fake engine logs it as
    # aborted, before its 5000 steps)
    body = b'{"messages": [{"role": "user", "content": "HUGE"}], "stream": true}'
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect(("127.0.0.1", quick.port))
    try:
        s.sendall(request_bytes("POST", "/v1/chat/completions", body=body))
        m = quick.wait_for_log(r"fake-engine: (chatcmpl-\w+) aborted after (\d+) steps", timeout_s=15)
        assert m is not None, quick.log()
        assert int(m.group(2)) < 5000
        assert "write timeout" in quick.log()
    finally:
        s.close()


@pytest.mark.parametrize("target", ["/health?x=1", "/health?", "/health/", "/heal%74h", "//health", "/HEALTH",
                                    "http://127.0.0.1/health"])
def test_paths_match_exactly(server, target):
    status, _, body = split_response(exchange(server.port, request_bytes("GET", target)))
    assert status == 404 and body.startswith(b"bankml serve --native: GET /bankml")


def test_wrong_methods_are_404_and_options_is_403(server):
    assert status_of(exchange(server.port, request_bytes("POST", "/health", body=b"{}"))) == 404
    assert status_of(exchange(server.port, request_bytes("HEAD", "/props"))) == 404
    assert status_of(exchange(server.port, request_bytes("OPTIONS", "/v1/chat/completions"))) == 403


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET /health HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n",
                                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
                                 b"\r\nGET /health HTTP/1.1\r\n\r\n"])
def test_malformed_heads_are_400_not_a_crash(server, raw):
    assert status_of(exchange(server.port, raw)) == 400
    assert status_of(exchange(server.port, request_bytes("GET", "/health"))) == 200
