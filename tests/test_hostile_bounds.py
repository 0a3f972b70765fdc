"""Issue 28: request preparation that hostile input cannot make slow or crash. Every schema, body and
logit_bias is bounded before anything recursive or costly reads it (a 400 naming the field and the
bound, never a 500); GBNF past what llguidance takes is a 400 before any token; grammars compile on a
small pool of their own, and work a departed client left queued there never starts. Each test fails
without the bound it covers."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from gateway_helpers import FakeServer, tiny_model

from bankml.errors import InvalidRequest, NotSupported
from gateway.http.body import MAX_BODY_DEPTH, parse_body
from gateway.serving import constraints
from gateway.serving.constraints import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, read_logit_bias
from model import constraint as mc
from model import gbnf

pytestmark = pytest.mark.timeout(180)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("hostile")))
    yield s
    s.stop()


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url(path), content=content, headers={"Content-Type": "application/json"}, timeout=60)


def objects(levels: int) -> dict:
    """A schema of `levels` objects, each the only property of the one above."""
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def arrays(levels: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "array", "items": s}
    return s


def tool(parameters: dict) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def error_message(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


# --- schemas: bounded before any work, never a 500 -----------------------------------------------------


def test_deep_tool_parameters_are_a_400_naming_the_tool_and_the_bound(server):
    # depth 40 took minutes of exponential work on a worker thread; 450 was a RecursionError (500)
    message = error_message(post(server, "/v1/chat/completions", {"messages": HI, "tools": tool(objects(40))}))
    assert message == ("'tools[0].function.parameters' is not supported by bankml serve --native: a schema nested "
                       f"deeper than {MAX_SCHEMA_DEPTH} levels (arrays and objects)")
    message = error_message(post(server, "/v1/chat/completions", {"messages": HI, "tools": tool(objects(450))}))
    assert message == (f"'tools' nests arrays and objects deeper than {MAX_BODY_DEPTH} levels in the request body "
                       "(bankml serve's bound)")


def test_a_json_schema_200_objects_or_900_arrays_deep_is_a_400_naming_the_field(server):
    # these were RecursionErrors (500s): now the body's bound, or past it the schema's, names the field
    for field, body, bound in (
            ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"schema": objects(200)}}},
             "body"),
            ("json_schema", {"json_schema": objects(200)}, "body"),
            ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"schema": objects(40)}}},
             "schema"),
            ("response_format", {"response_format": {"type": "json_object", "schema": arrays(70)}}, "schema"),
            ("json_schema", {"json_schema": arrays(70)}, "schema")):
        message = error_message(post(server, "/v1/chat/completions", {"messages": HI, **body}))
        assert message == (f"'{field}' nests arrays and objects deeper than {MAX_BODY_DEPTH} levels in the request "
                           "body (bankml serve's bound)" if bound == "body" else
                           f"'{field}' is not supported by bankml serve --native: a schema nested deeper than "
                           f"{MAX_SCHEMA_DEPTH} levels (arrays and objects)"), message
    message = error_message(post(server, "/completion", {"prompt": "hi", "json_schema": objects(40)}))
    assert message.startswith("'json_schema' is not supported")


def test_a_request_body_900_arrays_deep_is_a_400(server):
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 900 + b"]" * 900 + b"}"
    for path in ("/v1/chat/completions", "/completion", "/v1/completions"):
        message = error_message(post(server, path, deep))
        assert message == f"'x' nests arrays and objects deeper than {MAX_BODY_DEPTH} levels in the request body " \
                          "(bankml serve's bound)"


def test_a_body_at_the_depth_bound_parses_and_one_past_it_does_not():
    at = b'{"a": ' + b"[" * (MAX_BODY_DEPTH - 1) + b"]" * (MAX_BODY_DEPTH - 1) + b"}"
    assert parse_body(at)["a"] is not None
    with pytest.raises(InvalidRequest):
        parse_body(b'{"a": ' + b"[" * MAX_BODY_DEPTH + b"]" * MAX_BODY_DEPTH + b"}")
    many = json.dumps({"a": [[1]] * 1000}).encode()  # many brackets, shallow: walked, and fine
    assert len(parse_body(many)["a"]) == 1000


def test_ollama_format_nested_900_deep_is_a_400_not_a_500(server):
    fmt = json.loads("[" * 900 + "]" * 900)
    r = post(server, "/api/chat", {"model": "tiny-model.q8_0", "messages": HI, "format": fmt, "stream": False})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("'format' is not supported by bankml serve --native: a schema nested deeper")


def test_schemas_past_the_value_budget_are_a_400_counted_across_the_tools(server):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_NODES // 6)}}
    tools = [{"type": "function", "function": {"name": f"f{k}", "parameters": wide}} for k in range(3)]
    message = error_message(post(server, "/v1/chat/completions", {"messages": HI, "tools": tools}))
    # each tool alone fits; the third passes the budget the tools share
    assert message == ("'tools[2].function.parameters' is not supported by bankml serve --native: schemas of more "
                       f"than {MAX_SCHEMA_NODES} values in all")


# --- GBNF: what llguidance would fail on mid-decode is a 400 before any token -----------------------


def test_a_gbnf_of_3000_alternatives_is_a_400_before_any_token(server):
    grammar = "root ::= " + " | ".join(f'"w{i}"' for i in range(3000))
    for path, body in (("/v1/chat/completions", {"messages": HI, "grammar": grammar}),
                       ("/completion", {"prompt": "hi", "grammar": grammar})):
        message = error_message(post(server, path, body))
        assert message == ("'grammar': llguidance cannot compile this GBNF grammar, which llama.cpp parses: a rule of "
                           "3000 alternatives, more than 1999 (llguidance's parser holds 2000 items at a position)")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    from model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", "llama", n_layer=1))


def _decodes(tokenizer, grammar_text: str, text: str) -> bool:
    c = mc.compile_constraint(mc.gbnf_grammar(grammar_text), tokenizer)
    c.fill(np.zeros((tokenizer.n_vocab + 31) // 32, np.int32))
    return all(c.consume(t) for t in tokenizer.encode(text, False, False)) and c.error is None


def test_gbnf_alternatives_up_to_what_llguidance_holds_decode_and_one_more_is_refused(tokenizer):
    def words(n: int) -> str:
        return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))
    assert _decodes(tokenizer, words(gbnf.MAX_ALTERNATIVES), "w17")
    with pytest.raises(mc.GrammarRejected, match="a rule of 2000 alternatives"):
        mc.gbnf_grammar(words(gbnf.MAX_ALTERNATIVES + 1))
    group = 'root ::= "x" (' + " | ".join(f'"w{i}"' for i in range(3000)) + ")"  # a group is a rule too
    with pytest.raises(mc.GrammarRejected, match="a rule of 3000 alternatives"):
        mc.gbnf_grammar(group)


def test_a_chain_of_thousands_of_rules_is_refused_before_llguidance_compiles_it(tokenizer):
    # 5,000 chained rules overflowed llguidance's compile stack: the process ended (SIGSEGV)
    def chain(n: int) -> str:
        return "\n".join(f"r{i} ::= r{i + 1}" for i in range(n)) + f'\nr{n} ::= "a"\nroot ::= r0'
    with pytest.raises(mc.GrammarRejected, match=f"5002 rules, more than {gbnf.MAX_RULES}"):
        mc.gbnf_grammar(chain(5000))
    assert _decodes(tokenizer, chain(gbnf.MAX_RULES - 2), "a")
    gbnf.parse_gbnf(chain(5000))  # llama.cpp's parser still takes it: the refusal is llguidance's


# --- logit_bias --------------------------------------------------------------------------------------


def test_a_12_mb_logit_bias_key_is_a_400_and_health_stays_answered(server):
    key = "ab " * 4_000_000
    r = post(server, "/v1/chat/completions", {"messages": HI, "logit_bias": {key: 1}})
    assert error_message(r) == ("'logit_bias' is not supported by bankml serve --native: a token string of more "
                                f"than {constraints.MAX_BIAS_KEY_CHARS} characters ({len(key)})")
    r = post(server, "/completion", {"prompt": "hi", "logit_bias": [[key, 1]]})
    assert r.status_code == 400
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_logit_bias_is_bounded_in_entries_and_string_length():
    with pytest.raises(NotSupported, match="more than 262144 entries"):
        read_logit_bias([[i, 1.0] for i in range(constraints.MAX_BIAS_ENTRIES + 1)])
    ok = read_logit_bias({"x" * constraints.MAX_BIAS_KEY_CHARS: 1, "15": False})
    assert len(ok) == 2


# --- the preparation pool: bounded, and what a departed client queued never starts -----------------


class _Tokenizer:
    """Anything weakly referable (constraints._BUILDS keys on the tokenizer)."""


def test_compiles_run_on_a_small_pool_and_a_departed_clients_compile_never_starts(monkeypatch):
    started: list[str] = []
    running, most = [0], [0]
    release = threading.Event()
    lock = threading.Lock()

    def compile_constraint(grammar, tokenizer, n_vocab=None):
        with lock:
            started.append(grammar)
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1
        return SimpleNamespace(copy=lambda: None)

    monkeypatch.setattr(mc, "compile_constraint", compile_constraint)
    loaded = SimpleNamespace(model=SimpleNamespace(tokenizer=_Tokenizer()))

    def request():
        return SimpleNamespace(params=SimpleNamespace(logit_bias=()), constraint=None)

    async def scenario():
        tasks = {g: asyncio.create_task(constraints.attach_constraints(loaded, [request()], g))
                 for g in ("a", "b", "c", "d")}
        while len(started) < constraints.PREPARE_THREADS:  # the pool's threads are busy
            assert not any(t.done() for t in tasks.values())
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert sorted(started) == ["a", "b"]  # c and d wait: no more than the pool at once
        tasks["c"].cancel()  # its client left
        await asyncio.sleep(0.1)
        release.set()
        await asyncio.gather(tasks["a"], tasks["b"], tasks["d"])
        with pytest.raises(asyncio.CancelledError):
            await tasks["c"]

    asyncio.run(scenario())
    assert sorted(started) == ["a", "b", "d"]  # c's compile never started
    assert most[0] == constraints.PREPARE_THREADS


def test_logit_bias_strings_are_tokenized_off_the_event_loop(monkeypatch):
    loop_thread: list[int] = []

    class Tok:
        n_vocab = 256

        def encode(self, text, add_special, parse_special):
            loop_thread.append(threading.get_ident())
            return list(text.encode())

    loaded = SimpleNamespace(model=SimpleNamespace(tokenizer=Tok()))
    from model.messages import SamplingParams
    r = SimpleNamespace(params=SamplingParams(logit_bias=(("ab", 1.0), (7, -1.0))), constraint=None)

    async def scenario():
        await constraints.attach_constraints(loaded, [r], None)
        return threading.get_ident()

    on_loop = asyncio.run(scenario())
    assert loop_thread and on_loop not in loop_thread
    assert r.params.logit_bias == ((97, 1.0), (98, 1.0), (7, -1.0))
