"""GGUF key/values for the tokenizer, as plain Python values.

`gguf_fields` turns what the loader has (gguf-py's `GGUFReader`, its `.fields`, a dict of decoded
values, or a path) into `dict[str, value]`: scalars as int/float/bool/str, string arrays as
`list[str]`, numeric arrays as numpy arrays. From a path it reads only the key/value section, which
takes a fraction of a second where `GGUFReader` spends tens of seconds building a numpy view per
element of a 262k-entry vocabulary. The guard (bankml/guard.py) has already judged the header by the
time this runs; the reader still refuses a value that runs past the end of the file.

Strings are decoded with `surrogateescape`, so a token that is not valid UTF-8 keeps its bytes.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFReadError(ValueError):
    """The key/value section cannot be read; the message says where."""


def gguf_fields(source: Any, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, Any]:
    """Decoded key/values whose names start with one of `prefixes` (all keys if `prefixes` is empty).

    `source` is a path, a `GGUFReader`, a `GGUFReader.fields` mapping of `ReaderField`s, or a mapping of
    already-decoded values (returned filtered, unchanged).
    """
    if isinstance(source, str | os.PathLike):
        return read_kv(source, prefixes)
    fields = getattr(source, "fields", source)
    if not isinstance(fields, Mapping):
        raise TypeError(f"cannot read GGUF fields from {type(source).__name__}")
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if prefixes and not name.startswith(prefixes):
            continue
        out[name] = _decode_reader_field(value) if hasattr(value, "parts") and hasattr(value, "types") else value
    return out


def _decode_reader_field(field: Any) -> Any:
    """One gguf-py ReaderField, decoded without `contents()`'s per-element Python objects."""
    types = list(field.types)
    if types[0] != _ARRAY:
        return field.contents()
    if len(types) < 2:  # an empty array carries no element type in gguf-py
        return []
    if types[1] == _STRING:
        return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
    if types[1] in _NUMPY_DTYPE and field.data:
        arr = np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])
        return arr.astype(bool) if types[1] == 7 else arr
    return field.contents()


def read_kv(path: str | os.PathLike, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, Any]:
    """Read a GGUF file's key/value section (v2 or v3, little-endian) without touching its tensors."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        try:
            return _KVReader(memoryview(mm)).read(prefixes)
        except GGUFReadError as e:  # raised outside: its traceback's frames hold views of the mmap
            error = GGUFReadError(*e.args)
    raise error


class _KVReader:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.o = 0

    def _take(self, n: int) -> int:
        start = self.o
        if n < 0 or start + n > len(self.buf):
            raise GGUFReadError(f"gguf value at byte {start} runs past the end of the file")
        self.o = start + n
        return start

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self._take(size))[0]

    def _string(self) -> str:
        n = self._unpack("<Q")
        start = self._take(n)
        return str(self.buf[start : start + n], "utf-8", "surrogateescape")

    def read(self, prefixes: tuple[str, ...]) -> dict[str, Any]:
        if bytes(self.buf[:4]) != b"GGUF":
            raise GGUFReadError("not a GGUF file (bad magic)")
        self._take(4)
        version = self._unpack("<I")
        if version not in (2, 3):
            raise GGUFReadError(f"unsupported GGUF version {version}")
        self._unpack("<Q")  # tensor count
        n_kv = self._unpack("<Q")
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            name = self._string()
            wanted = not prefixes or name.startswith(prefixes)
            t = self._unpack("<I")
            if not wanted and t == _ARRAY and self._skip_strings():
                continue
            value = self._value(t)
            if wanted:
                out[name] = value
        return out

    def _skip_strings(self) -> bool:
        """Step over an array of strings no one asked for (a vocabulary, its merges) without decoding it;
        False, with nothing read, when the array holds something else."""
        start = self.o
        elem, n = self._unpack("<I"), self._unpack("<Q")
        if elem != _STRING:
            self.o = start
            return False
        buf, o, end, unpack = self.buf, self.o, len(self.buf), struct.Struct("<Q").unpack_from
        for _ in range(n):
            if o + 8 > end:
                raise GGUFReadError(f"gguf string at byte {o} runs past the end of the file")
            (length,) = unpack(buf, o)
            o += 8 + length
            if o > end:
                raise GGUFReadError(f"gguf string at byte {o - length} runs past the end of the file")
        self.o = o
        return True

    def _value(self, t: int) -> Any:
        if t in _SCALAR_FMT:
            return self._unpack(_SCALAR_FMT[t])
        if t == _STRING:
            return self._string()
        if t == _ARRAY:
            elem, n = self._unpack("<I"), self._unpack("<Q")
            if elem in _NUMPY_DTYPE:
                dtype = np.dtype(_NUMPY_DTYPE[elem])
                start = self._take(n * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=start).copy()
                return arr.astype(bool) if elem == 7 else arr
            if elem == _STRING:
                return self._strings(n)
            return [self._value(elem) for _ in range(n)]
        raise GGUFReadError(f"unknown gguf value type {t}")

    def _strings(self, n: int) -> list[str]:
        # The hot loop of a vocabulary: locals only.
        buf, o, end, unpack = self.buf, self.o, len(self.buf), struct.Struct("<Q").unpack_from
        out = []
        for _ in range(n):
            if o + 8 > end:
                raise GGUFReadError(f"gguf string at byte {o} runs past the end of the file")
            (length,) = unpack(buf, o)
            o += 8
            if o + length > end:
                raise GGUFReadError(f"gguf string at byte {o} runs past the end of the file")
            out.append(str(buf[o : o + length], "utf-8", "surrogateescape"))
            o += length
        self.o = o
        return out
