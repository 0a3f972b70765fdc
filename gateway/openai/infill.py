"""llama-server's `/infill` prompt: its body checks and the fill-in-the-middle token layout it builds.

The route (/completion with this prompt) runs as llama-server's `post_infill` does
(tools/server/server-context.cpp): `require_fim` first (a model without FIM tokens is refused before
the body is even parsed), then `check_infill_body`, then `infill_prompt`, which is
`format_prompt_infill` (server-common.cpp) with `spm_infill` off (its default; we take no --spm-infill):

    [extra context tail] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID

Yes, the request's `prompt` goes after the prefix, not after FIM_MID: that is what b11434 sends to the
model, and what its clients (llama.vim, llama.vscode) are tuned for. The budget is llama-server's, with
its server's --n-predict, not the request's; the prefix and suffix are tokenized without special tokens
(a prefix that writes "<|im_end|>" is text), the prompt with them, none with BOS.
"""

from __future__ import annotations

from typing import Any

from bankml.errors import InvalidRequest, NotServed
from gateway.http.json_values import JsonTypeError, get_int, type_name

# format_prompt_infill's separator for a model without FIM_SEP, spelled in bytes there "to avoid
# confusing the AI" (k_chunk_prefix_str)
_CHUNK_PREFIX = "\n\n--- snippet ---\n\n"
_FIM_ROLES = (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))


def _special_ids(model: Any) -> dict[str, int | None]:
    return getattr(model.tokenizer, "special_ids", None) or {}


def require_fim(model: Any) -> None:
    """llama-server's refusal of a model that cannot fill in the middle (each missing token named)."""
    ids = _special_ids(model)
    missing = "".join(f"{name} token is missing. " for role, name in _FIM_ROLES if ids.get(role) is None)
    if missing:
        raise NotServed(f"Infill is not supported by this model: {missing}")


def check_infill_body(doc: dict) -> None:
    """The body's 400s, in llama-server's order and words (post_infill's checks of input_extra, then
    what its JSON library throws while format_prompt_infill reads input_prefix and input_suffix,
    which ex_wrapper turns into a 400)."""
    # (a `prompt` that is not a string: llama-server writes its 400 "\"prompt\" must be a string" and
    # goes on without returning it, so its answer treats the prompt as ""; we do as its binary does)
    if "input_extra" in doc and not isinstance(doc["input_extra"], list):
        raise InvalidRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in doc.get("input_extra") or []:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InvalidRequest('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise InvalidRequest('extra_context chunk\'s "filename" field must be a string')
    # format_prompt_infill's arguments are read right to left (GCC): the suffix is missed first
    for key in ("input_suffix", "input_prefix"):
        if key not in doc:
            raise InvalidRequest(f"[json.exception.out_of_range.403] key '{key}' not found")
    for key in ("input_prefix", "input_suffix"):
        _check_mixed(doc[key])


def _check_mixed(value: Any) -> None:
    """tokenize_mixed's reads: a string, or an array of strings and token ids (a number or a bool
    converts to an id, as nlohmann's get<int> does)."""
    try:
        if isinstance(value, list):
            for p in value:
                if not isinstance(p, str):
                    get_int(p)
        elif not isinstance(value, str):
            raise JsonTypeError(f"[json.exception.type_error.302] type must be string, but is {type_name(value)}")
    except JsonTypeError as e:
        raise InvalidRequest(str(e)) from None


def _mixed(model: Any, value: str | list) -> list[int]:
    """tokenize_mixed(vocab, value, add_special=false, parse_special=false)."""
    if isinstance(value, str):
        return model.tokenize(value, False, False)
    out: list[int] = []
    for p in value:
        out.extend(model.tokenize(p, False, False) if isinstance(p, str) else [get_int(p)])
    return out


def infill_prompt(model: Any, doc: dict, *, n_ctx: int, n_batch: int, n_predict: int) -> list[int]:
    """The prompt tokens llama-server's /infill evaluates for `doc` (checked by check_infill_body).

    n_ctx: the slot's context; n_batch: the server's logical batch (llama-server's --batch-size,
    2048 by default); n_predict: the server's --n-predict (-1 by default). Raises the FIM refusal
    for a model without FIM tokens, and llama-server's "Prompt contains invalid tokens" for a token id
    outside the vocabulary that survives the cut (llama-server checks the prompt it sends)."""
    require_fim(model)
    ids = _special_ids(model)
    tok = model.tokenizer
    prefix = _mixed(model, doc["input_prefix"])
    suffix = _mixed(model, doc["input_suffix"])
    prompt_text = doc.get("prompt")
    prompt = model.tokenize(prompt_text if isinstance(prompt_text, str) else "", False, True)

    extra: list[int] = []
    if ids.get("fim_rep") is not None:
        extra += [ids["fim_rep"], *model.tokenize("myproject\n", False, False)]
    for chunk in doc.get("input_extra") or []:
        if ids.get("fim_sep") is not None:
            filename = chunk.get("filename")
            filename = filename if isinstance(filename, str) else "tmp"
            extra += [ids["fim_sep"], *model.tokenize(filename + "\n", False, False)]
        else:
            extra += model.tokenize(_CHUNK_PREFIX, False, False)
        extra += model.tokenize(chunk["text"], False, False)
    if ids.get("fim_sep") is not None:
        extra += [ids["fim_sep"], *model.tokenize("filename\n", False, False)]

    # format_prompt_infill's split: prefix:suffix = 3:1 of a batch, the rest of the context for the extra
    quarter = n_batch // 4
    n_prefix_take = min(len(prefix), 3 * quarter)
    n_suffix_take = min(len(suffix), max(0, quarter - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))

    head = extra[len(extra) - n_extra_take:]
    if getattr(tok, "add_bos", False):
        head.append(tok.bos_id)
    out = [*head, ids["fim_pre"], *prefix[len(prefix) - n_prefix_take:], *prompt,
           ids["fim_suf"], *suffix[:n_suffix_take], ids["fim_mid"]]
    n_vocab = getattr(tok, "n_vocab", None)
    if n_vocab is not None and any(not 0 <= t < n_vocab for t in out):
        raise InvalidRequest("Prompt contains invalid tokens")
    return out
