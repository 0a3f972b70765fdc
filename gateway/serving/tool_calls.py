"""Tool calls on the native engine: the request's `tools` read, the prompt and grammar they make for the
served template, and the answer parsed back into OpenAI's `tool_calls`.

The format is chosen from the template's text as llama.cpp's common/chat.cpp chooses it (`tool_format`):
`hermes` (`<tool_call>` JSON `</tool_call>`: Hermes 2 Pro, Qwen 2.5/3), `llama3` (an `ipython` header:
the whole answer is one call), else `generic` (`common_chat_params_init_generic`: a system instruction
and an answer constrained to `{"tool_call"|"tool_calls"|"response": ...}`; past calls and tool results are
written back in that JSON, which a template without tools would drop). Unlike llama.cpp's generic schema,
the model writes no call `id`: a small model spends up to 64 tokens on each; every id is ours.

A call's arguments are constrained to its function's parameters, each object `closed` (OpenAI's strict
mode). The parameters are bounded when they are read (`read_tools`: constraints.check_schema, the tools'
values counted together), and every walk over them visits each value once. A required call is constrained in every format, so it always parses; under `auto` only the generic
format constrains, and a hermes/llama3 answer that does not parse stays content. `parallel_tool_calls`
defaults to false, as llama-server reads it. The receipt's `response_sha256` covers the model's text as
generated, before content and calls are parsed out of it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from bankml.errors import InvalidRequest, NotSupported
from gateway.serving.constraints import MAX_SCHEMA_NODES, check_schema, exact_json
from model import constraint as mc

GENERIC_SYSTEM = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                  "reply to the user's request")
MAX_TOOLS = 128  # a request's functions; more is a 400 (each adds to the prompt and the grammar)
MAX_CALLS = 16  # calls in one answer with parallel_tool_calls: the grammar ends the answer there
_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@dataclass(frozen=True)
class Tools:
    """A request's tools as read: each function's name, description and parameters schema."""

    raw: list[dict]  # the request's `tools` array, for the template
    functions: tuple[dict, ...]  # {"name", "parameters", ["description"]}
    choice: str  # "auto", "none", "required" or "named"
    name: str | None = None  # the function tool_choice names
    parallel: bool = False

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    @property
    def required(self) -> bool:
        return self.choice in ("required", "named")

    def callable(self) -> tuple[dict, ...]:
        return tuple(f for f in self.functions if self.name is None or f["name"] == self.name)


def read_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a body, checked; None when it has no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is None:  # null is absent, as OpenAI and llama-server read it
        choice = "auto"
    if tools is None or tools == []:
        if choice == "required" or isinstance(choice, dict):  # a call asked for, and nothing to call
            raise InvalidRequest(f"Invalid tool_choice: {_short(choice)} asks for a tool call, but the request has "
                                 "no tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest(f"Failed to parse tools: Expected 'tools' to be an array, got {_short(tools)}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"Failed to parse tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    functions = []
    budget = MAX_SCHEMA_NODES  # the tools' schemas make one grammar: their values count together
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"Failed to parse tools: a tool must be {{\"type\": \"function\", \"function\": "
                                 f"{{...}}}}, got {_short(t)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"Failed to parse tools: a function needs a 'name' string, got {_short(fn)}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"Failed to parse tools: function '{name}': 'parameters' must be an object")
        budget -= check_schema(f"tools[{i}].function.parameters", params, budget)
        f = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            f["description"] = fn["description"]
        functions.append(f)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("Failed to parse tools: two functions have the same name")
    parallel = body.get("parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(f"Invalid tool_choice: {choice}")
        return Tools(tools, tuple(functions), choice, None, parallel)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest(f"Invalid tool_choice: {_short(choice)}")
        if name not in names:
            raise InvalidRequest(f"Invalid tool_choice: no function named '{name}' in tools")
        return Tools(tools, tuple(functions), "named", name, parallel)
    raise InvalidRequest(f"Invalid tool_choice: {_short(choice)}")


def _short(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:200] + "..."


def tool_format(template: str | None) -> str:
    """The call format of a chat template (llama.cpp's detection, common/chat.cpp)."""
    src = template or ""
    if "<tool_call>" in src:
        return "hermes"
    if "<|start_header_id|>ipython<|end_header_id|>" in src or "<|python_tag|>" in src:
        return "llama3"
    return "generic"


@dataclass
class ToolPlan:
    """What a request's tools make of one answer: the template's input, the grammar, the parsing."""

    tools: Tools
    format: str
    messages: list[dict]
    template_tools: list[dict] | None
    grammar: str | None
    ids: list[str] = field(default_factory=list)


def plan(tools: Tools | None, messages: list[dict], template: str | None,
         response_schema: Any = None) -> ToolPlan | None:
    """The plan for an answer with `tools` (None when there are none, or tool_choice is none: then the
    conversation renders as it would without them). `response_schema`: response_format's schema, which
    the generic format's `response` takes."""
    if tools is None or not tools.active:
        return None
    if response_schema is not None:
        check_schema("response_format", response_schema)  # read with the body already; cheap to be sure
    try:
        return _plan(tools, messages, template, response_schema)
    except RecursionError:  # the bounds keep every schema within Python's stack; never a 500 if one does not
        raise InvalidRequest("Failed to parse tools: the tools' schemas are nested too deeply") from None


def _plan(tools: Tools, messages: list[dict], template: str | None, response_schema: Any) -> ToolPlan:
    fmt = tool_format(template)
    if fmt == "generic":
        msgs = _generic_history(messages, tools.parallel)
        msgs = _add_system(msgs, generic_system(tools, template))
        return ToolPlan(tools, fmt, msgs, tools.raw, _generic_grammar(tools, response_schema))
    if response_schema is not None:
        raise NotSupported("'response_format' is not supported by bankml serve --native with tools on a "
                           f"template that calls tools in the {fmt} format (only the generic format takes both)")
    grammar = (_hermes_grammar(tools) if fmt == "hermes" else _llama3_grammar(tools)) if tools.required else None
    return ToolPlan(tools, fmt, [_openai_history(m) for m in messages], tools.raw, grammar)


# --- the conversation --------------------------------------------------------------------------------


def _arguments(call: dict) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}


def _openai_history(m: dict) -> dict:
    """A message for a template that reads tool calls: `arguments` as an object (what Hermes and Llama
    templates iterate over), as llama.cpp passes them."""
    if "tool_calls" not in m:
        return m
    calls = []
    for c in m["tool_calls"] or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequest("Failed to parse messages: a tool call needs a 'function' object")
        calls.append({**c, "function": {**fn, "arguments": _arguments(c)}})
    return {**m, "tool_calls": calls}


def _generic_history(messages: list[dict], parallel: bool) -> list[dict]:
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": (c.get("function") or {}).get("name"), "arguments": _arguments(c),
}
                     for c in m["tool_calls"] if isinstance(c, dict)]
            said = {"tool_calls": calls} if parallel or len(calls) > 1 else {"tool_call": calls[0]}
            out.append({"role": "assistant", "content": json.dumps(said, indent=2, ensure_ascii=False)})
        elif m.get("role") == "tool":
            reply = {"tool_response": {"tool": m.get("name") or m.get("tool_name") or "", "content": m.get("content")}}
            out.append({"role": "user", "content": json.dumps(reply, indent=2, ensure_ascii=False)})
        else:
            out.append(m)
    return out


def generic_system(tools: Tools, template: str | None) -> str:
    """The generic format's instruction; a template that does not read `tools` (SmolLM2's, Gemma 3's)
    gets them listed there too, as minja's tools polyfill lists them, so the model knows what it calls."""
    if template is not None and "tools" in template:
        return GENERIC_SYSTEM
    listed = json.dumps([{"type": "function", "function": f} for f in tools.callable()], indent=2, ensure_ascii=False)
    return f"{GENERIC_SYSTEM}\n\nYou can call any of the following tools to satisfy the user's requests: {listed}"


def _add_system(messages: list[dict], text: str) -> list[dict]:
    """minja's add_system: appended to a first system message, else a system message first."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = (first.get("content") or "") + "\n\n" + text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# --- grammars -------------------------------------------------------------------------------------------


_VALUES = ("const", "enum", "default", "examples")  # data, not schemas: kept as they are
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema


def closed(schema: Any) -> Any:
    """A parameters schema whose objects take only the properties they declare: an object schema with
    `properties` and no `additionalProperties` (or `patternProperties`) gets `additionalProperties: false`,
    as OpenAI's strict mode asks, so a call never carries an argument its function does not know.
    Each value is visited once (the schema is bounded by `read_tools`, so the recursion is too)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _VALUES:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: closed(s) for name, s in v.items()}
        else:
            out[k] = closed(v)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _call_schema(f: dict, args_key: str) -> dict:
    props: dict[str, Any] = {"name": {"type": "string", "const": f["name"]}, args_key: closed(f["parameters"])}
    required = ["name", args_key]
    schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if "description" in f:
        schema["description"] = f["description"]
    return schema


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def generic_schema(tools: Tools, response_schema: Any = None) -> dict:
    """llama.cpp's generic schema: a call (or calls), or unless required a response."""
    calls = [_call_schema(f, "arguments") for f in tools.callable()]
    if tools.parallel:
        call = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": _one_of(calls),
                                                                  "minItems": 1, "maxItems": MAX_CALLS}},
                "required": ["tool_calls"], "additionalProperties": False}
    else:
        call = {"type": "object", "properties": {"tool_call": _one_of(calls)}, "required": ["tool_call"],
                "additionalProperties": False}
    if tools.required:
        return call
    response = response_schema if response_schema is not None else {"type": "string"}
    return {"anyOf": [call, {"type": "object", "properties": {"response": response}, "required": ["response"],
                             "additionalProperties": False}]}


def _compiled(build, *args) -> str:
    try:
        return build(*args)
    except mc.GrammarRejected as e:
        raise InvalidRequest(f"Failed to initialize samplers: the tools' grammar does not compile: {e}") from None


def _generic_grammar(tools: Tools, response_schema: Any) -> str:
    # exact_json: the schemas' numbers as the request wrote them
    return _compiled(mc.json_schema_grammar, exact_json(generic_schema(tools, response_schema)))


def _lark_json(schema: dict) -> str:
    return "%json " + exact_json({**schema, "x-guidance": mc.JSON_OPTIONS})


def _hermes_grammar(tools: Tools) -> str:
    fn = _lark_json(_one_of([_call_schema(f, "arguments") for f in tools.callable()]))
    more = f' ("\\n" call){{0,{MAX_CALLS - 1}}}' if tools.parallel else ""
    lark = f'start: call{more}\ncall: "<tool_call>\\n" fn "\\n</tool_call>"\nfn: {fn}\n'
    return _compiled(mc.lark_grammar, lark)


def _llama3_grammar(tools: Tools) -> str:
    fn = _lark_json(_one_of([_call_schema(f, "parameters") for f in tools.callable()]))
    return _compiled(mc.lark_grammar, f"start: fn\nfn: {fn}\n")


# --- the answer --------------------------------------------------------------------------------------


def new_call_id() -> str:
    """llama-server's form: 32 random letters and digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(32))


def openai_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"type": "function", "function": {"name": name, "arguments": args}, "id": call_id or new_call_id()}


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[dict]  # OpenAI's tool_calls entries


def parse(p: ToolPlan, text: str) -> Parsed:
    """The answer's content and calls. Text that does not parse as the format's calls is content."""
    if p.format == "generic":
        return _parse_generic(p, text)
    if p.format == "hermes":
        return _parse_hermes(p, text)
    return _parse_llama3(p, text)


def _known(p: ToolPlan, name: Any) -> bool:
    return isinstance(name, str) and any(f["name"] == name for f in p.tools.functions)


def _parse_generic(p: ToolPlan, text: str) -> Parsed:
    try:
        value = json.loads(text)
    except ValueError:  # cut short (the length limit): a response's text so far, else the text as it is
        m = _RESPONSE_START.match(text)
        return Parsed(_partial_string(text[m.end():]) if m else text, [])
    if not isinstance(value, dict):
        return Parsed(text, [])
    if "response" in value and len(value) == 1:
        r = value["response"]
        return Parsed(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False), [])
    raw = value.get("tool_calls") if "tool_calls" in value else [value.get("tool_call")]
    calls = []
    for c in raw if isinstance(raw, list) else []:
        if not isinstance(c, dict) or not _known(p, c.get("name")):
            return Parsed(text, [])
        calls.append(openai_call(c["name"], c.get("arguments", {})))
    return Parsed(None, calls) if calls else Parsed(text, [])


_DECODER = json.JSONDecoder()


def _parse_hermes(p: ToolPlan, text: str) -> Parsed:
    content, calls, at = [], [], 0
    while True:
        start = text.find("<tool_call>", at)
        if start < 0:
            content.append(text[at:])
            break
        content.append(text[at:start])
        body = start + len("<tool_call>")
        ws = len(text) - len(text[body:].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, ws)
        except ValueError:
            content.append(text[start:])
            break
        close = text.find("</tool_call>", end)
        if not isinstance(value, dict) or not _known(p, value.get("name")) or \
                (close >= 0 and text[end:close].strip()):
            content.append(text[start:])
            break
        calls.append(openai_call(value["name"], value.get("arguments", {})))
        at = close + len("</tool_call>") if close >= 0 else len(text)
    joined = "".join(content).strip()  # the text around the calls, as a stream can send it
    return Parsed(joined or None if calls else joined, calls)


def _parse_llama3(p: ToolPlan, text: str) -> Parsed:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith("{"):
        return Parsed(text, [])
    try:
        value, end = _DECODER.raw_decode(body)
    except ValueError:
        return Parsed(text, [])
    if body[end:].strip() or not isinstance(value, dict) or not _known(p, value.get("name")):
        return Parsed(text, [])
    args = value.get("parameters", value.get("arguments", {}))
    return Parsed(None, [openai_call(value["name"], args)])


# --- streaming -------------------------------------------------------------------------------------------

_RESPONSE_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')


class ToolStream:
    """The deltas of a streamed answer with tools: content as soon as it is known to be content, each
    call whole once it is complete (OpenAI's `tool_calls` deltas: index, id, type, name, arguments).
    What is sent assembles to `parse` of the whole text."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan = p
        self.text = ""
        self.sent_content = ""
        self._at: int | None = None  # generic: where the response string's undecoded text starts
        self._decoded = ""  # generic: the response string decoded so far

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        """('content', str) and ('call', dict with index) deltas that `piece` makes sendable."""
        self.text += piece
        return self._content(self._streamable())

    def finish(self) -> tuple[list[tuple[str, Any]], Parsed]:
        parsed = parse(self.plan, self.text)
        out: list[tuple[str, Any]] = []
        if parsed.calls:
            # content before the calls (hermes) may have been sent; what is left of it goes first
            out += self._content(parsed.content or "") if (parsed.content or "").startswith(self.sent_content) \
                else []
            for i, c in enumerate(parsed.calls):
                out.append(("call", {"index": i, **c}))
        else:
            out += self._content(parsed.content or "")
        return out, parsed

    def _content(self, known: str) -> list[tuple[str, Any]]:
        if not known.startswith(self.sent_content) or len(known) == len(self.sent_content):
            return []
        new = known[len(self.sent_content):]
        self.sent_content = known
        return [("content", new)]

    def _streamable(self) -> str:
        """The content that the text so far is sure to have."""
        t = self.text
        if self.plan.format == "generic":
            if self._at is None:
                m = _RESPONSE_START.match(t)
                if m is None:
                    return ""
                self._at = m.end()
            piece, self._at = _decode_from(t, self._at)  # only what came since the last piece
            self._decoded += piece
            return self._decoded
        if self.plan.format == "llama3":
            s = t.lstrip()
            if not s or s[0] == "{" or "<|python_tag|>".startswith(s[:14]) or s.startswith("<|python_tag|>"):
                return ""  # may be a call: held until the end
            return t
        # hermes: the content before a call, less what may start one; stripped as `parse` strips it
        t = t.lstrip()
        cut = t.find("<tool_call>")
        if cut >= 0:
            return t[:cut].rstrip()
        for k in range(min(len(t), len("<tool_call>") - 1), 0, -1):
            if "<tool_call>".startswith(t[-k:]):
                return t[:-k].rstrip()
        return t.rstrip()


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _partial_string(s: str) -> str:
    """The decoded prefix of a JSON string's body (after its opening quote), up to its end or to what
    is not complete yet."""
    return _decode_from(s, 0)[0]


def _decode_from(s: str, i: int) -> tuple[str, int]:
    """`_partial_string` of `s[i:]`, and where it stopped (resumable: a stream decodes only what is new)."""
    out = []
    while i < len(s):
        ch = s[i]
        if ch == '"':
            break
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(s):
            break
        e = s[i + 1]
        if e == "u":
            code = _hex4(s[i + 2:i + 6])
            if code is None:
                break
            width = 6
            if 0xD800 <= code < 0xDC00:  # a pair's first half: wait for the second
                low = _hex4(s[i + 8:i + 12]) if s[i + 6:i + 8] == "\\u" else None
                if low is None:
                    break
                code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                width = 12
            out.append(chr(code))
            i += width
            continue
        out.append(_ESCAPES.get(e, e))
        i += 2
    return "".join(out), i


def _hex4(s: str) -> int | None:
    return int(s, 16) if len(s) == 4 and all(c in "0123456789abcdefABCDEF" for c in s) else None


# --- Ollama's form -----------------------------------------------------------------------------------


def ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool_calls as Ollama's message.tool_calls: `{"id", "function": {"index", "name",
    "arguments"}}`, the arguments an object (api/types.go ToolCall)."""
    out = []
    for i, c in enumerate(calls):
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = fn["arguments"]
        out.append({"id": c["id"], "function": {"index": i, "name": fn["name"], "arguments": args}})
    return out


def from_ollama_calls(v: Any) -> list[dict]:
    """A history message's Ollama tool_calls in OpenAI's form (the arguments kept as the object)."""
    if not isinstance(v, list):
        raise InvalidRequest("tool_calls must be an array")
    out = []
    for c in v:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"a tool call needs a 'function' with a 'name', got {_short(c)}")
        cid = c.get("id") if isinstance(c.get("id"), str) and c["id"] else new_call_id()
        out.append({"type": "function", "id": cid,
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}})
    return out
