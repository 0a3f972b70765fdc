"""`/api/chat` and `/api/generate` answers in Ollama's shapes (spec §1.3, §1.4; Ollama's api/types.go),
in bankML's JSON style (bankml/jstr.py: fixed key order).

A stream is NDJSON, one line per non-empty piece, then the final object; tool calls (Ollama's form,
gateway/serving/tool_calls.ollama_calls) come whole, on a line of their own before the final one. A load
or unload (an empty prompt) ends its final object at `load_duration`. Durations are integer nanoseconds:
load is the verify + open this request waited for, prompt and eval the engine thread's timeline
(model/messages.py `Timeline`); `eval_count` includes the end-of-turn token. A logprob entry is
api/types.go's `Logprob` (no `id`; empty `bytes` and top list left out); the receipt's `logprobs_sha256`
covers the arrays as written (gateway/serving/receipt.py).
"""

from __future__ import annotations

import time
from typing import Any

from bankml import jstr
from gateway.http.timestamps import created_at
from model.detokenizer import complete_utf8_text
from model.messages import LogprobEntry, StepOutput

NDJSON = "application/x-ndjson"


def logprob_entry(e: LogprobEntry, top: int) -> dict:
    """One token's entry in Ollama's shape, its top list cut to `top`."""
    out: dict[str, Any] = {"token": complete_utf8_text(e.text), "logprob": e.logprob}
    if e.text:
        out["bytes"] = list(e.text)
    tops = []
    for t in e.top[:top]:
        entry: dict[str, Any] = {"token": complete_utf8_text(t.piece), "logprob": t.logprob}
        if t.piece:
            entry["bytes"] = list(t.piece)
        tops.append(entry)
    if tops:
        out["top_logprobs"] = tops
    return out


def _content(kind: str, text: str, tool_calls: list[dict] | None = None, thinking: str = "") -> dict:
    """The answer's text, and its thought (`thinking`, written only when there is one, as Ollama's omitempty)."""
    if kind != "chat":
        return {"response": text, "thinking": thinking} if thinking else {"response": text}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"message": message}


def piece_line(tag: str, kind: str, piece: str, logprobs: list[dict] | None = None,
               tool_calls: list[dict] | None = None, thinking: str = "") -> bytes:
    """One NDJSON line of a streamed answer (the calls, Ollama's form, ride on a line of their own; a piece of
    the thought is `thinking`, its content empty)."""
    obj: dict[str, Any] = {"model": tag, "created_at": created_at(time.time()),
                           **_content(kind, piece, tool_calls, thinking), "done": False}
    if logprobs:
        obj["logprobs"] = logprobs
    return (jstr.dumps(obj) + "\n").encode("utf-8")


def _ns(ms: float) -> int:
    return max(0, int(ms * 1e6))


def final_object(tag: str, kind: str, text: str, done_reason: str, total_ns: int, load_ns: int,
                 last: StepOutput | None = None, logprobs: list[dict] | None = None,
                 receipt: dict | None = None, tool_calls: list[dict] | None = None, thinking: str = "") -> str:
    """The last object's JSON text; without `last` (a load or unload) it has no counts and no receipt."""
    obj: dict[str, Any] = {"model": tag, "created_at": created_at(time.time()),
                           **_content(kind, text, tool_calls, thinking),
                           "done": True,
                           "done_reason": done_reason, "total_duration": int(total_ns), "load_duration": int(load_ns)}
    if last is not None:
        obj.update(prompt_eval_count=last.prompt_tokens, prompt_eval_duration=_ns(last.prompt_ms),
                   eval_count=last.completion_tokens, eval_duration=_ns(last.predicted_ms),
                   bankml_cache_n=last.cached_tokens)
        if logprobs:
            obj["logprobs"] = logprobs
        if receipt is not None:
            obj["bankml_receipt"] = receipt
    return jstr.dumps(obj)


def final_line(text: str) -> bytes:
    """A final object's text as the stream's last line."""
    return (text + "\n").encode("utf-8")
