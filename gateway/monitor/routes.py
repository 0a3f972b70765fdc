"""The monitor's routes, for the native gateway and P0 alike: each reads `state.monitoring`.

- `GET /bankml/usage`: the usage snapshot (the Rust bankml's keys and order, then ours), shared and cached;
- `GET /bankml/metrics`: the ring of answers (answer_metrics.py);
- `GET /metrics`: Prometheus text (prometheus.py);
- `GET /bankml/status`: the status page's data: what /bankml says, the usage, the last answers;
- `GET /` (and HEAD): the status page for a browser (its Accept names text/html), else one line of
  text for API clients.
The page is gateway/static/status.{html,css,js}, inlined into one document when first served: no
build step, no second request, no URL outside this server.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from sanic import HTTPResponse

from bankml import jstr
from gateway.http.errors import json_response, text_response


@cache
def status_page() -> bytes:
    static = resources.files("gateway") / "static"
    html = (static / "status.html").read_text("utf-8")
    css = (static / "status.css").read_text("utf-8")
    js = (static / "status.js").read_text("utf-8")
    return html.replace("/*STATUS_CSS*/", css).replace("/*STATUS_JS*/", js).encode("utf-8")


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
        return HTTPResponse(status_page(), content_type="text/html; charset=utf-8",
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
