"""`POST /v1/responses` (and `/v1/responses/input_tokens`): OpenAI's Responses body read, before any model
work, into what the answer pipeline takes: the conversation for the template, the sampling parameters,
the tools, the grammar of `text.format`, how the answer thinks.

- every top-level key is one we serve, one we read and echo (`metadata`, `user`...), or a 400 naming it
  in OpenAI's shape (`param` set): built-in tools (web_search, file_search, computer_use,
  code_interpreter, mcp, image_generation...), `background`, images and files, `include` of encrypted
  reasoning, `conversation`, `prompt` templates, `truncation: "auto"`;
- `input`, a string or items (messages with string or `input_text`/`output_text` parts, `function_call`,
  `function_call_output`, `reasoning`), becomes items with ids (the store keeps them, `input_items`
  lists them), then chat messages for the template (`messages_of`): developer reads as system, a
  function call joins the assistant message before it, its output is a `tool` message, a reasoning
  item rides on the next assistant message as `reasoning_content` (the templates that read it);
- `tools` (flat, Responses' form) and `tool_choice` are read as chat's (gateway/serving/tool_calls.py),
  `text.format` as chat's `response_format` (gateway/serving/constraints.py);
- `reasoning.effort` is a `Reasoning` (gateway/serving/reasoning.py): "none" turns the template's
  thinking off, the other levels bound the thought (EFFORT_BUDGET).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields
from typing import Any

from bankml.errors import InvalidRequest, NotSupported
from gateway.serving.constraints import chat_grammar, response_schema
from gateway.serving.reasoning import Reasoning
from gateway.serving.request_fields import read_fields
from gateway.serving.tool_calls import Tools, read_tools
from model.messages import SamplingParams

# reasoning.effort -> thought tokens before the thought is closed (-1: unbounded); "none" does not think.
# OpenAI does not publish its budgets; these keep a small local model's thought in proportion to a reply.
EFFORT_BUDGET = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": -1, "xhigh": -1}

# keys read and echoed, that cannot change the answer
_ECHOED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "stream_options")
_SERVED = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
           "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id", "reasoning",
           "truncation", "include", "background", "top_logprobs", "max_tool_calls", *_ECHOED)
# top-level keys we do not serve: each is a 400 naming it when it is set
_REFUSED = ("conversation", "prompt", "prompt_cache_retention", "prompt_cache_options", "context_management",
            "moderation",
            "input_transformations", "partial_images")
_BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
                  "code_interpreter", "mcp", "image_generation", "local_shell", "shell", "custom", "apply_patch")


def refused(param: str, why: str = "") -> NotSupported:
    """A field or value we do not serve: OpenAI's 400 shape, `param` naming it."""
    return NotSupported(f"'{param}' is not supported by bankml serve --native{': ' + why if why else ''}",
                        param=param, code="unsupported_parameter")


def invalid(param: str | None, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_value" if param else None)


def new_id(prefix: str) -> str:
    """OpenAI's form: a prefix and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass(frozen=True)
class ResponsesRequest:
    input_items: list[dict]  # this request's input as items with ids (the store's `input_items`)
    instructions: str | None
    params: SamplingParams
    stream: bool
    store: bool
    tools: Tools | None
    tools_echo: list[dict]  # `tools` as the response echoes them
    tool_choice: Any  # as echoed
    parallel_tool_calls: bool
    grammar: str | None  # text.format's, without active tools
    text_schema: Any  # with active tools: the schema a response that does not call answers in
    text: dict  # `text` as echoed
    reasoning: Reasoning
    effort: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    model: str | None
    echoed: dict  # metadata, user... as echoed


def parse_responses(body: Any, defaults: SamplingParams) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    for key, value in body.items():
        if key in _REFUSED and value is not None:
            raise refused(key)
        if key not in _SERVED and key not in _REFUSED:
            raise InvalidRequest(f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
    if body.get("background") not in (None, False):
        raise refused("background", "every answer is given while the request waits")
    if body.get("top_logprobs") not in (None, 0):
        raise refused("top_logprobs")
    if body.get("max_tool_calls") is not None:
        raise refused("max_tool_calls")
    if body.get("truncation") not in (None, "disabled"):
        raise refused("truncation", "only \"disabled\" (a conversation that does not fit is a 400)")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise invalid("include", "'include' must be an array of strings.")
    for i, what in enumerate(include):
        raise refused(f"include[{i}]", f"{what!r} (we return no encrypted reasoning, logprobs or tool results)")
    stream = _bool(body, "stream", False)
    store = _bool(body, "store", True)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "'instructions' must be a string.")
    items = input_items(body.get("input"))
    tools_echo, chat_tools, choice_echo, chat_choice = _tools(body.get("tools"), body.get("tool_choice"))
    parallel = _bool(body, "parallel_tool_calls", True)
    tools = read_tools({"tools": chat_tools, "tool_choice": chat_choice, "parallel_tool_calls": parallel})
    text, rf = _text(body.get("text"))
    chat_body = {"response_format": rf} if rf is not None else {}
    grammar = chat_grammar({}, chat_body)
    schema = None
    if tools is not None and tools.active:
        schema, grammar = response_schema(chat_body), None  # the tools' plan makes the grammar
    reasoning, effort = _reasoning(body.get("reasoning"))
    max_output = body.get("max_output_tokens")
    if max_output is not None and (not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1):
        raise invalid("max_output_tokens", "'max_output_tokens' must be a positive integer.")
    fields_in = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
    if max_output is not None:
        fields_in["n_predict"] = max_output
    p = read_fields(fields_in, defaults)
    params = SamplingParams(**{k: v for k, v in p.items() if k in _SAMPLING})
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("previous_response_id", "'previous_response_id' must be a string.")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16
                                 or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                                            and len(v) <= 512 for k, v in metadata.items())):
        raise invalid("metadata", "'metadata' must be an object of at most 16 string values (keys up to 64 "
                                  "characters, values up to 512).")
    model = body.get("model") if isinstance(body.get("model"), str) else None
    echoed = {k: body.get(k) for k in _ECHOED if k in body}
    return ResponsesRequest(items, instructions, params, stream, store, tools, tools_echo, choice_echo, parallel,
                            grammar, schema, text, reasoning, effort, previous, max_output, model, echoed)


_SAMPLING = {f.name for f in fields(SamplingParams)}


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(key, f"'{key}' must be a boolean.")
    return v


# --- input ------------------------------------------------------------------------------------------------

_ROLES = ("user", "assistant", "system", "developer")


def input_items(value: Any) -> list[dict]:
    """`input` as items with ids, in the shapes `input_items` lists them."""
    if value is None:
        raise invalid("input", "Missing required parameter: 'input'.")
    if isinstance(value, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise invalid("input", "'input' must be a string or an array of items.")
    return [_item(i, v) for i, v in enumerate(value)]


def _item(i: int, v: Any) -> dict:
    where = f"input[{i}]"
    if not isinstance(v, dict):
        raise invalid(where, f"'{where}' must be an object.")
    kind = v.get("type", "message" if "role" in v else None)
    if kind == "message":
        role = v.get("role")
        if role not in _ROLES:
            raise invalid(f"{where}.role", f"'{where}.role' must be one of {', '.join(_ROLES)}.")
        parts = _parts(f"{where}.content", v.get("content"), role)
        item = {"id": _id_of(v, "msg"), "type": "message", "role": role, "status": "completed", "content": parts}
        return item
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(v.get(key), str):
                raise invalid(f"{where}.{key}", f"'{where}.{key}' must be a string.")
        return {"id": _id_of(v, "fc"), "type": "function_call", "status": "completed", "arguments": v["arguments"],
                "call_id": v["call_id"], "name": v["name"]}
    if kind == "function_call_output":
        if not isinstance(v.get("call_id"), str):
            raise invalid(f"{where}.call_id", f"'{where}.call_id' must be a string.")
        output = v.get("output")
        if isinstance(output, list):
            output = "".join(p["text"] for p in _parts(f"{where}.output", output, "user"))
        if not isinstance(output, str):
            raise invalid(f"{where}.output", f"'{where}.output' must be a string or input_text parts.")
        return {"id": _id_of(v, "fco"), "type": "function_call_output", "status": "completed",
                "call_id": v["call_id"], "output": output}
    if kind == "reasoning":
        if v.get("encrypted_content"):
            raise refused(f"{where}.encrypted_content", "we neither make nor read encrypted reasoning")
        item = {"id": _id_of(v, "rs"), "type": "reasoning", "summary": _texts(f"{where}.summary", v.get("summary"),
                                                                               "summary_text")}
        if v.get("content") is not None:
            item["content"] = _texts(f"{where}.content", v.get("content"), "reasoning_text")
        return item
    if kind == "item_reference":
        raise refused(f"{where}.type", "item references (send the item itself, or use previous_response_id)")
    raise refused(f"{where}.type", f"input items of type {kind!r}")


def _id_of(v: dict, prefix: str) -> str:
    given = v.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _parts(where: str, content: Any, role: str) -> list[dict]:
    """A message's content as parts: user, system and developer text is `input_text`, the assistant's
    `output_text` (as the API lists them)."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            t = part.get("type") if isinstance(part, dict) else None
            if t in ("input_image", "input_file", "input_audio", "input_video"):
                raise refused(f"{where}[{j}].type", f"{t} parts (this server reads text only)")
            if t not in ("input_text", "output_text", "text", "refusal") or \
                    not isinstance(part.get("text", part.get("refusal")), str):
                raise invalid(f"{where}[{j}]", f"'{where}[{j}]' must be an input_text or output_text part.")
            texts.append(part.get("text", part.get("refusal")))
    else:
        raise invalid(where, f"'{where}' must be a string or an array of content parts.")
    if kind == "output_text":
        return [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    return [{"type": "input_text", "text": t} for t in texts]


def _texts(where: str, value: Any, kind: str) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        raise invalid(where, f"'{where}' must be an array of {kind} parts.")
    return [{"type": kind, "text": p["text"]} for p in value]


def messages_of(instructions: str | None, items: list[dict]) -> list[dict]:
    """The conversation for the template (the module's docstring)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    thought: str | None = None
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            sep = "" if role == "assistant" else "\n"
            m = {"role": role, "content": sep.join(p["text"] for p in item["content"])}
            if role == "assistant" and thought is not None:
                m["reasoning_content"], thought = thought, None
            out.append(m)
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                m = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought is not None:
                    m["reasoning_content"], thought = thought, None
                out.append(m)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "name": names.get(item["call_id"], ""),
                        "content": item["output"]})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "\n".join(p["text"] for p in parts) or None
    return out


# --- tools, text, reasoning --------------------------------------------------------------------------


def _tools(tools: Any, choice: Any) -> tuple[list[dict], list[dict] | None, Any, Any]:
    """Responses' flat function tools: as echoed, and as chat's (read_tools reads them)."""
    echo, chat = [], []
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", "'tools' must be an array.")
    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            why = "built-in tools (this server runs none; give a function tool)" if kind in _BUILTIN_TOOLS \
                else "tools other than function tools"
            raise refused(f"tools[{i}].type" if kind is not None else f"tools[{i}]", f"{kind!r}: {why}")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}].name", f"Missing required parameter: 'tools[{i}].name'.")
        params = t.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        strict = t.get("strict", True)
        echo.append({"type": "function", "name": name, "description": t.get("description"), "parameters": params,
                     "strict": True if strict is None else strict})
        fn = {"name": name, "parameters": params}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        chat.append({"type": "function", "function": fn})
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"Invalid value for 'tool_choice': {choice!r}.")
        return echo, chat or None, choice, choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return echo, chat or None, {"type": "function", "name": choice["name"]}, \
            {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise refused("tool_choice", f"a tool_choice of type {kind!r} (auto, none, required or a function)")


def _text(text: Any) -> tuple[dict, dict | None]:
    """`text` as echoed, and the chat `response_format` its format is."""
    if text is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}, None
    if not isinstance(text, dict):
        raise invalid("text", "'text' must be an object.")
    if text.get("verbosity") not in (None, "medium"):
        raise refused("text.verbosity", "only \"medium\" (the model writes as it writes)")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    echo = {"format": fmt, "verbosity": "medium"}
    if kind == "text":
        return echo, None
    if kind == "json_object":
        return echo, {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid("text.format.schema", "'text.format.schema' must be a JSON Schema object.")
        if not isinstance(fmt.get("name"), str):
            raise invalid("text.format.name", "Missing required parameter: 'text.format.name'.")
        return echo, {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": schema,
                                                             "strict": fmt.get("strict")}}
    raise invalid("text.format.type", f"Invalid value for 'text.format.type': {kind!r} (text, json_object or "
                                      "json_schema).")


def _reasoning(value: Any) -> tuple[Reasoning, str | None]:
    """`reasoning` as a Reasoning (absent: the template's default, its thought split out) and its effort."""
    if value is None:
        return Reasoning(), None
    if not isinstance(value, dict):
        raise invalid("reasoning", "'reasoning' must be an object.")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            raise refused(f"reasoning.{key}", "the thought is given whole as reasoning_text, never summarised")
    effort = value.get("effort")
    if effort is None:
        return Reasoning(), None
    if effort not in EFFORT_BUDGET:
        raise invalid("reasoning.effort", f"Invalid value for 'reasoning.effort': {effort!r} "
                                          f"({', '.join(EFFORT_BUDGET)}).")
    if effort == "none":
        return Reasoning(budget=0), effort  # enable_thinking false, and a template that ignores it closed at once
    return Reasoning(enable=True, budget=EFFORT_BUDGET[effort]), effort
