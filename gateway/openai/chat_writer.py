"""`POST /v1/chat/completions`: the answer written in OpenAI's shapes (the request is read by
gateway/openai/chat_request.py), in bankML's JSON style (bankml/jstr.py) with the top-level keys in
llama-server's order (tools/server/server-task.cpp `to_json_oaicompat_chat*`).

A stream: the role delta first, as OpenAI sends it (llama-server sends it with the first token's text,
so not at all when that token ends inside a character); a chunk per text piece; the finish_reason's
chunk, which carries `usage` and `timings` unless `stream_options.include_usage` asks for a usage chunk
of its own (`choices: []`, as llama-server and OpenAI send it); the receipt chunk (no choices, the same
usage and timings); `data: [DONE]`. Every chunk has `id`, `object`, `created` and `model`. A logprob entry (llama-server's `probs_vector_to_json`) rides on the chunk its
token's text makes (the role delta when the first token makes none); its `token` is cut before a
character its raw `bytes` leave unfinished.
`system_fingerprint` is `b<bankml's version>`: it names the server that answered (llama-server writes
its build); the backend is in the receipt's `engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bankml import __version__, jstr
from gateway.serving.tool_calls import Parsed
from model.detokenizer import complete_utf8_text
from model.messages import LogprobEntry, StepOutput


def timings(out: StepOutput) -> dict:
    """llama-server's `timings` (b11434's keys, server-task.cpp `result_timings::to_json`) for an
    answer so far: a rate or a per-token time is null when its count or time is 0 (a division by
    zero there, which its JSON writes as null). `draft_n` and `draft_n_accepted` (the tokens drafted and
    checked so far, and of those the ones kept) only once something was drafted, as llama-server
    writes them (`if (draft_n > 0)`)."""
    prompt_n = max(0, out.prompt_tokens - out.cached_tokens)

    def rate(n: int, ms: float) -> float | None:
        return round(n / (ms / 1e3), 3) if n > 0 and ms > 0 else None

    def per_token(n: int, ms: float) -> float | None:
        return round(ms / n, 3) if n > 0 else None

    base = {"cache_n": out.cached_tokens, "prompt_n": prompt_n, "prompt_ms": round(out.prompt_ms, 3),
            "prompt_per_token_ms": per_token(prompt_n, out.prompt_ms),
            "prompt_per_second": rate(prompt_n, out.prompt_ms), "predicted_n": out.completion_tokens,
            "predicted_ms": round(out.predicted_ms, 3),
            "predicted_per_token_ms": per_token(out.completion_tokens, out.predicted_ms),
            "predicted_per_second": rate(out.completion_tokens, out.predicted_ms)}
    if out.draft_n > 0:
        base["draft_n"] = out.draft_n
        base["draft_n_accepted"] = out.draft_n_accepted
    return base


def usage(out: StepOutput, reasoning_tokens: int | None = None) -> dict:
    """`reasoning_tokens` (a thinking template's answer): the thought's tokens, its tags included, as OpenAI's
    `completion_tokens_details` (left out for a template that does not think)."""
    out_usage = {"completion_tokens": out.completion_tokens, "prompt_tokens": out.prompt_tokens,
                 "total_tokens": out.completion_tokens + out.prompt_tokens,
                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
    if reasoning_tokens is not None:
        out_usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out_usage


def logprob_entry(e: LogprobEntry) -> dict:
    return {"id": e.token, "token": complete_utf8_text(e.text), "bytes": list(e.text), "logprob": e.logprob,
            "top_logprobs": [{"id": t.token, "token": complete_utf8_text(t.piece), "bytes": list(t.piece),
                              "logprob": t.logprob}
                             for t in e.top]}


SYSTEM_FINGERPRINT = f"b{__version__}"


def finish_reason(last: StepOutput, parsed: Parsed | None) -> str:
    """`tool_calls` when the answer ended on its own with calls (llama-server's rule), else the engine's."""
    if parsed is not None and parsed.calls and last.finish_reason.value == "stop":
        return "tool_calls"
    return last.finish_reason.value


@dataclass(frozen=True)
class ChatCompletion:
    """One chat completion's constants, repeated by its body or by every chunk of its stream."""

    id: str  # "chatcmpl-...", llama-server's form
    created: int
    model: str
    include_usage: bool = False  # stream_options.include_usage: usage in a chunk of its own

    def body(self, text: str, last: StepOutput, receipt: dict, logprobs: list[dict] | None = None,
             parsed: Parsed | None = None, reasoning: str = "", reasoning_tokens: int | None = None) -> str:
        return self.body_of([self.choice(0, text, last, logprobs, parsed, reasoning)], last, receipt, reasoning_tokens)

    @staticmethod
    def choice(index: int, text: str, last: StepOutput, logprobs: list[dict] | None = None,
               parsed: Parsed | None = None, reasoning: str = "") -> dict[str, Any]:
        """One choice; `parsed` (an answer with tools): its content, and its calls as `tool_calls`;
        `reasoning` (a thinking template's thought): `reasoning_content`, written only when there is one,
        as llama-server writes it."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if parsed is not None:
            message["content"] = parsed.content if parsed.calls else (parsed.content or "")
            if parsed.calls:
                message["tool_calls"] = parsed.calls
        choice: dict[str, Any] = {"finish_reason": finish_reason(last, parsed), "index": index, "message": message}
        if logprobs:  # llama-server writes the key only when there are entries
            choice["logprobs"] = {"content": logprobs}
        return choice

    def body_of(self, choices: list[dict], last: StepOutput, receipt: dict | None,
                reasoning_tokens: int | None = None) -> str:
        """The answer with these choices; `usage` and `timings` are `last`'s (llama-server merges the
        choices of `n` > 1 into its first answer's object, whose usage and timings it keeps)."""
        res: dict[str, Any] = {
            "choices": choices,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": "chat.completion",
            "usage": usage(last, reasoning_tokens),
            "id": self.id,
            "timings": timings(last),
        }
        if receipt is not None:
            res["bankml_receipt"] = receipt
        return jstr.dumps(res)

    def _chunk(self, choices: list[dict], **extra: Any) -> bytes:
        return _event({"choices": choices, "created": self.created, "id": self.id, "model": self.model,
                       "system_fingerprint": SYSTEM_FINGERPRINT, "object": "chat.completion.chunk", **extra})

    def chunk(self, piece: str | None, logprobs: list[dict] | None = None, index: int = 0,
              timed: StepOutput | None = None) -> bytes:
        """A content chunk; with `piece` None, the role delta that opens the stream (of choice `index`).
        `timed`: timings_per_token, the chunk carries that output's `timings`."""
        delta = {"content": piece} if piece is not None else {"role": "assistant", "content": None}
        choice: dict[str, Any] = {"finish_reason": None, "index": index, "delta": delta}
        if logprobs:
            choice["logprobs"] = {"content": logprobs}
        if timed is not None:
            return self._chunk([choice], timings=timings(timed))
        return self._chunk([choice])

    def delta_chunk(self, kind: str, value: Any, index: int = 0, timed: StepOutput | None = None,
                    logprobs: list[dict] | None = None) -> bytes:
        """A content delta, a thought's (`reasoning_content`, as llama-server streams it), or with tools one
        call whole (`{"index", "id", "type", "function"}`)."""
        if kind == "content":
            return self.chunk(value, logprobs, index, timed)
        if kind == "reasoning":
            choice: dict[str, Any] = {"finish_reason": None, "index": index, "delta": {"reasoning_content": value}}
            if logprobs:
                choice["logprobs"] = {"content": logprobs}
            if timed is not None:
                return self._chunk([choice], timings=timings(timed))
            return self._chunk([choice])
        delta = {"tool_calls": [{"index": value["index"], "id": value["id"], "type": value["type"],
                                 "function": value["function"]}]}
        choice = {"finish_reason": None, "index": index, "delta": delta}
        if timed is not None:
            return self._chunk([choice], timings=timings(timed))
        return self._chunk([choice])

    def progress_chunk(self, index: int, progress: dict) -> bytes:
        """return_progress: a role delta carrying `prompt_progress`, as b11434 sends one as the prompt
        starts and after each prefill chunk (the role delta still opens the answer after them)."""
        choice = {"finish_reason": None, "index": index, "delta": {"role": "assistant", "content": None}}
        return self._chunk([choice], prompt_progress=progress)

    def final_chunks(self, last: StepOutput, index: int = 0, reason: str | None = None,
                     reasoning_tokens: int | None = None) -> bytes:
        """The finish_reason's chunk (`reason` in place of the engine's: tool_calls), then (include_usage)
        the usage chunk; `usage` and the whole `timings` on the last one, as llama-server sends them."""
        finish = [{"finish_reason": reason or last.finish_reason.value, "index": index, "delta": {}}]
        used = usage(last, reasoning_tokens)
        if not self.include_usage:
            return self._chunk(finish, usage=used, timings=timings(last))
        return self._chunk(finish) + self._chunk([], usage=used, timings=timings(last))

    def receipt_chunk(self, receipt: dict, last: StepOutput, index: int | None = None,
                      reasoning_tokens: int | None = None) -> bytes:
        """The receipt, last before [DONE]: a chunk of no choices, as the usage chunk is, with the answer's
        `usage` and `timings` again, so a client that takes every chunk without choices for the usage
        chunk (the openai client's stream helper, llama-server's own tests) reads the same figures. With
        `n` > 1, one per choice, after its last chunk, with the choice's `index`."""
        extra: dict[str, Any] = {"index": index} if index is not None else {}
        return self._chunk([], **extra, usage=usage(last, reasoning_tokens), timings=timings(last),
                           bankml_receipt=receipt)


def _event(obj: dict) -> bytes:
    return b"data: " + jstr.dumps(obj).encode("utf-8") + b"\n\n"


def receipt_event(receipt: dict) -> bytes:
    """P0's receipt after llama-server's own chunks (gateway/p0/chat.py): `choices` empty, for clients that
    read it on every event."""
    return _event({"choices": [], "bankml_receipt": receipt})


DONE_EVENT = b"data: [DONE]\n\n"
