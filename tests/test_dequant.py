"""kernels.dequant against gguf-py's dequantizer: bit for bit, for every supported type, on both paths.

The "cpu" path is the numpy twin used at load on XLA:CPU. The "gpu" path is the jitted JAX reference; it
runs here on the CPU device, and on a GPU it becomes the device path until the Triton twins exist.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernels.dequant import (
    SUPPORTED_TYPES,
    UnsupportedTensorType,
    check_supported,
    dequant_path,
    dequantize,
    dequantize_into,
    dequantize_tensor,
)
from kernels.dequant_ref import BLOCK_LAYOUT

PATHS = ["cpu", "gpu"]

# Byte offsets of the fp16 d/m/dmin fields inside each block (ggml-common.h).
FP16_FIELDS: dict[int, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def _finite_fp16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns covering zeros, subnormals, both signs and the max, but no inf/NaN."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    non_finite = (bits & 0x7C00) == 0x7C00
    bits[non_finite] ^= 0x4000  # drop the top exponent bit: still a random finite value
    return bits


def _random_tensor(ggml_type: int, rows: int, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Random raw bytes u8[rows, bytes_per_row] and the GGUF shape (ne0, ne1) they encode."""
    rng = np.random.default_rng(seed)
    block_size, type_size = BLOCK_LAYOUT[ggml_type]
    blocks_per_row = max(1, 256 // block_size) * 2
    raw = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS.get(ggml_type, ()):
        raw[:, offset : offset + 2] = _finite_fp16_bits(rng, raw.shape[0]).view(np.uint8).reshape(-1, 2)
    if ggml_type == T.F32:  # random f32 bits are mostly fine, but keep NaN payloads out of the comparison
        raw = rng.standard_normal(raw.size // 4).astype(np.float32).view(np.uint8).reshape(raw.shape)
    return raw.reshape(rows, -1), (blocks_per_row * block_size, rows)


def _gguf_ref(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, T(ggml_type))


def test_supported_table_is_the_thirteen_types():
    names = set("F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K".split())
    assert set(SUPPORTED_TYPES.values()) == names
    assert all(T(i).name == n for i, n in SUPPORTED_TYPES.items())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ggml_type", list(SUPPORTED_TYPES), ids=list(SUPPORTED_TYPES.values()))
def test_random_blocks_match_gguf_bit_for_bit(ggml_type: int, path: str):
    raw, shape = _random_tensor(ggml_type, rows=24, seed=ggml_type)
    got = np.asarray(dequantize(raw, ggml_type, shape, backend=path))
    want = _gguf_ref(raw, ggml_type)
    assert got.dtype == np.float32
    assert got.shape == want.shape == (shape[1], shape[0])
    # F16/BF16 random bits include NaNs; every other field here is finite, so equal_nan changes nothing there.
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ggml_type", [T.F16, T.BF16])
def test_float_special_values(ggml_type: int, path: str):
    # Every f16 / bf16 bit pattern: subnormals, signed zeros, infinities and NaNs.
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(64, -1)
    got = np.asarray(dequantize(raw, ggml_type, (1024, 64), backend=path))
    want = _gguf_ref(raw, ggml_type)
    assert np.array_equal(got, want, equal_nan=True)
    finite = np.isfinite(want)
    assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # -0.0 stays -0.0


def test_typed_arrays_from_the_reader_are_accepted():
    # gguf-py hands F32/F16 tensors over as typed arrays and everything else as u8.
    values = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float16)
    got = np.asarray(dequantize(values, T.F16, (32, 4)))
    assert np.array_equal(got, values.astype(np.float32))
    values32 = values.astype(np.float32)
    assert np.array_equal(np.asarray(dequantize(values32, T.F32, (32, 4))), values32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16])
def test_gguf_quantized_weights_round_trip(ggml_type: int, path: str):
    weights = np.random.default_rng(ggml_type).standard_normal((16, 512)).astype(np.float32)
    raw = gguf.quants.quantize(weights, T(ggml_type))
    got = np.asarray(dequantize(raw, ggml_type, (512, 16), backend=path))
    assert np.array_equal(got, _gguf_ref(raw, ggml_type))
    # the quantization error of a 4-bit type (and finer) is well under the weights' spread
    assert np.abs(got - weights).max() < 0.5


def test_shape_is_ggml_order_in_numpy_order_out():
    # Two rows of Q8_0 with ne0 = 64: row r of the result is exactly row r's blocks, in order.
    weights = np.arange(128, dtype=np.float32).reshape(2, 64) / 8
    raw = gguf.quants.quantize(weights, T.Q8_0)  # u8[2, 68]
    got = np.asarray(dequantize(raw, T.Q8_0, (64, 2)))
    assert got.shape == (2, 64)
    assert np.array_equal(got[1], _gguf_ref(raw[1:2], T.Q8_0)[0])
    three_d = np.asarray(dequantize(raw, T.Q8_0, (32, 2, 2)))
    assert three_d.shape == (2, 2, 32)
    assert np.array_equal(three_d.reshape(2, 64), got)


def test_dequantize_into_a_stacked_slot():
    raw, shape = _random_tensor(T.Q6_K, rows=4, seed=3)
    stacked = np.full((3, shape[1], shape[0]), -1.0, np.float32)  # [n_layer, rows, cols]
    dequantize_into(raw, T.Q6_K, shape, stacked[1], name="blk.1.ffn_down.weight")
    assert np.array_equal(stacked[1], _gguf_ref(raw, T.Q6_K))
    assert (stacked[0] == -1).all() and (stacked[2] == -1).all()
    with pytest.raises(ValueError, match="expected"):
        dequantize_into(raw, T.Q6_K, shape, stacked[1].T)
    with pytest.raises(UnsupportedTensorType):
        dequantize_into(raw, T.IQ4_XS, shape, stacked[1])


def test_bytes_that_do_not_fit_the_shape_are_refused():
    raw, shape = _random_tensor(T.Q4_K, rows=2, seed=0)
    with pytest.raises(ValueError, match="needs"):
        dequantize(raw, T.Q4_K, (shape[0], shape[1] + 1), name="blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match="block size 256"):
        dequantize(raw, T.Q4_K, (100, 2))


@pytest.mark.parametrize(
    "ggml_type", [T.IQ2_XXS, T.Q8_K, T.TQ1_0, T.IQ4_NL, T.I8, T.F64], ids=lambda t: T(t).name
)
def test_unsupported_types_are_refused_by_name(ggml_type: int):
    with pytest.raises(UnsupportedTensorType) as err:
        dequantize(np.zeros(512, np.uint8), ggml_type, (256, 2), name="blk.3.attn_q.weight")
    assert isinstance(err.value, ValueError)
    name = T(ggml_type).name
    assert str(err.value).startswith(
        f"tensor blk.3.attn_q.weight has type {name}, which bankml's engine does not support (supported: F32, "
    )
    assert "Q6_K" in str(err.value)


def test_unknown_type_id_is_refused():
    with pytest.raises(UnsupportedTensorType, match="unknown type 99"):
        check_supported(99, "x")


def test_refusal_from_a_gguf_file(tmp_path: Path):
    # A tiny file whose tensor claims IQ2_XXS: the reader accepts it, the engine must not.
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((2, 66), np.uint8), raw_dtype=T.IQ2_XXS)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    norm = np.asarray(dequantize_tensor(tensors["output_norm.weight"]))
    assert np.array_equal(norm, np.ones(8, np.float32))
    with pytest.raises(UnsupportedTensorType, match="tensor blk.0.ffn_down.weight has type IQ2_XXS"):
        dequantize_tensor(tensors["blk.0.ffn_down.weight"])


def test_path_per_backend():
    assert dequant_path("cpu") == "numpy"
    assert dequant_path("gpu") == "jax-reference"
    assert dequant_path() == dequant_path(jax.default_backend())
    with pytest.raises(RuntimeError, match="no dequantization path"):
        dequant_path("metal")


def test_importing_kernels_does_not_import_jax():
    code = "import sys, kernels, kernels.triton; assert 'jax' not in sys.modules, 'jax imported'"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# GGUF metadata value type -> bytes, for the fixed-size ones (8 is string, 9 is array).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fmt: skip


def _tensor_directory(path: Path) -> dict[str, tuple[int, list[int], int]]:
    """name -> (ggml type, GGUF dims, absolute data offset), from the header alone.

    gguf.GGUFReader builds every metadata value (gemma3's 262144-token vocab: 10+ s on a busy core),
    so the real-model tests only walk the header here; dequantize_tensor is tested on a tiny file instead.
    """
    buf = path.read_bytes()[: 64 << 20]  # the header of both models is a few MiB
    pos = 0

    def take(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def skip_value(vtype: int) -> int | None:
        nonlocal pos
        if vtype == 8:
            length = take("Q")  # not `pos += take(...)`: that would add to the pos read before take moved it
            pos += length
        elif vtype == 9:
            etype, count = take("I"), take("Q")
            if etype in _SCALAR_SIZES:
                pos += count * _SCALAR_SIZES[etype]
            else:
                for _ in range(count):
                    skip_value(etype)
        else:
            start = pos
            pos += _SCALAR_SIZES[vtype]
            return int.from_bytes(buf[start:pos], "little")
        return None

    assert buf[:4] == b"GGUF"
    pos = 8
    n_tensors, n_kv = take("Q"), take("Q")
    alignment = 32
    for _ in range(n_kv):
        key_len = take("Q")
        key = buf[pos : pos + key_len].decode()
        pos += key_len
        value = skip_value(take("I"))
        if key == "general.alignment":
            alignment = int(value)
    infos = {}
    for _ in range(n_tensors):
        name_len = take("Q")
        name = buf[pos : pos + name_len].decode()
        pos += name_len
        dims = [take("Q") for _ in range(take("I"))]
        infos[name] = (take("I"), dims, take("Q"))
    data_start = -(-pos // alignment) * alignment
    return {name: (t, dims, data_start + off) for name, (t, dims, off) in infos.items()}


def _check_real_tensors(path: Path, names: list[str], expect_types: set[str]) -> None:
    directory = _tensor_directory(path)
    seen = set()
    for name in names:
        ggml_type, dims, offset = directory[name]
        block_size, type_size = BLOCK_LAYOUT[ggml_type]
        rows = int(np.prod(dims[1:]))
        raw = np.memmap(path, np.uint8, "r", offset, shape=(rows, dims[0] // block_size * type_size))
        want = gguf.quants.dequantize(raw, T(ggml_type)).reshape(tuple(reversed(dims)))
        for backend in PATHS:
            got = np.asarray(dequantize(raw, ggml_type, dims, name=name, backend=backend))
            assert got.shape == want.shape, name
            assert np.array_equal(got, want), (name, backend)
        seen.add(T(ggml_type).name)
    assert seen == expect_types


def test_smollm2_q4_1_tensors(smollm2_path: Path):
    names = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight"]
    _check_real_tensors(smollm2_path, names, {"Q4_1", "F32"})


def test_gemma3_tensors(gemma3_path: Path):
    # attn_output Q4_K, ffn_down Q6_K, attn_k Q5_0, attn_v Q8_0, a norm F32
    names = ["attn_output", "ffn_down", "attn_k", "attn_v", "attn_q_norm"]
    _check_real_tensors(
        gemma3_path, [f"blk.0.{n}.weight" for n in names], {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}
    )
