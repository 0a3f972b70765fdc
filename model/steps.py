"""The compiled entry points: `prefill` (one slot, a padded chunk) and `decode_step(s)` (every slot).

Static under jit: the config, the padded shapes and the attention window bucket. Everything that
changes per request or per token -- tokens, slots, positions, sampling parameters, seeds -- is an
array, so the set of compiled programs is fixed at start-up (`Engine.warmup` compiles them all).
The cache is donated: each call consumes it and returns the updated one, written in place.
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
from model.sampling import SamplingArrays, logprobs, sample
from model.weights import Weights


@jax.tree_util.register_dataclass
@dataclass
class Sampled:
    """What a step returns to the host: small int/float arrays only."""

    tokens: jax.Array  # [B] int32 (decode_steps: [N, B])
    logprob: jax.Array  # [B] f32 log-softmax of the chosen token (0 unless asked)
    top_ids: jax.Array  # [B, N_PROBS_MAX] int32
    top_logprobs: jax.Array  # [B, N_PROBS_MAX] f32


def _select(logits, sa: SamplingArrays, steps) -> Sampled:
    tokens = sample(logits, sa, steps)
    lp, top_ids, top_lp = logprobs(logits, tokens, sa)
    return Sampled(tokens, lp, top_ids, top_lp)


@partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("cache",))
def prefill(weights: Weights, cache: KVCache, tokens: jax.Array, slot: jax.Array, start: jax.Array,
            n_new: jax.Array, sa: SamplingArrays, step: jax.Array, *, config: Config,
            window: int) -> tuple[KVCache, Sampled]:
    """Write one chunk `tokens [1, T]` (n_new real) into `slot` from position `start`; sample after it.

    The slot's cells at `start` and beyond are discarded first (a new prompt, or the part of an old
    one that no longer matches). `window` >= start; 0 when start is 0.
    """
    cache = KVCache(cache.k, cache.v, lax.dynamic_update_slice_in_dim(cache.lengths, start[None], slot, 0))
    logits, cache = forward(weights, cache, tokens, slot, n_new, config=config, window=window)
    return cache, _select(logits, sa, step)


@partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("cache",))
def decode_step(weights: Weights, cache: KVCache, tokens: jax.Array, active: jax.Array, sa: SamplingArrays,
                steps: jax.Array, *, config: Config, window: int) -> tuple[KVCache, Sampled]:
    """One token for every slot: tokens [B_slots], active [B_slots] bool (inactive rows are masked)."""
    logits, cache = forward(weights, cache, tokens[:, None], jnp.int32(0), active.astype(jnp.int32),
                            config=config, window=window)
    return cache, _select(logits, sa, steps)


@partial(jax.jit, static_argnames=("config", "window", "n_steps"), donate_argnames=("cache",))
def decode_steps(weights: Weights, cache: KVCache, tokens: jax.Array, active: jax.Array, sa: SamplingArrays,
                 steps: jax.Array, *, config: Config, window: int, n_steps: int) -> tuple[KVCache, Sampled]:
    """`n_steps` decode steps in one dispatch, each feeding its tokens to the next. Sampled fields gain
    a leading [n_steps] axis. The host drops what follows an end of generation and resets the lengths.
    `window` must cover every active slot's length + n_steps - 1.
    """

    def body(carry, i):
        cache, tokens = carry
        cache, out = decode_step(weights, cache, tokens, active, sa, steps + i, config=config, window=window)
        return (cache, out.tokens), out

    (cache, _), out = lax.scan(body, (cache, tokens), jnp.arange(n_steps, dtype=jnp.int32))
    return cache, out
