"""Teacher-forced scoring: the log-probability of every token of a text given the ones before it.

What OpenAI's legacy `/v1/completions` returns with `echo` and `logprobs` (the prompt's logprobs), and
what the fidelity bench (bench/fidelity.py) measures: each position's distribution over the
vocabulary, computed as the generation path computes it (the same `forward`, the same weights, the
K/V rounded through the same cache type), the whole text at once rather than token by token.

The text goes through the forward pass in chunks of the engine's largest prefill bucket, each chunk
attending to the ones before through a scratch pool of pages of its own (the engine's pool and its
prefix cache are never touched), with the engine's own buckets, so the programs are few. Per
position only what is asked leaves the device: the token's logprob and the top `n_probs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model.config import Config
from model.forward import forward
from model.kvcache import init_pool
from model.messages import N_PROBS_CAP
from model.programs import ProgramTable
from model.weights import Weights


@dataclass(frozen=True)
class Scored:
    """Position i (from 1) of a text: the logprob of tokens[i] after tokens[:i], and the top tokens
    there, [(id, logprob)], most likely first (empty unless asked for)."""

    logprob: float
    top: list[tuple[int, float]]


@partial(jax.jit, static_argnames=("config", "window_pages", "k", "full"), donate_argnames=("pool",))
def _chunk(weights, pool, tokens, table, starts, n_new, targets, *, config, window_pages: int, k: int,
           full: bool = False):
    """tokens [1, T] from position starts[0]; targets [T], the token after each. Returns the targets'
    logprobs [T], and the top k ids and logprobs [T, k] (k 0: none), and the pool; `full`: every
    position's whole log-softmax [T, V] instead of the targets'."""
    logits, pool = forward(weights, pool, tokens, table, starts, n_new, config=config, window_pages=window_pages,
                           all_logits=True)
    lp = jax.nn.log_softmax(logits[0], axis=-1)  # [T, V]
    if full:
        return lp, None, None, pool
    picked = jnp.take_along_axis(lp, targets[:, None], axis=1)[:, 0]  # [T]
    if not k:
        return picked, None, None, pool
    top_lp, top_ids = lax.top_k(lp, k)
    return picked, top_ids, top_lp, pool


@dataclass(frozen=True)
class Scorer:
    """What scoring reads of an engine: its weights and config, its program table (the context, the
    largest prefill chunk, the page size and the buckets) and its KV cache's type."""

    weights: Weights
    config: Config
    table: ProgramTable
    cache_type: str

    def score(self, tokens: Sequence[int], n_probs: int = 0) -> list[Scored]:
        """`Scored` for positions 1 .. len(tokens) - 1 of `tokens` (position 0 has nothing before it)."""
        if not 0 <= n_probs <= N_PROBS_CAP:
            raise ValueError(f"n_probs is at most {N_PROBS_CAP}, got {n_probs}")
        k = 0 if n_probs == 0 else N_PROBS_CAP if n_probs > 20 else 20  # two programs' worth of k, not one per value
        out: list[Scored] = []
        for picked, top_ids, top_lp in self._chunks(tokens, k, full=False):
            if k:
                top_ids, top_lp = top_ids[:, :n_probs], top_lp[:, :n_probs]
            for j in range(len(picked)):
                top = [(int(a), float(b)) for a, b in zip(top_ids[j], top_lp[j], strict=True)] if k else []
                out.append(Scored(float(picked[j]), top))
        return out

    def log_softmax(self, tokens: Sequence[int]) -> np.ndarray:
        """Every position's whole distribution, [len(tokens) - 1, V] f32: row i is log p(. | tokens[:i + 1])
        (the fidelity bench's KL divergence needs all of it)."""
        rows = [lp for lp, _, _ in self._chunks(tokens, 0, full=True)]
        return np.concatenate(rows) if rows else np.zeros((0, self.config.n_vocab), np.float32)

    def _chunks(self, tokens: Sequence[int], k: int, *, full: bool):
        """The chunks' results on the host, in order: (picked [m], top ids [m, k], top logprobs [m, k]),
        or with `full` (log-softmax [m, V], None, None)."""
        n, n_ctx = len(tokens), self.table.n_ctx
        if n > n_ctx:
            raise ValueError(f"the text has {n} tokens, the context only {n_ctx}")
        if n < 2:
            return
        page = self.table.page_size
        max_pages = -(-n_ctx // page)
        n_pages = -(-n // page) + 1  # the last chunk's padding writes nothing, but its bucket may reach a page more
        pool = init_pool(self.config, n_pages, page, self.cache_type, self.weights.parallel)
        table = np.zeros((1, max_pages), np.int32)  # past the scratch pages: page 0, never read (masked)
        table[0, :min(n_pages, max_pages)] = np.arange(min(n_pages, max_pages))
        ids = np.asarray(tokens, np.int32)
        start = 0
        while start < n - 1:  # the last token is a target only
            m = min(n - 1 - start, self.table.prefill_chunk)
            t, window = self.table.prefill_shape(start, m)
            padded, targets = np.zeros((1, t), np.int32), np.zeros(t, np.int32)
            padded[0, :m], targets[:m] = ids[start:start + m], ids[start + 1:start + 1 + m]
            picked, top_ids, top_lp, pool = _chunk(self.weights, pool, padded, table, np.array([start], np.int32),
                                                   np.array([m], np.int32), targets, config=self.config,
                                                   window_pages=window, k=k, full=full)
            yield (np.asarray(picked)[:m], None if top_ids is None else np.asarray(top_ids)[:m],
                   None if top_lp is None else np.asarray(top_lp)[:m])
            start += m
