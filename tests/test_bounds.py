"""Requests that must stay cheap (issue 11, item 9): each bound here was missing when a server was
probed over loopback, and each test fails without it.

- tokenization: a prompt that cannot fit is refused before it is tokenized whole (counted by the
  merges it did), one giant word neither takes gigabytes nor goes unanswered, the caches are bounded;
- DRY's breakers and the stop strings: bounded, with a 400 naming the field; the restart sequences
  are the same as a pass over the vocabulary gives, and their cache is bounded;
- a lone surrogate, a deep grammar and a JSON `response_format` are 400s with the reason, over the wire.
"""

from __future__ import annotations

import json
import logging
import random
import re

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model
from tiny_gguf import write_tiny_gguf

from bankml.errors import BankmlError
from gateway.http.errors import error_body, status_of
from gateway.openai.chat_request import parse_chat
from gateway.serving.native_model import NativeModel
from gateway.serving.request_fields import MAX_DRY_BREAKERS, MAX_STOP_BYTES, MAX_STOPS
from model import tokenizer_bpe
from model.dry import MAX_CHAR_LEN, MAX_SEQ_LEN, RestartCache, restart_sequences
from model.engine import Engine
from model.gbnf import parse_gbnf
from model.messages import SamplingParams
from model.stops import find_partial_stop
from model.tokenizer import Tokenizer, TokenLimitExceeded
from model.tokenizer_bpe import byte_encode

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def count_merges(monkeypatch, tok: Tokenizer) -> list[str]:
    """The words the BPE merge loop is asked to merge, from now on."""
    calls: list[str] = []
    merge = tok._bpe._word

    def counted(word: str, merges_only: bool = False):
        calls.append(word)
        return merge(word, merges_only)

    monkeypatch.setattr(tok._bpe, "_word", counted)
    return calls


def longest_token_bytes(tok: Tokenizer) -> int:
    return max(len(t) for t in tok.tokens)  # SmolLM2: byte-level text, one character per byte


# --- 1. tokenization -------------------------------------------------------------------------------

def test_a_text_that_cannot_fit_is_refused_before_any_merge(smollm2, monkeypatch):
    merges = count_merges(monkeypatch, smollm2)
    text = "a" * (16 << 20)  # the probe's 16 MiB body of one word: 98 s and 5 GB before its 400
    with pytest.raises(TokenLimitExceeded) as e:
        smollm2.encode(text, True, True, limit=5000)
    assert merges == []
    assert e.value.at_least == -(-len(text) // longest_token_bytes(smollm2))  # no token covers more


def test_the_tokenizer_stops_once_the_tokens_pass_the_limit(smollm2, monkeypatch):
    rng = random.Random(7)
    words = ["".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(9)) for _ in range(20000)]
    merges = count_merges(monkeypatch, smollm2)
    with pytest.raises(TokenLimitExceeded) as e:
        smollm2.encode(" ".join(words), False, False, limit=3000)
    assert 3000 < e.value.at_least < 3000 + 20
    assert 0 < len(merges) < 3000  # a few tokens a word: far from the 20,000 words of the text


def test_the_chat_prompt_says_at_least_in_llama_servers_error(smollm2):
    model = NativeModel(smollm2, 2048, None, SamplingParams())
    with pytest.raises(BankmlError) as e:
        model.prompt([{"role": "user", "content": "hi " * 1_000_000}])
    body = json.loads(error_body(e.value))
    n = body["error"]["n_prompt_tokens"]
    assert n > 2 * 2048
    assert body == {"error": {"code": 400, "message": f"request (at least {n} tokens) exceeds the available context "
                                                      "size (2048 tokens), try increasing it",
                              "type": "exceed_context_size_error", "n_prompt_tokens": n, "n_ctx": 2048}}
    # a prompt a little too long is tokenized whole: the route gives llama-server's exact count
    messages = [{"role": "user", "content": "hi " * 2100}]
    assert model.prompt(messages) == smollm2.encode(model.render(messages), True, True)


def test_tokenize_of_one_giant_word_is_a_400_with_the_reason(smollm2, monkeypatch):
    merges = count_merges(monkeypatch, smollm2)
    model = NativeModel(smollm2, 2048, None, SamplingParams())
    with pytest.raises(BankmlError) as e:
        model.tokenize("a" * (16 << 20), False, True)
    assert status_of(e.value) == 400
    assert e.value.message == ("the text holds a run of more than 65536 characters that the tokenizer cannot cut "
                               "without changing its tokens")
    assert merges == []


def test_a_long_word_is_merged_in_pieces_that_give_its_tokens(smollm2, monkeypatch):
    rng = random.Random(3)
    punct = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    word = "".join(rng.choice(punct) for _ in range(3000))  # one pre-token: ` ?[^\s\p{L}\p{N}]+`
    whole = smollm2._bpe._word(byte_encode(word))  # merged whole, as llama.cpp merges it
    monkeypatch.setattr(tokenizer_bpe, "MAX_MERGE_CHARS", 64)
    merges = count_merges(monkeypatch, smollm2)
    assert smollm2.encode(word, False, False) == list(whole)
    assert len(merges) >= 3000 // 64 and max(map(len, merges)) <= 64


def test_a_long_sentencepiece_fragment_is_merged_in_pieces_that_give_its_tokens(gemma3_path, monkeypatch):
    gemma3 = Tokenizer.from_gguf(gemma3_path)
    rng = random.Random(5)
    text = " ".join(rng.choice(["the", "quick", "brown", "fox", "Ça", "va", "ünïcode", "42", "jumps"])
                    for _ in range(600))
    whole = gemma3.encode(text, False, False)
    gemma3._spm._cache.clear()
    monkeypatch.setattr(tokenizer_bpe, "MAX_MERGE_CHARS", 64)
    calls: list[str] = []
    merge = gemma3._spm._merge
    monkeypatch.setattr(gemma3._spm, "_merge", lambda chunk: calls.append(chunk) or merge(chunk))
    assert gemma3.encode(text, False, False) == whole
    assert len(calls) > len(text) // 64 and max(map(len, calls)) <= 64


def test_the_word_cache_is_bounded_by_bytes(smollm2, monkeypatch):
    bpe = smollm2._bpe
    monkeypatch.setattr(bpe._cache, "max_bytes", 20_000)
    bpe._cache.clear()
    rng = random.Random(11)
    for _ in range(2000):
        bpe.tokenize(" " + "".join(rng.choice("abcdefgh") for _ in range(12)))
        assert bpe._cache.nbytes <= 20_000
    assert 0 < len(bpe._cache) < 2000
    long_word = " " + "ab" * 200
    bpe.tokenize(long_word)
    assert long_word not in bpe._cache  # a word that long is rarely seen twice: not kept


# --- 2. DRY's breakers and the stop strings ---------------------------------------------------------

def refusal(fields: dict) -> str:
    with pytest.raises(BankmlError) as e:
        parse_chat(json.dumps({"messages": HI, **fields}).encode())
    assert status_of(e.value) == 400
    return e.value.message


def test_dry_breakers_past_the_bound_are_a_400_naming_the_field():
    dry = {"dry_multiplier": 0.8}
    many = [f"b{i}" for i in range(MAX_DRY_BREAKERS + 1)]
    assert refusal({**dry, "dry_sequence_breakers": many}) == (
        f"'dry_sequence_breakers' is not supported by bankml serve --native: more than {MAX_DRY_BREAKERS} "
        f"breakers (got {MAX_DRY_BREAKERS + 1})")
    ok = parse_chat(json.dumps({"messages": HI, **dry, "dry_sequence_breakers": many[:-1]}).encode())
    assert len(ok.params.dry_sequence_breakers) == MAX_DRY_BREAKERS
    # DRY off: the breakers cost nothing, and llama-server takes them
    off = parse_chat(json.dumps({"messages": HI, "dry_sequence_breakers": many * 100}).encode())
    assert len(off.params.dry_sequence_breakers) == len(many) * 100


def test_stop_strings_past_the_bounds_are_a_400_naming_the_field():
    words = [f"w{i}" for i in range(MAX_STOPS + 1)]
    assert refusal({"stop": words}) == (f"'stop' is not supported by bankml serve --native: more than {MAX_STOPS} "
                                        f"stop strings (got {MAX_STOPS + 1})")
    long_stop = "é" * (MAX_STOP_BYTES // 2 + 1)  # few characters, more bytes than the bound
    assert refusal({"stop": long_stop}) == (f"'stop' is not supported by bankml serve --native: a stop string of "
                                            f"more than {MAX_STOP_BYTES} bytes")
    ok = parse_chat(json.dumps({"messages": HI, "stop": ["x" * MAX_STOP_BYTES] * MAX_STOPS}).encode())
    assert len(ok.params.stop) == MAX_STOPS


def _restarts_by_a_pass(breakers, pieces, encode):
    """llama.cpp's get_overlapping_token_sequences as written there: every token, every breaker."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        s = breaker.encode()[:MAX_CHAR_LEN]
        for token, word in enumerate(pieces):
            if s in word:
                if () not in out.setdefault(token, []):
                    out[token].append(())
                continue
            for pos in range(len(word)):
                if word[pos:] == s[:len(word) - pos]:
                    tail = tuple(encode(s[len(word) - pos:].decode("utf-8", "replace")))[:MAX_SEQ_LEN]
                    if tail not in out.setdefault(token, []):
                        out[token].append(tail)
    return {t: v for t, v in out.items() if v}


def test_restart_sequences_are_what_a_pass_over_the_vocabulary_gives(smollm2):
    pieces = [smollm2.token_to_piece(t, True) for t in range(smollm2.n_vocab)]
    encode = lambda text: smollm2.encode(text, False, False)  # noqa: E731
    for breakers in (["\n", ":", "\"", "*"], ["ing "], ["é", "😀x"], ["<|im_end|>"], ["the quick brown fox " * 3]):
        assert restart_sequences(breakers, pieces, encode) == _restarts_by_a_pass(breakers, pieces, encode)


def test_the_restart_cache_keeps_the_recent_lists_within_its_bounds():
    cache = RestartCache(max_entries=4, max_bytes=1 << 20)
    for i in range(10):
        cache.get((f"b{i}",), lambda: {1: [()]})
        cache.get(("b0",), lambda: pytest.fail("b0 is used every time: it stays"))
    assert len(cache) == 4
    small = RestartCache(max_entries=100, max_bytes=10_000)
    for i in range(10):
        small.get((f"b{i}",), lambda: {t: [(t, t)] for t in range(20)})
    assert small.n_bytes <= 10_000 and len(small) < 10


def test_the_engine_frees_the_restart_sequences_of_old_breaker_lists(tmp_path):
    engine = Engine.load(write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1), verified=True, n_ctx=64,
                         warmup=False)
    for i in range(50):  # each request may name its own list: the probe's 10 MB a request, never freed
        engine.runner._restarts((f"b{i}", "\n"))
    assert len(engine.runner._dry_restarts) <= 8


def test_the_partial_stop_is_the_longest_prefix_of_a_stop_the_text_ends_with():
    rng = random.Random(1)
    for _ in range(20000):
        text = bytes(rng.choice(b"ab\xc3") for _ in range(rng.randint(0, 9)))
        stops = [bytes(rng.choice(b"ab\xc3") for _ in range(rng.randint(1, 9))) for _ in range(2)]
        want = min((len(text) - n for s in stops for n in range(1, min(len(s), len(text)) + 1)
                    if text.endswith(s[:n])), default=None)
        assert find_partial_stop(text, stops) == want


# --- 3-5. over the wire ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("bounds")))
    yield s
    s.stop()


def post_raw(server, body: bytes) -> httpx.Response:
    return httpx.post(server.url("/v1/chat/completions"), content=body,
                      headers={"Content-Type": "application/json"}, timeout=60)


def test_a_lone_surrogate_in_content_role_or_stop_is_a_400(server):
    high = "invalid string: surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF"
    low = "invalid string: surrogate U+DC00..U+DFFF must follow U+D800..U+DBFF"
    for body, why in ((rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', high),
                      (rb'{"messages": [{"role": "\udfff", "content": "hi"}]}', low),
                      (rb'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud83d"]}', high),
                      (b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
                       "invalid string: ill-formed UTF-8 byte")):
        r = post_raw(server, body)
        assert r.status_code == 400, body
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("[json.exception.parse_error.101] parse error at line 1, column ")
        assert error["message"].endswith("syntax error while parsing value - " + why)
    # a pair is one character, and an escaped backslash before "ud800" is text
    r = post_raw(server, rb'{"messages": [{"role": "user", "content": "\ud83d\ude00 \\ud800"}], "max_tokens": 1}')
    assert r.status_code == 200, r.text


ACCESS_LINE = re.compile(r"bankml serve: (GET|POST) /\S* \d{3} ")


def test_a_deep_grammar_is_a_400_and_one_line_of_log_at_most(server):
    server.wait_for_log(r"Worker ready")  # the worker's start lines are not the request's
    before = len(server.lines)
    deep = "root ::= " + "(" * 10000 + '"a"' + ")" * 10000
    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, "grammar": deep}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("'grammar' is not supported by bankml serve --native: groups nested "
                                            "deeper than 256 levels")
    long = 'root ::= "' + "a" * 70000 + '"'
    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, "grammar": long}, timeout=60)
    assert r.status_code == 400 and "more than 65536 characters" in r.json()["error"]["message"]
    server.wait_for_log(r"(?s)(POST /v1/chat/completions 400 .*){2}")  # the access log's two lines
    said = [line for line in server.lines[before:] if not ACCESS_LINE.match(line)]
    assert len(said) <= 1 and "Traceback" not in server.log()


def test_a_chain_of_thousands_of_rules_parses():
    chain = "\n".join(f"r{i} ::= r{i + 1}" for i in range(5000)) + '\nr5000 ::= "a"\nroot ::= r0'
    rules, symbols = parse_gbnf(chain)  # its left-recursion check walked 5000 rules deep
    assert len(rules) == 5002 and "root" in symbols


def test_a_schema_llguidance_cannot_read_is_a_400_before_the_model(server):
    # 1e400 is no double: llguidance's reason, before any model work (gateway/serving/constraints.py)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", ' \
           b'"json_schema": {"schema": {"type": "number", "maximum": 1e400}}}}'
    r = post_raw(server, body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Failed to initialize samplers: number out of range")
    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, "response_format": {"type": "text"},
                                                             "max_tokens": 1}, timeout=60)
    assert r.status_code == 200


# --- found by probing the merged server -------------------------------------------------------------


def test_openai_fields_this_engine_cannot_honour_are_refused_by_name(server):
    cases = {
        "functions": {"functions": [{"name": "f", "parameters": {}}]},
        "function_call": {"function_call": "auto"},
        "audio": {"audio": {"voice": "alloy", "format": "wav"}},
        "modalities": {"modalities": ["text", "audio"]},
        "prediction": {"prediction": {"type": "content", "content": "x"}},
        "web_search_options": {"web_search_options": {}},
        "response_format": {"response_format": "json"},
    }
    for name, fields in cases.items():
        r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, **fields}, timeout=60)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["message"].startswith(f"'{name}' is not supported by bankml serve --native"), name
    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        'Invalid tool_choice: "required" asks for a tool call, but the request has no tools'
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json={"messages": HI, "modalities": ["text"], "tool_choice": "none", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_apply_template_reads_messages_as_a_chat_does(server):
    r = httpx.post(server.url("/apply-template"), content=rb'{"messages": [{"role": "user", "content": "a\ud800"}]}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "parse_error.101" in r.json()["error"]["message"]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]}
    plain = {"messages": [{"role": "user", "content": "Say\nhi"}]}  # llama-server joins text parts by lines
    r = httpx.post(server.url("/apply-template"), json=parts, timeout=60)
    assert r.status_code == 200 and r.json() == httpx.post(server.url("/apply-template"), json=plain, timeout=60).json()


def test_tokenize_takes_ids_mixes_and_pieces_as_llama_server(server):
    # issue 15: these were refused; now read as llama-server reads them (tests/test_llama_routes_small.py
    # compares them with its recorded answers on SmolLM2)
    r = httpx.post(server.url("/tokenize"), json={"content": ["a", 1]}, timeout=60)
    assert (r.status_code, r.json()) == (200, {"tokens": [97, 1]})
    r = httpx.post(server.url("/tokenize"), json={"content": 123}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "[json.exception.type_error.302] type must be string, but is number"
    r = httpx.post(server.url("/tokenize"), json={"content": "hi", "with_pieces": True}, timeout=60)
    assert r.json() == {"tokens": [{"id": 104, "piece": "h"}, {"id": 105, "piece": "i"}]}


def test_a_client_gone_is_not_logged_as_an_unhandled_error(caplog):
    from types import SimpleNamespace

    from sanic.exceptions import RequestCancelled

    from gateway.http.errors import GatewayErrorHandler

    with caplog.at_level(logging.INFO, logger="bankml.gateway"):
        GatewayErrorHandler("not found").default(SimpleNamespace(method="POST", path="/v1/chat/completions"),
                                                 RequestCancelled())
    assert "unhandled" not in caplog.text


def test_an_integer_past_64_bits_reads_as_the_double_it_is_in_llama_server(server):
    def answer(n: str) -> tuple[int, str]:
        r = post_raw(server, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + n.encode() + b"}")
        return r.status_code, r.json().get("error", {}).get("message", "")

    # 10**30 used to wrap to a huge positive count and generate to the end of the context
    assert answer(str(10**30)) == answer("1e30")
    assert answer(str(10**30))[0] == 400
