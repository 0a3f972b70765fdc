"""OpenAI's legacy `echo` on `/v1/completions`: the prompt comes back before the completion, and with
`logprobs` each prompt token's logprob too, teacher-forced by the engine (model/score.py).

With `echo`, a choice's `logprobs` is OpenAI's legacy object over the prompt's tokens and then the
completion's, as OpenAI and vLLM write it (llama-server b11434 ignores `echo`):
`{"tokens": [piece], "token_logprobs": [logprob], "top_logprobs": [{piece: logprob}], "text_offset":
[character offset in the text]}`; the first prompt token has nothing before it, so its logprob and its
top are null. `max_tokens` 0 scores the prompt and generates nothing (what evaluation harnesses send).
A stream with `echo` is refused (completion_request.py).
"""

from __future__ import annotations

from typing import Any

from model.detokenizer import complete_utf8_text


def prompt_texts(prompt: Any, prompts: list[list[int]], tokenizer) -> list[str]:
    """The text each prompt echoes: a prompt given as text is itself, one given as token ids their text."""
    if isinstance(prompt, str):
        return [prompt]
    items = prompt if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt) else [prompt]
    return [item if isinstance(item, str) else tokenizer.decode(ids) for item, ids in zip(items, prompts, strict=True)]


def legacy_logprobs(tokenizer, prompt_ids: list[int], scored: list, entries: list[dict]) -> dict:
    """The legacy object for the prompt (`scored`: model.score.Scored for its positions 1..) and then the
    completion's logprob entries (openai_chat.logprob_entry's)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict | None] = []
    for i, token in enumerate(prompt_ids):
        tokens.append(_piece(tokenizer, token))
        if i == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        s = scored[i - 1]
        token_logprobs.append(s.logprob)
        top_logprobs.append({_piece(tokenizer, t): lp for t, lp in s.top})
    for e in entries:
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        top_logprobs.append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _piece(tokenizer, token: int) -> str:
    return complete_utf8_text(tokenizer.token_to_piece(token, False))
