"""Paged attention in Triton: flash-decoding for the decode step, flash attention for prefill.

Twins of kernels/paged_attention.py (same signatures, same masks; read its docstring for the rules).
Both read the pool `[L, n_pages, Hkv, P, Dh]` through the block table, a tile of BLOCK_N cells
(several pages) at a time, and keep an online softmax (running max m, sum l, output acc) in f32, in
base 2 (the scale folded with log2 e). A masked cell contributes exactly nothing: its K and V are never
loaded (masked loads give 0, so a stale NaN in a reused page is not read), its score is -inf, and a row
whose every cell so far is masked keeps m = -inf without producing exp(-inf - -inf).

Tensor cores take f16: Q is split into an f16 head and an f16 remainder (q = hi + lo to ~2^-22), and so
is P in P.V, two dots each, so the products keep f32 accuracy against the twin. K and V are f16 as
the pool holds them; prefill reads the new tokens' K/V as f16 too, the values the forward scatters into
the f16 pool (model/forward.py rounds them through the cache type before attention); decode's merge
takes the one new token in f32.

A q8_0 pool (Q8: its int8 quants, and k_scale/v_scale [L, n_pages, Hkv, P, Dh // 32] f16 beside it) is
dequantized in the kernel as each tile is loaded: quants times their block's d, in f32 (the scale of
element offset o is at o // 32 of the scales, since Dh % 32 == 0). d * q needs up to 18 bits, more than
f16 holds, so a dequantized K or V tile is split into hi + lo as well and its dot takes a third product
(hi.hi + lo.hi + hi.lo); the new tokens' K/V, rounded through q8_0 by the caller, likewise.

decode (`decode_attention`), after SGLang's decode_attention.py (_fwd_grouped_kernel_stage1/stage2):
  1. `_decode_split`, one program per (row, kv head, KV split): the G query heads of that kv head
     (padded to 16 rows for tl.dot) against the split's cells below the row's start; splits wholly
     before the window or past the start run no iteration. Writes (acc, m, l) per query head.
  2. `_decode_merge`, one program per (row, query head): folds the new token (its own score, weight
     and value, in f32) and the splits' partials together by log-sum-exp.
  The split count comes from the static shapes: enough (row, kv head, split) programs to fill an H200
  twice over, no more splits than tiles of cells.
prefill (`prefill_attention`), after vLLM's triton_unified_attention.py: one program per (row, kv head,
  BLOCK_M packed query rows), a packed row r being query position r // G of group head r % G, so
  gemma3's 4 heads on 1 kv head fill a tile; it loops over the cached prefix's pages through the table
  (from the first tile the window reaches), then over the new tokens' tiles up to the diagonal. Blocks
  wholly past n_new[b] (the bucket's padding) return at once and their rows stay zero.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from kernels.kvquant import QK8_0, as_cached, quantize_q8_0
from kernels.paged_attention import cache_type_of
from kernels.paged_attention import decode_attention as decode_twin
from kernels.paged_attention import prefill_attention as prefill_twin
from kernels.triton.call import triton_call
from kernels.triton.spec import AotVariant, CheckResult

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: exp(x) = exp2(x * log2 e)
GPU_PROGRAMS = 2 * 132  # (row, kv head, split) programs wanted: two waves of an H200's 132 SMs
DECODE_BLOCK_N = 64  # cells per decode tile: 4 pages of 16
MERGE_BLOCK_S = 16  # splits the merge reads at a time
# Launched with triton.compile's defaults, so what `bankml gpu-check` compiles (AotVariant has no launch
# options) is what runs; the tiles are sized to fit them.
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _split_f16(x):
    """x f32 as hi + lo, both f16: the two operands that keep f32 accuracy through f16 tensor cores."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot(a_hi, a_lo, b, Q8: tl.constexpr):
    """(a_hi + a_lo) @ b in f32 accuracy: b f16 as the pool holds it (two dots), or, for a q8_0 pool, b f32
    split into hi + lo too (three: the lo.lo product is below f32's rounding)."""
    if Q8:
        b_hi, b_lo = _split_f16(b)
        out = tl.dot(a_hi, b_hi) + tl.dot(a_lo, b_hi) + tl.dot(a_hi, b_lo)
    else:
        out = tl.dot(a_hi, b) + tl.dot(a_lo, b)
    return out


@triton.jit
def _load_cells(pool_ptr, scale_ptr, offs, ok, Q8: tl.constexpr):
    """Cached K or V at element offsets `offs` ([N, D], masked by `ok`): f16 as stored, or for a q8_0 pool
    its quants times their block's d, in f32."""
    if Q8:
        d = tl.load(scale_ptr + offs // 32, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(pool_ptr + offs, mask=ok, other=0).to(tl.float32) * d
    else:
        x = tl.load(pool_ptr + offs, mask=ok, other=0.0)
    return x


@triton.jit
def _new_operand(x, Q8: tl.constexpr):
    """A new token's K or V (f32, already rounded through the cache's type) as `_dot`'s b operand."""
    if Q8:
        out = x
    else:
        out = x.to(tl.float16)
    return out


@triton.jit
def _online_step(m_i, l_i, acc, s, v, Q8: tl.constexpr):
    """One tile of the online softmax: s [M, N] base-2 scores (-inf where masked), v [N, D] (f16, or f32
    for a q8_0 pool)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay empty
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    p_hi, p_lo = _split_f16(p)
    acc = acc * alpha[:, None] + _dot(p_hi, p_lo, v, Q8)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _cell_offsets(table_ptr, b, n, ok, layer, kh, N_PAGES: tl.constexpr, HKV: tl.constexpr,
                  P: tl.constexpr, DH: tl.constexpr, MAX_PAGES: tl.constexpr):
    """Element offsets of cells n [N] of row b in the pool (int64: a pool passes 2^31 elements)."""
    page = tl.load(table_ptr + b * MAX_PAGES + n // P, mask=ok, other=0)
    return ((layer * N_PAGES + page).to(tl.int64) * HKV + kh) * (P * DH) + (n % P) * DH


@triton.jit
def _decode_split(q_ptr, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, layer_ptr, table_ptr, starts_ptr,
                  o_ptr, m_ptr, l_ptr,
                  SCALE: tl.constexpr, WINDOW: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
                  G: tl.constexpr, DH: tl.constexpr, P: tl.constexpr, N_PAGES: tl.constexpr,
                  MAX_PAGES: tl.constexpr, SPLITS: tl.constexpr, SPLIT_CELLS: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, Q8: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    layer = tl.load(layer_ptr)
    start = tl.load(starts_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < DH
    head = kh * G + g
    q = tl.load(q_ptr + (b * H + head)[:, None] * DH + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)  # [BG, BD]
    q_hi, q_lo = _split_f16(q)

    w_lo = 0
    if WINDOW > 0:
        w_lo = tl.maximum(start - WINDOW + 1, 0)  # the first cell the window reaches
    lo = tl.maximum(split * SPLIT_CELLS, (w_lo // BLOCK_N) * BLOCK_N)
    # cells past the table's columns are not the row's (and reading their page ids would leave the table)
    hi = tl.minimum(tl.minimum((split + 1) * SPLIT_CELLS, start), MAX_PAGES * P)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = (n >= w_lo) & (n < hi)
        cell = _cell_offsets(table_ptr, b, n, ok, layer, kh, N_PAGES, HKV, P, DH, MAX_PAGES)
        kv_ok = ok[:, None] & d_ok[None, :]
        offs = cell[:, None] + d[None, :]
        k = _load_cells(k_pool_ptr, k_scale_ptr, offs, kv_ok, Q8)  # [BN, BD]
        s = _dot(q_hi, q_lo, tl.trans(k), Q8) * (SCALE * LOG2E)  # [BG, BN]
        s = tl.where(ok[None, :], s, float("-inf"))
        v = _load_cells(v_pool_ptr, v_scale_ptr, offs, kv_ok, Q8)  # [BN, BD]
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, Q8)

    part = (b * SPLITS + split) * H + head  # [BG]: partials are [B, SPLITS, H]
    tl.store(o_ptr + part[:, None] * DH + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(m_ptr + part, m_i, mask=g_ok)
    tl.store(l_ptr + part, l_i, mask=g_ok)


@triton.jit
def _decode_merge(q_ptr, k_new_ptr, v_new_ptr, o_part_ptr, m_part_ptr, l_part_ptr, out_ptr,
                  SCALE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, DH: tl.constexpr,
                  SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DH
    q = tl.load(q_ptr + (b * H + h) * DH + d, mask=d_ok, other=0.0)
    k_new = tl.load(k_new_ptr + (b * HKV + kh) * DH + d, mask=d_ok, other=0.0)
    v_new = tl.load(v_new_ptr + (b * HKV + kh) * DH + d, mask=d_ok, other=0.0)
    # the new token starts the sums: always visible, so the running max is finite from here on
    m_i = tl.sum(q * k_new, 0) * (SCALE * LOG2E)
    l_i = 1.0
    acc = v_new
    for s0 in tl.static_range(0, SPLITS, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        sp_ok = sp < SPLITS
        part = (b * SPLITS + sp) * H + h  # [BS]
        m_s = tl.load(m_part_ptr + part, mask=sp_ok, other=float("-inf"))
        l_s = tl.load(l_part_ptr + part, mask=sp_ok, other=0.0)
        o_s = tl.load(o_part_ptr + part[:, None] * DH + d[None, :], mask=sp_ok[:, None] & d_ok[None, :],
                      other=0.0)  # [BS, BD]
        m_new = tl.maximum(m_i, tl.max(m_s, 0))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(m_s - m_new)  # 0 for splits with no visible cell (m_s = -inf)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        l_i = l_i * alpha + tl.sum(w * l_s, 0)
        m_i = m_new
    tl.store(out_ptr + (b * H + h) * DH + d, acc / l_i, mask=d_ok)


@triton.jit
def _prefill(q_ptr, k_new_ptr, v_new_ptr, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, layer_ptr, table_ptr,
             starts_ptr, n_new_ptr, out_ptr,
             SCALE: tl.constexpr, WINDOW: tl.constexpr, T: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
             G: tl.constexpr, DH: tl.constexpr, P: tl.constexpr, N_PAGES: tl.constexpr,
             MAX_PAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             Q8: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    r0 = tl.program_id(2) * BLOCK_M
    n_new = tl.load(n_new_ptr + b)
    t_first = r0 // G
    if t_first >= n_new:  # the bucket's padding: rows stay zero
        return
    layer = tl.load(layer_ptr)
    start = tl.load(starts_ptr + b)
    r = r0 + tl.arange(0, BLOCK_M)
    t = r // G  # [BM]: packed rows are (position, group head)
    r_ok = r < T * G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DH
    q_row = (b * T + t) * H + kh * G + r % G
    q = tl.load(q_ptr + q_row[:, None] * DH + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    q_hi, q_lo = _split_f16(q)
    qk_scale = SCALE * LOG2E
    t_last = tl.minimum((r0 + BLOCK_M - 1) // G, T - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # the cached prefix, cells [w_lo, start): pages through the table (no further than its columns)
    w_lo = 0
    if WINDOW > 0:
        w_lo = tl.maximum(start + t_first - WINDOW + 1, 0)
    n_cached = tl.minimum(start, MAX_PAGES * P)
    for n0 in range((w_lo // BLOCK_N) * BLOCK_N, n_cached, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = (n >= w_lo) & (n < n_cached)
        cell = _cell_offsets(table_ptr, b, n, ok, layer, kh, N_PAGES, HKV, P, DH, MAX_PAGES)
        kv_ok = ok[:, None] & d_ok[None, :]
        offs = cell[:, None] + d[None, :]
        kt = tl.trans(_load_cells(k_pool_ptr, k_scale_ptr, offs, kv_ok, Q8))  # [BD, BN]
        s = _dot(q_hi, q_lo, kt, Q8) * qk_scale  # [BM, BN]
        visible = ok[None, :]
        if WINDOW > 0:
            visible &= (start + t)[:, None] - n[None, :] < WINDOW
        s = tl.where(visible, s, float("-inf"))
        v = _load_cells(v_pool_ptr, v_scale_ptr, offs, kv_ok, Q8)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, Q8)

    # the new tokens, s <= t: up to the diagonal of this block's last position (and its real tokens)
    s_hi = tl.minimum(t_last + 1, n_new)
    s_lo = 0
    if WINDOW > 0:
        s_lo = (tl.maximum(t_first - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    for s0 in range(s_lo, s_hi, BLOCK_N):
        sn = s0 + tl.arange(0, BLOCK_N)
        ok = sn < s_hi
        kv_row = (b * T + sn) * HKV + kh
        kv_ok = ok[:, None] & d_ok[None, :]
        k = _new_operand(tl.load(k_new_ptr + kv_row[:, None] * DH + d[None, :], mask=kv_ok, other=0.0), Q8)
        s = _dot(q_hi, q_lo, tl.trans(k), Q8) * qk_scale
        visible = ok[None, :] & (sn[None, :] <= t[:, None])
        if WINDOW > 0:
            visible &= t[:, None] - sn[None, :] < WINDOW
        s = tl.where(visible, s, float("-inf"))
        v = _new_operand(tl.load(v_new_ptr + kv_row[:, None] * DH + d[None, :], mask=kv_ok, other=0.0), Q8)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, Q8)

    # a padding row of a mixed block may have seen nothing (l = 0): it writes 0, not 0 / 0
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    real = r_ok & (t < n_new)
    tl.store(out_ptr + q_row[:, None] * DH + d[None, :], out, mask=real[:, None] & d_ok[None, :])


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def decode_splits(batch: int, n_kv_head: int, max_pages: int, page: int) -> tuple[int, int]:
    """(splits, cells per split) for the decode step's static shapes: enough programs to fill the
    GPU, each split a whole number of tiles."""
    block_n = max(DECODE_BLOCK_N, page)
    tiles = -(-max_pages * page // block_n)
    want = max(1, -(-GPU_PROGRAMS // (batch * n_kv_head)))
    tiles_per_split = -(-tiles // min(want, tiles))
    return -(-tiles // tiles_per_split), tiles_per_split * block_n


def _refuse_unsupported(h: int, hkv: int, dh: int, q8: bool) -> None:
    if h % hkv:
        raise ValueError(f"attention kernels: {h} query heads do not group over {hkv} kv heads")
    if dh < 16:  # tl.dot's smallest K
        raise ValueError(f"attention kernels: head_dim {dh} < 16")
    if q8 and dh % QK8_0:
        raise ValueError(f"attention kernels: a q8_0 cache needs head_dim % {QK8_0} == 0, not {dh}")


def _decode_meta(q, k_pool, table, window: int, scale: float, q8: bool = False) -> dict:
    b, h, dh = q.shape
    _, n_pages, hkv, page, _ = k_pool.shape
    _refuse_unsupported(h, hkv, dh, q8)
    splits, split_cells = decode_splits(b, hkv, table.shape[1], page)
    return dict(SCALE=float(scale), WINDOW=int(window), H=h, HKV=hkv, G=h // hkv, DH=dh, P=page,
                N_PAGES=n_pages, MAX_PAGES=table.shape[1], SPLITS=splits, SPLIT_CELLS=split_cells,
                BLOCK_G=_pow2(h // hkv, 16), BLOCK_D=_pow2(dh), BLOCK_N=max(DECODE_BLOCK_N, page), Q8=q8)


def _prefill_meta(q, k_pool, table, window: int, scale: float, q8: bool = False) -> dict:
    b, t, h, dh = q.shape
    _, n_pages, hkv, page, _ = k_pool.shape
    _refuse_unsupported(h, hkv, dh, q8)
    # K tiles of at most 4096 cells x dims (8 KB f16): the two loops' pipelined K, V and Q tiles then
    # fit an A100's 163 KB of shared memory at 3 stages (gemma3's Dh 256: 100 KB, 64/128: 82/106 KB)
    block_d = _pow2(dh)
    return dict(SCALE=float(scale), WINDOW=int(window), T=t, H=h, HKV=hkv, G=h // hkv, DH=dh, P=page,
                N_PAGES=n_pages, MAX_PAGES=table.shape[1], BLOCK_M=32 if block_d > 128 else 64, BLOCK_D=block_d,
                BLOCK_N=max(16, page, min(64, 4096 // block_d)), Q8=q8)


def _merge_meta(split_meta: dict) -> dict:
    keep = ("SCALE", "H", "HKV", "G", "DH", "SPLITS", "BLOCK_D")
    return {k: split_meta[k] for k in keep} | dict(BLOCK_S=MERGE_BLOCK_S)


def _scales(k_pool, v_pool, k_scale, v_scale) -> tuple[jax.Array, jax.Array]:
    """The scale pointers: a q8_0 pool's, or (an f16 pool: never read) the pools themselves."""
    return (k_pool, v_pool) if k_scale is None else (k_scale, v_scale)


@partial(jax.jit, static_argnames=("window", "scale"))
def decode_attention(q, k_new, v_new, k_pool, v_pool, layer, table, starts, *, window: int,
                     scale: float, k_scale=None, v_scale=None) -> jax.Array:
    """The twin's contract (kernels/paged_attention.decode_attention): q [B, H, Dh] f32, k_new, v_new
    [B, Hkv, Dh] f32 at position starts[b]; a q8_0 pool with its k_scale, v_scale; returns [B, H, Dh] f32."""
    b, h, dh = q.shape
    cache_type = cache_type_of(k_scale)
    meta = _decode_meta(q, k_pool, table, window, scale, q8=cache_type == "q8_0")
    splits = meta["SPLITS"]
    parts = (jax.ShapeDtypeStruct((b, splits, h, dh), jnp.float32),
             jax.ShapeDtypeStruct((b, splits, h), jnp.float32),
             jax.ShapeDtypeStruct((b, splits, h), jnp.float32))
    i32 = jnp.int32
    o_part, m_part, l_part = triton_call(
        q.astype(jnp.float32), k_pool, v_pool, *_scales(k_pool, v_pool, k_scale, v_scale), jnp.asarray(layer, i32),
        table.astype(i32), starts.astype(i32), kernel=_decode_split, out_shape=parts, grid=(b, meta["HKV"], splits), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES, **meta)
    return triton_call(
        q.astype(jnp.float32), as_cached(k_new, cache_type), as_cached(v_new, cache_type), o_part, m_part, l_part,
        kernel=_decode_merge, out_shape=jax.ShapeDtypeStruct((b, h, dh), jnp.float32), grid=(b, h),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **_merge_meta(meta))


@partial(jax.jit, static_argnames=("window", "scale"))
def prefill_attention(q, k_new, v_new, k_pool, v_pool, layer, table, starts, n_new, *, window: int,
                      scale: float, k_scale=None, v_scale=None) -> jax.Array:
    """The twin's contract (kernels/paged_attention.prefill_attention): q [B, T, H, Dh] f32; returns
    [B, T, H, Dh] f32, zero in the padding rows t >= n_new[b]."""
    b, t, h, dh = q.shape
    cache_type = cache_type_of(k_scale)
    meta = _prefill_meta(q, k_pool, table, window, scale, q8=cache_type == "q8_0")
    i32 = jnp.int32
    grid = (b, meta["HKV"], triton.cdiv(t * meta["G"], meta["BLOCK_M"]))
    return triton_call(
        q.astype(jnp.float32), as_cached(k_new, cache_type), as_cached(v_new, cache_type), k_pool, v_pool,
        *_scales(k_pool, v_pool, k_scale, v_scale), jnp.asarray(layer, i32), table.astype(i32), starts.astype(i32), n_new.astype(i32),
        kernel=_prefill, out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), grid=grid,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **meta)


# --- what `bankml gpu-check` compiles and runs -------------------------------------------------------

# The shapes compiled ahead of time, (name, head_dim, query heads, kv heads, window), one per GQA group
# of 1/3/4/8 and head_dim of 64/128/256: the shipped models and the common 8B/70B layouts, page 16.
AOT_SHAPES = (("smollm2", 64, 9, 3, 0), ("gemma3", 256, 4, 1, 512), ("llama3_8b", 128, 32, 8, 0),
              ("llama3_70b", 128, 64, 8, 0), ("llama2_7b", 128, 32, 32, 0))
_AOT_BATCH, _AOT_MAX_PAGES, _AOT_POOL_PAGES, _AOT_T, _AOT_P = 8, 256, 4096, 512, 16


def _variant(name: str, kernel, pointers: dict[str, str], meta: dict, cache_type: str = "f16") -> AotVariant:
    """`kernel` with `pointers` its pointer args' types ("*fp16", ...), every other arg a constexpr of `meta`."""
    names = kernel.arg_names
    signature = {n: pointers.get(n, "constexpr") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers}  # jax buffers are aligned
    return AotVariant(name=name, types=(cache_type,), kernel=kernel, signature=signature, constexprs=dict(meta),
                      attrs=attrs)


def _aot_meta(dh: int, h: int, hkv: int, window: int, q8: bool = False) -> tuple[dict, dict]:
    """decode and prefill constexprs for 8 rows x 256 pages (decode) and one 512-token prefill."""
    q1 = jax.ShapeDtypeStruct((_AOT_BATCH, h, dh), jnp.float32)
    qt = jax.ShapeDtypeStruct((1, _AOT_T, h, dh), jnp.float32)
    pool = jax.ShapeDtypeStruct((2, _AOT_POOL_PAGES, hkv, _AOT_P, dh), jnp.int8 if q8 else jnp.float16)
    table = jax.ShapeDtypeStruct((_AOT_BATCH, _AOT_MAX_PAGES), jnp.int32)
    scale = 1.0 / math.sqrt(dh)
    return _decode_meta(q1, pool, table, window, scale, q8), _prefill_meta(qt, pool, table, window, scale, q8)


def aot_variants() -> list[AotVariant]:
    """decode split, merge and prefill for each of AOT_SHAPES over an f16 pool, and split and prefill over a
    q8_0 one (the merge reads no pool); a kernel's variants share its name and cache type, as its
    `interpret_checks` results do (gpu-check joins the two on them)."""
    f32, f16, i8, i32 = "*fp32", "*fp16", "*i8", "*i32"
    merge_types = dict(q_ptr=f32, k_new_ptr=f32, v_new_ptr=f32, o_part_ptr=f32, m_part_ptr=f32, l_part_ptr=f32,
                       out_ptr=f32)
    variants = []
    for cache_type, cells in (("f16", f16), ("q8_0", i8)):
        pools = dict(k_pool_ptr=cells, v_pool_ptr=cells, k_scale_ptr=f16, v_scale_ptr=f16)
        split_types = dict(q_ptr=f32, **pools, layer_ptr=i32, table_ptr=i32, starts_ptr=i32, o_ptr=f32, m_ptr=f32,
                           l_ptr=f32)
        prefill_types = dict(q_ptr=f32, k_new_ptr=f32, v_new_ptr=f32, **pools, layer_ptr=i32, table_ptr=i32,
                             starts_ptr=i32, n_new_ptr=i32, out_ptr=f32)
        for _, dh, h, hkv, window in AOT_SHAPES:
            decode, prefill = _aot_meta(dh, h, hkv, window, q8=cache_type == "q8_0")
            variants.append(_variant("attn_decode_split", _decode_split, split_types, decode, cache_type))
            if cache_type == "f16":
                variants.append(_variant("attn_decode_merge", _decode_merge, merge_types, _merge_meta(decode)))
            variants.append(_variant("attn_prefill", _prefill, prefill_types, prefill, cache_type))
    return variants


def check_inputs(seed: int, *, batch: int, kv_heads: int, group: int, head_dim: int, t: int, page: int = 16,
                 n_pages: int = 12, max_pages: int = 8, layers: int = 2, cache_type: str = "f16"):
    """Random f16-exact inputs with each row's pages shuffled through the pool: a dict of the
    arguments both attention signatures share (q, k_new and v_new for prefill, [B, T, ...]); for a q8_0
    cache the pools are int8 quants and k_scale, v_scale their blocks' d (None for f16)."""
    rng = np.random.default_rng(seed)
    h = kv_heads * group
    pool = (layers, n_pages, kv_heads, page, head_dim)

    def f16(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float16))

    x = dict(q=f16(batch, t, h, head_dim).astype(jnp.float32),
             k_new=f16(batch, t, kv_heads, head_dim).astype(jnp.float32),
             v_new=f16(batch, t, kv_heads, head_dim).astype(jnp.float32),
             k_pool=f16(*pool), v_pool=f16(*pool), layer=jnp.int32(layers - 1),
             table=jnp.asarray(np.stack([rng.permutation(n_pages)[:max_pages] for _ in range(batch)]), jnp.int32),
             k_scale=None, v_scale=None)
    if cache_type == "q8_0":
        (x["k_pool"], x["k_scale"]), (x["v_pool"], x["v_scale"]) = quantize_q8_0(x["k_pool"]), quantize_q8_0(x["v_pool"])
    return x


def _check(name: str, got: jax.Array, want: jax.Array, shape: str, cache_type: str,
           tolerance: float = 1e-5) -> CheckResult:
    err = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))
    return CheckResult(name=name, types=(cache_type,), shape=shape, max_rel_err=err, tolerance=tolerance,
                       ok=bool(err <= tolerance))


def interpret_checks() -> list[CheckResult]:
    """Decode (split + merge) and prefill under Triton's interpreter against their twins, over an f16 and a
    q8_0 pool: gemma3's shape (4 heads on 1, Dh 256) with a sliding window smaller than the context, and
    SmolLM2's (9 on 3, Dh 64) without; rows of different lengths, one with no cached cell, one with padding."""
    results = []
    for cache_type in ("f16", "q8_0"):
        for group, kv_heads, dh, window in ((4, 1, 256, 24), (3, 3, 64, 0)):
            x = check_inputs(0, batch=2, kv_heads=kv_heads, group=group, head_dim=dh, t=8, cache_type=cache_type)
            starts, n_new = jnp.array([37, 0], jnp.int32), jnp.array([5, 8], jnp.int32)
            pool = (x["k_pool"], x["v_pool"], x["layer"], x["table"], starts)
            kw = dict(window=window, scale=1.0 / math.sqrt(dh), k_scale=x["k_scale"], v_scale=x["v_scale"])
            shape = f"B=2 H={group * kv_heads} Hkv={kv_heads} Dh={dh} P=16 starts=37,0 window={window} {cache_type}"
            one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
            decode = _check("attn_decode_split", decode_attention(*one, *pool, **kw), decode_twin(*one, *pool, **kw),
                            shape + " (split and merge together)", cache_type)
            results.append(decode)
            if cache_type == "f16":
                results.append(dataclasses.replace(decode, name="attn_decode_merge"))
            new = (x["q"], x["k_new"], x["v_new"])
            results.append(_check("attn_prefill", prefill_attention(*new, *pool, n_new, **kw),
                                  prefill_twin(*new, *pool, n_new, **kw), shape + " T=8 n_new=5,8", cache_type))
    return results
