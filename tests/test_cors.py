"""Browsers: a foreign Origin is refused (403), --allow-origin / [serve] allowed_origins admits listed origins
exactly, with CORS preflights answered 204 for them only and Access-Control-Allow-Origin on their answers.

Raw sockets against the real gateway over the fake engine: the origin rule sits in the loopback protocol.
"""

from __future__ import annotations

import json

import pytest
from gateway_helpers import EdgeServer, exchange, request_bytes, split_response, tiny_model

from bankml.config import load_config, serve_options
from bankml.errors import ConfigInvalid
from bankml.serve_files import parse_origin

pytestmark = pytest.mark.timeout(120)

APP = "http://app.example:8080"
SECURE = "https://secure.example"
FOREIGN = "http://evil.example"
CHAT = json.dumps({"model": "tiny-model.q8_0", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("cors"))
    s = EdgeServer(model, fork, "--allow-origin", f"{APP},HTTPS://Secure.Example:443")
    yield s
    s.stop()


def ask(server, method: str, path: str, headers: dict | None = None, body: bytes = b"", host: str = "127.0.0.1",
        upstream: bool = False):
    port = server.upstream_port if upstream else server.port
    return split_response(exchange(port, request_bytes(method, path, host=host, headers=headers, body=body)))


def preflight(origin: str, **extra: str) -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type", **extra}


# --- preflights --------------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", [APP, SECURE])
def test_a_listed_origins_preflight_is_204_with_the_cors_headers(server, origin):
    status, headers, body = ask(server, "OPTIONS", "/v1/chat/completions", preflight(origin))
    assert status == 204 and body == b""
    assert "content-length" not in headers  # RFC 9110 §8.6: a 204 says no length
    assert headers["access-control-allow-origin"] == origin
    assert headers["vary"] == "Origin"
    assert set(headers["access-control-allow-methods"].split(", ")) >= {"GET", "POST"}
    allowed = {h.strip().lower() for h in headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key"} <= allowed
    assert "access-control-allow-credentials" not in headers
    assert "access-control-allow-private-network" not in headers


def test_the_private_network_preflight_is_answered(server):
    headers = preflight(APP, **{"Access-Control-Request-Private-Network": "true"})
    status, answer, _ = ask(server, "OPTIONS", "/api/chat", headers)
    assert status == 204 and answer["access-control-allow-private-network"] == "true"


def test_the_headers_a_client_asks_for_are_allowed(server):
    # the openai JS client (dangerouslyAllowBrowser) sends its x-stainless-* headers
    headers = preflight(APP, **{"Access-Control-Request-Headers": "authorization, x-stainless-os"})
    _, answer, _ = ask(server, "OPTIONS", "/v1/chat/completions", headers)
    assert "x-stainless-os" in answer["access-control-allow-headers"]


@pytest.mark.parametrize("headers", [preflight(FOREIGN), preflight("http://app.example"),  # another port
                                     preflight("http://app.example:8080/"), preflight("null"), {}])
def test_any_other_options_is_403(server, headers):
    status, answer, body = ask(server, "OPTIONS", "/v1/chat/completions", headers)
    assert status == 403 and answer["content-type"].startswith("text/plain")
    assert "access-control-allow-origin" not in answer


def test_a_preflight_passes_the_host_rule_first(server):
    status, _, body = ask(server, "OPTIONS", "/v1/chat/completions", preflight(APP), host="app.example:8080")
    assert status == 403 and b"loopback clients only" in body


# --- actual requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", [FOREIGN, "http://localhost:3000", "null", "http://127.0.0.1"])
def test_a_foreign_origin_is_refused_on_every_method(server, origin):
    for method, path, body in (("GET", "/bankml", b""), ("POST", "/v1/chat/completions", CHAT),
                               ("GET", "/health", b"")):
        status, headers, text = ask(server, method, path, {"Origin": origin}, body)
        assert status == 403, (method, path)
        assert b"another origin" in text and "access-control-allow-origin" not in headers


def test_the_servers_own_origin_keeps_working(server):
    # the status page at GET / fetches /bankml/status from where it came from: loopback at the port served
    for host in ("127.0.0.1", "localhost", "[::1]"):
        status, headers, _ = ask(server, "GET", "/bankml/status", {"Origin": f"http://{host}:{server.port}"})
        assert status == 200 and "access-control-allow-origin" not in headers
    # the other listener's origin is another origin
    status, _, _ = ask(server, "GET", "/bankml", {"Origin": f"http://127.0.0.1:{server.upstream_port}"})
    assert status == 403
    status, _, _ = ask(server, "GET", "/bankml", {"Origin": f"http://127.0.0.1:{server.upstream_port}"},
                       upstream=True)
    assert status == 200


def test_a_listed_origins_answers_carry_allow_origin(server):
    status, headers, body = ask(server, "POST", "/v1/chat/completions", {"Origin": APP}, CHAT)
    assert status == 200 and json.loads(body)["choices"]
    assert headers["access-control-allow-origin"] == APP and headers["vary"] == "Origin"


def test_streams_carry_allow_origin(server):
    stream = json.dumps({**json.loads(CHAT), "stream": True}).encode()
    status, headers, body = ask(server, "POST", "/v1/chat/completions", {"Origin": SECURE}, stream)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["access-control-allow-origin"] == SECURE
    assert b"data: [DONE]" in body
    ollama = json.dumps({"model": "tiny-model.q8_0", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, headers, _ = ask(server, "POST", "/api/chat", {"Origin": APP}, ollama)
    assert status == 200 and headers["access-control-allow-origin"] == APP


@pytest.mark.parametrize("method, path, body, want", [("POST", "/v1/chat/completions", b"{", 400),
                                                       ("GET", "/v1/nothing", b"", 404),
                                                       ("POST", "/api/chat", b"{", 400)])
def test_error_answers_carry_allow_origin(server, method, path, body, want):
    status, headers, _ = ask(server, method, path, {"Origin": APP}, body)
    assert status == want and headers["access-control-allow-origin"] == APP


def test_no_origin_no_cors_headers(server):
    status, headers, _ = ask(server, "GET", "/bankml")
    assert status == 200 and "access-control-allow-origin" not in headers
    assert json.loads(ask(server, "GET", "/bankml")[2])["allowed_origins"] == [APP, SECURE]


def test_without_allowed_origins_every_preflight_is_403(tmp_path):
    model, fork = tiny_model(tmp_path)
    s = EdgeServer(model, fork)
    try:
        status, _, body = ask(s, "OPTIONS", "/v1/chat/completions", preflight(APP))
        assert (status, body) == (403, b"bankml serve: cross-origin requests are refused (no --allow-origin)")
        assert ask(s, "GET", "/bankml", {"Origin": APP})[0] == 403
        assert ask(s, "GET", "/bankml", {"Origin": f"http://localhost:{s.port}"})[0] == 200
    finally:
        s.stop()


# --- the list ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, origin", [("http://a.example", "http://a.example"),
                                          ("HTTP://A.Example:80", "http://a.example"),
                                          ("https://a.example:443", "https://a.example"),
                                          ("https://a.example:8443", "https://a.example:8443"),
                                          ("http://[::1]:3000", "http://[::1]:3000"),
                                          ("chrome-extension://abcdef", "chrome-extension://abcdef")])
def test_origins_are_kept_as_browsers_serialize_them(text, origin):
    assert parse_origin(text, "--allow-origin") == origin


@pytest.mark.parametrize("text", ["*", "null", "http://*.example", "a.example", "http://a.example/",
                                  "http://a.example/app", "http://a.example:0", "http://a.example:99999",
                                  "http://a.example?x"])
def test_anything_but_an_exact_origin_is_refused(text):
    with pytest.raises(ConfigInvalid, match="origin"):
        parse_origin(text, "--allow-origin")


def test_the_config_list_and_the_flag(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[serve]\nallowed_origins = ["http://a.example", "https://b.example:443"]\n')
    config = load_config(str(cfg))
    assert serve_options(config, native=True).allowed_origins == ("http://a.example", "https://b.example")
    # the flag replaces the config's list, and may be repeated or comma-separated
    options = serve_options(config, native=True, allow_origin=["http://c.example,http://d.example", "http://c.example"])
    assert options.allowed_origins == ("http://c.example", "http://d.example")
    bad = tmp_path / "bad.toml"
    bad.write_text('[serve]\nallowed_origins = ["*"]\n')
    with pytest.raises(ConfigInvalid, match="allowed_origins"):
        load_config(str(bad))
    bad.write_text('[serve]\nallowed_origins = "http://a.example"\n')
    with pytest.raises(ConfigInvalid, match="a list of strings"):
        load_config(str(bad))
