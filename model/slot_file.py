"""Slot files: a sequence's tokens and their K/V on disk (serving.md §4.3), numpy only.

The layout, little-endian:

    b"bankML slot v2\\n"
    the model's sha256, 64 ASCII hex digits
    u64 n_ctx, u64 n_tok, u64 n_layers
    per layer: u64 width (Hkv * Dh; bit 63 set for q8_0), then K, then V, each n_tok rows of `width`:
        f16: u16 values, [n_tok, width]
        q8_0: ggml's block_q8_0 (an f16 scale d, then 32 int8 quants) per 32 values, [n_tok, width/32, 34]
    u32 tokens, n_tok of them
    HMAC-SHA256 of every byte above (32 bytes), keyed by `mac_key(the server's receipt key)`

The MAC is why a restore may put the file's K/V in the prefix cache every client reads: a file only
this server's key could have sealed holds K/V this server computed for those tokens of this model. A
file anyone else wrote or changed (a sha256 can be recomputed by anyone; v1 files had only that) would
otherwise answer another client's identical prompt from forged pages. `decode` checks the MAC before
it reads anything else, so such a file restores nothing.

`Slot` is what a file holds, with K/V as the pool keeps them (f16 values, or int8 quants and f16
scales); `encode` makes the bytes, `decode` checks and reads them back, refusing with the reason
(`SlotFileError`) a file that is not one, is damaged or forged, or was written for another model,
context, shape or cache type. `read` and `write` are the file system's side, for a worker thread
(never the engine thread, never the event loop): `read` opens the name inside the slot directory
without following a link and without blocking (a FIFO planted there is refused, not waited on),
takes a regular file only, and reads no more than a slot file of this model can have; `write` goes
through a temporary file beside the name, renamed over it, so a crash never leaves half a file under
the name a restore reads. Their reasons name no path: the caller adds the name its client gave.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import struct
import tempfile
from dataclasses import dataclass

import numpy as np

MAGIC = b"bankML slot v2\n"
OLD_MAGICS = (b"bankML slot v1\n",)  # sealed by a sha256 alone: anyone could have written one
Q8_0_FLAG = 1 << 63
QK8_0 = 32  # values per q8_0 block
CACHE_TYPES = ("f16", "q8_0")
MAC_BYTES = 32
MAC_LABEL = b"bankml slot file v2"
_HEAD = len(MAGIC) + 64 + 3 * 8


class SlotFileError(ValueError):
    """A slot file that cannot be restored; the message is the reason (no path in it)."""


class SlotBusy(RuntimeError):
    """The slot is running a sequence: ask again once it is idle (llama-server defers the task)."""


class SlotSaveFailed(RuntimeError):
    """A save that could not be done; the message is the reason (no path in it)."""


def mac_key(secret: bytes) -> bytes:
    """The key slot files are sealed with, derived from a secret only this server holds (the raw bytes
    of its receipt key): HMAC-SHA256(secret, MAC_LABEL), so the receipt key itself never keys a MAC."""
    return hmac.new(secret, MAC_LABEL, hashlib.sha256).digest()


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
        """The largest file these can describe (n_tok < n_ctx): a restore reads nothing bigger."""
        return _HEAD + self.n_layers * (8 + 2 * self.n_ctx * _row_bytes(self.width, self.cache_type)) \
            + 4 * self.n_ctx + MAC_BYTES


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


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def encode(slot: Slot, expect: Expect, key: bytes) -> bytes:
    """The file's bytes for `slot`, written for `expect`'s model and shapes, sealed with `key` (`mac_key`)."""
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
    return body + _mac(key, body)


def decode(data: bytes, expect: Expect, key: bytes) -> Slot:
    """The slot `data` holds, checked against `expect`; SlotFileError names what is wrong. The MAC is
    checked first: nothing of a file this server did not seal is read."""
    if data.startswith(OLD_MAGICS):
        raise SlotFileError("the file is an unauthenticated slot file of an older bankML (v1); save the slot again")
    if len(data) < _HEAD + MAC_BYTES or not data.startswith(MAGIC):
        raise SlotFileError("not a bankML slot file")
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(_mac(key, body), mac):
        raise SlotFileError("the file is damaged, or was not saved by this server (its MAC does not match)")
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


# --- the file system (a worker thread's) ---------------------------------------------------------


def write(directory: str | os.PathLike, name: str, data: bytes) -> None:
    """`data` to the file `name` in `directory`, through a temporary file beside it renamed into place
    (a reader never sees half a file; a link or FIFO planted under the name is replaced, never followed
    or opened). The temporary name is short, not `name` + ".tmp": a name of 255 bytes, which the
    filename rule allows, would be too long for the file system with a suffix. Mode 0600, as mkstemp
    makes it: a slot file holds a conversation. SlotSaveFailed says why it could not be written."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".bankml-slot-", suffix=".tmp", dir=directory)
    except OSError as e:
        raise SlotSaveFailed(f"the slot directory cannot be written ({_why(e)})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, IsADirectoryError):
            raise SlotSaveFailed("the name is a directory") from None
        if isinstance(e, OSError):
            raise SlotSaveFailed(f"the file cannot be written ({_why(e)})") from None
        raise


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_OPEN_REASONS = {
    errno.ENOENT: "the file does not exist",
    errno.ELOOP: "the name is a symbolic link (slot files are regular files)",
    errno.EACCES: "the file cannot be read (permission denied)",
    errno.EPERM: "the file cannot be read (permission denied)",
    errno.ENXIO: "not a regular file",  # a socket
    errno.ENAMETOOLONG: "the name is too long for the file system",
}


def read(directory: str | os.PathLike, name: str, max_bytes: int) -> bytes:
    """The bytes of the file `name` in `directory`: a regular file, not a link, opened without blocking
    (a FIFO would otherwise wait for a writer), refused unread when it has more than `max_bytes`.
    SlotFileError says why it cannot be."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise SlotFileError(f"the slot directory cannot be read ({_why(e)})") from None
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise SlotFileError(_OPEN_REASONS.get(e.errno, f"the file cannot be opened ({_why(e)})")) from None
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SlotFileError("the name is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise SlotFileError("not a regular file")
        if info.st_size > max_bytes:
            raise SlotFileError(f"the file has {info.st_size} bytes, more than a slot file of this model can have")
        chunks, n = [], 0
        while n <= max_bytes:  # the size again: the file may grow while it is read
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > max_bytes:
            raise SlotFileError("the file grew past the size of a slot file of this model while it was read")
        return b"".join(chunks)
    except OSError as e:
        raise SlotFileError(f"the file cannot be read ({_why(e)})") from None
    finally:
        os.close(fd)


def _why(e: OSError) -> str:
    """The system's reason without the path an OSError's str() carries."""
    return e.strerror or errno.errorcode.get(e.errno or 0, "unknown error")
