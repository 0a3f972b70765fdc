"""Dequantize one GGUF tensor to f32, on the path chosen for this platform. Unknown types are refused.

The model loader calls `dequantize(tensor.data, tensor.tensor_type, tensor.shape, name=tensor.name)`
once per tensor at load. `dequantize_into` fills a caller's host array instead, such as a layer's slot
of a stacked weight. This is the only module that decides how dequantization runs:

- cpu: the numpy twins in dequant_ref.py, run once at load to f32. The forward pass then runs on f32,
  which XLA:CPU handles far better than narrow types (research/kernels.md §3c). Measured on this
  2-core box, end to end into a jax.Array, they beat the jitted JAX reference for every type: about
  0.45 s against 1.0 s for gemma3's 262144x640 Q8_0 embedding. They also need no compile per shape.
  The output buffer is 64-byte aligned, so `jax.device_put` adopts it without a copy.
- gpu: the jitted JAX reference runs on the device, from the raw bytes -- only for what is held as
  f32 there (the "dense" layout). The GPU's default "device" layout never dequantizes at load: its
  matrices stay in their blocks (kernels/qlayout.py) and the Triton matmul dequantizes in registers.

Every supported type is bit-identical to `gguf.quants.dequantize` (gguf-py 0.19.0) on both paths;
tests/test_dequant.py checks this. A type not in SUPPORTED_TYPES raises UnsupportedTensorType and never falls back.

Shape convention: `shape` is GGUF/ggml order, ne0 first (gguf-py's `ReaderTensor.shape`, the file's
dims). The result is in numpy order, the reverse: a 2-D weight with ne = (cols, rows) comes back as
[rows, cols], where cols = ne0 is the contiguous axis (the input features of a matmul weight).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor

from kernels.dequant_ref import BLOCK_LAYOUT, dequantize_jax, dequantize_numpy
from kernels.supported_types import SUPPORTED_TYPES  # the one table; re-exported here

# jax.default_backend() -> dequant path. Anything else is refused rather than guessed.
PATH_FOR_BACKEND: dict[str, str] = {
    "cpu": "numpy",
    "gpu": "jax-reference",  # the "dense" layout only; the device layout keeps the blocks (kernels/ops.py)
    "cuda": "jax-reference",
    "rocm": "jax-reference",
}


class UnsupportedTensorType(ValueError):
    """A tensor's ggml type has no dequantizer here; raised before any bytes are read."""

    def __init__(self, tensor_name: str, ggml_type: int):
        self.tensor_name = tensor_name
        self.ggml_type = int(ggml_type)
        self.type_name = type_name(ggml_type)
        supported = ", ".join(SUPPORTED_TYPES.values())
        super().__init__(
            f"tensor {tensor_name} has type {self.type_name}, which bankml's engine does not support "
            f"(supported: {supported})"
        )


def type_name(ggml_type: int) -> str:
    """The ggml name of a type id ("IQ2_XXS"), or "unknown type <id>" for ids gguf-py does not know."""
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"unknown type {int(ggml_type)}"


def check_supported(ggml_type: int, tensor_name: str = "<unnamed>") -> None:
    """Raise UnsupportedTensorType unless `ggml_type` is in SUPPORTED_TYPES (to refuse a file up front)."""
    if int(ggml_type) not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(tensor_name, ggml_type)


def dequant_path(backend: str | None = None) -> str:
    """The path `dequantize` takes on `backend` (default: jax.default_backend()), for logs and tests."""
    backend = backend or jax.default_backend()
    if backend not in PATH_FOR_BACKEND:
        known = ", ".join(PATH_FOR_BACKEND)
        raise RuntimeError(f"no dequantization path for JAX backend {backend!r} (known: {known})")
    return PATH_FOR_BACKEND[backend]


def numpy_shape(ggml_shape: Sequence[int]) -> tuple[int, ...]:
    """GGUF dims (ne0 first) -> numpy shape (ne0 last)."""
    return tuple(int(n) for n in reversed(list(ggml_shape)))


def _raw_bytes(raw: np.ndarray, ggml_type: int, ggml_shape: Sequence[int], tensor_name: str) -> np.ndarray:
    """The tensor's bytes as flat u8, after checking their count against the shape."""
    arr = np.asarray(raw)
    if arr.dtype.byteorder == ">":
        raise ValueError(f"tensor {tensor_name}: big-endian GGUF data is not supported")
    block_size, type_size = BLOCK_LAYOUT[ggml_type]
    dims = [int(n) for n in ggml_shape]
    if not dims or dims[0] % block_size:
        raise ValueError(
            f"tensor {tensor_name}: ne0 of shape {dims} is not a multiple of the {SUPPORTED_TYPES[ggml_type]} "
            f"block size {block_size}"
        )
    n_bytes = int(np.prod(dims)) // block_size * type_size
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if flat.size != n_bytes:
        raise ValueError(
            f"tensor {tensor_name}: {flat.size} bytes of data, but shape {dims} as "
            f"{SUPPORTED_TYPES[ggml_type]} needs {n_bytes}"
        )
    return flat


def dequantize(
    raw: np.ndarray,
    ggml_type: int,
    shape: Sequence[int],
    *,
    name: str = "<unnamed>",
    backend: str | None = None,
) -> jax.Array:
    """GGUF tensor bytes -> f32 jax.Array on the default device, numpy-ordered (see the module docstring).

    raw: the tensor data as gguf-py's reader gives it: u8 for block types and BF16, f16/f32 arrays for
      F16/F32. Any C-contiguous array holding exactly the tensor's bytes will do.
    ggml_type: the ggml type id (`int(tensor.tensor_type)`); must be in SUPPORTED_TYPES.
    shape: GGUF dims, ne0 first (`tensor.shape`).
    name: the tensor name, used only in error messages.
    backend: overrides jax.default_backend() to pick the path (tests run the device path on CPU).
    """
    ggml_type = int(ggml_type)
    check_supported(ggml_type, name)
    path = dequant_path(backend)
    flat = _raw_bytes(raw, ggml_type, shape, name)
    out_shape = numpy_shape(shape)
    if path == "numpy":
        return jax.device_put(dequantize_numpy(flat, ggml_type).reshape(out_shape))
    # GPU: only the raw bytes travel to the device, and the reference expands them there.
    # TODO(triton issue): keep Q4_0/Q4_K/Q6_K/Q8_0 packed for the Triton dequant-GEMV instead.
    return dequantize_jax(jax.device_put(flat), ggml_type).reshape(out_shape)


def dequantize_into(
    raw: np.ndarray, ggml_type: int, shape: Sequence[int], out: np.ndarray, *, name: str = "<unnamed>"
) -> np.ndarray:
    """Like `dequantize`, but on the host, written into `out` (f32, C-contiguous, numpy-order shape).

    This is for filling one layer's slot of a stacked [n_layer, ...] array at load without an extra copy.
    It always takes the numpy path, whatever the backend, because its result is a host array.
    """
    ggml_type = int(ggml_type)
    check_supported(ggml_type, name)
    flat = _raw_bytes(raw, ggml_type, shape, name)
    if tuple(out.shape) != numpy_shape(shape):
        raise ValueError(f"tensor {name}: out has shape {tuple(out.shape)}, expected {numpy_shape(shape)}")
    dequantize_numpy(flat, ggml_type, out=out)
    return out


def dequantize_tensor(tensor: ReaderTensor, *, backend: str | None = None) -> jax.Array:
    """`dequantize` for a gguf.ReaderTensor: dequantize_tensor(reader.tensors[i])."""
    return dequantize(tensor.data, int(tensor.tensor_type), tensor.shape, name=tensor.name, backend=backend)
