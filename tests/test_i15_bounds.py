"""Issue 15's routes stay cheap for a cheap request: a body that would hand the engine thousands of
sequences, or the embedder hundreds of thousands of inputs, is a 400 naming the field and its limit,
before any model work; a list the engine's queue has no room for right now is refused whole (503),
never half-submitted. Each test fails without the bound it covers."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model

from bankml.errors import Overloaded
from gateway.serving.embeddings import MAX_INPUTS
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
    thread = EngineThread(name="bounds15", max_waiting=2)
    # the thread busy with a call: what is submitted stays queued (with no engine it would answer the jobs
    # "no model is loaded" as soon as it took them, and free their room)
    started, gate = threading.Event(), threading.Event()
    thread.call(lambda: (started.set(), gate.wait(60)))
    assert started.wait(30)
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
        gate.set()
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


class _Model:
    """What /tokenize reads of a NativeModel: the tokenizer, and tokenize()."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokenize(self, text, add_special, parse_special, limit=None):
        return [int(t) for t in self.tokenizer.encode(text, add_special, parse_special)]


def test_tokenize_with_pieces_renders_each_distinct_token_once(smollm2_path, monkeypatch):
    """A 16 MiB `content` makes millions of tokens: their pieces are looked up once per distinct id and
    written as text (through jstr.dumps, one dict per token, such a body held a thread for over ten
    minutes), with the bytes llama-server's shape had before."""
    from bankml import jstr
    from gateway.openai.tokenize import tokenize_body, tokenize_json
    from model.tokenizer import Tokenizer

    model = _Model(Tokenizer.from_gguf(smollm2_path))
    for body in [{"content": "héllo <|im_start|> wörld 🎉", "with_pieces": True},
                 {"content": ["a", 5, "b"], "with_pieces": True}, {"content": "x"}, {}, {"content": ""}]:
        assert tokenize_json(model, body) == jstr.dumps({"tokens": tokenize_body(model, body)}), body
    calls = []
    real = model.tokenizer.token_to_piece
    monkeypatch.setattr(model.tokenizer, "token_to_piece", lambda t, special: calls.append(t) or real(t, special))
    body = {"content": "ab cd, é " * 20_000, "with_pieces": True}
    text = tokenize_json(model, body)
    ids = [t["id"] for t in json.loads(text)["tokens"]]
    assert len(ids) > 50_000 and sorted(calls) == sorted(set(ids))


def test_a_huge_prompt_string_is_tokenized_only_until_it_cannot_fit(smollm2_path):
    """A 6 MiB prompt is the exceed-context 400 after about twice the context's tokens (the count "at
    least"), not after tokenizing all 3M of them; a prompt a little too long keeps its exact count."""
    from bankml.errors import ContextExceeded
    from gateway.openai.completion_request import prompt_tokens
    from gateway.serving.native_model import NativeModel
    from model.tokenizer import Tokenizer

    model = NativeModel(Tokenizer.from_gguf(smollm2_path), 2048, None, SamplingParams())
    for prompt in ("a " * 3_000_000, ["hi", "a " * 3_000_000], [["a " * 3_000_000, 5]]):
        with pytest.raises(ContextExceeded) as e:
            prompt_tokens(model, prompt)
        assert e.value.extra["n_ctx"] == 2048 and 2048 < e.value.extra["n_prompt_tokens"] < 3_000_000
        assert str(e.value).startswith("request (at least ")
    assert len(prompt_tokens(model, "a " * 4000)[0]) == 4001  # over the context, under the limit: exact


def test_detokenize_looks_each_distinct_id_up_once(monkeypatch):
    from gateway.openai.tokenize import detokenize_body

    calls = []

    class Tok:
        n_vocab = 300

        def token_to_piece(self, t, special):
            calls.append(t)
            return bytes([t % 256])

    class M:
        tokenizer = Tok()

    assert detokenize_body(M(), {"tokens": [104, 105] * 100_000}) == "hi" * 100_000
    assert sorted(calls) == [104, 105]


def test_a_client_that_leaves_a_stream_of_several_prompts_cancels_every_sequence(tmp_path):
    """/completion streams two prompts x n 2 (four sequences, two at a time: two wait); the client
    reads a few events and closes: every sequence is aborted or never run, and the next request is
    answered (no sequence is left decoding for nobody)."""
    import re

    from gateway_helpers import connect, request_bytes

    s = FakeServer(*tiny_model(tmp_path), step_ms=5, engine={"max_seqs": 2})
    try:
        body = json.dumps({"prompt": ["LONG", "LONG"], "n": 2, "stream": True}).encode()
        with connect(s.port) as sock:
            sock.sendall(request_bytes("POST", "/completion", body=body))
            seen = b""
            while seen.count(b"data: ") < 6:
                seen += sock.recv(4096)
        assert s.wait_for_log(r"(?s)(fake-engine: \S+ aborted after \d+ steps.*){2}") is not None
        r = post(s, "/completion", {"prompt": "hi", "n_predict": 2})
        assert r.status_code == 200, r.text
        ended = re.findall(r"fake-engine: (\S+)-(\d) (\w+) after (\d+) steps", s.log())
        first = ended[0][0]  # the streamed request's id; its sequences are first-0 .. first-3
        ours = {int(j): (how, int(n)) for rid, j, how, n in ended if rid == first}
        # the two running were aborted long before their 5000 pieces; the two waiting never ran (or, if
        # the engine had taken them already, were aborted there too)
        assert {0, 1} <= set(ours) and all(how == "aborted" and n < 1000 for how, n in ours.values()), ended
    finally:
        s.stop()


def test_embd_normalize_past_a_c_int_is_a_400_naming_it(server):
    for value in (10**30, 1e300, -2**40, 2**31):
        r = post(server, "/embedding", {"content": "hello", "embd_normalize": value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("'embd_normalize' must be an int"), r.text
    for value in (-1, 0, 1, 2, 3, 1.7, True):  # llama-server's own conversions stand
        assert post(server, "/embedding", {"content": "hello", "embd_normalize": value}).status_code == 200


def test_tokenize_with_pieces_is_bounded_and_the_ids_are_not(server):
    from gateway.openai.tokenize import MAX_PIECES

    content = "a" * (MAX_PIECES + 1)  # the fake's tokenizer: one token per byte
    r = post(server, "/tokenize", {"content": content, "with_pieces": True})
    assert r.status_code == 400, r.text[:200]
    assert r.json()["error"]["message"] == (f"'with_pieces': the content makes {MAX_PIECES + 1} tokens, more than this "
                                            f"server writes pieces for (at most {MAX_PIECES}); ask without "
                                            "with_pieces, or in parts")
    r = post(server, "/tokenize", {"content": content})
    assert r.status_code == 200 and len(r.json()["tokens"]) == MAX_PIECES + 1
