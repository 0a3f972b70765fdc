"""The paged KV cache on the device: one pool of pages, shared by every sequence, fixed at start.

k and v: [n_layer, n_pages, Hkv, page_size, Dh], f16 as llama.cpp's default cache (half the bytes a
decode step reads; attention computes in f32), or q8_0 (`[engine] cache_type`, llama-server's
--cache-type-k/v q8_0): int8 quants in the same layout and, beside them, k_scale and v_scale
[n_layer, n_pages, Hkv, page_size, Dh // 32] f16, each block of 32 values' d (kernels/kvquant.py), 34
bytes per 32 values where f16 takes 64. Where head_dim % 64 == 0 a q8_0 pool holds K and V
Hadamard-rotated, as llama.cpp's quantized cache does (kernels/kvquant.py `rotation`; model/forward.py
rotates before the write and rotates the attention output back). A sequence's cells are found through its block table,
[max_pages] page ids in order (model/pages.py keeps which page belongs to whom): position p is cell
p % page_size of page table[p // page_size]. The forward pass gathers a window of a sequence's pages
per layer and scatters the new K/V into them in one write at the end of a step; callers donate the
pool to the jitted step, so the write is in place. Nothing here knows which sequence is which: the
block tables and the starting positions come with every step, as arrays.

The layout is the one the GPU kernels read (a page is a contiguous [page_size, Dh] tile per head, its
scales a [page_size, Dh // 32] tile).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from kernels.kvquant import (
    CACHE_TYPES,
    Q8_0_BLOCK_BYTES,
    QK8_0,
    as_cached,
    dequantize_q8_0,
    quantize_q8_0,
    rotate,
    rotation,
)
from model.config import Config

__all__ = ["CACHE_TYPES", "KVPool", "as_cached", "cache_type_refusal", "dequantize_q8_0", "gather_pages", "init_pool",
           "page_bytes", "quantize_q8_0", "read_cells", "rotate", "rotation", "scatter_pages", "write_cells"]

_DTYPES = {"f16": jnp.float16, "f32": jnp.float32}  # "f32": an exact cache, for tests


@jax.tree_util.register_dataclass
@dataclass
class KVPool:
    k: jax.Array  # [L, n_pages, Hkv, page_size, Dh]: f16, or int8 quants for q8_0
    v: jax.Array
    k_scale: jax.Array | None = None  # q8_0 only: f16 [L, n_pages, Hkv, page_size, Dh // 32], each block's d
    v_scale: jax.Array | None = None

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def cache_type(self) -> str:
        """"q8_0" or "f16" ("f32" for a test's exact pool): what forward.py rounds K, V and Q through."""
        if self.k_scale is not None:
            return "q8_0"
        return "f32" if self.k.dtype == jnp.float32 else "f16"

    @property
    def arrays(self) -> list[jax.Array]:
        """k, v, then a q8_0 cache's scales: the fields in order (`KVPool(*arrays)` makes it again)."""
        return [a for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None]

    @property
    def nbytes(self) -> int:
        """The device bytes of the pool, scales included."""
        return sum(int(a.nbytes) for a in self.arrays)


def cache_type_refusal(config: Config, cache_type: str) -> str | None:
    """Why a pool of `cache_type` cannot hold this model's K/V, or None."""
    if cache_type not in CACHE_TYPES:
        return f"[engine] cache_type {cache_type!r} is not a KV cache type bankML has (one of {', '.join(CACHE_TYPES)})"
    if cache_type == "q8_0" and config.head_dim % QK8_0:
        return (f"[engine] cache_type q8_0 needs a head_dim divisible by {QK8_0} (blocks of {QK8_0} values); "
                f"this model's is {config.head_dim}: use f16")
    return None


def page_bytes(config: Config, page_size: int, cache_type: str = "f16") -> int:
    """The device bytes of one page, K and V of every layer (q8_0: quants and scales)."""
    values = 2 * config.n_layer * config.n_head_kv * page_size * config.head_dim
    if cache_type == "q8_0":
        return values // QK8_0 * Q8_0_BLOCK_BYTES
    return values * jnp.dtype(_DTYPES[cache_type]).itemsize


def init_pool(config: Config, n_pages: int, page_size: int, cache_type: str = "f16", parallel=None) -> KVPool:
    """An empty pool; with `parallel` (model/parallel.py), split over its mesh by KV head, each device
    making its own share."""
    why = cache_type_refusal(config, cache_type) if cache_type != "f32" else None
    if why:
        raise ValueError(why)
    heads = config.n_head_kv if parallel is None else parallel.pool_heads(config)
    shape = (config.n_layer, n_pages, heads, page_size, config.head_dim)

    def make() -> KVPool:
        if cache_type != "q8_0":
            return KVPool(k=jnp.zeros(shape, _DTYPES[cache_type]), v=jnp.zeros(shape, _DTYPES[cache_type]))
        scales = (*shape[:-1], config.head_dim // QK8_0)
        return KVPool(k=jnp.zeros(shape, jnp.int8), v=jnp.zeros(shape, jnp.int8),
                      k_scale=jnp.zeros(scales, jnp.float16), v_scale=jnp.zeros(scales, jnp.float16))

    if parallel is None:
        return make()
    return jax.jit(make, out_shardings=parallel.pool_sharding())()


def read_cells(pool: KVPool, index) -> tuple[jax.Array, jax.Array]:
    """(K, V) of `pool.k[index]`, f32: an index of the leading axes (layer, pages, ...), never of Dh."""
    if pool.k_scale is None:
        return pool.k[index].astype(jnp.float32), pool.v[index].astype(jnp.float32)
    return dequantize_q8_0(pool.k[index], pool.k_scale[index]), dequantize_q8_0(pool.v[index], pool.v_scale[index])


def write_cells(pool: KVPool, index, k: jax.Array, v: jax.Array) -> KVPool:
    """The pool with `k`, `v` (f32, the shape of `pool.k[index]`) written at `index`, in the cache's type;
    an out-of-range page drops its write (mode="drop": padding rows go to page n_pages)."""
    if pool.k_scale is None:
        return KVPool(pool.k.at[index].set(k.astype(pool.k.dtype), mode="drop"),
                      pool.v.at[index].set(v.astype(pool.v.dtype), mode="drop"))
    (kq, kd), (vq, vd) = quantize_q8_0(k), quantize_q8_0(v)
    return KVPool(pool.k.at[index].set(kq, mode="drop"), pool.v.at[index].set(vq, mode="drop"),
                  pool.k_scale.at[index].set(kd, mode="drop"), pool.v_scale.at[index].set(vd, mode="drop"))


@jax.jit
def gather_pages(leaf: jax.Array, pages: jax.Array) -> jax.Array:
    """[L, n_pages, Hkv, P, X] (one of `KVPool.arrays`) -> the listed pages' cells in order,
    [L, len(pages) * P, Hkv * X]; a page id past the pool reads the last page (clip)."""
    x = jnp.take(leaf, pages, axis=1, mode="clip")  # [L, Np, Hkv, P, X]
    n_layer, n_p, hkv, p, w = x.shape
    return jnp.moveaxis(x, 2, 3).reshape(n_layer, n_p * p, hkv * w)


@partial(jax.jit, donate_argnums=(0,))
def scatter_pages(leaf: jax.Array, pages: jax.Array, cells: jax.Array) -> jax.Array:
    """The inverse of `gather_pages`: cells [L, len(pages) * P, Hkv * X] into the listed pages; a page id
    past the pool writes nothing (drop)."""
    n_layer, _, hkv, p, w = leaf.shape
    x = jnp.moveaxis(cells.reshape(n_layer, -1, p, hkv, w), 3, 2)  # [L, Np, Hkv, P, X]
    return leaf.at[:, pages].set(x.astype(leaf.dtype), mode="drop")
