"""The embedding routes over the fake engine, against llama-server's recorded answers (b11434 --embeddings,
tests/fixtures/embeddings_smollm2.json): its refusals, statuses and shapes, its normalizations
(common_embd_normalize) on its own raw vectors, its prompt splitting on SmolLM2's tokenizer, the
`openai` and `ollama` clients unchanged, and receipts that hash the vectors exactly as written."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
from fake_engine import fake_embedding
from gateway_helpers import FakeServer, tiny_model

from bankml.errors import RequestFailed
from gateway.ollama.embed import float32_json, go_float32, ollama_normalize
from gateway.openai.embeddings import EmbeddingRequest, check_task, input_prompts, normalize
from gateway.serving.native_model import NativeModel

pytestmark = pytest.mark.timeout(120)

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "embeddings_smollm2.json").read_text())
MEAN = FIXTURE["answers"]["mean"]  # llama-server --pooling mean: what bankml serves for a chat model


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("embed")))
    yield s
    s.stop()


def post(server, path: str, body) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return httpx.post(server.url(path), content=data, headers={"Content-Type": "application/json"}, timeout=30)


def fake_vector(text: str) -> np.ndarray:
    return fake_embedding(list(text.encode("utf-8")))  # the fake tokenizer: one token per byte


# --- llama-server's rules, on its own numbers ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["norm_maxabs", "norm_taxicab", "norm_euclid", "norm_p3", "norm_float", "norm_bool",
                                  "norm_none"])
def test_normalization_is_common_embd_normalize(name):
    raw = np.array(MEAN["norm_none"]["body"][0]["embedding"][0], np.float32)  # embd_normalize -1: the pooled vector
    request = EmbeddingRequest(FIXTURE_REQUESTS[name], oai=False)
    want = np.array(MEAN[name]["body"][0]["embedding"][0], np.float32)
    np.testing.assert_allclose(normalize(raw, request.normalize), want, rtol=1e-6, atol=1e-9)


FIXTURE_REQUESTS = {
    "norm_maxabs": {"content": "x", "embd_normalize": 0}, "norm_taxicab": {"content": "x", "embd_normalize": 1},
    "norm_euclid": {"content": "x"}, "norm_p3": {"content": "x", "embd_normalize": 3},
    "norm_float": {"content": "x", "embd_normalize": 1.7}, "norm_bool": {"content": "x", "embd_normalize": True},
    "norm_none": {"content": "x", "embd_normalize": -1},
}


@pytest.fixture(scope="module")
def smollm2_model(smollm2_path):
    from model.tokenizer import Tokenizer

    return NativeModel(Tokenizer.from_gguf(smollm2_path), 2048, None, None)


@pytest.mark.parametrize("name", ["oai_short", "oai_multibyte", "oai_batch", "oai_tokens", "oai_token_lists",
                                  "oai_base64", "llama_batch", "long_400", "oai_mixed", "obj_prompt_string",
                                  "obj_content_parts", "obj_list"])
def test_inputs_split_and_tokenize_as_llama_server(smollm2_model, name):
    _, body = FIXTURE["requests"][name]
    got = input_prompts(smollm2_model, body.get("input", body.get("content")))
    if name == "oai_mixed":  # ["Hello", 905, " again"]: one prompt, the BOS rule on its first piece only
        hello, again = FIXTURE["tokens"]["mixed_parts"]
        assert got == [hello + [905] + again]
        assert MEAN[name]["body"]["usage"]["prompt_tokens"] == len(got[0])
    elif name.startswith("obj_"):  # objects: prompt_string, or content parts whose texts are joined
        assert len(got) == len(MEAN[name]["body"]["data"])
        if name == "obj_content_parts":
            assert got[0] == got[1]
    else:
        assert got == FIXTURE["tokens"][name]
    usage = MEAN[name]["body"]["usage"]["prompt_tokens"] if isinstance(MEAN[name]["body"], dict) else None
    assert usage in (None, sum(len(t) for t in got))


# --- refusals: llama-server's status, type and message ------------------------------------------------------


# depend on SmolLM2's tokenizer (the fake's is one token per byte) or are served otherwise (dimensions)
COUNTED = {"too_large", "too_large_llama"}
# the JSON parser's own words are gateway/openai/chat_request.py's (shared with /v1/chat/completions)
PARSER = {"not_json"}
OURS = {"dimensions_other", "dimensions_same"}
# recorded from b11434; later llama-server builds embed an empty input (200, test_embedding.py) and refuse media
# on a text model with a 400: test_llama_server_edges.py holds those answers
LATER = {"content_empty", "empty_in_list", "empty_string", "part_text_number",
         "content_audio", "content_image", "multimodal_data"}


@pytest.mark.parametrize("name", sorted(set(FIXTURE["refusals"]) - OURS - LATER))
def test_refusals_are_llama_servers(server, name):
    rec = FIXTURE["refusals"][name]
    r = post(server, rec["path"], rec["request"])
    want = rec["body"]["error"]
    got = r.json()["error"]
    assert (r.status_code, got["code"], got["type"]) == (rec["status"], want["code"], want["type"])
    if name in COUNTED:  # the same words, with our tokenizer's count
        assert re.fullmatch(r"input \(\d+ tokens\) is too large to process\. increase the physical batch size "
                            r"\(current batch size: 512\)", got["message"])
    elif name not in PARSER:
        assert got["message"] == want["message"]


def test_the_physical_batch_is_the_context_when_that_is_smaller():
    rec = FIXTURE["small_context"]
    n = int(re.match(r"input \((\d+) tokens\)", rec["body"]["error"]["message"]).group(1))
    with pytest.raises(RequestFailed) as e:
        check_task([1] * n, rec["n_ctx"], 49152)
    assert (rec["status"], e.value.message) == (500, rec["body"]["error"]["message"])
    check_task([1] * rec["n_ctx"], rec["n_ctx"], 49152)  # a whole context fits


def test_dimensions_other_than_the_models_are_refused(server):
    # llama-server ignores `dimensions` and answers its full vector: a client asking for 64 would not get 64
    r = post(server, "/v1/embeddings", {"input": "x", "dimensions": 4})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("dimensions: this model's embeddings "
                                                                            "have 8 dimensions")
    assert post(server, "/v1/embeddings", {"input": "x", "dimensions": 8}).status_code == 200


# --- shapes --------------------------------------------------------------------------------------------------


def _skeleton(value):
    """The JSON's shape: keys in order, value types, list lengths of objects (vectors' lengths dropped)."""
    if isinstance(value, dict):
        return [(k, _skeleton(v)) for k, v in value.items() if k not in ("bankml_receipt", "model")]
    if isinstance(value, list):
        if value and all(isinstance(v, int | float) for v in value):
            return "vector"
        return [_skeleton(v) for v in value]
    if isinstance(value, str) and len(value) > 40:
        return "base64"
    return type(value).__name__ if not isinstance(value, str) else value


@pytest.mark.parametrize("name", ["oai_short", "oai_batch", "oai_base64", "oai_content", "alias_embeddings",
                                  "llama_short", "llama_batch", "llama_input", "oai_token_lists"])
def test_answers_have_llama_servers_shape(server, name):
    path, body = FIXTURE["requests"][name]
    r = post(server, path, body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    got, want = r.json(), MEAN[name]["body"]
    if isinstance(want, dict):
        assert got["usage"] == {"prompt_tokens": sum(len(t) for t in _fake_tokens(body)),
                                "total_tokens": sum(len(t) for t in _fake_tokens(body))}
        got["usage"] = want["usage"]
        assert got["model"] == "Tiny-Model.Q8_0.gguf"  # the file's name, not llama-server's path of it
    assert _skeleton(got) == _skeleton(want)


def _fake_tokens(body: dict) -> list[list[int]]:
    value = body.get("input", body.get("content"))
    if isinstance(value, str):
        return [list(value.encode())]
    if all(isinstance(v, int) for v in value):
        return [value]
    return [list(v.encode()) if isinstance(v, str) else v for v in value]


def test_vectors_base64_and_the_model_named(server):
    r = post(server, "/v1/embeddings", {"input": ["Hello", "there"], "model": "tiny-model.q8_0"})
    floats = [d["embedding"] for d in r.json()["data"]]
    assert r.json()["model"] == "tiny-model.q8_0"  # llama-server echoes the request's model
    for text, v in zip(["Hello", "there"], floats, strict=True):
        np.testing.assert_array_equal(np.array(v, np.float32), normalize(fake_vector(text), 2))
    r = post(server, "/v1/embeddings", {"input": ["Hello", "there"], "encoding_format": "base64"})
    for item, v in zip(r.json()["data"], floats, strict=True):
        assert item["encoding_format"] == "base64"
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(item["embedding"]), "<f4"), np.float32(v))
    r = post(server, "/embedding", {"content": "Hello", "embd_normalize": -1})
    np.testing.assert_array_equal(np.float32(r.json()[0]["embedding"][0]), fake_vector("Hello"))


def test_many_inputs_come_back_in_order(server):
    texts = [f"text number {i}" + "!" * (i % 7) for i in range(40)]  # 3 engine calls, by length
    r = post(server, "/v1/embeddings", {"input": texts})
    assert [d["index"] for d in r.json()["data"]] == list(range(40))
    for text, d in zip(texts, r.json()["data"], strict=True):
        np.testing.assert_array_equal(np.float32(d["embedding"]), normalize(fake_vector(text), 2))


def test_content_parts_embed_as_their_joined_text(server):
    r = post(server, "/v1/embeddings", FIXTURE["requests"]["obj_content_parts"][1])
    assert r.json()["data"][0]["embedding"] == r.json()["data"][1]["embedding"]


def test_any_model_name_is_the_one_model_and_routes_are_exact(server):
    r = post(server, "/v1/embeddings", {"input": "x", "model": "text-embedding-3-small"})
    assert r.status_code == 200 and r.json()["model"] == "text-embedding-3-small"  # echoed, as llama-server does
    assert httpx.get(server.url("/v1/embeddings")).status_code == 404


def test_the_openai_client_unchanged(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    out = client.embeddings.create(input=["Hello", "Ça va ✓"], model="tiny-model.q8_0")  # it asks for base64
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens == len("HelloÇa va ✓".encode())
    for text, d in zip(["Hello", "Ça va ✓"], out.data, strict=True):
        np.testing.assert_allclose(d.embedding, normalize(fake_vector(text), 2), rtol=1e-6)
    out = client.embeddings.create(input="Hello", model="tiny-model.q8_0", encoding_format="float")
    assert abs(np.linalg.norm(out.data[0].embedding) - 1) < 1e-6


# --- receipts ------------------------------------------------------------------------------------------------


def test_receipts_hash_the_vectors_as_written(server):
    body = json.dumps({"input": ["Hello", "there"], "encoding_format": "base64"}).encode()
    for path, payload in (("/v1/embeddings", body), ("/v1/embeddings", b'{"input": [[1, 2, 3], "abc"]}')):
        r = httpx.post(server.url(path), content=payload, headers={"Content-Type": "application/json"})
        written = re.findall(r'"embedding": (\[[^\]]*\]|"[^"]*")', r.text)
        receipt = r.json()["bankml_receipt"]
        assert receipt["response_sha256"] == sha("[" + ",".join(written) + "]")
        assert receipt["request_sha256"] == sha(payload)
        assert (receipt["prompt_tokens"], receipt["completion_tokens"]) == (r.json()["usage"]["prompt_tokens"], 0)
    payload = b'{"content": ["Hello", "there!"]}'
    r = httpx.post(server.url("/embedding"), content=payload, headers={"Content-Type": "application/json"})
    written = re.findall(r'"embedding": (\[\[[^\]]*\]\])', r.text)
    assert len(written) == 2
    for item, w, n in zip(r.json(), written, (5, 6), strict=True):  # one receipt per answer object
        assert item["bankml_receipt"]["response_sha256"] == sha(w)
        assert (item["bankml_receipt"]["prompt_tokens"], item["bankml_receipt"]["request_sha256"]) == (n, sha(payload))


# --- Ollama ------------------------------------------------------------------------------------------------


def test_go_writes_float32_shortest():
    assert [go_float32(v) for v in (0.1, 1e-7, 1.5e-9, 3e-6, 123456.79, 1e21, -2.5, 0.0)] == [
        "0.1", "1e-7", "1.5e-9", "0.000003", "123456.79", "1e+21", "-2.5", "0"]
    v = np.array([0.1, -1e-8, 2], np.float32)
    assert np.array_equal(np.array(json.loads(float32_json(v)), np.float32), v)


def test_api_embed(server):
    r = post(server, "/api/embed", {"model": "tiny-model.q8_0", "input": ["Hello", "there"], "keep_alive": "1m"})
    obj = r.json()
    assert r.status_code == 200 and list(obj) == ["model", "embeddings", "total_duration", "load_duration",
                                                  "prompt_eval_count", "bankml_receipt"]
    assert obj["model"] == "tiny-model.q8_0:latest" and obj["prompt_eval_count"] == 10
    for text, v in zip(["Hello", "there"], obj["embeddings"], strict=True):
        np.testing.assert_array_equal(np.float32(v), ollama_normalize(fake_vector(text)))
    written = re.search(r'"embeddings": (\[\[.*?\]\])', r.text).group(1)
    assert obj["bankml_receipt"]["response_sha256"] == sha(written)
    r = post(server, "/api/embed", {"input": "Hello", "dimensions": 3}).json()
    want = ollama_normalize(ollama_normalize(fake_vector("Hello"))[:3])
    np.testing.assert_array_equal(np.float32(r["embeddings"][0]), want)
    assert abs(np.linalg.norm(r["embeddings"][0]) - 1) < 1e-6


def test_api_embed_truncation_and_refusals(server):
    long = "a" * 5000  # 5000 fake tokens; the context is 4096
    r = post(server, "/api/embed", {"input": long})
    # Ollama's limit: the context less one for the missing BOS and one for the missing EOS
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 4094
    r = post(server, "/api/embed", {"input": long, "truncate": False})
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})
    r = post(server, "/api/embed", {"input": long, "options": {"num_ctx": 100}})
    assert r.json()["prompt_eval_count"] == 98
    for bad in ({"input": 3}, {"input": ["a", 1]}, {"input": {"a": 1}}):
        r = post(server, "/api/embed", bad)
        assert (r.status_code, r.json()) == (400, {"error": "invalid input type"})
    r = post(server, "/api/embed", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and "not found" in r.json()["error"]
    r = post(server, "/api/embed", {"input": "x", "options": {"bogus": 1}})
    assert r.status_code == 400 and r.json()["error"].startswith("options.bogus")
    r = post(server, "/api/embed", {"model": "tiny-model.q8_0"})  # no input: it only loads
    assert (r.status_code, r.json()) == (200, {"model": "tiny-model.q8_0:latest", "embeddings": []})


def test_api_embeddings_legacy(server):
    r = post(server, "/api/embeddings", {"model": "tiny-model.q8_0", "prompt": "Hello"})
    obj = r.json()
    assert list(obj) == ["embedding", "bankml_receipt"]
    np.testing.assert_array_equal(np.float32(obj["embedding"]), fake_vector("Hello"))  # not normalized
    written = re.search(r'"embedding": (\[[^\]]*\])', r.text).group(1)
    assert obj["bankml_receipt"]["response_sha256"] == sha(written)
    assert post(server, "/api/embeddings", {"prompt": ""}).json() == {"embedding": []}
    assert post(server, "/api/embeddings", {"prompt": 3}).status_code == 400


def test_the_ollama_client_unchanged(server):
    client = ollama.Client(host=server.url(""))
    out = client.embed(model="tiny-model.q8_0", input=["Hello", "there"])
    assert len(out.embeddings) == 2 and out.prompt_eval_count == 10
    np.testing.assert_allclose(out.embeddings[0], ollama_normalize(fake_vector("Hello")), rtol=1e-6)
    legacy = client.embeddings(model="tiny-model.q8_0", prompt="Hello")
    np.testing.assert_allclose(legacy.embedding, fake_vector("Hello"), rtol=1e-6)
