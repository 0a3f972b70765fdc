"""Embeddings: the final hidden states after the output norm, pooled as the GGUF says.

What llama-server `--embeddings` returns is llama.cpp's `t_embd` (`result_norm`, the output norm's
result, before the LM head) pooled by the context's pooling type (src/llama-graph.cpp,
`build_pooling`): `<arch>.pooling_type` from the GGUF (llama.cpp's enum: model/pooling.py), and, for a
model without one, mean (`resolve_pooling`: what `llama-server --pooling mean` gives; b11434 without
`--pooling` pools such a model as none, recorded in tests/fixtures/embeddings_smollm2.json).

`Embedder.embed(token_lists, pooling)` runs a request's inputs together: they are grouped by
power-of-two length bucket (at least MIN_LENGTH), each group cut into batches of a power-of-two
size whose tokens stay within MAX_BATCH_TOKENS (a batch too large for memory is split), right-padded
with token 0. Attention is the model's own, causal (llama.cpp keeps a decoder's causal mask for
embeddings), so a real token never sees the padding after it; the pooling reads the real tokens
only. Nothing is written to a KV cache: the layers are forward.py's own (`_layer`, `_attention`),
attending to the new tokens alone, with K and V rounded to the cache's type as llama.cpp's graph
rounds them through its cache. Each (batch, length, pooling) program is compiled on first use,
never at start-up, and kept.

Runs on the model's engine thread (the gateway calls it through `client.call`), between two
decode iterations, so it never races the decode loop for the device.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from model.config import Config
from model.forward import _attention, _layer, embed, rms_norm
from model.parallel import AXIS, Parallel, weight_specs
from model.pooling import (
    POOLING_CLS,
    POOLING_LAST,
    POOLING_MEAN,
    POOLING_NAMES,
    POOLING_NONE,
    SERVED,
    EmbedError,
)
from model.rope import rope_tables
from model.weights import Weights

log = logging.getLogger(__name__)

MIN_LENGTH = 16  # the smallest length bucket
MAX_BATCH = 16  # the largest batch bucket
MAX_BATCH_TOKENS = 4096  # padded tokens in one program: the attention scores grow with B * T * T


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@partial(jax.jit, static_argnames=("config", "pooling", "cache_type"))
def embed_forward(weights: Weights, tokens: jax.Array, n_real: jax.Array, *, config: Config, pooling: int,
                  cache_type: str) -> jax.Array:
    """tokens [B, T] (row b's first n_real[b] real, right-padded) -> pooled [B, D], or [B, T, D] for
    pooling none: the output norm's result (llama.cpp's t_embd), f32. Weights split over a mesh
    (model/parallel.py) run each device's share under `shard_map`, as model/forward.py does."""
    tp = weights.parallel
    if tp is None:
        return _embed_forward(weights, tokens, n_real, config, pooling, cache_type, None)
    return jax.shard_map(partial(_embed_forward, config=tp.local_config(config), pooling=pooling,
                                 cache_type=cache_type, tp=tp),
                         mesh=tp.mesh, in_specs=(weight_specs(weights), P(), P()), out_specs=P(),
                         check_vma=False)(weights, tokens, n_real)


def _embed_forward(weights: Weights, tokens, n_real, config: Config, pooling: int, cache_type: str,
                   tp: Parallel | None):
    reduce = None if tp is None else partial(lax.psum, axis_name=AXIS)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    x = embed(weights, tokens, config, tp)  # [B, T, D]
    ropes = rope_tables(config, positions, weights.rope_freqs)
    starts = jnp.zeros(b, jnp.int32)

    def attend_with(is_swa):
        def attend(q, k, v):  # the new tokens only: no cached cells (k_old None), causal
            return _attention(q, k, v, None, None, starts, positions, is_swa, config)
        return attend

    if isinstance(weights.layers, tuple):  # device layout: one layer after another
        for il, lw in enumerate(weights.layers):
            swa = bool(config.swa_layers[il])
            x, _, _ = _layer(x, lw, None, swa, attend_with(jnp.asarray(swa)), ropes, config, cache_type,
                             reduce)
    else:
        def body(x, xs):
            layer_swa, il = xs
            x, _, _ = _layer(x, weights.layers, il, layer_swa, attend_with(layer_swa), ropes, config, cache_type,
                             reduce)
            return x, None

        x, _ = lax.scan(body, x, (jnp.asarray(config.swa_layers, dtype=bool), jnp.arange(config.n_layer)))
    x = rms_norm(x, weights.output_norm, config.norm_eps)  # [B, T, D]: result_norm
    if pooling == POOLING_NONE:
        return x
    if pooling == POOLING_MEAN:  # llama-graph.cpp: inp_mean, 1/n over the sequence's tokens
        real = (jnp.arange(t)[None, :] < n_real[:, None]).astype(x.dtype)  # [B, T]
        return jnp.einsum("btd,bt->bd", x, real, precision=lax.Precision.HIGHEST) / n_real[:, None].astype(x.dtype)
    if pooling == POOLING_CLS:
        return x[:, 0]
    if pooling == POOLING_LAST:
        return jnp.take_along_axis(x, (n_real - 1)[:, None, None], axis=1)[:, 0]
    raise EmbedError(f"pooling type {pooling} is not served")


class Embedder:
    """The compiled embedding programs of one engine (its weights, config and KV type)."""

    def __init__(self, config: Config, weights: Weights, cache_type: str, lowering: threading.Lock | None = None):
        self.config, self.weights, self.cache_type = config, weights, cache_type
        self._compiled: dict[tuple[int, int, int], object] = {}
        # the engine's lock: one program is lowered at a time, beside the background compile (model/compiled.py)
        self._lowering = lowering or threading.Lock()

    def plan(self, lengths: Sequence[int]) -> list[tuple[int, int, list[int]]]:
        """The programs a request runs: (batch bucket, length bucket, the inputs' indices) for each batch."""
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_length.setdefault(_pow2_at_least(n, MIN_LENGTH), []).append(i)
        out = []
        for t, members in sorted(by_length.items()):
            most = max(1, min(MAX_BATCH, MAX_BATCH_TOKENS // t))
            most = 1 << (most.bit_length() - 1)  # a power of two
            for s in range(0, len(members), most):
                part = members[s:s + most]
                out.append((_pow2_at_least(len(part), 1), t, part))
        return out

    def _program(self, b: int, t: int, pooling: int):
        key = (b, t, pooling)
        program = self._compiled.get(key)
        if program is None:
            t0 = time.perf_counter()
            specs = (jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
            with self._lowering:
                lowered = embed_forward.lower(self.weights, *specs, config=self.config, pooling=pooling,
                                              cache_type=self.cache_type)
            program = lowered.compile()
            self._compiled[key] = program
            log.info("compiled the embedding program for %d x %d tokens (pooling %s) in %.2f s", b, t,
                     POOLING_NAMES.get(pooling, pooling), time.perf_counter() - t0)
        return program

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: int) -> list[np.ndarray]:
        """One array per input: [D] pooled, or [n, D] (pooling none), f32, unnormalized."""
        if pooling not in SERVED:
            raise EmbedError(f"pooling type {POOLING_NAMES.get(pooling, pooling)} is not served by bankml "
                             "serve --native (rank needs a classification head)")
        n_vocab = self.config.n_vocab
        for tokens in token_lists:
            if not tokens:
                raise EmbedError("Input content cannot be empty")
            if any(t < 0 or t >= n_vocab for t in tokens):
                raise EmbedError("the input contains a token id outside the vocabulary")
        out: list[np.ndarray | None] = [None] * len(token_lists)
        for b, t, members in self.plan([len(x) for x in token_lists]):
            tokens = np.zeros((b, t), np.int32)
            n_real = np.ones(b, np.int32)  # padding rows: one token, thrown away
            for row, i in enumerate(members):
                tokens[row, :len(token_lists[i])] = token_lists[i]
                n_real[row] = len(token_lists[i])
            result = np.asarray(self._program(b, t, pooling)(self.weights, tokens, n_real))
            for row, i in enumerate(members):
                out[i] = result[row, :n_real[row]] if pooling == POOLING_NONE else result[row]
        return out  # type: ignore[return-value]
