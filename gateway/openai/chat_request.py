"""`POST /v1/chat/completions`: the body read once, as llama-server reads it, before any model work.

`parse_chat(body, defaults)`, in llama-server's order (b11434):
1. the JSON itself (gateway/http/body.py: nlohmann's parse error, 400; a lone surrogate is one there too);
2. the OpenAI layer (tools/server/server-common.cpp, `oaicompat_chat_params_parse`): `stop` as a
   string or an array, json_schema against grammar, `response_format`, the messages and their content
   parts, `logprobs`/`top_logprobs` (default 20, `top_logprobs` alone refused), then every other key
   passed through (`n_predict` over `max_tokens`);
3. llama-server's field table and its sampler set-up (gateway/serving/request_fields.py);
4. ours: a value this engine cannot honour is a 400 naming the field (`refuse_unsupported`).
Messages, statuses and error types are llama-server's, recorded in tests/fixtures/parity_smollm2.json
(tests/test_parity.py); a few of its refusals are 500s (`server_error`), and so are ours.

One difference in order: llama-server renders the template inside step 2, so a template error comes
before a bad field there; here the template renders after the model is acquired (chat.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from bankml.errors import InvalidRequest, NotSupported, RequestFailed
from gateway.http.body import parse_body
from gateway.http.json_values import (
    JsonTypeError,
    dump,
    get_bool,
    get_int,
    get_string,
    has_value,
    json_value,
    type_name,
)
from gateway.serving.constraints import chat_grammar, read_logit_bias, response_schema
from gateway.serving.prompt_input import MEDIA, media_refused
from gateway.serving.reasoning import Reasoning, read_chat
from gateway.serving.request_fields import N_PROBS_MAX, read_fields
from gateway.serving.tool_calls import Tools, read_tools
from model.messages import DEFAULT_SAMPLERS, SamplingParams


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # {"role", "content": str} (text parts joined), for the template
    stream: bool
    params: SamplingParams
    model: str | None
    add_generation_prompt: bool = True
    include_usage: bool = False  # stream_options.include_usage: usage in a last chunk of its own
    n: int = 1  # choices, each its own sequence (llama-server's n_cmpl)
    timings_per_token: bool = False  # `timings` on every streamed chunk
    return_progress: bool = False  # prompt progress chunks while the prompt is computed (streamed only)
    grammar: str | None = None  # llguidance grammar text (gateway/serving/constraints.py), or None
    tools: Tools | None = None  # the request's tools (gateway/serving/tool_calls.py), or None
    response_schema: Any = None  # with tools: the schema a response that does not call answers in
    id_slot: int = -1  # llama-server's: the sequence slot to run in (-1: any)
    reasoning: Reasoning = field(default_factory=Reasoning)  # reasoning_format, chat_template_kwargs, the budget
    continue_final: bool = False  # the final assistant message is continued (prompt_ending)


def bad(message: str) -> InvalidRequest:
    """llama-server's std::invalid_argument: 400 invalid_request_error."""
    return InvalidRequest(message)


def failed(message: str) -> RequestFailed:
    """llama-server's other exceptions (std::runtime_error): 500 server_error."""
    return RequestFailed(message)


# --- 2. the OpenAI layer -------------------------------------------------------------------------

def _content_text(parts: list) -> str:
    for p in parts:
        kind = json_value(p, "type", "", get_string)
        if kind in MEDIA:
            raise media_refused(kind)
        if kind != "text":
            raise bad("unsupported content[].type")
    # common_chat_msg::to_json_oaicompat for a template that reads a string: text parts, one per line
    pieces = []
    for p in parts:
        if "text" not in p:
            raise failed("Failed to parse messages: [json.exception.out_of_range.403] key 'text' not found")
        try:
            piece = get_string(p["text"])
        except JsonTypeError as e:
            raise failed(f"Failed to parse messages: {e}") from None
        pieces.append(piece)
    return "\n".join(pieces)  # one join: adding piece by piece copies the text each time (quadratic)


def check_messages(messages: Any) -> list[dict]:
    """llama-server's checks of `messages`, then common_chat_msgs_parse_oaicompat's; the template's list."""
    if not isinstance(messages, list):
        raise bad("Expected 'messages' to be an array")
    for msg in messages:
        role = json_value(msg, "role", "", get_string)
        has = isinstance(msg, dict) and "content" in msg
        if role != "assistant" and not has:
            raise bad("All non-assistant messages must contain 'content'")
        if role == "assistant" and not has and "tool_calls" not in msg:
            raise bad("Assistant message must contain either 'content' or 'tool_calls'!")
        content = msg.get("content") if has else None
        if has and content is not None and not isinstance(content, str | list):
            raise bad("Expected 'content' to be a string or an array")
    out = []
    for msg in messages:
        if "role" not in msg:
            raise failed(f"Failed to parse messages: Missing 'role' in message: {dump(msg)}")
        try:
            role = get_string(msg["role"])
        except JsonTypeError as e:
            raise failed(f"Failed to parse messages: {e}") from None
        content = msg.get("content")
        text = _content_text(content) if isinstance(content, list) else content or ""
        kept = {k: msg[k] for k in _TOOL_KEYS if k in msg and msg[k] is not None}
        if "tool_calls" in kept and not isinstance(kept["tool_calls"], list):
            raise bad("Failed to parse messages: 'tool_calls' must be an array")
        _check_call_arguments(len(out), kept.get("tool_calls", []))
        out.append({"role": role, "content": text, **kept})
    if len(out) >= 2 and out[-1]["role"] == "assistant" and out[-2]["role"] == "assistant":
        raise bad("Cannot have 2 or more assistant messages at the end of the list.")
    return out


def _check_call_arguments(i: int, calls: list) -> None:
    """A call in the history whose `function.arguments` is a string must be JSON (llama-server parses it
    for the template and answers 400 naming the message); an object is taken as it is."""
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str) and args.strip():
            try:
                json.loads(args)
            except ValueError as e:
                raise bad(f"Failed to parse messages: messages[{i}].tool_calls[{j}].function.arguments is not "
                          f"valid JSON ({e})") from None


_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # kept for the template and gateway/serving/tool_calls.py


def openai_layer(body: Any) -> tuple[dict, list[dict]]:
    """oaicompat_chat_params_parse: llama-server's params from an OpenAI body, and the messages."""
    params: dict[str, Any] = {}
    tools = json_value(body, "tools", None)
    has_tools = isinstance(tools, list) and bool(tools)
    stream = json_value(body, "stream", False, get_bool)
    stop = body.get("stop") if isinstance(body, dict) else None
    params["stop"] = [stop] if isinstance(stop, str) else json_value(body, "stop", [])
    json_schema = json_value(body, "json_schema", None)
    grammar = json_value(body, "grammar", "", get_string)
    if json_schema is not None and grammar:
        raise bad("Cannot use both json_schema and grammar")  # llama-server's words, as a 500
    if isinstance(body, dict) and "response_format" in body:
        rf = json_value(body, "response_format", {})
        kind = json_value(rf, "type", "", get_string)
        if kind and kind not in ("text", "json_object", "json_schema"):
            raise bad(f'response_format type must be one of "text" or "json_object", but got: {kind}')
        wrapper = json_value(rf, "json_schema", None)
        for where, holder in (("response_format.schema", rf), ("response_format.json_schema.schema", wrapper)):
            if isinstance(holder, dict) and holder.get("schema") is not None and not isinstance(holder["schema"], dict):
                raise bad(f"{where} must be a JSON Schema object (got {type_name(holder['schema'])})")
    if not isinstance(body, dict) or "messages" not in body:
        raise bad("'messages' is required")
    messages = check_messages(body["messages"])
    if has_tools and json_value(body, "tool_choice", "auto", get_string) != "none" and "grammar" in body:
        raise bad("Cannot use custom grammar constraints with tools.")
    if json_value(body, "logprobs", False, get_bool):
        if has_tools and stream:
            raise bad("logprobs is not supported with tools + stream")
        params["n_probs"] = json_value(body, "top_logprobs", 20, get_int)
    elif has_value(body, "top_logprobs"):
        raise bad("top_logprobs requires logprobs to be set to true")
    # llama-server's own keys win over the request's (the template decides them), n_predict excepted
    params.update(chat_format=0, grammar_lazy=False, grammar_triggers=[], preserved_tokens=[],
                  generation_prompt="")
    for key, value in body.items():
        if key not in params or key == "n_predict":
            params[key] = value
    return params, messages


# --- 4. ours -------------------------------------------------------------------------------------

# request field -> why ignoring it cannot change the answer (the report's "ignored" column)
IGNORED = {
    "model": "one model is served, and any name is answered by it (as llama-server does)",
    "return_tokens": "only llama-server's /completion shape has `tokens`",
    "response_fields": "only llama-server's /completion shape reads it",
    "sse_ping_interval": "pings are SSE comments, not part of the answer",
    "n_keep": "no context shift: a prompt that does not fit is refused",
    "n_discard": "no context shift",
    "mirostat_tau": "read only by mirostat, which is refused",
    "mirostat_eta": "read only by mirostat, which is refused",
    "adaptive_target": "read only by the adaptive-p sampler, which needs a custom `samplers` (refused)",
    "adaptive_decay": "read only by the adaptive-p sampler, which needs a custom `samplers` (refused)",
    "backend_sampling": "where the sampler runs, not what it draws",
    "user": "llama-server ignores it too",
    "metadata": "llama-server ignores it too",
    "store": "llama-server ignores it too",
    "service_tier": "llama-server ignores it too",
    "parallel_tool_calls": "read with tools (gateway/serving/tool_calls.py); without them nothing to call",
    "tool_choice": "read with tools (gateway/serving/tool_calls.py); without them auto and none are the same",
    "grammar_lazy": "set by llama-server itself from the template",
    "chat_format": "set by llama-server itself from the template",
    "generation_prompt": "set by llama-server itself from the template",
    "grammar_triggers": "set by llama-server itself from the template",
    "preserved_tokens": "set by llama-server itself from the template",
}


def _not_supported(name: str) -> NotSupported:
    return NotSupported(f"'{name}' is not supported by bankml serve --native yet")


def refuse_unsupported(p: dict, request: dict, messages: list[dict]) -> None:
    """What llama-server would honour and this engine cannot: a 400 naming the field."""
    # the field that set n_probs: top_logprobs (with logprobs), else n_probs, else a numeric logprobs
    probs_field = "top_logprobs" if has_value(request, "top_logprobs") else \
        "n_probs" if has_value(request, "n_probs") else "logprobs"
    checks = (
        (probs_field, p["n_probs"] > N_PROBS_MAX, f"at most {N_PROBS_MAX} top logprobs per token"),
        ("mirostat", p["mirostat"] != 0, None),
        ("samplers", p["samplers"] != DEFAULT_SAMPLERS, "only llama-server's default order"),
        ("verbose", p.get("verbose") is True, None),
        ("timings_per_token", p.get("timings_per_token") is True, None),
        ("return_progress", p.get("return_progress") is True, None),
        ("post_sampling_probs", p.get("post_sampling_probs") is True, None),
        ("n_indent", p.get("n_indent", 0) > 0, None),
        ("n_cache_reuse", p.get("n_cache_reuse", 0) > 0, None),
        ("t_max_predict_ms", p.get("t_max_predict_ms", -1) > 0, None),
        ("lora", bool(p.get("lora")), None),
        ("echo", p.get("echo") is True, None),
        ("reasoning_budget_message", bool(p.get("reasoning_budget_message")), "the thought is closed with no message"),
        ("reasoning_budget_start_tag", bool(p.get("reasoning_budget_start_tag")), "the template's own tags are used"),
        ("reasoning_budget_end_tags", bool(p.get("reasoning_budget_end_tags")), "the template's own tags are used"),
        ("reasoning_control", p.get("reasoning_control") is True, None),
        ("chat_parser", bool(p.get("chat_parser")), None),
        # OpenAI's own fields that llama-server passes by; each would change the answer
        ("functions", has_value(request, "functions"), None),
        ("function_call", has_value(request, "function_call"), None),
        ("audio", has_value(request, "audio"), None),
        ("modalities", json_value(request, "modalities", ["text"]) not in (["text"], []), "text only"),
        ("prediction", has_value(request, "prediction"), None),
        ("web_search_options", has_value(request, "web_search_options"), None),
        ("response_format", has_value(request, "response_format") and not isinstance(request["response_format"], dict),
         "it must be an object, e.g. {\"type\": \"text\"}"),
    )
    for name, refused, why in checks:
        if refused:
            if why:
                raise NotSupported(f"'{name}' is not supported by bankml serve --native: {why}")
            raise _not_supported(name)


_SAMPLING = {f.name for f in fields(SamplingParams)}


def parse_chat(body: bytes, defaults: SamplingParams | None = None) -> ChatRequest:
    """The request checked as llama-server checks it, then against what this engine does."""
    return parse_chat_request(parse_body(body), defaults)


def parse_chat_request(request: Any, defaults: SamplingParams | None = None, n_max: int = 1) -> ChatRequest:
    """`parse_chat` on a body already read (`parse_body`): a derived model's layer goes over it first.
    n_max: the bound of `n` (a route that checks it against the engine's sequences later reads it
    unbounded)."""
    params, messages = openai_layer(request)
    p = read_fields(params, defaults or SamplingParams(), n_max=n_max)
    timings_per_token, return_progress = bool(p.get("timings_per_token")), bool(p.get("return_progress"))
    # honoured: every output carries the engine thread's timeline, the engine reports each prefill chunk
    p["timings_per_token"] = p["return_progress"] = False
    refuse_unsupported(p, request, messages)
    reasoning = read_chat(request, int(p.get("reasoning_budget_tokens", -1)), p.get("reasoning_format") or None)
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        model = None  # the route resolved it already (not a string: the startup model)
    grammar = chat_grammar(p, request)
    tools = read_tools(request)
    schema = None
    if tools is not None and tools.active:
        schema, grammar = response_schema(request), None  # the tools' plan makes the grammar
    p["logit_bias"] = read_logit_bias(p.get("logit_bias"))
    p["ignore_eos"] = bool(p.get("ignore_eos"))
    sp = SamplingParams(**{k: v for k, v in p.items() if k in _SAMPLING})
    add_generation_prompt, continue_final = prompt_ending(request, messages)
    return ChatRequest(messages, bool(p["stream"]), sp, model, add_generation_prompt,
                       bool(p["include_usage"]), int(p["n"]), timings_per_token, return_progress, grammar,
                       tools, schema, json_value(request, "id_slot", -1, get_int), reasoning, continue_final)


def prompt_ending(request: dict, messages: list[dict]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message), as llama-server decides them (server-common.cpp,
    oaicompat_chat_params_parse): a final assistant message is continued, its text the start of the answer
    (the assistant prefill Anthropic's and OpenAI's clients use to steer a reply), unless the body asks
    `continue_final_message` itself (vLLM's and transformers' name), which excludes a generation prompt."""
    add = json_value(request, "add_generation_prompt", True, get_bool)
    asked = bool(json_value(request, "continue_final_message", False, get_bool))
    final = messages[-1] if messages else None
    if not asked and final is not None and final["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise bad("Cannot have 2 or more assistant messages at the end of the list.")
        asked, add = True, False
    elif asked and add:
        raise bad("Cannot set both add_generation_prompt and continue_final_message to true.")
    if asked and (final is None or final["role"] != "assistant"):
        raise bad("continue_final_message needs a final assistant message to continue")
    if asked and final.get("tool_calls"):
        raise bad("a final assistant message with tool_calls cannot be continued: send the tools' results")
    return add, asked

