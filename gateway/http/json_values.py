"""Reading request values as llama-server's JSON library (nlohmann::json) reads them, with its messages.

llama-server converts a field with `get<T>()`: a number or a boolean converts to any number type (a
float is truncated toward zero, an integer wraps to the width), a bool must be a JSON boolean, a
string a JSON string; anything else is `[json.exception.type_error.302] type must be T, but is X`.
`json_value(body, key, default)` (tools/server/server-common.h) is the lenient form: an absent,
null or wrongly typed value gives the default. `dump` writes a value as nlohmann's `dump()` does
(compact, key order kept, UTF-8 as is), for messages that quote part of a request. A number literal
a float would change is read as a `RawNumber` (`exact_float`, gateway/http/body.py), so a schema's
bounds reach the grammar as the request wrote them (gateway/serving/constraints.py, `exact_json`). `nesting` measures a value's depth and size in one walk
without recursion, so a hostile body or schema is refused before anything recursive reads it.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

FLT_MAX = 3.4028234663852886e38
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT32 = (0, (1 << 32) - 1)


class RawNumber(float):
    """A JSON number literal a float would not keep exactly: its value, and its text as sent."""

    text: str

    def __new__(cls, text: str) -> RawNumber:
        self = super().__new__(cls, float(text))
        self.text = text
        return self


def exact_float(text: str) -> float:
    """A float literal as read from a body: a literal a double would change keeps its text (`RawNumber`),
    for a schema's exact bounds (gateway/serving/constraints.py)."""
    x = float(text)
    return x if repr(x) == text else RawNumber(text)


class JsonTypeError(ValueError):
    """nlohmann's type_error.302 (its message is the exception's)."""


def type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _type_error(want: str, v: Any) -> JsonTypeError:
    return JsonTypeError(f"[json.exception.type_error.302] type must be {want}, but is {type_name(v)}")


def _number(v: Any) -> int | float:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int | float):
        return v
    raise _type_error("number", v)


def _wrap(n: int, bits: int, signed: bool) -> int:
    n &= (1 << bits) - 1
    return n - (1 << bits) if signed and n >> (bits - 1) else n


def get_int(v: Any, bits: int = 32, signed: bool = True) -> int:
    """`get<int32_t>` (or int64_t, uint32_t): truncation toward zero, wrap-around as a C++ cast does."""
    n = _number(v)
    if isinstance(n, float):
        lo, hi = INT64 if bits == 64 or not signed else INT32
        if not math.isfinite(n) or not lo <= math.trunc(n) <= hi:
            return lo  # x86's "integer indefinite": what cvttsd2si gives out of range
        n = math.trunc(n)
    return _wrap(n, bits, signed)


def f32(x: float) -> float:
    """A double rounded to float, as `static_cast<float>` does (overflow gives an infinity)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def get_float(v: Any) -> float:
    """`get<float>`."""
    return f32(float(_number(v)))


def get_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _type_error("boolean", v)
    return v


def get_string(v: Any) -> str:
    if not isinstance(v, str):
        raise _type_error("string", v)
    return v


def has_value(body: Any, key: str) -> bool:
    """Present and not null (llama-server treats null as absent)."""
    return isinstance(body, dict) and body.get(key) is not None


def json_value(body: Any, key: str, default: Any, get=None) -> Any:
    """llama-server's lenient read: absent, null or a type error give `default`."""
    if not has_value(body, key):
        return default
    if get is None:
        return body[key]
    try:
        return get(body[key])
    except JsonTypeError:
        return default


def is_empty(v: Any) -> bool:
    """nlohmann's `empty()`: true for null and empty arrays and objects only (a string "" is not)."""
    return v is None or (isinstance(v, list | dict) and not v)


def dump(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def to_string(x: int | float) -> str:
    """std::to_string: integers in decimal, floats as "%f"."""
    return f"{x:f}" if isinstance(x, float) else str(x)


def nesting(value: Any, max_depth: int, max_nodes: int | None = None) -> tuple[int, int]:
    """(depth, nodes) of a JSON value: arrays and objects nested (a scalar is depth 0) and every value
    counted once (with `max_nodes`; else only the containers). Walked with an explicit stack, each value
    once; it stops as soon as either passes its bound, so the numbers then only say which one did."""
    if not isinstance(value, list | dict):
        return 0, 1
    depth = nodes = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        nodes += 1
        depth = max(depth, d)
        if depth > max_depth:
            break
        children = v.values() if isinstance(v, dict) else v
        if max_nodes is not None:
            nodes += len(v) - sum(1 for c in children if isinstance(c, list | dict))  # the scalars in it
            if nodes > max_nodes:
                break
        stack.extend((c, d + 1) for c in children if isinstance(c, list | dict))
    return depth, nodes
