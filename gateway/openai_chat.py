"""`POST /v1/chat/completions`: the request parsed once, and the answer written in OpenAI's shapes.

Reading: `parse_chat(body)` turns the raw body into a `ChatRequest` or raises a 400 `ApiError` before
any model work. Fields this engine does not honour yet are refused by name ("refuse, never
approximate"); `UNSUPPORTED` lists them with their neutral values, which pass (issue 5 brings the
sampler chain, stops and logprobs and takes them off the list).

Writing (serving.md §6, with the original's JSON style: `", "` and `": "` separators, key order as
quoted there):
- non-streamed: `{"choices": [{"index", "message": {"role", "content"}, "finish_reason"}], "created",
  "model", "object": "chat.completion", "usage", "timings", "bankml_receipt"}`;
- streamed (SSE): one `chat.completion.chunk` per text piece, a final chunk with an empty delta, the
  finish_reason, `usage` and `timings.cache_n`, then `data: {"bankml_receipt": ...}`, then
  `data: [DONE]`. No role delta (the original sends one only with logprobs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bankml import jstr
from gateway.errors import ApiError
from model.messages import SamplingParams, StepOutput


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    stream: bool
    params: SamplingParams
    model: str | None


def parse_json_body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError(400, "body is not JSON") from None


def _absent(v: Any) -> bool:
    return v is None


# field -> is this value neutral (cannot change the answer)? Anything else is refused by name.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "stop": lambda v: v is None or v == "" or v == [],
    "logprobs": lambda v: v is None or v is False,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "grammar": _absent,
    "json_schema": _absent,
    "tools": lambda v: v is None or v == [],
    "n": lambda v: v is None or v == 1,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "repeat_penalty": lambda v: v is None or v == 1,
    "typical_p": lambda v: v is None or v == 1,
    "mirostat": lambda v: v is None or v == 0,
    "dry_multiplier": lambda v: v is None or v == 0,
    "xtc_probability": lambda v: v is None or v == 0,
    "top_n_sigma": lambda v: v is None or v == -1,
    "dynatemp_range": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {} or v == [],
    "samplers": _absent,
    "n_probs": lambda v: v is None or v == 0,
}


def _number(req: dict, name: str, default: float, integer: bool = False) -> float:
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not float(v).is_integer()):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}")
    return int(v) if integer else float(v)


def parse_messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise ApiError(400, "'messages' is required and must be an array")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string (content parts are not supported yet)")
        out.append({**m, "content": content or ""})
    return out


def parse_chat(body: bytes) -> ChatRequest:
    req = parse_json_body(body)
    if not isinstance(req, dict):
        raise ApiError(400, "body is not a JSON object")
    if req.get("top_logprobs") is not None and req.get("logprobs") is not True:
        raise ApiError(400, "top_logprobs requires logprobs to be set to true")
    for name, neutral in UNSUPPORTED.items():
        if name in req and not neutral(req[name]):
            raise ApiError(400, f"'{name}' is not supported by bankml serve --native yet")
    messages = parse_messages(req.get("messages"))
    stream = req.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string")
    d = SamplingParams()
    # max_tokens, else llama-server's n_predict; a negative or absent one means no limit (the original's rule)
    limit = req.get("max_tokens", req.get("n_predict"))
    max_tokens = int(limit) if isinstance(limit, int | float) and not isinstance(limit, bool) and limit >= 0 else -1
    params = SamplingParams(
        temperature=_number(req, "temperature", d.temperature),
        top_k=_number(req, "top_k", d.top_k, integer=True),
        top_p=_number(req, "top_p", d.top_p),
        min_p=_number(req, "min_p", d.min_p),
        seed=_number(req, "seed", d.seed, integer=True),
        max_tokens=max_tokens,
    )
    return ChatRequest(messages, bool(stream), params, model)


# --- writing ---------------------------------------------------------------------------------------


def timings(out: StepOutput) -> dict:
    """llama-server's `timings` for a finished answer; a rate is null when its count or time is 0."""
    prompt_n = max(0, out.prompt_tokens - out.cached_tokens)

    def rate(n: int, ms: float) -> float | None:
        return round(n / (ms / 1e3), 3) if n > 0 and ms > 0 else None

    return {"cache_n": out.cached_tokens, "prompt_n": prompt_n, "prompt_ms": round(out.prompt_ms, 3),
            "prompt_per_second": rate(prompt_n, out.prompt_ms), "predicted_n": out.completion_tokens,
            "predicted_ms": round(out.predicted_ms, 3),
            "predicted_per_second": rate(out.completion_tokens, out.predicted_ms)}


def usage(out: StepOutput) -> dict:
    return {"completion_tokens": out.completion_tokens, "prompt_tokens": out.prompt_tokens,
            "total_tokens": out.completion_tokens + out.prompt_tokens}


def completion_body(text: str, last: StepOutput, created: int, model_id: str, receipt: dict) -> str:
    return jstr.dumps({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": last.finish_reason.value}],
        "created": created,
        "model": model_id,
        "object": "chat.completion",
        "usage": usage(last),
        "timings": timings(last),
        "bankml_receipt": receipt,
    })


def _event(obj: dict) -> bytes:
    return b"data: " + jstr.dumps(obj).encode("utf-8") + b"\n\n"


def chunk_event(piece: str, created: int, model_id: str) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                   "created": created, "model": model_id, "object": "chat.completion.chunk"})


def final_event(last: StepOutput, created: int, model_id: str) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {}, "finish_reason": last.finish_reason.value}],
                   "created": created, "model": model_id, "object": "chat.completion.chunk",
                   "usage": usage(last), "timings": {"cache_n": last.cached_tokens}})


def receipt_event(receipt: dict) -> bytes:
    return _event({"bankml_receipt": receipt})


def error_event(error: ApiError) -> bytes:
    return _event({"error": {"code": error.status, "message": error.message, "type": error.type}})


DONE_EVENT = b"data: [DONE]\n\n"
