"""The Modelfile parser against Ollama's parser.go behaviour, its rules, and the quote round trip."""

from __future__ import annotations

import struct

import pytest

from bankml.errors import InvalidRequest
from gateway.serving.modelfile import (
    ModelSpec,
    format_number,
    parse_commands,
    parse_modelfile,
    quote,
    render_modelfile,
    spec_from_request,
)


def cmds(text: str) -> list[tuple[str, str]]:
    return [(c.name, c.args) for c in parse_commands(text)]


def refused(text: str) -> str:
    with pytest.raises(InvalidRequest) as e:
        parse_modelfile(text)
    return e.value.message


def test_instructions_any_case_comments_blank_lines_crlf_bom_tabs():
    text = "\ufeff# a comment\n\nfrom  base\r\nsystem\tbe brief  \r\nPaRaMeTeR temperature 0.2\nLiCeNsE MIT\n"
    assert cmds(text) == [("model", "base"), ("system", "be brief"), ("temperature", "0.2"), ("license", "MIT")]


def test_a_hash_after_a_value_is_part_of_it():
    assert cmds("FROM x # not a comment") == [("model", "x # not a comment")]
    assert cmds("  # indented comment\nFROM x") == [("model", "x")]


def test_quoted_values_span_lines_without_escapes():
    text = 'FROM m\nSYSTEM """line one\nline "two"\n"""\nPARAMETER stop <|im_end|>\nTEMPLATE "a\\nb\nc"\n'
    assert cmds(text) == [("model", "m"), ("system", 'line one\nline "two"\n'), ("stop", "<|im_end|>"),
                          ("template", "a\\nb\nc")]
    # quotes inside a bare value stay; a value that ends in an open quote runs on to where it closes
    assert cmds('SYSTEM say "hi" now\n') == [("system", 'say "hi" now')]
    assert cmds('SYSTEM ""\n') == [("system", "")]


def test_messages_carry_their_role():
    text = 'FROM m\nMESSAGE user What is your purpose?\nMESSAGE assistant """I am a model."""'
    assert cmds(text)[1:] == [("message", "user: What is your purpose?"), ("message", "assistant: I am a model.")]


def test_parser_errors_name_the_line():
    bad = {
        "FROM m\nFORM x": "line 2: command must be one of",
        "FROM m\nMESSAGE robot hi": 'line 2: message role must be one of "system", "user", or "assistant"',
        "FROM m\nMESSAGE User hi": "message role must be one of",
        'FROM m\n\nSYSTEM """never closed\n': "line 3: SYSTEM: a quote opened here is never closed",
        "FROM\nx": "line 1: command must be one of",
        "FROM m\nPARAMETER temperature\n": "line 2: a PARAMETER needs a name and a value",
        "FROM m\nMESSAGE user\n": "line 2: a MESSAGE needs a role and a message",
        "FROM m\nSYSTEM": "line 2: unexpected end of the Modelfile",
    }
    for text, why in bad.items():
        assert why in refused(text), text


def test_crlf_counts_one_line():
    assert "line 3:" in refused("FROM m\r\n\r\nFORM x\r\n")


def test_rules_last_wins_accumulate_and_parameters():
    spec = parse_modelfile(
        "FROM b\nSYSTEM one\nSYSTEM two\nPARAMETER temperature 0.7\nPARAMETER stop <|im_end|>\n"
        'PARAMETER stop "END"\nPARAMETER temperature 0.5\nPARAMETER num_ctx 2048\nLICENSE MIT\nLICENSE BSD\n'
        "MESSAGE user hi\nMESSAGE assistant hello\nREQUIRES 0.1\nREQUIRES 0.2\nTEMPLATE t1\nTEMPLATE t2\n")
    assert spec == ModelSpec(
        from_="b", system="two", template="t2", parameters={"temperature": 0.5, "num_ctx": 2048},
        stop=["<|im_end|>", "END"], license=["MIT", "BSD"],
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], requires="0.2")
    assert isinstance(spec.parameters["num_ctx"], int)


def test_floats_are_rounded_to_f32():
    spec = parse_modelfile("FROM b\nPARAMETER temperature 0.7\nPARAMETER top_p 0.95\n")
    want = struct.unpack("<f", struct.pack("<f", 0.7))[0]
    assert spec.parameters["temperature"] == want != 0.7
    assert format_number(spec.parameters["temperature"]) == "0.7"
    assert format_number(spec.parameters["top_p"]) == "0.95"
    assert [format_number(x) for x in (1.0, 1e-5, 123456789.0, -0.5, 40)] == ["1", "0.00001", "123456790", "-0.5",
                                                                             "40"]


def test_parameter_refusals_name_the_key_and_why():
    cases = {
        "PARAMETER typical_p 0.9": "PARAMETER typical_p: bankml reproduces",
        "PARAMETER mirostat 2": "this sampler is not reproduced",
        "PARAMETER num_thread 4": "PARAMETER num_thread: a resource option",
        "PARAMETER num_gpu 1": "a resource option",
        "PARAMETER warp 9": "PARAMETER warp: not a parameter bankml reproduces",
        "PARAMETER Temperature 1": "PARAMETER Temperature: not a parameter",
        "PARAMETER num_ctx 2048.0": "not an integer",
        "PARAMETER seed 1_000": "not an integer",
        "PARAMETER temperature hot": "not a number",
        "PARAMETER temperature 1e39": "not a finite number",
        "PARAMETER num_ctx 0": "PARAMETER num_ctx 0: out of range",
        "PARAMETER num_predict -3": "out of range",
        "PARAMETER repeat_penalty 0": "out of range",
        "PARAMETER temperature -0.1": "out of range",
        "PARAMETER repeat_last_n -1": "out of range",
    }
    for line, why in cases.items():
        msg = refused(f"FROM b\n{line}\n")
        assert msg.startswith("Modelfile line 2: ") and why in msg, (line, msg)
    ok = parse_modelfile("FROM b\nPARAMETER top_k -5\nPARAMETER seed -1\nPARAMETER num_predict -2\n"
                         "PARAMETER presence_penalty -1.5\nPARAMETER frequency_penalty 2\n")
    assert ok.parameters == {"top_k": -5, "seed": -1, "num_predict": -2, "presence_penalty": -1.5,
                             "frequency_penalty": 2.0}


def test_from_rules_and_adapter():
    assert "no FROM line" in refused("SYSTEM x\n")
    assert "line 2: more than one FROM" in refused("FROM a\nFROM b\n")
    assert refused("FROM a\nADAPTER /x/lora\n") == (
        "Modelfile line 2: ADAPTER: bankml has no adapters; merge the adapter into the weights first, "
        "then FROM the merged model")


@pytest.mark.parametrize("value", ["plain", "two words", " edge", "edge ", "line\nbreak", 'said "hi"\nthen',
                                   "<|im_end|>", "tab\there", 'multi\n\nparagraph "q" end', ""])
def test_quote_round_trips_through_the_parser(value):
    assert cmds(f"SYSTEM {quote(value)}\n") == [("system", value)]


def test_quote_rule():
    assert quote("<|im_end|>") == "<|im_end|>"
    assert quote("a\nb") == '"a\nb"'
    assert quote(" a") == '" a"'
    assert quote('a\n"b"') == '"""a\n"b""""'
    assert quote('a "b"') == 'a "b"'


def test_render_then_parse_gives_the_layer_back():
    spec = ModelSpec(
        from_="smollm2-135m-instruct.q4_1", system='You are terse.\nSay "no" often. ',
        parameters={"temperature": struct.unpack("<f", struct.pack("<f", 0.3))[0], "num_ctx": 2048, "seed": 7},
        stop=["<|im_end|>", " END"], license=["Apache-2.0", "line one\nline two"],
        messages=[{"role": "user", "content": "who are you?"}, {"role": "assistant", "content": "a model"}],
        requires="0.4.2")
    text = render_modelfile(spec.from_, system=spec.system, parameters=spec.parameters, stop=spec.stop,
                            license=spec.license, messages=spec.messages, requires=spec.requires,
                            header="bankml 0.4.2: derived model x\nverified before every load")
    assert text.startswith("# bankml 0.4.2: derived model x\n# verified before every load\n\nFROM ")
    assert parse_modelfile(text) == spec


def test_structured_form():
    spec = spec_from_request({"model": "m", "from": "b", "system": "s", "license": ["L1", "L2"],
                              "parameters": {"temperature": 0.7, "num_ctx": 4096.0, "stop": ["a", "b"]},
                              "messages": [{"role": "user", "content": "hi"}]})
    assert spec.from_ == "b" and spec.system == "s" and spec.license == ["L1", "L2"]
    assert spec.parameters == {"temperature": struct.unpack("<f", struct.pack("<f", 0.7))[0], "num_ctx": 4096}
    assert spec.stop == ["a", "b"] and spec.messages == [{"role": "user", "content": "hi"}]
    assert spec_from_request({"from": "b", "license": "MIT"}).license == ["MIT"]
    bad = [({"from": "b", "quantize": "q8_0"}, "quantize:"), ({"from": "b", "adapters": {"a": "sha256:x"}}, "adapters:"),
           ({"from": "b", "files": {"m.gguf": "sha256:x"}}, "files:"), ({"system": "x"}, "from:"),
           ({"from": "b", "parameters": {"typical_p": 0.5}}, "PARAMETER typical_p"),
           ({"from": "b", "parameters": {"num_ctx": 10.5}}, "not an integer"),
           ({"from": "b", "parameters": {"temperature": "hot"}}, "parameters.temperature must be a number"),
           ({"from": "b", "messages": [{"role": "tool", "content": "x"}]}, "message role"),
           ({"from": "b", "parameters": []}, "parameters must be an object"),
           ({"from": "b", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "only text")]
    for body, why in bad:
        with pytest.raises(InvalidRequest) as e:
            spec_from_request(body)
        assert why in e.value.message, body
    # quantize/files/adapters at their empty values are absent, as the ollama client may send them
    assert spec_from_request({"from": "b", "files": {}, "quantize": ""}).from_ == "b"


@pytest.mark.timeout(15)
def test_a_long_unterminated_quote_is_a_fast_400():
    # each newline inside an open quote joined the whole value so far: quadratic, minutes for 512 KiB
    text = 'FROM x\nSYSTEM """' + "a\n" * (1 << 18)
    with pytest.raises(InvalidRequest, match="line 2: SYSTEM: a quote opened here is never closed"):
        parse_modelfile(text)
    spec = parse_modelfile('FROM x\nSYSTEM """' + "a b\n" * (1 << 17) + '"""\n')
    assert spec.system == "a b\n" * (1 << 17)


@pytest.mark.timeout(15)
def test_many_messages_and_stops_parse_in_linear_time():
    # each MESSAGE (and PARAMETER stop) copied the list so far: quadratic, a hang for a 16 MiB Modelfile
    spec = parse_modelfile("FROM x\n" + "MESSAGE user hi\n" * (1 << 17) + "PARAMETER stop x\n" * (1 << 17))
    assert len(spec.messages) == 1 << 17 and spec.messages[0] == {"role": "user", "content": "hi"}
    assert spec.stop == ["x"] * (1 << 17)


def test_a_megabyte_parameter_value_is_a_short_400():
    # the whole value was quoted in the message: a 1 MiB line made a 1 MiB error
    for key, value in (("temperature", "1" * (1 << 20)), ("top_k", "9" * (1 << 20)), ("top_k", "x" * (1 << 20)),
                       ("temperature", "y" * (1 << 20))):
        with pytest.raises(InvalidRequest) as e:
            parse_modelfile(f"FROM x\nPARAMETER {key} {value}\n")
        assert len(e.value.message) < 300 and "(1048576 characters)" in e.value.message, e.value.message[:200]
    with pytest.raises(InvalidRequest, match=r"PARAMETER top_k '1\.5': not an integer"):
        parse_modelfile("FROM x\nPARAMETER top_k 1.5\n")
