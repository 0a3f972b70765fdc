"""--chat-template-file / [serve] chat_template_file: read once at start, checked (bounded, UTF-8, compiling
in the Jinja sandbox), in force for the startup model only; its sha256 in /bankml and every receipt.

A template that visibly changes the prompt: /apply-template shows it, and a chat answer's prompt tokens
count it (the fake engine's tokenizer is one token per UTF-8 byte).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from gateway_helpers import EdgeServer, exchange, registry_dir, request_bytes, split_response, tiny_model

from bankml.cli import main
from bankml.errors import ConfigInvalid
from bankml.serve_files import MAX_TEMPLATE_BYTES, read_chat_template

pytestmark = pytest.mark.timeout(120)

TEMPLATE = ("{% for m in messages %}<<{{ m.role | upper }}>> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<ASSISTANT>> {% endif %}\n")
MESSAGES = [{"role": "user", "content": "hi"}]
RENDERED = "<<USER>> hi\n<<ASSISTANT>> "  # trim_blocks; the template's one trailing newline dropped
SHA = hashlib.sha256(TEMPLATE.encode()).hexdigest()
RECORDED = json.loads((Path(__file__).parent / "fixtures" / "chat_template_file_smollm2.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("template")
    model, fork = tiny_model(d)
    registry_dir(d / "forks", ["Other-Model.Q8_0.gguf"])
    template = d / "template.jinja"
    template.write_text(TEMPLATE)
    s = EdgeServer(model, fork, "--chat-template-file", str(template), "--registry", str(d / "forks"))
    # the file is read once: what it says afterwards never reaches the server
    template.write_text("{{ raise_exception('re-read') }}")
    yield s
    s.stop()


def post(server, path: str, doc: dict) -> tuple[int, dict]:
    status, _, body = split_response(exchange(server.port, request_bytes("POST", path, body=json.dumps(doc).encode())))
    return status, json.loads(body)


def test_apply_template_renders_the_file(server):
    status, doc = post(server, "/apply-template", {"messages": MESSAGES})
    assert status == 200 and doc["prompt"] == RENDERED


def test_a_chat_answer_is_prompted_with_it_and_its_receipt_names_it(server):
    status, doc = post(server, "/v1/chat/completions", {"model": "tiny-model.q8_0", "messages": MESSAGES,
                                                        "max_tokens": 3})
    assert status == 200
    assert doc["usage"]["prompt_tokens"] == len(RENDERED.encode())
    assert doc["bankml_receipt"]["chat_template_sha256"] == SHA


def test_bankml_shows_its_sha256(server):
    status, _, body = split_response(exchange(server.port, request_bytes("GET", "/bankml")))
    info = json.loads(body)
    assert status == 200 and info["chat_template_sha256"] == SHA and info["chat_template_file"].endswith(
        "template.jinja")


def test_another_model_of_the_registry_keeps_its_own_template(server):
    status, doc = post(server, "/v1/chat/completions", {"model": "other-model.q8_0", "messages": MESSAGES,
                                                        "max_tokens": 3})
    assert status == 200
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # llama-server's fallback: no GGUF template
    assert doc["usage"]["prompt_tokens"] == len(chatml.encode())
    assert "chat_template_sha256" not in doc["bankml_receipt"]


def test_ollamas_show_names_the_template_in_force(server):
    status, doc = post(server, "/api/show", {"model": "tiny-model.q8_0"})
    assert status == 200 and doc["template"] == TEMPLATE.removesuffix("\n")  # as llama-server keeps it


# --- refused at start ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content, why", [
    (b"{% for m in messages %}{{ m.content }}", "syntax error"),
    (b"\xff\xfe{{ messages }}", "not UTF-8"),
    (b"  \n", "empty"),
    (b"x" * (MAX_TEMPLATE_BYTES + 1), "over"),
])
def test_a_template_that_cannot_serve_is_refused(tmp_path, content, why):
    f = tmp_path / "t.jinja"
    f.write_bytes(content)
    with pytest.raises(ConfigInvalid, match=why):
        read_chat_template(str(f), "--chat-template-file")


def test_serve_refuses_with_exit_2_before_fetching_a_model(tmp_path, capsys):
    f = tmp_path / "t.jinja"
    f.write_text("{% if %}")
    assert main(["serve", "--native", "--chat-template-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bankml serve: refuse: --chat-template-file") and "syntax error" in err
    assert main(["serve", "--native", "--chat-template-file", str(tmp_path / "absent")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_p0_refuses_it(tmp_path, capsys):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert main(["serve", "--chat-template-file", str(f), "--upstream", "127.0.0.1:1"]) == 2
    assert "--native's" in capsys.readouterr().err


def test_the_config_key(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[serve]\nchat_template_file = "{tmp_path / "absent"}"\n')
    assert main(["serve", "--native", "--config", str(cfg)]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_the_file_sha256_is_of_its_bytes(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_bytes(TEMPLATE.encode())
    read = read_chat_template(str(f), "--chat-template-file")
    assert read.sha256 == SHA and read.path == str(f)
    # the text as llama-server holds it (its /props, recorded): one trailing newline dropped, CRLF as LF
    assert read.text == TEMPLATE.removesuffix("\n")
    f.write_bytes(RECORDED["template"].replace("\n", "\r\n").encode())
    assert read_chat_template(str(f), "--chat-template-file").text == RECORDED["props_chat_template"]


# --- against llama-server's recorded answers (SmolLM2, its real tokenizer) ----------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_path, smollm2_fork):
    template = tmp_path_factory.mktemp("recorded") / "template.jinja"
    template.write_text(RECORDED["template"])
    s = EdgeServer(smollm2_path, smollm2_fork, "--replay", "--ctx", "2048", "--chat-template-file", str(template))
    yield s
    s.stop()


@pytest.mark.parametrize("name", sorted(RECORDED["answers"]))
def test_llama_servers_prompt_and_its_token_count(smollm2, name):
    rec = RECORDED["answers"][name]
    status, doc = post(smollm2, "/apply-template", {"messages": rec["messages"]})
    assert status == 200 and doc["prompt"] == rec["prompt"]
    # a chat answer's prompt: the template's text, tokenized with special tokens parsed and BOS as the model says
    status, doc = post(smollm2, "/tokenize", {"content": rec["prompt"], "add_special": True, "parse_special": True})
    assert status == 200 and len(doc["tokens"]) == rec["prompt_tokens"]


def test_the_recorded_template_is_shown_as_llama_server_shows_it(smollm2):
    status, doc = post(smollm2, "/api/show", {"model": "smollm2-135m-instruct.q4_1"})
    assert status == 200 and doc["template"] == RECORDED["props_chat_template"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_real_engine_answers_with_it_behind_a_key(tmp_path, bankml_cmd, smollm2_path, smollm2_fork):
    """End to end on SmolLM2 through the installed command: --api-key and --chat-template-file together;
    the openai client's answer counts llama-server's recorded prompt tokens, and its receipt names the file."""
    import openai
    from gateway_helpers import CliServer

    template = tmp_path / "template.jinja"
    template.write_text(RECORDED["template"])
    key = "sk-real-engine"
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "512", "--config", "cpu",
                  "--api-key", key, "--chat-template-file", str(template))
    try:
        rec = RECORDED["answers"]["hi"]
        client = openai.OpenAI(base_url=s.url("/v1"), api_key=key, max_retries=0, timeout=300)
        raw = client.chat.completions.with_raw_response.create(model="smollm2-135m-instruct.q4_1",
                                                               messages=rec["messages"], max_tokens=4,
                                                               temperature=0)
        doc = json.loads(raw.text)
        assert doc["usage"]["prompt_tokens"] == rec["prompt_tokens"]
        assert doc["bankml_receipt"]["chat_template_sha256"] == hashlib.sha256(template.read_bytes()).hexdigest()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url("/v1"), api_key="sk-other", max_retries=0).chat.completions.create(
                model="smollm2-135m-instruct.q4_1", messages=rec["messages"], max_tokens=1)
    finally:
        s.stop()


def test_a_broken_gguf_template_is_served_with_a_file_that_replaces_it(tmp_path, monkeypatch):
    """The reason for the flag: a GGUF whose own template does not compile is refused at start, and
    served once --chat-template-file replaces it."""
    import gguf

    add_pre = gguf.GGUFWriter.add_tokenizer_pre

    def with_broken_template(self, pre):
        add_pre(self, pre)
        self.add_chat_template("{% for m in messages %}{{ m.content }}")  # no endfor

    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre", with_broken_template)
    model, fork = tiny_model(tmp_path)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="refuse: .*syntax error"):  # the server did not start: why
        EdgeServer(model, fork, timeout_s=30)
    template = tmp_path / "fixed.jinja"
    template.write_text(TEMPLATE)
    s = EdgeServer(model, fork, "--chat-template-file", str(template))
    try:
        status, doc = post(s, "/apply-template", {"messages": MESSAGES})
        assert status == 200 and doc["prompt"] == RENDERED
    finally:
        s.stop()
