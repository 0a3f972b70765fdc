"""What the host adds to a batch's logits before the device samples: logit_bias, ignore_eos, DRY, grammars.

llama-server's chain (common/sampling.cpp, b11434) runs the logit-bias sampler first, then the
penalties, then DRY and the rest; a grammar (`common_sampler_sample`, grammar applied to the
candidates) removes the tokens it forbids from what the chain may pick. Here, for the rows that need
any of it, the host builds two [D, V] f32 arrays, D the smallest bucket holding those rows:
- `pre`, added to the raw logits before the penalties: each request's `logit_bias` (summed per token,
  as llama.cpp adds each entry) and -inf on every end-of-generation token under `ignore_eos`;
- `post`, added after the penalties (where DRY's bias goes): DRY's penalties, and -inf on every token
  the row's grammar forbids now (model/constraint.py). -inf there is the same as -inf before the
  penalties (a penalty keeps -inf), so the grammar masks what the whole chain sees.
Rows past the batch's sequences aim at row `rows` (the batch size), which the device drops.

A row whose grammar and biases together leave no token keeps its grammar alone: the biases give
way (a grammar's output must parse), never an arbitrary token. A row with biases that forbid every
token and no grammar keeps the biases' finite entries only.

The mask is filled while the device computes the forward step the host just dispatched (JAX
dispatches asynchronously), so its time overlaps the step. A batch that needs none of this sends
nothing (`None`): an unconstrained batch runs the program it ran before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from model.messages import SamplingParams

NEG_INF = np.float32(-np.inf)


def bitmask_words(n_vocab: int) -> int:
    """int32 words in one row of a token bitmask (llguidance's layout: bit t of word t // 32).
    Here, not in model/constraint.py, so the engine imports no llguidance until a request is constrained."""
    return (n_vocab + 31) // 32


def needs_pre(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.ignore_eos


def pre_bias(p: SamplingParams, n_vocab: int, eog_ids: Collection[int], out: np.ndarray) -> None:
    """`logit_bias` and `ignore_eos` of one request into `out` [V] (zeros on entry)."""
    for token, bias in p.logit_bias:
        if 0 <= token < n_vocab:
            out[token] += bias
    if p.ignore_eos:
        for token in eog_ids:
            if 0 <= token < n_vocab:
                out[token] = NEG_INF


def mask_bias(words: np.ndarray, n_vocab: int, out: np.ndarray) -> None:
    """-inf into `out` [V] for every token whose bit in `words` (llguidance's int32 bitmask) is clear."""
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
    out[~allowed] = NEG_INF


def wants_bias(p: SamplingParams, constraint: object, uses_dry: bool) -> bool:
    """Whether a row needs the host's bias: biases or ignore_eos, DRY, or a grammar."""
    return needs_pre(p) or uses_dry or constraint is not None


def bias_rows(n: int, buckets: Sequence[int]) -> int:
    """The bias rows D for `n` rows that need one: the smallest bucket that holds them (0 for none)."""
    return 0 if n == 0 else next(x for x in buckets if x >= n)


def host_bias(seqs: Sequence, rows: int, buckets: Sequence[int], n_vocab: int, eog_ids: Collection[int],
              dry: Callable[[object], np.ndarray | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(pre [D, V], post [D, V], at [D] int32) for the rows of `seqs` that need any, or None.

    `seqs` are the scheduler's sequences, row i of the batch; `dry(seq)` is DRY's bias for a sequence
    that uses DRY, else None; `buckets` the allowed D, ascending.
    """
    wanted = []
    for row, s in enumerate(seqs):
        p = s.request.params
        constraint = s.request.constraint
        dry_row = dry(s)
        if wants_bias(p, constraint, dry_row is not None):
            wanted.append((row, s, p, constraint, dry_row))
    if not wanted:
        return None
    d = bias_rows(len(wanted), buckets)
    pre = np.zeros((d, n_vocab), np.float32)
    post = np.zeros((d, n_vocab), np.float32)
    at = np.full(d, rows, np.int32)
    words = None
    for i, (row, _s, p, constraint, dry_row) in enumerate(wanted):
        at[i] = row
        if needs_pre(p):
            pre_bias(p, n_vocab, eog_ids, pre[i])
        if dry_row is not None:
            post[i] = dry_row
        if constraint is not None:
            if words is None:
                words = np.zeros(bitmask_words(n_vocab), np.int32)
            words[:] = 0
            constraint.fill(words)
            mask_bias(words, n_vocab, post[i])
            if not np.isfinite(pre[i] + post[i]).any():
                pre[i] = 0.0  # the grammar wins over biases that would leave nothing
        elif not np.isfinite(pre[i] + post[i]).any():
            pre[i][~np.isfinite(pre[i])] = 0.0
    return pre, post, at
