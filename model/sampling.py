"""Token selection on device: greedy, or top-k -> top-p -> min-p -> temperature -> draw, per row.

Every parameter is a [B] array (`SamplingArrays`), so a new temperature or seed never recompiles.
The filters follow llama.cpp's samplers (src/llama-sampler.cpp) in llama-server's default order, with
the temperature applied last: top-p and min-p see the raw distribution. temperature <= 0 is greedy.
The random draw is keyed by (seed, step), so a request gives the same tokens whatever else shares
the batch; the bits are JAX's, not llama.cpp's mt19937 (spec README §1.2). The full llama-server
chain (penalties, DRY, typical, XTC, ...) builds on this later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model.messages import DEFAULT_SAMPLERS, SamplingParams

# Candidates kept by the partial sort. A row whose top_k is off (<= 0) or larger switches the whole
# batch to a full sort of the vocabulary for that step, so the result is exact either way.
TOP_K_CAP = 128
# The most top logprobs a step reports (OpenAI's top_logprobs allows 20).
N_PROBS_MAX = 20


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    temperature: jax.Array  # [B] f32; <= 0: greedy
    top_k: jax.Array  # [B] i32; <= 0: off
    top_p: jax.Array  # [B] f32; >= 1: off
    min_p: jax.Array  # [B] f32; <= 0: off
    seed: jax.Array  # [B] u32
    n_probs: jax.Array  # [B] i32; > 0: report top logprobs


def sampling_arrays(params: Sequence[SamplingParams | None], seeds: Sequence[int]) -> SamplingArrays:
    """Host-side [B] arrays; a None row (an idle slot) samples greedily and is thrown away."""
    idle = SamplingParams(temperature=0.0)
    rows = [p or idle for p in params]
    return SamplingArrays(
        temperature=np.array([p.temperature for p in rows], np.float32),
        top_k=np.array([p.top_k for p in rows], np.int32),
        top_p=np.array([p.top_p for p in rows], np.float32),
        min_p=np.array([p.min_p for p in rows], np.float32),
        seed=np.array([s & 0xFFFFFFFF for s in seeds], np.uint32),
        n_probs=np.array([p.n_probs for p in rows], np.int32),
    )


def unsupported_sampling(p: SamplingParams) -> str | None:
    """The reason this sampler cannot honour `p`, or None. Refuse, never approximate (spec README)."""
    active = {
        "mirostat": p.mirostat != 0,
        "dynatemp_range": p.dynatemp_range > 0,
        "typical_p": p.typical_p < 1.0,
        "top_n_sigma": p.top_n_sigma > 0,
        "xtc_probability": p.xtc_probability > 0 and p.xtc_threshold <= 0.5,
        "repeat_penalty": p.repeat_last_n != 0 and p.repeat_penalty != 1.0,
        "frequency_penalty": p.repeat_last_n != 0 and p.frequency_penalty != 0.0,
        "presence_penalty": p.repeat_last_n != 0 and p.presence_penalty != 0.0,
        "dry_multiplier": p.dry_multiplier != 0.0 and p.dry_penalty_last_n != 0,
        "min_keep": p.min_keep > 1,
        "samplers": tuple(p.samplers) != DEFAULT_SAMPLERS,
    }
    asked = [name for name, on in active.items() if on]
    if asked:
        return f"not supported by this engine's sampler yet: {', '.join(asked)}"
    return None


def _filtered_draw(vals, ids, sa: SamplingArrays, keys):
    """vals/ids [B, K]: candidates sorted by logit, descending. Returns the drawn ids [B]."""
    k = vals.shape[-1]
    rank = jnp.arange(k)
    top_k = jnp.where(sa.top_k <= 0, k, jnp.minimum(sa.top_k, k))
    keep = rank[None, :] < top_k[:, None]
    # top-p (llama_sampler_top_p_apply): the smallest prefix whose probability reaches top_p.
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (before < sa.top_p[:, None]) | (sa.top_p[:, None] >= 1.0)
    # min-p (llama_sampler_min_p_apply): logit >= max_logit + log(min_p).
    floor = vals[:, :1] + jnp.log(jnp.maximum(sa.min_p, 1e-30))[:, None]
    keep &= (vals >= floor) | (sa.min_p[:, None] <= 0.0)
    keep = keep.at[:, 0].set(True)  # min_keep = 1
    temp = jnp.maximum(sa.temperature, 1e-6)[:, None]
    scaled = jnp.where(keep, vals / temp, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, scaled)  # [B]
    return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, sa: SamplingArrays, steps: jax.Array) -> jax.Array:
    """logits [B, V] f32, steps [B] (the token's index within its request) -> tokens [B] int32."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = sa.temperature <= 0.0
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(sa.seed, steps)

    def partial_sort(_):
        vals, ids = lax.top_k(logits, min(TOP_K_CAP, logits.shape[-1]))
        return _filtered_draw(vals, ids.astype(jnp.int32), sa, keys)

    def full_sort(_):
        ids = jnp.argsort(-logits, axis=-1).astype(jnp.int32)
        return _filtered_draw(jnp.take_along_axis(logits, ids, axis=-1), ids, sa, keys)

    def stochastic(_):
        needs_full = jnp.any(~greedy & ((sa.top_k <= 0) | (sa.top_k > TOP_K_CAP)))
        return lax.cond(needs_full, full_sort, partial_sort, None)

    drawn = lax.cond(jnp.all(greedy), lambda _: greedy_ids, stochastic, None)
    return jnp.where(greedy, greedy_ids, drawn)


def logprobs(logits: jax.Array, tokens: jax.Array, sa: SamplingArrays):
    """Log-softmax of the raw logits (before any filter): the chosen token's and the top N_PROBS_MAX.

    Returns (token_logprob [B], top_ids [B, N], top_logprobs [B, N]); skipped (zeros) when no row asks.
    """
    n = min(N_PROBS_MAX, logits.shape[-1])

    def compute(_):
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = lax.top_k(lp, n)
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def skip(_):
        b = logits.shape[0]
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32)

    return lax.cond(jnp.any(sa.n_probs > 0), compute, skip, None)
