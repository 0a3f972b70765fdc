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
from model.kvcache import init_pool
from model.packed import PACKABLE_TYPES, Packed, expand, linear, pack, take_rows, unpack_affine
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
        # the loader's narrowest form: nibble pairs for 4-bit codes, f16 constants where exact
        narrow = pack(q, scale, None if offset is None else np.asarray(offset), ("f32",))
        assert narrow.shape == (rows, cols)
        got = np.asarray(expand(narrow))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype.name, group, "packed")


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
def test_four_bit_codes_travel_two_per_byte_and_exact_constants_as_f16(qtype):
    raw = _random_blocks(qtype, 4, 256, seed=3)
    p = pack(*unpack_affine(raw, int(qtype), 4, 256, 32), ("f32",))
    four_bit = qtype in (T.Q4_0, T.Q4_1, T.Q4_K)
    assert p.q.dtype == (jnp.uint8 if four_bit else jnp.int8)
    assert p.q.shape == (4, 128 if four_bit else 256)
    assert p.nibble_bias == {T.Q4_0: 8, T.Q4_1: 0, T.Q4_K: 0}.get(qtype)
    # legacy d (and m) are f16 in the file; a K-quant's d * sub-scale generally is not an f16
    assert p.scale.dtype == (jnp.float32 if qtype == T.Q4_K else jnp.float16)


def test_linear_and_rows_match_the_f32_matrix():
    rows, cols = 384, 256  # 384 rows: three expansion blocks of 128
    raw = _random_blocks(T.Q4_K, rows, cols, seed=1)
    dense = np.asarray(dequantize(raw, int(T.Q4_K), (cols, rows)))
    p = pack(*unpack_affine(raw, int(T.Q4_K), rows, cols, 32), ("f32",))
    assert p.nibble_bias == 0
    x = np.random.default_rng(2).standard_normal((2, 3, cols)).astype(np.float32)
    want = x @ dense.T
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), p)), want, rtol=0, atol=1e-5 * np.abs(want).max())
    ids = jnp.array([[5, 0], [383, 7]])
    assert np.array_equal(np.asarray(take_rows(p, ids)), dense[np.asarray(ids)])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_packed_model_gives_the_f32_model_logits(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path / "q.gguf", "gemma3", n_layer=2, head_dim=32, n_head_kv=1, n_embd=256,
                           n_ff=256, matrix_type=qtype)
    config, dense = load_weights(path, verified=True, packed=False)
    _, packed = load_weights(path, verified=True, packed=True)
    assert isinstance(packed.layers.attn_q, Packed) and isinstance(packed.token_embd, Packed)
    q = packed.layers.attn_q
    assert (q.q.dtype, q.offset is None) == ((jnp.int8, True) if qtype == T.Q8_0 else (jnp.uint8, False))
    tokens = jnp.asarray(np.arange(10, dtype=np.int32)[None] * 7)
    outs = []
    for weights in (dense, packed):
        logits, _ = forward(weights, init_pool(config, 1, 16), tokens, jnp.zeros((1, 1), jnp.int32),
                            jnp.zeros(1, jnp.int32), jnp.array([10], jnp.int32), config=config, window_pages=0,
                            all_logits=True)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())
