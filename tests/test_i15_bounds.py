"""Issue 15's routes stay cheap for a cheap request: a body that would hand the engine thousands of
sequences, or the embedder hundreds of thousands of inputs, is a 400 naming the field and its limit,
before any model work; a list the engine's queue has no room for right now is refused whole (503),
never half-submitted. Each test fails without the bound it covers."""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model

from bankml.errors import Overloaded
from gateway.embeddings import MAX_INPUTS
from model.engine_thread import EngineThread
from model.messages import GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

MAX_SEQS, MAX_WAITING = 1, 2  # so one request may hand the engine at most 3 sequences


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("bounds15")),
                   engine={"max_seqs": MAX_SEQS, "max_waiting": MAX_WAITING})
    yield s
    s.stop()


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url(path), content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=30)


@pytest.mark.parametrize("path", ["/completion", "/completions", "/v1/completions"])
def test_more_prompts_than_the_engine_takes_is_a_400_naming_the_limit(server, path):
    r = post(server, path, {"prompt": ["ab"] * 5000, "max_tokens": 1, "n_predict": 1})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message == ("'prompt': 5000 prompts x n 1 = 5000 sequences, more than one request may hand the engine "
                       "(at most 3: [engine] max_seqs + max_waiting)")
    # what fits is answered
    r = post(server, path, {"prompt": ["ab"] * (MAX_SEQS + MAX_WAITING), "max_tokens": 1, "n_predict": 1})
    assert r.status_code == 200, r.text


def test_an_empty_list_and_a_token_list_are_one_prompt_each_not_a_count(server):
    r = post(server, "/completion", {"prompt": [1] * 5000, "n_predict": 1})  # one prompt of 5000 ids
    assert "sequences" not in r.text
    r = post(server, "/completion", {"prompt": [], "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["message"] == '"prompt" must not be empty'


def test_submit_all_queues_all_or_none():
    """The engine's queue takes a request's sequences together or refuses them together."""
    thread = EngineThread(name="bounds15", max_waiting=2)  # no engine: nothing runs, everything waits
    try:
        def req(i: int) -> GenerateRequest:
            return GenerateRequest([1, 2], SamplingParams(), request_id=f"r{i}")

        seen = []
        with pytest.raises(Overloaded):
            thread.submit_all([(req(i), seen.append) for i in range(3)])
        assert thread.in_flight() == (0, 0) and seen == []  # nothing was queued
        tickets = thread.submit_all([(req(i), seen.append) for i in range(2)])
        assert len(tickets) == 2
        with pytest.raises(Overloaded):
            thread.submit(req(9), seen.append)
    finally:
        thread.stop()


def test_embeddings_take_at_most_2048_inputs_counted_before_any_model_work(server):
    many = ["a"] * (MAX_INPUTS + 1)
    for path, field in [("/v1/embeddings", "input"), ("/embedding", "content"), ("/embeddings", "input")]:
        r = post(server, path, {field: many})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["message"] == (f"'{field}': {MAX_INPUTS + 1} inputs, more than one request may "
                                                f"hold (at most {MAX_INPUTS}, as OpenAI's embeddings API)")
    r = post(server, "/api/embed", {"model": "tiny-model.q8_0", "input": many})
    assert r.status_code == 400 and "at most 2048" in r.json()["error"], r.text
    # a token list of any length is one input (refused later by its own rules, never by this count)
    r = post(server, "/v1/embeddings", {"input": [1] * (MAX_INPUTS + 1)})
    assert "inputs, more than" not in r.text
