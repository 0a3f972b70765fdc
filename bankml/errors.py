"""Every error bankml reports, one class each, and the one table that maps them to what a client sees.

An error is raised where it arises, as its class, with the message a user reads. What it becomes is
decided here, by its class, never by its text: the HTTP status per API (OpenAI's `/v1`, llama-server's
own routes, Ollama's `/api/*`) and the exit code of the `bankml` command. gateway/http/errors.py renders
them in each API's shape; bankml/cli.py takes its exit codes from `exit_code`.

Imports neither sanic nor jax: the gate, the CLI and the engine all raise these.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# `bankml` exit codes (the CLI's usage text lists them)
EXIT_OK = 0
EXIT_UNREADABLE = 1  # a file cannot be read, or bad usage
EXIT_REFUSED = 2
EXIT_TRUNCATED = 3  # the guard needs more header bytes than the file has


def refuse_start(why: object) -> int:
    """`bankml serve` will not start: say why on stderr; its exit code (EXIT_REFUSED, every refusal at start)."""
    print(f"bankml serve: refuse: {why}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


class BankmlError(Exception):
    """A reason to refuse, told to a user. `extra` are keys the error object carries on the wire
    (llama-server's exceed_context_size_error has `n_prompt_tokens` and `n_ctx`)."""

    def __init__(self, message: str, **extra):
        super().__init__(message)
        self.message = message
        self.extra = extra


# --- the gate: guard, pin, identity ---------------------------------------------------------------


class Refused(BankmlError):
    """The gate refused the file (the guard's rules, or a sha256 other than the pinned one)."""


class NotPinned(Refused):
    """The FORK.json has no sha256 record for the file's name."""


class Truncated(Refused):
    """The guard needs more header bytes than the file has."""


class Unreadable(BankmlError):
    """A file (the model, its FORK.json) cannot be read or hashed."""


class FileChanged(BankmlError):
    """The file is not the one that was verified: it changed while it was hashed, or since."""


class ModelUnusable(BankmlError):
    """The served model cannot answer until its file verifies again (or the engine serves it again)."""


class ModelNotFound(BankmlError):
    """No pinned model has the requested name."""


class ResponseNotFound(BankmlError):
    """No stored response has this id (OpenAI's Responses API: never stored, deleted or evicted)."""


class RouteNotFound(BankmlError):
    """No route has this method and exact path (an OpenAI client reads the message of a JSON 404)."""


# --- a request --------------------------------------------------------------------------------------


class InvalidRequest(BankmlError):
    """The request itself is wrong: its body, a field, a value."""


class RequestFailed(BankmlError):
    """A request llama-server answers with its 500 while reading it (a std::runtime_error in
    tools/server, e.g. "Failed to parse messages"): kept as a 500 so its clients see what they expect."""


class Unauthorized(BankmlError):
    """The request carries none of the configured API keys (llama-server's 401 "Invalid API Key")."""


class ContextExceeded(InvalidRequest):
    """The prompt does not fit in the context (llama-server's exceed_context_size_error)."""


class NotSupported(InvalidRequest):
    """A request asks for something bankml cannot honour yet; refused by name, never ignored."""


class NotServed(BankmlError):
    """llama-server's not_supported_error (501): an endpoint or feature this server or model does not
    offer (POST /props without --props, /infill on a model without FIM tokens, /reranking...)."""


# --- the backend ----------------------------------------------------------------------------------


class EngineFailed(BankmlError):
    """The engine failed on a request it had taken (or failed to load a model)."""


class EngineGone(BankmlError):
    """The engine thread has stopped: nothing in this process can answer any more."""


class Overloaded(BankmlError):
    """Too many requests are waiting for the engine ([engine] max_waiting): try again after
    `retry_after_s` seconds (the answer's Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamFailed(BankmlError):
    """P0: llama-server could not be asked, or its answer is unusable."""


class InternalError(BankmlError):
    """A bug: an exception nobody typed. Its type and message go to the client; the traceback to the log."""


# --- start-up ---------------------------------------------------------------------------------------


class UsageError(BankmlError):
    """The command line is wrong: an unknown flag, a value missing or malformed."""


class ConfigInvalid(BankmlError):
    """A config preset or file (or a flag over it) has an unknown key or a wrong value; names both."""


class StartFailed(BankmlError):
    """`bankml serve` cannot start: an address in use, an engine that does not load or launch."""


# --- a receipt, checked -----------------------------------------------------------------------------


class ReceiptInvalid(BankmlError):
    """`bankml receipt verify`: the receipt is not signed, or not by this key, or not as it is now."""


@dataclass(frozen=True)
class Codes:
    """What one error class becomes: its status per API, llama-server's error `type`, its exit code."""

    openai: int  # /v1/*
    llama: int  # llama-server's own routes (/health, /props, /tokenize, ...)
    ollama: int  # /api/*: Ollama's statuses (docs.ollama.com/api/errors; 503 as server/routes.go's busy)
    type: str  # llama-server's error type (tools/server/utils.hpp, format_error_response)
    exit_code: int


# The one table. OpenAI's and llama-server's statuses are llama-server's (it serves /v1 itself);
# the exit codes are the Rust bankml CLI's: 1 cannot read, 2 refused, 3 truncated.
TABLE: dict[type[BankmlError], Codes] = {
    Refused: Codes(400, 400, 400, "invalid_request_error", EXIT_REFUSED),
    NotPinned: Codes(400, 400, 400, "invalid_request_error", EXIT_REFUSED),
    Truncated: Codes(400, 400, 400, "invalid_request_error", EXIT_TRUNCATED),
    Unreadable: Codes(500, 500, 500, "server_error", EXIT_UNREADABLE),
    FileChanged: Codes(503, 503, 503, "unavailable_error", EXIT_REFUSED),
    ModelUnusable: Codes(503, 503, 503, "unavailable_error", EXIT_REFUSED),
    ModelNotFound: Codes(404, 404, 404, "not_found_error", EXIT_UNREADABLE),
    RouteNotFound: Codes(404, 404, 404, "not_found_error", EXIT_UNREADABLE),
    ResponseNotFound: Codes(404, 404, 404, "invalid_request_error", EXIT_UNREADABLE),  # OpenAI's type
    InvalidRequest: Codes(400, 400, 400, "invalid_request_error", EXIT_UNREADABLE),
    RequestFailed: Codes(500, 500, 400, "server_error", EXIT_UNREADABLE),
    Unauthorized: Codes(401, 401, 401, "authentication_error", EXIT_REFUSED),
    ContextExceeded: Codes(400, 400, 400, "exceed_context_size_error", EXIT_UNREADABLE),
    NotSupported: Codes(400, 400, 400, "invalid_request_error", EXIT_UNREADABLE),
    NotServed: Codes(501, 501, 501, "not_supported_error", EXIT_UNREADABLE),
    EngineFailed: Codes(500, 500, 500, "server_error", EXIT_REFUSED),
    EngineGone: Codes(503, 503, 503, "unavailable_error", EXIT_REFUSED),
    Overloaded: Codes(503, 503, 503, "unavailable_error", EXIT_REFUSED),
    UpstreamFailed: Codes(502, 502, 502, "server_error", EXIT_REFUSED),
    InternalError: Codes(500, 500, 500, "server_error", EXIT_REFUSED),
    UsageError: Codes(400, 400, 400, "invalid_request_error", EXIT_UNREADABLE),
    ConfigInvalid: Codes(500, 500, 500, "server_error", EXIT_REFUSED),
    StartFailed: Codes(500, 500, 500, "server_error", EXIT_REFUSED),
    ReceiptInvalid: Codes(400, 400, 400, "invalid_request_error", EXIT_REFUSED),  # raised by the CLI only
}


def codes(error: BankmlError | type[BankmlError]) -> Codes:
    """The row of `error`'s class, or of its nearest listed base (a subclass a caller defines)."""
    cls = error if isinstance(error, type) else type(error)
    for c in cls.__mro__:
        if c in TABLE:
            return TABLE[c]
    return TABLE[InternalError]


def exit_code(error: BankmlError | type[BankmlError]) -> int:
    return codes(error).exit_code
