"""ggml's activation rounding (model/actquant.py) against plain transcriptions of ggml's C, and the
rounded matmul against ggml's integer dot product."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_packed import _random_blocks
from tiny_gguf import write_tiny_gguf

from model.actquant import ACT_KIND, q8_32, q8_k
from model.packed import linear, pack, unpack_affine
from model.weights import load_weights


def _activations(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    x[5] = 0.5 * 127 / 127  # exact halves after scaling appear; the zero block below too
    x[64:96] = 0
    x[300] = -40.0  # an outlier that sets its block's scale
    return x


def _ggml_q8_1(x: np.ndarray):
    """quantize_row_q8_1, x86 AVX2 path: per block of 32 -> (q int, d fp16, s fp16)."""
    out = []
    for blk in x.reshape(-1, 32):
        amax = np.float32(np.abs(blk).max())
        d = np.float32(amax / np.float32(127))
        iscale = np.float32(np.float32(127) / amax) if amax != 0 else np.float32(0)
        q = np.rint(blk * iscale)  # _mm256_round_ps(_MM_ROUND_NEAREST): ties to even
        out.append((q, np.float16(d), np.float16(np.float32(d * np.float32(q.sum())))))
    return out


def _ggml_q8_k(x: np.ndarray):
    """quantize_row_q8_K_ref: per block of 256 -> (q int, d f32)."""
    out = []
    for blk in x.reshape(-1, 256):
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = np.float32(abs(v)), v
        if amax == 0:
            out.append((np.zeros(256), np.float32(0)))
            continue
        iscale = np.float32(np.float32(-127) / mx)
        q = np.minimum(127, np.rint(np.float32(iscale) * blk))  # nearest_int: ties to even
        out.append((q, np.float32(np.float32(1) / iscale)))
    return out


def test_q8_0_and_q8_1_round_as_ggml():
    x = _activations(512, seed=1)
    xq, s_err = q8_32(jnp.asarray(x))
    ref = _ggml_q8_1(x)
    want = np.concatenate([q * np.float32(d) for q, d, _ in ref])
    assert np.array_equal(np.asarray(xq), want.astype(np.float32))
    want_err = [np.float32(s) - np.float32(d) * np.float32(q.sum()) for q, d, s in ref]
    assert np.array_equal(np.asarray(s_err), np.array(want_err, np.float32))
    assert np.any(np.asarray(s_err) != 0)  # the stored sum really differs from d * sum q somewhere


def test_q8_k_rounds_as_ggml():
    x = _activations(1024, seed=2)
    x[600] = 37.0  # a positive maximum: its own code is -127 and the clamp at +127 matters elsewhere
    x[601] = -37.0  # equal magnitude later in the block: the first one wins
    got = np.asarray(q8_k(jnp.asarray(x)))
    want = np.concatenate([q * d for q, d in _ggml_q8_k(x)]).astype(np.float32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rounded_matmul_is_ggmls_integer_dot(qtype):
    """linear with the type's rounding equals sum_b d_w d_x sum_j q_w q_x (+ m_w s_x), ggml's vec_dot."""
    rows, cols = 8, 512
    raw = _random_blocks(qtype, rows, cols, seed=4)
    q, scale, offset = unpack_affine(raw, int(qtype), rows, cols, 16 if qtype == T.Q6_K else 32)
    kind = ACT_KIND[int(qtype)]
    p = pack(q, scale, offset if offset.any() else None, (kind,))
    x = _activations(cols, seed=5)
    got = np.asarray(linear(jnp.asarray(x)[None], p))[0]

    w = q.astype(np.float64) * np.repeat(scale, cols // scale.shape[1], axis=1)
    if kind == "q8_K":
        xq = np.concatenate([qq * d for qq, d in _ggml_q8_k(x)]).astype(np.float64)
        want = w @ xq + np.repeat(offset, cols // offset.shape[1], axis=1) @ xq
    else:
        ref = _ggml_q8_1(x)
        xq = np.concatenate([qq * np.float64(d) for qq, d, _ in ref])
        want = w @ xq
        if kind == "q8_1":  # m_w * s_x, with ggml's stored fp16 sum
            want += offset.astype(np.float64) @ np.array([np.float64(s) for _, _, s in ref])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_the_loader_rounds_only_when_asked(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf", "llama", n_layer=2, n_embd=256, n_ff=256,
                           matrix_type=T.Q4_1)
    _, plain = load_weights(path, verified=True, packed=True)
    _, ggml = load_weights(path, verified=True, packed=True, activations="ggml")
    assert plain.layers.attn_q.act == ("f32", "f32")
    assert ggml.layers.attn_q.act == ("q8_1", "q8_1")
    with pytest.raises(ValueError, match="activations must be"):
        load_weights(path, verified=True, activations="q8")


def test_a_stack_of_mixed_types_rounds_each_layer_its_own_way():
    """Layers of one stack may differ in type (gemma3 mixes Q5_0 and Q8_0 attn_v): each layer's input is
    rounded for its own type, and q8_1's sum term applies only to the q8_1 layer."""
    rows, cols = 8, 512
    parts = [unpack_affine(_random_blocks(t, rows, cols, seed=6 + i), int(t), rows, cols, 32)
             for i, t in enumerate((T.Q4_1, T.Q8_0))]
    stack = pack(*(np.stack([p[i] for p in parts]) for i in range(3)), ("q8_1", "q8_0"))
    x = jnp.asarray(_activations(cols, seed=7))[None]
    for il, kind in enumerate(("q8_1", "q8_0")):
        q, scale, offset = parts[il]
        alone = pack(q, scale, offset if offset.any() else None, (kind,))
        np.testing.assert_allclose(np.asarray(linear(x, stack, jnp.int32(il))), np.asarray(linear(x, alone)),
                                   rtol=0, atol=1e-6 * float(np.abs(np.asarray(linear(x, alone))).max()))
    unrounded = pack(*(np.stack([p[i] for p in parts]) for i in range(3)), ("f32", "f32"))
    assert not np.allclose(np.asarray(linear(x, stack, jnp.int32(0))), np.asarray(linear(x, unrounded, jnp.int32(0))),
                           rtol=0, atol=1e-6)
