"""llama-server's `/tokenize` and `/detokenize` bodies, read and answered as b11434 does
(tools/server/server-context.cpp `post_tokenize` / `post_detokenize`, server-common.cpp).

`/tokenize {"content", "add_special"=false, "parse_special"=true, "with_pieces"=false}`: `content` is
a string, or an array mixing strings and token ids (`tokenize_mixed`: ids are passed through as
they are, unchecked; only the first element, if a string, gets BOS); the flags are read leniently
(a wrong type is the default). With `with_pieces` each token is `{"id", "piece"}`, its piece the
token's text with special tokens rendered, or its bytes as a list of numbers when they are not UTF-8
by llama-server's `is_valid_utf8` (a check of the byte pattern only).

`/detokenize {"tokens"}`: every token's piece (special tokens rendered), concatenated; bytes that do
not form UTF-8 become U+FFFD, as llama-server's JSON writer replaces them.

A token id outside the vocabulary is llama-server's 500: its vocabulary's `id_to_token.at(id)`
throws std::out_of_range, whose libstdc++ message ex_wrapper sends.
"""

from __future__ import annotations

from typing import Any

from bankml import jstr
from bankml.errors import InvalidRequest, RequestFailed
from gateway.http.json_values import JsonTypeError, get_bool, get_int, get_string, json_value, type_name


def _flag(body: dict, key: str, default: bool) -> bool:
    return json_value(body, key, default, get_bool)


def tokenize_body(model: Any, body: Any, pieces: bool = True) -> list[int] | list[dict]:
    """The `tokens` of llama-server's /tokenize answer for `body` (ids, or {"id", "piece"} objects;
    `pieces` False: the ids whatever `with_pieces` says). The route writes them with tokenize_json."""
    if not isinstance(body, dict) or "content" not in body:
        return []  # llama-server: no `content`, no tokens (a body that is not an object has none)
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    tokens = tokenize_mixed(model, body["content"], add_special, parse_special)
    if not (with_pieces and pieces):
        return tokens
    return [{"id": t, "piece": piece_json(piece_of(model, t))} for t in tokens]


# ours (llama-server has no bound): `with_pieces` answers ~25 bytes per token, so a 16 MiB content of
# one-byte tokens made a 371 MiB answer (and twice that in memory while it was written); 1M tokens is
# about 4 MiB of English text on SmolLM2, a 25 MiB answer. Without with_pieces the ids stay unbounded.
MAX_PIECES = 1 << 20


def tokenize_json(model: Any, body: Any) -> str:
    """llama-server's /tokenize answer as JSON text: `{"tokens": [ids]}`, or with `with_pieces` one
    `{"id", "piece"}` object per token, each distinct token's object written once and reused (a 16 MiB
    content makes millions of tokens but at most n_vocab distinct ones: without the cache, and
    written through jstr.dumps, such a body held a thread for many minutes and gigabytes)."""
    tokens = tokenize_body(model, body, pieces=False)
    if not (isinstance(body, dict) and _flag(body, "with_pieces", False)) or not tokens:
        # the Rust bankml writes the list compactly: {"tokens": [1,2,3]}
        return '{"tokens": [' + ",".join(map(str, tokens)) + "]}"
    if len(tokens) > MAX_PIECES:
        raise InvalidRequest(f"'with_pieces': the content makes {len(tokens)} tokens, more than this server writes "
                             f"pieces for (at most {MAX_PIECES}); ask without with_pieces, or in parts")
    written: dict[int, str] = {}

    def one(t: int) -> str:
        w = written.get(t)
        if w is None:
            w = written[t] = f'{{"id": {t}, "piece": {jstr.dumps(piece_json(piece_of(model, t)))}}}'
        return w

    return '{"tokens": [' + ", ".join(one(t) for t in tokens) + "]}"


def tokenize_mixed(model: Any, value: Any, add_special: bool, parse_special: bool) -> list[int]:
    """tokenize_mixed (server-common.cpp): a string, or an array of strings and ids."""
    try:
        if not isinstance(value, list):
            return model.tokenize(get_string(value), add_special, parse_special)
        out: list[int] = []
        for i, p in enumerate(value):
            if isinstance(p, str):
                out += model.tokenize(p, add_special and i == 0, parse_special)
            else:
                out.append(get_int(p))
        return out
    except JsonTypeError as e:
        raise InvalidRequest(str(e)) from None


def detokenize_body(model: Any, body: Any) -> str:
    """The `content` of llama-server's /detokenize answer for `body`."""
    if not isinstance(body, dict) or "tokens" not in body:
        return ""
    tokens = body["tokens"]
    try:
        if not isinstance(tokens, list):
            raise JsonTypeError(f"[json.exception.type_error.302] type must be array, but is {type_name(tokens)}")
        ids = [get_int(t) for t in tokens]
    except JsonTypeError as e:
        raise InvalidRequest(str(e)) from None
    pieces: dict[int, bytes] = {}  # each distinct id looked up once (1M ids are at most n_vocab pieces)
    out = bytearray()
    for t in ids:
        piece = pieces.get(t)
        if piece is None:
            piece = pieces[t] = piece_of(model, t)
        out += piece
    return out.decode("utf-8", "replace")


def piece_of(model: Any, token: int) -> bytes:
    """common_token_to_piece(vocab, token, special=true), with llama-server's 500 for an unknown id."""
    tok = model.tokenizer
    n_vocab = tok.n_vocab
    if not 0 <= token < n_vocab:
        # std::vector::at's message (libstdc++), the index as a size_t
        raise RequestFailed(f"vector::_M_range_check: __n (which is {token & 0xFFFFFFFFFFFFFFFF}) >= "
                            f"this->size() (which is {n_vocab})")
    return tok.token_to_piece(token, special=True)


def piece_json(piece: bytes) -> str | list[int]:
    """The piece as text when llama-server's is_valid_utf8 passes it, else its bytes."""
    if is_valid_utf8(piece):
        return piece.decode("utf-8", "replace")
    return list(piece)


def is_valid_utf8(data: bytes) -> bool:
    """is_valid_utf8 (server-common.cpp): lead bytes and the count of continuation bytes only, so an
    overlong form or an encoded surrogate passes (the JSON writer then replaces it)."""
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b <= 0x7F:
            size = 1
        elif b & 0xE0 == 0xC0:
            size = 2
        elif b & 0xF0 == 0xE0:
            size = 3
        elif b & 0xF8 == 0xF0:
            size = 4
        else:
            return False
        if n - i < size or any(c & 0xC0 != 0x80 for c in data[i + 1:i + size]):
            return False
        i += size
    return True
