"""API keys (--api-key, --api-key-file / [serve] api_key_file): read at start, asked for on every route but
llama-server's public ones, in llama-server's (and Ollama's) 401 shape, before the body is read.

The server runs over the fake engine (tests/fake_engine.py); the keys sit in front of everything.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from gateway_helpers import EdgeServer, connect, exchange, read_all, request_bytes, split_response, tiny_model

from bankml import serve_files
from bankml.cli import main
from bankml.errors import ConfigInvalid
from gateway.http import access as access_module
from gateway.http.access import Access
from gateway.http.loopback import Head

pytestmark = pytest.mark.timeout(120)

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "api_key_smollm2.json").read_text())
KEY, OTHER = RECORDED["keys"]  # the keys llama-server was recorded with
WRONG = "sk-wrong-key-never-logged"
LLAMA_401 = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
OLLAMA_401 = {"error": "Invalid API Key"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    model, fork = tiny_model(d)
    key_file = d / "keys.txt"
    key_file.write_text(f"# the second key\n\n{OTHER}\n")
    key_file.chmod(0o600)
    s = EdgeServer(model, fork, "--api-key", KEY, "--api-key-file", str(key_file))
    yield s
    s.stop()


def get(server, path: str, headers: dict | None = None, method: str = "GET", body: bytes = b"",
        upstream: bool = False) -> tuple[int, dict, bytes]:
    port = server.upstream_port if upstream else server.port
    return split_response(exchange(port, request_bytes(method, path, headers=headers, body=body)))


# --- the header forms ------------------------------------------------------------------------------


def _head(*headers: tuple[str, str], method: str = "POST", target: str = "/completion") -> Head:
    return Head(method, target, "HTTP/1.1", (("host", "localhost"), *((k.lower(), v) for k, v in headers)), b"")


@pytest.mark.parametrize("headers", [
    [("Authorization", f"Bearer {KEY}")],
    [("Authorization", KEY)],  # llama-server compares the value itself when there is no "Bearer " prefix
    [("X-Api-Key", KEY)],
    [("Authorization", ""), ("X-Api-Key", KEY)],  # an empty Authorization: x-api-key is read (llama-server)
    [("Authorization", f"Bearer {OTHER}")],
])
def test_the_header_forms_llama_server_takes(headers):
    assert Access.of((KEY, OTHER)).authorized(_head(*headers))


@pytest.mark.parametrize("headers", [
    [],
    [("Authorization", "Bearer")],
    [("Authorization", f"Bearer {KEY}x")],
    [("Authorization", f"Basic {KEY}")],
    [("Authorization", f"Bearer {WRONG}"), ("X-Api-Key", KEY)],  # Authorization wins, as in llama-server
    [("Authorization", f"Bearer {KEY[:-1]}")],
    [("Authorization", f"bearer {KEY}")],  # llama-server strips "Bearer " exactly (recorded)
    [("Authorization", f"Bearer  {KEY}")],
    [("Authorization", f"Bearer {KEY},{OTHER}")],
])
def test_anything_else_is_refused(headers):
    assert not Access.of((KEY, OTHER)).authorized(_head(*headers))


def test_every_key_is_compared_every_time(monkeypatch):
    calls = []
    compare = hmac.compare_digest

    def counting(a, b):
        calls.append(len(a) == len(b))
        return compare(a, b)

    monkeypatch.setattr(access_module.hmac, "compare_digest", counting)
    access = Access.of((KEY, OTHER, "sk-third"))
    assert access.authorized(_head(("Authorization", f"Bearer {KEY}")))  # the first key matches
    assert calls == [True, True, True]  # all three compared, each at one length (digests)


def test_the_policy_keeps_digests_only():
    access = Access.of((KEY,))
    assert KEY not in repr(access) and KEY.encode() not in b"".join(access.key_digests)


# --- keys read at start ------------------------------------------------------------------------------


def test_a_key_file_skips_comments_and_blank_lines_and_takes_crlf(tmp_path):
    f = tmp_path / "keys"
    f.write_bytes(b"# keys\r\n\r\n  # an indented comment\nsk-a\r\nsk-b\n")
    f.chmod(0o600)
    assert serve_files.read_key_file(str(f), "--api-key-file") == ["sk-a", "sk-b"]


@pytest.mark.parametrize("content, why", [
    (b"", "no key in it"),
    (b"# only a comment\n\n", "no key in it"),
    (b"sk a\n", "visible ASCII"),
    (b" sk-a\n", "visible ASCII"),
    (b"sk-a\x0bsk-b\n", "visible ASCII"),
    (b"sk-\xc3\xa9\n", "visible ASCII"),
    (b"sk-\xff\n", "not UTF-8"),
])
def test_a_bad_key_file_is_refused_naming_its_line_not_its_key(tmp_path, content, why):
    f = tmp_path / "keys"
    f.write_bytes(content)
    f.chmod(0o600)
    with pytest.raises(ConfigInvalid, match=why) as e:
        serve_files.read_key_file(str(f), "[serve] api_key_file")
    assert "sk-a" not in str(e.value) and "sk a" not in str(e.value)


def test_an_unreadable_key_file_is_refused(tmp_path):
    with pytest.raises(ConfigInvalid, match="cannot read it"):
        serve_files.read_key_file(str(tmp_path / "absent"), "--api-key-file")
    with pytest.raises(ConfigInvalid, match="cannot read it"):
        serve_files.read_key_file(str(tmp_path), "--api-key-file")  # a directory


def test_a_key_file_others_may_read_is_a_warning_not_a_refusal(tmp_path, capsys):
    f = tmp_path / "keys"
    f.write_text("sk-a\n")
    f.chmod(0o644)
    assert serve_files.read_key_file(str(f), "--api-key-file") == ["sk-a"]
    err = capsys.readouterr().err
    assert "warning" in err and "0644" in err and "sk-a" not in err
    f.chmod(0o600)
    serve_files.read_key_file(str(f), "--api-key-file")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, why", [
    (["--api-key", "bad key"], "visible ASCII"),
    (["--api-key", ""], "empty API key"),
    (["--api-key", "sk-a,sk-b"], "a key with a comma"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read it"),
])
def test_serve_refuses_bad_keys_at_start_with_exit_2(capsys, argv, why):
    assert main(["serve", "--native", *argv]) == 2  # refused before any model is fetched
    err = capsys.readouterr().err
    assert err.startswith("bankml serve: refuse: ") and why in err
    assert "bad key" not in err and "sk-a" not in err


def test_the_config_key_file_is_read(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[serve]\napi_key_file = "{tmp_path / "absent"}"\n')
    assert main(["serve", "--native", "--config", str(cfg)]) == 2
    assert "[serve] api_key_file" in capsys.readouterr().err


# --- on the wire ------------------------------------------------------------------------------------


LATER_PUBLIC = ("/models", "/v1/models")  # public in llama-server after b11434 (its test_security.py)


@pytest.mark.parametrize("name", sorted(RECORDED["answers"]))
def test_llama_servers_recorded_answers(server, name):
    """Each request recorded against llama-server with the same two keys gets its status (and its 401)."""
    rec = RECORDED["answers"][name]
    req = rec["request"]
    body = json.dumps(req["body"]).encode() if req["body"] is not None else b""
    status, headers, got = get(server, req["path"], headers=req["headers"], method=req["method"], body=body)
    if req["path"] in LATER_PUBLIC and rec["status"] == 401:  # b11434 keyed the model lists; later builds do not
        assert status == 200, got
        return
    assert status == rec["status"], got
    if status == 401:
        assert json.loads(got) == rec["body"] == LLAMA_401
        assert headers["content-type"] == rec["content_type"]


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("HEAD", "/health"), ("GET", "/"), ("HEAD", "/"),
                                          ("GET", "/models"), ("GET", "/v1/models")])
def test_public_endpoints_need_no_key(server, method, path):
    status, _, body = get(server, path, method=method)
    assert status == 200 and b"error" not in body


def test_a_public_path_is_public_whatever_the_method(server):
    # llama-server matches its public endpoints on the path: POST /health is its route table's 404, not a 401
    assert get(server, "/health", method="POST", body=b"{}")[0] == 404
    assert get(server, "/v1/health")[0] == 200  # public in llama-server, served here as /health


@pytest.mark.parametrize("method, path", [("GET", "/props"), ("GET", "/bankml"), ("GET", "/slots"),
                                          ("GET", "/slots?fail_on_no_slot=1"), ("GET", "/metrics"),
                                          ("POST", "/tokenize"), ("POST", "/v1/chat/completions"),
                                          ("GET", "/no-such-route"),
                                          ("GET", "/bankml/status")])
def test_every_other_route_is_401_in_llama_servers_shape(server, method, path):
    status, headers, body = get(server, path, method=method, body=b"{}" if method == "POST" else b"")
    assert status == 401
    assert headers["content-type"] == "application/json; charset=utf-8"
    assert json.loads(body) == LLAMA_401


@pytest.mark.parametrize("method, path", [("GET", "/api/tags"), ("POST", "/api/chat"), ("POST", "/api/show"),
                                          ("DELETE", "/api/delete")])
def test_ollama_routes_get_ollamas_shape(server, method, path):
    status, _, body = get(server, path, method=method, body=b"{}" if method == "POST" else b"")
    assert status == 401 and json.loads(body) == OLLAMA_401


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY},
                                     {"Authorization": f"Bearer {OTHER}"}])
def test_a_configured_key_passes(server, headers):
    status, _, body = get(server, "/props", headers=headers)
    assert status == 200 and "n_ctx" in json.loads(body)


def test_the_engine_address_asks_for_the_key_too(server):
    assert get(server, "/props", upstream=True)[0] == 401
    assert get(server, "/props", headers={"x-api-key": KEY}, upstream=True)[0] == 200


def test_the_401_comes_before_the_body(server):
    # the head announces 1000 bytes and sends 2: the answer does not wait for the rest
    with connect(server.port, timeout_s=3) as s:
        s.sendall(request_bytes("POST", "/v1/chat/completions", body=b"{}")
                  .replace(b"Content-Length: 2", b"Content-Length: 1000"))
        status, _, body = split_response(read_all(s))
    assert status == 401 and json.loads(body) == LLAMA_401


def test_a_refused_key_is_never_logged_nor_shown(server):
    get(server, "/props", headers={"Authorization": f"Bearer {WRONG}"})
    status, _, body = get(server, "/bankml", headers={"x-api-key": KEY})
    info = json.loads(body)
    assert status == 200 and info["api_keys"] == 2
    assert KEY not in body.decode() and OTHER not in body.decode()
    log = server.log()
    assert "refused 401" in log
    assert WRONG not in log and KEY not in log and OTHER not in log


def test_the_openai_client_with_api_key(server):
    messages = [{"role": "user", "content": "hi"}]
    good = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    answer = good.chat.completions.create(model="tiny-model.q8_0", messages=messages, max_tokens=4)
    assert answer.choices[0].message.content
    bad = openai.OpenAI(base_url=server.url("/v1"), api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Invalid API Key") as e:
        bad.chat.completions.create(model="tiny-model.q8_0", messages=messages, max_tokens=4)
    assert e.value.status_code == 401


def test_the_ollama_client_with_headers(server):
    good = ollama.Client(host=server.url(), timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert good.list().models
    bad = ollama.Client(host=server.url(), timeout=30)
    with pytest.raises(ollama.ResponseError) as e:
        bad.chat(model="tiny-model.q8_0", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.error == "Invalid API Key"


def test_a_server_without_keys_asks_for_none(tmp_path):
    model, fork = tiny_model(tmp_path)
    s = EdgeServer(model, fork)
    try:
        assert get(s, "/props")[0] == 200
        assert "api_keys" not in json.loads(get(s, "/bankml")[2])
    finally:
        s.stop()



def test_p0_asks_for_the_keys_too(tmp_path):
    from p0_helpers import REPLY, Gateway, StandaloneMock, chat_body, sha

    model, fork = tiny_model(tmp_path)
    mock = StandaloneMock(model)
    g = None
    try:
        g = Gateway(model, fork, "--upstream", mock.address, "--api-key", KEY, "--allow-origin", "http://a.example")
        assert g.ready, g.log()
        r = g.post(chat_body())
        assert r.status_code == 401 and r.json() == LLAMA_401
        json_type = {"Content-Type": "application/json"}
        assert httpx.post(g.url("/v1/chat/completions"), content=chat_body(), headers={**json_type, "x-api-key": KEY},
                          timeout=60).status_code == 200
        r = httpx.post(g.url("/v1/chat/completions"), content=chat_body(), timeout=60,
                       headers={**json_type, "Authorization": f"Bearer {KEY}", "Origin": "http://a.example"})
        assert r.status_code == 200 and r.json()["bankml_receipt"]["response_sha256"] == sha(REPLY)
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        status, _, _ = split_response(exchange(g.port, request_bytes("GET", "/health")))
        assert status == 200
    finally:
        if g is not None:
            g.stop()
        mock.stop()
