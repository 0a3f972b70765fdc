"""Ollama's `POST /api/create`, `POST /api/copy` and `DELETE /api/delete` over bankml's derived models.

A create reads `{model|name, modelfile}` or the structured form the ollama client sends (`{model, from, system,
template, license, parameters, messages}`), then runs gateway/serving/derived.py's `create` off the event loop (it hashes
the base) and one at a time. It streams Ollama's `{"status": ...}` lines as NDJSON by default; with
`stream: false` the answer is `{"status": "success"}`. A refusal before the first status is a 400; one after it
has gone out is an `{"error": ...}` line, as Ollama's server writes one mid-stream. Copy and delete answer 200
with an empty body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from sanic import HTTPResponse

from bankml import jstr
from bankml.errors import BankmlError, InternalError, InvalidRequest
from gateway.http.errors import json_response
from gateway.ollama.request import read_body
from gateway.serving import derived
from gateway.serving.modelfile import refuse_uploads

NDJSON = "application/x-ndjson"
NO_REGISTRY = ("bankml serve was started without --registry: a derived model is written beside the pins of the "
               "registry directory")

_lock: asyncio.Lock | None = None  # one create, copy or delete at a time


def _one_at_a_time() -> asyncio.Lock:
    global _lock
    if _lock is None:
        _lock = asyncio.Lock()
    return _lock


def _registry(state: Any) -> Any:
    registry = getattr(state, "registry", None)
    if registry is None or not registry.directory:
        raise InvalidRequest(NO_REGISTRY)
    return registry


_END = object()


def _step(steps: Iterator[str]) -> Any:
    """The next status line, or _END: StopIteration cannot cross asyncio.to_thread's future."""
    try:
        return next(steps)
    except StopIteration:
        return _END
    except BankmlError:
        raise
    except Exception as e:  # a bug: typed here, so a stream ends with its message and not a traceback
        raise InternalError(f"internal error: {type(e).__name__}: {e}") from e


def _status_line(status: str) -> bytes:
    return (jstr.dumps({"status": status}) + "\n").encode("utf-8")


async def create(request, state):
    """POST /api/create."""
    body = await asyncio.to_thread(read_body, request.body)  # off the loop: 16 MiB of JSON takes a while to parse
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequest("model: name the model to create")
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be true or false")
    refuse_uploads(body)
    registry = _registry(state)
    modelfile = body.get("modelfile")
    if modelfile is not None and not isinstance(modelfile, str):
        raise InvalidRequest("modelfile must be a string")
    spec: Any = modelfile if modelfile and modelfile.strip() else body
    ctx = getattr(getattr(state, "residency", None), "ctx", None)  # --ctx: a larger num_ctx gets a warning
    async with _one_at_a_time():
        steps = derived.create(registry, name, spec, ctx)
        first = await asyncio.to_thread(_step, steps)  # a refusal here is still an ordinary 400
        if not stream:
            while first is not _END:
                first = await asyncio.to_thread(_step, steps)
            return json_response('{"status": "success"}')
        response = await request.respond(content_type=NDJSON)
        line = first
        client_gone = False
        while line is not _END:
            if not client_gone:
                try:
                    await response.send(_status_line(line))
                except Exception:  # the client went away: the model is created all the same
                    client_gone = True
            try:
                line = await asyncio.to_thread(_step, steps)
            except BankmlError as e:
                if not client_gone:
                    await response.send((jstr.dumps({"error": e.message}) + "\n").encode("utf-8"))
                break
        if not client_gone:
            await response.eof()
    return None  # the answer went out through `response`


def _empty() -> HTTPResponse:
    return HTTPResponse(b"", status=200, content_type="application/json")


async def copy(request, state):
    """POST /api/copy {source, destination}: a derived model FROM source, nothing else."""
    body = await asyncio.to_thread(read_body, request.body)
    registry = _registry(state)
    async with _one_at_a_time():
        await asyncio.to_thread(derived.copy, registry, body.get("source"), body.get("destination"))
    return _empty()


async def delete(request, state):
    """DELETE /api/delete {model}: a derived model's manifest removed; a pin refused; unknown, 404."""
    body = await asyncio.to_thread(read_body, request.body)
    name = body.get("model") or body.get("name")
    registry = getattr(state, "registry", None)
    if registry is None:
        raise InvalidRequest(NO_REGISTRY)
    async with _one_at_a_time():
        await asyncio.to_thread(derived.delete, registry, name)
    return _empty()
