"""llama-server's `tokenize_input_prompts(vocab, mctx, prompt, add_special=true, parse_special=true)`
(tools/server/server-common.cpp, b11434): the one reader of a request's prompts, for /completion,
/v1/completions (field "prompt") and the embedding routes (field "input"), as b11434 uses the one
function for both (recorded: tests/fixtures/completions_smollm2.json and embeddings_smollm2.json).

One prompt is a string, a list of ids, a list mixing both (BOS only before a first string element,
`tokenize_mixed`) or an object (`_object_text`); any other list is a list of prompts. The ids are not
checked here: the routes check them against the vocabulary, as llama-server does when its task starts.
A float or a boolean is not an id (nlohmann's is_number_integer). `limit`: the tokenizer stops once a
string is sure to make more tokens (TokenLimitExceeded), so a 16 MiB prompt costs no more than a long one.
"""

from __future__ import annotations

from typing import Any

from bankml.errors import InvalidRequest
from gateway.http.json_values import type_name

ELEMENTS = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, or a '
            'list of mixed strings & tokens.')


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def all_ints(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(e) for e in v)


def mixed(v: Any) -> bool:
    """json_is_array_of_mixed_numbers_strings: a list of ids and strings, with at least one of each."""
    return (isinstance(v, list) and all(_is_int(e) or isinstance(e, str) for e in v)
            and any(_is_int(e) for e in v) and any(isinstance(e, str) for e in v))


def is_prompt_list(v: Any) -> bool:
    """Whether `v` is a list of prompts (not one prompt of ids, or of ids and strings)."""
    return isinstance(v, list) and not mixed(v) and not all_ints(v)


def prompt_count(v: Any) -> int:
    """How many prompts `tokenize_input_prompts` makes of `v`, counted on the JSON alone."""
    return len(v) if is_prompt_list(v) and v else 1


def tokenize_input_prompts(model: Any, value: Any, field: str, limit: int | None = None) -> list[list[int]]:
    """The prompts' tokens (one list per prompt); `field` names the request's field in the empty list's 400."""
    if isinstance(value, list) and not value:
        raise InvalidRequest(f'"{field}" must not be empty')
    if is_prompt_list(value):
        return [_one(model, p, limit) for p in value]
    return [_one(model, value, limit)]


def _one(model: Any, p: Any, limit: int | None) -> list[int]:
    if isinstance(p, str) or mixed(p):
        return _tokenize_mixed(model, p, limit)
    if all_ints(p):
        return list(p)
    if isinstance(p, dict):
        return _tokenize_mixed(model, _object_text(p), limit)
    raise InvalidRequest(ELEMENTS)


def _tokenize_mixed(model: Any, v: Any, limit: int | None) -> list[int]:
    bound = {"limit": limit} if limit is not None else {}
    if isinstance(v, str):
        return model.tokenize(v, True, True, **bound)
    out: list[int] = []
    for i, e in enumerate(v):
        out += model.tokenize(e, i == 0, True, **bound) if isinstance(e, str) else [e]
    return out


MEDIA = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}


def media_refused(kind: str) -> InvalidRequest:
    """A media part on a text-only model: llama-server's words, as a 400 (b11434 answered 500, a server
    fault, for what is the request's; its own tests now want 400)."""
    return InvalidRequest(f"{MEDIA[kind]} input is not supported - hint: if this is unexpected, you may need to "
                          "provide the mmproj")


def _type_error(expected: str, v: Any) -> InvalidRequest:
    return InvalidRequest(f"[json.exception.type_error.302] type must be {expected}, but is {type_name(v)}")


def _object_text(value: dict) -> str:
    """A prompt given as an object (b11434, recorded): `prompt_string` (with `multimodal_data` the refusal
    of a text-only model), else `content` as OpenAI's parts, whose texts are joined."""
    if "prompt_string" in value:
        text = value["prompt_string"]
        if not isinstance(text, str):
            raise _type_error("string", text)
        if "multimodal_data" in value:
            raise InvalidRequest("Multimodal data provided, but model does not support multimodal requests.")
        return text
    if "content" not in value:
        raise InvalidRequest(ELEMENTS)
    parts = value["content"]
    if not isinstance(parts, list):
        raise InvalidRequest('"content" must be an array')
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            texts.append(text if isinstance(text, str) else "")  # a text that is not a string reads as ""
        elif kind in MEDIA:
            raise media_refused(kind)
        else:
            raise InvalidRequest("unsupported content[].type")
    return "".join(texts)
