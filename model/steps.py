"""The compiled entry points: `run` (a prefill chunk of one sequence), `decode` (a step of many) and
`select` (sampling from their logits).

Static under jit: the config, the padded shapes and the attention window bucket (in pages).
Everything that changes per request or per token -- tokens, block tables, positions, sampling
parameters, seeds -- is an array, so the set of compiled programs is fixed at start-up
(`Engine.warmup` compiles them all). The KV pool is donated: each call consumes it and returns the
updated one, written in place. Logits
stay on the device between a forward program and `select`; only the sampled ids and logprobs travel,
and never back: `select` writes each token into the token history, and the next `decode` gathers its
input there, so a step can be dispatched before the host has read the previous one's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
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
           steps: jax.Array, dry_bias: jax.Array | None = None, dry_rows: jax.Array | None = None,
           pre_bias: jax.Array | None = None, *, branchless: bool = False) -> tuple[Sampled, jax.Array]:
    """Sample the next token of slots `rows` [R] from their logits [R, V] through llama-server's
    chain, report logprobs, and append the tokens to the slots' rows of `history` [B_slots, n_ctx]
    (at `lengths` [R], the tokens each row holds: the penalties' window). `ca` holds R rows.
    dry_bias [D, V]: what the host adds after the penalties for the rows `dry_rows` [D] (R: a padding
    entry): DRY's penalties and -inf on the tokens a grammar forbids; pre_bias [D, V], the same rows'
    logit_bias and ignore_eos, added to the raw logits before the chain (model/host_bias.py). None (no
    row needs either): nothing is uploaded, nothing added. Logprobs stay the raw model's.

    Compiled apart from the forward programs: one sampler program per batch size serves every
    window bucket, which halves start-up compilation. branchless (static; a GPU): no `lax.cond`, so
    the step never waits on the host to choose a branch (model/sampler_chain.py).
    """
    bias, biased = None, logits
    if dry_bias is not None:
        bias = jnp.zeros(logits.shape, jnp.float32).at[dry_rows].set(dry_bias, mode="drop")  # [R, V]
    if pre_bias is not None:
        biased = logits + jnp.zeros(logits.shape, jnp.float32).at[dry_rows].set(pre_bias, mode="drop")
    tokens = sample_chain(biased, ca, history[rows], lengths, steps, bias, branchless)
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


@partial(jax.jit, static_argnames=("config", "window_pages"), donate_argnames=("pool",))
def decode(weights: Weights, pool: KVPool, history: jax.Array, slots: jax.Array, table: jax.Array,
           starts: jax.Array, n_new: jax.Array, *, config: Config, window_pages: int) -> tuple[KVPool, jax.Array]:
    """One decode step of B rows: row b computes the token `history[slots[b], starts[b]]` at position
    `starts[b]` (what the last `select` of its slot wrote there, or its prompt's last token), so
    the host never reads a token on its way to the next step. As `run` otherwise (n_new[b] 0: a
    padding row)."""
    tokens = history[slots, starts][:, None]  # [B, 1]
    logits, pool = forward(weights, pool, tokens, table, starts, n_new, config=config, window_pages=window_pages)
    return pool, logits


@partial(jax.jit, static_argnames=("config", "window_pages"), donate_argnames=("pool",))
def verify(weights: Weights, pool: KVPool, tokens: jax.Array, table: jax.Array, starts: jax.Array,
           n_new: jax.Array, *, config: Config, window_pages: int) -> tuple[KVPool, jax.Array]:
    """A speculative step of B rows of T tokens (model/speculative.py): row b's next token, then its
    draft, `n_new[b]` of them real, from position `starts[b]`. As `run`, with the logits after every
    position [B, T, V]."""
    logits, pool = forward(weights, pool, tokens, table, starts, n_new, config=config, window_pages=window_pages,
                           all_logits=True)
    return pool, logits


@partial(jax.jit, static_argnames=("branchless",), donate_argnames=("history",))
def select_drafted(logits: jax.Array, ca: ChainArrays, history: jax.Array, rows: jax.Array, lengths: jax.Array,
                   steps: jax.Array, drafts: jax.Array, n_new: jax.Array, dry_bias: jax.Array | None = None,
                   dry_rows: jax.Array | None = None, pre_bias: jax.Array | None = None, *,
                   branchless: bool = False) -> tuple[Sampled, jax.Array]:
    """`select` at every position of a verify step: logits [B, T, V]; drafts [B, T] (row b's draft
    token j at [b, j], the rest ignored); n_new [B] (1 + the draft's length; 0: a padding row).

    Position j of row b is sampled as the step j tokens later would sample it without speculation:
    the same chain, seed and step index (`steps + j`), its penalties over the row's history with
    the draft's first j tokens in it (written before sampling: where the draft holds, they are what
    that step would have seen). Returns tokens etc. [B, T, ...] and the history with each position's
    sample written after it (`lengths + j`): where the draft holds, the draft token itself; at the
    first position where it does not, the sample that replaces it; after, cells the row's next
    steps write again. The host bias (`select`'s) applies to every position of its row.
    """
    b, t, v = logits.shape
    j = jnp.arange(t, dtype=jnp.int32)
    n_ctx = history.shape[1]
    draft_cell = jnp.where(j[None, :] < n_new[:, None] - 1, lengths[:, None] + j[None, :], n_ctx)
    history = history.at[rows[:, None], draft_cell].set(drafts, mode="drop")
    flat_ca = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), ca)
    flat_rows = jnp.repeat(rows, t)
    flat_lengths = (lengths[:, None] + j[None, :]).reshape(-1)
    flat_steps = (steps[:, None] + j[None, :]).reshape(-1)
    x = logits.reshape(b * t, v)
    bias, biased = None, x
    if dry_rows is not None:
        at = (dry_rows[:, None] * t + j[None, :]).reshape(-1)  # a padding entry (B) lands past B*T: dropped
        if dry_bias is not None:
            bias = jnp.zeros(x.shape, jnp.float32).at[at].set(jnp.repeat(dry_bias, t, axis=0), mode="drop")
        if pre_bias is not None:
            biased = x + jnp.zeros(x.shape, jnp.float32).at[at].set(jnp.repeat(pre_bias, t, axis=0), mode="drop")
    tokens = sample_chain(biased, flat_ca, history[flat_rows], flat_lengths, flat_steps, bias, branchless)
    lp, top_ids, top_lp = logprobs(x, tokens, flat_ca, branchless)
    live = (j[None, :] < n_new[:, None]).reshape(-1)
    history = history.at[flat_rows, jnp.where(live, flat_lengths, n_ctx)].set(tokens, mode="drop")
    return Sampled(tokens.reshape(b, t), lp.reshape(b, t), top_ids.reshape(b, t, -1),
                   top_lp.reshape(b, t, -1)), history
