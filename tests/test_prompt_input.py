"""One reader of a request's prompts (gateway/serving/prompt_input.py, llama-server's tokenize_input_prompts)
for /completion, /v1/completions and the embedding routes: what b11434 recorded on one route holds on
the others, only the field named in the empty list's 400 differs."""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model

from gateway.serving.prompt_input import ELEMENTS

pytestmark = pytest.mark.timeout(120)

MULTIMODAL = "Multimodal data provided, but model does not support multimodal requests."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("prompt_input")), engine={"max_seqs": 2})
    yield s
    s.stop()


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url(path), content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=30)


def err(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["message"]


@pytest.mark.parametrize("path,field", [("/completion", "prompt"), ("/v1/completions", "prompt"),
                                        ("/v1/embeddings", "input"), ("/embedding", "content")])
def test_every_route_reads_prompts_alike(server, path, field):
    extra = {"n_predict": 1, "max_tokens": 1} if "compl" in path else {}
    # a float is not a token id (recorded on /completion: prompt_float); embeddings took it as one
    assert err(post(server, path, {field: [1.5, 2], **extra})) == (400, ELEMENTS)
    assert err(post(server, path, {field: [1, True], **extra})) == (400, ELEMENTS)
    # b11434's object prompt with media on a text-only model (recorded on /v1/embeddings: multimodal_data,
    # a 500 there; the request's fault, so a 400 here, as llama-server's own tests now want)
    body = {field: {"prompt_string": "x", "multimodal_data": []}, **extra}
    assert err(post(server, path, body)) == (400, MULTIMODAL)
    shown = "input" if "embed" in path else "prompt"
    assert err(post(server, path, {field: [], **extra})) == (400, f'"{shown}" must not be empty')
    # an object's content parts are one prompt of their joined texts
    r = post(server, path, {field: {"content": [{"type": "text", "text": "hi"}]}, **extra})
    assert r.status_code == 200, r.text
