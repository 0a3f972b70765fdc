"""Typed errors: one table for every class, rendered per API, and the exit codes the CLI takes from it.

The last tests run the real gateway over the fake engine: a served model whose file changed is one
503, on /health and on every answer, until the file verifies again.
"""

from __future__ import annotations

import inspect
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model
from sanic.exceptions import NotFound
from tiny_gguf import write_tiny_gguf

from bankml import errors
from bankml.cli import main
from bankml.errors import (
    TABLE,
    BankmlError,
    ContextExceeded,
    ModelUnusable,
    NotPinned,
    Refused,
    Truncated,
    Unreadable,
    UpstreamFailed,
    exit_code,
)
from bankml.pin import fork_record
from gateway.http.errors import Api, GatewayErrorHandler, api_of, error_body, render, stream_error

pytestmark = pytest.mark.timeout(120)

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, BankmlError) and c is not BankmlError]


def test_the_table_has_a_row_for_every_error_class():
    assert len(CLASSES) >= 15
    assert sorted(c.__name__ for c in CLASSES) == sorted(c.__name__ for c in TABLE)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_renders_its_status_in_each_apis_shape(cls):
    row = TABLE[cls]
    e = cls("why it failed")
    for api, status in ((Api.OPENAI, row.openai), (Api.LLAMA, row.llama), (Api.OLLAMA, row.ollama)):
        r = render(e, api)
        assert r.status == status and r.content_type == "application/json"
        body = json.loads(r.body)
        if api is Api.OLLAMA:
            assert body == {"error": "why it failed"}  # Ollama's error: one string
        else:
            assert body == {"error": {"code": status, "message": "why it failed", "type": row.type}}


def test_statuses_that_clients_rely_on():
    by_name = {c.__name__: TABLE[c] for c in TABLE}
    assert {n: r.openai for n, r in by_name.items() if n in ("Refused", "ModelUnusable", "ModelNotFound",
                                                               "EngineGone", "UpstreamFailed", "EngineFailed")} == {
        "Refused": 400, "ModelUnusable": 503, "ModelNotFound": 404, "EngineGone": 503, "UpstreamFailed": 502,
        "EngineFailed": 500}
    assert by_name["ModelNotFound"].type == "not_found_error" and by_name["ModelUnusable"].type == "unavailable_error"


def test_context_exceeded_keeps_llama_servers_extra_keys_in_order():
    from gateway.http.errors import exceed_context

    e = exceed_context(5000, 4096)
    assert isinstance(e, ContextExceeded)
    assert error_body(e, Api.OPENAI) == (
        '{"error": {"code": 400, "message": "request (5000 tokens) exceeds the available context size (4096 tokens), '
        'try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}}')


def test_a_stream_that_fails_ends_with_the_same_error_object():
    assert stream_error(UpstreamFailed("upstream gone")) == (
        b'data: {"error": {"code": 502, "message": "upstream gone", "type": "server_error"}}\n\n')


def test_the_error_handler_picks_the_api_by_path():
    assert (api_of("/api/chat"), api_of("/v1/chat/completions"), api_of("/health")) == (
        Api.OLLAMA, Api.OPENAI, Api.LLAMA)
    handler = GatewayErrorHandler("not found")
    r = handler.default(SimpleNamespace(path="/api/chat", method="POST"), ModelUnusable("the file changed"))
    assert (r.status, json.loads(r.body)) == (503, {"error": "the file changed"})
    r = handler.default(SimpleNamespace(path="/v1/chat/completions", method="POST"), KeyError("x"))
    assert r.status == 500 and json.loads(r.body)["error"]["message"] == "internal error: KeyError: 'x'"


def test_subclasses_take_their_bases_row():
    class Mine(Refused):
        pass

    assert exit_code(Mine("x")) == exit_code(Refused) == 2


# --- the CLI's exit codes for verify's outcomes --------------------------------------------------


def test_verify_exit_codes_come_from_the_table(tmp_path, capsys):
    model = write_tiny_gguf(tmp_path / "m.gguf")
    fork = tmp_path / "m.gguf.FORK.json"
    good = fork_record(model)
    fork.write_text(json.dumps(good))
    assert main(["verify", str(model), "--fork", str(fork)]) == 0
    bad = dict(good, files=[dict(good["files"][0], sha256="0" * 64)])
    fork.write_text(json.dumps(bad))
    assert main(["verify", str(model), "--fork", str(fork)]) == exit_code(Refused) == 2
    fork.write_text(json.dumps(dict(good, files=[dict(good["files"][0], path="other.gguf")])))
    assert main(["verify", str(model), "--fork", str(fork), "--json"]) == exit_code(NotPinned) == 2
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["verdict"] == "refuse"
    short = tmp_path / "short.gguf"
    short.write_bytes(model.read_bytes()[:40])
    assert main(["verify", str(short), "--fork", str(fork)]) == exit_code(Truncated) == 3
    assert main(["verify", str(tmp_path / "absent.gguf"), "--fork", str(fork)]) == exit_code(Unreadable) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("refuse: cannot read ")
    assert main(["verify", str(model), "--fork", str(tmp_path / "nofork.json")]) == 1
    assert main(["verify", str(model)]) == 1  # FILE without --fork
    assert "--fork F is required" in capsys.readouterr().err


# --- a served model that became unusable ---------------------------------------------------------


HI = [{"role": "user", "content": "Say hello."}]
CHANGED = ("Tiny-Model.Q8_0.gguf changed since bankml verified it: unloaded, and refused; "
           "the next request verifies it again")


def chat(server, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.url("/v1/chat/completions"), json=body or {"messages": HI}, timeout=30)


def test_health_and_every_answer_are_one_503_until_the_file_verifies_again(tmp_path):
    model, fork = tiny_model(tmp_path)
    original = model.read_bytes()
    s = FakeServer(model, fork)
    try:
        assert httpx.get(s.url("/health")).status_code == 200 and chat(s).status_code == 200
        with open(model, "ab") as f:  # the file changes under the server
            f.write(b"\0")
        want = {"error": {"code": 503, "message": CHANGED, "type": "unavailable_error"}}
        for _ in range(3):  # the first answer unloads; the later ones verify again and fail the pin
            r = chat(s)
            assert (r.status_code, r.json()) == (503, want)
            for upstream in (False, True):  # /health on both addresses: a balancer routes away
                h = httpx.get(s.url("/health", upstream))
                assert (h.status_code, h.json()) == (503, want)
        assert (chat(s, {"messages": HI, "stream": True}).status_code, httpx.get(s.url("/props")).status_code) == (
            503, 503)
        assert "does not verify: Tiny-Model.Q8_0.gguf sha256 " in s.log()  # why, in the log
        time.sleep(1.1)  # a new mtime
        model.write_bytes(original)
        assert httpx.get(s.url("/health")).status_code == 503  # /health never hashes: an answer verifies
        r = chat(s)
        assert r.status_code == 200 and "bankml_receipt" in r.json()
        assert (httpx.get(s.url("/health")).status_code, httpx.get(s.url("/health")).json()) == (
            200, {"status": "ok"})
    finally:
        s.stop()


def test_a_deleted_model_file_is_the_same_503(tmp_path):
    model, fork = tiny_model(tmp_path)
    s = FakeServer(model, fork)
    try:
        model.unlink()
        for _ in range(2):
            r = chat(s)
            assert (r.status_code, r.json()["error"]["message"]) == (503, CHANGED)
        assert httpx.get(s.url("/health")).status_code == 503
    finally:
        s.stop()


def test_an_unknown_path_under_v1_is_llama_servers_json_404_and_elsewhere_the_routes_text():
    handler = GatewayErrorHandler("bankml serve --native: GET /health")
    r = handler.default(SimpleNamespace(path="/v1/embeddings", method="POST"), NotFound())
    assert (r.status, json.loads(r.body)) == (404, {"error": {"code": 404, "message": "File Not Found",
                                                              "type": "not_found_error"}})
    r = handler.default(SimpleNamespace(path="/nope", method="GET"), NotFound())
    assert (r.status, r.body) == (404, b"bankml serve --native: GET /health")
