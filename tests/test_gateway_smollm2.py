"""`bankml serve --native` end to end on the real SmolLM2, through the installed command.

The `openai` client unchanged, plain and streamed, greedy: the same text both ways, and receipts
whose hashes the test recomputes from what it sent and received. Then a client that walks away from
a long stream must not hold the engine.
"""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import openai
import pytest
from gateway_helpers import CliServer, connect, request_bytes

from model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.fixture(scope="module")
def served(bankml_cmd, smollm2_path, smollm2_fork):
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "512", "--config", "cpu")
    yield s
    s.stop()


def test_startup_logs_what_was_verified_the_compile_time_and_both_addresses(served, smollm2_fork):
    pin = json.loads(smollm2_fork.read_text())["files"][0]["sha256"]
    log = served.log()
    assert f"sha256 {pin}" in log
    assert "compiled in" in log
    assert f"http://127.0.0.1:{served.port}" in log and f"http://127.0.0.1:{served.upstream_port}" in log
    status = httpx.get(served.url("/bankml")).json()
    assert status["verified"]["model_sha256"] == pin and status["resident"] == "smollm2-135m-instruct.q4_1"


def test_openai_client_plain_and_streamed_give_the_same_text_with_checkable_receipts(served):
    bodies: list[bytes] = []
    http = httpx.Client(event_hooks={"request": [lambda r: bodies.append(r.read())]}, timeout=600)
    client = openai.OpenAI(base_url=served.url("/v1"), api_key="none", http_client=http, max_retries=0)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct.Q4_1.gguf"

    plain = client.chat.completions.create(model=model, messages=HELLO, temperature=0, max_tokens=16)
    text = plain.choices[0].message.content
    assert text.strip() and plain.choices[0].finish_reason in ("stop", "length")
    receipt = plain.model_extra["bankml_receipt"]
    assert receipt["response_sha256"] == sha(text)
    assert receipt["request_sha256"] == sha(bodies[-1])
    assert receipt["completion_tokens"] == plain.usage.completion_tokens <= 16
    assert receipt["ttft_ms"] is not None and receipt["signed"] is True

    pieces, streamed_receipt = [], None
    for chunk in client.chat.completions.create(model=model, messages=HELLO, temperature=0, max_tokens=16,
                                                stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            streamed_receipt = chunk.model_extra["bankml_receipt"]
    assert "".join(pieces) == text
    assert streamed_receipt["response_sha256"] == sha(text)
    assert streamed_receipt["request_sha256"] == sha(bodies[-1])


def test_llama_server_routes_on_the_engine_address(served, smollm2_path):
    r = httpx.post(served.url("/tokenize", upstream=True), json={"content": "Hello <|im_end|> world"}, timeout=60)
    want = Tokenizer.from_gguf(smollm2_path).encode("Hello <|im_end|> world", False, True)
    assert r.json() == {"tokens": want}
    props = httpx.get(served.url("/props", upstream=True)).json()
    assert props["n_ctx"] == 512 and props["model_path"] == str(smollm2_path.resolve())
    prompt = httpx.post(served.url("/apply-template", upstream=True), json={"messages": HELLO}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and HELLO[0]["content"] in prompt


def test_a_client_that_leaves_mid_stream_frees_the_engine(served):
    body = json.dumps({"messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
                       "stream": True, "temperature": 0, "max_tokens": 400}).encode()
    with connect(served.port, timeout_s=300) as sock:
        sock.sendall(request_bytes("POST", "/v1/chat/completions", body=body))
        seen = b""
        while seen.count(b'"delta"') < 3:
            seen += sock.recv(4096)
    t0 = time.monotonic()
    r = httpx.post(served.url("/v1/chat/completions"), json={"messages": HELLO, "max_tokens": 2}, timeout=300)
    waited = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    # the engine stopped the abandoned answer within a step or two of the client leaving ...
    m = served.wait_for_log(r"(chatcmpl-\w+) aborted after (\d+) tokens: its client went away", timeout_s=60)
    assert m is not None and int(m.group(2)) < 50
    # ... and the short answer did not wait for the ~400 tokens it had to go
    rate = r.json()["timings"]["predicted_per_second"] or 1.0
    assert waited < max(5.0, 0.5 * 400 / rate)
