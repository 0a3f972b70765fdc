"""Request bodies read as JSON, once, before any model work; every dialect's parser starts here.

- `parse_body(body)`: the body as llama-server's JSON library (nlohmann::json) reads it: NaN and
  Infinity are not JSON, nor is a lone surrogate (400, nlohmann's parse_error.101 message with its
  line and column); an integer past 64 bits is a double; a float literal a double would change keeps
  its text (`RawNumber`, gateway/http/json_values.py); arrays and objects nested deeper than
  MAX_BODY_DEPTH are a 400 (nlohmann has no bound; ours keeps every recursive reader of a body, the
  schemas', the template's, the receipt's, within Python's stack).
- `parse_json_body(body)`: plain JSON, refused as "body is not JSON" (the P0 gateway's reading).
"""

from __future__ import annotations

import json
import re
from typing import Any

from bankml.errors import InvalidRequest
from gateway.http.json_values import RawNumber, exact_float, nesting

# arrays and objects nested in a body: a tool's parameters sit 4 deep and a schema may nest 64
# (gateway/serving/constraints.py, MAX_SCHEMA_DEPTH), so a real request stays far below
MAX_BODY_DEPTH = 128


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid literal {name}")


def _nlohmann_int(text: str) -> int | float:
    # nlohmann keeps an integer literal as an integer only while it fits int64 or uint64, else as a
    # double (lexer.hpp, scan_number): `max_tokens: 1e30` and `max_tokens: 10**30` then read the same
    n = int(text)
    return n if -(1 << 63) <= n < 1 << 64 else RawNumber(text)


def parse_body(body: bytes) -> Any:
    """The body as nlohmann parses it: NaN and Infinity are not JSON, nor is a lone surrogate; an
    integer past 64 bits is a double."""
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_int=_nlohmann_int,
                           parse_float=exact_float)
    except json.JSONDecodeError as e:
        raise _parse_error(e.lineno, e.colno, e.msg) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"[json.exception.parse_error.101] parse error: {e}") from None
    _refuse_lone_surrogates(body)
    check_depth(body, value)
    return value


def check_depth(body: bytes, value: Any) -> None:
    """A 400 for a body nested deeper than MAX_BODY_DEPTH. A body with fewer brackets than that cannot
    be (one count at C speed); else one walk of its arrays and objects."""
    if body.count(b"[") + body.count(b"{") <= MAX_BODY_DEPTH:
        return
    if nesting(value, MAX_BODY_DEPTH)[0] <= MAX_BODY_DEPTH:
        return
    fields = value.items() if isinstance(value, dict) else ()
    field = next((k for k, v in fields if nesting(v, MAX_BODY_DEPTH - 1)[0] > MAX_BODY_DEPTH - 1), None)
    where = f"'{field}' nests" if field is not None else "the request body nests"
    raise InvalidRequest(f"{where} arrays and objects deeper than {MAX_BODY_DEPTH} levels in the request body "
                         "(bankml serve's bound)")


def _parse_error(line: int, column: int, why: str) -> InvalidRequest:
    # llama-server's std::invalid_argument: 400 invalid_request_error
    return InvalidRequest(f"[json.exception.parse_error.101] parse error at line {line}, column {column}: "
                          f"syntax error while parsing value - {why}")


# Python's json accepts what nlohmann's lexer refuses: a `\uD800`-style escape that is not half of a
# pair, and (reading bytes with "surrogatepass") a surrogate written as UTF-8. Such a string would
# fail later, when it is encoded for the tokenizer or a stop string. Every backslash of a valid JSON
# text is inside a string, so an escape is one that follows an even run of backslashes.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_ESCAPED_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*\\u(?:[dD][89abAB][0-9a-fA-F]{2}(?P<low>\\u[dD][c-fC-F][0-9a-fA-F]{2})?"
    rb"|(?P<lone_low>[dD][c-fC-F][0-9a-fA-F]{2}))")
_UTF8_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _refuse_lone_surrogates(body: bytes) -> None:
    """nlohmann's lexer errors (scan_string) for a string that is not valid Unicode: 400."""
    if not _MAYBE_SURROGATE.search(body):
        return  # the common case: one scan at C speed
    for m in _ESCAPED_SURROGATE.finditer(body):
        if m["lone_low"] is not None:
            why = "invalid string: surrogate U+DC00..U+DFFF must follow U+D800..U+DBFF"
        elif m["low"] is None:
            why = "invalid string: surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF"
        else:
            continue  # a pair: one code point
        raise _parse_error(*_line_column(body, m.end()), why)
    m = _UTF8_SURROGATE.search(body)
    if m is not None:
        raise _parse_error(*_line_column(body, m.end()), "invalid string: ill-formed UTF-8 byte")


def _line_column(body: bytes, end: int) -> tuple[int, int]:
    line_start = body.rfind(b"\n", 0, end) + 1
    return body.count(b"\n", 0, end) + 1, end - line_start + 1


def parse_json_body(body: bytes) -> Any:
    """Plain JSON (Python's reading, not nlohmann's): anything else is a 400 "body is not JSON"."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidRequest("body is not JSON") from None
