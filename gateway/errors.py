"""Errors, typed where they arise and rendered here, in the shape the client's API expects.

- `ApiError`: llama-server's error object, `{"error": {"code", "message", "type"}}` (plus any extra
  keys, e.g. exceed_context_size_error's `n_prompt_tokens` and `n_ctx`), which the `openai` client
  reads as the error's message. Used by /v1 and llama-server's routes.
- `PlainError`: a text/plain answer, as the original gives for unknown paths and the loopback rules.
- Sanic's own exceptions (a head Sanic cannot parse, a request timeout, ...) keep their status and
  become text/plain. Anything else is a 500 with the exception's type and message: no traceback ever
  reaches a client; it goes to the log.
"""

from __future__ import annotations

import logging

from sanic import HTTPResponse
from sanic.exceptions import MethodNotAllowed, NotFound, SanicException
from sanic.handlers import ErrorHandler

from bankml import jstr

log = logging.getLogger("bankml.gateway")

# llama-server's error types (tools/server/utils.hpp, format_error_response)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}


class GatewayError(Exception):
    status: int = 500

    def response(self) -> HTTPResponse:
        raise NotImplementedError


class ApiError(GatewayError):
    def __init__(self, status: int, message: str, type_: str | None = None, **extra):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status, "server_error")
        self.extra = extra

    def body(self) -> str:
        return jstr.dumps({"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}})

    def response(self) -> HTTPResponse:
        return json_response(self.body(), self.status)


class PlainError(GatewayError):
    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status
        self.text = text

    def response(self) -> HTTPResponse:
        return text_response(self.text, self.status)


def exceed_context(n_prompt: int, n_ctx: int) -> ApiError:
    """llama-server's refusal of a prompt that does not fit (serving.md §6), status 400."""
    return ApiError(400, f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it", "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=n_ctx)


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
        if isinstance(exception, GatewayError):
            return exception.response()
        if isinstance(exception, NotFound | MethodNotAllowed):
            # paths (and methods) match exactly, as in the original: anything else is a 404
            return text_response(self.not_found_text, 404)
        if isinstance(exception, SanicException):
            return text_response(str(exception) or "error", exception.status_code)
        log.error("unhandled %s on %s %s", type(exception).__name__, getattr(request, "method", "?"),
                  getattr(request, "path", "?"), exc_info=exception)
        return ApiError(500, f"internal error: {type(exception).__name__}: {exception}").response()
