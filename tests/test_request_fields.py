"""Reading a /v1 request as llama-server reads it: conversions, clamps, aliases, defaults from the
GGUF, and the GBNF parser behind "failed to parse grammar". The refusals themselves are compared with
llama-server's recorded answers in tests/test_parity.py.
"""

from __future__ import annotations

import json
import re

import pytest

from bankml.errors import NotSupported
from gateway.http.json_values import f32, get_int
from gateway.openai.chat_request import parse_chat
from gateway.serving.request_fields import gguf_defaults
from model.gbnf import GrammarError, parse_gbnf
from model.messages import SamplingParams

HI = [{"role": "user", "content": "hi"}]


def params(**fields) -> SamplingParams:
    return parse_chat(json.dumps({"messages": HI, **fields}).encode()).params


def test_numbers_convert_as_nlohmann_converts_them():
    assert get_int(3.7) == 3 and get_int(-3.7) == -3 and get_int(True) == 1
    assert get_int(2**32 + 5) == 5 and get_int(1e300) == -(2**31)
    assert params(max_tokens=3.7).max_tokens == 3
    assert params(temperature=True).temperature == 1.0
    assert params(seed=-1).seed == 0xFFFFFFFF  # uint32: llama.cpp's "random"


def test_soft_limits_clamp():
    p = params(top_p=7, min_p=-2, top_k=-4, temperature=-1, xtc_probability=3, xtc_threshold=-1, mirostat=-3)
    assert (p.top_p, p.min_p, p.top_k, p.temperature, p.xtc_probability, p.xtc_threshold, p.mirostat) == \
        (1.0, 0.0, 0, 0.0, 1.0, 0.0, 0)
    assert params(repeat_penalty=1e39).repeat_penalty == f32(3.4028234663852886e38)  # to FLT_MAX, not inf
    assert params(dry_base=0.5).dry_base == 1.75  # below 1: llama.cpp's default


def test_n_predict_wins_over_max_completion_tokens_over_max_tokens():
    assert params(max_tokens=5, max_completion_tokens=6, n_predict=7).max_tokens == 7
    assert params(max_tokens=5, max_completion_tokens=6).max_tokens == 6
    assert params(max_tokens=None).max_tokens == -1  # null is absent


@pytest.mark.parametrize(("stop", "words"), [("x", ("x",)), (["a", None, "b"], ("a", "b")), (5, ()),
                                              (None, ()), (["", "a"], ("", "a"))])
def test_stop_forms(stop, words):
    assert params(stop=stop).stop == words


@pytest.mark.parametrize(("fields", "n_probs"), [({"logprobs": True}, 20), ({"logprobs": True, "top_logprobs": 0}, 0),
                                                 ({"logprobs": True, "top_logprobs": 3}, 3), ({"logprobs": 2}, 2),
                                                 ({"n_probs": 4}, 4), ({"logprobs": False}, 0)])
def test_logprobs_become_n_probs(fields, n_probs):
    assert params(**fields).n_probs == n_probs


def test_defaults_come_from_the_gguf_over_llama_cpps():
    kv = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.penalty_last_n": "32",
          "general.sampling.top_p": "not a number", "general.sampling.sequence": "top_k;temp"}
    d = gguf_defaults(kv)
    assert (d.temperature, d.top_k, d.repeat_last_n, d.top_p) == (f32(0.6), 20, 32, SamplingParams().top_p)
    assert d.samplers == ("top_k", "temperature")
    ok = gguf_defaults({"general.sampling.temp": 0.6, "general.sampling.top_k": 20})
    req = parse_chat(json.dumps({"messages": HI}).encode(), ok).params
    assert (req.temperature, req.top_k) == (f32(0.6), 20)
    assert parse_chat(json.dumps({"messages": HI, "top_k": 3}).encode(), ok).params.top_k == 3
    with pytest.raises(NotSupported, match="'samplers' is not supported"):
        parse_chat(json.dumps({"messages": HI}).encode(), d)  # a GGUF order this engine does not run


def test_the_default_sampler_order_is_accepted_by_any_of_its_names():
    assert params(samplers=["penalties", "DRY", "top-n-sigma", "topk", "typ_p", "nucleus", "min_p", "xtc",
                            "temp"]).samplers == SamplingParams().samplers
    assert params(samplers="edskyp" + "mxt").samplers == SamplingParams().samplers


def test_add_generation_prompt_is_read():
    assert parse_chat(json.dumps({"messages": HI, "add_generation_prompt": False}).encode()).add_generation_prompt is False
    assert parse_chat(json.dumps({"messages": HI}).encode()).add_generation_prompt is True


@pytest.mark.parametrize("grammar", ['root ::= "a"', 'root ::= [a-z]+ ("," [0-9]{1,3})*', "root ::= x\nx ::= \"b\" | ",
                                     'root ::= <[12]> "\\u00e9"', "# comment\nroot ::= (\"a\" | \"b\")?"])
def test_grammars_llama_cpp_parses(grammar):
    rules, symbols = parse_gbnf(grammar)
    assert "root" in symbols and rules[symbols["root"]]


@pytest.mark.parametrize(("grammar", "why"), [
    ("root ::= (", "expecting ')'"), ("root ::= foo", "Undefined rule identifier 'foo'"),
    ('x ::= "a"', "'root' symbol"), ('root ::= root "a"', "left recursion"), ("root ::= \"a\"{3000}", "sane"),
    ('root ::= "\\q"', "unknown escape"), ("root := \"a\"", "expecting ::="), ("root ::= <think>", "no vocab"),
])
def test_grammars_llama_cpp_refuses(grammar, why):
    with pytest.raises(GrammarError, match=re.escape(why)):
        parse_gbnf(grammar)
