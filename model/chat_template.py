"""The GGUF's chat template (`tokenizer.chat_template`), rendered as llama-server `--jinja` renders it.

llama-server runs its own Jinja engine (common/jinja, llama.cpp b11434); we run Jinja2's immutable
sandbox configured to give the same bytes (common/chat.cpp, `common_chat_template_direct_apply_impl`):
- `trim_blocks` and `lstrip_blocks` on, one trailing newline of the template dropped (common/jinja/lexer.cpp);
- the context: `messages`, `bos_token`, `eos_token`, `add_generation_prompt` (set only when true),
  `enable_thinking`, `datetime` / `date_string`, `tools` when given, plus any extra keys;
- `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` that writes JSON as llama.cpp's
  `value_to_json` does (no HTML escaping, `", "`/`": "` separators, floats as C++ streams print them);
- undefined values stay lenient as there: attribute access on them gives undefined, and `+` treats an
  undefined or null operand next to a string as "";
- when the tokenizer adds BOS itself (`add_bos`), a BOS the template wrote at the start is removed.
Without a template, llama-server falls back to ChatML (`CHATML_TEMPLATE`). A template that fails to
compile or to render raises `TemplateError` with the reason; the sandbox refuses unsafe attribute access.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML_TEMPLATE", "TemplateError", "compile_template", "render_chat", "tojson"]

# common/chat.cpp CHATML_TEMPLATE_SRC, byte for byte.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


class TemplateError(ValueError):
    """The chat template cannot be compiled or rendered; the message is the reason."""


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["+"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Refuse at once: a chainable undefined would otherwise swallow the refusal silently.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        # common/jinja/runtime.cpp: null or undefined next to a string concatenates as "".
        if operator == "+":
            if (left is None or isinstance(left, jinja2.Undefined)) and isinstance(right, str):
                return right
            if (right is None or isinstance(right, jinja2.Undefined)) and isinstance(left, str):
                return left
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"Jinja Exception: {message}")


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    """common/jinja/value.cpp `tojson`: JSON text with llama.cpp's spacing and escapes."""
    if sort_keys:
        raise TemplateError("tojson sort_keys=true not implemented")
    width = indent if isinstance(indent, int) and not isinstance(indent, bool) else -1
    seps = list(separators or ())
    item_sep = seps[0] if seps else (", " if width < 0 else ",")
    key_sep = seps[1] if len(seps) > 1 else ": "
    out: list[str] = []
    _json(value, 0, width, item_sep, key_sep, out)
    text = "".join(out)
    return "".join(map(_ascii_escape, text)) if ensure_ascii else text


def _ascii_escape(ch: str) -> str:
    cp = ord(ch)
    if cp < 0x80:
        return ch
    if cp <= 0xFFFF:
        return f"\\u{cp:04x}"
    cp -= 0x10000
    return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"


def _json_string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_NAMED_ESCAPES = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _json(v: Any, level: int, indent: int, item_sep: str, key_sep: str, out: list[str]) -> None:
    pad = " " * (level * indent) if indent > 0 else ""
    step = " " * indent if indent > 0 else ""
    newline = "\n" if indent >= 0 else ""
    if v is None or isinstance(v, jinja2.Undefined):
        out.append("null")
    elif isinstance(v, bool):
        out.append("true" if v else "false")
    elif isinstance(v, int):
        out.append(str(v))
    elif isinstance(v, float):
        out.append(f"{v:g}")  # std::ostream's default: 6 significant digits
    elif isinstance(v, str):
        out.append(_json_string(v))
    elif isinstance(v, Mapping):
        out.append("{")
        if v:
            out.append(newline)
            for i, (k, item) in enumerate(v.items()):
                out.append(pad + step + _json_string(str(k)) + key_sep)
                _json(item, level + 1, indent, item_sep, key_sep, out)
                if i < len(v) - 1:
                    out.append(item_sep)
                out.append(newline)
            out.append(pad)
        out.append("}")
    elif isinstance(v, list | tuple):
        out.append("[")
        if v:
            out.append(newline)
            for i, item in enumerate(v):
                out.append(pad + step)
                _json(item, level + 1, indent, item_sep, key_sep, out)
                if i < len(v) - 1:
                    out.append(item_sep)
                out.append(newline)
            out.append(pad)
        out.append("]")
    else:
        out.append("null")


_ENV = _Environment(
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=False,
    undefined=jinja2.ChainableUndefined,  # llama.cpp: a member of undefined is undefined
    extensions=[jinja2.ext.loopcontrols],
)
_ENV.filters["tojson"] = tojson
_ENV.globals["raise_exception"] = _raise_exception


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None


def compile_template(source: str) -> None:
    """Compile `source` in the sandbox (a --chat-template-file is checked at start); TemplateError if it
    does not."""
    _compile(source)


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                *, bos_token: str = "", eos_token: str = "", add_bos: bool = False, add_eos: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool = True,
                extra_context: Mapping[str, Any] | None = None, now: float | None = None) -> str:
    """Render a conversation into the prompt text, as llama-server's /apply-template returns it.

    `template` None or "" (or "chatml") selects llama-server's ChatML fallback. `add_bos` / `add_eos`
    are the tokenizer's add_bos_token / add_eos_token: the template's own BOS at the start (EOS at the
    end) is removed, since tokenizing with add_special adds it. `now` (seconds since the epoch) fixes
    the clock for `strftime_now` and `date_string`.
    """
    source = template if template and template != "chatml" else CHATML_TEMPLATE
    tmpl = _compile(source)
    clock = time.localtime(time.time() if now is None else now)
    context: dict[str, Any] = {
        "messages": [dict(m) for m in messages],
        "bos_token": bos_token,
        "eos_token": eos_token,
        "enable_thinking": enable_thinking,
        "datetime": time.strftime("%b %d %Y", clock),
        "date_string": time.strftime("%d %b %Y", clock),
        "strftime_now": lambda fmt: time.strftime(fmt, clock),
    }
    if tools:
        context["tools"] = [dict(t) for t in tools]
    if extra_context:
        context.update(extra_context)
    if add_generation_prompt:
        context["add_generation_prompt"] = True
    try:
        text = tmpl.render(context)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:  # includes SecurityError and UndefinedError
        raise TemplateError(f"chat template failed to render: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
    if add_bos and text.startswith(bos_token):
        text = text[len(bos_token):]
    if add_eos and eos_token and text.endswith(eos_token):
        text = text[: len(text) - len(eos_token)]
    return text
