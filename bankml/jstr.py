"""JSON text the Rust bankml's way: fixed key order, `": "` and `", "` separators, its string escaper.

The Rust bankml's `jstr` escapes `"`, `\\` and `\\n`, writes every other char below 0x20 as
`\\u00xx` (lowercase hex, so a tab is `\\u0009`), and leaves non-ASCII raw. Clients match substrings
of this text, so `json.dumps` (which writes `\\t`) is not close enough for strings from a header.
"""

from __future__ import annotations

from typing import Any


def jstr(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            out.append("\ufffd")  # a lone surrogate cannot be written as UTF-8
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def dumps(value: Any) -> str:
    """Serialise dicts (in insertion order), lists, strings, ints, floats, bools and None."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return jstr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return "null"
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{jstr(str(k))}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
