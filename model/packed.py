"""Packed matrices for the CPU path: small integer codes plus a per-group affine map, expanded inside
the step.

Every supported GGUF block type dequantizes as `w = scale_g * q + offset_g` with a small integer q and
f32 group constants (research/kernels.md §1): Q4_0/Q5_0/Q8_0 (groups of 32, no offset), Q4_1/Q5_1
(32, offset m), Q4_K/Q5_K (32, scale d*sc, offset -dmin*m), Q2_K (16, offset), Q3_K/Q6_K (16, no
offset). The products are exact in f32 (at most 23 significant bits), so `q * scale + offset`
reproduces `gguf.quants.dequantize` bit for bit whatever the rounding of the fused add.

Why: decode on XLA:CPU streams every weight once per token and is bound by memory bandwidth. f32
weights are 4 bytes each; int8 codes with f32 constants 1 + 8/g (1.25 or 1.5); 4-bit codes two to a
byte with f16 constants 0.625, what llama.cpp's Q4_1 itself streams. On SmolLM2 (2 cores) a decode
step took 40 ms with f32 weights' worth of traffic halved to int8, 35 -> 28 ms with nibbles and f16
constants. XLA:CPU's dot is slow on narrow types (kernels.md §3c), so `linear` expands one block of
rows at a time to f32 (small enough to stay in cache) right before its dot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model.actquant import KINDS, round_activations

_NIB = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_1BIT = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)

ROWS_PER_EXPAND = 128  # rows expanded to f32 at a time: 128 x 1536 x 4 B = 768 KiB, inside L2
# Up to this many activation rows (a decode step of a few sequences), each row is its own matrix-vector
# product on the expanded block, still in cache: XLA:CPU runs a vector product with its own fast loop,
# but a product of 2-4 rows with Eigen's GEMM, which packs the block first and took 1.9x the time of
# one row for two (SmolLM2's ffn_up: 192 us -> 365 us; as vector products 227 us; four rows 419 vs
# 310 us). From 8 rows on, the GEMM is as fast or faster.
GEMV_ROWS = 4


@jax.tree_util.register_dataclass
@dataclass
class Packed:
    """A matrix [..., out, in] as small integer codes and per-group constants [..., out, in/g].

    Codes are int8 [..., out, in], or, when every code fits in four bits (Q4_0, Q4_1, Q4_K), two per
    byte: uint8 [..., out, in/2] holding column c in the low nibble and column c + in/2 in the high
    one, less `nibble_bias` (8 for Q4_0's signed codes). Constants are f16 where every one of them is
    exactly an f16 (the legacy types' d and m), else f32. Either way `expand` gives the same f32
    values; the narrower forms halve what a decode step streams from memory.
    """

    q: jax.Array  # int8 [..., out, in], or uint8 [..., out, in/2] nibble pairs
    scale: jax.Array  # f16 or f32 [..., out, in/g]
    offset: jax.Array | None  # f16 or f32 [..., out, in/g]; None when every group's offset is 0
    # per layer (one entry unstacked): how ggml rounds the activations for this type (model/actquant.py)
    act: tuple[str, ...] = field(default=("f32",), metadata={"static": True})
    nibble_bias: int | None = field(default=None, metadata={"static": True})  # None: int8 codes

    @property
    def shape(self) -> tuple[int, ...]:
        cols = self.q.shape[-1] * (1 if self.nibble_bias is None else 2)
        return (*self.q.shape[:-1], cols)

    @property
    def group(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, act: tuple[str, ...]) -> Packed:
    """Codes int8 [..., out, in] and constants [..., out, in/g] (from `unpack_affine`) -> the narrowest
    Packed that expands to the same values."""
    bias = None
    if q.shape[-1] % 64 == 0:  # each half of a row must hold whole groups of 32
        lo, hi = int(q.min(initial=0)), int(q.max(initial=0))
        bias = 0 if lo >= 0 and hi <= 15 else 8 if lo >= -8 and hi <= 7 else None
    if bias is not None:
        c = (q.astype(np.int16) + bias).astype(np.uint8)
        half = q.shape[-1] // 2
        q = c[..., :half] | (c[..., half:] << np.uint8(4))
    return Packed(jnp.asarray(q), _narrow(scale), None if offset is None else _narrow(offset), act, bias)


def _narrow(a: np.ndarray) -> jax.Array:
    """f16 when that is exact for every element (and finite), else f32."""
    h = a.astype(np.float16)
    return jnp.asarray(h if np.array_equal(h.astype(np.float32), a) else a.astype(np.float32))


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)  # [n, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    n = qs.shape[0]
    return ((qs.reshape(n, 1, 1, 16) >> _NIB) & np.uint8(0x0F)).reshape(n, 32)


def _bits32(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, m, m_d = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 63, (m_d & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (m_d >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


# ggml type id -> blocks u8[n, type_size] -> (q int8 [n, QK], scale f32 [n, QK/g], offset f32 | None)
def _q4_0(b):
    return _nibbles(b[:, 2:18]).view(np.int8) - np.int8(8), _f16(b[:, 0:2]), None


def _q4_1(b):
    return _nibbles(b[:, 4:20]).view(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << np.uint8(4))
    return q.view(np.int8) - np.int8(16), _f16(b[:, 0:2]), None


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << np.uint8(4))
    return q.view(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:34].view(np.int8), _f16(b[:, 0:2]), None


def _q2_k(b):
    n, scales = b.shape[0], b[:, 0:16]
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> _2BIT) & np.uint8(3)).reshape(n, 256)
    return q.view(np.int8), _f16(b[:, 80:82]) * (scales & 15), -(_f16(b[:, 82:84]) * (scales >> 4))


def _q3_k(b):
    n, scales = b.shape[0], b[:, 96:108]
    lo = (scales[:, None, 0:8] >> np.array([0, 4], dtype=np.uint8)[None, :, None]).reshape(n, 16)
    hi = (scales[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]).reshape(n, 16)
    sc = ((lo & 15) | ((hi & 3) << 4)).view(np.int8) - np.int8(32)
    ql = ((b[:, 32:96].reshape(n, 2, 1, 32) >> _2BIT) & np.uint8(3)).reshape(n, 256)
    qh = ((b[:, 0:32].reshape(n, 1, 1, 32) >> _1BIT) & np.uint8(1)).reshape(n, 256)
    return ql.view(np.int8) - ((qh ^ np.uint8(1)) << np.uint8(2)).view(np.int8), _f16(b[:, 108:110]) * sc, None


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    q = ((b[:, 16:144].reshape(n, 4, 1, 32) >> _NIB) & np.uint8(15)).reshape(n, 256)
    return q.view(np.int8), _f16(b[:, 0:2]) * sc, -(_f16(b[:, 2:4]) * mn)


def _q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    ql = ((b[:, 48:176].reshape(n, 4, 1, 32) >> _NIB) & np.uint8(15)).reshape(n, 256)
    qh = ((b[:, 16:48].reshape(n, 1, 1, 32) >> _1BIT) & np.uint8(1)).reshape(n, 256)
    return (ql | (qh << np.uint8(4))).view(np.int8), _f16(b[:, 0:2]) * sc, -(_f16(b[:, 2:4]) * mn)


def _q6_k(b):
    n = b.shape[0]
    ql = ((b[:, 0:128].reshape(n, 2, 1, 64) >> _NIB) & np.uint8(15)).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _2BIT) & np.uint8(3)).reshape(n, 8, 32)
    q = (ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)
    return q.reshape(n, 256), _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8), None


# ggml type id -> (elements per block, bytes per block, decoder)
_TYPES = {2: (32, 18, _q4_0), 3: (32, 20, _q4_1), 6: (32, 22, _q5_0), 7: (32, 24, _q5_1), 8: (32, 34, _q8_0),
          10: (256, 84, _q2_k), 11: (256, 110, _q3_k), 12: (256, 144, _q4_k), 13: (256, 176, _q5_k),
          14: (256, 210, _q6_k)}
PACKABLE_TYPES = frozenset(_TYPES)


def unpack_affine(raw: np.ndarray, ggml_type: int, rows: int, cols: int, group: int):
    """Raw GGUF bytes of a [rows, cols] matrix -> (q int8 [rows, cols], scale, offset [rows, cols/group]).

    `group` may be finer than the type's own groups (to stack with layers of another type): constants
    are then repeated. offset is zeros for types without one.
    """
    qk, size, decode = _TYPES[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, size)
    q, scale, offset = decode(blocks)
    own = qk // scale.shape[1]
    if own % group:
        raise ValueError(f"group {group} does not divide the type's group {own}")
    scale = np.repeat(scale.astype(np.float32), own // group, axis=1)
    offset = np.zeros_like(scale) if offset is None else np.repeat(offset.astype(np.float32), own // group, axis=1)
    return q.reshape(rows, cols), scale.reshape(rows, cols // group), offset.reshape(rows, cols // group)


def type_group(ggml_type: int) -> int:
    """The group size of a packable type's constants (16 or 32)."""
    return {10: 16, 11: 16, 14: 16}.get(ggml_type, 32)


def _affine(c: jax.Array, scale: jax.Array, offset: jax.Array | None, g: int) -> jax.Array:
    """Codes [..., out, n] (any int type) with constants [..., out, n/g] -> f32 values."""
    w = c.reshape(*c.shape[:-1], -1, g).astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[..., None]
    return w.reshape(c.shape)


def expand_parts(p: Packed) -> list[jax.Array]:
    """p as f32 column blocks: [all columns], or [first half, second half] when nibble-packed."""
    if p.nibble_bias is None:
        return [_affine(p.q, p.scale, p.offset, p.group)]
    g, n = p.group, p.scale.shape[-1] // 2
    parts = []
    for i, c in enumerate((p.q & jnp.uint8(15), p.q >> jnp.uint8(4))):
        c = c.astype(jnp.int8) - jnp.int8(p.nibble_bias) if p.nibble_bias else c
        cols = slice(i * n, (i + 1) * n)
        parts.append(_affine(c, p.scale[..., cols], None if p.offset is None else p.offset[..., cols], g))
    return parts


def expand(p: Packed) -> jax.Array:
    """Packed [..., out, in] -> f32, exactly the GGUF dequantization."""
    return jnp.concatenate(expand_parts(p), axis=-1)


def linear(x: jax.Array, p: Packed, layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ p.T -> [..., out], expanding ROWS_PER_EXPAND rows at a time.

    When the stack asks for it (`Packed.act`, "f32" unless loaded with activations="ggml"), x is
    first rounded as ggml rounds activations for the layer's type (model/actquant.py). With `layer`, p is a stack [L, out, in] and layer `layer`
    is used. Each block of rows is sliced straight from the stack inside the expansion, which XLA
    fuses: slicing the layer out first (as `lax.scan` does with its xs) would copy every weight of the
    model once per step.
    """
    out_dim, in_dim = p.shape[-2:]
    rows = max(r for r in range(1, min(ROWS_PER_EXPAND, out_dim) + 1) if out_dim % r == 0)
    stacked = p if layer is not None else jax.tree.map(lambda a: a[None], p)
    il = jnp.int32(0) if layer is None else layer
    xq, s_err = _rounded(x, p.act, il, p.offset is not None)
    xs = jnp.split(xq, 1 if p.nibble_bias is None else 2, axis=-1)  # one per block expand_parts gives
    n_rows = math.prod(x.shape[:-1])

    def one(row0: jax.Array) -> jax.Array:
        part = jax.tree.map(lambda a: lax.dynamic_slice(a, (il, row0, 0), (1, rows, a.shape[-1]))[0], stacked)
        # the barrier keeps XLA from fusing the expansion into the dot, which XLA:CPU runs slowly
        ws = lax.optimization_barrier(expand_parts(part))
        if 1 < n_rows <= GEMV_ROWS:
            flat = [xi.reshape(n_rows, -1) for xi in xs]
            y = jnp.stack([sum(jnp.einsum("i,oi->o", xi[r], w) for xi, w in zip(flat, ws, strict=True))
                           for r in range(n_rows)]).reshape(*x.shape[:-1], rows)
        else:
            y = sum(jnp.einsum("...i,oi->...o", xi, w) for xi, w in zip(xs, ws, strict=True))
        if s_err is not None:  # q8_1's sum term: offset * fp16(d * sum q), not offset * fp16(d) * sum q
            y = y + jnp.einsum("...b,ob->...o", s_err, part.offset[:, ::32 // part.group].astype(jnp.float32))
        return y

    n = out_dim // rows
    if n == 1:
        return one(jnp.int32(0))
    ys = lax.map(one, jnp.arange(n, dtype=jnp.int32) * rows)  # [n, ..., rows]
    return jnp.moveaxis(ys, 0, -2).reshape(*x.shape[:-1], out_dim)


def _rounded(x: jax.Array, act: tuple[str, ...], il: jax.Array, has_offset: bool):
    """(xq, s_err or None): x rounded for layer `il`'s kind; s_err is zeros for layers without q8_1."""
    kinds = sorted(set(act), key=KINDS.index)
    want_s = has_offset and "q8_1" in kinds
    if len(kinds) == 1:
        xq, s_err = round_activations(x, kinds[0])
        return xq, s_err if want_s else None

    def branch(kind):
        def run(x):
            xq, s_err = round_activations(x, kind)
            zeros = jnp.zeros((*x.shape[:-1], x.shape[-1] // 32), jnp.float32)
            return xq, (zeros if s_err is None else s_err)
        return run

    which = jnp.asarray([kinds.index(k) for k in act], jnp.int32)[il]
    xq, s_err = lax.switch(which, [branch(k) for k in kinds], x)
    return xq, s_err if want_s else None


def take_rows(p: Packed, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a packed [V, D] matrix, dequantized (the embedding lookup)."""
    return expand(jax.tree.map(lambda a: a[ids], p))
