"""The forward pass: a batch of token rows through every layer, attending to the paged KV cache.

One function serves prefill and decode. Row b of `tokens [B, T]` continues the sequence whose pages
`table[b]` lists, from position `starts[b]`; its first `n_new[b]` tokens are real (0: a padding row,
computed and thrown away so the shapes never change; its writes are dropped). Layers run under one
`lax.scan` over the layer index, each matmul reading its layer from the stacked weights; per-layer
differences (gemma3's sliding window and rope base) are scanned arrays. Each layer attends to the
cells of the first `window_pages` pages of its row's table (valid below `starts[b]`) -- a static
bucket the caller picks above the longest prefix -- plus the new tokens, causally; all new K/V are
scattered into their pages in one write at the end. The float
rules follow llama.cpp's graphs (src/models/llama.cpp, qwen2.cpp, qwen3.cpp, gemma3.cpp) in f32 with
exactly dequantized weights, and K, V (and Q) pass through the cache's type (f16 by default, as
llama.cpp's) before attention; we are not bit-identical to llama.cpp (README, "How close to llama.cpp";
tests/test_golden.py, bench/rounding.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from model.config import Config
from model.kvcache import KVPool
from model.packed import Packed, take_rows
from model.packed import linear as packed_linear
from model.rope import apply_rope, rope_tables
from model.weights import Layer, Weights


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # ggml_rms_norm then ggml_mul: x / sqrt(mean(x^2) + eps) * w (gemma's +1 is folded into w by the converter)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _linear(x: jax.Array, w: jax.Array | Packed, b: jax.Array | None = None,
            layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w.T (+ b). With `layer`, w and b are stacks over layers and `layer` picks one."""
    if isinstance(w, Packed):
        y = packed_linear(x, w, layer)
    else:
        y = jnp.einsum("...i,oi->...o", x, w if layer is None else w[layer])  # GGUF's [out, in]
    if b is not None:
        y = y + (b if layer is None else b[layer])
    return y


def embed(weights: Weights, tokens: jax.Array, config: Config) -> jax.Array:
    """tokens [B, T] -> [B, T, D] (gemma scales by sqrt(n_embd))."""
    table = weights.token_embd
    rows = take_rows(table, tokens) if isinstance(table, Packed) else table[tokens]
    return rows * jnp.float32(config.embd_scale)


def _attention(q, k_new, v_new, k_old, v_old, starts, positions, is_swa, config: Config):
    """Scaled dot-product attention over cached cells plus the new tokens (causal).

    q [B, T, H, Dh]; k_new, v_new [B, T, Hkv, Dh]; k_old and v_old [B, Wp, Hkv, P, Dh], a row's first Wp
    pages in order (cell w = n*P + p is position w), or None (no cached cells);
    starts [B] (cells valid below it); positions [B, T]. Returns [B, T, H*Dh].
    """
    b, t, _, dh = q.shape
    qg = q.reshape(b, t, config.n_head_kv, config.n_group, dh) * config.attn_scale  # [B, T, K, G, Dh]

    # Key s of the new block sees query t iff s <= t; with a sliding window also t - s < n_swa
    # (llama.cpp's is_masked_swa, LLAMA_SWA_TYPE_STANDARD: masked iff p_q - p_k >= n_swa).
    t_idx = jnp.arange(t)
    new_ok = t_idx[None, :] <= t_idx[:, None]  # [T, S]
    if config.n_swa:
        new_ok &= ~is_swa | (t_idx[:, None] - t_idx[None, :] < config.n_swa)
    scores = [jnp.where(new_ok, jnp.einsum("btkgd,bskd->bkgts", qg, k_new), -jnp.inf)]  # [B, K, G, T, T]
    if k_old is not None:
        n_old, page = k_old.shape[1], k_old.shape[3]
        w_idx = jnp.arange(n_old * page)
        old_ok = w_idx[None, None, :] < starts[:, None, None]  # [B, 1, W]
        if config.n_swa:
            old_ok = old_ok & (~is_swa | (positions[:, :, None] - w_idx[None, None, :] < config.n_swa))  # [B, T, W]
        old = jnp.einsum("btkgd,bnkpd->bkgtnp", qg, k_old).reshape(b, config.n_head_kv, config.n_group, t, -1)
        scores.insert(0, jnp.where(old_ok[:, None, None], old, -jnp.inf))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., -t:], v_new)
    if k_old is not None:
        p_old = probs[..., :-t].reshape(*probs.shape[:-1], k_old.shape[1], k_old.shape[3])  # [B, K, G, T, Wp, P]
        out = out + jnp.einsum("bkgtnp,bnkpd->btkgd", p_old, v_old)
    return out.reshape(b, t, config.n_head * dh)


def _layer(x, lw: Layer, il, is_swa, k_old, v_old, starts, positions, ropes, config: Config, kv_dtype):
    """Block `il` of the stacked layers `lw`; returns (x_out, k_new, v_new). x [B, T, D].

    Matrices stay stacked and are indexed inside their matmul (see packed.linear); vectors are
    indexed here. Attention sees the new K and V as the cache stores them (kv_dtype), and Q rounded
    to the same type, as llama.cpp's flash attention converts Q to the K cache's type.
    """
    b, t, _ = x.shape
    dh, eps = config.head_dim, config.norm_eps
    h = rms_norm(x, lw.attn_norm[il], eps)
    q = _linear(h, lw.attn_q, lw.attn_q_bias, il).reshape(b, t, config.n_head, dh)
    k = _linear(h, lw.attn_k, lw.attn_k_bias, il).reshape(b, t, config.n_head_kv, dh)
    v = _linear(h, lw.attn_v, lw.attn_v_bias, il).reshape(b, t, config.n_head_kv, dh)
    if config.qk_norm:
        q = rms_norm(q, lw.attn_q_norm[il], eps)
        k = rms_norm(k, lw.attn_k_norm[il], eps)
    (cos_g, sin_g), (cos_l, sin_l) = ropes
    if cos_g is not cos_l:
        cos, sin = jnp.where(is_swa, cos_l, cos_g), jnp.where(is_swa, sin_l, sin_g)
    else:
        cos, sin = cos_g, sin_g
    q = apply_rope(q, cos, sin, config.rope_neox)
    k = apply_rope(k, cos, sin, config.rope_neox)
    q, k, v = (a.astype(kv_dtype).astype(jnp.float32) for a in (q, k, v))

    attn = _attention(q, k, v, k_old, v_old, starts, positions, is_swa, config)
    out = _linear(attn, lw.attn_output, lw.attn_output_bias, il)
    if config.post_norms:
        out = rms_norm(out, lw.post_attention_norm[il], eps)
    x = x + out

    h = rms_norm(x, lw.ffn_norm[il], eps)
    gate = _linear(h, lw.ffn_gate, None, il)
    act = jax.nn.gelu(gate, approximate=True) if config.ffn_gelu else jax.nn.silu(gate)
    out = _linear(act * _linear(h, lw.ffn_up, None, il), lw.ffn_down, None, il)
    if config.post_norms:
        out = rms_norm(out, lw.post_ffw_norm[il], eps)
    return x + out, k, v


def output_logits(weights: Weights, x: jax.Array, config: Config) -> jax.Array:
    """Final norm and LM head: x [..., D] -> logits [..., V]."""
    x = rms_norm(x, weights.output_norm, config.norm_eps)
    logits = _linear(x, weights.token_embd if weights.output is None else weights.output)
    if config.final_logit_softcap > 0:
        cap = config.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits


@partial(jax.jit, static_argnames=("config", "window_pages", "all_logits"), donate_argnames=("pool",))
def forward(weights: Weights, pool: KVPool, tokens: jax.Array, table: jax.Array, starts: jax.Array,
            n_new: jax.Array, *, config: Config, window_pages: int,
            all_logits: bool = False) -> tuple[jax.Array, KVPool]:
    """Run `tokens [B, T]` (row b from position starts[b], through the pages `table [B, max_pages]`
    lists) and write their real tokens' K/V into those pages.

    window_pages: attend to the cells of each row's first `window_pages` pages; they must cover every
    row's start (0: every row starts at position 0 and no cell is read). Returns (logits, pool):
    logits [B, V] at each row's last real token, or [B, T, V] when `all_logits`.
    """
    b, t = tokens.shape
    n_pages, page = pool.n_pages, pool.page_size
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    x = embed(weights, tokens, config)  # [B, T, D]
    ropes = rope_tables(config, positions, weights.rope_freqs)
    is_swa = jnp.asarray(config.swa_layers, dtype=bool)
    window = table[:, :window_pages]  # [B, Wp]
    # cells at or past a row's start hold whatever the page held before (another sequence, a padding
    # row's page): their scores are masked, and their values are zeroed, so a stale inf or NaN never
    # reaches the product as 0 * inf (llama.cpp's kernels skip masked cells)
    stale = (jnp.arange(window_pages * page) >= starts[:, None]).reshape(b, window_pages, 1, page, 1)

    def body(x, xs):
        layer_swa, il = xs
        k_old = v_old = None
        if window_pages:  # one gather per layer: the row's pages, in order
            k_old = pool.k[il, window].astype(jnp.float32)  # [B, Wp, Hkv, P, Dh]
            v_old = jnp.where(stale, 0.0, pool.v[il, window].astype(jnp.float32))
        x, k, v = _layer(x, weights.layers, il, layer_swa, k_old, v_old, starts, positions, ropes, config,
                         pool.k.dtype)
        return x, (k, v)

    # The scan runs over layer indices, not over the stacked weights: scanning xs would slice (copy)
    # every layer's weights out of the stack on each step.
    x, (k_new, v_new) = lax.scan(body, x, (is_swa, jnp.arange(config.n_layer)))

    # One scatter for all layers: row b's token j goes to cell (p % P) of page table[b, p // P], p its
    # position. Padding tokens and positions past the table go to page n_pages, which is dropped.
    slot = positions // page
    real = (jnp.arange(t)[None, :] < n_new[:, None]) & (slot < table.shape[1])
    pages = jnp.where(real, jnp.take_along_axis(table, jnp.minimum(slot, table.shape[1] - 1), axis=1), n_pages)
    cells = positions % page
    # advanced indices around a slice put their dims first: the target is [B, T, L, Hkv, Dh]
    k_all = pool.k.at[:, pages, :, cells].set(jnp.moveaxis(k_new, 0, 2).astype(pool.k.dtype), mode="drop")
    v_all = pool.v.at[:, pages, :, cells].set(jnp.moveaxis(v_new, 0, 2).astype(pool.v.dtype), mode="drop")
    pool = KVPool(k_all, v_all)

    if all_logits:
        return output_logits(weights, x, config), pool
    last = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, D]
    return output_logits(weights, last, config), pool
