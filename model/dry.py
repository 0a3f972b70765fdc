"""DRY ("Don't Repeat Yourself"), host-side: llama.cpp's `llama_sampler_dry_apply` in numpy.

It runs on the host because its Z-algorithm scan is sequential and data-dependent; the device adds
the [B, V] bias it yields after the penalties and before top-n-sigma (sample_chain's `bias`).
Ported from src/llama-sampler.cpp (itself from koboldcpp PR 982).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# llama_sampler_init_dry (src/llama-sampling.cpp): a breaker is cut to 40 characters (bytes), its tail
# to 20 tokens. llama.cpp sets no limit on how many breakers a request names; each costs one pass over
# the vocabulary there, so the gateway bounds their number (gateway/serving/request_fields.py, MAX_DRY_BREAKERS).
MAX_CHAR_LEN = 40
MAX_SEQ_LEN = 20
# log(FLT_MAX): the exponent is clamped so the penalty stays finite
FLOAT_MAX_LOG = 88.7228391

# head token -> the tails (token tuples) that complete a restart sequence with it
RestartSequences = dict[int, list[tuple[int, ...]]]

_SEP = b"\xff"  # never in UTF-8 text, so never inside a breaker


def dry_enabled(multiplier: float, base: float, last_n: int) -> bool:
    """llama_sampler_init_dry's test: otherwise the sampler is empty."""
    return multiplier != 0.0 and base >= 1.0 and last_n != 0


class PieceIndex:
    """Every token's text in one byte string, 0xFF after each, so that finding the tokens that hold a
    breaker, or end with its beginning, is a search at C speed instead of a pass over the vocabulary."""

    def __init__(self, pieces: Sequence[bytes]):
        self.blob = _SEP.join(pieces) + _SEP
        self.starts = [0, *itertools.accumulate(len(p) + 1 for p in pieces)]  # starts[t + 1] - 1: t's end

    def _token_at(self, x: int) -> int:
        return bisect.bisect_right(self.starts, x) - 1

    def holding(self, s: bytes) -> list[int]:
        """The tokens whose text contains `s` (which holds no 0xFF, so no match spans two tokens)."""
        out, x = [], self.blob.find(s)
        while x != -1:
            t = self._token_at(x)
            out.append(t)
            x = self.blob.find(s, self.starts[t + 1])
        return out

    def ending_with(self, s: bytes) -> list[int]:
        """The tokens whose text ends with `s` (a 0xFF inside a token's own text is not its end)."""
        out, needle = [], s + _SEP
        x = self.blob.find(needle)
        while x != -1:
            t = self._token_at(x)
            if x + len(s) == self.starts[t + 1] - 1:
                out.append(t)
            x = self.blob.find(needle, x + 1)
        return out


def restart_sequences(breakers: Sequence[str], pieces: Sequence[bytes] | PieceIndex, encode) -> RestartSequences:
    """The breakers as token sequences (llama.cpp's get_overlapping_token_sequences).

    pieces[t]: token t's text with specials (vocab.detokenize({t}, true)), or a PieceIndex of them;
    encode(text) -> token ids without BOS and without parsing specials. A token that contains a breaker
    is a restart by itself (empty tail); a token that ends with a breaker's prefix is a head whose tail
    is the rest, tokenized. A breaker repeated (after the cut to 40 bytes) adds nothing.
    """
    index = pieces if isinstance(pieces, PieceIndex) else PieceIndex(pieces)
    out: RestartSequences = {}
    seen: set[bytes] = set()
    for breaker in breakers:
        s = breaker.encode("utf-8")[:MAX_CHAR_LEN]
        if not s or s in seen:
            continue  # llama.cpp skips empty breakers with a warning
        seen.add(s)
        holders = set(index.holding(s))
        for token in sorted(holders):
            tails = out.setdefault(token, [])
            if () not in tails:  # a multimap in llama.cpp; a duplicate changes nothing
                tails.append(())
        # the token's text ends with s[:k]; llama.cpp scans each token from its start, so the longest
        # overlap (the smallest position) comes first
        heads: dict[int, list[int]] = {}
        for k in range(len(s) - 1, 0, -1):
            for token in index.ending_with(s[:k]):
                if token not in holders:
                    heads.setdefault(token, []).append(k)
        tail_of: dict[int, tuple[int, ...]] = {}
        for token in sorted(heads):
            tails = out.setdefault(token, [])
            for k in heads[token]:
                if k not in tail_of:
                    tail_of[k] = tuple(encode(s[k:].decode("utf-8", errors="replace")))[:MAX_SEQ_LEN]
                if tail_of[k] not in tails:
                    tails.append(tail_of[k])
    return out


class RestartCache:
    """The restart sequences of the breaker lists seen lately, least recently used out first, bounded
    by count and by an estimate of their bytes (a list of breakers common in the vocabulary can hold
    an entry for most tokens)."""

    def __init__(self, max_entries: int = 8, max_bytes: int = 64 << 20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, ...], tuple[RestartSequences, int]] = OrderedDict()
        self.n_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, ...], build) -> RestartSequences:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[0]
        value = build()
        size = restart_bytes(value)
        self._entries[key] = (value, size)
        self.n_bytes += size
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.n_bytes > self.max_bytes):
            _, (_, old) = self._entries.popitem(last=False)
            self.n_bytes -= old
        return value


def restart_bytes(restarts: RestartSequences) -> int:
    """A rough size in memory: a dict slot and a list per head, a tuple per tail, a pointer per token."""
    return sum(120 + sum(48 + 8 * len(t) for t in tails) for tails in restarts.values())


def dry_penalties(history: Sequence[int], multiplier: float, base: float, allowed_length: int,
                  last_n: int, restarts: RestartSequences) -> dict[int, float]:
    """token -> the amount DRY subtracts from its logit, given the tokens so far (prompt included,
    as llama-server accepts the prompt into the chain). last_n < 0 is taken as the whole history."""
    if not dry_enabled(multiplier, base, last_n):
        return {}
    last_n = len(history) if last_n < 0 else last_n
    n = min(len(history), last_n)
    if n <= allowed_length:
        return {}
    tail = list(history[len(history) - n:])

    def rat(i: int) -> int:  # ring_buffer::rat: i tokens back from the newest
        return tail[n - 1 - i]

    # step 1: the nearest restart sequence bounds the repeat length
    rep_limit = n
    for i in range(n):
        tails = restarts.get(rat(i))
        if not tails:
            continue
        longest = -1
        for seq in tails:
            if longest < len(seq) <= i and all(seq[o] == rat(i - o - 1) for o in range(len(seq))):
                longest = len(seq)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return {}

    # step 2: reverse Z-algorithm: repeat[last - k] = length of the suffix repeated ending k back
    repeat = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            repeat[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p, right_len = k - lt, rt - k + 1
            if repeat[last - p] < right_len:
                repeat[last - k] = min(repeat[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                repeat[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1

    # step 3: the token after each repeat would extend it; keep its longest
    longest_for: dict[int, int] = {}
    for i in range(n - 1):
        if repeat[i] >= allowed_length:
            token = rat(n - 2 - i)
            if longest_for.get(token, -1) < repeat[i]:
                longest_for[token] = repeat[i]

    # step 4: the penalties, sparing single-token breakers
    base32, mult32 = np.float32(base), np.float32(multiplier)  # llama.cpp holds them as float
    max_exponent = int(np.float32(FLOAT_MAX_LOG) / np.log(base32)) if base32 > np.float32(1.000001) else 0
    out: dict[int, float] = {}
    for token, length in longest_for.items():
        if () in restarts.get(token, ()):
            continue
        exponent = length - allowed_length
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        # std::pow(float, int) promotes to double; the product is stored back as a float
        out[token] = float(np.float32(float(mult32) * math.pow(float(base32), exponent)))
    return out


def dry_bias(history: Sequence[int], multiplier: float, base: float, allowed_length: int, last_n: int,
             restarts: RestartSequences, n_vocab: int) -> np.ndarray:
    """The dense [V] f32 row to add to the logits (minus each penalty)."""
    row = np.zeros(n_vocab, np.float32)
    for token, penalty in dry_penalties(history, multiplier, base, allowed_length, last_n, restarts).items():
        if 0 <= token < n_vocab:
            row[token] = -penalty
    return row
