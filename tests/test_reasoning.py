"""Reasoning models without a server (gateway/serving/reasoning.py): the thought cut out of an answer whole
and piece by piece alike, the grammar that bounds it and puts a request's grammar after it (checked with
llguidance on a tiny byte-level vocabulary), and the request fields that choose how a request thinks."""

from __future__ import annotations

import json
import random

import pytest
from fake_engine import REPLY, THOUGHT, THOUGHT_PIECES
from tiny_gguf import write_tiny_gguf

from bankml.errors import InvalidRequest
from gateway.serving.reasoning import Reasoning, ThoughtStream, constrain, ollama_think, read_chat, split
from model import constraint as mc
from model.tokenizer import Tokenizer
from model.tokenizer_gguf import gguf_fields

TAGS = ("<think>", "</think>")
ANSWERS = ["".join(THOUGHT_PIECES), "<think>\n a b \n</think>\n\nX  ", "  hello", "<think>unfinished \n", "\n<thi",
           "<think></think>", "x<think>y</think>z", "abc</think>\n\nd", " \n"]


def test_a_qwen3_answer_splits_into_its_thought_and_its_reply():
    assert split("".join(THOUGHT_PIECES), TAGS) == (THOUGHT, REPLY)
    assert split(REPLY, TAGS) == ("", REPLY)  # no thought: all content
    assert split("".join(THOUGHT_PIECES), None) == ("", "".join(THOUGHT_PIECES))  # a template that does not think


def test_a_prompt_that_opened_the_thought_starts_the_answer_inside_it():
    # DeepSeek-R1's generation prompt ends with "<think>\n": the model writes the thought, then the close tag
    assert split(f"{THOUGHT}\n</think>\n\n{REPLY}", TAGS, started=True) == (THOUGHT, REPLY)
    assert split("".join(THOUGHT_PIECES), TAGS, started=True) == (THOUGHT, REPLY)  # the tag again: dropped
    assert split("still thinking", TAGS, started=True) == ("still thinking", "")


@pytest.mark.parametrize("started", [False, True])
def test_the_stream_sends_what_the_whole_answer_splits_into_however_it_is_cut(started):
    rng = random.Random(7)
    for text in ANSWERS:
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = ThoughtStream(TAGS, started)
            deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
            assert all(d for _, d in deltas)
            got = ("".join(d for k, d in deltas if k == "reasoning"), "".join(d for k, d in deltas if k == "content"))
            assert got == split(text, TAGS, started), (text, pieces)


def test_a_partial_close_tag_is_held_until_it_is_sure():
    stream = ThoughtStream(TAGS)
    assert stream.feed("<think>I think</") == [("reasoning", "I think")]
    assert stream.feed("th") == []
    assert stream.feed("ink>\n\nHi") == [("content", "Hi")]


# --- the grammar -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("reasoning") / "tiny.gguf")
    return Tokenizer.from_gguf(gguf_fields(path))


def _takes(tokenizer, grammar: str, text: str) -> bool:
    """The grammar takes every token of `text` (byte tokens here) and is complete after them."""
    c = mc.compile_constraint(grammar, tokenizer)
    return all(c.consume(t) for t in tokenizer.encode(text, False, False)) and c.accepting


SCHEMA = mc.json_schema_grammar(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}))


def test_a_json_schema_applies_to_the_answer_after_the_thought(tokenizer):
    g = constrain(Reasoning(), TAGS, False, SCHEMA)
    assert _takes(tokenizer, g, '<think>\nlet me see\n</think>\n\n{"a":1}')
    assert _takes(tokenizer, g, '{"a":1}')  # the model may answer at once
    assert not _takes(tokenizer, g, '<think>x</think>\n\nnot json')
    assert not _takes(tokenizer, SCHEMA, '<think>x</think>{"a":1}')  # without it, the schema forbids the thought
    opened = constrain(Reasoning(), TAGS, True, SCHEMA)  # the prompt opened it: it must close first
    assert _takes(tokenizer, opened, 'hmm</think>\n{"a":2}') and not _takes(tokenizer, opened, '{"a":2}')
    # thinking off: the schema is the whole answer, as before
    assert constrain(Reasoning(enable=False), TAGS, False, SCHEMA) == SCHEMA
    assert constrain(Reasoning(), None, False, SCHEMA) == SCHEMA  # a template that does not think
    assert constrain(Reasoning(), TAGS, False, None) is None  # nothing to enforce


def test_a_budget_closes_the_thought_once_spent(tokenizer):
    g = constrain(Reasoning(budget=6), TAGS, False, None)
    assert _takes(tokenizer, g, "<think>abcdef</think>then the answer")  # 6 thought tokens (bytes here)
    c = mc.compile_constraint(g, tokenizer)
    assert all(c.consume(t) for t in tokenizer.encode("<think>abcdef", False, False))
    assert not c.consume(tokenizer.encode("g", False, False)[0])  # the 7th is refused: the close tag is forced
    assert not _takes(tokenizer, g, "an answer without a thought")  # a budget: the thought is opened
    zero = constrain(Reasoning(budget=0), TAGS, True, None)  # R1 with budget 0: closed at once
    assert _takes(tokenizer, zero, "</think>hi") and not _takes(tokenizer, zero, "a</think>hi")


def test_a_budget_of_zero_renders_thinking_off():
    assert Reasoning(budget=0).template_kwargs() == {"enable_thinking": False}
    assert Reasoning(budget=0, enable=True).template_kwargs() == {"enable_thinking": True}
    assert Reasoning(budget=5).template_kwargs() == {}
    assert constrain(Reasoning(budget=0), TAGS, False, None) is None  # Qwen3's prompt closed the thought itself


# --- the request -------------------------------------------------------------------------------------------


def test_chat_fields_choose_how_a_request_thinks():
    r = read_chat({"chat_template_kwargs": {"enable_thinking": False, "custom": [1]}, "reasoning_effort": "low"},
                  7, "deepseek")
    assert (r.split, r.enable, r.budget, r.legacy) == (True, False, 7, False)
    assert r.template_kwargs() == {"custom": [1], "reasoning_effort": "low", "enable_thinking": False}
    assert not read_chat({}, -1, "none").split and read_chat({}, -1, "deepseek-legacy").legacy
    assert read_chat({}).split  # the default: llama-server's auto, the thought apart


@pytest.mark.parametrize("body, fmt, message", [
    ({"chat_template_kwargs": [1]}, None, "'chat_template_kwargs' must be a JSON object, got array"),
    ({"chat_template_kwargs": "x"}, None, "'chat_template_kwargs' must be a JSON object, got string"),
    ({"chat_template_kwargs": {"messages": []}}, None, "'chat_template_kwargs' cannot set 'messages'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False, "bos_token": ""}}, None,
     "'chat_template_kwargs' cannot set 'add_generation_prompt', 'bos_token'"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, None,
     'invalid type for "enable_thinking" (expected boolean, got string)'),
    ({"reasoning_effort": 3}, None, "'reasoning_effort' must be a string, got number"),
    ({}, "deepthink", "Unknown reasoning format: deepthink"),
])
def test_what_a_template_cannot_take_is_a_400_naming_it(body, fmt, message):
    with pytest.raises(InvalidRequest) as e:
        read_chat(body, -1, fmt)
    assert str(e.value).startswith(message)


def test_ollamas_think_values():
    assert ollama_think(None) == Reasoning()
    assert ollama_think(True) == Reasoning(enable=True)
    assert ollama_think(False) == Reasoning(enable=False, split=False)  # the thought, if any, stays in the content
    assert ollama_think("high").template_kwargs() == {"reasoning_effort": "high", "enable_thinking": True}
    for bad in ("max", 1, [], "TRUE"):
        with pytest.raises(InvalidRequest, match="invalid think value"):
            ollama_think(bad)
