"""llama-server's small endpoints (/tokenize, /detokenize, /props, /apply-template) and the refusals of
the routes we do not serve, against llama-server b11434's recorded answers on SmolLM2
(tests/fixtures/llama_small_smollm2.json, by tests/fixtures/record_llama_small.py).

The server is the real gateway over SmolLM2's real tokenizer and template (tests/replay_engine.py:
only the forward pass is not run), on both addresses.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model

from bankml import __version__
from gateway.openai.props import ftype_name
from gateway.serving.template_caps import template_caps
from model.chat_template import CHATML_TEMPLATE

DATA = json.loads((Path(__file__).parent / "fixtures" / "llama_small_smollm2.json").read_text())


@pytest.fixture(scope="module")
def server(smollm2_path, smollm2_fork):
    assert DATA["model"] == smollm2_path.name
    s = FakeServer(smollm2_path, smollm2_fork, ctx=2048, replay=True, step_ms=0)
    yield s
    s.stop()


def send(server, method: str, path: str, body=None, upstream: bool = False) -> httpx.Response:
    url = server.url(path, upstream)
    if body is None:
        return httpx.request(method, url, timeout=60)
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return httpx.request(method, url, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def same_answer(r: httpx.Response, rec: dict) -> None:
    assert (r.status_code, r.json()) == (rec["status"], rec["body"])
    assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("name", list(DATA["tokenize"]))
def test_tokenize_is_llama_servers(server, name):
    rec = DATA["tokenize"][name]
    if name == "body_not_json":  # our parse error names the same place, in Python's words after it
        r = send(server, "POST", "/tokenize", rec["request"])
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "[json.exception.parse_error.101] parse error at line 1, column 2")
        return
    same_answer(send(server, "POST", "/tokenize", rec["request"]), rec)


def test_a_piece_that_is_not_utf8_alone_is_its_bytes(server):
    """An emoji split over tokens: each piece is a list of byte values, and together they are the text."""
    rec = DATA["tokenize"]["emoji_pieces"]
    tokens = send(server, "POST", "/tokenize", rec["request"], upstream=True).json()["tokens"]
    assert any(isinstance(t["piece"], list) for t in tokens)
    text = b"".join(bytes(t["piece"]) if isinstance(t["piece"], list) else t["piece"].encode() for t in tokens)
    assert text.decode() == rec["request"]["content"]


@pytest.mark.parametrize("name", list(DATA["detokenize"]))
def test_detokenize_is_llama_servers(server, name):
    rec = DATA["detokenize"][name]
    same_answer(send(server, "POST", "/detokenize", rec["request"]), rec)


def test_detokenize_undoes_tokenize_with_special_tokens(server):
    text = "<|im_start|>user\nhé 😀<|im_end|>"
    tokens = send(server, "POST", "/tokenize", {"content": text}).json()["tokens"]
    assert send(server, "POST", "/detokenize", {"tokens": tokens}, upstream=True).json() == {"content": text}


@pytest.mark.parametrize("name", list(DATA["apply_template"]))
def test_apply_template_is_llama_servers(server, name):
    rec = DATA["apply_template"][name]
    same_answer(send(server, "POST", "/apply-template", rec["request"]), rec)


def test_props_has_llama_servers_fields_filled_from_this_server(server, smollm2_path):
    theirs = DATA["props"]["body"]
    for upstream in (False, True):
        r = send(server, "GET", "/props", upstream=upstream)
        assert r.status_code == 200
        ours = r.json()
        # every field llama-server sends, but the one we cannot fill truthfully (props.py says why)
        assert set(theirs) - set(ours) == {"media_marker"}
        assert set(ours) - set(theirs) == {"n_ctx", "cache_type"}  # what the KV pages hold
        assert ours["default_generation_settings"] == theirs["default_generation_settings"]  # same defaults, n_ctx
        same = ("model_ftype", "modalities", "endpoint_slots", "endpoint_props", "ui", "ui_settings",
                "chat_template", "chat_template_caps", "bos_token", "eos_token", "is_sleeping", "cors_proxy_enabled", "total_slots")
        assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
        assert ours["model_path"] == str(smollm2_path.resolve()) and ours["n_ctx"] == 2048
        assert ours["model_alias"] == smollm2_path.name  # the name our answers carry as "model"
        assert ours["build_info"] == f"bankML {__version__} native"
        assert ours["endpoint_metrics"] is True  # GET /metrics is served (Prometheus)
        assert "chat_template_sha256" not in ours  # no --chat-template-file


def test_props_reports_the_engines_slots(tmp_path):
    model, fork = tiny_model(tmp_path)
    s = FakeServer(model, fork, engine={"max_seqs": 3})
    try:
        props = send(s, "GET", "/props").json()
    finally:
        s.stop()
    assert props["total_slots"] == 3
    assert props["chat_template"] == CHATML_TEMPLATE  # the tiny GGUF has none: llama-server's fallback
    assert props["default_generation_settings"]["params"]["seed"] == 4294967295


@pytest.mark.parametrize("name", list(DATA["template_caps"]))
def test_template_caps_are_llama_servers(name):
    """Each small template's caps, as llama-server's /props reported them with it as --chat-template-file."""
    rec = DATA["template_caps"][name]
    assert template_caps(rec["template"]) == rec["caps"]


def test_ftype_names_are_llama_cpps():
    assert (ftype_name(3), ftype_name(15), ftype_name(1024 | 7), ftype_name(99), ftype_name(None)) == (
        "Q4_1", "Q4_K - Medium", "(guessed) Q8_0", "unknown, may not work", "unknown, may not work")


RECORDED = {(r["method"], r["path"]): r for r in DATA["other_routes"]}


@pytest.mark.parametrize("method,path", [("POST", "/props"), ("POST", "/slots/0?action=save"), ("GET", "/v1/health"),
                                         ("GET", "/cors-proxy"), ("GET", "/tools"), ("GET", "/lora-adapters")])
def test_routes_answered_as_llama_server_answers_them(server, method, path):
    rec = RECORDED[(method, path)]
    for upstream in (False, True):
        same_answer(send(server, method, path, rec["request"], upstream), rec)


def test_chat_token_counts_are_llama_servers(server):
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        rec = RECORDED[("POST", path)]
        for upstream in (False, True):
            same_answer(send(server, "POST", path, rec["request"], upstream), rec)
    r = send(server, "POST", "/v1/chat/completions/input_tokens", {"messages": [], "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Failed to parse tools: a tool must be")


def test_post_props_is_refused_whatever_the_body(server):
    bodies = [r for r in DATA["other_routes"] if r["path"] == "/props"]
    assert len(bodies) == 3
    for rec in bodies:
        same_answer(send(server, "POST", "/props", rec["request"]), rec)


@pytest.mark.parametrize("method,path", [
    ("POST", "/rerank"), ("POST", "/reranking"), ("POST", "/v1/rerank"), ("POST", "/v1/reranking"),
    ("POST", "/lora-adapters"),
    ("POST", "/v1/chat/completions/control"), ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/systemone"),
    ("GET", "/v1/stream"), ("POST", "/v1/streams/lookup"),
])
def test_llama_server_routes_we_do_not_serve_are_refused_by_name(server, method, path):
    rec = RECORDED[(method, path)]
    r = send(server, method, path, rec["request"])
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["code"] == 501 and err["type"] == "not_supported_error"
    assert "bankml serve --native" in err["message"] or err["message"] == rec["body"]["error"]["message"]


def test_an_unknown_route_is_still_a_404(server):
    assert send(server, "GET", "/nonexistent").status_code == 404


def test_template_caps_of_llama_cpps_own_templates():
    """llama.cpp's models/templates (71 templates, b11434), where LLAMA_CPP_TEMPLATES names that folder:
    each one's caps as llama-server reported them (tests/fixtures/template_caps_llama_cpp.json)."""
    import hashlib
    import os

    folder = os.environ.get("LLAMA_CPP_TEMPLATES")
    if not folder:
        pytest.skip("LLAMA_CPP_TEMPLATES (llama.cpp's models/templates) is not set")
    recorded = json.loads((Path(__file__).parent / "fixtures" / "template_caps_llama_cpp.json").read_text())
    for name, rec in recorded["templates"].items():
        data = (Path(folder) / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == rec["sha256"], name
        assert template_caps(data.decode()) == rec["caps"], name
