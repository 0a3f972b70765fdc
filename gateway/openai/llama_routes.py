"""llama-server's endpoints (its tools/server/README.md), on both addresses, so its clients reach us unchanged.

They name no model: they use the most recently used resident one, or verify and load the startup
model (kept forever). `/health` (and `/v1/health`) and `/v1/models` never load; `/health` is 503 with
the reason while the startup model is unusable (its file changed and does not verify again, or it
failed to load), the engine thread of the model it reports is gone, or the server is wedged (a resident
model's engine, or every worker thread, has had work waiting longer than `[limits] wedged_after_s`
without completing any: gateway/http/liveness.py), so a balancer routes away.
`/v1/models` lists every pin of the registry. `/tokenize` and `/detokenize` read their bodies as
b11434 does (tokenize.py), `/props` is props.py's, `/apply-template` reads a chat body as
/v1/chat/completions does. Reading the body, tokenizing and templating run off the event loop (a 16
MiB body would otherwise stall every other client), on a thread of their own: a burst of /tokenize
calls queues behind itself, never in front of the chat answers, which use the loop's default pool.
`/slots` is the current model's scheduler's last snapshot (one entry per sequence slot, `[engine]
max_seqs` of them), in llama-server's shape; `POST /slots/{id}` is gateway/openai/slots.py's. The
routes of llama-server we do not serve are refused by name in refusals.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

from bankml import jstr
from bankml.errors import EngineGone, ModelNotFound, ModelUnusable, NotServed, Overloaded
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.sanic_app import query_of, takes_query
from gateway.openai.chat_request import openai_layer, prompt_ending
from gateway.openai.params_json import params_json
from gateway.openai.props import props_json
from gateway.openai.slots import model_named, slot_model
from gateway.openai.tokenize import detokenize_body, tokenize_json
from gateway.serving.reasoning import read_chat
from gateway.serving.registry import v1_models_data
from gateway.serving.tool_calls import plan as tool_plan
from gateway.serving.tool_calls import read_tools
from model.messages import SequenceState
from model.speculative import Speculation

_TEXT_TOOLS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bankml-text-tools")


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_TEXT_TOOLS, fn, *args)


async def health(request, state):
    res = state.residency
    recent = res.most_recent()
    failure = recent.client.failure if recent is not None else None
    if failure is not None:  # its engine thread is gone: nothing here can answer
        raise EngineGone(f"the engine thread stopped: {failure}")
    unusable = res.unusable.get(state.registry.startup.name)
    if unusable is not None:
        raise ModelUnusable(unusable.message)
    request.app.ctx.liveness.check(res.resident())  # Wedged: a 503 naming what does not move
    return json_response('{"status": "ok"}')


async def props(request, state):
    """llama-server's `GET /props` (gateway/openai/props.py says what each field holds)."""
    loaded = await state.residency.current()
    return json_response(jstr.dumps(await _off_loop(props_json, loaded)))


async def change_props(request, state):
    """`POST /props`: refused as llama-server refuses it without `--props` (there is nothing to change)."""
    raise NotServed("This server does not support changing global properties. Start it with `--props`")


async def models(request, state):
    # off the loop: a derived model's manifest not read yet (or changed) is read and checked from disk
    return json_response(jstr.dumps({"object": "list", "data": await _off_loop(v1_models_data, state.registry)}))


async def model(request, state):
    """OpenAI's `GET /v1/models/{model}`: the listed model of that id, else OpenAI's 404 naming it."""
    wanted = unquote(request.raw_url.decode("latin-1").partition("?")[0].rpartition("/")[2])
    for m in await _off_loop(v1_models_data, state.registry):
        if m["id"] == wanted:
            return json_response(jstr.dumps(m))
    raise ModelNotFound(f"The model '{wanted}' does not exist")


async def tokenize(request, state):
    """llama-server's `POST /tokenize` (gateway/openai/tokenize.py reads the body as b11434 does)."""
    req = await _off_loop(parse_body, request.body)  # JSON as llama-server reads it (a lone surrogate is a 400)
    loaded = await state.residency.current()
    return json_response(await _off_loop(tokenize_json, loaded.model, req))


async def detokenize(request, state):
    """llama-server's `POST /detokenize`: `{"content"}`, every piece with special tokens rendered."""
    req = await _off_loop(parse_body, request.body)
    loaded = await state.residency.current()
    content = await _off_loop(detokenize_body, loaded.model, req)
    return json_response(jstr.dumps({"content": content}))


async def apply_template(request, state):
    """llama-server's `POST /apply-template`: the chat body read as /v1/chat/completions reads it
    (oaicompat_chat_params_parse, its 400s), and the prompt its template makes, `{"prompt"}`."""
    req = await _off_loop(parse_body, request.body)
    _, messages = await _off_loop(openai_layer, req)  # as a chat reads them, content parts too
    ending = prompt_ending(req, messages)  # (add_generation_prompt, continue_final_message)
    loaded = await state.residency.current()
    prompt = await _off_loop(_render, loaded.model, req, messages, ending)
    return json_response(jstr.dumps({"prompt": prompt}))


async def count_tokens(request, state):
    """llama-server's `POST /v1/chat/completions/input_tokens` (handle_count_tokens): the chat body's
    prompt, templated as /apply-template makes it and tokenized with BOS and special tokens, counted."""
    req = await _off_loop(parse_body, request.body)
    _, messages = await _off_loop(openai_layer, req)
    ending = prompt_ending(req, messages)  # (add_generation_prompt, continue_final_message)
    loaded = await state.residency.current()
    prompt = await _off_loop(_render, loaded.model, req, messages, ending)
    tokens = await _off_loop(loaded.model.tokenize, prompt, True, True)
    return json_response(jstr.dumps({"input_tokens": len(tokens), "object": "response.input_tokens"}))


def _render(model, req: dict, messages: list[dict], ending: tuple[bool, bool]) -> str:
    """The prompt text a chat with this body would get: with its tools, as gateway/serving/tool_calls.py plans them,
    and the template's variables (chat_template_kwargs, reasoning_effort, a budget of 0: gateway/serving/reasoning.py)."""
    budget = req.get("reasoning_budget_tokens")
    kwargs = read_chat(req, budget if isinstance(budget, int) and not isinstance(budget, bool) else -1)
    kwargs = kwargs.template_kwargs() or None
    plan = tool_plan(read_tools(req), messages, model.chat_template)
    add_generation_prompt, continue_final = ending
    if plan is None:
        return model.render(messages, add_generation_prompt, None, kwargs, continue_final)
    return model.render(plan.messages, add_generation_prompt, plan.template_tools, kwargs, continue_final)


@takes_query
async def slots(request, state):
    """llama-server's `GET /slots`; `?fail_on_no_slot=<anything>` makes it a 503 while no slot is idle
    (tools/server: any non-empty value, its "no slot available" unavailable_error). `?model=` says
    whose slots, required with several models loaded (slots.py `slot_model`); each slot also says its
    `cache_type`, what its pages hold ([engine] cache_type, $BANKML_CACHE_TYPE)."""
    query = query_of(request)
    client = (await slot_model(state, model_named(None, query))).client  # gateway/openai/slots.py
    if client.failure is not None:
        raise EngineGone(f"the engine thread stopped: {client.failure}")
    stats = client.stats()
    sequences = stats.sequences if stats is not None else ()  # no engine has run: no slots yet
    if any(query.get("fail_on_no_slot", [])) and all(s.is_processing for s in sequences):
        raise Overloaded("no slot available")
    speculation = client.speculation
    return json_response(jstr.dumps([{**slot_json(s, speculation), "cache_type": client.cache_type}
                                     for s in sequences]))


def slot_json(seq: SequenceState, speculation: Speculation | None = None) -> dict[str, Any]:
    """One slot as llama-server's `server_slot::to_json` writes it (tools/server/server-context.cpp).

    Left out on purpose: its `prompt` and `generated`, the text of another client's request, which
    anyone who can reach /slots would read, and for the same reason its `stop` strings. An idle
    slot keeps no memory of its last task (llama-server shows that task's params): `id_task` -1; its
    `n_prompt_tokens` are the tokens it keeps in the cache (its last sequence's, a restored file's,
    0 once erased; absent for a slot that never ran), as llama-server's idle slot shows them.
    `speculative`: the engine drafts (`speculation`: --spec-type other than none), as llama-server's
    slot says it can speculate."""
    speculates = speculation is not None and speculation.on
    out: dict[str, Any] = {"id": seq.id, "n_ctx": seq.n_ctx, "speculative": speculates,
                           "is_processing": seq.is_processing, "id_task": seq.id_task}
    if not seq.is_processing:
        if seq.n_kept is not None:
            out["n_prompt_tokens"] = seq.n_kept
        return out
    out["n_prompt_tokens"] = seq.n_prompt
    out["n_prompt_tokens_processed"] = max(0, seq.n_prompt_done - seq.n_cached)
    out["n_prompt_tokens_cache"] = seq.n_cached
    if seq.params is not None:
        # llama-server's task params (gateway/openai/params_json.py), its stop strings left out (see above)
        out["params"] = {k: v for k, v in params_json(seq.params, speculation=speculation).items() if k != "stop"}
    out["next_token"] = [{
        "has_next_token": True,  # a sequence that stopped has left its slot
        "has_new_line": False,  # llama-server tracks it for n_indent, which this engine does not take
        "n_remain": seq.n_remain,
        "n_decoded": seq.n_decoded,
        "stopping_word": "",
    }]
    return out
