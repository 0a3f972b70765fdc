"""GGUF block dequantizers: the pure-JAX references, plus numpy twins for the CPU load path.

Every function here reproduces `gguf.quants.dequantize` (gguf-py 0.19.0) bit for bit. The block layouts
and formulas mirror ggml's `dequantize_row_*` in ggml/src/ggml-quants.c; research/kernels.md §1 spells
them out. Two facts make "bit-identical" hold on any backend, not only where the operation order matches:
- every fp16 field widens to f32 exactly, and
- each product of a widened fp16 scale with small integers (6-bit sub-scale, at most 6-bit quant) has
  at most 24 significant bits, so it is exact in f32.
So the only rounding step is the final `+ m` / `- dmin*m`, the same single rounding gguf-py does.
An FMA (XLA:GPU contracts) or a reordered product therefore gives the same bits. We still keep
gguf-py's operation order, so a reader can check each function against quants.py line by line.

The JAX functions (`*_jax`) take `blocks: u8[N, type_size]` and return `f32[N, block_size]`. They are
the oracle for the Triton twins, and also the GPU load path until those exist. The numpy functions
(`*_np`) have the same math. They write into a caller-given `out` a chunk of blocks at a time, so
temporaries stay cache-sized. That makes them the fast exact path for load-time dequant on XLA:CPU
(see kernels/dequant.py for the measured choice).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

QK_K = 256  # elements per K-quant super-block (ggml-common.h)

# ggml type id -> (elements per block, bytes per block); ids and sizes from ggml.h / gguf.constants.
BLOCK_LAYOUT: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    30: (1, 2),  # BF16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (QK_K, 84),  # Q2_K
    11: (QK_K, 110),  # Q3_K
    12: (QK_K, 144),  # Q4_K
    13: (QK_K, 176),  # Q5_K
    14: (QK_K, 210),  # Q6_K
}


# ---------------------------------------------------------------------------------------------
# Pure JAX references: u8[N, type_size] -> f32[N, block_size]
# ---------------------------------------------------------------------------------------------


def _f16_jax(two_bytes: jax.Array) -> jax.Array:
    """u8[..., 2] little-endian fp16 -> f32[...], exact."""
    return lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def _nibbles_jax(qs: jax.Array) -> jax.Array:
    """u8[N, 16] -> u8[N, 32]: ggml puts element j in the low nibble of byte j, j+16 in the high one."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32_jax(qh: jax.Array) -> jax.Array:
    """u8[N, 4] (one little-endian u32) -> u8[N, 32], bit i of the u32 at position i."""
    word = lax.bitcast_convert_type(qh, jnp.uint32)  # [N]
    return ((word[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)


def f32_jax(blocks: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(blocks.reshape(-1, 4), jnp.float32).reshape(-1, 1)


def f16_jax(blocks: jax.Array) -> jax.Array:
    return _f16_jax(blocks.reshape(-1, 2)).reshape(-1, 1)


def bf16_jax(blocks: jax.Array) -> jax.Array:
    # gguf-py: (int16 -> int32) << 16, viewed as f32; the sign-extension bits are shifted out.
    bits = lax.bitcast_convert_type(blocks.reshape(-1, 2), jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32).reshape(-1, 1)


def q4_0_jax(blocks: jax.Array) -> jax.Array:
    d = _f16_jax(blocks[:, 0:2])[:, None]  # [N, 1]
    q = _nibbles_jax(blocks[:, 2:18]).astype(jnp.int8) - 8  # [N, 32]
    return d * q.astype(jnp.float32)


def q4_1_jax(blocks: jax.Array) -> jax.Array:
    d = _f16_jax(blocks[:, 0:2])[:, None]
    m = _f16_jax(blocks[:, 2:4])[:, None]
    q = _nibbles_jax(blocks[:, 4:20]).astype(jnp.float32)
    return (d * q) + m


def q5_0_jax(blocks: jax.Array) -> jax.Array:
    d = _f16_jax(blocks[:, 0:2])[:, None]
    hi = _bits32_jax(blocks[:, 2:6])
    q = (_nibbles_jax(blocks[:, 6:22]) | (hi << 4)).astype(jnp.int8) - 16
    return d * q.astype(jnp.float32)


def q5_1_jax(blocks: jax.Array) -> jax.Array:
    d = _f16_jax(blocks[:, 0:2])[:, None]
    m = _f16_jax(blocks[:, 2:4])[:, None]
    hi = _bits32_jax(blocks[:, 4:8])
    q = (_nibbles_jax(blocks[:, 8:24]) | (hi << 4)).astype(jnp.float32)
    return (d * q) + m


def q8_0_jax(blocks: jax.Array) -> jax.Array:
    d = _f16_jax(blocks[:, 0:2])[:, None]
    x = lax.bitcast_convert_type(blocks[:, 2:34], jnp.int8).astype(jnp.float32)
    return x * d


_SHIFT_2BIT = jnp.array([0, 2, 4, 6], dtype=jnp.uint8).reshape(1, 1, 4, 1)
_SHIFT_1BIT = jnp.arange(8, dtype=jnp.uint8).reshape(1, 1, 8, 1)
_SHIFT_NIB = jnp.array([0, 4], dtype=jnp.uint8).reshape(1, 1, 2, 1)


def q2_k_jax(blocks: jax.Array) -> jax.Array:
    n = blocks.shape[0]
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    d = _f16_jax(blocks[:, 80:82])[:, None]
    dmin = _f16_jax(blocks[:, 82:84])[:, None]
    dl = (d * (scales & 0x0F).astype(jnp.float32))[..., None]  # [N, 16, 1]
    ml = (dmin * (scales >> 4).astype(jnp.float32))[..., None]
    q = (qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT) & 3  # [N, half, shift, 32]
    q = q.reshape(n, 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(n, QK_K)


def q3_k_jax(blocks: jax.Array) -> jax.Array:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16_jax(blocks[:, 108:110])[:, None]
    # 16 signed 6-bit scales: low nibbles in bytes 0..7 (two per byte), high 2-bit pairs in bytes 8..11.
    lo = (scales[:, None, 0:8] >> jnp.array([0, 4], dtype=jnp.uint8)[None, :, None]).reshape(n, 16)
    hi = (scales[:, None, 8:12] >> jnp.array([0, 2, 4, 6], dtype=jnp.uint8)[None, :, None]).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(jnp.int8) - 32
    dl = (d * sc.astype(jnp.float32))[..., None]  # [N, 16, 1]
    ql = ((qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT).reshape(n, 16, 16)) & 3
    qh = ((hmask.reshape(n, 1, 1, 32) >> _SHIFT_1BIT).reshape(n, 16, 16)) & 1
    # A clear hmask bit means "subtract 4" (ggml: `(hm & m) ? 0 : 4`).
    q = (ql.astype(jnp.int8) - ((qh ^ 1) << 2).astype(jnp.int8)).astype(jnp.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min_jax(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """u8[N, 12] -> (sc, m) u8[N, 8] each: the 6-bit packing of Q4_K/Q5_K (get_scale_min_k4)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4_k_jax(blocks: jax.Array) -> jax.Array:
    n = blocks.shape[0]
    d = _f16_jax(blocks[:, 0:2])[:, None]
    dmin = _f16_jax(blocks[:, 2:4])[:, None]
    sc, mn = _k_scale_min_jax(blocks[:, 4:16])
    dl = (d * sc.astype(jnp.float32))[..., None]  # [N, 8, 1]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    q = ((blocks[:, 16:144].reshape(n, 4, 1, 32) >> _SHIFT_NIB) & 0x0F).reshape(n, 8, 32)
    return (dl * q.astype(jnp.float32) - ml).reshape(n, QK_K)


def q5_k_jax(blocks: jax.Array) -> jax.Array:
    n = blocks.shape[0]
    d = _f16_jax(blocks[:, 0:2])[:, None]
    dmin = _f16_jax(blocks[:, 2:4])[:, None]
    sc, mn = _k_scale_min_jax(blocks[:, 4:16])
    dl = (d * sc.astype(jnp.float32))[..., None]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    ql = ((blocks[:, 48:176].reshape(n, 4, 1, 32) >> _SHIFT_NIB) & 0x0F).reshape(n, 8, 32)
    qh = ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> _SHIFT_1BIT) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.float32)
    return (dl * q - ml).reshape(n, QK_K)


def q6_k_jax(blocks: jax.Array) -> jax.Array:
    n = blocks.shape[0]
    scales = lax.bitcast_convert_type(blocks[:, 192:208], jnp.int8).astype(jnp.float32)  # [N, 16]
    d = _f16_jax(blocks[:, 208:210])[:, None]
    dl = (d * scales)[..., None]  # [N, 16, 1]
    ql = ((blocks[:, 0:128].reshape(n, 2, 1, 64) >> _SHIFT_NIB) & 0x0F).reshape(n, 8, 32)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2BIT) & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(jnp.float32)).reshape(n, QK_K)


JAX_BLOCK_FNS: dict[int, Callable[[jax.Array], jax.Array]] = {
    0: f32_jax,
    1: f16_jax,
    30: bf16_jax,
    2: q4_0_jax,
    3: q4_1_jax,
    6: q5_0_jax,
    7: q5_1_jax,
    8: q8_0_jax,
    10: q2_k_jax,
    11: q3_k_jax,
    12: q4_k_jax,
    13: q5_k_jax,
    14: q6_k_jax,
}


@partial(jax.jit, static_argnames=("ggml_type",))
def dequantize_jax(raw: jax.Array, ggml_type: int) -> jax.Array:
    """Flat raw GGUF bytes u8[n_bytes] -> flat f32[n_elements]. Compiles once per (type, size)."""
    _, type_size = BLOCK_LAYOUT[ggml_type]
    blocks = raw.reshape(-1, type_size)  # [N, type_size]
    return JAX_BLOCK_FNS[ggml_type](blocks).reshape(-1)


# ---------------------------------------------------------------------------------------------
# numpy twins for the CPU load path: (u8[n, type_size], out f32[n, block_size]) -> None
# ---------------------------------------------------------------------------------------------

_NP_NIB = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_NP_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_NP_1BIT = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)


def _f16_np(two_bytes: np.ndarray) -> np.ndarray:
    """u8[n, 2] -> f32[n, 1]."""
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)


def _nibbles_np(qs: np.ndarray) -> np.ndarray:
    """u8[n, 16] -> u8[n, 32], low nibbles first."""
    n = qs.shape[0]
    return ((qs.reshape(n, 1, 1, 16) >> _NP_NIB) & np.uint8(0x0F)).reshape(n, 32)


def _bits32_np(qh: np.ndarray) -> np.ndarray:
    """u8[n, 4] (a little-endian u32) -> u8[n, 32] of 0/1, bit i at position i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def q4_0_np(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles_np(blocks[:, 2:18]).view(np.int8) - np.int8(8)
    np.multiply(_f16_np(blocks[:, 0:2]), q, out=out, dtype=np.float32)


def q4_1_np(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_f16_np(blocks[:, 0:2]), _nibbles_np(blocks[:, 4:20]), out=out, dtype=np.float32)
    out += _f16_np(blocks[:, 2:4])


def q5_0_np(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles_np(blocks[:, 6:22]) | (_bits32_np(blocks[:, 2:6]) << np.uint8(4))
    q = q.view(np.int8) - np.int8(16)
    np.multiply(_f16_np(blocks[:, 0:2]), q, out=out, dtype=np.float32)


def q5_1_np(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles_np(blocks[:, 8:24]) | (_bits32_np(blocks[:, 4:8]) << np.uint8(4))
    np.multiply(_f16_np(blocks[:, 0:2]), q, out=out, dtype=np.float32)
    out += _f16_np(blocks[:, 2:4])


def q8_0_np(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 2:34].view(np.int8), _f16_np(blocks[:, 0:2]), out=out, dtype=np.float32)


def q2_k_np(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    dl = (_f16_np(blocks[:, 80:82]) * (scales & np.uint8(0x0F))).reshape(n, 16, 1)
    ml = (_f16_np(blocks[:, 82:84]) * (scales >> np.uint8(4))).reshape(n, 16, 1)
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> _NP_2BIT) & np.uint8(3)).reshape(n, 16, 16)
    o = out.reshape(n, 16, 16)
    np.multiply(dl, q, out=o)
    o -= ml


def q3_k_np(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    scales = blocks[:, 96:108]
    lo = (scales[:, None, 0:8] >> np.array([0, 4], dtype=np.uint8)[None, :, None]).reshape(n, 16)
    hi = (scales[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]).reshape(n, 16)
    sc = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(0x03)) << np.uint8(4))).view(np.int8) - np.int8(32)
    dl = (_f16_np(blocks[:, 108:110]) * sc).reshape(n, 16, 1)
    ql = ((blocks[:, 32:96].reshape(n, 2, 1, 32) >> _NP_2BIT) & np.uint8(3)).reshape(n, 16, 16)
    qh = ((blocks[:, 0:32].reshape(n, 1, 1, 32) >> _NP_1BIT) & np.uint8(1)).reshape(n, 16, 16)
    q = ql.view(np.int8) - ((qh ^ np.uint8(1)) << np.uint8(2)).view(np.int8)
    np.multiply(dl, q, out=out.reshape(n, 16, 16), dtype=np.float32)


def _k_scale_min_np(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    low6, low4, top2 = np.uint8(0x3F), np.uint8(0x0F), np.uint8(0x30)
    sc = np.concatenate([d & low6, (m_d & low4) | ((d >> np.uint8(2)) & top2)], axis=-1)
    mn = np.concatenate([m & low6, (m_d >> np.uint8(4)) | ((m >> np.uint8(2)) & top2)], axis=-1)
    return sc, mn


def q4_k_np(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    sc, mn = _k_scale_min_np(blocks[:, 4:16])
    dl = (_f16_np(blocks[:, 0:2]) * sc).reshape(n, 8, 1)
    ml = (_f16_np(blocks[:, 2:4]) * mn).reshape(n, 8, 1)
    q = ((blocks[:, 16:144].reshape(n, 4, 1, 32) >> _NP_NIB) & np.uint8(0x0F)).reshape(n, 8, 32)
    o = out.reshape(n, 8, 32)
    np.multiply(dl, q, out=o)
    o -= ml


def q5_k_np(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    sc, mn = _k_scale_min_np(blocks[:, 4:16])
    dl = (_f16_np(blocks[:, 0:2]) * sc).reshape(n, 8, 1)
    ml = (_f16_np(blocks[:, 2:4]) * mn).reshape(n, 8, 1)
    ql = ((blocks[:, 48:176].reshape(n, 4, 1, 32) >> _NP_NIB) & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> _NP_1BIT) & np.uint8(1)).reshape(n, 8, 32)
    o = out.reshape(n, 8, 32)
    np.multiply(dl, ql | (qh << np.uint8(4)), out=o)
    o -= ml


def q6_k_np(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    dl = (_f16_np(blocks[:, 208:210]) * blocks[:, 192:208].view(np.int8)).reshape(n, 16, 1)
    ql = ((blocks[:, 0:128].reshape(n, 2, 1, 64) >> _NP_NIB) & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> _NP_2BIT) & np.uint8(0x03)).reshape(n, 8, 32)
    q = (ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)
    np.multiply(dl, q.reshape(n, 16, 16), out=out.reshape(n, 16, 16), dtype=np.float32)


NUMPY_BLOCK_FNS: dict[int, Callable[[np.ndarray, np.ndarray], None]] = {
    2: q4_0_np,
    3: q4_1_np,
    6: q5_0_np,
    7: q5_1_np,
    8: q8_0_np,
    10: q2_k_np,
    11: q3_k_np,
    12: q4_k_np,
    13: q5_k_np,
    14: q6_k_np,
}

# Elements per numpy chunk (2 MiB of f32 output). Measured on a 2-core Xeon: 8K-element chunks are
# 20-50% slower (per-call overhead), and past 512K nothing is gained; the temporaries stay a few MiB.
_CHUNK_ELEMS = 1 << 19


def aligned_empty_f32(n_elements: int) -> np.ndarray:
    """f32[n] whose data is 64-byte aligned: XLA:CPU's device_put then adopts it without a copy."""
    buf = np.empty(n_elements * 4 + 64, dtype=np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start : start + n_elements * 4].view(np.float32)


def dequantize_numpy(raw: np.ndarray, ggml_type: int, out: np.ndarray | None = None) -> np.ndarray:
    """Flat raw GGUF bytes u8[n_bytes] -> flat f32[n_elements].

    Without `out` the result is a fresh 64-byte-aligned array. With `out` (f32, C-contiguous, n_elements
    in any shape) it is written there, e.g. a layer's slot of a stacked array, and returned flat.
    """
    block_size, type_size = BLOCK_LAYOUT[ggml_type]
    n_elements = raw.size // type_size * block_size
    if out is None:
        out = aligned_empty_f32(n_elements)
    elif out.dtype != np.float32 or out.size != n_elements or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be C-contiguous f32 with {n_elements} elements, got {out.dtype}{out.shape}"
        )
    out = out.reshape(-1)
    if ggml_type == 0:
        out[:] = raw.view(np.float32)  # a copy, so the weights outlive the file mapping
        return out
    if ggml_type == 1:
        out[:] = raw.view(np.float16)
        return out
    if ggml_type == 30:
        np.left_shift(raw.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
        return out
    blocks = raw.reshape(-1, type_size)  # [N, type_size]
    out_blocks = out.reshape(blocks.shape[0], block_size)
    step = max(1, _CHUNK_ELEMS // block_size)
    fn = NUMPY_BLOCK_FNS[ggml_type]
    # Garbage scales (inf/NaN fp16) give NaN weights as in gguf-py; that is the file's business, not a warning.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], step):
            fn(blocks[start : start + step], out_blocks[start : start + step])
    return out
