"""P0 `POST /v1/chat/completions`, top to bottom: the Rust bankml's per-request re-check, then its receipt.

1. the body must be JSON (400); it is forwarded byte for byte, and its sha256 is the receipt's
   request_sha256;
2. the file must still be the one that was hashed (its identity: device, inode, size, mtime; 503),
   and llama-server must still serve it (its /props model_path, canonical; 503, or 502 when /props
   cannot be read). Nothing is re-hashed, and a refused answer has no receipt;
3. the request goes to llama-server through the pooled client;
4. a status other than 200 passes through as it came, without a receipt;
5. non-streamed: the upstream JSON with `, "bankml_receipt": {...}` inserted before its last `}`;
   the text is choices[0].message.content, the counts are its usage, ttft_ms is null;
6. streamed: lines are passed on as they arrive (all complete lines of each upstream read in one
   write), the delta.content pieces are joined for the receipt, the counts come from usage (or, as
   llama-server sends it unasked, the last chunk's timings), and on `data: [DONE]` the receipt
   event goes first. A failure after the head has gone out ends the stream with an error event and
   no receipt.
A client that goes away cancels the handler, which closes the upstream connection, and llama-server
stops generating.
"""

from __future__ import annotations

import json
from typing import Any

from sanic import HTTPResponse

from bankml import jstr
from bankml.errors import FileChanged, ModelUnusable, UpstreamFailed
from bankml.verify import FileIdentity
from gateway.http.body import parse_json_body
from gateway.http.errors import stream_error
from gateway.openai.chat_writer import receipt_event
from gateway.p0.upstream import UpstreamError
from gateway.serving.receipt import Tally

FILE_CHANGED = "the model file changed since bankml verified it; restart bankml serve to verify it again"
ENGINE_MOVED = "the engine no longer serves the verified file"
DONE = b"data: [DONE]"


async def still_verified(state) -> None:
    """The file and llama-server are still what was verified, or FileChanged, ModelUnusable (503),
    UpstreamFailed (502)."""
    try:
        identity = FileIdentity.of(state.gated.path)
    except OSError:
        identity = None
    if identity != state.gated.identity:
        raise FileChanged(FILE_CHANGED)
    try:
        served = await state.upstream.served_path()
    except UpstreamError as e:
        raise UpstreamFailed(str(e)) from None
    if served != state.gated.path:
        raise ModelUnusable(ENGINE_MOVED)


def _first_choice(v: Any, key: str) -> str | None:
    """choices[0][key].content when it is a string (key: "message" or "delta")."""
    try:
        content = v["choices"][0][key]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def token_counts(v: Any) -> tuple[bool, int, int] | None:
    """(from usage?, prompt tokens, completion tokens) that one upstream JSON object states, if any.

    `usage` is OpenAI's; a llama-server stream sends it only when asked (stream_options.include_usage),
    but its last chunk always has `timings`, whose prompt_n is the uncached part (cache_n the rest)."""
    if not isinstance(v, dict):
        return None
    usage, timings = v.get("usage"), v.get("timings")
    if isinstance(usage, dict):
        prompt, completion = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
        if prompt is not None and completion is not None:
            return True, prompt, completion
    if isinstance(timings, dict):
        prompt, cached = _int(timings.get("prompt_n")), _int(timings.get("cache_n")) or 0
        completion = _int(timings.get("predicted_n"))
        if prompt is not None and completion is not None:
            return False, prompt + cached, completion
    return None


def _count(tally: Tally, v: Any, usage_seen: bool = False) -> bool:
    """Take the counts `v` states (timings never override usage); returns whether usage has been seen."""
    counts = token_counts(v)
    if counts is None or (usage_seen and not counts[0]):
        return usage_seen
    tally.prompt_tokens, tally.completion_tokens = counts[1], counts[2]
    return usage_seen or counts[0]


def with_receipt(raw: bytes, receipt: dict) -> bytes:
    """The upstream JSON object with the receipt inserted before its last `}`, every other byte kept."""
    end = raw.rfind(b"}")
    sep = b", " if raw[raw.find(b"{") + 1:end].strip() else b""
    return raw[:end] + sep + b'"bankml_receipt": ' + jstr.dumps(receipt).encode("utf-8") + raw[end:]


async def chat_completions(request, state):
    body = request.body
    req = parse_json_body(body)
    stream = isinstance(req, dict) and req.get("stream") is True
    await still_verified(state)
    tally = Tally.start(body, state.receipt_key)
    upstream = state.upstream
    try:
        async with upstream.post("/v1/chat/completions", body) as r:
            if r.status_code != 200 or not stream:
                raw = await upstream.read_body(r)
                content_type = r.headers.get("content-type", "application/json")
                if r.status_code != 200:
                    return HTTPResponse(raw, status=r.status_code, content_type=content_type)
                return _whole(raw, content_type, tally, state)
            return await _streamed(request, r, tally, state)
    except UpstreamError as e:
        raise UpstreamFailed(str(e)) from None


def _whole(raw: bytes, content_type: str, tally: Tally, state) -> HTTPResponse:
    try:
        v = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise UpstreamFailed("upstream answer is not JSON") from None
    if not isinstance(v, dict):
        raise UpstreamFailed("upstream answer is not a JSON object")
    tally.sent(_first_choice(v, "message") or "")
    _count(tally, v)
    return HTTPResponse(with_receipt(raw, tally.receipt(state.backend, state.gated.verified)),
                        status=200, content_type=content_type)


def _account(tally: Tally, payload: bytes, usage_seen: bool) -> bool:
    """One `data:` event: its content piece joins the answer text, its usage or timings set the counts."""
    try:
        v = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return usage_seen  # passed on all the same; it carries no text
    piece = _first_choice(v, "delta")
    if piece:
        tally.token()  # the first piece sets the time to first token
        tally.sent(piece)
    return _count(tally, v, usage_seen)


async def _streamed(request, r, tally: Tally, state) -> None:
    upstream = state.upstream
    response = await request.respond(content_type=r.headers.get("content-type", "text/event-stream"),
                                     headers={"Cache-Control": "no-cache"})
    usage_seen = False
    try:
        async for batch in upstream.lines(r):
            out = []
            for line in batch:
                s = line.rstrip()
                if s == DONE:
                    out.append(receipt_event(tally.receipt(state.backend, state.gated.verified)))
                elif s.startswith(b"data:"):
                    usage_seen = _account(tally, s[5:], usage_seen)
                out.append(line)
            await response.send(b"".join(out))
    except UpstreamError as e:
        await response.send(stream_error(UpstreamFailed(str(e))))  # the stream ends here, with no receipt
    await response.eof()
    return None  # the answer went out through request.respond(); Sanic logs an error if it is returned again
