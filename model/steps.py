"""The compiled entry points: `prefill` (one slot, a padded chunk), `decode_step` (every slot) and
`select` (sampling from their logits).

Static under jit: the config, the padded shapes and the attention window bucket. Everything that
changes per request or per token -- tokens, slots, positions, sampling parameters, seeds -- is an
array, so the set of compiled programs is fixed at start-up (`Engine.warmup` compiles them all).
The cache is donated: each call consumes it and returns the updated one, written in place. Logits
stay on the device between a forward program and `select`; only the sampled ids and logprobs travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from model.config import Config
from model.forward import forward
from model.kvcache import KVCache
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


@partial(jax.jit, donate_argnames=("history",))
def select(logits: jax.Array, ca: ChainArrays, history: jax.Array, rows: jax.Array, lengths: jax.Array,
           steps: jax.Array, bias: jax.Array) -> tuple[Sampled, jax.Array]:
    """Sample the next token of slots `rows` [R] from their logits [R, V] through llama-server's
    chain, report logprobs, and append the tokens to the slots' rows of `history` [B_slots, n_ctx]
    (at `lengths` [R], the tokens each row holds: the penalties' window). `ca` holds R rows; bias
    [R, V]: DRY's host-computed penalties (zeros for rows without DRY, so one program serves both).

    Compiled apart from the forward programs: one sampler program per batch size serves every
    window bucket, which halves start-up compilation.
    """
    tokens = sample_chain(logits, ca, history[rows], lengths, steps, bias)
    lp, top_ids, top_lp = logprobs(logits, tokens, ca)
    history = history.at[rows, lengths].set(tokens, mode="drop")
    return Sampled(tokens, lp, top_ids, top_lp), history


@partial(jax.jit, donate_argnames=("history",))
def put_row(history: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
    """A new prompt's tokens into `history[slot]` (row [n_ctx], zero-padded)."""
    return lax.dynamic_update_slice_in_dim(history, row[None], slot, 0)


@partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("cache",))
def prefill(weights: Weights, cache: KVCache, tokens: jax.Array, slot: jax.Array, start: jax.Array,
            n_new: jax.Array, *, config: Config, window: int) -> tuple[KVCache, jax.Array]:
    """Write one chunk `tokens [1, T]` (n_new real) into `slot` from position `start`.

    The slot's cells at `start` and beyond are discarded first (a new prompt, or the part of an old
    one that no longer matches). `window` >= start; 0 when start is 0. Returns the logits [1, V]
    after the chunk's last real token.
    """
    cache = KVCache(cache.k, cache.v, lax.dynamic_update_slice_in_dim(cache.lengths, start[None], slot, 0))
    logits, cache = forward(weights, cache, tokens, slot, n_new, config=config, window=window)
    return cache, logits


@partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("cache",))
def decode_step(weights: Weights, cache: KVCache, tokens: jax.Array, active: jax.Array, *, config: Config,
                window: int) -> tuple[KVCache, jax.Array]:
    """One token for every slot: tokens [B_slots], active [B_slots] bool (inactive rows are masked).
    Returns the logits [B_slots, V]."""
    logits, cache = forward(weights, cache, tokens[:, None], jnp.int32(0), active.astype(jnp.int32),
                            config=config, window=window)
    return cache, logits
