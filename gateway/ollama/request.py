"""`POST /api/chat` and `POST /api/generate`: the body read once, before any model work (spec §1.1-§1.4).

`parse_ollama` checks in the spec's order, which its body follows line by line: the JSON, `model`
(registry.resolve; a derived model's layer applied, gateway/serving/layer.py), `keep_alive` (Ollama's
api/types.go Duration) and `stream`; an empty prompt only loads or unloads, and nothing else is checked
on that path (as in the Rust bankml); then `format` (Ollama's llm/server.go), `tools` (chat only, `auto`:
Ollama has no tool_choice), the refusals (§1.2), logprobs, `options` (the sampler built through
llama-server's field table, gateway/serving/request_fields.py, so a bad value gets the message /v1 gives
it), the messages. Every refusal is a 400 `{"error"}`, in the Rust bankml's words where it has them
(bankML/ollama.rs; the top_k range from its sampler.rs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from bankml.config import parse_keep_alive
from bankml.errors import ConfigInvalid, InvalidRequest
from gateway.http.json_values import exact_float, get_int
from gateway.serving.constraints import ollama_format_grammar
from gateway.serving.layer import apply_ollama
from gateway.serving.reasoning import Reasoning, ollama_think
from gateway.serving.registry import Pin, Registry, Resolved
from gateway.serving.request_fields import I32_MAX, read_fields
from gateway.serving.tool_calls import Tools, from_ollama_calls, read_tools
from model.messages import DEFAULT_SAMPLERS, SamplingParams

TOP_LOGPROBS_MAX = 20
TOP_K_RANGE = (1, 128)  # the Rust sampler's partial_sort range, the only one /api reproduces (spec §1.2)

# options -> llama-server's request field of the same meaning (read by request_fields.read_fields)
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty", "typical_p", "min_keep")
# resource options: they change scheduling, not the answer (the kernels' bits do not depend on them)
IGNORED = ("num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "use_mlock", "low_vram", "numa",
           "f16_kv", "vocab_only", "logits_all", "num_keep")
# read only by samplers that are refused unless neutral: they pass
NEUTRAL = ("mirostat_eta", "mirostat_tau", "penalize_newline")

MIROSTAT_REFUSED = ("mirostat: not reproduced; bankML reproduces llama.cpp's default sampler chain (penalties, "
                    "DRY, top-n-σ, top-k, typical-p, top-p, min-p, XTC, temperature), not mirostat")
IMAGES_REFUSED = "images: bankML's models are text-only; vision is out of scope"
REFUSALS = (  # (field, why), checked in this order when the field is present
    ("images", IMAGES_REFUSED),
    ("suffix", "suffix: fill-in-the-middle is not reproduced; send the whole prompt"),
    ("template", "template: bankML renders the pinned model's own chat template (as llama-server --jinja does); "
                 "a replacement template is not taken"),
    ("context", "context: send the conversation as /api/chat messages instead; the prompt cache reuses the "
                "shared prefix"),
)
IMAGE_GENERATION = ("width", "height", "steps")  # Ollama's image generation (its client sends them to /api/generate)


@dataclass(frozen=True)
class OllamaRequest:
    kind: str  # "chat" or "generate"
    resolved: Resolved  # the pin (a derived model's base), its layer, and the tag answers show
    body: dict  # the request after the derived layer
    keep_alive_s: float  # 0: unload; math.inf: forever
    stream: bool
    empty: bool  # only load or unload (no prompt)
    num_ctx: int | None  # options.num_ctx >= 1: the prompt is fitted to it; None: --ctx, no fitting
    params: SamplingParams | None = None  # None on the empty path
    messages: list[dict] | None = None  # the conversation to template (chat, and generate but raw)
    raw_prompt: str | None = None  # generate with raw: true (no template)
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # `format` as llguidance grammar text (gateway/serving/constraints.py)
    tools: Tools | None = None  # chat's `tools` (gateway/serving/tool_calls.py)
    response_schema: Any = None  # `format` as a schema: what an answer with tools responds in
    reasoning: Reasoning = Reasoning()  # `think` (gateway/serving/reasoning.py; frozen, so one default serves all)

    @property
    def pin(self) -> Pin:
        return self.resolved.pin

    @property
    def tag(self) -> str:
        return self.resolved.tag


def bad(message: str) -> InvalidRequest:
    return InvalidRequest(message)


def read_body(body: bytes) -> dict:
    try:  # a schema's numbers keep their literals (gateway/serving/constraints.py)
        value = json.loads(body, parse_float=exact_float)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("body is not JSON") from None
    if not isinstance(value, dict):
        raise bad("body is not a JSON object")
    return value


def is_present(v: Any) -> bool:
    """Present, as the refusals read it: not null, false, "", [] or {}."""
    return not (v is None or v is False or (isinstance(v, str | list | dict) and not v))


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def keep_alive(v: Any, default_s: float) -> float:
    """`keep_alive` in seconds as Ollama reads it (api/types.go Duration): 0 unloads, math.inf keeps forever."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return default_s
    if _number(v):
        try:
            seconds = float(v)  # an integer of 400 digits is no float (Go's decoder refuses it too)
        except OverflowError:
            seconds = math.nan
        if not math.isfinite(seconds):
            raise bad("keep_alive must be a duration string or a number of seconds")
        return math.inf if seconds < 0 else seconds
    if isinstance(v, str):
        try:
            return parse_keep_alive(v, "keep_alive")
        except ConfigInvalid:
            raise bad(f'keep_alive {json.dumps(v, ensure_ascii=False)}: not a duration ("5m", "1h", seconds, '
                      '0 or -1)') from None
    raise bad("keep_alive must be a duration string or a number of seconds")


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false")
    return v


def is_empty_prompt(kind: str, body: dict) -> bool:
    if kind == "chat":
        messages = body.get("messages")
        return not isinstance(messages, list) or not messages
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("prompt must be a string")
    return not prompt


def refusals(body: dict) -> None:
    """What the forward pass does not reproduce, in the spec's order (§1.2); before any model work."""
    for field, why in REFUSALS:
        if is_present(body.get(field)):
            raise bad(why)
    for field in IMAGE_GENERATION:
        if is_present(body.get(field)):
            raise bad(f"{field}: image generation is out of scope for bankml serve; its models generate text")


def read_logprobs(body: dict) -> tuple[bool, int]:
    """(logprobs on, top_logprobs): the range is checked even when logprobs are off (spec §1.4)."""
    top = body.get("top_logprobs")
    if top is None:
        top = 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= TOP_LOGPROBS_MAX:
        raise bad(f"top_logprobs must be between 0 and {TOP_LOGPROBS_MAX}")
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("logprobs must be true or false")
    return bool(on), top


def stops(v: Any) -> list[str]:
    """`stop`: a string or an array of strings; empty ones are dropped."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise bad("stop must be a string or an array of strings")


def _shown(n: int | float) -> str:
    return str(int(n)) if float(n).is_integer() else repr(n)


@dataclass(frozen=True)
class Options:
    sampling: dict[str, int | float]  # llama-server's request fields
    max_tokens: int  # -1: no limit
    stop: list[str]
    num_ctx: int | None


def read_options(v: Any, n_ctx: int) -> Options:
    """Ollama's `options`, each key's rule (spec §1.2); `n_ctx` is this server's --ctx."""
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise bad("options must be an object")
    sampling: dict[str, int | float] = {}
    max_tokens, stop, num_ctx = -1, [], None

    def number(key: str, x: Any) -> int | float:
        if not _number(x) or not _finite(x):  # Infinity, NaN, 1e400, a 400-digit integer: no number Go reads
            raise bad(f"options.{key} must be a number")
        return x

    for key, x in v.items():
        if key in SAMPLING:
            sampling[key] = number(key, x)
        elif key == "num_predict":
            n = number(key, x)
            # Ollama's runner limits only when num_predict > 0: 0, -1 and -2 all mean no limit
            max_tokens = min(int(n), I32_MAX) if n >= 1 else -1
        elif key == "num_ctx":
            n = number(key, x)
            if n > n_ctx:
                raise bad(f"num_ctx {_shown(n)} is larger than the context this server holds ({n_ctx}); restart "
                          f"bankml serve with --ctx {_shown(n)} if it fits in memory")
            if n >= 1:
                num_ctx = int(n)
        elif key == "stop":
            stop = stops(x)
        elif key == "mirostat":
            if number(key, x) != 0:
                raise bad(MIROSTAT_REFUSED)
        elif key == "tfs_z":
            if number(key, x) != 1:
                raise bad("tfs_z: tail-free sampling is not reproduced (llama.cpp removed it)")
        elif key in NEUTRAL or key in IGNORED:
            pass
        else:
            raise bad(f"options.{key}: not an option bankML knows; it refuses rather than ignore what might "
                      "change the answer")
    return Options(sampling, max_tokens, stop, num_ctx)


def sampling_params(opts: Options, defaults: SamplingParams, n_probs: int) -> SamplingParams:
    """The sampler over the GGUF's defaults, through llama-server's field table and its sampler checks
    (the messages /v1 gives: a negative repeat_last_n, a repeat_penalty <= 0, ...), then the top_k range."""
    p = read_fields({**opts.sampling, "stop": opts.stop}, defaults)
    params = SamplingParams(**{k: p[k] for k in SamplingParams.__dataclass_fields__})
    if params.mirostat != 0:  # a GGUF default (general.sampling.mirostat)
        raise bad(MIROSTAT_REFUSED)
    if params.samplers != DEFAULT_SAMPLERS:  # a GGUF default order (general.sampling.sequence)
        raise bad("samplers: only llama.cpp's default sampler order is reproduced")
    # the value asked for, before llama-server's clamp makes a negative one 0
    top_k = get_int(opts.sampling["top_k"]) if "top_k" in opts.sampling else params.top_k
    lo, hi = TOP_K_RANGE
    if not lo <= top_k <= hi:
        raise bad(f"top_k {top_k}: only {lo}–{hi} is reproduced (llama.cpp sorts larger sets another way)")
    return replace(params, max_tokens=opts.max_tokens, n_probs=n_probs)


def chat_messages(v: Any) -> list[dict]:
    """Ollama's messages for the template: a role and text content; `thinking` is the reasoning; an
    assistant's `tool_calls` and a tool's `tool_name` are kept (gateway/serving/tool_calls.py renders them)."""
    if not isinstance(v, list):
        raise bad("messages must be an array")
    out = []
    for m in v:
        if not isinstance(m, dict):
            raise bad("a message without a role")
        if isinstance(m.get("images"), list) and m["images"]:
            raise bad(IMAGES_REFUSED)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad("a message without a role")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise bad("only text content is in scope")
        msg = {"role": role, "content": content or ""}
        if m.get("tool_calls"):  # Ollama's {"function": {"name", "arguments": {...}}}, in OpenAI's form
            msg["tool_calls"] = from_ollama_calls(m["tool_calls"])
        for key in ("tool_name", "tool_call_id"):  # a tool's result: which tool, which call
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        thinking = m.get("thinking", m.get("reasoning_content"))
        if isinstance(thinking, str):
            msg["reasoning_content"] = thinking
        out.append(msg)
    return out


def _apply_layer(resolved: Resolved, kind: str, body: dict) -> dict:
    if resolved.derived is None:
        return body
    return apply_ollama(resolved.derived.layer, kind, body)


def _empty_num_ctx(body: dict, n_ctx: int) -> int | None:
    # the load path checks nothing: a bad `options` records --ctx, as Ollama's would
    try:
        return read_options(body.get("options"), n_ctx).num_ctx
    except InvalidRequest:
        return None


def parse_ollama(body: bytes, kind: str, registry: Registry, n_ctx: int, default_keep_alive_s: float) -> OllamaRequest:
    """The request, checked in the spec's order (module doc); every refusal before any load."""
    request = read_body(body)
    resolved = registry.resolve(request.get("model"))
    request = _apply_layer(resolved, kind, request)
    ka = keep_alive(request.get("keep_alive"), default_keep_alive_s)
    stream = _bool(request, "stream", True)
    if is_empty_prompt(kind, request):
        return OllamaRequest(kind, resolved, request, ka, stream, True, _empty_num_ctx(request, n_ctx))
    grammar = ollama_format_grammar(request.get("format"))
    tools = _tools(kind, request)
    refusals(request)
    reasoning = ollama_think(request.get("think"))
    raw = kind == "generate" and _bool(request, "raw", False)
    logprobs, top = read_logprobs(request)
    opts = read_options(request.get("options"), n_ctx)
    info = resolved.pin.info
    defaults = info.sampling if info is not None else SamplingParams()
    params = sampling_params(opts, defaults, max(top, 1) if logprobs else 0)
    messages, raw_prompt = None, None
    if kind == "chat":
        messages = chat_messages(request["messages"])
    elif raw:
        raw_prompt = request["prompt"]
    elif resolved.derived is not None:  # its conversation (gateway/serving/layer.py apply_ollama; never a client's)
        messages = chat_messages(request["bankml_messages"])
    else:
        system = request.get("system")
        if system is not None and not isinstance(system, str):
            raise bad("system must be a string")
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": request["prompt"]}]
    fmt = request.get("format")
    schema = {"type": "object"} if fmt == "json" else fmt if isinstance(fmt, dict) else None
    return OllamaRequest(kind, resolved, request, ka, stream, False, opts.num_ctx, params, messages, raw_prompt,
                         logprobs, top, grammar, tools, schema, reasoning)


def _tools(kind: str, request: dict) -> Tools | None:
    """Chat's tools, under `auto` (Ollama has no tool_choice or parallel_tool_calls: one call, or text)."""
    if not is_present(request.get("tools")):
        return None
    if kind != "chat":
        raise bad("tools: /api/generate takes no tools (Ollama's generate has no tool calling); send the "
                  "conversation to /api/chat")
    return read_tools({"tools": request["tools"]})
