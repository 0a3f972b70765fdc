"""Chat templates against llama-server's /apply-template (fixtures recorded by
tests/fixtures/record_tokenizer.py), the ChatML fallback, failures and the sandbox."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from model.chat_template import CHATML_TEMPLATE, TemplateError, render_chat, tojson
from model.tokenizer import Tokenizer, gguf_fields

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture(name: str) -> dict:
    path = FIXTURES / f"template_{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: run tests/fixtures/record_tokenizer.py")
    return json.loads(path.read_text())


def _render_like_server(path: Path, request: dict) -> str:
    fields = gguf_fields(path)
    tok = Tokenizer.from_gguf(fields)
    return render_chat(fields.get("tokenizer.chat_template"), request["messages"],
                       add_generation_prompt=request.get("add_generation_prompt", True),
                       bos_token=tok.bos_token, eos_token=tok.eos_token, add_bos=tok.add_bos, add_eos=tok.add_eos)


def test_smollm2_template_matches_llama_server(smollm2_path: Path):
    data = _fixture("smollm2")
    assert data["file"] == smollm2_path.name
    assert len(data["cases"]) >= 5
    assert "tokenizer.chat_template" in gguf_fields(smollm2_path)
    for case in data["cases"]:
        assert _render_like_server(smollm2_path, case["request"]) == case["prompt"], case["request"]


def test_gemma3_without_template_matches_llama_server(gemma3_path: Path):
    # this GGUF carries no tokenizer.chat_template: llama-server falls back to ChatML
    data = _fixture("gemma3")
    assert data["file"] == gemma3_path.name
    assert "tokenizer.chat_template" not in gguf_fields(gemma3_path)
    for case in data["cases"]:
        assert _render_like_server(gemma3_path, case["request"]) == case["prompt"], case["request"]


def test_fallback_is_chatml_without_a_template():
    fields = {"tokenizer.ggml.model": "gpt2"}  # a GGUF with no tokenizer.chat_template
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    want = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(fields.get("tokenizer.chat_template"), messages) == want
    assert render_chat("", messages) == want
    assert render_chat(CHATML_TEMPLATE, messages, add_generation_prompt=False) == want.removesuffix(
        "<|im_start|>assistant\n")


def test_smollm2_default_system_prompt(smollm2_path: Path):
    template = gguf_fields(smollm2_path)["tokenizer.chat_template"]
    out = render_chat(template, [{"role": "user", "content": "hi"}])
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_template_bos_is_dropped_when_the_tokenizer_adds_it():
    template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
    messages = [{"role": "user", "content": "x"}]
    assert render_chat(template, messages, bos_token="<bos>", eos_token="<eos>") == "<bos><user>x<eos>"
    assert render_chat(template, messages, bos_token="<bos>", eos_token="<eos>", add_bos=True) == "<user>x<eos>"
    assert render_chat(template, messages, bos_token="<bos>", eos_token="<eos>", add_eos=True) == "<bos><user>x"


def test_raise_exception_is_a_template_error_with_the_reason():
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}"
    with pytest.raises(TemplateError, match="Conversations must start with user"):
        render_chat(template, [{"role": "assistant", "content": "x"}])
    assert render_chat(template, [{"role": "user", "content": "x"}]) == ""


def test_syntax_error_is_a_template_error():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        render_chat("ok\n{% for m in messages %}{{ m.content }}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% set l = [] %}{{ l.append(1) }}",
])
def test_sandbox_refuses_unsafe_access(template: str):
    with pytest.raises(TemplateError, match="unsafe"):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_trim_and_lstrip_blocks():
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
    out = render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert out == "[a]\n[b]\n"


def test_undefined_is_lenient_like_llama_cpp():
    template = "{{ messages[0].missing.deeper }}|{{ 'a' + messages[0].missing }}|{{ none + 'b' }}|{{ add_generation_prompt }}"
    assert render_chat(template, [{"role": "user", "content": "x"}], add_generation_prompt=False) == "|a|b|"


def test_tojson_writes_like_llama_cpp():
    value = {"role": "<|im_start|>", "n": [1, 2.5, 0.1, 1e20], "ok": True, "none": None, "s": "é\"\n\x01"}
    assert tojson(value) == ('{"role": "<|im_start|>", "n": [1, 2.5, 0.1, 1e+20], "ok": true, '
                             '"none": null, "s": "é\\"\\n\\u0001"}')
    assert tojson([1, {"a": []}], indent=2) == '[\n  1,\n  {\n    "a": []\n  }\n]'
    assert tojson({"k": "🙂é"}, ensure_ascii=True) == '{"k": "\\ud83d\\ude42\\u00e9"}'
    assert tojson({"a": 1, "b": 2}, separators=(",", ":")) == '{"a":1,"b":2}'
    out = render_chat("{{ messages | tojson }}", [{"role": "user", "content": "<b>&</b>"}])
    assert out == '[{"role": "user", "content": "<b>&</b>"}]'


def test_strftime_now_and_dates_use_the_given_clock():
    now = time.mktime((2025, 3, 7, 12, 0, 0, 0, 0, -1))
    out = render_chat("{{ strftime_now('%Y-%m-%d') }} {{ date_string }}", [], now=now)
    assert out == "2025-03-07 07 Mar 2025"
