"""The KV cache's types: f16 (llama.cpp's default) or q8_0 blocks, and the rounding a value takes through each.

q8_0 is ggml's block of 32 values: one f16 scale d and 32 int8 quants, 34 bytes for what f16 holds in 64.
The pool keeps the quants in the cells' own layout ([..., Dh] int8) and the scales beside them
([..., Dh // 32] f16, the d of each block of 32 along head_dim), so a cell is still one contiguous row.

`quantize_q8_0` is the quantization llama.cpp's CPU backend writes into its KV cache (ggml-cpu's set_rows
goes through the type's from_float, ggml/src/ggml-cpu/arch/x86/quants.c `quantize_row_q8_0`, its AVX2 path):
amax = max |x| over the block, d = amax / 127 rounded to f16, id = 127 / amax (0 when amax is 0), and
q = x * id rounded to nearest, ties to even. The portable `quantize_row_q8_0_ref` (ggml-quants.c) differs
in two places, id = 1 / d and roundf's ties away from zero, so the two disagree by one step at exact ties;
tests/test_kvquant.py ports both. llama.cpp's flash attention over a q8_0 K quantizes Q the same way (it
converts Q to K's vec_dot_type, ggml-cpu/ops.cpp, ggml_compute_forward_flash_attn_ext_f16_one_chunk) and
dequantizes V to f32: `as_cached` is that round trip, for Q, K and V alike.

An f32 -> f16 -> f32 round trip inside one XLA program is not a rounding XLA keeps: with its default
`xla_allow_excess_precision` the GPU compiler removes such convert pairs (seen on an H200: a new token's
V, or a q8_0 block's d, reached attention unrounded, 2.5e-4 to 3.8e-4 off the CPU's answer, in the twin or
in the kernel's wrapper depending on how XLA fused the program). `round_f16` rounds with
`lax.reduce_precision`, which no pass removes, so every backend rounds where llama.cpp stores f16.

Before a quantized cache, llama.cpp rotates (src/llama-kv-cache.cpp `attn_rot_k`/`attn_rot_v` and
llama-graph.cpp `build_attn`, PR #21038, on unless LLAMA_ATTN_ROT_DISABLE is set): where head_dim % 64 == 0,
Q and K (after rope) are multiplied by an orthonormal Walsh-Hadamard matrix in blocks of the largest power
of two >= 64 that divides head_dim, V in blocks of 64, and the attention output by V's matrix again (H is
its own inverse). Scores are unchanged in exact arithmetic; what the rotation changes is what q8_0 rounds,
outliers spread over a block. `rotation` says which blocks, `rotate` applies one.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CACHE_TYPES = ("f16", "q8_0")
QK8_0 = 32  # values per q8_0 block
Q8_0_BLOCK_BYTES = 2 + QK8_0  # the f16 d and 32 int8 quants


F16_MIN_NORMAL = 2.0**-14


def round_f16(x: jax.Array) -> jax.Array:
    """x f32 rounded to the nearest f16 (ties to even), kept in f32; overflow is inf, as a cast gives.
    `reduce_precision` for the normal range (XLA keeps it where it would drop a convert pair); the f16
    subnormals through the cast, whose loss if XLA drops it is below 2^-25 in absolute terms."""
    x = x.astype(jnp.float32)
    normal = lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
    return jnp.where(jnp.abs(x) < F16_MIN_NORMAL, x.astype(jnp.float16).astype(jnp.float32), normal)


def quantize_q8_0(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n] (n % 32 == 0) -> (qs int8 [..., n], d f16 [..., n // 32]), block by block along the last axis."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // QK8_0, QK8_0)  # [..., NB, 32]
    amax = jnp.max(jnp.abs(blocks), axis=-1)  # [..., NB]
    d = round_f16(amax / jnp.float32(127.0)).astype(jnp.float16)  # exact: a dequantize in the same program reads it so
    inv = jnp.where(amax != 0, jnp.float32(127.0) / jnp.where(amax != 0, amax, 1.0), 0.0)
    qs = jnp.round(blocks * inv[..., None]).astype(jnp.int8)  # jnp.round: ties to even, as _MM_ROUND_NEAREST
    return qs.reshape(x.shape), d


def dequantize_q8_0(qs: jax.Array, d: jax.Array) -> jax.Array:
    """(qs int8 [..., n], d f16 [..., n // 32]) -> f32 [..., n]: d * q (exact in f32)."""
    blocks = qs.reshape(*qs.shape[:-1], qs.shape[-1] // QK8_0, QK8_0).astype(jnp.float32)
    return (blocks * d.astype(jnp.float32)[..., None]).reshape(qs.shape)


def as_cached(a: jax.Array, cache_type: str = "f16") -> jax.Array:
    """`a` as a cache of `cache_type` holds it, in f32: through f16, or a q8_0 round trip ("f32": as it is,
    the exact cache some tests use)."""
    if cache_type == "q8_0":
        return dequantize_q8_0(*quantize_q8_0(a))
    if cache_type == "f16":
        return round_f16(a)
    if cache_type == "f32":
        return a.astype(jnp.float32)
    raise ValueError(f"no KV cache type {cache_type!r} (one of {', '.join(CACHE_TYPES)})")


def rotation(head_dim: int, cache_type: str) -> tuple[int, int] | None:
    """(Q and K's block, V's block) of llama.cpp's Hadamard rotation for this cache, or None (not quantized,
    or head_dim % 64 != 0): llama_kv_cache::build_input_k_rot (the largest power of two >= 64 dividing
    head_dim) and build_input_v_rot (64)."""
    if cache_type != "q8_0" or head_dim % 64:
        return None
    k_block = 64
    while head_dim % (2 * k_block) == 0:
        k_block *= 2
    return k_block, 64


@cache
def hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard (src/llama-kv-cache.cpp): the orthonormal Sylvester-Walsh matrix [n, n] f32, its
    entries +-(1.0 / sqrtf(n)) as ggml rounds them; symmetric, and its own inverse."""
    h = np.zeros((n, n), np.float32)
    h[0, 0] = np.float32(1.0 / np.float64(np.sqrt(np.float32(n))))
    s = 1
    while s < n:
        h[s:2 * s, :s], h[:s, s:2 * s], h[s:2 * s, s:2 * s] = h[:s, :s], h[:s, :s], -h[:s, :s]
        s *= 2
    return h


def rotate(x: jax.Array, n: int) -> jax.Array:
    """x [..., D] (D % n == 0) times the n x n Hadamard matrix, block by block along the last axis, in f32."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)  # [..., D / n, n]
    out = jnp.einsum("...j,jk->...k", blocks, jnp.asarray(hadamard(n)), precision=lax.Precision.HIGHEST)
    return out.reshape(x.shape)
