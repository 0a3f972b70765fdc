"""The guard: a bounded GGUF header parser that says play, refuse (with reasons) or need_more.

It runs before anything else touches a model file (README, "The gate"): `guard_file` reads a
32 MiB prefix and `judge` parses it with no other library, so a hostile header is refused here, not
inside gguf-py or the engine. The rules are the Rust bankml's (its `gguf.rs`, 0.4.2, whose
reason texts are kept byte for byte) followed by ours: every tensor's data is sized from its block
layout and must lie inside the file, aligned, without overlapping another's; names are unique; every
count and length is checked against a bound and against the bytes the file can hold before anything is
built from it; and no size computation may leave u64.

Never raises on any byte input. Parsing is iterative (arrays nest through an explicit stack that
refuses at depth 64), so a 2,000,000-deep file is refused in microseconds.

Rule set: only mainline exists here (the Bonsai/prism rules are out of scope). `rule_set` is kept in
the Rust bankml's signatures, but every file is judged as mainline and every report says so; the CLI and
the config refuse any other rule set by name before the guard runs.
"""

from __future__ import annotations

import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field

from bankml import jstr
from bankml.gguf_types import BLOCK_LAYOUT, FORK_ONLY, MAINLINE_COUNT, type_name

U64_MAX = (1 << 64) - 1
_I128_MIN, _I128_MAX = -(1 << 127), (1 << 127) - 1
_U128_MAX = (1 << 128) - 1

PREFIX_BYTES = 32 << 20  # guard_file's first read: the header of any real model fits in it
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 64

# Our bounds, beyond the Rust bankml's rules. Real headers are far inside them: a 262k-token vocabulary with its
# scores and merges is under 20 MiB, n_kv is tens, n_tensors a few thousand.
MAX_HEADER_BYTES = 256 << 20
MAX_KEY_BYTES = 65535
MAX_STRING_BYTES = 64 << 20
MAX_KV_COUNT = 1 << 16
MAX_TENSOR_COUNT = 1 << 18
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the NUL; gguf.cpp refuses longer names
MAX_DIMS = 4  # GGML_MAX_DIMS

# The smallest encodings, to check a claimed count against the bytes the file has left.
_MIN_KV_BYTES = 13  # key length (8) + value type (4) + a one-byte value
_MIN_TENSOR_INFO_BYTES = 24  # name length (8) + n_dims (4) + type (4) + offset (8)
_MIN_STRING_BYTES = 8
_MIN_ARRAY_BYTES = 12  # element type (4) + count (8)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")  # element type, count
# Scalar value types: (struct, is_bool). GGUF's value types 0-7 and 10-12 (gguf-py's GGUFValueType).
_SCALARS: dict[int, tuple[struct.Struct, bool]] = {
    0: (struct.Struct("<B"), False),
    1: (struct.Struct("<b"), False),
    2: (struct.Struct("<H"), False),
    3: (struct.Struct("<h"), False),
    4: (_U32, False),
    5: (struct.Struct("<i"), False),
    6: (struct.Struct("<f"), False),
    7: (struct.Struct("<B"), True),
    10: (_U64, False),
    11: (struct.Struct("<q"), False),
    12: (struct.Struct("<d"), False),
}
_SCALAR_BYTES = {t: s.size for t, (s, _) in _SCALARS.items()}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: skipped, not decoded; only its count is kept, as the Rust bankml does."""

    count: int
    elem_type: int

    def __str__(self) -> str:
        return f"<array {self.count}>"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    type_id: int
    offset: int  # relative to the data section

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def n_bytes(self) -> int | None:
        """Bytes of data, or None when the type has no layout, rows are not whole blocks, or u64 overflows."""
        layout = BLOCK_LAYOUT.get(self.type_id)
        if layout is None:
            return None
        per_block, block_bytes = layout
        row = self.dims[0] if self.dims else 1
        n = self.n_elements
        if row % per_block or n > U64_MAX:
            return None
        size = n // per_block * block_bytes
        return size if size <= U64_MAX else None


@dataclass(frozen=True)
class Report:
    verdict: str  # "play" | "refuse" | "need_more"
    bytes_needed: int | None = None  # need_more only
    gguf_version: int = 0
    arch: str | None = None
    name: str | None = None
    tensors: int = 0
    types: dict[str, int] = field(default_factory=dict)  # name -> count, in type-id order
    rule_set: str = "mainline"
    reasons: list[str] = field(default_factory=list)
    kv_f16_bytes_per_token: int | None = None
    # Parsed facts for later steps (None/empty unless the header parsed).
    alignment: int | None = None
    header_bytes: int | None = None  # where the tensor infos end
    data_start: int | None = None
    file_size: int | None = None
    tensor_infos: tuple[TensorInfo, ...] = ()
    metadata: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The report object of `guard --json`, keys in the Rust bankml's order (its clients match them)."""
        if self.verdict == "need_more":
            return {"verdict": "need_more", "bytes_needed": self.bytes_needed}
        out: dict[str, object] = {
            "gguf_version": self.gguf_version,
            "arch": self.arch,
            "name": self.name,
            "tensors": self.tensors,
            "types": dict(self.types),
            "engine": self.rule_set,  # the Rust bankml's key for the rule set
            "reasons": list(self.reasons),
        }
        if self.kv_f16_bytes_per_token is not None:
            out["kv_f16_bytes_per_token"] = self.kv_f16_bytes_per_token
        out["verdict"] = self.verdict
        return out

    def to_json(self) -> str:
        return jstr.dumps(self.as_dict())

    def to_text(self) -> str:
        """The CLI's text: `<verdict> <Name:count …>`, then `  - <reason>` per reason (no final newline)."""
        lines = [f"{self.verdict} " + " ".join(f"{n}:{c}" for n, c in self.types.items())]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


class _NeedMore(Exception):
    def __init__(self, n: int):
        super().__init__(n)
        self.n = min(n, U64_MAX)  # the Rust bankml's checked_add clamps to u64::MAX


class _Refuse(Exception):
    pass


class _Reader:
    """Little-endian reads off a buffer; reading past its end raises _NeedMore(end)."""

    def __init__(self, buf: memoryview, file_size: int | None):
        self.buf = buf
        self.end = len(buf)
        self.o = 0
        self.file_size = file_size

    def take(self, n: int) -> int:
        start, stop = self.o, self.o + n
        if stop > self.end:
            raise _NeedMore(stop)
        self.o = stop
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def array_head(self) -> tuple[int, int]:
        if self.o + 12 > self.end:
            return self.u32(), self.u64()  # need_more names the field that is cut, as the Rust bankml
        return _ARRAY_HEAD.unpack_from(self.buf, self.take(12))

    def fits(self, need: int) -> None:
        # A claimed count whose smallest encoding already runs past the file is a truncated file:
        # say so now instead of walking it (or, without a file size, let the buffer's end stop the walk).
        if self.file_size is not None and need > self.file_size:
            raise _NeedMore(need)

    def string(self, limit: int, what: str) -> str:
        n = self.u64()
        if n > limit:
            raise _Refuse(f"gguf {what} of {n} bytes is longer than the {limit}-byte bound")
        start = self.take(n)
        return str(self.buf[start : start + n], "utf-8", "replace")  # lossy, as from_utf8_lossy

    def value(self, t: int) -> object:
        scalar = _SCALARS.get(t)
        if scalar is not None:
            st, is_bool = scalar
            v = st.unpack_from(self.buf, self.take(st.size))[0]
            return v != 0 if is_bool else v
        if t == _STRING:
            return self.string(MAX_STRING_BYTES, "string")
        if t == _ARRAY:
            return self.array()
        raise _Refuse(f"unknown gguf value type {t}")

    def array(self) -> GGUFArray:
        """Walk an array (top level is depth 0) with an explicit stack; only its count is kept."""
        elem_type, n = self.array_head()
        result = GGUFArray(n, elem_type)
        pending: list[int] = []  # per open array-of-arrays: elements not yet started
        while True:
            if elem_type == _ARRAY and len(pending) >= MAX_ARRAY_DEPTH:
                raise _Refuse(f"gguf arrays nested deeper than {MAX_ARRAY_DEPTH}")
            size = _SCALAR_BYTES.get(elem_type)
            if size is not None:
                self.take(min(n * size, U64_MAX))  # skipped, not decoded; saturating as the Rust bankml
            elif n:
                if elem_type == _STRING:
                    self.skip_strings(n)
                elif elem_type == _ARRAY:
                    self.fits(self.o + n * _MIN_ARRAY_BYTES)
                    pending.append(n)
                else:
                    raise _Refuse(f"unknown gguf value type {elem_type}")
            while pending and pending[-1] == 0:
                pending.pop()
            if not pending:
                return result
            pending[-1] -= 1
            elem_type, n = self.array_head()

    def skip_strings(self, n: int) -> None:
        # The hot loop of a real header (a vocabulary, its merges): locals and unpack_from only.
        self.fits(self.o + n * _MIN_STRING_BYTES)
        buf, end, o, unpack = self.buf, self.end, self.o, _U64.unpack_from
        for _ in range(n):
            if o + 8 > end:
                raise _NeedMore(o + 8)
            (length,) = unpack(buf, o)
            if length > MAX_STRING_BYTES:
                raise _Refuse(
                    f"gguf string of {length} bytes is longer than the {MAX_STRING_BYTES}-byte bound"
                )
            o += 8 + length
            if o > end:
                raise _NeedMore(o)
        self.o = o


@dataclass(frozen=True)
class _Header:
    version: int
    kv: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    header_bytes: int
    data_start: int


def _parse(buf: memoryview, file_size: int | None) -> _Header:
    r = _Reader(buf, file_size)
    start = r.take(4)
    if bytes(buf[start : start + 4]) != b"GGUF":
        raise _Refuse("not a GGUF file")
    version, n_tensors, n_kv = r.u32(), r.u64(), r.u64()
    if n_kv > MAX_KV_COUNT:
        raise _Refuse(f"gguf header claims {n_kv} metadata keys, over the bound of {MAX_KV_COUNT}")
    if n_tensors > MAX_TENSOR_COUNT:
        raise _Refuse(f"gguf header claims {n_tensors} tensors, over the bound of {MAX_TENSOR_COUNT}")
    r.fits(r.o + n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES)

    kv: dict[str, object] = {}
    for _ in range(n_kv):
        key = r.string(MAX_KEY_BYTES, "key")
        kv[key] = r.value(r.u32())  # a duplicate key: the last one wins

    tensors = []
    for _ in range(n_tensors):
        name = r.string(MAX_TENSOR_NAME_BYTES, "tensor name")
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise _Refuse(f"tensor {_shown(name)} has {n_dims} dims; ggml allows at most {MAX_DIMS}")
        dims = tuple(r.u64() for _ in range(n_dims))
        tensors.append(TensorInfo(name, dims, r.u32(), r.u64()))

    alignment = _alignment(kv)
    data_start = min(-(-r.o // alignment) * alignment, U64_MAX)
    return _Header(version, kv, tuple(tensors), alignment, r.o, data_start)


_ABSENT = object()


def _alignment(kv: dict[str, object]) -> int:
    v = kv.get("general.alignment", _ABSENT)
    if v is _ABSENT:
        return DEFAULT_ALIGNMENT
    if isinstance(v, float) and v >= 1:
        return U64_MAX if math.isinf(v) else min(int(v), U64_MAX)  # Rust's saturating `as u64`
    if isinstance(v, int) and 1 <= v <= U64_MAX:  # bool counts as int
        return int(v)
    raise _Refuse(f"general.alignment {v} is not a positive integer")


def _as_int(v: object) -> int | None:
    return int(v) if isinstance(v, int) else None  # bool counts as int


def _i128(x: int) -> int:
    if not _I128_MIN <= x <= _I128_MAX:
        raise OverflowError
    return x


def _kv_bytes_per_token(kv: dict[str, object]) -> tuple[int | None, str | None]:
    """f16 KV-cache bytes per token, with Rust's i128 checked arithmetic: (value, overflow reason)."""
    arch = kv.get("general.architecture", _ABSENT)
    a = "None" if arch is _ABSENT else str(arch)

    def get(key: str) -> object:
        return kv.get(f"{a}.{key}", _ABSENT)

    n_layers, n_kv_heads = _as_int(get("block_count")), _as_int(get("attention.head_count_kv"))
    key_len, value_len = get("attention.key_length"), _as_int(get("attention.value_length"))
    k: int | None
    if key_len is _ABSENT:
        k = None
        embd, n_heads = _as_int(get("embedding_length")), _as_int(get("attention.head_count"))
        if embd is not None and n_heads:
            k = value_len = embd // n_heads
    else:
        k = _as_int(key_len)
    if n_layers is None or n_kv_heads is None or k is None:
        return None, None
    try:
        per_head = _i128(k + (value_len if value_len is not None else k))
        return _i128(_i128(_i128(n_layers * n_kv_heads) * per_head) * 2), None
    except OverflowError:
        return None, (
            f"KV cache size per token overflows ({a}.block_count × head_count_kv × key/value length):"
            " malformed header"
        )


def _shown(name: str) -> str:
    """A header string inside a reason: control characters escaped, so a reason stays one line."""
    return name.translate(_CONTROL_ESCAPES)


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F]}


def _in_all(first: str, n: int, unit: str = "tensors") -> str:
    return first if n == 1 else f"{first} ({n} {unit} in all)"


def _layout_reasons(h: _Header, file_size: int | None, short_q2: set[int]) -> list[str]:
    """Our rules, beyond the Rust bankml's: sized, whole blocks, aligned, inside the file, no overlap, no overflow.

    One reason per rule, naming the first offender and the count, so a hostile header with a
    million bad tensors still gives a short answer.
    """
    why: list[str] = []
    dups = [n for n, c in Counter(t.name for t in h.tensors).items() if c > 1]
    if dups:
        why.append(_in_all(f"duplicate tensor name {_shown(dups[0])}", len(dups), "duplicated names"))
    if h.alignment & (h.alignment - 1):
        why.append(f"general.alignment {h.alignment} is not a power of two; ggml refuses it")

    no_layout: list[str] = []
    partial: list[str] = []
    overflow: list[str] = []
    misaligned: list[str] = []
    outside: list[str] = []
    spans: list[tuple[int, int, str]] = []
    for i, t in enumerate(h.tensors):
        if t.offset % h.alignment:
            misaligned.append(
                f"tensor {_shown(t.name)}: offset {t.offset} is not a multiple of the alignment {h.alignment}"
            )
        if t.type_id >= MAINLINE_COUNT or i in short_q2:
            continue  # already refused by the Rust bankml's rules
        layout = BLOCK_LAYOUT.get(t.type_id)
        if layout is None:
            no_layout.append(
                f"tensor {_shown(t.name)}: type {t.type_id} has no known block layout, so its size cannot be checked"
            )
            continue
        per_block = layout[0]
        row = t.dims[0] if t.dims else 1
        if row % per_block:
            partial.append(
                f"tensor {_shown(t.name)}: a row of {row} elements is not a whole number of {per_block}-element"
                f" {t.type_name} blocks"
            )
            continue
        n_bytes = t.n_bytes
        start = h.data_start + t.offset
        if n_bytes is None or start + n_bytes > U64_MAX:
            overflow.append(f"tensor {_shown(t.name)}: size or offset overflows u64")
            continue
        if file_size is not None and start + n_bytes > file_size:
            outside.append(
                f"tensor {_shown(t.name)}: data at bytes {start}..{start + n_bytes} runs past the end of the"
                f" {file_size}-byte file"
            )
        if n_bytes:
            spans.append((start, start + n_bytes, _shown(t.name)))

    for found in (no_layout, partial, overflow, misaligned, outside):
        if found:
            why.append(_in_all(found[0], len(found)))

    overlaps: list[str] = []
    spans.sort()
    reach, reach_name = -1, ""
    for start, end, name in spans:
        if start < reach:
            overlaps.append(f"tensors {reach_name} and {name} overlap in the data section")
        if end > reach:
            reach, reach_name = end, name
    if overlaps:
        why.append(_in_all(overlaps[0], len(overlaps), "overlaps"))
    return why


def _short_q2_0(h: _Header, file_size: int | None) -> set[int]:
    """Indices of type-42 tensors whose span is below the group-64 size."""
    order = sorted(range(len(h.tensors)), key=lambda i: h.tensors[i].offset)  # stable, as Rust's sort_by_key
    short = set()
    for pos, i in enumerate(order):
        t = h.tensors[i]
        if pos + 1 < len(order):
            end = h.tensors[order[pos + 1]].offset
        elif file_size is not None:
            end = file_size - h.data_start
        else:
            continue
        if t.type_id == 42 and end - t.offset < min(t.n_elements, _U128_MAX) // 64 * 18:
            short.add(i)
    return short


def judge(
    buf: bytes | bytearray | memoryview,
    rule_set: str = "mainline",
    file_size: int | None = None,
    filename: str | None = None,
) -> Report:
    """Judge a header prefix without I/O, as the Rust bankml's `judge(b, engine, file_size, filename)`.

    `rule_set` and `filename` feed only the prism/Bonsai rules, which are out of scope: every call is
    judged as mainline.
    """
    del rule_set, filename
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.format != "B" or not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    if file_size is not None:
        file_size = max(file_size, len(mv))
    try:
        h = _parse(mv, file_size)
    except _NeedMore as e:
        if file_size is not None and MAX_HEADER_BYTES < e.n <= file_size:
            return Report("refuse", reasons=[_header_too_large(e.n)])
        return Report("need_more", bytes_needed=e.n)
    except _Refuse as e:
        return Report("refuse", reasons=[str(e)])

    ids = Counter(t.type_id for t in h.tensors)
    arch, name = h.kv.get("general.architecture"), h.kv.get("general.name")
    why: list[str] = []
    kv_bytes, overflow = _kv_bytes_per_token(h.kv)
    if overflow:
        why.append(overflow)
    unknown = sorted(t for t in ids if t >= MAINLINE_COUNT and t not in FORK_ONLY)
    if unknown:
        why.append(f"type ids {unknown} unknown to every build this guard knows")
    if any(t in FORK_ONLY for t in ids):
        why.append("PQ2_0/PTQ1_0 are PrismML-fork types; mainline and llama.rn refuse them")
    short = _short_q2_0(h, file_size)
    if short:
        why.append(
            f"{len(short)} Q2_0 tensors smaller than group-64 layout: legacy group-128 Prism file,"
            " use *-Q2_0_g64.gguf or *-PQ2_0.gguf"
        )
    if h.header_bytes > MAX_HEADER_BYTES:
        why.append(_header_too_large(h.header_bytes))
    why += _layout_reasons(h, file_size, short)

    return Report(
        "refuse" if why else "play",
        gguf_version=h.version,
        arch=None if arch is None else str(arch),
        name=None if name is None else str(name),
        tensors=len(h.tensors),
        types={type_name(t): ids[t] for t in sorted(ids)},
        reasons=why,
        kv_f16_bytes_per_token=kv_bytes,
        alignment=h.alignment,
        header_bytes=h.header_bytes,
        data_start=h.data_start,
        file_size=file_size,
        tensor_infos=h.tensors,
        metadata=h.kv,
    )


def _header_too_large(n: int) -> str:
    return f"gguf header needs {n} bytes, over the {MAX_HEADER_BYTES}-byte bound"


def guard_file(path: str | os.PathLike, rule_set: str = "mainline") -> Report:
    """Guard a file: judge a 32 MiB prefix, reading more (up to the file's size) on need_more.

    need_more survives only for a truncated file. Raises OSError; the caller says `cannot read …`.
    """
    size = os.stat(path).st_size
    filename = os.path.basename(os.fspath(path))
    want = min(PREFIX_BYTES, size)
    buf = b""
    with open(path, "rb") as f:
        while True:
            if len(buf) < want:
                buf += f.read(want - len(buf))
            report = judge(buf, rule_set, max(size, len(buf)), filename)
            n = report.bytes_needed
            if report.verdict != "need_more" or not want < n <= size:
                return report
            # n is within the header bound here (judge refuses past it), so doubling stops there too.
            want = min(size, max(n, min(2 * want, MAX_HEADER_BYTES)))
