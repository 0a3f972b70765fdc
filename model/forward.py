"""The forward pass: a batch of token rows through every layer, attending to the paged KV cache.

One function serves prefill and decode. Row b of `tokens [B, T]` continues the sequence whose pages
`table[b]` lists, from position `starts[b]`; its first `n_new[b]` tokens are real (0: a padding row,
computed and thrown away so the shapes never change; its writes are dropped). Layers run under one
`lax.scan` over the layer index, each matmul reading its layer from the stacked weights; per-layer
differences (gemma3's sliding window and rope base) are scanned arrays. Each layer attends to the
cells of the first `window_pages` pages of its row's table (valid below `starts[b]`) -- a static
bucket the caller picks above the longest prefix -- plus the new tokens, causally; all new K/V are
scattered into their pages in one write at the end.

Weights in device layout (model/weights.py: a tuple of per-layer `Layer`s, matrices as `QWeight`s or
16-bit arrays) take the same steps with the layers unrolled: a Python loop, each layer's types and
sliding window static, every matmul through `kernels.ops.qmatmul` and attention through
`kernels.ops.decode_attention` (T == 1) or `prefill_attention`, which read the pool's pages themselves
(the layer index goes in as an int32 array). kernels/ops.py picks the Triton kernel or its jnp twin.
Dense f32 dots are at HIGHEST precision, so XLA:GPU never runs them as TF32.

The float rules follow llama.cpp's graphs (src/models/llama.cpp, qwen2.cpp, qwen3.cpp, gemma3.cpp) in
f32 with exactly dequantized weights, and K, V (and Q) pass through the cache's type (f16 by default,
as llama.cpp's, or q8_0 blocks: model/kvcache.py) before attention; we are not bit-identical to llama.cpp (README, "How close to llama.cpp";
tests/test_golden.py, bench/rounding.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from kernels import ops
from model.config import Config
from model.kvcache import KVPool, as_cached, read_cells, rotate, rotation, write_cells
from model.packed import Packed, take_rows
from model.packed import linear as packed_linear
from model.parallel import AXIS, Parallel, pool_spec, weight_specs
from model.rope import apply_rope, rope_tables
from model.weights import Layer, Weights


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # ggml_rms_norm then ggml_mul: x / sqrt(mean(x^2) + eps) * w (gemma's +1 is folded into w by the converter)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


_HIGHEST = lax.Precision.HIGHEST  # f32 dots stay f32 (XLA:GPU would otherwise run them as TF32 on Hopper)


def _linear(x: jax.Array, w: jax.Array | Packed, b: jax.Array | None = None,
            layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w.T (+ b). With `layer`, w and b are stacks over layers and `layer` picks one."""
    if isinstance(w, Packed):
        y = packed_linear(x, w, layer)
    else:
        y = jnp.einsum("...i,oi->...o", x, w if layer is None else w[layer], precision=_HIGHEST)  # GGUF's [out, in]
    if b is not None:
        y = y + (b if layer is None else b[layer])
    return y


def _qlinear(x: jax.Array, w, b: jax.Array | None = None) -> jax.Array:
    """Device layout: x [..., in] @ w.T (+ b) through kernels.ops.qmatmul, on x flattened to [M, in]."""
    y = ops.qmatmul(x.reshape(-1, x.shape[-1]), w)  # [M, out]
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if b is None else y + b


def embed(weights: Weights, tokens: jax.Array, config: Config, tp: Parallel | None = None) -> jax.Array:
    """tokens [B, T] -> [B, T, D] (gemma scales by sqrt(n_embd)). Under tensor parallelism with the
    vocabulary split, each device looks up the tokens in its share and one all-reduce adds the rows."""
    table = weights.token_embd

    def lookup(ids):
        if isinstance(weights.layers, tuple):
            return ops.take_rows(table, ids)
        return take_rows(table, ids) if isinstance(table, Packed) else table[ids]

    if tp is not None and tp.vocab_split:
        n = table.shape[0]  # this device's rows
        local = tokens - lax.axis_index(AXIS) * n
        inside = (local >= 0) & (local < n)
        rows = lax.psum(jnp.where(inside[..., None], lookup(jnp.clip(local, 0, n - 1)), 0.0), AXIS)
    else:
        rows = lookup(tokens)
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
    scores = [jnp.where(new_ok, jnp.einsum("btkgd,bskd->bkgts", qg, k_new, precision=_HIGHEST),
                        -jnp.inf)]  # [B, K, G, T, T]
    if k_old is not None:
        n_old, page = k_old.shape[1], k_old.shape[3]
        w_idx = jnp.arange(n_old * page)
        old_ok = w_idx[None, None, :] < starts[:, None, None]  # [B, 1, W]
        if config.n_swa:
            old_ok = old_ok & (~is_swa | (positions[:, :, None] - w_idx[None, None, :] < config.n_swa))  # [B, T, W]
        old = jnp.einsum("btkgd,bnkpd->bkgtnp", qg, k_old, precision=_HIGHEST)
        old = old.reshape(b, config.n_head_kv, config.n_group, t, -1)
        scores.insert(0, jnp.where(old_ok[:, None, None], old, -jnp.inf))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., -t:], v_new, precision=_HIGHEST)
    if k_old is not None:
        p_old = probs[..., :-t].reshape(*probs.shape[:-1], k_old.shape[1], k_old.shape[3])  # [B, K, G, T, Wp, P]
        out = out + jnp.einsum("bkgtnp,bnkpd->btkgd", p_old, v_old, precision=_HIGHEST)
    return out.reshape(b, t, config.n_head * dh)


def _layer(x, lw: Layer, il, is_swa, attend, ropes, config: Config, cache_type: str, reduce=None):
    """One block; returns (x_out, k_new, v_new). x [B, T, D].

    reduce: under tensor parallelism (model/parallel.py), the all-reduce that sums the row-parallel
    projections' shares (attention output, FFN down), before their bias and norm; None on one device.

    Stacked weights (`il` a traced layer index): matrices stay stacked and are indexed inside their
    matmul (see packed.linear); vectors are indexed here. Device layout (`il` None): `lw` is the one
    layer, its matmuls go through kernels.ops. `attend(q, k, v) -> [B, T, H*Dh]` is the attention.
    Attention sees the new K and V as the cache stores them (`cache_type`, kernels/kvquant.py), and Q
    rounded to the same type, as llama.cpp's flash attention converts Q to the K cache's type (f16, or
    q8_0 blocks: K's vec_dot_type). Before a q8_0 cache, Q, K and V are Hadamard-rotated and the
    attention output rotated back, as llama.cpp's build_attn does (kernels/kvquant.py `rotation`): the
    cache holds rotated K and V.
    """
    b, t, _ = x.shape
    dh, eps = config.head_dim, config.norm_eps

    def vec(a):
        return a if il is None else a[il]

    def lin(h, w, bias=None):
        return _qlinear(h, w, bias) if il is None else _linear(h, w, bias, il)

    h = rms_norm(x, vec(lw.attn_norm), eps)
    q = lin(h, lw.attn_q, lw.attn_q_bias).reshape(b, t, config.n_head, dh)
    k = lin(h, lw.attn_k, lw.attn_k_bias).reshape(b, t, config.n_head_kv, dh)
    v = lin(h, lw.attn_v, lw.attn_v_bias).reshape(b, t, config.n_head_kv, dh)
    if config.qk_norm:
        q = rms_norm(q, vec(lw.attn_q_norm), eps)
        k = rms_norm(k, vec(lw.attn_k_norm), eps)
    (cos_g, sin_g), (cos_l, sin_l) = ropes
    if cos_g is cos_l:
        cos, sin = cos_g, sin_g
    elif isinstance(is_swa, bool):  # unrolled: this layer's kind is known
        cos, sin = (cos_l, sin_l) if is_swa else (cos_g, sin_g)
    else:
        cos, sin = jnp.where(is_swa, cos_l, cos_g), jnp.where(is_swa, sin_l, sin_g)
    q = apply_rope(q, cos, sin, config.rope_neox)
    k = apply_rope(k, cos, sin, config.rope_neox)
    rot = rotation(dh, cache_type)
    if rot:
        q, k, v = rotate(q, rot[0]), rotate(k, rot[0]), rotate(v, rot[1])
    q, k, v = (as_cached(a, cache_type) for a in (q, k, v))

    attended = attend(q, k, v)  # [B, T, H*Dh]
    if rot:
        attended = rotate(attended, rot[1])  # blocks of 64 never cross a head (Dh % 64 == 0)
    out = lin(attended, lw.attn_output)
    if reduce is not None:
        out = reduce(out)
    if lw.attn_output_bias is not None:
        out = out + vec(lw.attn_output_bias)
    if config.post_norms:
        out = rms_norm(out, vec(lw.post_attention_norm), eps)
    x = x + out

    h = rms_norm(x, vec(lw.ffn_norm), eps)
    gate = lin(h, lw.ffn_gate)
    act = jax.nn.gelu(gate, approximate=True) if config.ffn_gelu else jax.nn.silu(gate)
    out = lin(act * lin(h, lw.ffn_up), lw.ffn_down)
    if reduce is not None:
        out = reduce(out)
    if config.post_norms:
        out = rms_norm(out, vec(lw.post_ffw_norm), eps)
    return x + out, k, v


def output_logits(weights: Weights, x: jax.Array, config: Config, tp: Parallel | None = None) -> jax.Array:
    """Final norm and LM head: x [..., D] -> logits [..., V] (the vocabulary's shares gathered, under
    tensor parallelism with it split)."""
    x = rms_norm(x, weights.output_norm, config.norm_eps)
    head = weights.token_embd if weights.output is None else weights.output
    logits = _qlinear(x, head) if isinstance(weights.layers, tuple) else _linear(x, head)
    if tp is not None and tp.vocab_split:
        logits = lax.all_gather(logits, AXIS, axis=logits.ndim - 1, tiled=True)
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

    Weights split over a mesh (`weights.parallel`, model/parallel.py) run each device's share of the
    layers and of the pool under `jax.shard_map`; the logits come back whole, on every device.
    """
    tp = weights.parallel
    if tp is None:
        return _forward(weights, pool, tokens, table, starts, n_new, config, window_pages, all_logits, None)
    shares = pool_spec(pool)
    return jax.shard_map(
        partial(_forward, config=tp.local_config(config), window_pages=window_pages, all_logits=all_logits, tp=tp),
        mesh=tp.mesh, in_specs=(weight_specs(weights), shares, P(), P(), P(), P()), out_specs=(P(), shares),
        check_vma=False)(weights, pool, tokens, table, starts, n_new)


def _forward(weights: Weights, pool: KVPool, tokens, table, starts, n_new, config: Config, window_pages: int,
             all_logits: bool, tp: Parallel | None):
    """`forward` on one device, or one device's share under `shard_map` (`tp`; `config` its share's)."""
    reduce = None if tp is None else partial(lax.psum, axis_name=AXIS)
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)  # [B, T]
    x = embed(weights, tokens, config, tp)  # [B, T, D]
    ropes = rope_tables(config, positions, weights.rope_freqs)
    if isinstance(weights.layers, tuple):
        x, pool = _unrolled(weights.layers, x, pool, table, starts, positions, n_new, ropes, config, window_pages,
                            reduce)
    else:
        x, k_new, v_new = _scanned(weights.layers, x, pool, table, starts, positions, ropes, config, window_pages,
                                   reduce)
        pool = _write(pool, k_new, v_new, table, positions, n_new)

    if all_logits:
        return output_logits(weights, x, config, tp), pool
    last = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, D]
    return output_logits(weights, last, config, tp), pool


def _scanned(layers: Layer, x, pool: KVPool, table, starts, positions, ropes, config: Config, window_pages: int,
             reduce=None):
    """Stacked layers under one `lax.scan`; returns (x, k_new, v_new), the new K/V [L, B, T, Hkv, Dh]."""
    b = x.shape[0]
    page = pool.page_size
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
            k_old, v_old = read_cells(pool, (il, window))  # [B, Wp, Hkv, P, Dh] f32
            v_old = jnp.where(stale, 0.0, v_old)

        def attend(q, k, v):
            return _attention(q, k, v, k_old, v_old, starts, positions, layer_swa, config)

        x, k, v = _layer(x, layers, il, layer_swa, attend, ropes, config, pool.cache_type, reduce)
        return x, (k, v)

    # The scan runs over layer indices, not over the stacked weights: scanning xs would slice (copy)
    # every layer's weights out of the stack on each step.
    x, (k_new, v_new) = lax.scan(body, x, (is_swa, jnp.arange(config.n_layer)))
    return x, k_new, v_new


def _unrolled(layers: tuple[Layer, ...], x, pool: KVPool, table, starts, positions, n_new, ropes, config: Config,
              window_pages: int, reduce=None):
    """Device layout: one layer after another (unrolled under jit), attention through kernels.ops;
    returns (x, pool), the pool holding every layer's new K/V.

    Each layer writes its new K/V into the pool before its attention reads the pool (which reads only
    the cells below each row's start, so the write changes nothing it sees): every write then comes
    after the reads of the layers before it, by data dependence. One write at the end, as `_scanned`
    does, is not ordered after the last layer's reads (the new K/V do not depend on them), and XLA keeps
    those reads safe by copying the whole pool, K and V, every step: on a GPU whose pool fills most
    of the memory, a step that runs out of it."""
    b, t, _ = x.shape
    # the kernels read the cells below each row's start from the pages of its window (at least one
    # page, so a prefill from position 0 reads an all-masked page rather than an empty table)
    window = table[:, :max(window_pages, 1)]  # [B, Wp]
    pages, cells = _cells(pool, table, positions, n_new)
    for il, lw in enumerate(layers):
        swa = bool(config.swa_layers[il])
        kw = dict(window=config.n_swa if swa else 0, scale=config.attn_scale)
        layer = jnp.asarray(il, jnp.int32)

        def attend(q, k, v, il=il, layer=layer, kw=kw):
            nonlocal pool
            pool = write_cells(pool, (il, pages, slice(None), cells), k, v)
            scales = dict(k_scale=pool.k_scale, v_scale=pool.v_scale)
            if t == 1:
                out = ops.decode_attention(q[:, 0], k[:, 0], v[:, 0], pool.k, pool.v, layer, window, starts, **kw,
                                           **scales)
            else:
                out = ops.prefill_attention(q, k, v, pool.k, pool.v, layer, window, starts, n_new, **kw, **scales)
            return out.reshape(b, t, config.n_head * config.head_dim)

        x, _, _ = _layer(x, lw, None, swa, attend, ropes, config, pool.cache_type, reduce)
    return x, pool


def _cells(pool: KVPool, table, positions, n_new) -> tuple[jax.Array, jax.Array]:
    """Where the new tokens go, (pages, cells) [B, T]: row b's token j to cell (p % P) of page
    table[b, p // P], p its position. Padding tokens and positions past the table go to page n_pages,
    which a write with mode="drop" drops."""
    t = positions.shape[1]
    page = pool.page_size
    slot = positions // page
    real = (jnp.arange(t)[None, :] < n_new[:, None]) & (slot < table.shape[1])
    pages = jnp.where(real, jnp.take_along_axis(table, jnp.minimum(slot, table.shape[1] - 1), axis=1), pool.n_pages)
    return pages, positions % page


def _write(pool: KVPool, k_new, v_new, table, positions, n_new) -> KVPool:
    """One scatter for all layers (`_cells` says where)."""
    pages, cells = _cells(pool, table, positions, n_new)
    # advanced indices around a slice put their dims first: the target is [B, T, L, Hkv, Dh]
    return write_cells(pool, (slice(None), pages, slice(None), cells), jnp.moveaxis(k_new, 0, 2),
                       jnp.moveaxis(v_new, 0, 2))
