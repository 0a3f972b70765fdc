"""GGUF quantized matrices kept in their block bits on the device, as "planes", and the jnp twin of the
Triton quantized matmul (kernels/triton/qmatmul.py).

A GGUF matrix [N rows (out), K cols (in)] is a row of blocks per output row, each block a struct of
fields (research/kernels.md §1). `repack` splits those structs into one contiguous array per field --
a plane -- straight from the file's bytes (no f32 round trip): the same bits, each plane [N, ...] with
a power-of-two number of bytes per block, so a kernel finds element (n, k) with a multiply and a shift.
The only decoding done here is the K-quants' packed 6-bit scales (Q3_K, Q4_K, Q5_K), unpacked to a byte
each, which costs 4-16 bytes per 256 elements: every type stays within 1.04x of its file bytes (Q3_K).

Plane order per type (nb = K/32 blocks, ns = K/256 super-blocks; u8 unless said, f16 stays f16):
  Q4_0  qs [N, K/2] (block b's 16 bytes at 16b..16b+15, file order), d f16 [N, nb]
  Q4_1  qs, d, m f16 [N, nb]
  Q5_0  qs, qh [N, K/8] (block b's 4 bytes at 4b..4b+3), d
  Q5_1  qs, qh, d, m
  Q8_0  qs i8 [N, K], d
  Q2_K  qs [N, K/4] (64 per super-block), sc [N, K/16] (raw: low nibble scale, high nibble min), d, dmin f16 [N, ns]
  Q3_K  hmask [N, K/8], qs [N, K/4], sc i8 [N, K/16] (the signed 6-bit scale, already minus 32), d
  Q4_K  qs [N, K/2], sc [N, K/32], mn [N, K/32] (unpacked 6-bit), d, dmin
  Q5_K  qs, qh [N, K/8] (32 per super-block), sc, mn, d, dmin
  Q6_K  ql [N, K/2], qh [N, K/4], sc i8 [N, K/16], d
`dequantize_planes` is bit-identical to `gguf.quants.dequantize` for the same reason kernels/dequant_ref.py
is: every product of an f16 field with the small integers is exact in f32, so the one rounding is the
final add of the min, whatever the order or fusion of the operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.dequant import SUPPORTED_TYPES
from kernels.dequant_ref import BLOCK_LAYOUT

# ggml type id -> name: the types kept as QWeights (F16/BF16/F32 stay dense arrays in the engine).
QUANT_TYPES: dict[int, str] = {t: name for t, name in SUPPORTED_TYPES.items() if name not in ("F32", "F16", "BF16")}

# ggml type id -> the names of its planes, in order.
PLANES: dict[int, tuple[str, ...]] = {
    2: ("qs", "d"),
    3: ("qs", "d", "m"),
    6: ("qs", "qh", "d"),
    7: ("qs", "qh", "d", "m"),
    8: ("qs", "d"),
    10: ("qs", "sc", "d", "dmin"),
    11: ("hmask", "qs", "sc", "d"),
    12: ("qs", "sc", "mn", "d", "dmin"),
    13: ("qs", "qh", "sc", "mn", "d", "dmin"),
    14: ("ql", "qh", "sc", "d"),
}


@jax.tree_util.register_dataclass
@dataclass
class QWeight:
    """A quantized matrix [N, K] as its planes (PLANES[ggml_type] order), each [N, ...]."""

    planes: tuple[jax.Array, ...]
    ggml_type: int = field(metadata={"static": True})
    shape: tuple[int, int] = field(metadata={"static": True})  # (N, K)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)

    @property
    def type_name(self) -> str:
        return QUANT_TYPES[self.ggml_type]


# Byte offsets of the f16 fields (d, m, dmin) inside each block (ggml-common.h).
F16_FIELDS: dict[int, tuple[int, ...]] = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82),
                                          11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_raw(ggml_type: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random raw bytes u8 [rows, bytes per row] of a [rows, cols] matrix, for tests and `bankml gpu-check`:
    every quant bit random, the f16 fields normal times 2**-14 .. 2**-1 (subnormals included, never an inf
    or NaN that would only compare NaNs), so dots of a few thousand elements stay well inside f32's range."""
    block, size = BLOCK_LAYOUT[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        values = rng.standard_normal(raw.shape[0]) * np.exp2(rng.integers(-14, 0, raw.shape[0]))
        raw[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def file_nbytes(ggml_type: int, rows: int, cols: int) -> int:
    """What a [rows, cols] matrix of this type takes in a GGUF file."""
    block, size = BLOCK_LAYOUT[ggml_type]
    return rows * cols // block * size


# ---------------------------------------------------------------------------------------------
# Repacking on the host: raw block bytes -> planes
# ---------------------------------------------------------------------------------------------


def _field(blocks: np.ndarray, start: int, stop: int, dtype=np.uint8) -> np.ndarray:
    """Bytes start:stop of every block, [N, nb, w] -> [N, nb * w] (as dtype: f16 or i8 views of the same bits)."""
    n = blocks.shape[0]
    return np.ascontiguousarray(blocks[:, :, start:stop]).view(dtype).reshape(n, -1)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, ns, 12] packed -> (sc, mn) u8 [N, ns * 8]: ggml's get_scale_min_k4 (ggml-quants.c)."""
    n = s.shape[0]
    d, m, m_d = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (m_d & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (m_d >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.reshape(n, -1), mn.reshape(n, -1)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """[N, ns, 12] packed -> i8 [N, ns * 16]: scale i is low 4 bits of s[i%8] >> 4(i//8) and high 2 bits
    of s[8 + i%4] >> 2(i//4), minus 32 (dequantize_row_q3_K in ggml-quants.c)."""
    n, ns = s.shape[:2]
    lo = (s[:, :, None, 0:8] >> np.array([0, 4], np.uint8)[:, None]).reshape(n, ns, 16) & 15
    hi = (s[:, :, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(n, ns, 16) & 3
    return ((lo | (hi << 4)).view(np.int8) - np.int8(32)).reshape(n, -1)


def repack(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """Raw GGUF bytes of a [rows, cols] matrix (any shape, e.g. the reader's memmap) -> host planes."""
    if ggml_type not in QUANT_TYPES:
        raise ValueError(f"ggml type {ggml_type} is not a quantized block type ({sorted(QUANT_TYPES)})")
    block, size = BLOCK_LAYOUT[ggml_type]
    if cols % block:
        raise ValueError(f"{QUANT_TYPES[ggml_type]} rows hold whole blocks of {block}; got {cols} columns")
    flat = np.asarray(raw).reshape(-1).view(np.uint8)
    if flat.size != file_nbytes(ggml_type, rows, cols):
        raise ValueError(f"{flat.size} bytes for a {rows}x{cols} {QUANT_TYPES[ggml_type]} matrix, "
                         f"want {file_nbytes(ggml_type, rows, cols)}")
    b = flat.reshape(rows, cols // block, size)  # [N, blocks, bytes]
    f16, i8 = np.float16, np.int8
    match ggml_type:
        case 2:
            return _field(b, 2, 18), _field(b, 0, 2, f16)
        case 3:
            return _field(b, 4, 20), _field(b, 0, 2, f16), _field(b, 2, 4, f16)
        case 6:
            return _field(b, 6, 22), _field(b, 2, 6), _field(b, 0, 2, f16)
        case 7:
            return _field(b, 8, 24), _field(b, 4, 8), _field(b, 0, 2, f16), _field(b, 2, 4, f16)
        case 8:
            return _field(b, 2, 34, i8), _field(b, 0, 2, f16)
        case 10:
            return _field(b, 16, 80), _field(b, 0, 16), _field(b, 80, 82, f16), _field(b, 82, 84, f16)
        case 11:
            return _field(b, 0, 32), _field(b, 32, 96), _q3_k_scales(b[:, :, 96:108]), _field(b, 108, 110, f16)
        case 12:
            sc, mn = _k_scale_min(b[:, :, 4:16])
            return _field(b, 16, 144), sc, mn, _field(b, 0, 2, f16), _field(b, 2, 4, f16)
        case 13:
            sc, mn = _k_scale_min(b[:, :, 4:16])
            return _field(b, 48, 176), _field(b, 16, 48), sc, mn, _field(b, 0, 2, f16), _field(b, 2, 4, f16)
        case 14:
            return _field(b, 0, 128), _field(b, 128, 192), _field(b, 192, 208, i8), _field(b, 208, 210, f16)


def to_qweight(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> QWeight:
    """repack, then the planes onto the default device."""
    planes = tuple(jnp.asarray(p) for p in repack(raw, ggml_type, rows, cols))
    return QWeight(planes, ggml_type, (rows, cols))


# ---------------------------------------------------------------------------------------------
# The jnp twin: planes -> f32, and the matmul the Triton kernels compute
# ---------------------------------------------------------------------------------------------

_U8 = jnp.uint8


def _shifted(a: jax.Array, shifts: tuple[int, ...], axis: int) -> jax.Array:
    """a with a new axis at `axis` holding a >> s for each s (the sub-fields of packed bytes)."""
    s = jnp.asarray(shifts, _U8).reshape((-1,) + (1,) * (a.ndim - axis))
    return jnp.expand_dims(a, axis) >> s


def _f32(a: jax.Array) -> jax.Array:
    return a.astype(jnp.float32)


def _q4_0(qs, d):
    n = qs.shape[0]
    q = _shifted(qs.reshape(n, -1, 16), (0, 4), 2) & 15  # [N, nb, 2, 16]: element 16h + j
    q = q.reshape(n, -1, 32).astype(jnp.int8) - 8
    return _f32(d)[..., None] * _f32(q)


def _q4_1(qs, d, m):
    n = qs.shape[0]
    q = (_shifted(qs.reshape(n, -1, 16), (0, 4), 2) & 15).reshape(n, -1, 32)
    return _f32(d)[..., None] * _f32(q) + _f32(m)[..., None]


def _q5(qs, qh):
    """5-bit codes u8 [N, nb, 32]: nibble | bit i of the block's little-endian u32 qh << 4."""
    n = qs.shape[0]
    lo = (_shifted(qs.reshape(n, -1, 16), (0, 4), 2) & 15).reshape(n, -1, 32)
    hi = (_shifted(qh.reshape(n, -1, 4), tuple(range(8)), 3) & 1).reshape(n, -1, 32)  # bit 8*byte + shift
    return lo | (hi << 4)


def _q5_0(qs, qh, d):
    return _f32(d)[..., None] * _f32(_q5(qs, qh).astype(jnp.int8) - 16)


def _q5_1(qs, qh, d, m):
    return _f32(d)[..., None] * _f32(_q5(qs, qh)) + _f32(m)[..., None]


def _q8_0(qs, d):
    return _f32(qs.reshape(qs.shape[0], -1, 32)) * _f32(d)[..., None]


def _q2_bits(qs):
    """2-bit codes [N, ns, 16, 16] from qs [N, K/4]: element 128h + 32s + l is (qs[32h + l] >> 2s) & 3."""
    n = qs.shape[0]
    return (_shifted(qs.reshape(n, -1, 2, 32), (0, 2, 4, 6), 3) & 3).reshape(n, -1, 16, 16)


def _q2_k(qs, sc, d, dmin):
    n = qs.shape[0]
    sc = sc.reshape(n, -1, 16)
    dl = (_f32(d)[..., None] * _f32(sc & 15))[..., None]  # [N, ns, 16, 1]
    ml = (_f32(dmin)[..., None] * _f32(sc >> 4))[..., None]
    return dl * _f32(_q2_bits(qs)) - ml


def _q3_k(hmask, qs, sc, d):
    n = qs.shape[0]
    h = (_shifted(hmask.reshape(n, -1, 32), tuple(range(8)), 2) & 1).reshape(n, -1, 16, 16)  # bit j // 32
    # A clear hmask bit means "subtract 4" (ggml: `(hm & m) ? 0 : 4`).
    q = _q2_bits(qs).astype(jnp.int8) - ((h ^ 1) << 2).astype(jnp.int8)
    dl = (_f32(d)[..., None] * _f32(sc.reshape(n, -1, 16)))[..., None]
    return dl * _f32(q)


def _q4_bits(qs):
    """4-bit codes [N, ns, 8, 32] from qs [N, K/2]: sub-block j is the low (j even) or high nibbles of
    qs[32(j//2) : 32(j//2) + 32]."""
    n = qs.shape[0]
    return (_shifted(qs.reshape(n, -1, 4, 32), (0, 4), 3) & 15).reshape(n, -1, 8, 32)


def _k_affine(q, sc, mn, d, dmin):
    n = q.shape[0]
    dl = (_f32(d)[..., None] * _f32(sc.reshape(n, -1, 8)))[..., None]  # [N, ns, 8, 1]
    ml = (_f32(dmin)[..., None] * _f32(mn.reshape(n, -1, 8)))[..., None]
    return dl * _f32(q) - ml


def _q4_k(qs, sc, mn, d, dmin):
    return _k_affine(_q4_bits(qs), sc, mn, d, dmin)


def _q5_k(qs, qh, sc, mn, d, dmin):
    n = qs.shape[0]
    hi = (_shifted(qh.reshape(n, -1, 32), tuple(range(8)), 2) & 1)  # [N, ns, 8, 32]: bit j of qh[l]
    return _k_affine(_q4_bits(qs) | (hi << 4), sc, mn, d, dmin)


def _q6_k(ql, qh, sc, d):
    n = ql.shape[0]
    # element 128h + 32k + l: nibble k >> 1 of ql[64h + 32(k & 1) + l], 2-bit field k of qh[32h + l]
    lo = (_shifted(ql.reshape(n, -1, 2, 64), (0, 4), 3) & 15).reshape(n, -1, 8, 32)
    hi = (_shifted(qh.reshape(n, -1, 2, 32), (0, 2, 4, 6), 3) & 3).reshape(n, -1, 8, 32)
    q = (lo | (hi << 4)).astype(jnp.int8) - 32
    dl = (_f32(d)[..., None] * _f32(sc.reshape(n, -1, 16)))[..., None]  # [N, ns, 16, 1]
    return dl * _f32(q.reshape(n, -1, 16, 16))


_DEQUANT = {2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k,
            14: _q6_k}


def dequantize_planes(w: QWeight) -> jax.Array:
    """f32 [N, K], bit-identical to gguf.quants.dequantize of the file's bytes."""
    return _DEQUANT[w.ggml_type](*w.planes).reshape(w.shape)


def qmatmul_ref(x: jax.Array, w: QWeight) -> jax.Array:
    """x [M, K] f32 @ w.T -> [M, N] f32: the twin of kernels/triton/qmatmul.qmatmul."""
    return jnp.dot(x, dequantize_planes(w).T, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
