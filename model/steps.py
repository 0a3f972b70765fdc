"""The compiled entry points: `run` (a prefill chunk of one sequence, or a decode step of many) and
`select` (sampling from their logits).

Static under jit: the config, the padded shapes and the attention window bucket (in pages).
Everything that changes per request or per token -- tokens, block tables, positions, sampling
parameters, seeds -- is an array, so the set of compiled programs is fixed at start-up
(`Engine.warmup` compiles them all). The KV pool is donated: each call consumes it and returns the
updated one, written in place. Logits
stay on the device between a forward program and `select`; only the sampled ids and logprobs travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
from jax import lax

from model.config import Config
from model.forward import forward
from model.kvcache import KVPool
from model.sampler_chain import ChainArrays, sample_chain
from model.sampling import logprobs
from model.weights import Weights


@jax.tree_util.register_dataclass
@dataclass
class Sampled:
    """What a step returns to the host: small int/float arrays only."""

    tokens: jax.Array  # [B] int32
    logprob: jax.Array  # [B] f32 log-softmax of the chosen token (0 unless asked)
    top_ids: jax.Array  # [B, N_PROBS_MAX] int32
    top_logprobs: jax.Array  # [B, N_PROBS_MAX] f32


@partial(jax.jit, static_argnames=("branchless",), donate_argnames=("history",))
def select(logits: jax.Array, ca: ChainArrays, history: jax.Array, rows: jax.Array, lengths: jax.Array,
           steps: jax.Array, bias: jax.Array, *, branchless: bool = False) -> tuple[Sampled, jax.Array]:
    """Sample the next token of slots `rows` [R] from their logits [R, V] through llama-server's
    chain, report logprobs, and append the tokens to the slots' rows of `history` [B_slots, n_ctx]
    (at `lengths` [R], the tokens each row holds: the penalties' window). `ca` holds R rows; bias
    [R, V]: DRY's host-computed penalties (zeros for rows without DRY, so one program serves both).

    Compiled apart from the forward programs: one sampler program per batch size serves every
    window bucket, which halves start-up compilation. branchless (static; a GPU): no `lax.cond`, so
    the step never waits on the host to choose a branch (model/sampler_chain.py).
    """
    tokens = sample_chain(logits, ca, history[rows], lengths, steps, bias, branchless)
    lp, top_ids, top_lp = logprobs(logits, tokens, ca, branchless)
    history = history.at[rows, lengths].set(tokens, mode="drop")
    return Sampled(tokens, lp, top_ids, top_lp), history


@partial(jax.jit, donate_argnames=("history",))
def put_row(history: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
    """A new sequence's tokens into `history[slot]` (row [n_ctx], zero-padded)."""
    return lax.dynamic_update_slice_in_dim(history, row[None], slot, 0)


@partial(jax.jit, static_argnames=("config", "window_pages"), donate_argnames=("pool",))
def run(weights: Weights, pool: KVPool, tokens: jax.Array, table: jax.Array, starts: jax.Array,
        n_new: jax.Array, *, config: Config, window_pages: int) -> tuple[KVPool, jax.Array]:
    """One forward step of B rows of T tokens: a prefill chunk (B = 1) or a decode step (T = 1).

    Row b writes its `n_new[b]` real tokens from position `starts[b]` into the pages `table[b]` lists
    (0: a padding row, nothing written); `window_pages` covers every row's start (0 when all start at
    position 0). Returns the pool and the logits [B, V] after each row's last real token.
    """
    logits, pool = forward(weights, pool, tokens, table, starts, n_new, config=config, window_pages=window_pages)
    return pool, logits
