"""model/stops.py and model/completion.py on hand-made tokens: each of llama-server's rules by hand.

A toy vocabulary: token i is the i-th piece of PIECES (raw bytes), 0 is the end-of-generation token.
The same host side runs against llama-server's real recordings in tests/test_parity.py.
"""

from __future__ import annotations

import pytest

from model.completion import Completion
from model.messages import FinishReason, SamplingParams
from model.stops import find_partial_stop, find_stop

PIECES = [b"", b"Hel", b"lo", b" th", b"ere", b"!", b"\xf0\x9f", b"\x98\x80", b" I", b"x"]
IDS = {p: i for i, p in enumerate(PIECES)}
EOG = 0


class Toy:
    def token_to_piece(self, token: int, special: bool) -> bytes:
        return PIECES[token]

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        # greedy longest match over the toy pieces (enough to count a stop's tokens)
        data, out = text.encode(), []
        while data:
            best = max((p for p in PIECES if p and data.startswith(p)), key=len, default=data[:1])
            out.append(IDS.get(best, 99))
            data = data[len(best):]
        return out


def run(tokens: list[int], n_ctx: int = 100, n_prompt: int = 5, probs: bool = False, **kw):
    c = Completion(Toy(), SamplingParams(n_probs=2 if probs else 0, **kw), n_prompt=n_prompt, n_ctx=n_ctx,
                   eog_ids={EOG})
    outs = []
    for t in tokens:
        outs.append(c.push(t, -0.5 if probs else None, [(t, -0.5), (9, -2.0)] if probs else ()))
        if outs[-1].finish_reason is not None:
            break
    return outs


def test_find_stop_searches_only_near_the_end_and_the_earliest_wins():
    assert find_stop(b"Hello there", [b"lo", b"He"], piece_len=9) == (0, b"He")
    assert find_stop(b"Hello there", [b"He"], piece_len=1) is None  # ended before this token's bytes
    assert find_stop(b"abcab", [b"b", b"ab"], piece_len=5) == (0, b"ab")
    assert find_stop(b"abc", [b"c", b"bc"], piece_len=1) == (1, b"bc")


def test_find_partial_stop_is_the_longest_prefix_of_a_stop_at_the_end():
    assert find_partial_stop(b"Hello th", [b"lo there"]) == 3
    assert find_partial_stop(b"Hello", [b"xyz"]) is None
    assert find_partial_stop(b"Hello", [b""]) is None


def test_a_stop_split_across_tokens_is_held_then_dropped():
    outs = run([1, 2, 3, 4], stop=("lo th",))
    assert [o.text for o in outs] == ["", "", "Hel"]  # "l", then "lo" might begin the stop; " th" ends it
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].completion_tokens == 3
    assert outs[-1].held_text == ""


def test_held_text_is_released_when_the_stop_cannot_complete():
    outs = run([1, 2, 5], stop=("lox",))
    assert [o.text for o in outs] == ["", "", "Hello!"]


def test_held_text_at_the_limit_is_held_text_for_a_whole_answer_only():
    outs = run([1, 2, 3], stop=("lox",), max_tokens=2)
    assert [o.text for o in outs] == ["", ""]
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].held_text == "Hello"


def test_the_end_of_generation_token_releases_held_text_and_counts():
    outs = run([1, 2, EOG], stop=("lox",))
    assert [o.text for o in outs] == ["", "", "Hello"]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].completion_tokens == 3


def test_max_tokens_0_still_gives_one_token():
    outs = run([1, 2, 3], max_tokens=0)
    assert len(outs) == 1 and outs[0].text == "Hel" and outs[0].finish_reason is FinishReason.LENGTH


def test_a_full_context_says_length_even_over_a_stop_word():
    outs = run([1, 2], n_prompt=8, n_ctx=10, stop=("lo",))
    assert outs[-1].completion_tokens == 2 and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].logprobs_trim == 0


def test_an_empty_stop_fires_at_once_as_in_llama_server():
    outs = run([1, 2], stop=("",))
    assert len(outs) == 1 and outs[0].text == "" and outs[0].finish_reason is FinishReason.STOP


def test_a_character_split_across_tokens_makes_one_entry_with_its_text():
    outs = run([6, 7, 5], probs=True)
    assert outs[0].text == "" and outs[0].logprobs is None  # half an emoji: no entry yet
    assert outs[1].text == "😀" and outs[1].logprobs.text == "😀".encode() and outs[1].logprobs.token == 7
    assert [t.token for t in outs[1].logprobs.top] == [7, 9] and outs[1].logprobs.top[1].piece == b"x"


def test_a_character_cut_by_the_end_is_held_text():
    outs = run([5, 6], max_tokens=2)
    assert outs[-1].text == "" and outs[-1].held_text == "\ufffd"


def test_the_stop_words_entries_are_counted_as_llama_server_counts_them():
    outs = run([1, 3, 4, 5, 8], stop=("there! I",), probs=True)
    assert [o.text for o in outs] == ["Hel", "", "", "", " "]  # the whole unsent text waits, not just the stop
    assert outs[-1].finish_reason is FinishReason.STOP
    entries = [o.logprobs for o in outs if o.logprobs is not None]
    assert len(entries) == 5 and outs[-1].logprobs_trim == len(Toy().encode("there! I", False, False))


def test_a_finished_completion_takes_no_more_tokens():
    c = Completion(Toy(), SamplingParams(max_tokens=1), n_prompt=1, n_ctx=10, eog_ids={EOG})
    c.push(1)
    with pytest.raises(ValueError):
        c.push(2)
