"""kernels.qlayout: planes repacked from GGUF block bytes dequantize exactly as gguf-py does, fit in
about the file's bytes, and qmatmul_ref (the Triton kernels' twin) is that dequantization times x."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernels.dequant_ref import BLOCK_LAYOUT
from kernels.qlayout import (
    F16_FIELDS,
    PLANES,
    QUANT_TYPES,
    dequantize_planes,
    file_nbytes,
    qmatmul_ref,
    random_raw,
    repack,
    to_qweight,
)
from model.weights import _tensor_table

TYPES = list(QUANT_TYPES)
IDS = list(QUANT_TYPES.values())


def _any_finite_f16(raw: np.ndarray, ggml_type: int, seed: int) -> np.ndarray:
    """raw with every f16 field a random finite bit pattern: zeros, subnormals, both signs, the max."""
    rng = np.random.default_rng(seed)
    block, size = BLOCK_LAYOUT[ggml_type]
    blocks = raw.reshape(-1, size).copy()
    for offset in F16_FIELDS[ggml_type]:
        bits = rng.integers(0, 1 << 16, blocks.shape[0], dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # no inf/NaN: still a random finite value
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(raw.shape)


def _gguf(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, T(ggml_type))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_types_are_ggml_s_block_types():
    assert set(QUANT_TYPES) == set(PLANES)
    assert all(T(i).name == name for i, name in QUANT_TYPES.items())


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_random_blocks_dequantize_as_gguf_bit_for_bit(ggml_type: int):
    rows, cols = 12, 768  # three super-blocks, 24 blocks of 32 per row
    raw = _any_finite_f16(random_raw(ggml_type, rows, cols, seed=ggml_type), ggml_type, seed=ggml_type + 1)
    w = to_qweight(raw, ggml_type, rows, cols)
    assert w.shape == (rows, cols) and w.type_name == T(ggml_type).name
    assert len(w.planes) == len(PLANES[ggml_type]) and all(p.shape[0] == rows for p in w.planes)
    got = np.asarray(dequantize_planes(w))
    assert _same_bits(got, _gguf(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_device_bytes_are_about_the_file_bytes(ggml_type: int):
    rows, cols = 4, 512
    w = to_qweight(random_raw(ggml_type, rows, cols, seed=0), ggml_type, rows, cols)
    assert file_nbytes(ggml_type, rows, cols) <= w.nbytes <= 1.15 * file_nbytes(ggml_type, rows, cols)


def test_planes_are_the_file_s_bits_in_documented_order():
    # Q4_0: block b's 16 qs bytes at columns 16b.., its d as f16 at column b.
    raw = random_raw(T.Q4_0, 2, 64, seed=3)  # [2, 2 blocks * 18 bytes]
    qs, d = repack(raw, T.Q4_0, 2, 64)
    assert qs.dtype == np.uint8 and qs.shape == (2, 32) and d.dtype == np.float16 and d.shape == (2, 2)
    assert np.array_equal(qs[1, 16:32], raw[1, 20:36])
    assert np.array_equal(d[1, 1:2].view(np.uint8), raw[1, 18:20])
    # Q4_K: sub-block 5's 6-bit scale is (s[9] & 15) | (s[1] >> 6) << 4 of the 12 packed bytes.
    raw = random_raw(T.Q4_K, 1, 256, seed=4)
    qs, sc, mn, d, dmin = repack(raw, T.Q4_K, 1, 256)
    s = raw[0, 4:16]
    assert sc[0, 5] == (s[9] & 15) | ((s[1] >> 6) << 4) and mn[0, 5] == (s[9] >> 4) | ((s[5] >> 6) << 4)
    assert sc.max() < 64 and mn.max() < 64 and np.array_equal(qs[0], raw[0, 16:144])
    # Q6_K's scales are signed bytes, as in the file.
    ql, qh, sc6, d6 = repack(random_raw(T.Q6_K, 1, 256, seed=5), T.Q6_K, 1, 256)
    assert sc6.dtype == np.int8 and (ql.shape, qh.shape, sc6.shape, d6.shape) == ((1, 128), (1, 64), (1, 16), (1, 1))


def test_bytes_that_do_not_fit_are_refused():
    raw = random_raw(T.Q4_K, 2, 512, seed=0)
    with pytest.raises(ValueError, match="want"):
        repack(raw, T.Q4_K, 3, 512)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        repack(raw, T.Q4_K, 4, 128)
    with pytest.raises(ValueError, match="not a quantized block type"):
        repack(raw, T.F16, 2, 512)


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_qmatmul_ref_is_the_dequantized_dot(ggml_type: int):
    rows, cols = 24, 512
    raw = random_raw(ggml_type, rows, cols, seed=ggml_type)
    x = np.random.default_rng(1).standard_normal((3, cols)).astype(np.float32)
    w = to_qweight(raw, ggml_type, rows, cols)
    got = np.asarray(jax.jit(qmatmul_ref)(x, w))  # QWeight is a pytree with its type and shape static
    want = x.astype(np.float64) @ _gguf(raw, ggml_type).astype(np.float64).T
    assert got.shape == (3, rows) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def _check_real(tensor, rows: int | None = None):
    cols, all_rows = (int(n) for n in tensor.shape)
    rows = all_rows if rows is None else rows
    raw = np.asarray(tensor.data[:rows])  # the reader's memmap, [rows, bytes per row]
    w = to_qweight(raw, int(tensor.tensor_type), rows, cols)
    want = _gguf(raw, int(tensor.tensor_type))
    assert _same_bits(np.asarray(dequantize_planes(w)), want), tensor.name
    assert w.nbytes <= 1.15 * raw.nbytes
    x = np.random.default_rng(0).standard_normal((2, cols)).astype(np.float32)
    ref = np.asarray(qmatmul_ref(x, w))
    exact = x.astype(np.float64) @ want.astype(np.float64).T
    assert np.abs(ref - exact).max() <= 1e-6 * np.abs(exact).max(), tensor.name


def real_tensors(path) -> dict:
    """name -> gguf-py ReaderTensor. The engine's tensor-table reader is gguf.GGUFReader without its
    parse of the key/value section (tens of seconds for gemma3's 262k-token vocabulary)."""
    return {t.name: t for t in _tensor_table(path).tensors}


def test_smollm2_q4_1_tensors(smollm2_path):
    tensors = real_tensors(smollm2_path)
    for name in ("blk.0.attn_k.weight", "blk.0.ffn_down.weight"):
        assert tensors[name].tensor_type == T.Q4_1
        _check_real(tensors[name])
    _check_real(tensors["token_embd.weight"], rows=256)  # Q8_0 [49152, 576]: a few rows


def test_gemma3_one_tensor_of_each_type(gemma3_path):
    tensors = real_tensors(gemma3_path)
    picks = {"blk.0.attn_v.weight": T.Q8_0, "blk.0.attn_k.weight": T.Q5_0,
             "blk.0.attn_output.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q6_K}
    for name, ggml_type in picks.items():
        assert tensors[name].tensor_type == ggml_type
        _check_real(tensors[name], rows=128)
    _check_real(tensors["token_embd.weight"], rows=64)  # Q8_0 [262144, 640]
