"""llama-server's endpoints (its tools/server/README.md), on both addresses, so its clients reach us unchanged.

They name no model: they use the resident one, or verify and load the startup model. `/health` and
`/v1/models` never load; `/health` is 503 with the reason while the model is unusable (its file
changed and does not verify again, or it failed to load) or the engine thread is gone, so a balancer
routes away. Reading the body, tokenizing and templating run off the event loop (a 16 MiB body would
otherwise stall every other client), on a thread of their own: a burst of /tokenize calls queues
behind itself, never in front of the chat answers, which use the loop's default pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bankml import __version__, jstr
from bankml.errors import EngineGone, InvalidRequest, ModelUnusable, NotSupported
from gateway.chat_request import check_messages, parse_body
from gateway.errors import json_response

_TEXT_TOOLS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bankml-text-tools")


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_TEXT_TOOLS, fn, *args)


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
    req = await _off_loop(parse_body, request.body)  # JSON as llama-server reads it (a lone surrogate is a 400)
    if not isinstance(req, dict):
        raise InvalidRequest("body is not a JSON object")
    content = req.get("content")
    if content is not None and not isinstance(content, str):
        raise NotSupported("'content' as token ids or a mix of text and ids is not supported by bankml serve "
                           "--native yet")
    if req.get("with_pieces") is True:
        raise NotSupported("'with_pieces' is not supported by bankml serve --native yet")
    text = content or ""
    add_special = req.get("add_special") is True  # llama-server: false unless asked
    parse_special = req.get("parse_special") is not False  # llama-server: true unless refused
    loaded = await state.residency.current()
    ids = await _off_loop(loaded.model.tokenize, text, add_special, parse_special)
    # the Rust bankml writes the list compactly: {"tokens": [1,2,3]}
    return json_response('{"tokens": [' + ",".join(map(str, ids)) + "]}")


async def apply_template(request, state):
    req = await _off_loop(parse_body, request.body)
    if not isinstance(req, dict) or "messages" not in req:
        raise InvalidRequest("no messages")
    messages = await _off_loop(check_messages, req["messages"])  # as a chat reads them, content parts too
    loaded = await state.residency.current()
    prompt = await _off_loop(loaded.model.render, messages)
    return json_response(jstr.dumps({"prompt": prompt}))
