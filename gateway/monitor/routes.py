"""The monitor's routes, for the native gateway and P0 alike: each reads `state.monitoring`.

- `GET /bankml/usage`: the usage snapshot (the Rust bankml's keys and order, then ours), shared and cached;
- `GET /bankml/metrics`: the ring of answers (answer_metrics.py);
- `GET /metrics`: Prometheus text (prometheus.py);
- `GET /bankml/status`: the status page's data: what /bankml says, the usage, the last answers;
- `GET /` (and HEAD): the status page for a browser (its Accept names text/html), else one line of
  text for API clients.
The page is gateway/static/status.{html,css,js}, inlined into one document when first served: no
build step, no second request, no URL outside this server. Each page carries the /bankml/status answer
of the moment it was served (a JSON script element), so its first paint shows real values before its
first poll; except where API keys are required: the page is public, /bankml/status is not, so the page
then carries nothing and its script asks with the key (`#key=KEY`).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from sanic import HTTPResponse

from bankml import jstr
from gateway.http.errors import json_response, text_response

INITIAL = "/*STATUS_INITIAL*/"  # in status.html, inside <script type="application/json" id="initial">
# JSON in a script element must not end it: a "</script>" or "<!--" in a string (a model's name, a
# reason) would, so every "<" is written as JSON's "\u003c" (">" and "&" too, as is customary)
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


@cache
def _page_parts() -> tuple[bytes, bytes]:
    """The page around its initial state: (before, after)."""
    static = resources.files("gateway") / "static"
    html = (static / "status.html").read_text("utf-8")
    css = (static / "status.css").read_text("utf-8")
    js = (static / "status.js").read_text("utf-8")
    before, _, after = html.partition(INITIAL)
    return (before.replace("/*STATUS_CSS*/", css).encode("utf-8"),
            after.replace("/*STATUS_JS*/", js).encode("utf-8"))


def status_page(initial: dict | None = None) -> bytes:
    """The page, carrying `initial` (a /bankml/status answer) for its first paint; without it, `null`."""
    before, after = _page_parts()
    data = "null" if initial is None else jstr.dumps(initial).translate(_SCRIPT_SAFE)
    return before + data.encode("utf-8") + after


def keys_required(request) -> bool:
    """Whether this connection's rules ask an API key of /bankml/status (the protocol holds them,
    gateway/http/access.py; a connection without such rules, as a test client's, asks none)."""
    access = getattr(request.protocol, "access", None)
    return access is not None and access.keys_required


def wants_html(accept: str | None) -> bool:
    """A browser's navigation asks for text/html by name; curl's */* and API clients do not."""
    for part in (accept or "").split(","):
        media, _, params = part.strip().partition(";")
        if media.strip().lower() in ("text/html", "application/xhtml+xml"):
            q = next((p.split("=", 1)[1] for p in params.split(";") if p.strip().startswith("q=")), "1")
            try:
                if float(q) > 0:
                    return True
            except ValueError:
                return True
    return False


async def root(request, state):
    if wants_html(request.headers.get("accept")):
        initial = None
        if request.method == "GET" and not keys_required(request):
            initial = await state.monitoring.status()
        return HTTPResponse(status_page(initial), content_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})
    return text_response(state.monitoring.root_text, 200)


async def _usage(state) -> dict:
    """The monitor's snapshot, with the engine's devices (`Monitoring.devices`) where it has some."""
    usage = await state.monitoring.monitor.get_usage()
    devices = state.monitoring.devices()
    return usage if devices is None else {**usage, "engine_devices": devices}


async def usage(request, state):
    return json_response(jstr.dumps(await _usage(state)))


async def metrics(request, state):
    return json_response(jstr.dumps(state.monitoring.ring.json_dict()))


async def status(request, state):
    return json_response(jstr.dumps(await state.monitoring.status()))


async def prometheus(request, state):
    m = state.monitoring
    body, content_type = m.prom.exposition(await _usage(state), request.headers.get("accept"))
    return HTTPResponse(body, content_type=content_type)


ROUTES = {
    ("GET", "/"): root,
    ("HEAD", "/"): root,
    ("GET", "/bankml/usage"): usage,
    ("GET", "/bankml/metrics"): metrics,
    ("GET", "/bankml/status"): status,
    ("GET", "/metrics"): prometheus,
}
