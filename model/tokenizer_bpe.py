"""Byte-level BPE (`tokenizer.ggml.model = "gpt2"`), as llama.cpp's llm_tokenizer_bpe_session.

A text fragment (no special tokens left in it) is cut into words by the pre-tokenizer's regexes, each
word's UTF-8 bytes are mapped to GPT-2's printable byte alphabet, and each word is merged pair by pair,
lowest merge rank first, leftmost on ties. Words are cached: the same word always gives the same ids.

The regexes are llama.cpp's own (src/llama-vocab.cpp, `llm_tokenizer_bpe`), applied one after the other
as src/unicode.cpp's `unicode_regex_split` does: each one splits the pieces the previous one left, and
text between matches stays a piece of its own. llama.cpp runs them on a "collapsed" copy of the text
where every code point >= 128 is replaced by one byte naming its class in llama.cpp's Unicode table
(`\\p{L}` -> 0xD2, `\\p{N}` -> 0xD1, whitespace -> 0x0B, ...); we do the same with Python's `re` in
ASCII mode, which matches std::regex's ECMAScript semantics for these patterns. llama.cpp's hand-written
splitters for the GPT-2 and Llama-3 patterns (unicode_regex_split_custom_*) follow those patterns branch
for branch, so the same path serves them; tests/fixtures/tokenize_pre_*.json hold llama-server's answers.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from model import tokenizer_unicode_data as _ud

_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
           "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
          "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """One `tokenizer.ggml.pre` family: its regexes and the defaults llama.cpp gives it."""

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is taken whole
    add_bos: bool = False  # llama.cpp's default before `tokenizer.ggml.add_bos_token`


_DEFAULT = PreTokenizer("default", (
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    _GPT2,
    "\\p{N}+",
    "[0-9][0-9][0-9]",
))
_FAMILIES = {
    "default": _DEFAULT,
    "gpt2": PreTokenizer("gpt2", (_GPT2,)),
    "smollm": PreTokenizer("smollm", ("\\p{N}", _GPT2)),
    "llama3": PreTokenizer("llama3", (_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer("qwen2", (_QWEN2,)),
}
# `tokenizer.ggml.pre` values llama.cpp maps to each family (llama_vocab::impl::load). A missing key
# means "default", as there.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _FAMILIES["default"],
    "gpt-2": _FAMILIES["gpt2"],
    "smollm": _FAMILIES["smollm"],
    "llama3": _FAMILIES["llama3"],
    "llama-v3": _FAMILIES["llama3"],
    "llama-bpe": _FAMILIES["llama3"],
    "qwen2": _FAMILIES["qwen2"],
    "deepseek-r1-qwen": _FAMILIES["qwen2"],
}


# --- llama.cpp's code point classes and the collapsed text ---------------------------------------

_CLASS_BYTE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5", "O": "\xd0"}
_WHITESPACE_BYTE = "\x0b"  # std::regex's \s does not match non-ASCII spaces; llama.cpp uses VT


def _build_collapse_table() -> str:
    """A 0x110000-character string: entry c is the collapsed form of code point c (ASCII is itself)."""
    starts = (*_ud.RANGE_STARTS, 0x110000)
    classes = "".join(_ud.RANGE_CLASSES)
    table = bytearray().join(
        _CLASS_BYTE[cls].encode("latin-1") * (starts[i + 1] - starts[i]) for i, cls in enumerate(classes))
    for cp in _ud.WHITESPACE:
        table[cp] = ord(_WHITESPACE_BYTE)
    table[:128] = bytes(range(128))
    return table.decode("latin-1")


_COLLAPSE = _build_collapse_table()
# Non-ASCII whitespace only, for regexes that name no Unicode class (llama.cpp's std::wregex path).
_WIDE_SPACES = {cp: _WHITESPACE_BYTE for cp in _ud.WHITESPACE if cp > 0x7F}

# The ASCII members of each class, as llama.cpp writes them into a collapsed regex (k_ucat_map).
_CLASS_ASCII = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    "M": "",
    "S": "\\$\\+<-\\>\\^`\\|",
}
_UCAT = {"\\p{N}": "N", "\\p{L}": "L", "\\p{P}": "P", "\\p{M}": "M", "\\p{S}": "S",
         "\\p{Lu}": "L", "\\p{Ll}": "L", "\\p{Lt}": "L", "\\p{Lm}": "L", "\\p{Lo}": "L"}


def _uses_classes(expr: str) -> bool:
    return any(cat in expr for cat in _UCAT)


@cache
def _compile(expr: str) -> re.Pattern[str]:
    """llama.cpp's regex, rewritten for the collapsed text when it names Unicode classes."""
    if not _uses_classes(expr):
        return re.compile(expr, re.ASCII)
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
            out.append(c)
        elif inside and c == "]" and expr[i - 1] != "\\":
            inside = False
            out.append(c)
        elif expr.startswith("\\p{", i) and (close := expr.find("}", i + 3)) != -1 and expr[i:close + 1] in _UCAT:
            cls = _UCAT[expr[i:close + 1]]
            body = re.escape(_CLASS_BYTE[cls]) + _CLASS_ASCII[cls]
            out.append(body if inside else f"[{body}]")
            i = close
        else:
            out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII)


def regex_split(text: str, regexes: Sequence[str]) -> list[str]:
    """Split `text` into words as llama.cpp's unicode_regex_split does (before byte encoding)."""
    if not text:
        return []
    collapsed = text.translate(_COLLAPSE) if any(map(_uses_classes, regexes)) else ""
    wide = ""
    lengths = [len(text)]
    for expr in regexes:
        subject = collapsed if _uses_classes(expr) else (wide or (wide := text.translate(_WIDE_SPACES)))
        finditer = _compile(expr).finditer
        out: list[int] = []
        start = 0
        for n in lengths:
            end = start + n
            pos = start
            for m in finditer(subject, start, end):
                a, b = m.span()
                if a > pos:
                    out.append(a - pos)
                out.append(b - a)
                pos = b
            if pos < end:
                out.append(end - pos)
            start = end
        lengths = out
    words = []
    start = 0
    for n in lengths:
        words.append(text[start:start + n])
        start += n
    return words


# --- GPT-2's byte alphabet ---------------------------------------------------------------------

def _bytes_to_unicode() -> list[str]:
    """src/unicode.cpp unicode_byte_to_utf8_map: printable bytes are themselves, the rest 256 + n."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in keep:
        table[b] = chr(b)
    n = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
_BYTE_ENCODE = "".join(BYTE_TO_CHAR)  # a translate table indexed by byte value


def byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogateescape").decode("latin-1").translate(_BYTE_ENCODE)


# --- the merges ---------------------------------------------------------------------------------

def parse_merges(merges: Iterable[str]) -> dict[tuple[str, str], int]:
    """`tokenizer.ggml.merges` -> rank of each pair. llama.cpp splits at the first space after the
    first character, and keeps the first rank of a repeated pair."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        pos = merge.find(" ", 1)
        pair = (merge[:pos], merge[pos + 1:]) if pos != -1 else ("", "")
        ranks.setdefault(pair, rank)
    return ranks


# --- bounds -------------------------------------------------------------------------------------

# The merge loop holds a few hundred bytes per character of the word it merges, so a word is merged
# at most this many characters at a time. llama.cpp merges any word whole (and in C++); we cut a
# longer one only where no merge can join the two sides, which leaves the tokens unchanged.
MAX_MERGE_CHARS = 1 << 16
CUT_SEARCH = 1 << 12  # how far back from a chunk's end such a place is looked for


class TokenLimitExceeded(ValueError):
    """The text makes more tokens than the caller's limit; `at_least` of them are counted."""

    def __init__(self, at_least: int):
        super().__init__(f"the text makes at least {at_least} tokens")
        self.at_least = at_least


class InvalidText(ValueError):
    """The text cannot be tokenized as it is (a lone surrogate, or a run the merge loop does not take).
    The message is the reason; a request that sent it gets a 400."""


class WordTooLong(InvalidText):
    """A run of text that cannot be cut without changing its tokens is longer than the merge loop takes."""


def exact_chunks(word: str, unsafe: Container[str], max_chars: int) -> list[str]:
    """`word` in pieces of at most `max_chars`, cut only between two characters whose pair is not in
    `unsafe` (the pairs some merge would join), so that merging the pieces one by one gives the
    tokens the whole word gives."""
    out: list[str] = []
    start, n = 0, len(word)
    while n - start > max_chars:
        end = start + max_chars
        cut = next((p for p in range(end, max(start, end - CUT_SEARCH), -1) if word[p - 1:p + 1] not in unsafe),
                   None)
        if cut is None:
            raise WordTooLong(f"the text holds a run of more than {max_chars} characters that the tokenizer "
                              "cannot cut without changing its tokens")
        out.append(word[start:cut])
        start = cut
    out.append(word[start:])
    return out


class IdsCache:
    """Token ids by text, bounded by count and by bytes (about: the text, its ids and the dict's own
    slot), emptied when full, so a hostile text cannot grow it; a text over `max_chars` is not kept
    (it is rarely seen twice)."""

    def __init__(self, max_entries: int, max_bytes: int, max_chars: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_chars = max_chars
        self._ids: dict[str, tuple[int, ...]] = {}
        self.nbytes = 0

    def get(self, text: str) -> tuple[int, ...] | None:
        return self._ids.get(text)

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > self.max_chars:
            return
        size = 100 + 2 * len(text) + 8 * len(ids)
        if len(self._ids) >= self.max_entries or self.nbytes + size > self.max_bytes:
            self.clear()
        self._ids[text] = ids
        self.nbytes += size

    def clear(self) -> None:
        self._ids.clear()
        self.nbytes = 0

    def __contains__(self, text: str) -> bool:
        return text in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class BpeModel:
    """The merge loop and the word cache for one vocabulary."""

    def __init__(self, token_to_id: Mapping[str, int], ranks: Mapping[tuple[str, str], int],
                 pre: PreTokenizer):
        self.token_to_id = token_to_id
        self.ranks = ranks
        self.pre = pre
        self._cache = IdsCache(max_entries=1 << 17, max_bytes=64 << 20, max_chars=256)  # words
        self._junctions: frozenset[str] | None = None

    @property
    def junctions(self) -> frozenset[str]:
        """Every pair of byte-level characters a merge joins: a word may be cut anywhere else."""
        if self._junctions is None:
            self._junctions = frozenset(left[-1] + right[0] for left, right in self.ranks if left and right)
        return self._junctions

    def tokenize(self, text: str, out: list[int] | None = None, limit: int | None = None,
                 min_tokens: Callable[[str], int] | None = None) -> list[int]:
        """Append the text's tokens to `out`. With `limit`, stop with TokenLimitExceeded once `out` holds
        more than `limit` ids, or before merging a long word that would pass it by itself, by
        `min_tokens(word)` (a lower bound on its tokens)."""
        out = [] if out is None else out
        cache = self._cache
        for word in regex_split(text, self.pre.regexes):
            ids = cache.get(word)
            if ids is None:
                if limit is not None and min_tokens is not None and len(word) > cache.max_chars:
                    at_least = len(out) + min_tokens(word)
                    if at_least > limit:
                        raise TokenLimitExceeded(at_least)
                ids = self._encode_word(word)
                cache.put(word, ids)
            out.extend(ids)
            if limit is not None and len(out) > limit:
                raise TokenLimitExceeded(len(out))
        return out

    def _encode_word(self, word: str) -> tuple[int, ...]:
        encoded = byte_encode(word)
        if len(encoded) <= MAX_MERGE_CHARS:
            return self._word(encoded)
        if self.pre.ignore_merges and encoded in self.token_to_id:
            return (self.token_to_id[encoded],)
        chunks = exact_chunks(encoded, self.junctions, MAX_MERGE_CHARS)
        return tuple(t for chunk in chunks for t in self._word(chunk, merges_only=True))

    def _word(self, word: str, merges_only: bool = False) -> tuple[int, ...]:
        token_to_id = self.token_to_id
        if self.pre.ignore_merges and not merges_only and word in token_to_id:
            return (token_to_id[word],)
        texts: list[str] = list(word)
        n = len(texts)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        ranks = self.ranks
        heap: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            rank = ranks.get((texts[left], texts[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, texts[left] + texts[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not texts[left] or not texts[right] or texts[left] + texts[right] != merged:
                continue  # outdated: one side was merged since this pair was queued
            texts[left] = merged
            texts[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        ids: list[int] = []
        for sym in texts:
            if not sym:
                continue
            tid = token_to_id.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            # No token for the merged text: one token per byte of its encoded form, and a byte
            # without a token is dropped, as llama.cpp does.
            for b in sym.encode("utf-8"):
                tid = token_to_id.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if tid is not None:
                    ids.append(tid)
        return tuple(ids)
