"""DRY ("Don't Repeat Yourself"), host-side: llama.cpp's `llama_sampler_dry_apply` in numpy.

It runs on the host because its Z-algorithm scan is sequential and data-dependent; the device adds
the [B, V] bias it yields after the penalties and before top-n-sigma (sample_chain's `bias`).
Ported from src/llama-sampler.cpp (itself from koboldcpp PR 982).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# llama_sampler_init_dry: a breaker is cut to 40 characters (bytes), its tail to 20 tokens
MAX_CHAR_LEN = 40
MAX_SEQ_LEN = 20
# log(FLT_MAX): the exponent is clamped so the penalty stays finite
FLOAT_MAX_LOG = 88.7228391

# head token -> the tails (token tuples) that complete a restart sequence with it
RestartSequences = dict[int, list[tuple[int, ...]]]


def dry_enabled(multiplier: float, base: float, last_n: int) -> bool:
    """llama_sampler_init_dry's test: otherwise the sampler is empty."""
    return multiplier != 0.0 and base >= 1.0 and last_n != 0


def restart_sequences(breakers: Sequence[str], pieces: Sequence[bytes], encode) -> RestartSequences:
    """The breakers as token sequences (llama.cpp's get_overlapping_token_sequences).

    pieces[t]: token t's text with specials (vocab.detokenize({t}, true)); encode(text) -> token ids
    without BOS and without parsing specials. A token that contains a breaker is a restart by itself
    (empty tail); a token that ends with a breaker's prefix is a head whose tail is the rest, tokenized.
    """
    out: RestartSequences = {}
    for breaker in breakers:
        s = breaker.encode("utf-8")[:MAX_CHAR_LEN]
        if not s:
            continue  # llama.cpp skips empty breakers with a warning
        for token, word in enumerate(pieces):
            tails = out.setdefault(token, [])
            if s in word:
                if () not in tails:  # a multimap in llama.cpp; a duplicate changes nothing
                    tails.append(())
                continue
            pos = word.find(s[:1])
            while pos != -1:
                i, match = 1, True
                while i < len(s) and i + pos < len(word):
                    if word[pos + i] != s[i]:
                        match = False
                        break
                    i += 1
                if match:
                    tail = tuple(encode(s[i:].decode("utf-8", errors="replace")))[:MAX_SEQ_LEN]
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(s[:1], pos + 1)
            if not tails:
                del out[token]
    return out


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
