"""The Modelfile: Ollama's parser (parser/parser.go's state machine), its rules, and the text `/api/show` writes.

`parse_commands` reads a Modelfile state by state as parser.go does: the 8 instructions in any case, `#` a
comment only where a line starts, a value running to the end of its line, `"..."` and `\"\"\"...\"\"\"` spanning
lines, no escapes. `parse_modelfile` applies the rules a bankml derived model keeps (one FROM; the last SYSTEM,
TEMPLATE and REQUIRES; every LICENSE and MESSAGE; the PARAMETERs bankml reproduces, with Ollama's parsing).
`spec_from_request` takes the structured form of `POST /api/create` (what the ollama client sends) to the same
`ModelSpec`. `render_modelfile` writes a layer back with Ollama's `quote`, so parsing it gives the layer again.
Every refusal is an InvalidRequest that names the line (where the parser knows it) and the reason.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from bankml.errors import BankmlError, InvalidRequest
from gateway.serving.request_fields import read_fields
from model.messages import SamplingParams

INSTRUCTIONS = ("from", "license", "template", "system", "adapter", "parameter", "message", "requires")
ROLES = ("system", "user", "assistant")

# The PARAMETERs bankml reproduces, in the order a manifest keeps them, and whether each is an integer.
PARAMETERS: dict[str, bool] = {
    "temperature": False, "top_k": True, "top_p": False, "min_p": False, "seed": True, "num_ctx": True,
    "num_predict": True, "repeat_penalty": False, "repeat_last_n": True, "presence_penalty": False,
    "frequency_penalty": False,
}
_NOT_REPRODUCED = ("typical_p", "tfs_z", "mirostat", "mirostat_eta", "mirostat_tau", "penalize_newline", "min_keep")
_RESOURCE = ("num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "use_mlock", "low_vram", "numa", "f16_kv",
             "vocab_only", "logits_all", "num_keep", "num_gqa", "rope_frequency_base", "rope_frequency_scale")

ADAPTER_REFUSED = ("ADAPTER: bankml has no adapters; merge the adapter into the weights first, "
                   "then FROM the merged model")
_BAD_COMMAND = ('command must be one of "from", "license", "template", "system", "adapter", "parameter", '
                '"message" or "requires"')
_BAD_ROLE = 'message role must be one of "system", "user", or "assistant"'

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class Command:
    """One instruction as parser.go gives it: `name` is "model" (FROM), an instruction, or a PARAMETER's
    name; `args` its value ("role: content" for a MESSAGE). `line` is where it starts."""

    name: str
    args: str
    line: int = 0


@dataclass
class ModelSpec:
    """What a Modelfile (or the structured form) asks for, checked. None: not given (a derived base's
    value is inherited); `stop` and `messages` given replace the inherited list as a whole."""

    from_: str
    system: str | None = None
    template: str | None = None
    parameters: dict[str, int | float] = field(default_factory=dict)
    stop: list[str] | None = None
    license: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None
    requires: str | None = None


def _at(line: int, message: str) -> InvalidRequest:
    return InvalidRequest(f"Modelfile line {line}: {message}" if line > 0 else f"Modelfile: {message}")


def _unquote(s: str) -> str | None:
    """parser.go's unquote: `\"\"\"x\"\"\"` and `"x"` lose their quotes; None while a quote is still open."""
    if s.startswith('"""'):
        return s[3:-3] if len(s) >= 6 and s.endswith('"""') else None
    if s.startswith('"'):
        return s[1:-1] if len(s) >= 2 and s.endswith('"') else None
    return s


def _push(buf: list[str], c: str, first: int, last: int) -> tuple[int, int]:
    """`c` appended to `buf`; the indexes of its first and last non-space characters after it."""
    if not c.isspace():
        last = len(buf)
        if first < 0:
            first = last
    buf.append(c)
    return first, last


def _still_open(buf: list[str], first: int, last: int) -> bool:
    """Whether `_unquote(_trim("".join(buf)))` is None (a quote still open), in constant time."""
    if first < 0:
        return False
    n = last - first + 1
    if buf[first:first + 3] == ['"', '"', '"']:
        return not (n >= 6 and buf[last - 2:last + 1] == ['"', '"', '"'])
    if buf[first] == '"':
        return not (n >= 2 and buf[last] == '"')
    return False


def _is_space(c: str) -> bool:
    return c in " \t"


def _is_newline(c: str) -> bool:
    return c in "\r\n"


def _is_alpha(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z")


def _trim(s: str) -> str:
    # Go's strings.TrimSpace: Unicode white space at both ends
    return s.strip()


_NIL, _NAME, _VALUE, _PARAMETER, _MESSAGE, _COMMENT = range(6)


def parse_commands(text: str) -> list[Command]:
    """Ollama's ParseFile, state for state (parser.go's parseRuneForState and its transitions)."""
    if text.startswith("\ufeff"):
        text = text[1:]
    commands: list[Command] = []
    state, buf, name, role = _NIL, [], "", ""
    first, last = -1, -1  # where buf's first and last non-space characters are (-1: none yet)
    line, start = 1, 1
    for i, r in enumerate(text):
        sp, nl = _is_space(r), _is_newline(r)
        ends_line = nl and not (r == "\r" and text[i + 1:i + 2] == "\n")  # \r\n is one line end
        keep: str | None
        if state == _NIL:
            if r == "#":
                nxt, keep = _COMMENT, None
            elif sp or nl:
                nxt, keep = _NIL, None
            else:
                nxt, keep, start = _NAME, r, line
        elif state == _NAME:
            if _is_alpha(r):
                nxt, keep = _NAME, r
            elif sp:
                nxt, keep = _VALUE, None
            else:
                raise _at(line, _BAD_COMMAND)
        elif state == _VALUE:
            nxt, keep = (_NIL, r) if (sp or nl) else (_VALUE, r)
        elif state == _PARAMETER:
            if _is_alpha(r) or r.isdigit() and r.isascii() or r == "_":
                nxt, keep = _PARAMETER, r
            elif sp:
                nxt, keep = _VALUE, None
            else:
                raise _at(line, "a PARAMETER needs a name and a value")
        elif state == _MESSAGE:
            if _is_alpha(r):
                nxt, keep = _MESSAGE, r
            elif sp:
                nxt, keep = _VALUE, None
            else:
                raise _at(line, "a MESSAGE needs a role and a message")
        else:  # _COMMENT
            nxt, keep = (_NIL, None) if nl else (_COMMENT, None)

        if nxt != state:
            word = "".join(buf) if state != _VALUE else ""
            if state == _NAME:
                lower = word.lower()
                if lower not in INSTRUCTIONS:
                    raise _at(line, _BAD_COMMAND)
                if lower == "from":
                    name = "model"
                elif lower == "parameter":
                    nxt = _PARAMETER
                elif lower == "message":
                    nxt, name = _MESSAGE, lower
                else:
                    name = lower
            elif state == _PARAMETER:
                if not word:
                    raise _at(line, "a PARAMETER needs a name")
                name = word
            elif state == _MESSAGE:
                if word not in ROLES:
                    raise _at(line, _BAD_ROLE)
                role = word
            elif state == _VALUE:
                # a space inside the value, or a newline inside an open quote: the value goes on (decided
                # without joining the value so far, which made a long quoted value quadratic: a hang)
                if sp or _still_open(buf, first, last):
                    first, last = _push(buf, r, first, last)
                    line += ends_line
                    continue
                value = _unquote(_trim("".join(buf)))
                if role:
                    value, role = f"{role}: {value}", ""
                commands.append(Command(name, value, start))
            buf, first, last = [], -1, -1
            state = nxt
        if keep is not None and keep.isprintable():
            first, last = _push(buf, keep, first, last)
        line += ends_line

    if state == _VALUE:
        value = _unquote(_trim("".join(buf)))
        if value is None:
            raise _at(start, f"{name.upper() if name != 'model' else 'FROM'}: a quote opened here is never "
                             "closed (unexpected end of the Modelfile)")
        if role:
            value = f"{role}: {value}"
        commands.append(Command(name, value, start))
    elif state not in (_NIL, _COMMENT):
        raise _at(start, "unexpected end of the Modelfile: an instruction needs a value")
    return commands


def _refusal(key: str) -> str:
    if key in _NOT_REPRODUCED:
        return (f"PARAMETER {key}: bankml reproduces llama.cpp's penalties, temperature, top-k, top-p, min-p and "
                "seed; this sampler is not reproduced, so it cannot become a default of the model")
    if key in _RESOURCE:
        return (f"PARAMETER {key}: a resource option; it does not change an answer bankml gives, so it is not "
                "part of a model (give it to bankml serve)")
    return (f"PARAMETER {key}: not a parameter bankml reproduces (it reproduces {', '.join(PARAMETERS)} "
            "and stop)")


def f32(x: float) -> float:
    """`x` rounded to the nearest float32 (Ollama parses PARAMETER floats at 32 bits); inf when it overflows."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


SHOWN_MAX = 80  # a value longer than this is cut in a message (a 1 MiB line made a 1 MiB error)


def _shown(text: str) -> str:
    """`text` as a message quotes it: repr, cut to SHOWN_MAX characters with how long it was."""
    if len(text) <= SHOWN_MAX:
        return repr(text)
    return f"{text[:SHOWN_MAX]!r}… ({len(text)} characters)"


def parameter_value(key: str, text: str) -> int | float:
    """One PARAMETER's value, parsed as Ollama parses it (ints base 10, floats at 32 bits) and range-checked."""
    if key not in PARAMETERS:
        raise InvalidRequest(_refusal(key))
    t = text.strip()
    value: int | float
    if PARAMETERS[key]:
        if not _INT.fullmatch(t):
            raise InvalidRequest(f"PARAMETER {key} {_shown(text)}: not an integer")
        digits = t.lstrip("+-").lstrip("0")  # int() of over 4300 digits is a ValueError (a 500): none fits 64 bits
        sign = t[0] if t[0] in "+-" else ""
        value = int(sign + (digits or "0")) if len(digits) <= 20 else 2**63
        if not -(2**63) <= value < 2**63:
            raise InvalidRequest(f"PARAMETER {key} {_shown(text)}: out of range for a 64-bit integer")
    else:
        if not _FLOAT.fullmatch(t):
            raise InvalidRequest(f"PARAMETER {key} {_shown(text)}: not a number")
        value = f32(float(t))
        if not math.isfinite(value):
            raise InvalidRequest(f"PARAMETER {key} {_shown(text)}: not a finite number")
    if _out_of_range(key, value):
        raise InvalidRequest(f"PARAMETER {key} {format_number(value)}: out of range ({_RANGES.get(key, '>= 0')})")
    return value


_RANGES = {"num_ctx": ">= 1", "num_predict": ">= -2", "repeat_penalty": "> 0",
           "presence_penalty": "any finite number", "frequency_penalty": "any finite number"}


def _out_of_range(key: str, v: int | float) -> bool:
    if key in ("top_k", "seed", "presence_penalty", "frequency_penalty"):
        return False  # top_k and seed are unchecked; llama.cpp takes any finite penalty, negative ones too
    if key == "num_ctx":
        return v < 1
    if key == "num_predict":
        return v < -2
    if key == "repeat_penalty":
        return v <= 0
    return v < 0


def format_number(v: int | float) -> str:
    """A parameter as the manifest writes it: ints bare, floats in the shortest decimal that reads back
    as the same float32, positional, without a trailing `.0` (the Rust bankml's `format!("{}", f32)`)."""
    if isinstance(v, bool):
        raise TypeError("a parameter is a number, not a bool")
    if isinstance(v, int):
        return str(v)
    x = f32(v)
    text = "0"
    for digits in range(1, 10):  # the shortest that reads back; 9 significant digits always do
        text = f"{x:.{digits - 1}e}"
        if f32(float(text)) == x:
            break
    out = format(Decimal(text), "f")
    if "." in out:
        out = out.rstrip("0").rstrip(".")
    return out


# The PARAMETERs a request reads as llama-server's sampling fields (num_ctx fits the prompt, num_predict is the
# length: each dialect reads those two its own way)
_SAMPLING_FIELDS = tuple(k for k in PARAMETERS if k not in ("num_ctx", "num_predict"))


def check_as_request(parameters: Mapping[str, int | float], stop: tuple[str, ...] | list[str]) -> None:
    """A derived model's sampling parameters and stops, read by the rules every request's are read by
    (request_fields.read_fields: at most MAX_STOPS stops of MAX_STOP_BYTES each, a repeat_penalty whose
    inverse is finite...), so a model is refused when it is created, with the message each of its requests
    would get, rather than created and then never able to answer."""
    request: dict[str, Any] = {k: parameters[k] for k in _SAMPLING_FIELDS if k in parameters}
    request["stop"] = list(stop)
    try:
        read_fields(request, SamplingParams())
    except BankmlError as e:
        raise InvalidRequest(f"{e.message} (a request for this model would be refused so: it could never "
                             "answer)") from None


def _set_parameter(spec: ModelSpec, key: str, text: str) -> None:
    if key == "stop":
        if spec.stop is None:
            spec.stop = []
        spec.stop.append(text)  # stop accumulates (in place: copying it per line made many lines quadratic)
        return
    spec.parameters[key] = parameter_value(key, text)  # the last value wins


def parse_modelfile(text: str) -> ModelSpec:
    """A Modelfile's text to its checked ModelSpec (Ollama's rules, ADAPTER refused)."""
    froms: list[Command] = []
    spec = ModelSpec(from_="")
    for c in parse_commands(text):
        try:
            if c.name == "model":
                froms.append(c)
            elif c.name == "system":
                spec.system = c.args
            elif c.name == "template":
                spec.template = c.args
            elif c.name == "requires":
                spec.requires = c.args
            elif c.name == "license":
                spec.license.append(c.args)
            elif c.name == "adapter":
                raise InvalidRequest(ADAPTER_REFUSED)
            elif c.name == "message":
                role, _, content = c.args.partition(": ")
                if spec.messages is None:
                    spec.messages = []
                spec.messages.append({"role": role, "content": content})  # in place: not quadratic
            else:
                _set_parameter(spec, c.name, c.args)
        except InvalidRequest as e:
            raise _at(c.line, e.message) from None
    if not froms:
        raise InvalidRequest("Modelfile: no FROM line: name the base (a pinned model's name, a derived model, "
                             "or a pinned GGUF's path)")
    if len(froms) > 1:
        raise _at(froms[1].line, "more than one FROM: a bankml model has one base")
    if not froms[0].args.strip():
        raise _at(froms[0].line, "FROM needs a value: the base's name or path")
    spec.from_ = froms[0].args
    return spec


def _present(v: Any) -> bool:
    return v not in (None, False, "", [], {})


def refuse_uploads(body: Mapping[str, Any]) -> None:
    """`files`, `adapters` and `quantize` of `POST /api/create`, present (not null, false, "", [] or {}): refused."""
    if _present(body.get("files")):
        raise InvalidRequest("files: bankml does not take uploaded blobs; FROM a GGUF pinned in the registry "
                             "(its FORK.json beside it), by name or path")
    if _present(body.get("adapters")):
        raise InvalidRequest("adapters: bankml has no adapters; merge the adapter into the weights first, "
                             "then FROM the merged model")
    if _present(body.get("quantize")):
        raise InvalidRequest("quantize: bankml serves the weights it pinned, as pinned; quantizing makes a new "
                             "file, which must be pinned on its own")


def spec_from_request(body: Mapping[str, Any]) -> ModelSpec:
    """`POST /api/create`'s structured form `{model, from, system, template, license, parameters, messages}`
    (what the ollama client sends) to a ModelSpec; `files`, `adapters` and `quantize` refused with the reason."""
    refuse_uploads(body)
    base = body.get("from")
    if not isinstance(base, str) or not base.strip():
        raise InvalidRequest("from: name the base (a pinned model's name, a derived model, or a pinned GGUF's "
                             "path), or send a modelfile")
    spec = ModelSpec(from_=base)
    for key in ("system", "template"):
        v = body.get(key)
        if v is not None and not isinstance(v, str):
            raise InvalidRequest(f"{key} must be a string")
    spec.system = body.get("system")
    spec.template = body.get("template") or None
    lic = body.get("license")
    if isinstance(lic, str):
        spec.license = [lic] if lic else []
    elif isinstance(lic, list) and all(isinstance(x, str) for x in lic):
        spec.license = list(lic)
    elif lic is not None:
        raise InvalidRequest("license must be a string or an array of strings")
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise InvalidRequest("messages must be an array of {role, content}")
        spec.messages = []
        for m in messages:
            if not isinstance(m, Mapping) or m.get("role") not in ROLES:
                raise InvalidRequest(f"messages: {_BAD_ROLE}")
            if _present(m.get("images")) or _present(m.get("tool_calls")):
                raise InvalidRequest("messages: only text content is in scope (no images, no tool calls)")
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise InvalidRequest("messages: content must be a string")
            spec.messages.append({"role": m["role"], "content": content or ""})
    params = body.get("parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise InvalidRequest("parameters must be an object")
        for key, v in params.items():
            if v is None:
                continue
            if key == "stop":
                stops = [v] if isinstance(v, str) else v
                if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                    raise InvalidRequest("parameters.stop must be a string or an array of strings")
                spec.stop = [*(spec.stop or []), *stops]
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                if key not in PARAMETERS:
                    raise InvalidRequest(_refusal(key))
                raise InvalidRequest(f"parameters.{key} must be a number")
            else:
                text = str(v) if isinstance(v, int) else (str(int(v)) if v.is_integer() and PARAMETERS.get(key)
                                                          else repr(v))
                spec.parameters[key] = parameter_value(key, text)
    return spec


def quote(s: str) -> str:
    """Ollama's quote (parser.go): `\"\"\"s\"\"\"` when s has a newline or an edge space and a `"`; `"s"` when it
    has a newline or an edge space; bare otherwise."""
    if "\n" in s or s.startswith(" ") or s.endswith(" "):
        return f'"""{s}"""' if '"' in s else f'"{s}"'
    return s


def render_modelfile(from_: str, *, system: str = "", parameters: Mapping[str, int | float] | None = None,
                     stop: tuple[str, ...] | list[str] = (), license: tuple[str, ...] | list[str] = (),
                     messages: tuple[Mapping[str, str], ...] | list[Mapping[str, str]] = (),
                     requires: str = "", header: str = "") -> str:
    """A layer as a Modelfile: the comment header, FROM, SYSTEM, `PARAMETER k v`, the stops, LICENSE,
    `MESSAGE role`, REQUIRES, each value in Ollama's quote."""
    out = [f"# {h}" if h else "#" for h in header.split("\n")] if header else []
    if out:
        out.append("")
    out.append(f"FROM {from_}")
    if system:
        out.append(f"SYSTEM {quote(system)}")
    for k, v in (parameters or {}).items():
        out.append(f"PARAMETER {k} {format_number(v)}")
    out.extend(f"PARAMETER stop {quote(s)}" for s in stop)
    out.extend(f"LICENSE {quote(text)}" for text in license)
    out.extend(f"MESSAGE {m['role']} {quote(m['content'])}" for m in messages)
    if requires:
        out.append(f"REQUIRES {quote(requires)}")
    return "\n".join(out) + "\n"
