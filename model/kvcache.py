"""The paged KV cache on the device: one pool of pages, shared by every sequence, fixed at start.

k and v: [n_layer, n_pages, Hkv, page_size, Dh], f16 as llama.cpp's default cache (half the bytes a
decode step reads; attention computes in f32). A sequence's cells are found through its block table,
[max_pages] page ids in order (model/pages.py keeps which page belongs to whom): position p is cell
p % page_size of page table[p // page_size]. The forward pass gathers a window of a sequence's pages
per layer and scatters the new K/V into them in one write at the end of a step; callers donate the
pool to the jitted step, so the write is in place. Nothing here knows which sequence is which: the
block tables and the starting positions come with every step, as arrays.

The layout is the one the GPU kernels read (a page is a contiguous [page_size, Dh] tile per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from model.config import Config


@jax.tree_util.register_dataclass
@dataclass
class KVPool:
    k: jax.Array  # [L, n_pages, Hkv, page_size, Dh]
    v: jax.Array  # [L, n_pages, Hkv, page_size, Dh]

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def page_bytes(config: Config, page_size: int, dtype: jnp.dtype = jnp.float16) -> int:
    """The device bytes of one page, K and V of every layer."""
    return 2 * config.n_layer * config.n_head_kv * page_size * config.head_dim * jnp.dtype(dtype).itemsize


def init_pool(config: Config, n_pages: int, page_size: int, dtype: jnp.dtype = jnp.float16) -> KVPool:
    shape = (config.n_layer, n_pages, config.n_head_kv, page_size, config.head_dim)
    return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
