"""Build GGUF files for tests: well-formed ones with gguf-py's GGUFWriter, malformed ones byte by byte.

The byte builders write exactly what they are told (counts, lengths, offsets, sizes), so a test can
lie in any field. Byte sizes of well-formed tensors come from gguf-py's `GGML_QUANT_SIZES`, not from
the guard's own table, so a guard test never checks the guard against itself.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF metadata value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)

Q2_0 = 42  # bankML's group-64 ternary type; gguf-py does not know it
Q2_0_LAYOUT = (64, 18)


def layout(type_id: int) -> tuple[int, int]:
    """(elements, bytes) per block, from gguf-py (and bankML's Q2_0)."""
    if type_id == Q2_0:
        return Q2_0_LAYOUT
    return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]


def nbytes(dims: Sequence[int], type_id: int) -> int:
    per_block, block_bytes = layout(type_id)
    n = 1
    for d in dims:
        n *= d
    return n // per_block * block_bytes


# ---- byte builders ----------------------------------------------------------------------------


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type, and the value's bytes as given."""
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_str(key: str, value: str | bytes) -> bytes:
    return kv(key, STRING, gstr(value))


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def kv_i32(key: str, value: int) -> bytes:
    return kv(key, I32, struct.pack("<i", value))


def kv_u64(key: str, value: int) -> bytes:
    return kv(key, U64, struct.pack("<Q", value))


def kv_i64(key: str, value: int) -> bytes:
    return kv(key, I64, struct.pack("<q", value))


def kv_f32(key: str, value: float) -> bytes:
    return kv(key, F32, struct.pack("<f", value))


def kv_f64(key: str, value: float) -> bytes:
    return kv(key, F64, struct.pack("<d", value))


def kv_bool(key: str, value: bool) -> bytes:
    return kv(key, BOOL, bytes([value]))


def array(elem_type: int, count: int, body: bytes = b"") -> bytes:
    """An array value: element type, count, then the elements' bytes as given."""
    return struct.pack("<IQ", elem_type, count) + body


def nested_array(depth: int) -> bytes:
    """`depth` arrays of one array each, around an empty u32 array (the Rust bankml's `nest(depth)`)."""
    return struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", U32, 0)


def tensor_info(name: str | bytes, dims: Sequence[int], type_id: int, offset: int) -> bytes:
    return (
        gstr(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", type_id, offset)
    )


def header(
    kvs: Sequence[bytes] = (),
    infos: Sequence[bytes] = (),
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    magic: bytes = b"GGUF",
    version: int = 3,
) -> bytes:
    """The header up to the end of the tensor infos; the counts default to the entries given."""
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(infos) if n_tensors is None else n_tensors
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(infos)


def gguf_bytes(
    kvs: Sequence[bytes] = (),
    tensors: Sequence[tuple[str, Sequence[int], int]] = (),
    *,
    alignment: int = 32,
    offsets: Sequence[int] | None = None,
    data_bytes: int | None = None,
) -> bytes:
    """A whole file: header, padding to `alignment`, then the data section.

    `tensors` are (name, dims, type_id); by default each is laid out at the next aligned offset with
    its gguf-py size, and the data section holds them all. `offsets` and `data_bytes` override that.
    """
    if offsets is None:
        offsets, at = [], 0
        for _, dims, type_id in tensors:
            offsets.append(at)
            at += -(-nbytes(dims, type_id) // alignment) * alignment
        data_bytes = at if data_bytes is None else data_bytes
    head = header(kvs, [tensor_info(n, d, t, o) for (n, d, t), o in zip(tensors, offsets, strict=True)])
    head += b"\0" * (-len(head) % alignment)
    return head + b"\0" * (data_bytes or 0)


# ---- well-formed files through gguf-py --------------------------------------------------------


def write_model(
    path: str | Path,
    tensors: Sequence[tuple[str, Sequence[int], int]],
    *,
    arch: str = "llama",
    name: str | None = "tiny",
    u32_keys: dict[str, int] | None = None,
    alignment: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a well-formed GGUF with GGUFWriter; `tensors` are (name, ggml dims, type_id) with random bytes.

    Dims are in ggml order (dims[0] is the row length), as the guard reports them.
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in (u32_keys or {}).items():
        w.add_uint32(key, value)
    for tname, dims, type_id in tensors:
        raw = rng.integers(0, 256, nbytes(dims, type_id), dtype=np.uint8).view(np.int8)
        # int8, not uint8, so gguf-py takes raw_shape as elements rather than converting a byte shape.
        w.add_tensor(tname, raw, raw_shape=list(reversed(dims)), raw_dtype=type_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
