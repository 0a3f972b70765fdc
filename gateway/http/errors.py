"""Errors rendered here, in the shape the client's API expects; typed where they arise (bankml/errors.py).

- a `BankmlError` (Refused, ModelUnusable, ContextExceeded, ...) gets its status from bankml/errors.py's
  table, per API, chosen by the request's path: `/api/*` is Ollama's (`{"error": "<message>"}`),
  `/v1/messages*` Anthropic's (`{"type": "error", "error": {"type", "message"}}`, the type by status),
  `/v1/*` OpenAI's and every other route llama-server's: `{"error": {"code", "message", "type"}}`
  plus the error's extra keys (exceed_context_size_error's `n_prompt_tokens` and `n_ctx`), which the
  `openai` client reads as the error's message; the loopback rules' refusals of an Anthropic route
  (413, 415, ...) get Anthropic's shape too (`anthropic_refusal`), so its SDK reads every error;
- an `Overloaded` (the engine's waiting queue is full) is a 503 in every API's shape, with a
  `Retry-After` header in seconds, as an HTTP client's retry logic (the `openai` client's included)
  reads it;
- Sanic's own exceptions (a head Sanic cannot parse, a request timeout, ...) keep their status and
  become text/plain. Anything else is an InternalError (500) with the exception's type and message: no
  traceback ever reaches a client; it goes to the log.
"""

from __future__ import annotations

import enum
import logging

from sanic import HTTPResponse
from sanic.exceptions import MethodNotAllowed, NotFound, RequestCancelled, SanicException
from sanic.handlers import ErrorHandler

from bankml import jstr
from bankml.errors import BankmlError, ContextExceeded, InternalError, Overloaded, RouteNotFound, codes

log = logging.getLogger("bankml.gateway")

class Api(enum.Enum):
    OPENAI = "openai"  # /v1/*
    LLAMA = "llama"  # llama-server's own routes, and bankml's
    OLLAMA = "ollama"  # /api/*
    ANTHROPIC = "anthropic"  # /v1/messages, /v1/messages/count_tokens


# the 404 of an unknown /api route or a wrong method (the Rust bankml's, bankML/ollama.rs)
OLLAMA_ROUTES_TEXT = ("bankml serve --native (Ollama API): GET /api/version /api/tags /api/ps, POST /api/show "
                      "/api/chat /api/generate /api/embed /api/embeddings /api/create /api/copy, DELETE /api/delete")


# Anthropic's error types by status (docs.anthropic.com/en/api/errors); any other 5xx is api_error
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def api_of(path: str) -> Api:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return Api.ANTHROPIC
    if path.startswith("/api/"):
        return Api.OLLAMA
    if path.startswith("/v1/"):
        return Api.OPENAI
    return Api.LLAMA


def status_of(error: BankmlError, api: Api = Api.OPENAI) -> int:
    row = codes(error)
    return {Api.OPENAI: row.openai, Api.LLAMA: row.llama, Api.OLLAMA: row.ollama, Api.ANTHROPIC: row.openai}[api]


def anthropic_error(status: int, message: str) -> str:
    """Anthropic's error object (its SDK picks the exception by status, and reads `error.type`)."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return jstr.dumps({"type": "error", "error": {"type": kind, "message": message}})


def unavailable_error(status: int, message: str) -> str:
    """llama-server's (and OpenAI's) error object for a failure that is not a BankmlError (a child
    gone, a shutdown): `error_body`'s shape, type `unavailable_error`."""
    return jstr.dumps({"error": {"code": status, "message": message, "type": "unavailable_error"}})


def sse_error_event(status: int, message: str, api: Api = Api.OPENAI) -> bytes:
    """The SSE event that ends a stream cut after its head, in its API's shape: Anthropic's
    `event: error` with its error object (as its SDK reads one), else `unavailable_error`'s
    (`stream_error`'s framing)."""
    if api is Api.ANTHROPIC:
        return b"event: error\ndata: " + anthropic_error(status, message).encode() + b"\n\n"
    return b"data: " + unavailable_error(status, message).encode() + b"\n\n"


def error_body(error: BankmlError, api: Api = Api.OPENAI) -> str:
    """The JSON text of `error` in `api`'s shape."""
    if api is Api.OLLAMA:
        return jstr.dumps({"error": error.message})
    if api is Api.ANTHROPIC:
        return anthropic_error(status_of(error, api), error.message)
    return jstr.dumps({"error": {"code": status_of(error, api), "message": error.message, "type": codes(error).type,
                                 **error.extra}})


def render(error: BankmlError, api: Api = Api.OPENAI) -> HTTPResponse:
    response = json_response(error_body(error, api), status_of(error, api))
    if isinstance(error, Overloaded):
        response.headers["Retry-After"] = str(max(1, int(error.retry_after_s)))
    return response


def stream_error(error: BankmlError) -> bytes:
    """The last event of an SSE stream that fails after its head went out (the status is sent by then)."""
    return f"data: {error_body(error)}\n\n".encode()


def exceed_context(n_prompt: int, n_ctx: int) -> ContextExceeded:
    """llama-server's refusal of a prompt that does not fit (llama.cpp tools/server, ERROR_TYPE_EXCEED_CONTEXT_SIZE), status 400."""
    return ContextExceeded(f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                           "try increasing it", n_prompt_tokens=n_prompt, n_ctx=n_ctx)


def json_response(text: str, status: int = 200) -> HTTPResponse:
    return HTTPResponse(text.encode("utf-8"), status=status, content_type="application/json")


def text_response(text: str, status: int) -> HTTPResponse:
    return HTTPResponse(text.encode("utf-8"), status=status, content_type="text/plain; charset=utf-8")


class GatewayErrorHandler(ErrorHandler):
    """Sanic's error hook: every exception a handler or Sanic raises is answered here."""

    def __init__(self, not_found_text: str):
        super().__init__()
        self.not_found_text = not_found_text

    def default(self, request, exception: Exception) -> HTTPResponse:
        if isinstance(exception, BankmlError):
            return render(exception, api_of(getattr(request, "path", "")))
        if isinstance(exception, RequestCancelled):  # the client went away: nobody reads this answer
            log.debug("%s %s: the client went away", getattr(request, "method", "?"), getattr(request, "path", "?"))
            return text_response("client gone", 499)
        if isinstance(exception, NotFound | MethodNotAllowed):
            # paths (and methods) match exactly, as in the Rust bankml: anything else is a 404, in text
            # (the routes' list) except under /v1, where OpenAI's clients read llama-server's JSON 404, and
            # under /api, where Ollama's read {"error"} naming Ollama's routes
            path = getattr(request, "path", "")
            if api_of(path) in (Api.OPENAI, Api.ANTHROPIC):
                return render(RouteNotFound("File Not Found"), api_of(path))
            if api_of(path) is Api.OLLAMA:
                return render(RouteNotFound(OLLAMA_ROUTES_TEXT), Api.OLLAMA)
            return text_response(self.not_found_text, 404)
        if isinstance(exception, SanicException):
            return text_response(str(exception) or "error", exception.status_code)
        log.error("unhandled %s on %s %s", type(exception).__name__, getattr(request, "method", "?"),
                  getattr(request, "path", "?"), exc_info=exception)
        return render(InternalError(f"internal error: {type(exception).__name__}: {exception}"),
                      api_of(getattr(request, "path", "")))
