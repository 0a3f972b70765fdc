"""Slot files: a sequence's tokens and their K/V on disk (serving.md §4.3), numpy only.

The layout, little-endian:

    b"bankML slot v1\\n"
    the model's sha256, 64 ASCII hex digits
    u64 n_ctx, u64 n_tok, u64 n_layers
    per layer: u64 width (Hkv * Dh; bit 63 set for q8_0), then K, then V, each n_tok rows of `width`:
        f16: u16 values, [n_tok, width]
        q8_0: ggml's block_q8_0 (an f16 scale d, then 32 int8 quants) per 32 values, [n_tok, width/32, 34]
    u32 tokens, n_tok of them
    the sha256 of every byte above (32 bytes)

`Slot` is what a file holds, with K/V as the pool keeps them (f16 values, or int8 quants and f16
scales); `encode` makes the bytes, `decode` checks and reads them back, refusing with the reason
(`SlotFileError`) a file that is not one, is damaged, or was written for another model, context,
shape or cache type. It is written to a temporary file beside it and renamed, so a crash never leaves
half a file under the name a restore reads.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass

import numpy as np

MAGIC = b"bankML slot v1\n"
Q8_0_FLAG = 1 << 63
QK8_0 = 32  # values per q8_0 block
CACHE_TYPES = ("f16", "q8_0")
_HEAD = len(MAGIC) + 64 + 3 * 8


class SlotFileError(ValueError):
    """A slot file that cannot be restored; the message is the reason."""


class SlotBusy(RuntimeError):
    """The slot is running a sequence: ask again once it is idle (llama-server defers the task)."""


class SlotSaveFailed(RuntimeError):
    """A save that could not be done; the message is the reason."""


@dataclass(frozen=True)
class SlotResult:
    """What a save or restore did: the tokens, the file's bytes, the time it took."""

    n_tokens: int
    n_bytes: int
    ms: float


@dataclass(frozen=True)
class Expect:
    """What a file must have been written for: this model, this context, this cache's shape."""

    model_sha256: str
    n_ctx: int
    n_layers: int
    width: int  # Hkv * Dh
    cache_type: str  # "f16" | "q8_0"
    n_vocab: int

    def max_bytes(self) -> int:
        """The largest file these can describe: a restore reads nothing bigger."""
        return _HEAD + self.n_layers * (8 + 2 * self.n_ctx * _row_bytes(self.width, self.cache_type)) \
            + 4 * self.n_ctx + 32


@dataclass(frozen=True)
class Slot:
    """A sequence's tokens and K/V: k, v [L, n_tok, width] f16, or for q8_0 the int8 quants
    [L, n_tok, width] and scales k_scale, v_scale [L, n_tok, width/32] f16."""

    tokens: np.ndarray  # [n_tok] int
    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    @property
    def cache_type(self) -> str:
        return "f16" if self.k_scale is None else "q8_0"

    @property
    def arrays(self) -> list[np.ndarray]:
        """k, v, then the scales of q8_0: in the order of KVPool.arrays."""
        return [a for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None]


def _row_bytes(width: int, cache_type: str) -> int:
    return 2 * width if cache_type == "f16" else width // QK8_0 * (2 + QK8_0)


def _blocks(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """int8 quants [n, width] and f16 scales [n, width/32] as block_q8_0 bytes [n, width/32, 34]."""
    n, width = qs.shape
    out = np.empty((n, width // QK8_0, 2 + QK8_0), np.uint8)
    out[..., :2] = np.ascontiguousarray(d, "<f2").view(np.uint8).reshape(n, -1, 2)
    out[..., 2:] = qs.reshape(n, -1, QK8_0).view(np.uint8)
    return out


def encode(slot: Slot, expect: Expect) -> bytes:
    """The file's bytes for `slot`, written for `expect`'s model and shapes."""
    n_tok = len(slot.tokens)
    parts = [MAGIC, expect.model_sha256.encode("ascii"), struct.pack("<QQQ", expect.n_ctx, n_tok, expect.n_layers)]
    q8 = slot.cache_type == "q8_0"
    for il in range(expect.n_layers):
        parts.append(struct.pack("<Q", expect.width | (Q8_0_FLAG if q8 else 0)))
        if q8:
            parts += [_blocks(slot.k[il], slot.k_scale[il]).tobytes(), _blocks(slot.v[il], slot.v_scale[il]).tobytes()]
        else:
            parts += [np.ascontiguousarray(slot.k[il], "<f2").tobytes(), np.ascontiguousarray(slot.v[il], "<f2").tobytes()]
    parts.append(np.asarray(slot.tokens, "<u4").tobytes())
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, expect: Expect) -> Slot:
    """The slot `data` holds, checked against `expect`; SlotFileError names what is wrong."""
    if len(data) < _HEAD + 32 or not data.startswith(MAGIC):
        raise SlotFileError("not a bankML slot file")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise SlotFileError("the file is damaged (its sha256 does not match)")
    at = len(MAGIC)
    if body[at:at + 64] != expect.model_sha256.encode("ascii"):
        raise SlotFileError("the file was saved from another model")
    n_ctx, n_tok, n_layers = struct.unpack_from("<QQQ", body, at + 64)
    if n_ctx != expect.n_ctx:
        raise SlotFileError(f"the file was saved with a context of {n_ctx} tokens, this server has {expect.n_ctx}")
    if n_tok >= expect.n_ctx:
        raise SlotFileError("Restored prompt does not fit in the slot context")
    if n_layers != expect.n_layers:
        raise SlotFileError(f"the file has {n_layers} layers, the model {expect.n_layers}")
    at = _HEAD
    q8 = expect.cache_type == "q8_0"
    row = _row_bytes(expect.width, expect.cache_type)
    k, v, ks, vs = [], [], [], []
    for _ in range(n_layers):
        if len(body) < at + 8:
            raise SlotFileError("the file is truncated")
        (word,) = struct.unpack_from("<Q", body, at)
        if bool(word & Q8_0_FLAG) != q8:
            raise SlotFileError(f"the file holds {'a q8_0' if word & Q8_0_FLAG else 'an f16'} cache, this "
                                f"server {expect.cache_type}")
        if word & ~Q8_0_FLAG != expect.width:
            raise SlotFileError(f"the file's K/V width is {word & ~Q8_0_FLAG}, the model's {expect.width}")
        at += 8
        size = n_tok * row
        if len(body) < at + 2 * size:
            raise SlotFileError("the file is truncated")
        for dst, scales in ((k, ks), (v, vs)):
            raw = np.frombuffer(body, np.uint8, size, at)
            at += size
            if q8:
                blocks = raw.reshape(n_tok, expect.width // QK8_0, 2 + QK8_0)
                scales.append(blocks[..., :2].copy().view("<f2").reshape(n_tok, -1).astype(np.float16))
                dst.append(blocks[..., 2:].copy().view(np.int8).reshape(n_tok, expect.width))
            else:
                dst.append(raw.view("<f2").reshape(n_tok, expect.width).astype(np.float16))
    if len(body) != at + 4 * n_tok:
        raise SlotFileError("the file is truncated" if len(body) < at + 4 * n_tok else "the file has trailing data")
    tokens = np.frombuffer(body, "<u4", n_tok, at).astype(np.int64)
    if n_tok and int(tokens.max()) >= expect.n_vocab:
        raise SlotFileError("Invalid tokens in slot save file")

    def stack(arrays, shape, dtype):
        return np.stack(arrays) if arrays else np.zeros(shape, dtype)

    empty = (0, 0, expect.width)
    return Slot(tokens, stack(k, empty, np.int8 if q8 else np.float16), stack(v, empty, np.int8 if q8 else np.float16),
                stack(ks, (0, 0, expect.width // QK8_0), np.float16) if q8 else None,
                stack(vs, (0, 0, expect.width // QK8_0), np.float16) if q8 else None)


def write(path: str | os.PathLike, data: bytes) -> None:
    """`data` to `path`, through a temporary file beside it renamed into place (a reader never sees
    half a file). Its name is short, not `path` + ".tmp": a name of 255 bytes, which the filename rule
    allows, would be too long for the file system with a suffix. Mode 0600, as mkstemp makes it: a
    slot file holds a conversation."""
    fd, tmp = tempfile.mkstemp(prefix=".bankml-slot-", suffix=".tmp", dir=os.path.dirname(os.fspath(path)) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read(path: str | os.PathLike, expect: Expect) -> bytes:
    """The bytes of the file at `path`, refused unread when it is larger than any slot file of
    `expect` could be."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > expect.max_bytes():
                raise SlotFileError(f"the file has {size} bytes, more than a slot file of this model can have")
            return f.read(size + 1)
    except FileNotFoundError:
        raise SlotFileError("the file does not exist") from None
    except IsADirectoryError:
        raise SlotFileError("the name is a directory") from None
    except PermissionError:
        raise SlotFileError("the file cannot be read (permission denied)") from None
