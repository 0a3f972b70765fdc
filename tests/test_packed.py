"""Packed matrices (model/packed.py) expand to exactly gguf's dequantization, and run the same model."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from tiny_gguf import write_tiny_gguf

from kernels.dequant import dequantize
from model.forward import forward
from model.kvcache import init_cache
from model.packed import PACKABLE_TYPES, Packed, expand, linear, take_rows, unpack_affine
from model.weights import load_weights

# byte ranges of each type's fp16 fields (d, dmin/m), which random bytes must fill with finite values
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int), ids=lambda t: t.name)
def test_expand_is_bit_identical_to_dequantize(qtype):
    assert int(qtype) in PACKABLE_TYPES
    rows, cols = 8, 512
    raw = _random_blocks(qtype, rows, cols)
    want = np.asarray(dequantize(raw, int(qtype), (cols, rows)))
    # a 32-group type also stacks with 16-group layers (constants repeated); 16 cannot merge to 32
    for group in (16,) if qtype in (T.Q2_K, T.Q3_K, T.Q6_K) else (16, 32):
        q, scale, offset = unpack_affine(raw, int(qtype), rows, cols, group)
        offset = jnp.asarray(offset) if offset.any() else None  # as the loader stores it
        got = np.asarray(expand(Packed(jnp.asarray(q), jnp.asarray(scale), offset)))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype.name, group)


def test_linear_and_rows_match_the_f32_matrix():
    rows, cols = 384, 256  # 384 rows: three expansion blocks of 128
    raw = _random_blocks(T.Q4_K, rows, cols, seed=1)
    dense = np.asarray(dequantize(raw, int(T.Q4_K), (cols, rows)))
    p = Packed(*(jnp.asarray(a) for a in unpack_affine(raw, int(T.Q4_K), rows, cols, 32)))
    x = np.random.default_rng(2).standard_normal((2, 3, cols)).astype(np.float32)
    want = x @ dense.T
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), p)), want, rtol=0, atol=1e-5 * np.abs(want).max())
    ids = jnp.array([[5, 0], [383, 7]])
    assert np.array_equal(np.asarray(take_rows(p, ids)), dense[np.asarray(ids)])


def test_packed_model_gives_the_f32_model_logits(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf", "gemma3", n_layer=2, head_dim=32, n_head_kv=1, n_embd=256,
                           n_ff=256, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    config, dense = load_weights(path, verified=True, packed=False)
    _, packed = load_weights(path, verified=True, packed=True)
    assert isinstance(packed.layers.attn_q, Packed) and isinstance(packed.token_embd, Packed)
    assert packed.layers.attn_q.q.dtype == jnp.int8 and packed.layers.attn_q.offset is None
    tokens = jnp.asarray(np.arange(10, dtype=np.int32)[None] * 7)
    outs = []
    for weights in (dense, packed):
        logits, _ = forward(weights, init_cache(config, 1, 16), tokens, jnp.int32(0), jnp.array([10], jnp.int32),
                            config=config, window=0, all_logits=True)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())
