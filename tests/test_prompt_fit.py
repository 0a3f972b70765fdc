"""Fitting a conversation to num_ctx as Ollama's chatPrompt does (gateway/serving/prompt_fit.py, spec §4.4),
over a fake model whose every word is one token."""

from __future__ import annotations

import pytest

from bankml.errors import InvalidRequest
from gateway.serving.prompt_fit import chat_prompt, fit_messages, raw_prompt
from model.tokenizer_bpe import TokenLimitExceeded


class WordModel:
    """NativeModel's render/tokenize: `role: content` per message, one token per word (and one for the
    generation prompt); the limit is honoured as the real tokenizer honours it."""

    def __init__(self, n_ctx: int = 64):
        self.n_ctx = n_ctx
        self.calls = 0

    @property
    def count_limit(self) -> int:
        return 2 * self.n_ctx + 16

    def render(self, messages, add_generation_prompt=True, tools=None):
        listed = f"tools: {' '.join(t['function']['name'] for t in tools)} " if tools else ""
        return listed + " ".join(f"{m['role']}: {m['content']}" for m in messages) + \
            (" assistant:" if add_generation_prompt else "")

    def tokenize(self, text, add_special, parse_special, limit=None):
        self.calls += 1
        ids = [hash(w) % 1000 for w in text.split()]
        if limit is not None and len(ids) > limit:
            raise TokenLimitExceeded(limit + 1)
        return ids


def msg(role: str, words: int, tag: str = "w") -> dict:
    return {"role": role, "content": " ".join([tag] * words)}


def words(messages) -> int:
    return sum(1 + len(m["content"].split()) for m in messages) + 1  # role words, content, generation prompt


def test_everything_that_fits_is_kept():
    m = WordModel()
    conv = [msg("system", 3), msg("user", 3), msg("assistant", 3), msg("user", 3)]
    assert len(chat_prompt(m, conv, 64)) == words(conv)
    assert len(chat_prompt(m, conv, None)) == words(conv)


def test_a_conversation_kept_whole_is_tokenized_once_per_candidate():
    m = WordModel()
    conv = [msg("system", 3), msg("user", 3), msg("assistant", 3), msg("user", 3)]
    tokens = chat_prompt(m, conv, 64)
    # the candidates from messages[2:] back to messages[0:]; the last of them is the prompt itself
    assert m.calls == 3 and tokens == m.tokenize(m.render(conv), True, True)


def test_the_oldest_go_first_and_the_system_before_them_stays():
    conv = [msg("system", 2, "s"), msg("user", 10, "a"), msg("assistant", 10, "b"), msg("user", 3, "c")]
    # with the system kept: [sys] + msgs[2:] is 3 + 11 + 4 + 1 = 19 tokens; + msgs[1] would be 30
    kept, dropped = fit_messages(conv, 20, words)
    assert kept == [conv[0], conv[2], conv[3]] and dropped == 1
    kept, dropped = fit_messages(conv, 30, words)
    assert kept == conv and dropped == 0
    kept, _ = fit_messages(conv, 10, words)
    assert kept == [conv[0], conv[3]]


def test_the_quirk_a_system_message_that_is_the_first_cut_is_dropped():
    # i=1 is a system message and [msgs[1:]] does not fit: the system messages *before* 1 are kept (none),
    # so msgs[1] is lost although it is a system message
    conv = [msg("user", 1, "a"), msg("system", 20, "s"), msg("user", 3, "b")]
    kept, dropped = fit_messages(conv, 8, words)
    assert kept == [conv[2]] and dropped == 2
    # a system message before the first cut stays, even when it alone is long
    conv = [msg("system", 30, "s"), msg("user", 3, "a"), msg("user", 3, "b")]
    assert fit_messages(conv, 12, words)[0] == [conv[0], conv[2]]
    # and the leading system message goes when it is itself the first one cut
    conv = [msg("system", 30, "s"), msg("user", 3, "a")]
    assert fit_messages(conv, 12, words)[0] == [conv[1]]
    # the system messages before a kept one are not counted twice
    conv = [msg("system", 2, "s"), msg("user", 3, "a"), msg("system", 2, "t"), msg("user", 3, "b")]
    assert fit_messages(conv, 100, words)[0] == conv


def test_the_last_message_always_stays_and_alone_too_long_is_400():
    m = WordModel()
    conv = [msg("user", 5), msg("assistant", 5), msg("user", 40)]
    assert fit_messages(conv, 10, words)[0] == [conv[2]]
    with pytest.raises(InvalidRequest) as e:
        chat_prompt(m, conv, 10)
    assert e.value.message == (
        "the prompt is 42 tokens, more than num_ctx 10 with the 2 oldest messages dropped: Ollama would cut tokens "
        "out of its middle (num_keep), which bankML does not reproduce; shorten the last message or raise num_ctx "
        "(up to this server's --ctx)")
    with pytest.raises(InvalidRequest, match=r"^the prompt is 42 tokens, more than num_ctx 10: Ollama"):
        chat_prompt(m, [conv[2]], 10)


def test_a_fitted_prompt_is_the_templated_kept_conversation():
    m = WordModel()
    conv = [msg("system", 2, "s"), msg("user", 10, "a"), msg("assistant", 10, "b"), msg("user", 3, "c")]
    assert chat_prompt(m, conv, 20) == m.tokenize(m.render([conv[0], conv[2], conv[3]]), True, True)


def test_the_tools_are_in_every_candidate_and_count_against_num_ctx():
    m = WordModel()
    conv = [msg("system", 2, "s"), msg("user", 10, "a"), msg("assistant", 10, "b"), msg("user", 3, "c")]
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(9)]  # 10 words of template
    got = chat_prompt(m, conv, 20, tools)
    assert got == m.tokenize(m.render([conv[0], conv[3]], True, tools), True, True)  # one more message cut


def test_the_servers_context_bounds_it_too():
    m = WordModel(n_ctx=16)
    with pytest.raises(InvalidRequest, match=r"^the prompt has 17 tokens; the context is 16$"):
        chat_prompt(m, [msg("user", 15)], None)
    with pytest.raises(InvalidRequest, match=r"^the prompt has at least \d+ tokens; the context is 16$"):
        chat_prompt(m, [msg("user", 100)], None)


def test_raw():
    m = WordModel()
    assert raw_prompt(m, "a b c", None) == m.tokenize("a b c", True, True)
    assert raw_prompt(m, "a b c", 3) == m.tokenize("a b c", True, True)
    with pytest.raises(InvalidRequest) as e:
        raw_prompt(m, "a b c d", 3)
    assert e.value.message == (
        "the raw prompt is 4 tokens, more than num_ctx 3: Ollama would cut tokens out of its middle (num_keep), "
        "which bankML does not reproduce; shorten it or raise num_ctx (up to this server's --ctx)")


def test_counting_stops_early_for_a_long_candidate():
    m = WordModel()
    conv = [msg("user", 1000), msg("user", 3)]
    # the long candidate hits the tokenizer's limit (num_ctx) rather than being counted whole
    assert chat_prompt(m, conv, 8) == m.tokenize(m.render([conv[1]]), True, True)
