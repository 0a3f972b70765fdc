"""`GET /v1/models` and `GET /v1/models/{model}` for both SDKs that read them.

Anthropic's clients send `anthropic-version` on every request and read Anthropic's list (`data` of
`{"type": "model", "id", "display_name", "created_at"}`, `first_id`, `last_id`, `has_more`); everyone
else gets OpenAI's (gateway/openai/llama_routes.py). The models are the same: every pin by its file
name, then every derived model by its tag; `created_at` is the pinned file's (or the derived model's)
time, in RFC 3339.
"""

from __future__ import annotations

from urllib.parse import unquote

from bankml import jstr
from bankml.errors import ModelNotFound
from gateway.http.errors import Api, json_response, render
from gateway.http.timestamps import created_at
from gateway.openai import llama_routes
from gateway.serving.answer import off_loop
from gateway.serving.registry import Registry, derived_with_base


def wants_anthropic(request) -> bool:
    return "anthropic-version" in request.headers


async def models(request, state):
    if not wants_anthropic(request):
        return await llama_routes.models(request, state)
    data = await off_loop(anthropic_models, state.registry)
    return json_response(jstr.dumps({"data": data, "first_id": data[0]["id"] if data else None,
                                     "last_id": data[-1]["id"] if data else None, "has_more": False}))


async def model(request, state):
    if not wants_anthropic(request):
        return await llama_routes.model(request, state)
    wanted = unquote(request.raw_url.decode("latin-1").partition("?")[0].rpartition("/")[2])
    for m in await off_loop(anthropic_models, state.registry):
        if m["id"] == wanted:
            return json_response(jstr.dumps(m))
    return render(ModelNotFound(f"model: {wanted}"), Api.ANTHROPIC)  # Anthropic's words for an unknown model


def anthropic_models(registry: Registry) -> list[dict]:
    out = [_info(p.file_name, created_at(p.modified_at)) for p in registry.pins]
    out += [_info(d.tag, d.created_at or created_at(0)) for d, _ in derived_with_base(registry)]
    return out


def _info(name: str, created_at: str) -> dict:
    return {"type": "model", "id": name, "display_name": name, "created_at": created_at}

