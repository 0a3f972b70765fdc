"""The completion answers written as llama-server writes them (tools/server/server-task.cpp): /completion
as `to_json_non_oaicompat` (cut to `response_fields` when asked, `json_get_nested_values`), /v1/completions
as `to_json_oaicompat` (`/completions` is /completion's alias in b11434).

Streamed, /completion sends one event per token, then the final object with an empty `content`, and no
`[DONE]` (llama-server sends none there); /v1/completions ends with `[DONE]`. With return_progress,
`prompt_progress` events come first. Every answer carries `bankml_receipt` as a key of each answer object
(each choice's when there are several) or of the sequence's final event, never as an event of its own:
that would break llama-server's clients (its test suite reads `stop` on every /completion event, the
`openai` client `choices[0]` on every chunk).
"""

from __future__ import annotations

from typing import Any

from gateway.openai.chat_writer import SYSTEM_FINGERPRINT, timings, usage
from gateway.openai.chat_writer import _event as event
from model.messages import StepOutput

__all__ = ["event", "nested_values", "partial_timings", "llama_final", "llama_partial", "llama_progress",
           "oai_choice", "oai_body", "oai_chunk", "oai_progress"]


def nested_values(paths: list, obj: dict) -> dict:
    """json_get_nested_values (server-common.cpp): each path's value, keyed by the path, where it exists."""
    out: dict[str, Any] = {}
    for path in paths:
        if not isinstance(path, str):
            continue
        node: Any = obj
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


def partial_timings(out: StepOutput, timings_per_token: bool) -> bool:
    """Whether a streamed token's event carries `timings`: with timings_per_token, and (b11434, as
    recorded) on the token whose text ends the answer with a stop word."""
    return timings_per_token or out.stop_type == "word"


def llama_partial(index: int, out: StepOutput, *, with_timings: bool, entries: list[dict] | None) -> dict:
    res: dict[str, Any] = {
        "index": index,
        "content": out.text,
        "tokens": [out.token] if out.token is not None else [],
        "stop": False,
        "id_slot": -1,  # b11434 names the slot only in the final result
        "tokens_predicted": out.completion_tokens,
        "tokens_evaluated": out.prompt_tokens,
    }
    if with_timings:
        res["timings"] = timings(out)
    if entries:
        res["completion_probabilities"] = entries
    return res


def llama_progress(index: int, out: StepOutput) -> dict:
    """A prompt progress event (return_progress), as b11434 writes it: its `tokens` is `[0]` there
    (a result without a token, recorded), kept for its clients."""
    return {"index": index, "content": "", "tokens": [0], "stop": False, "id_slot": -1, "tokens_predicted": 0,
            "tokens_evaluated": out.prompt_tokens, "prompt_progress": out.progress.to_json()}


def oai_progress(cmpl_id: str, created: int, model: str, index: int, out: StepOutput) -> dict:
    chunk = oai_chunk(cmpl_id, created, model, oai_choice(index, "", None, None), None)
    chunk["prompt_progress"] = out.progress.to_json()
    return chunk


def llama_final(index: int, last: StepOutput, *, content: str, tokens: list[int], model: str, settings: dict,
                prompt: str, has_new_line: bool, entries: list[dict] | None) -> dict:
    res: dict[str, Any] = {
        "index": index,
        "content": content,
        "tokens": tokens,
        "id_slot": last.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": last.completion_tokens,
        "tokens_evaluated": last.prompt_tokens,
        "generation_settings": settings,
        "prompt": prompt,
        "has_new_line": has_new_line,
        "truncated": last.truncated,
        "stop_type": last.stop_type,
        "stopping_word": last.stopping_word,
        # the slot's tokens once it stopped: the prompt and what it generated, less the last token
        # (sampled, never decoded)
        "tokens_cached": max(0, last.prompt_tokens + last.completion_tokens - 1) if last.completion_tokens else 0,
        "timings": timings(last),
    }
    if entries:
        res["completion_probabilities"] = entries
    return res


def _finish_reason(last: StepOutput) -> str:
    # llama-server: "stop" for an end-of-generation token or a stop word, else "length"
    return last.finish_reason.value if last.finish_reason is not None else "length"


def oai_choice(index: int, text: str, last: StepOutput | None, entries: list[dict] | None) -> dict:
    return {"text": text, "index": index, "logprobs": {"content": entries} if entries else None,
            "finish_reason": _finish_reason(last) if last is not None else None}


def oai_body(cmpl_id: str, created: int, model: str, choices: list[dict], first: StepOutput) -> dict:
    """The answer; with several choices (a list of prompts, `n` > 1) llama-server merges them into its
    first sequence's object, whose `usage` and `timings` it keeps (recorded: not a sum)."""
    return {"choices": choices, "created": created, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": "text_completion", "usage": usage(first), "id": cmpl_id, "timings": timings(first)}


def oai_chunk(cmpl_id: str, created: int, model: str, choice: dict, timed: StepOutput | None) -> dict:
    res: dict[str, Any] = {"choices": [choice], "created": created, "model": model,
                           "system_fingerprint": SYSTEM_FINGERPRINT, "object": "text_completion", "id": cmpl_id}
    if timed is not None:
        res["timings"] = timings(timed)
    return res
