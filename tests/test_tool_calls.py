"""gateway/serving/tool_calls.py without a model: the request's tools read, the plan each template format makes,
the answer parsed back, and the streamed deltas assembling to the parsed answer."""

from __future__ import annotations

import json

import pytest

from bankml.errors import InvalidRequest, NotSupported
from gateway.serving import tool_calls as tc

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                            "properties": {"tz": {"type": "string"}}}}}
HERMES = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}" \
         "{% if tools %}<tools>{{ tools | tojson }}</tools> answer in <tool_call></tool_call>{% endif %}"
LLAMA3 = "<|start_header_id|>ipython<|end_header_id|>{{ messages }}"
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
USER = [{"role": "user", "content": "Weather in Paris?"}]


def tools(**body) -> tc.Tools:
    t = tc.read_tools({"tools": [WEATHER, TIME], **body})
    assert t is not None
    return t


@pytest.mark.parametrize("body,message", [
    ({"tools": {"a": 1}}, "Failed to parse tools: Expected 'tools' to be an array, got {\"a\": 1}"),
    ({"tools": ["x"]}, "Failed to parse tools: a tool must be"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "Failed to parse tools: a tool must be"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "a function needs a 'name'"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}, "'parameters' must be an object"),
    ({"tools": [WEATHER, WEATHER]}, "two functions have the same name"),
    ({"tools": [WEATHER] * (tc.MAX_TOOLS + 1)}, f"at most {tc.MAX_TOOLS} tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "Invalid tool_choice: sometimes"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Invalid tool_choice: no function named 'nope' in tools"),
    ({"tools": [WEATHER], "tool_choice": 3}, "Invalid tool_choice: 3"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be a boolean"),
])
def test_bad_tools_are_a_400_with_the_reason(body, message):
    with pytest.raises(InvalidRequest) as e:
        tc.read_tools(body)
    assert message in str(e.value)


def test_tools_are_read_with_their_choice():
    assert tc.read_tools({}) is None and tc.read_tools({"tools": []}) is None
    auto = tools()
    assert auto.choice == "auto" and auto.active and not auto.required and not auto.parallel
    assert [f["name"] for f in auto.functions] == ["get_weather", "get_time"]
    assert auto.functions[1]["parameters"] == TIME["function"]["parameters"]
    assert not tools(tool_choice="none").active
    named = tools(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.required and [f["name"] for f in named.callable()] == ["get_time"]
    assert tools(tool_choice="required", parallel_tool_calls=True).parallel


def test_the_format_is_the_templates():
    assert tc.tool_format(HERMES) == "hermes"
    assert tc.tool_format(LLAMA3) == "llama3"
    assert tc.tool_format(PLAIN) == tc.tool_format(None) == "generic"


def test_no_plan_without_tools_or_under_none():
    assert tc.plan(None, USER, PLAIN) is None
    assert tc.plan(tools(tool_choice="none"), USER, HERMES) is None


def test_the_generic_plan_instructs_and_writes_the_history_in_its_own_json():
    history = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18 C"},
    ]
    p = tc.plan(tools(), history, PLAIN)
    assert p.format == "generic" and p.grammar and p.template_tools == [WEATHER, TIME]
    system = p.messages[0]
    assert system["role"] == "system" and system["content"].startswith(tc.GENERIC_SYSTEM)
    listed = json.loads(system["content"].split("satisfy the user's requests: ", 1)[1])
    assert listed == [{"type": "function", "function": f} for f in tools().functions]  # PLAIN reads no tools
    assert tc.plan(tools(), history, HERMES.replace("<tool_call>", "")).messages[0]["content"] == tc.GENERIC_SYSTEM
    assert json.loads(p.messages[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert p.messages[3]["role"] == "user"
    assert json.loads(p.messages[3]["content"]) == {"tool_response": {"tool": "get_weather", "content": "18 C"}}
    with_system = tc.plan(tools(), [{"role": "system", "content": "Be brief."}] + USER, PLAIN)
    assert with_system.messages[0]["content"].startswith("Be brief.\n\n" + tc.GENERIC_SYSTEM)


def test_the_generic_schema_is_a_call_or_a_response_and_only_a_call_when_required():
    auto = tc.generic_schema(tools())
    call, response = auto["anyOf"]
    assert call["required"] == ["tool_call"] and response["properties"]["response"] == {"type": "string"}
    names = [s["properties"]["name"]["const"] for s in call["properties"]["tool_call"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    required = tc.generic_schema(tools(tool_choice="required", parallel_tool_calls=True))
    assert required["required"] == ["tool_calls"]
    item = required["properties"]["tool_calls"]["items"]["anyOf"][0]
    assert item["required"] == ["name", "arguments"]  # the ids are ours, not the model's
    assert required["properties"]["tool_calls"]["maxItems"] == tc.MAX_CALLS  # bounded by construction
    assert tc.generic_schema(tools(), {"type": "object"})["anyOf"][1]["properties"]["response"] == {"type": "object"}


def test_arguments_take_only_the_declared_properties_unless_the_schema_says_otherwise():
    params = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}},
                                               "tags": {"type": "array", "items": {"type": "object",
                                                                                   "properties": {"k": {}}}},
                                               "extra": {"type": "object", "properties": {},
                                                         "additionalProperties": True}},
              "$defs": {"d": {"type": "object", "properties": {"x": {"const": {"properties": 1}}}}}}
    c = tc.closed(params)
    assert c["additionalProperties"] is False and c["properties"]["where"]["additionalProperties"] is False
    assert c["properties"]["tags"]["items"]["additionalProperties"] is False
    assert c["properties"]["extra"]["additionalProperties"] is True  # what the schema says is kept
    assert c["$defs"]["d"]["additionalProperties"] is False
    assert c["$defs"]["d"]["properties"]["x"] == {"const": {"properties": 1}}  # a value, not a schema
    assert "additionalProperties" not in params


def test_hermes_and_llama3_pass_the_tools_and_constrain_only_a_required_call():
    auto = tc.plan(tools(), USER, HERMES)
    assert auto.format == "hermes" and auto.grammar is None and auto.template_tools == [WEATHER, TIME]
    assert auto.messages == USER
    hermes = tc.plan(tools(tool_choice="required", parallel_tool_calls=True), USER, HERMES).grammar
    assert '"<tool_call>\\n" fn "\\n</tool_call>"' in hermes and f'("\\n" call){{0,{tc.MAX_CALLS - 1}}}' in hermes
    assert '"const":"get_time"' in tc.plan(tools(tool_choice="required"), USER, LLAMA3).grammar
    with pytest.raises(NotSupported):
        tc.plan(tools(), USER, HERMES, {"type": "object"})


def test_a_history_call_reaches_a_tool_template_with_its_arguments_as_an_object():
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    p = tc.plan(tools(), USER + [msg], HERMES)
    assert p.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    with pytest.raises(InvalidRequest):
        tc.plan(tools(), USER + [{"role": "assistant", "tool_calls": [{"id": "x"}]}], HERMES)


def _plan(template: str, **body) -> tc.ToolPlan:
    return tc.plan(tools(**body), USER, template)


def _call(c: dict) -> tuple[str, dict]:
    assert c["type"] == "function" and len(c["id"]) >= 4
    return c["function"]["name"], json.loads(c["function"]["arguments"])


def test_generic_answers_parse_into_calls_or_content():
    p = _plan(PLAIN)
    got = tc.parse(p, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
    assert got.content is None and [_call(c) for c in got.calls] == [("get_weather", {"city": "Paris"})]
    assert tc.parse(p, '{"response": "Hello \\u00e9"}') == tc.Parsed("Hello \u00e9", [])
    assert tc.parse(p, '{"response": "cut sho').content == "cut sho"  # the length limit
    unknown = '{"tool_call": {"name": "rm_rf", "arguments": {}}}'
    assert tc.parse(p, unknown) == tc.Parsed(unknown, [])
    par = _plan(PLAIN, parallel_tool_calls=True)
    two = tc.parse(par, json.dumps({"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_time", "arguments": {}}]}))
    assert [c["function"]["name"] for c in two.calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in two.calls}) == 2


def test_hermes_answers_keep_the_text_around_the_calls():
    p = _plan(HERMES)
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    got = tc.parse(p, text)
    assert got.content == "Let me look."
    assert [_call(c) for c in got.calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert tc.parse(p, " no call here\n") == tc.Parsed("no call here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert tc.parse(p, broken) == tc.Parsed(broken, [])


def test_llama3_answers_are_a_call_or_content():
    p = _plan(LLAMA3)
    got = tc.parse(p, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert got.content is None and [_call(c) for c in got.calls] == [("get_time", {"tz": "UTC"})]
    trailing = '{"name": "get_time", "parameters": {}} and more'
    assert tc.parse(p, trailing) == tc.Parsed(trailing, [])
    assert tc.parse(p, "It is noon.") == tc.Parsed("It is noon.", [])


STREAMED = [
    (PLAIN, '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"q\\"\\nend"}'),
    (PLAIN, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'),
    (HERMES, 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (HERMES, "Just text, with a < sign and <tool not a call"),
    (LLAMA3, '{"name": "get_time", "parameters": {}}'),
    (LLAMA3, "Plain words."),
]


@pytest.mark.parametrize("template,text", STREAMED)
def test_streamed_deltas_assemble_to_the_parsed_answer(template, text):
    p = _plan(template)
    whole = tc.parse(p, text)
    stream = tc.ToolStream(p)
    deltas = []
    for ch in text:  # one character at a time: the hardest split
        deltas += stream.feed(ch)
    more, parsed = stream.finish()
    deltas += more
    content = "".join(d for kind, d in deltas if kind == "content")
    calls = [d for kind, d in deltas if kind == "call"]
    assert content == (whole.content or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert parsed.content == whole.content


def test_a_response_streams_before_it_is_complete():
    stream = tc.ToolStream(_plan(PLAIN))
    assert stream.feed('{"response": "Hel') == [("content", "Hel")]
    assert stream.feed('lo \\u00') == [("content", "lo ")]  # an escape is held until it is whole
    assert stream.feed('e9"}') == [("content", "\u00e9")]


def test_partial_strings_stop_at_what_is_unfinished():
    assert tc._partial_string('abc"rest') == "abc"
    assert tc._partial_string("a\\") == "a"
    assert tc._partial_string("\\ud83d") == ""  # half a pair
    assert tc._partial_string("\\ud83d\\ude00x") == "\U0001F600x"
    assert tc._partial_string("\\uZZZZ") == ""


def test_ollama_calls_carry_the_arguments_as_an_object_both_ways():
    got = tc.parse(_plan(PLAIN), '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
    ollama = tc.ollama_calls(got.calls)
    assert ollama == [{"id": got.calls[0]["id"], "function": {"index": 0, "name": "get_weather",
                                                               "arguments": {"city": "Paris"}}}]
    back = tc.from_ollama_calls([{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
    assert back[0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}} and len(back[0]["id"]) == 32
    with pytest.raises(InvalidRequest):
        tc.from_ollama_calls([{"function": {"arguments": {}}}])


# --- on the engine: a required call's grammar always gives a call that parses --------------------------

BOUNDED = [  # every string bounded, so a random model's call ends within the budget
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    from model.engine import Engine
    path = write_tiny_gguf(tmp_path_factory.mktemp("tools") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    return Engine.load(path, verified=True, n_ctx=1024, max_seqs=4, warmup=False)


def _generate(engine, grammar: str, seed: int) -> str:
    from model import constraint as mc
    from model.messages import FinishReason, GenerateRequest, SamplingParams
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=600)
    task = engine.add(GenerateRequest([1, 2, 3], params,
                                      constraint=mc.compile_constraint(grammar, engine.tokenizer,
                                                                       engine.config.n_vocab)))
    outs = []
    while not outs or outs[-1].finish_reason is None:
        outs += [o for t, o in engine.iterate().outputs if t == task and (o.token is not None or o.finish_reason)]
    assert outs[-1].finish_reason is FinishReason.STOP  # the grammar completed, not the budget
    return engine.tokenizer.decode([o.token for o in outs if o.token is not None and o.token not in engine.eog_ids])


@pytest.mark.parametrize("template,body", [
    (HERMES, {"tool_choice": "required"}),
    (HERMES, {"tool_choice": "required", "parallel_tool_calls": True}),
    (LLAMA3, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    (PLAIN, {"tool_choice": "required"}),
    (PLAIN, {"tool_choice": "required", "parallel_tool_calls": True}),
], ids=["hermes", "hermes-parallel", "llama3-named", "generic", "generic-parallel"])
def test_a_required_call_always_parses_and_its_arguments_validate(engine, template, body):
    import jsonschema
    t = tc.read_tools({"tools": BOUNDED, **body})
    p = tc.plan(t, USER, template)
    params = {f["name"]: f["parameters"] for f in t.callable()}
    for seed in range(2):  # sampled at temperature 1: the mask alone makes a random model call
        text = _generate(engine, p.grammar, seed)
        got = tc.parse(p, text)
        assert got.calls, text
        for c in got.calls:
            name, args = _call(c)
            jsonschema.validate(args, params[name])
        if not t.parallel:
            assert len(got.calls) == 1


def _objects(levels: int) -> dict:
    """Parameters `levels` objects deep, each object's `next` the one below, a digit at the bottom."""
    s: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels):
        s = {"type": "object", "properties": {"next": s}, "required": ["next"]}
    return s


def test_closed_visits_each_value_of_a_deep_schema_once(monkeypatch):
    # it closed each level's properties twice: 2^levels calls (a 40-deep tool took minutes)
    calls = [0]
    real = tc.closed

    def counting(schema):
        calls[0] += 1
        return real(schema)

    monkeypatch.setattr(tc, "closed", counting)
    levels = 16
    out = tc.closed(_objects(levels))
    # each level: the object, its "type", its "required" list and the name in it; the bottom: the
    # integer schema and its three values
    assert calls[0] == 4 * levels + 4
    for _ in range(levels):
        assert out["additionalProperties"] is False
        out = out["properties"]["next"]
    assert out == {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize("levels", [5, 10])  # 10: the nesting OpenAI's strict mode allows
def test_a_tool_nested_as_deep_as_real_tools_are_is_called_with_valid_arguments(engine, levels):
    import jsonschema
    params = _objects(levels)
    t = tc.read_tools({"tools": [{"type": "function", "function": {"name": "deep", "parameters": params}}],
                       "tool_choice": "required"})
    p = tc.plan(t, USER, PLAIN)
    name, args = _call(tc.parse(p, _generate(engine, p.grammar, 0)).calls[0])
    assert name == "deep"
    jsonschema.validate(args, tc.closed(params))
