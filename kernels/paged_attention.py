"""Attention over the paged KV cache, in plain JAX: the twins of kernels/triton/attention.py.

Same signatures as the Triton kernels, and the CPU path's math (model/forward.py `_attention`, the
rules of llama.cpp): a query at position p sees cached cell w iff w < starts[b] (cells at or past a
row's start are stale: another sequence's, or never written) and, with a sliding window, iff
p - w < window (llama.cpp's is_masked_swa, LLAMA_SWA_TYPE_STANDARD: masked iff p_q - p_k >= n_swa);
it sees the new tokens causally under the same window. Cells at or past a row's start are never read,
so the new tokens' K/V come as their own arrays (the device-layout forward has written them into the pool
already, before each layer's attention; the stacked one writes after); they are read as the
cache holds them, rounded to f16 or through q8_0 (the forward has rounded them already, as llama.cpp's
cache does), so the twins and the kernels agree whatever they are given.

The pool is `[L, n_pages, Hkv, P, Dh]` (model/kvcache.py), f16, or int8 quants with `k_scale`/`v_scale`
[L, n_pages, Hkv, P, Dh // 32] f16 beside them for a q8_0 cache (dequantized as they are read, to f32:
kernels/kvquant.py); cell w of row b is slot w % P of page table[b, w // P]. The twins gather every page the table lists, so callers pass as many table columns
as the longest row needs (forward's `window_pages`). A stale cell's value is zeroed before the
product, not only its score masked, so an inf or NaN left in a reused page never reaches the output
as 0 * inf. GQA: query head h reads kv head h // G, G = H // Hkv.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from kernels.kvquant import as_cached, dequantize_q8_0

_HIGHEST = lax.Precision.HIGHEST  # f32 dots stay f32 on a GPU too (no TF32)


def cache_type_of(k_scale: jax.Array | None) -> str:
    return "f16" if k_scale is None else "q8_0"


def _gather(pool: jax.Array, scale: jax.Array | None, layer: jax.Array, table: jax.Array) -> jax.Array:
    """The cells the table lists, in sequence order: [B, Hkv, W, Dh] f32, W = max_pages * P."""
    pages = pool[layer][table]  # [B, Wp, Hkv, P, Dh]
    pages = pages.astype(jnp.float32) if scale is None else dequantize_q8_0(pages, scale[layer][table])
    b, wp, hkv, p, dh = pages.shape
    return jnp.moveaxis(pages, 2, 1).reshape(b, hkv, wp * p, dh)


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Query positions [..., T, 1] against key positions [..., S]: causal, and inside the window."""
    ok = k_pos <= q_pos
    if window:
        ok &= q_pos - k_pos < window
    return ok


@partial(jax.jit, static_argnames=("window", "scale"))
def prefill_attention(q, k_new, v_new, k_pool, v_pool, layer, table, starts, n_new, *, window: int,
                      scale: float, k_scale=None, v_scale=None) -> jax.Array:
    """q [B, T, H, Dh] f32 (query t at position starts[b] + t); k_new, v_new [B, T, Hkv, Dh] f32;
    k_pool, v_pool [L, n_pages, Hkv, P, Dh] f16, or int8 with k_scale, v_scale [L, n_pages, Hkv, P, Dh // 32]
    f16 (q8_0); layer int32 []; table [B, max_pages] int32; starts, n_new [B] int32; window: 0 or n_swa.
    Returns [B, T, H, Dh] f32, zero in the padding rows t >= n_new[b]."""
    b, t, h, dh = q.shape
    hkv = k_new.shape[2]
    cache_type = cache_type_of(k_scale)
    k_new, v_new = as_cached(k_new, cache_type), as_cached(v_new, cache_type)
    qg = q.reshape(b, t, hkv, h // hkv, dh)  # [B, T, K, G, Dh]
    q_pos = starts[:, None] + jnp.arange(t)  # [B, T]

    k_old, v_old = _gather(k_pool, k_scale, layer, table), _gather(v_pool, v_scale, layer, table)  # [B, K, W, Dh]
    w_pos = jnp.arange(k_old.shape[2])
    cached = w_pos[None, :] < starts[:, None]  # [B, W]: below the row's start, else stale
    old_ok = cached[:, None, :] & _visible(q_pos[:, :, None], w_pos[None, None, :], window)  # [B, T, W]
    v_old = jnp.where(cached[:, None, :, None], v_old, 0.0)
    new_ok = _visible(jnp.arange(t)[:, None], jnp.arange(t)[None, :], window)  # [T, S]

    old = jnp.einsum("btkgd,bkwd->bkgtw", qg, k_old, precision=_HIGHEST) * scale
    new = jnp.einsum("btkgd,bskd->bkgts", qg, k_new, precision=_HIGHEST) * scale
    scores = jnp.concatenate([jnp.where(old_ok[:, None, None], old, -jnp.inf),
                              jnp.where(new_ok, new, -jnp.inf)], axis=-1)  # [B, K, G, T, W + S]
    probs = jax.nn.softmax(scores, axis=-1)
    w = k_old.shape[2]
    out = (jnp.einsum("bkgtw,bkwd->btkgd", probs[..., :w], v_old, precision=_HIGHEST)
           + jnp.einsum("bkgts,bskd->btkgd", probs[..., w:], v_new, precision=_HIGHEST))
    real = jnp.arange(t)[None, :] < n_new[:, None]  # [B, T]
    return jnp.where(real[:, :, None, None], out.reshape(b, t, h, dh), 0.0)


@partial(jax.jit, static_argnames=("window", "scale"))
def decode_attention(q, k_new, v_new, k_pool, v_pool, layer, table, starts, *, window: int,
                     scale: float, k_scale=None, v_scale=None) -> jax.Array:
    """One new token per row, at position starts[b]: q [B, H, Dh] f32; k_new, v_new [B, Hkv, Dh] f32;
    the rest as in `prefill_attention`. Returns [B, H, Dh] f32."""
    n_new = jnp.ones_like(starts)
    out = prefill_attention(q[:, None], k_new[:, None], v_new[:, None], k_pool, v_pool, layer, table, starts,
                            n_new, window=window, scale=scale, k_scale=k_scale, v_scale=v_scale)
    return out[:, 0]
