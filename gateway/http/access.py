"""Who may talk to the server beyond the loopback rules: browser origins and API keys (README, "API keys,
browsers, and the chat template", has every answer).

Both are decided on the request head alone (loopback.py, rules 3 and 8), so an unwelcome request never
has its body read nor reaches a route or a model.

Origins: admitted are no Origin (not a browser), the server's own (loopback at the port served: the
status page), and those `--allow-origin` lists, exactly as a browser serializes them. Any other is 403 on
every method, as Ollama refuses one (gin-contrib/cors): a request never served has no side effect either.
No `Access-Control-Allow-Credentials`: a page sets the key header itself, so no cookie need cross.

API keys: llama-server's rules (b11434, tools/server/server-http.cpp; recorded in
tests/fixtures/api_key_smollm2.json): only its public endpoints and our status page go without: /health
and /v1/health, and /models and /v1/models, public in later builds (its own test_security.py; b11434 asked a
key for them); an exact "Bearer "
prefix is stripped; `X-Api-Key` is its retry for Anthropic's clients. The 401 comes before routing (an
unknown path gets it too), in the route's API shape. Keys are compared as sha256 digests, every key every
time, so the timing tells nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from bankml.errors import Unauthorized
from gateway.http.errors import api_of, error_body
from gateway.http.loopback import PREFLIGHT_REFUSED as NO_ORIGINS_LISTED
from gateway.http.loopback import Head, Refusal

INVALID_KEY = "Invalid API Key"  # llama-server's message, tools/server/server-http.cpp
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/"})
ORIGIN_REFUSED = ("bankml serve: requests from a web page of another origin are refused (--allow-origin "
                  "admits one)")
PREFLIGHT_REFUSED = "bankml serve: cross-origin requests are refused (this origin is not in --allow-origin)"
ALLOW_METHODS = "GET, POST, DELETE, HEAD"  # every method a route answers
ALWAYS_ALLOWED_HEADERS = ("Authorization", "Content-Type", "X-Api-Key")
JSON_TYPE = "application/json; charset=utf-8"

_OWN_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_TOKEN_LIST = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+(?:[ \t]*,[ \t]*[!#$%&'*+\-.^_`|~0-9A-Za-z]+)*")


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("latin-1", "replace")).digest()


@dataclass(frozen=True)
class Access:
    """The origin and key policy of one server (both listeners); the default admits what it always has:
    no key needed, no origin but the server's own."""

    key_digests: tuple[bytes, ...] = ()
    allowed_origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, api_keys: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()) -> Access:
        # the keys are kept only as digests: nothing here can print one
        return cls(tuple(_digest(k) for k in api_keys), frozenset(allowed_origins))

    @property
    def keys_required(self) -> bool:
        return bool(self.key_digests)

    # --- origins -----------------------------------------------------------------------------------

    def listed(self, head: Head) -> str | None:
        """The request's Origin when it is a listed one (its answer then carries the CORS headers)."""
        origin = head.header("origin")
        return origin if origin is not None and origin in self.allowed_origins else None

    def origin_refusal(self, head: Head, port: int) -> Refusal | None:
        """Rule 3: a preflight is answered here (204 or 403); another request from a foreign origin is 403."""
        origin = head.header("origin")
        if head.method == "OPTIONS":
            if self.listed(head):
                return self._preflight(head)
            return Refusal(403, PREFLIGHT_REFUSED if self.allowed_origins else NO_ORIGINS_LISTED)
        if origin is None or self.listed(head) or own_origin(origin, port):
            return None
        return Refusal(403, ORIGIN_REFUSED)

    def _preflight(self, head: Head) -> Refusal:
        origin = head.header("origin") or ""
        asked = head.header("access-control-request-headers") or ""
        extra = [h.strip(" \t") for h in asked.split(",")] if _TOKEN_LIST.fullmatch(asked) else []
        allowed = list(ALWAYS_ALLOWED_HEADERS)
        allowed += [h for h in extra if h.lower() not in {a.lower() for a in allowed}]
        headers = [("Access-Control-Allow-Origin", origin), ("Access-Control-Allow-Methods", ALLOW_METHODS),
                   ("Access-Control-Allow-Headers", ", ".join(allowed)), ("Vary", "Origin")]
        # Chrome's Private Network Access: a public page's preflight to a loopback address asks for this
        if (head.header("access-control-request-private-network") or "").lower() == "true":
            headers.append(("Access-Control-Allow-Private-Network", "true"))
        return Refusal(204, "", headers=tuple(headers))

    # --- keys --------------------------------------------------------------------------------------

    def key_refusal(self, head: Head) -> Refusal | None:
        """Rule 8: the 401 of a request that needs a key and has none of the configured ones."""
        if not self.key_digests:
            return None
        path = head.target.partition("?")[0]
        if path in PUBLIC_PATHS:  # whatever the method: a POST /health is then the route table's 404
            return None
        if self.authorized(head):
            return None
        headers = [("WWW-Authenticate", "Bearer")]  # RFC 9110 §11.6.1: a 401 names its scheme
        origin = self.listed(head)
        if origin is not None:  # the admitted page may read why it was refused
            headers += [("Access-Control-Allow-Origin", origin), ("Vary", "Origin")]
        return Refusal(401, error_body(Unauthorized(INVALID_KEY), api_of(path)), content_type=JSON_TYPE,
                       headers=tuple(headers))

    def authorized(self, head: Head) -> bool:
        candidate = head.header("authorization") or head.header("x-api-key") or ""
        candidate = candidate.removeprefix("Bearer ")  # exactly llama-server's prefix: "bearer x" is key "bearer x"
        digest = _digest(candidate)
        ok = False
        for key in self.key_digests:  # every key, every time: no early exit tells which one is near
            ok |= hmac.compare_digest(digest, key)
        return ok


def own_origin(origin: str, port: int) -> bool:
    """The server's own origin: a page it served itself (http, a loopback host, the port served)."""
    rest = origin.removeprefix("http://")
    if rest == origin:
        return False
    return any(rest == f"{host}:{port}" or (port == 80 and rest == host) for host in _OWN_HOSTS)
