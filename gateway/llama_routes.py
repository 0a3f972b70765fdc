"""llama-server's endpoints (its tools/server/README.md), on both addresses, so its clients reach us unchanged.

They name no model: they use the resident one, or verify and load the startup model. `/health` and
`/v1/models` never load; `/health` is 503 with the reason while the model is unusable (its file
changed and does not verify again, or it failed to load) or the engine thread is gone, so a balancer
routes away. Tokenizing and templating run off the event loop (a 16 MiB body would
otherwise stall every other client).
"""

from __future__ import annotations

import asyncio

from bankml import __version__, jstr
from bankml.errors import EngineGone, InvalidRequest, ModelUnusable
from gateway.errors import json_response
from gateway.openai_chat import parse_json_body, parse_messages


async def health(request, state):
    failure = state.client.failure
    if failure is not None:  # the engine thread is gone: nothing here can answer
        raise EngineGone(f"the engine thread stopped: {failure}")
    unusable = state.residency.unusable
    if unusable is not None:
        raise ModelUnusable(unusable.message)
    return json_response('{"status": "ok"}')


async def props(request, state):
    loaded = await state.residency.current()
    m = loaded.model
    d = m.defaults
    return json_response(jstr.dumps({
        "model_path": loaded.path,
        "n_ctx": m.n_ctx,
        "default_generation_settings": {
            "n_ctx": m.n_ctx,
            "params": {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p},
        },
        "build_info": f"bankML {__version__} native",
    }))


async def models(request, state):
    res = state.residency
    file_name = res.resident.file_name if res.resident else res.file_name
    return json_response(jstr.dumps({"object": "list",
                                     "data": [{"id": file_name, "object": "model", "owned_by": "bankML"}]}))


async def tokenize(request, state):
    req = parse_json_body(request.body)
    if not isinstance(req, dict):
        raise InvalidRequest("body is not a JSON object")
    content = req.get("content")
    text = content if isinstance(content, str) else ""
    add_special = req.get("add_special") is True  # llama-server: false unless asked
    parse_special = req.get("parse_special") is not False  # llama-server: true unless refused
    loaded = await state.residency.current()
    ids = await asyncio.to_thread(loaded.model.tokenize, text, add_special, parse_special)
    # the Rust bankml writes the list compactly: {"tokens": [1,2,3]}
    return json_response('{"tokens": [' + ",".join(map(str, ids)) + "]}")


async def apply_template(request, state):
    req = parse_json_body(request.body)
    if not isinstance(req, dict) or "messages" not in req:
        raise InvalidRequest("no messages")
    messages = parse_messages(req["messages"])
    loaded = await state.residency.current()
    prompt = await asyncio.to_thread(loaded.model.render, messages)
    return json_response(jstr.dumps({"prompt": prompt}))
