"""The gateway's side of structured output (gateway/serving/constraints.py): response_format, json_schema and
grammar read as llama-server reads them (server-common.cpp oaicompat_chat_params_parse, server-task.cpp
params_from_json_cmpl), exact schema numbers, logit_bias / ignore_eos / n_probs honoured, and one
Constraint per sequence compiled with SmolLM2's tokenizer (a 400 with llguidance's reason before any
model work)."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from bankml.errors import InvalidRequest, NotSupported
from gateway.http.body import parse_body
from gateway.openai.chat_request import parse_chat_request
from gateway.openai.completion_request import parse_completion
from gateway.serving.constraints import attach_constraints, exact_json, read_logit_bias
from model import constraint as mc
from model.host_bias import bitmask_words
from model.messages import GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["n"]}


def chat(body: dict):
    return parse_chat_request(parse_body(json.dumps({"messages": HI, **body}).encode()), SamplingParams())


def test_response_format_json_schema_is_the_schema():
    req = chat({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                             "strict": True}}})
    assert req.grammar == mc.json_schema_grammar(json.dumps(SCHEMA, separators=(",", ":")))


def test_response_format_json_schema_without_schema_is_any_value():
    # llama-server: json_value(schema_wrapper, "schema", json::object()), the empty schema
    req = chat({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert req.grammar == mc.json_schema_grammar("{}")


def test_response_format_json_object_and_its_schema_key():
    assert chat({"response_format": {"type": "json_object"}}).grammar == mc.json_object_grammar()
    with_schema = chat({"response_format": {"type": "json_object", "schema": SCHEMA}})
    assert with_schema.grammar == mc.json_schema_grammar(json.dumps(SCHEMA, separators=(",", ":")))


def test_text_and_nothing_give_no_grammar():
    assert chat({"response_format": {"type": "text"}}).grammar is None
    assert chat({}).grammar is None


def test_body_json_schema_and_grammar_fields():
    assert chat({"json_schema": SCHEMA}).grammar == mc.json_schema_grammar(json.dumps(SCHEMA, separators=(",", ":")))
    assert chat({"grammar": 'root ::= "yes" | "no"'}).grammar == mc.gbnf_grammar('root ::= "yes" | "no"')
    # llama-server's message; its status is 500 there, a 400 here: the request is what is wrong
    with pytest.raises(InvalidRequest, match="^Cannot use both json_schema and grammar$"):
        chat({"json_schema": SCHEMA, "grammar": 'root ::= "a"'})


def test_bad_gbnf_is_llama_servers_message():
    with pytest.raises(InvalidRequest, match="^Failed to initialize samplers: failed to parse grammar$"):
        chat({"grammar": "root ::= ("})


def test_bad_response_format_type():
    with pytest.raises(InvalidRequest, match='response_format type must be one of "text" or "json_object", but got: xml'):
        chat({"response_format": {"type": "xml"}})


def test_completion_fields():
    req = parse_completion({"prompt": "a", "json_schema": SCHEMA}, SamplingParams(), oai=False)
    assert req.grammar == mc.json_schema_grammar(json.dumps(SCHEMA, separators=(",", ":")))
    req = parse_completion({"prompt": "a", "grammar": 'root ::= "a"'}, SamplingParams(), oai=True)
    assert req.grammar == mc.gbnf_grammar('root ::= "a"')
    assert parse_completion({"prompt": "a"}, SamplingParams(), oai=False).grammar is None


def test_schema_numbers_keep_their_literals():
    # a float round trip writes 1.2345678901234568e+23 and 1.0; the schema text must carry the request's
    body = b'{"type":"integer","maximum":123456789012345678901234,"minimum":0.1e1,"m":0.1,"k":5}'
    doc = parse_body(body)
    assert json.dumps(doc) != body.decode().replace(",", ", ").replace(":", ": ")
    assert exact_json(doc) == body.decode()
    assert doc["maximum"] == 123456789012345678901234.0  # still a number to every other reader


def test_logit_bias_forms():
    assert read_logit_bias([[5, 1.5], [7, False], ["hi", -2], ["bad"], [1, "x"]]) == \
        ((5, 1.5), (7, -math.inf), ("hi", -2.0))
    assert read_logit_bias({"5": 2, "hello": False}) == ((5, 2.0), ("hello", -math.inf))
    req = chat({"logit_bias": {"10": -100}, "ignore_eos": True})
    assert req.params.logit_bias == ((10, -100.0),)
    assert req.params.ignore_eos is True


def test_top_logprobs_above_20():
    assert chat({"logprobs": True, "top_logprobs": 50}).params.n_probs == 50
    with pytest.raises(NotSupported, match="top_logprobs"):
        chat({"logprobs": True, "top_logprobs": 100000})


@pytest.fixture(scope="module")
def smollm2():
    from bankml.default_model import default_model_path
    from model.tokenizer import Tokenizer
    from model.tokenizer_gguf import gguf_fields

    tok = Tokenizer.from_gguf(gguf_fields(default_model_path()))
    return SimpleNamespace(model=SimpleNamespace(tokenizer=tok))


def test_each_sequence_gets_its_own_constraint(smollm2):
    requests = [GenerateRequest([1, 2], SamplingParams()) for _ in range(3)]
    asyncio.run(attach_constraints(smollm2, requests, mc.json_schema_grammar(json.dumps(SCHEMA))))
    constraints = [r.constraint for r in requests]
    assert all(c is not None for c in constraints)
    assert len({id(c) for c in constraints}) == 3
    # advancing one leaves the others where they were
    tok = smollm2.model.tokenizer
    first = tok.encode("{", False, False)[0]
    assert constraints[0].consume(first)
    row = [0] * bitmask_words(constraints[1].n_vocab)
    import numpy as np

    fresh, advanced = np.zeros(len(row), np.int32), np.zeros(len(row), np.int32)
    constraints[1].fill(fresh)
    constraints[0].fill(advanced)
    assert (fresh >> (first % 32))[first // 32] & 1 == 1
    assert not np.array_equal(fresh, advanced)


def test_uncompilable_schema_is_a_400(smollm2):
    requests = [GenerateRequest([1], SamplingParams())]
    with pytest.raises(InvalidRequest, match="Failed to initialize samplers: .*strin"):
        asyncio.run(attach_constraints(smollm2, requests, mc.json_schema_grammar('{"type": "strin"}')))
    assert requests[0].constraint is None


def test_no_grammar_no_constraint(smollm2):
    requests = [GenerateRequest([1], SamplingParams())]
    asyncio.run(attach_constraints(smollm2, requests, None))
    assert requests[0].constraint is None


def test_logit_bias_strings_are_tokenized_and_out_of_range_dropped(smollm2):
    tok = smollm2.model.tokenizer
    ids = tok.encode(" hello world", False, False)
    params = SamplingParams(logit_bias=((" hello world", -5.0), (10**9, 1.0), (3, 2.0)))
    requests = [GenerateRequest([1], params)]
    asyncio.run(attach_constraints(smollm2, requests, None))
    assert requests[0].params.logit_bias == tuple((t, -5.0) for t in ids) + ((3, 2.0),)


# --- Ollama's format, and the metrics record ---------------------------------------------------------


def test_ollama_format():
    from gateway.serving.constraints import ollama_format_grammar

    assert ollama_format_grammar(None) is None and ollama_format_grammar("") is None
    assert ollama_format_grammar("json") == mc.json_object_grammar()  # Ollama's grammarJSON: root ::= object
    assert ollama_format_grammar(SCHEMA) == mc.json_schema_grammar(json.dumps(SCHEMA, separators=(",", ":")))
    for fmt, shown in ((5, '"5"'), ("xml", '"\\"xml\\""'), ([1], '"[1]"')):
        with pytest.raises(InvalidRequest) as e:
            ollama_format_grammar(fmt)
        assert str(e.value) == f'invalid format: {shown}; expected "json" or a valid JSON Schema object'


def test_metrics_record_carries_grammar_ms():
    from gateway.monitor.answer_metrics import answer_record
    from model.messages import FinishReason, StepOutput

    last = StepOutput(token=1, finish_reason=FinishReason.STOP, grammar_ms=1.23456)
    record = answer_record("m", last)
    assert record["grammar_ms"] == 1.235 and record["resampled"] == 0


# --- through the app, on SmolLM2 (the engine's masks: they pass once model/ honours `constraint`) ------

ANSWER_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                  "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                 "required": ["color", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(bankml_cmd, smollm2_path, smollm2_fork):
    from gateway_helpers import CliServer

    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "512", "--config", "cpu")
    yield s
    s.stop()


def _post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.url(path), json=body, timeout=300)


def _records(server) -> int:
    import httpx

    return len(httpx.get(server.url("/bankml/metrics"), timeout=30).json()["records"])


def test_a_schema_answer_parses_and_validates(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": ANSWER_SCHEMA, "strict": True}}
    r = _post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Pick a color and a count."}],
                                               "response_format": fmt, "max_tokens": 48, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    value = json.loads(choice["message"]["content"])
    assert value["color"] in ("red", "green", "blue") and 1 <= value["count"] <= 9 and set(value) == {"color", "count"}
    assert choice["finish_reason"] == "stop"


def test_a_gbnf_completion_and_an_ollama_format(served):
    r = _post(served, "/completion", {"prompt": "Is the sky blue? Answer:", "grammar": 'root ::= " yes" | " no"',
                                      "n_predict": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["content"] in (" yes", " no")
    r = _post(served, "/api/chat", {"model": "smollm2-135m-instruct.q4_1", "stream": False, "format": ANSWER_SCHEMA,
                                    "messages": [{"role": "user", "content": "Pick a color."}],
                                    "options": {"temperature": 0, "num_predict": 48}})
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["message"]["content"])
    assert value["color"] in ("red", "green", "blue")


def test_an_uncompilable_schema_is_a_400_and_no_model_work(served):
    before = _records(served)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    r = _post(served, "/v1/chat/completions", {"messages": HI, "response_format": fmt})
    assert r.status_code == 400 and "strin" in r.json()["error"]["message"]
    assert _records(served) == before
