"""llama-server's routes that bankml serve --native does not serve, each refused by name.

An unknown route is a 404 (as the Rust bankml answers it); a route llama-server b11434 has
(tools/server/server.cpp's table) gets 501 not_supported_error with the reason instead, so its client
learns why. Where llama-server itself refuses a route by default (/cors-proxy, /tools), or answers it
truthfully for us too (GET /lora-adapters: `[]`), its own recorded answer is given
(tests/fixtures/llama_small_smollm2.json).
"""

from __future__ import annotations

from bankml.errors import NotServed
from gateway.http.errors import json_response
from gateway.http.sanic_app import takes_query

_FEATURE_DISABLED = '{"error": {"message": "this feature is disabled", "type": "feature_disabled"}}'


def refusal(why: str):
    """A route handler that answers 501 not_supported_error with `why`."""
    async def refuse(request, state):
        raise NotServed(why)

    return takes_query(refuse)  # llama-server's routes take a ?query; the refusal is the same with one


RERANK = refusal("bankml serve --native does not serve reranking: it runs no reranker model "
                 "(llama-server's --reranking)")
LORA_CHANGE = refusal("bankml serve --native loads no LoRA adapters: there are none to change")
CONTROL = refusal("bankml serve --native does not serve /v1/chat/completions/control: a running "
                  "completion is stopped by closing its connection")
TRANSCRIPTIONS = refusal("The current model does not support audio input.")  # llama-server's words, true here
SYSTEMONE = refusal("bankml serve --native does not serve /v1/systemone (llama-server's decision models)")
STREAMS = refusal("bankml serve --native keeps no streams to resume: a stream ends with its connection")


async def lora_adapters(request, state):
    """GET /lora-adapters: the adapters loaded, none (llama-server without --lora answers [])."""
    return json_response("[]")


async def feature_disabled(request, state):
    """llama-server's answer on /cors-proxy and /tools when they are off (its res_403, server.cpp)."""
    return json_response(_FEATURE_DISABLED, 403)
