"""`chat_template_caps` for /props: what a chat template can take, found as llama.cpp b11434 finds it
(common/jinja/caps.cpp `caps_get`): render probe conversations and watch which of their values the
template reads.

llama.cpp's own Jinja engine keeps, per value, whether it was used (read as a member, passed to a
filter or a test, looped over) and the operations applied to it (`selectattr`, `array_access`,
`test_is_string`...). Here the probe's dicts, lists and strings are subclasses that carry that record,
and a sandboxed Jinja2 environment (the chat template's own, model/chat_template.py) marks them in
its getitem/getattr, filter, test and loop hooks. The probes and the rules that read the records are
caps.cpp's, in its order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from model import chat_template as ct


class _Stats:
    __slots__ = ("ops", "used")

    def __init__(self) -> None:
        self.used = False
        self.ops: set[str] = set()


class TStr(str):
    stats: _Stats

    def __iter__(self):
        if _State.looping:  # llama.cpp's for loop refuses a string
            self.stats.used = True
            self.stats.ops.add("array_access")
            raise TypeError("Expected iterable or object type in for loop: got String")
        return super().__iter__()


class TList(list):
    stats: _Stats

    def __iter__(self):
        if _State.looping:
            self.stats.used = True
            self.stats.ops.add("array_access")
        return super().__iter__()


class TDict(dict):
    stats: _Stats

    def __iter__(self):
        if _State.looping:
            self.stats.used = True
            self.stats.ops.add("object_access")
        return super().__iter__()


class _Looping(threading.local):
    looping = True  # False while a filter runs (its own iteration is not the template's loop)


_State = _Looping()


def track(v: Any) -> Any:
    """The probe value `v` as tracked values (JSON-like: dicts, lists, strings, scalars)."""
    if isinstance(v, dict):
        out: Any = TDict({k: track(x) for k, x in v.items()})
    elif isinstance(v, list):
        out = TList(track(x) for x in v)
    elif isinstance(v, str):
        out = TStr(v)
    else:
        return v
    out.stats = _Stats()
    return out


def _mark(v: Any, deep: bool = False) -> None:
    stats = getattr(v, "stats", None)
    if isinstance(stats, _Stats):
        stats.used = True
    if deep:  # through any container (a filter's list of tracked values too), without counting as a loop
        if isinstance(v, dict):
            for x in dict.values(v):
                _mark(x, True)
        elif isinstance(v, list | tuple):
            for x in list.__iter__(v) if isinstance(v, list) else v:
                _mark(x, True)


def _op(v: Any, name: str) -> None:
    stats = getattr(v, "stats", None)
    if isinstance(stats, _Stats):
        stats.used = True
        stats.ops.add(name)


class _TrackingEnvironment(ct._Environment):
    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        # llama.cpp's engine lets a template append to its own lists: so do the probes (their data is ours)
        return jinja2.sandbox.SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        self._accessed(obj, argument, value)
        return value

    def getattr(self, obj: Any, attribute: str) -> Any:
        value = super().getattr(obj, attribute)
        self._accessed(obj, attribute, value)
        if attribute == "get" and isinstance(obj, TDict):
            # `{% set x = m.get("k") %}` then `{{ x }}`: llama.cpp marks the value at the lookup of `x`,
            # which Jinja2 does not show us; the value got is taken as used
            def get(key: Any, default: Any = None) -> Any:
                got = dict.get(obj, key, default)
                _mark(got)
                return got

            return get
        return value

    def _accessed(self, obj: Any, key: Any, value: Any) -> None:
        if isinstance(value, jinja2.Undefined):
            return
        if callable(value) and not isinstance(value, str | list | dict):
            # a built-in method (message.get, content.strip): llama.cpp's try_builtin_func names it
            _op(obj, str(key))
            return
        _mark(value)
        if isinstance(key, int):  # a bool too, as llama.cpp
            _op(obj, "array_access")
        else:
            _op(obj, "object_access")


def _tracking_filter(name: str, fn: Callable) -> Callable:
    deep = name in ("tojson", "string")

    def run(*args: Any, **kwargs: Any) -> Any:
        _State.looping, was = False, _State.looping
        try:
            # jinja2's pass_context / pass_environment filters get those first; the value follows
            value = next((a for a in args if isinstance(getattr(a, "stats", None), _Stats)), None)
            if value is not None:
                _op(value, name)
            if deep:
                for a in args:
                    _mark(a, True)
            out = fn(*args, **kwargs)
            # llama.cpp's map/select/... make arrays of the same values: a later tojson still reaches them
            return list(out) if isinstance(out, Iterator) else out
        finally:
            _State.looping = was

    for attr in ("jinja_pass_arg",):
        if hasattr(fn, attr):
            setattr(run, attr, getattr(fn, attr))
    return run


def _tracking_test(name: str, fn: Callable) -> Callable:
    def run(value: Any, *args: Any, **kwargs: Any) -> Any:
        _op(value, f"test_is_{name}")
        return fn(value, *args, **kwargs)

    return run


class _Generation(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}...{% endgeneration %}` (a training mask): llama.cpp's engine
    renders its body; so do the probes."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=1)
def _env() -> _TrackingEnvironment:
    env = _TrackingEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                               undefined=jinja2.ChainableUndefined, extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters.update(ct._ENV.filters)
    env.globals.update(ct._ENV.globals)
    env.filters = {n: _tracking_filter(n, f) for n, f in env.filters.items()}
    env.tests = {n: _tracking_test(n, f) for n, f in env.tests.items()}
    env.globals["strftime_now"] = lambda fmt: ""
    return env


def _execute(template: jinja2.Template, messages: list, tools: list | None = None,
             extra: dict | None = None) -> tuple[bool, Any, Any, dict, str]:
    context = {"messages": track(messages), "tools": track(tools if tools is not None else []),
               "bos_token": "", "eos_token": "", "add_generation_prompt": True, **(extra or {})}
    try:
        return True, context["messages"], context["tools"], context, template.render(context)
    except Exception:  # a probe the template cannot take tells its own story, as in caps.cpp
        return False, context["messages"], context["tools"], context, ""


def _used(v: Any) -> bool:
    return bool(getattr(v, "stats", None) and v.stats.used)


def _has_op(v: Any, name: str) -> bool:
    return bool(getattr(v, "stats", None) and name in v.stats.ops)


_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}]


def _tool_conversation(args: Any, calls: int = 1) -> list:
    return [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call0000{i + 1}", "type": "function", "function": {"name": "tool1", "arguments": args}}
            for i in range(calls)]},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


@lru_cache(maxsize=16)
def template_caps(source: str) -> dict[str, bool]:
    """caps::to_map() for the template `source` (keys sorted, as std::map writes them)."""
    try:
        template = _env().from_string(source)
    except jinja2.TemplateSyntaxError:
        template = None
    caps = {"supports_tools": True, "supports_tool_calls": True, "supports_system_role": True,
            "supports_parallel_tool_calls": True, "supports_preserve_reasoning": False,
            "supports_reasoning_effort": False, "supports_string_content": True,
            "supports_typed_content": False, "supports_object_arguments": False}
    if template is None:
        return dict(sorted(caps.items()))

    marker = "STRING_MARKER"
    ok, messages, _, _, text = _execute(template, [{"role": "user", "content": marker}])
    content = messages[0]["content"]
    checks_for_string = _has_op(content, "test_is_string")
    as_array = _has_op(content, "selectattr") or _has_op(content, "array_access")
    if as_array:
        caps["supports_typed_content"] = True
    if not ok or (as_array and marker not in text):
        caps["supports_string_content"] = False
    if checks_for_string:
        ok, messages, _, _, _ = _execute(template, [{"role": "user", "content": []}])
        content = messages[0]["content"]
        if ok and (_has_op(content, "selectattr") or _has_op(content, "array_access")):
            caps["supports_typed_content"] = True

    _, messages, _, _, _ = _execute(template, [{"role": "system", "content": "System message"},
                                               {"role": "user", "content": "User message"}])
    if not _used(messages[0]["content"]):
        caps["supports_system_role"] = False

    ok, messages, tools, _, _ = _execute(template, _tool_conversation({"arg": "value"}), _TOOLS)
    if ok:
        if not _used(tools[0]["function"]["name"]):
            caps["supports_tools"] = False
        tool_calls = messages[1]["tool_calls"]
        if not _used(tool_calls):
            caps["supports_tool_calls"] = False
        elif _used(tool_calls[0]["function"]["arguments"]["arg"]):
            caps["supports_object_arguments"] = True
    if not caps["supports_object_arguments"]:
        ok, messages, tools, _, _ = _execute(template, _tool_conversation('{"arg": "value"}'), _TOOLS)
        if not ok:
            caps["supports_tool_calls"] = caps["supports_tools"] = False
        else:
            if not _used(tools[0]["function"]["name"]):
                caps["supports_tools"] = False
            if not _used(messages[1]["tool_calls"]):
                caps["supports_tool_calls"] = False

    args = {"arg": "value"} if caps["supports_object_arguments"] else '{"arg": "value"}'
    ok, messages, _, _, _ = _execute(template, _tool_conversation(args, calls=2), _TOOLS)
    if not ok or not _used(messages[1]["tool_calls"][1]["function"]):
        caps["supports_parallel_tool_calls"] = False

    placeholder = "<REASONING_CONTENT_PLACEHOLDER>"
    thinking = {"enable_thinking": True, "preserve_thinking": True, "clear_thinking": False,
                "truncate_history_thinking": False, "drop_thinking": False}
    _, _, _, _, text = _execute(template, [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "Assistant message", "reasoning_content": placeholder},
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
        {"role": "user", "content": "User message"}], extra=thinking)
    if placeholder in text:
        caps["supports_preserve_reasoning"] = True

    # llama.cpp marks a variable used when its name is looked up; Jinja2 resolves a template's names
    # as it starts, so "looked up" is "named in the template"
    names = jinja2.meta.find_undeclared_variables(_env().parse(source))
    caps["supports_reasoning_effort"] = bool({"reasoning_effort", "reasoning_strength"} & names)
    return dict(sorted(caps.items()))
