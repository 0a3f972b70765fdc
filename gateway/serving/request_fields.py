"""The request's fields, read as llama-server reads them (tools/server/server-schema.cpp, b11434), then
ours: what this engine does not do is refused by name.

`read_fields` walks llama-server's field table (`FIELDS`) in its order, so the first bad field is the one
llama-server names, in its words: aliases tried in order, null as absent, numbers converted as
nlohmann's `get<T>()` (gateway/http/json_values.py), a hard limit refused and a soft one clamped, then
the sampler set-up's checks (common/sampling.cpp). Every refusal is 400 `invalid_request_error`.
Then ours (`refuse_unsupported`): a value this engine cannot honour is a 400 naming the field ("refuse,
never approximate"); `IGNORED` lists the fields read and dropped, each with why it cannot change the
answer; and a few bounds llama-server lacks (DRY breakers, stop strings, grammar size), where a small
body would cost the engine much.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from bankml.errors import InvalidRequest, NotSupported
from gateway.http.json_values import (
    FLT_MAX,
    INT32,
    INT64,
    JsonTypeError,
    f32,
    get_bool,
    get_float,
    get_int,
    get_string,
    has_value,
    is_empty,
    json_value,
    to_string,
)
from model.dry import dry_enabled
from model.messages import N_PROBS_CAP, SamplingParams

I32_MAX = INT32[1]
N_PROBS_MAX = N_PROBS_CAP  # the most top logprobs the engine reports per token (model/messages.py)
MAX_GRAMMAR_CHARS = 1 << 16  # a GBNF grammar longer than this is refused before it is parsed
MAX_DRY_BREAKERS = 32  # dry_sequence_breakers per request (llama.cpp's defaults are 4)
MAX_STOPS = 32  # stop strings per request (OpenAI takes 4)
MAX_STOP_BYTES = 512  # the UTF-8 length of one stop string


@dataclass(frozen=True)
class Field:
    names: tuple[str, ...]  # the name, then aliases in the order llama-server tries them
    kind: str  # "bool", "i32", "u32", "i64", "f32", "json" (read by `read`)
    limits: tuple[float, float] | None = None
    hard: bool = False  # out of limits: refuse (else clamp)
    read: Callable[[dict, Any], None] | None = None  # a custom handler: (task params, request value)


def _dry_base(p: dict, v: Any) -> None:
    x = get_float(v)
    p["dry_base"] = x if x >= 1.0 else SamplingParams.dry_base


def _over_limit(name: str, why: str) -> NotSupported:
    return NotSupported(f"'{name}' is not supported by bankml serve --native: {why}")


def _breakers(p: dict, v: Any) -> None:
    value = v if isinstance(v, list) and all(isinstance(s, str) for s in v) else []
    if not value:
        raise JsonTypeError("Error: dry_sequence_breakers must be a non-empty array of strings")
    # llama.cpp cuts each breaker to 40 bytes (model/dry.py does too) but takes any number of them;
    # each costs the engine a search of the vocabulary, so the number is ours to bound
    if len(value) > MAX_DRY_BREAKERS and dry_enabled(p["dry_multiplier"], p["dry_base"], p["dry_penalty_last_n"]):
        raise _over_limit("dry_sequence_breakers", f"more than {MAX_DRY_BREAKERS} breakers (got {len(value)})")
    p["dry_sequence_breakers"] = tuple(value)


def _stop(p: dict, v: Any) -> None:
    words: list[str] = []
    if isinstance(v, list):
        for word in v:
            if not is_empty(word):  # nlohmann's empty(): "" is a stop (it fires at once), null is not
                words.append(get_string(word))
    elif isinstance(v, str):
        words.append(v)
    # llama-server bounds neither; every stop is searched after every token (model/stops.py)
    if len(words) > MAX_STOPS:
        raise _over_limit("stop", f"more than {MAX_STOPS} stop strings (got {len(words)})")
    for word in words:
        if len(word) > MAX_STOP_BYTES or len(word.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            raise _over_limit("stop", f"a stop string of more than {MAX_STOP_BYTES} bytes")
    p["stop"] = tuple(words)


def _lora(p: dict, v: Any) -> None:
    if not isinstance(v, list):
        raise JsonTypeError("Error: 'lora' must be an array of objects with 'id' and 'scale' fields")
    p["lora"] = v


_CANONICAL = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill",
              "penalties", "adaptive_p")
# common_sampler_types_from_names: canonical names, kebab-case and dashless forms, a few more aliases
SAMPLER_NAMES = {**{c.replace("_", "-"): c for c in _CANONICAL if "_" in c},
                 **{c.replace("_", ""): c for c in _CANONICAL if "_" in c},
                 "nucleus": "top_p", "temp": "temperature", "typ": "typ_p", **{c: c for c in _CANONICAL}}
SAMPLER_CHARS = dict(zip("dkypsmtxiea", ("dry", "top_k", "typ_p", "top_p", "top_n_sigma", "min_p", "temperature",
                                         "xtc", "infill", "penalties", "adaptive_p"), strict=True))


def sampler_names(names: list[str]) -> tuple[str, ...]:
    """Canonical names, unknown ones dropped (as llama.cpp drops them with a warning)."""
    return tuple(SAMPLER_NAMES[n.lower()] for n in names if n.lower() in SAMPLER_NAMES)


def _samplers(p: dict, v: Any) -> None:
    if isinstance(v, list):
        p["samplers"] = sampler_names([get_string(s) for s in v])
    elif isinstance(v, str):
        p["samplers"] = tuple(SAMPLER_CHARS[c] for c in v if c in SAMPLER_CHARS)


def _grammar(p: dict, request: dict) -> None:
    # "json_schema" takes precedence; a grammar string is kept when non-empty
    if has_value(request, "json_schema") and "grammar" not in request:
        p["json_schema"] = request["json_schema"]
    else:
        grammar = json_value(request, "grammar", "", get_string)
        if grammar:
            p["grammar"] = grammar


def _keep(name: str) -> Callable[[dict, Any], None]:
    def read(p: dict, v: Any) -> None:
        p[name] = v

    return read


def _string(name: str) -> Callable[[dict, Any], None]:
    def read(p: dict, v: Any) -> None:
        p[name] = get_string(v)

    return read


def _int_handler(name: str) -> Callable[[dict, Any], None]:
    def read(p: dict, v: Any) -> None:
        p[name] = get_int(v)

    return read


def _draft_length(name: str) -> Callable[[dict, Any], None]:
    """speculative.n_max / n_min: an int, a negative one read as 0 (server-task.cpp's clamp); -1 in
    the params means the server's --draft-max / --draft-min, which a request cannot ask for."""
    def read(p: dict, v: Any) -> None:
        p[name] = max(get_int(v, 32), 0)

    return read


F32 = (-FLT_MAX, FLT_MAX)
H32 = (0, I32_MAX)  # the common hard limit

# server-schema.cpp's table, in its order (the first failing field is the one reported)
FIELDS: tuple[Field, ...] = (
    Field(("verbose",), "bool"),
    Field(("timings_per_token",), "bool"),
    Field(("stream",), "bool"),
    Field(("stream_options",), "nested"),
    Field(("cache_prompt",), "bool"),
    Field(("return_tokens",), "bool"),
    Field(("return_progress",), "bool"),
    Field(("sse_ping_interval",), "i32", (-1, I32_MAX), hard=True),
    Field(("n_predict", "max_completion_tokens", "max_tokens"), "i32", (-1, I32_MAX), hard=True),
    Field(("n_indent",), "i32", H32, hard=True),
    Field(("n_keep",), "i32", (-1, I32_MAX), hard=True),
    Field(("n_discard",), "i32", H32, hard=True),
    Field(("n_cmpl", "n"), "i32", (1, 1), hard=True),  # 1..n_parallel, and this server runs one
    Field(("n_cache_reuse",), "i32", H32, hard=True),
    Field(("t_max_predict_ms",), "i64", (-1, INT64[1]), hard=True),
    Field(("response_fields",), "json", read=_keep("response_fields")),
    Field(("top_k",), "i32", (0, I32_MAX)),
    Field(("top_p",), "f32", (0.0, 1.0)),
    Field(("min_p",), "f32", (0.0, 1.0)),
    Field(("top_n_sigma",), "f32", F32),
    Field(("xtc_probability",), "f32", (0.0, 1.0)),
    Field(("xtc_threshold",), "f32", (0.0, 1.0)),
    Field(("typical_p",), "f32", F32),
    Field(("temperature",), "f32", (0.0, math.inf)),
    Field(("dynatemp_range",), "f32", F32),
    Field(("dynatemp_exponent",), "f32", F32),
    Field(("repeat_last_n",), "i32", H32, hard=True),
    Field(("repeat_penalty",), "f32", F32),
    Field(("frequency_penalty",), "f32", F32),
    Field(("presence_penalty",), "f32", F32),
    Field(("dry_multiplier",), "f32", F32),
    Field(("dry_base",), "f32", read=_dry_base),
    Field(("dry_allowed_length",), "i32", H32, hard=True),
    Field(("dry_penalty_last_n",), "i32", H32, hard=True),
    Field(("mirostat",), "i32", (0, 2)),
    Field(("mirostat_tau",), "f32", F32),
    Field(("mirostat_eta",), "f32", F32),
    Field(("adaptive_target",), "f32", (-FLT_MAX, 1.0)),
    Field(("adaptive_decay",), "f32", (0.0, f32(0.99)), hard=True),
    Field(("seed",), "u32"),
    Field(("n_probs", "logprobs"), "i32", INT32),
    Field(("min_keep",), "i32", H32, hard=True),
    Field(("backend_sampling",), "bool"),
    Field(("post_sampling_probs",), "bool"),
    Field(("lora",), "json", read=_lora),
    Field(("dry_sequence_breakers",), "json", read=_breakers),
    Field(("json_schema", "grammar"), "request", read=_grammar),
    Field(("grammar_lazy",), "bool"),
    Field(("chat_format",), "json", read=_int_handler("chat_format")),
    Field(("reasoning_format",), "json", read=_string("reasoning_format")),
    Field(("generation_prompt",), "json", read=_string("generation_prompt")),
    Field(("parse_tool_calls",), "bool"),
    Field(("chat_parser",), "json", read=_string("chat_parser")),
    Field(("continue_final_message",), "json", read=_keep("continue_final_message")),
    Field(("echo",), "bool"),
    Field(("preserved_tokens",), "json", read=_keep("preserved_tokens")),
    Field(("grammar_triggers",), "json", read=_keep("grammar_triggers")),
    Field(("reasoning_control",), "bool"),
    Field(("reasoning_budget_tokens",), "i32", (-1, I32_MAX), hard=True),
    Field(("reasoning_budget_start_tag",), "json", read=_string("reasoning_budget_start_tag")),
    Field(("reasoning_budget_end_tags", "reasoning_budget_end_tag"), "json",
          read=_keep("reasoning_budget_end_tags")),
    Field(("reasoning_budget_message",), "json", read=_string("reasoning_budget_message")),
    Field(("logit_bias",), "json", read=_keep("logit_bias")),
    Field(("ignore_eos",), "bool"),
    Field(("stop",), "json", read=_stop),
    Field(("samplers",), "json", read=_samplers),
    # server-task.cpp reads these beside the schema's table, clamped after (`_sampler_init`)
    Field(("speculative.n_max",), "json", read=_draft_length("spec_n_max")),
    Field(("speculative.n_min",), "json", read=_draft_length("spec_n_min")),
    Field(("speculative.p_min",), "f32"),
)

# the task params' names where they differ from the request's
TARGET = {"n_predict": "max_tokens", "n_cmpl": "n", "top_n_sigma": "top_n_sigma",
          "speculative.n_max": "spec_n_max", "speculative.n_min": "spec_n_min", "speculative.p_min": "spec_p_min"}


def _read_number(f: Field, v: Any) -> int | float:
    x: int | float
    if f.kind == "f32":
        x = get_float(v)
    elif f.kind == "u32":
        x = get_int(v, 32, signed=False)
    else:
        x = get_int(v, 64 if f.kind == "i64" else 32)
    if f.limits is None:
        return x
    lo, hi = f.limits
    if f.hard:
        if x < lo or x > hi:
            lo_s, hi_s, x_s = (to_string(float(lo)), to_string(float(hi)), to_string(x)) if f.kind == "f32" else \
                (to_string(int(lo)), to_string(int(hi)), to_string(x))
            raise JsonTypeError(f"Value must be between {lo_s} <= value <= {hi_s}, but got {x_s}")
        return x
    return max(lo, min(hi, x))


def _eval(f: Field, request: dict, p: dict) -> None:
    if f.kind == "nested":  # stream_options: its include_usage, when it is an object
        sub = request.get(f.names[0])
        if isinstance(sub, dict) and has_value(sub, "include_usage"):
            _read(Field(("include_usage",), "bool"), "include_usage", sub["include_usage"], sub, p)
        return
    for name in f.names:
        if has_value(request, name):
            _read(f, name, request[name], request, p)
            return


def _read(f: Field, name: str, v: Any, request: dict, p: dict) -> None:
    """One field's value into `p`; a failure is llama-server's `Field 'name': ...` 400."""
    target = TARGET.get(f.names[0], f.names[0])
    try:
        if f.kind == "request":
            f.read(p, request)
        elif f.read is not None:
            f.read(p, v)
        elif f.kind == "bool":
            p[target] = get_bool(v)
        else:
            p[target] = _read_number(f, v)
    except JsonTypeError as e:
        raise InvalidRequest(f"Field '{name}': {e}") from None


def read_fields(request: dict, defaults: SamplingParams, n_max: int = 1) -> dict:
    """llama-server's task params from a request (after the OpenAI layer), over `defaults` (llama.cpp's,
    under the GGUF's general.sampling.*); raises llama-server's 400 for the first bad field. `n_max` bounds
    `n` (llama-server's n_parallel); a route that checks `n` against the engine once it holds the model
    passes more than 1."""
    p: dict[str, Any] = {k: getattr(defaults, k) for k in SamplingParams.__dataclass_fields__}
    p.update(stream=False, include_usage=False, n=1)
    for f in FIELDS:
        if f.names[0] == "n_cmpl" and n_max != 1:
            f = replace(f, limits=(INT32[0], n_max))
        _eval(f, request, p)
    _sampler_init(p)
    return p


def _sampler_init(p: dict) -> None:
    """common_sampler_init's checks (common/sampling.cpp), in its order; first, the draft lengths
    clamped as server-task.cpp clamps them (n_min <= n_max, both >= 0; -1 stays the server's)."""
    if p["spec_n_max"] >= 0 and p["spec_n_min"] > p["spec_n_max"]:
        p["spec_n_min"] = p["spec_n_max"]
    rp = p["repeat_penalty"]
    if not math.isfinite(rp) or rp <= 0.0 or not math.isfinite(f32(1.0 / rp)):
        raise InvalidRequest("Failed to initialize samplers: penalty_repeat must be finite and greater than 0")
    if not math.isfinite(p["frequency_penalty"]):
        raise InvalidRequest("Failed to initialize samplers: penalty_freq must be finite")
    if not math.isfinite(p["presence_penalty"]):
        raise InvalidRequest("Failed to initialize samplers: penalty_present must be finite")
    if "grammar" in p:
        from model.gbnf import GrammarError, GrammarTooDeep, parse_gbnf

        if len(p["grammar"]) > MAX_GRAMMAR_CHARS:  # the parse runs on the event loop, ~3 s per MB
            raise NotSupported(f"'grammar' is not supported by bankml serve --native: more than "
                                f"{MAX_GRAMMAR_CHARS} characters")
        try:
            parse_gbnf(p["grammar"])
        except GrammarTooDeep as e:  # llama-server would parse it: ours is a refusal, by name
            raise NotSupported(f"'grammar' is not supported by bankml serve --native: {e}") from None
        except GrammarError:
            raise InvalidRequest("Failed to initialize samplers: failed to parse grammar") from None


# general.sampling.* (common/common.cpp, common_init_sampler_from_model): key -> (field, type)
GGUF_SAMPLING = {
    "top_k": ("top_k", int), "top_p": ("top_p", float), "min_p": ("min_p", float),
    "xtc_probability": ("xtc_probability", float), "xtc_threshold": ("xtc_threshold", float),
    "temp": ("temperature", float), "penalty_last_n": ("repeat_last_n", int),
    "penalty_repeat": ("repeat_penalty", float), "mirostat": ("mirostat", int),
}


def gguf_defaults(kv: dict[str, Any]) -> SamplingParams:
    """llama.cpp's defaults under the GGUF's `general.sampling.*` keys.

    llama.cpp reads each key as text with strtol/strtof and keeps the default when that fails.
    """
    changes: dict[str, Any] = {}
    seq = kv.get("general.sampling.sequence")
    if isinstance(seq, str) and seq:
        changes["samplers"] = sampler_names(seq.split(";"))
    for key, (name, kind) in GGUF_SAMPLING.items():
        v = kv.get("general.sampling." + key)
        try:
            value = kind(float(v)) if kind is int else f32(float(v))
        except (TypeError, ValueError):
            continue
        changes[name] = value
    return replace(SamplingParams(), **changes)
