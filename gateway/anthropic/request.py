"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's body read into our chat request.

The parser checks Anthropic's fields as its API does (an unknown top-level field is its 400 "Extra inputs
are not permitted"; `max_tokens` is required on create), refuses by name what we cannot honour (image and
document blocks, server tools, MCP servers...), then writes the request as the OpenAI chat body our chat
parser reads (gateway/openai/chat_request.py: the sampler fields, stop strings, tools and the history's
checks are llama-server's, once):

- `system` (a string or text blocks) -> a first system message;
- a user turn's `tool_result` blocks -> `tool` messages (before the turn's text), `is_error` said in the
  content; an assistant turn's `tool_use` blocks -> `tool_calls`, its `thinking` -> `reasoning_content`
  (what a thinking template reads back), `redacted_thinking` dropped (we cannot read it);
- `tools[].input_schema` -> `parameters`; `tool_choice` auto/any/tool/none -> auto/required/named/none,
  `disable_parallel_tool_use` -> `parallel_tool_calls` false (Anthropic allows parallel calls by default);
- `thinking` enabled -> Reasoning(enable=True, budget=budget_tokens), disabled -> Reasoning(enable=False),
  absent -> the template's default; the thought is always split into `thinking` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bankml.errors import InvalidRequest, NotSupported
from gateway.serving.reasoning import Reasoning

# top-level fields, as Anthropic's API takes them; another is its 400
CREATE_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p",
                           "top_k", "tools", "tool_choice", "thinking", "metadata", "stream", "service_tier",
                           "container", "mcp_servers", "context_management", "output_format", "output_config",
                           "inference_geo", "cache_control", "diagnostics", "speed", "user_profile_id",
                           "workspace_id"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers",
                          "context_management", "output_format", "output_config", "cache_control"})
# accepted and not acted on, as none changes the answer: `cache_control` (the prefix cache is always on),
# `speed`, `service_tier` (one machine, one speed), `user_profile_id`, `workspace_id`, `metadata` (attribution)
# Anthropic's fields we cannot honour: each a 400 naming it
REFUSED_FIELDS = {
    "container": "no code-execution containers",
    "mcp_servers": "no MCP connector: give the tools as `tools`",
    "context_management": "no server-side context editing",
    "output_format": "no structured outputs on /v1/messages yet (use /v1/chat/completions' response_format)",
    "output_config": "no output configuration",
    "inference_geo": "one machine answers",
    "diagnostics": "no prompt-cache diagnostics",
}
# block types Anthropic takes that a text model here cannot read
UNREAD_BLOCKS = {
    "image": "the model reads text only",
    "document": "the model reads text only",
    "search_result": "no search results in the prompt",
    "container_upload": "no code-execution containers",
    "server_tool_use": "no server tools",
    "web_search_tool_result": "no server tools",
    "web_fetch_tool_result": "no server tools",
    "code_execution_tool_result": "no server tools",
    "bash_code_execution_tool_result": "no server tools",
    "text_editor_code_execution_tool_result": "no server tools",
    "mcp_tool_use": "no MCP connector",
    "mcp_tool_result": "no MCP connector",
}
SERVICE_TIERS = ("auto", "standard_only")


@dataclass(frozen=True)
class MessagesRequest:
    """Anthropic's request, read: the chat body our chat parser takes, and what only this dialect says."""

    chat_body: dict  # the OpenAI chat body (model, messages, max_tokens, stop, sampler fields, tools, stream)
    reasoning: Reasoning
    thinking: bool  # `thinking` enabled: the answer's thought is a block even on a template without tags
    omit_thought: bool  # thinking.display "omitted": the block's text is empty, its signature kept
    thoughts: list[str | None]  # each history message's thinking (its reasoning_content), by index
    stream: bool


def bad(message: str) -> InvalidRequest:
    return InvalidRequest(message)


def _refused(where: str, why: str) -> NotSupported:
    return NotSupported(f"{where} is not supported by bankml serve --native: {why}")


def _type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _int(doc: dict, name: str, minimum: int) -> int:
    v = doc[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name}: Input should be a valid integer")
    if v < minimum:
        raise bad(f"{name}: Input should be greater than or equal to {minimum}")
    return v


def _number(doc: dict, name: str, low: float, high: float | None) -> float:
    v = doc[name]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"{name}: Input should be a valid number")
    if v < low or (high is not None and v > high):
        raise bad(f"{name}: Input should be between {low:g} and {high:g}" if high is not None
                  else f"{name}: Input should be greater than or equal to {low:g}")
    return float(v)


def read_messages_request(doc: Any, count: bool = False) -> MessagesRequest:
    """The create (or, `count`, the count_tokens) body checked and written as our chat body."""
    if not isinstance(doc, dict):
        raise bad("The request body must be a JSON object")
    allowed = COUNT_FIELDS if count else CREATE_FIELDS
    for name in doc:
        if name not in allowed:
            raise bad(f"{name}: Extra inputs are not permitted")
    for name, why in REFUSED_FIELDS.items():
        if doc.get(name) is not None:
            raise _refused(f"'{name}'", why)
    if "model" not in doc:
        raise bad("model: Field required")
    if not isinstance(doc["model"], str):
        raise bad("model: Input should be a valid string")
    if "messages" not in doc:
        raise bad("messages: Field required")
    body: dict[str, Any] = {"model": doc["model"]}
    stream = False
    if not count:
        if "max_tokens" not in doc:
            raise bad("max_tokens: Field required")
        body["max_tokens"] = _int(doc, "max_tokens", 1)
        if doc.get("stream") is not None:
            if not isinstance(doc["stream"], bool):
                raise bad("stream: Input should be a valid boolean")
            stream = doc["stream"]
        body["stream"] = stream
        if doc.get("temperature") is not None:
            body["temperature"] = _number(doc, "temperature", 0.0, 1.0)
        if doc.get("top_p") is not None:
            body["top_p"] = _number(doc, "top_p", 0.0, 1.0)
        if doc.get("top_k") is not None:
            body["top_k"] = _int(doc, "top_k", 0)
        stops = doc.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad("stop_sequences: Input should be a valid list of strings")
            body["stop"] = stops
        metadata = doc.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise bad("metadata: Input should be a valid dictionary")
        speed = doc.get("speed")
        if speed is not None and speed not in ("standard", "fast"):
            raise bad("speed: Input should be 'standard' or 'fast'")
        tier = doc.get("service_tier")
        if tier is not None and tier not in SERVICE_TIERS:
            raise bad(f"service_tier: Input should be {' or '.join(repr(t) for t in SERVICE_TIERS)}")
    reasoning, thinking, omit = _thinking(doc.get("thinking"), body.get("max_tokens"))
    messages, thoughts = _conversation(doc.get("system"), doc["messages"])
    body["messages"] = messages
    tools = _tools(doc.get("tools"))
    if tools is not None:
        body["tools"] = tools
    choice = doc.get("tool_choice")
    if choice is not None:
        body["tool_choice"], parallel = _tool_choice(choice)
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
    if tools and "parallel_tool_calls" not in body:
        body["parallel_tool_calls"] = True  # Anthropic's default
    return MessagesRequest(body, reasoning, thinking, omit, thoughts, stream)


def _thinking(v: Any, max_tokens: int | None) -> tuple[Reasoning, bool, bool]:
    """(how the answer thinks, thinking enabled, its text omitted)."""
    if v is None:
        return Reasoning(), False, False
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "disabled":
        return Reasoning(enable=False), False, False
    if kind == "enabled":
        budget = v.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise bad("thinking.enabled.budget_tokens: Field required" if budget is None
                      else "thinking.enabled.budget_tokens: Input should be a valid integer")
        if budget < 1:
            raise bad("thinking.enabled.budget_tokens: Input should be greater than or equal to 1")
        if max_tokens is not None and budget >= max_tokens:
            raise bad("`max_tokens` must be greater than `thinking.budget_tokens`")
        display = v.get("display")
        if display not in (None, "summarized", "omitted"):
            raise bad("thinking.enabled.display: Input should be 'summarized' or 'omitted'")
        return Reasoning(enable=True, budget=budget), True, display == "omitted"
    if kind in ("adaptive", "between_tools"):
        raise _refused(f"thinking.type '{kind}'", "give a budget with {\"type\": \"enabled\", \"budget_tokens\": N}")
    raise bad("thinking: Input tag does not match any of the expected tags: 'enabled', 'disabled'")


def _text_of(blocks: Any, where: str) -> str:
    """A `system` or tool_result content: a string, or text blocks (joined by newlines)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where}: Input should be a valid string or a list of blocks")
    texts = []
    for j, b in enumerate(blocks):
        kind = _kind(b, f"{where}.{j}")
        if kind != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}.{j}: a text block ({{\"type\": \"text\", \"text\": \"...\"}}) is expected, "
                      f"got {_short(b)}")
        texts.append(b["text"])
    return "\n".join(texts)


def _short(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:200] + "..."


def _conversation(system: Any, turns: Any) -> tuple[list[dict], list[str | None]]:
    """Anthropic's system and turns as the chat messages a template reads; each message's thinking."""
    out: list[dict] = []
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(turns, list):
        raise bad("messages: Input should be a valid list")
    if not turns:
        raise bad("messages: at least one message is required")
    names: dict[str, str] = {}  # tool_use id -> its tool's name, for the tool_result that answers it
    thoughts: list[str | None] = [None] * len(out)
    for i, turn in enumerate(turns):
        where = f"messages.{i}"
        if not isinstance(turn, dict):
            raise bad(f"{where}: Input should be a valid dictionary")
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role: Input should be 'user' or 'assistant'")
        if "content" not in turn:
            raise bad(f"{where}.content: Field required")
        content = turn["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            thoughts.append(None)
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content: Input should be a valid string or a list of blocks")
        if role == "user":
            for m in _user_blocks(content, where, names):
                out.append(m)
                thoughts.append(None)
        else:
            m, thought = _assistant_blocks(content, where, names)
            out.append(m)
            thoughts.append(thought)
    return out, thoughts


def _kind(b: Any, at: str) -> Any:
    """A content block's type; a block we cannot read is a 400 naming it."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind in UNREAD_BLOCKS:
        raise _refused(f"{at}: the '{kind}' block", UNREAD_BLOCKS[kind])
    return kind


def _block_text(b: dict, at: str) -> str:
    if not isinstance(b.get("text"), str):
        raise bad(f"{at}.text: Field required")
    return b["text"]


def _user_blocks(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    results, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(b, at)
        if kind == "text":
            texts.append(_block_text(b, at))
        elif kind == "tool_result":
            tool_id = b.get("tool_use_id")
            if not isinstance(tool_id, str):
                raise bad(f"{at}.tool_use_id: Field required")
            text = _text_of(b.get("content", ""), f"{at}.content")
            if b.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": tool_id, "name": names.get(tool_id, ""), "content": text})
        elif kind in ("tool_use", "thinking", "redacted_thinking"):
            raise bad(f"{at}: a '{kind}' block belongs in an assistant message")
        else:
            raise bad(f"{at}.type: unknown block type {_short(kind)}")
    out = results
    if texts or not results:
        out = [*results, {"role": "user", "content": "\n".join(texts)}]
    return out


def _assistant_blocks(blocks: list, where: str, names: dict[str, str]) -> tuple[dict, str | None]:
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(b, at)
        if kind == "text":
            texts.append(_block_text(b, at))
        elif kind == "tool_use":
            tool_id, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not isinstance(tool_id, str) or not isinstance(name, str):
                raise bad(f"{at}: a tool_use block needs 'id' and 'name' strings")
            if not isinstance(args, dict):
                raise bad(f"{at}.input: Input should be a valid dictionary")
            names[tool_id] = name
            calls.append({"id": tool_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{at}.thinking: Field required")
            thoughts.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue  # another server's encrypted thought: nothing a template here can read
        elif kind == "tool_result":
            raise bad(f"{at}: a 'tool_result' block belongs in a user message")
        else:
            raise bad(f"{at}.type: unknown block type {_short(kind)}")
    m: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        m["tool_calls"] = calls
    return m, "\n".join(thoughts) if thoughts else None


def _tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad("tools: Input should be a valid list")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise bad(f"tools.{i}: Input should be a valid dictionary")
        kind = t.get("type", "custom")
        if kind not in ("custom", None):
            raise _refused(f"tools.{i}: the '{kind}' tool", "Anthropic's server and client tools are not run "
                           "here; describe a custom tool with `input_schema`")
        if not isinstance(t.get("name"), str):
            raise bad(f"tools.{i}.name: Field required")
        if "input_schema" not in t:
            raise bad(f"tools.{i}.input_schema: Field required")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> tuple[Any, bool | None]:
    """OpenAI's tool_choice, and parallel_tool_calls (None: the default)."""
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice: Input tag does not match any of the expected tags: 'auto', 'any', 'tool', 'none'")
    disable = v.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad("tool_choice.disable_parallel_tool_use: Input should be a valid boolean")
    parallel = None if disable is None else not disable
    if kind == "tool":
        if not isinstance(v.get("name"), str):
            raise bad("tool_choice.tool.name: Field required")
        return {"type": "function", "function": {"name": v["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
