"""One line per request, when it ends: method, path, status, model, tokens in and out, milliseconds.

    bankml serve: POST /v1/chat/completions 200 smollm2-135m-instruct.q4_1 in=31 out=12 412 ms

The line is written once the answer has been sent, a stream's last event included, so its time is the
whole request's. A route that ran the model notes each answer it recorded (`note_answer`: the monitor's
`Answer.record` calls it, so the line agrees with /bankml/metrics' records): `n` choices add up, each
with its prompt (the tokens the engine took in, cached ones included); a request that ran none shows `-` for the model and no
tokens. A request refused by the loopback rules before routing (403, 408, 413, 415 ...) has its own
"refused" line already (gateway/http/loopback.py) and no second one. The query string is left out: it
may carry a key (`?key=`), and the path is what an operator greps for. `--quiet` turns it off.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("bankml.access")


@dataclass
class _Entry:
    tokens_in: int = 0
    tokens_out: int = 0
    answers: int = 0
    models: list[str] = field(default_factory=list)


_current: ContextVar[_Entry | None] = ContextVar("bankml_access", default=None)


def note_answer(model: str, tokens_in: int, tokens_out: int) -> None:
    """An answer of the request under way (a no-op outside one)."""
    entry = _current.get()
    if entry is None:
        return
    entry.answers += 1
    entry.tokens_in += tokens_in
    entry.tokens_out += tokens_out
    if model not in entry.models:
        entry.models.append(model)


def begin() -> tuple[_Entry, float]:
    """The request's entry, current for the handler and every task it starts."""
    entry = _Entry()
    _current.set(entry)
    return entry, time.perf_counter()


def line(method: str, path: str, status: int | None, entry: _Entry, t0: float) -> str:
    ms = (time.perf_counter() - t0) * 1e3
    model = ",".join(entry.models) or "-"
    tokens = f" in={entry.tokens_in} out={entry.tokens_out}" if entry.answers else ""
    return f"{method} {path} {status if status is not None else '-'} {model}{tokens} {ms:.0f} ms"


def write(method: str, path: str, status: int | None, entry: _Entry, t0: float) -> None:
    log.info("%s", line(method, path, status, entry, t0))
