"""Constrained decoding through llguidance: grammars compiled once per request, a token mask per step.

- `lltokenizer(tokenizer)`: llguidance's view of a model's vocabulary, built once per tokenizer (about
  2 s for SmolLM2's 49k tokens) and kept. Every token is its bytes as llama-server renders it; a
  control token is prefixed with 0xFF, as llguidance's own llama.cpp bridge does, so no grammar text
  can spell it (llguidance/llamacpp.py). The end-of-generation tokens end a grammar that is complete.
- The grammar builders turn what a request names into llguidance's grammar text: a JSON schema (its
  text as the request sent it, so numbers stay exact), any JSON object, GBNF (llama-server's
  `grammar`), Lark, a regex. JSON's whitespace is llama.cpp's (common/json-schema-to-grammar.cpp,
  SPACE_RULE: nothing, one space, or one or two newlines and up to 20 spaces or tabs), so a small
  model cannot spend its tokens on blank lines.
- `compile_constraint(grammar, tok)`: a `Constraint` ready for one sequence, or `GrammarRejected`
  with llguidance's reason. It is built by the gateway, off the event loop, before any model work;
  `Constraint.copy()` gives each further sequence of a request its own state.
- `Constraint` is the engine's handle: `fill(row)` writes the allowed tokens into one row of a
  bitmask (int32 words, bit t of word t // 32 for token t, llguidance's layout), `consume(token)`
  advances it, `done` says the grammar is complete (the sequence ends, "stop"), `grammar_ms` is the
  host time spent in both, measured.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from model import gbnf
from model.tokenizer import TokenAttr

# llama.cpp's SPACE_RULE, as a regex between JSON's tokens
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE, "item_separator": ",",
                                "key_separator": ":"}
# what a grammar may cost (llguidance's own limits, tightened for a request): compile fuel, lexer
# states, grammar size. A schema past them is refused with llguidance's reason. Items in a row (its
# default) is checked only while decoding: model/gbnf.py refuses a GBNF past it before.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_lexer_states=100_000,
                                   max_grammar_size=200_000, max_items_in_row=gbnf.MAX_ITEMS_IN_ROW,
                                   verbose_errors=False)


class GrammarRejected(ValueError):
    """A grammar or schema llguidance cannot compile; the message is its reason."""


# --- the vocabulary --------------------------------------------------------------------------------

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads off a tokenizer (llguidance/_tokenizer.py)."""

    def __init__(self, tokenizer) -> None:
        # weakly: llguidance's LLTokenizer keeps this object (its tokenize callback) and is _TOKENIZERS's value
        # for this very tokenizer, so a strong reference kept every unloaded model's tokenizer and its
        # LLTokenizer (~50 MB for SmolLM2's vocabulary) alive for good
        self._tokenizer = weakref.ref(tokenizer)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = []
        for t in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_piece(t, True)
            if tokenizer.attrs[t] & TokenAttr.CONTROL:
                piece = b"\xff" + piece
            self.tokens.append(piece)
        self.special_token_ids = []

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the model's tokenizer was unloaded")
        return tokenizer.encode(text, False, False)


def lltokenizer(tokenizer, n_vocab: int | None = None) -> LLTokenizer:
    """llguidance's tokenizer for `tokenizer` (model/tokenizer.py), built once and kept while the
    tokenizer lives. `n_vocab`: the model's output width, when it has more rows than tokens."""
    with _LOCK:
        built = _TOKENIZERS.get(tokenizer)
        if built is None:
            eog = sorted(getattr(tokenizer, "eog_ids", None) or [tokenizer.eos_id])
            built = LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
                                n_vocab=max(n_vocab or 0, tokenizer.n_vocab), eos_token=eog)
            _TOKENIZERS[tokenizer] = built
        return built


# --- grammars --------------------------------------------------------------------------------------


def json_schema_grammar(schema_text: str) -> str:
    """llguidance's grammar for a JSON schema given as its text (numbers as the request wrote them)."""
    try:
        return LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarRejected(str(e)) from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `json_object`, Ollama's `"json"`), as llama-server's {"type": "object"}."""
    return json_schema_grammar(json.dumps({"type": "object"}))


def gbnf_grammar(text: str) -> str:
    """A GBNF grammar (llama-server's `grammar`) in llguidance's Lark; GrammarRejected for one past what
    llguidance takes (model/gbnf.py, check_llguidance_size)."""
    try:
        gbnf.check_llguidance_size(text)
    except gbnf.GrammarTooLarge as e:
        raise GrammarRejected(str(e)) from None
    except gbnf.GrammarError:
        pass  # what llama.cpp's parser refuses was refused with its words before (request_fields.py)
    try:
        return LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except Exception as e:  # gbnf_to_lark raises plain Exceptions on what it cannot read
        raise GrammarRejected(f"failed to parse grammar: {e}") from None


def lark_grammar(text: str) -> str:
    return LLMatcher.grammar_from_lark(text)


def regex_grammar(regex: str) -> str:
    return LLMatcher.grammar_from_regex(regex)


# --- one sequence's constraint ---------------------------------------------------------------------


class Constraint:
    """One sequence's grammar state (an llguidance matcher) and the host time it has cost."""

    def __init__(self, matcher: LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self.n_vocab = n_vocab
        self.grammar_ms = 0.0
        self._scratch = allocate_token_bitmask(1, n_vocab)

    def copy(self) -> Constraint:
        """A fresh state for another sequence of the same request (its time counted apart)."""
        return Constraint(self._matcher.deep_copy(), self.n_vocab)

    def fill(self, row: np.ndarray) -> None:
        """The tokens allowed next into `row` (int32 [host_bias.bitmask_words(n_vocab)]): bit set = allowed."""
        t0 = time.perf_counter()
        fill_next_token_bitmask(self._matcher, self._scratch, 0)
        n = min(row.shape[0], self._scratch.shape[1])
        row[:n] = self._scratch[0, :n]
        row[n:] = 0  # rows past llguidance's vocabulary: never allowed
        self.grammar_ms += (time.perf_counter() - t0) * 1e3

    def consume(self, token: int) -> bool:
        """Advance past `token`; False when the grammar forbids it (then `error` says why)."""
        t0 = time.perf_counter()
        ok = self._matcher.consume_token(token)
        self.grammar_ms += (time.perf_counter() - t0) * 1e3
        return ok

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the sequence ends here."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


def compile_constraint(grammar: str, tokenizer, n_vocab: int | None = None) -> Constraint:
    """A `Constraint` for llguidance grammar text (one of the builders above), or GrammarRejected."""
    tok = lltokenizer(tokenizer, n_vocab)
    matcher = LLMatcher(tok, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise GrammarRejected(matcher.get_error())
    return Constraint(matcher, tok.vocab_size)
