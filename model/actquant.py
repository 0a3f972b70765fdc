"""ggml's activation rounding before a quantized matmul, emulated in f32.

llama.cpp's CPU backend never multiplies a block-quantized weight by f32 activations: it first
quantizes each activation row to the weight type's `vec_dot_type` -- q8_0 for Q4_0/Q5_0/Q8_0, q8_1
for Q4_1/Q5_1, q8_K for the K-quants -- and takes integer dots. On small models that rounding moves
logprobs by ~0.07 nats. It is opt-in (`activations="ggml"`): it is chaotic, so reproducing it exactly
brings an engine whose f32 sums run in another order no closer to llama.cpp (bench/rounding.py).

`x @ W.T` over the rounded activations `xq = d * q` (q the 8-bit codes, d the block scale) equals
ggml's `sum_b d_w d_x sum_j q_w q_x (+ m_w s_x)` up to f32 summation order, because both sides'
products are exact. The one term that is not is q8_1's `s`: ggml stores `fp16(d * sum q)` rather
than `fp16(d) * sum q`, so `q8_1` returns the difference, which the caller applies to the weight
offsets (`Packed.offset`).

Rounding rules, from ggml-cpu/arch/x86/quants.c (the x86 AVX2 path our reference build runs) and
ggml-quants.c (`quantize_row_q8_K_ref`):
- q8_0 / q8_1 (blocks of 32): amax = max |x|; d = fp16(amax / 127); q = round_half_even(x * (127 / amax)).
- q8_1 also: s = fp16((amax / 127) * sum q), with the unrounded d.
- q8_K (blocks of 256): m = the first x with the largest |x|; iscale = -127 / m;
  q = min(127, round_half_even(iscale * x)); d = 1 / iscale, kept in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.kvquant import round_f16  # an f16 rounding XLA keeps (a convert pair it may drop)

# ggml type id -> the activation rounding its CPU dot product uses. Types not here (F32) take f32.
ACT_KIND = {2: "q8_0", 6: "q8_0", 8: "q8_0", 3: "q8_1", 7: "q8_1",
            10: "q8_K", 11: "q8_K", 12: "q8_K", 13: "q8_K", 14: "q8_K"}
KINDS = ("f32", "q8_0", "q8_1", "q8_K")


def _blocks(x: jax.Array, n: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)


def q8_32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q8_0/q8_1 rounding of x [..., K] -> (xq [..., K] f32, s_err [..., K/32]).

    s_err = fp16(d * sum q) - fp16(d) * sum q per block: what q8_1's stored sum differs by.
    """
    xb = _blocks(x, 32)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    d = amax / jnp.float32(127)
    d16 = round_f16(d)
    iscale = jnp.where(amax != 0, jnp.float32(127) / jnp.where(amax != 0, amax, 1), 0)
    q = jnp.round(xb * iscale)  # half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    qsum = jnp.sum(q, axis=-1, keepdims=True)  # exact: |sum| <= 4064
    s_err = round_f16(d * qsum) - d16 * qsum
    return (q * d16).reshape(x.shape), s_err[..., 0]


def q8_k(x: jax.Array) -> jax.Array:
    """q8_K rounding of x [..., K] (K a multiple of 256) -> xq [..., K] f32."""
    xb = _blocks(x, 256)
    first = jnp.argmax(jnp.abs(xb), axis=-1, keepdims=True)  # the first of equal maxima, as ggml's `>`
    m = jnp.take_along_axis(xb, first, axis=-1)
    nonzero = m != 0
    iscale = jnp.float32(-127) / jnp.where(nonzero, m, 1)
    q = jnp.minimum(jnp.round(iscale * xb), 127)
    d = jnp.where(nonzero, jnp.float32(1) / iscale, 0)
    return (q * d).reshape(x.shape)


def round_activations(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array | None]:
    """x [..., K] as ggml hands it to a `kind` dot -> (xq, s_err or None)."""
    if kind == "f32":
        return x, None
    if kind == "q8_K":
        return q8_k(x), None
    xq, s_err = q8_32(x)
    return xq, (s_err if kind == "q8_1" else None)
