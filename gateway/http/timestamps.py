"""RFC 3339 timestamps as Ollama writes them (UTC, exactly 9 fractional digits, "Z"): an answer's
`created_at`, a model's `modified_at` and `expires_at`, a derived model's manifest (spec §1.3)."""

from __future__ import annotations

import math
import time


def created_at(t: float) -> str:
    """`t` (unix seconds) in RFC 3339, UTC, with exactly 9 fractional digits and "Z" (spec §1.3)."""
    seconds = math.floor(t)
    ns = min(999_999_999, round((t - seconds) * 1e9))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ns:09d}Z"


def created_at_ns(t_ns: int) -> str:
    """The same, from integer nanoseconds (time.time_ns()), every digit exact."""
    seconds, ns = divmod(t_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ns:09d}Z"
