"""The KV cache: one fixed-shape buffer for every slot, so neither prefill nor decode ever recompiles.

k: [n_layer, n_slots, Hkv, S, Dh] and v: [n_layer, n_slots, Hkv, Dh, S] (S = n_ctx), f16 as llama.cpp's
default cache (half the bytes a decode step reads; attention computes in f32): each is laid
out the way its attention product reads it (Q.K contracts Dh, P.V contracts the cells), so a layer's
window of cells is copied out without a transpose (a transposed window cost more than the whole
attention on XLA:CPU). `lengths[slot]` counts the valid positions: a cell at
position p of a slot is valid iff p < lengths[slot]. The forward pass reads cells with `lengths` as the
mask and writes new cells in one scatter at the end of a step; callers donate the cache to the jitted
step so the write is in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from model.config import Config


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, B_slots, Hkv, S, Dh]
    v: jax.Array  # [L, B_slots, Hkv, Dh, S]
    lengths: jax.Array  # [B_slots] int32

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]


def init_cache(config: Config, n_slots: int, n_ctx: int, dtype: jnp.dtype = jnp.float16) -> KVCache:
    n_layer, h, dh = config.n_layer, config.n_head_kv, config.head_dim
    return KVCache(k=jnp.zeros((n_layer, n_slots, h, n_ctx, dh), dtype),
                   v=jnp.zeros((n_layer, n_slots, h, dh, n_ctx), dtype),
                   lengths=jnp.zeros((n_slots,), jnp.int32))

