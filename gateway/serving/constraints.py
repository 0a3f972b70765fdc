"""Structured output on the gateway: a request's schema or grammar as llguidance grammar text, compiled
per sequence before any model work (model/constraint.py).

- `chat_grammar` follows llama-server's oaicompat_chat_params_parse (tools/server/server-common.cpp,
  b11434): `response_format` first, then the body's `json_schema`, else `grammar` (GBNF);
  `fields_grammar` is the /completion reading (server-task.cpp, params_from_json_cmpl).
- Exact numbers: body.parse_body keeps every number literal a float would change as a `RawNumber`
  (gateway/http/json_values.py), and `exact_json` writes it back, so `"maximum": 0.1` or `1e400` reaches
  llguidance as the request wrote it.
- Bounds first: every schema a request hands us (response_format's, `json_schema`, Ollama's `format`, each
  tool's parameters) is measured in one walk without recursion (`check_schema`: MAX_SCHEMA_DEPTH arrays
  and objects nested, MAX_SCHEMA_NODES values) before anything recursive reads it; `logit_bias` is
  bounded when it is read. Past a bound is a 400 naming the field and the bound.
- `attach_constraints`: compiled off the loop, one Constraint per sequence (`.copy()` for the others), or
  a 400 with llguidance's reason; string keys of `logit_bias` are tokenized here too, as llama-server does.
  Both run on a small pool of their own (PREPARE_THREADS), so requests that were left cannot take every
  worker thread, and work a departed client queued there never starts. llguidance's compile cannot be
  interrupted once started: the bounds are what keep it short.
- `prebuild_tokenizer`: llguidance's tokenizer is built in the background when a model loads, so only a
  constrained request that comes before the build is done waits for it.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from bankml.errors import InvalidRequest, NotSupported
from gateway.http.json_values import RawNumber, nesting
from model import constraint as mc

MAX_SCHEMA_CHARS = 1 << 16  # a JSON schema whose text is longer is refused before it is compiled
# OpenAI's structured outputs take up to 10 levels of object nesting and 5,000 properties in all
# (platform.openai.com/docs/guides/structured-outputs, "Supported schemas"); an object level is two
# here (the schema and its `properties`), so 64 and 25,000 values leave room above both
MAX_SCHEMA_DEPTH = 64  # arrays and objects nested in one schema
MAX_SCHEMA_NODES = 25_000  # values (objects, arrays, scalars) in a request's schemas together
MAX_BIAS_ENTRIES = 1 << 18  # logit_bias entries: the largest vocabularies (Gemma 3's 262,144 tokens)
MAX_BIAS_KEY_CHARS = 1 << 10  # a logit_bias string, tokenized: a word or phrase, not a document
PREPARE_THREADS = 2  # grammars compiled and logit_bias strings tokenized at once


def check_schema(field: str, schema: Any, max_nodes: int = MAX_SCHEMA_NODES) -> int:
    """A 400 naming `field` for a schema nested deeper than MAX_SCHEMA_DEPTH or holding more than
    `max_nodes` values; else its number of values (what is left of a shared budget is the caller's)."""
    depth, nodes = nesting(schema, MAX_SCHEMA_DEPTH, max_nodes)
    if depth > MAX_SCHEMA_DEPTH:
        raise NotSupported(f"'{field}' is not supported by bankml serve --native: a schema nested deeper than "
                           f"{MAX_SCHEMA_DEPTH} levels (arrays and objects)")
    if nodes > max_nodes:
        raise NotSupported(f"'{field}' is not supported by bankml serve --native: schemas of more than "
                           f"{MAX_SCHEMA_NODES} values in all")
    return nodes


def exact_json(value: Any) -> str:
    """`value` as compact JSON, every RawNumber as its own literal."""
    if isinstance(value, RawNumber):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + exact_json(v) for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(exact_json(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(str(value))  # cannot come from JSON text; never silently invalid
    return json.dumps(value, ensure_ascii=False)


def schema_grammar(schema: Any, field: str = "json_schema") -> str:
    """llguidance's grammar for the schema a request's `field` holds, bounded first."""
    if isinstance(schema, dict) and not schema:
        return mc.json_schema_grammar("{}")
    check_schema(field, schema)
    text = exact_json(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise NotSupported(f"'{field}' is not supported by bankml serve --native: more than "
                           f"{MAX_SCHEMA_CHARS} characters")
    return _rejected_is_400(mc.json_schema_grammar, text)


def _rejected_is_400(build, *args) -> str:
    try:
        return build(*args)
    except mc.GrammarRejected as e:
        raise InvalidRequest(f"Failed to initialize samplers: {e}") from None
    except RecursionError:  # the bounds keep every schema within Python's stack; never a 500 if one does not
        raise InvalidRequest("Failed to initialize samplers: the schema is nested too deeply") from None


def fields_grammar(p: dict) -> str | None:
    """The grammar of llama-server's `json_schema` / `grammar` fields as read_fields kept them."""
    if "json_schema" in p:
        return schema_grammar(p["json_schema"])
    if p.get("grammar"):  # llama.cpp's parser took it already (request_fields._sampler_init)
        try:
            return mc.gbnf_grammar(p["grammar"])
        except mc.GrammarRejected as e:
            raise InvalidRequest(f"'grammar': llguidance cannot compile this GBNF grammar, which llama.cpp "
                                 f"parses: {e}") from None
    return None


def chat_grammar(p: dict, request: dict) -> str | None:
    """/v1/chat/completions: response_format first (it sets json_schema), then the body's fields."""
    rf = request.get("response_format") if isinstance(request, dict) else None
    if isinstance(rf, dict):
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema")
            return schema_grammar(schema, "response_format") if isinstance(schema, dict) else \
                mc.json_object_grammar()
        if kind == "json_schema":
            return schema_grammar(_json_schema_of(rf), "response_format")
    return fields_grammar(p)


def _json_schema_of(rf: dict) -> dict:
    """response_format json_schema's `json_schema.schema`; absent (or not an object) is `{}`, any value."""
    wrapper = rf.get("json_schema")
    schema = wrapper.get("schema", {}) if isinstance(wrapper, dict) else {}
    return schema if isinstance(schema, dict) else {}


def response_schema(request: dict) -> Any:
    """The schema an answer with tools responds in when it does not call (the generic format's
    `response`, gateway/serving/tool_calls.py), read as `chat_grammar` reads it: response_format's, else the
    body's `json_schema`; None for text."""
    rf = request.get("response_format")
    if isinstance(rf, dict):
        if rf.get("type") == "json_object":
            return rf["schema"] if isinstance(rf.get("schema"), dict) else {"type": "object"}
        if rf.get("type") == "json_schema":
            return _json_schema_of(rf)
    schema = request.get("json_schema")
    return schema if isinstance(schema, dict) else None


def ollama_format_grammar(fmt: Any) -> str | None:
    """Ollama's `format` (llm/server.go): null or "" nothing; "json" its JSON grammar (root ::= object,
    so any object); an object a JSON schema; anything else Ollama's error."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return mc.json_object_grammar()
    check_schema("format", fmt)  # before exact_json, which recurses
    if not isinstance(fmt, dict):
        raw = exact_json(fmt)
        raise InvalidRequest(f"invalid format: {json.dumps(raw)}; expected \"json\" or a valid JSON Schema object")
    return schema_grammar(fmt, "format")


# --- logit_bias ----------------------------------------------------------------------------------


def read_logit_bias(v: Any) -> tuple[tuple[int | str, float], ...]:
    """llama-server's logit_bias (params_from_json_cmpl): `[[token, bias], ...]` or `{"token": bias}`;
    a token is an id or a string (tokenized later); `false` is -inf; a malformed entry is skipped.
    Ours: more than MAX_BIAS_ENTRIES entries, or a string longer than MAX_BIAS_KEY_CHARS, is a 400
    (llama-server tokenizes whatever it is given)."""
    def bias_of(b: Any) -> float | None:
        if b is False:
            return -math.inf
        if isinstance(b, int | float) and not isinstance(b, bool):
            return float(b)
        return None

    pairs: list[tuple[Any, Any]] = []
    if isinstance(v, list):
        pairs = [(e[0], e[1]) for e in v if isinstance(e, list) and len(e) == 2]
    elif isinstance(v, dict):
        pairs = [(_key_token(k), b) for k, b in v.items()]
    if len(pairs) > MAX_BIAS_ENTRIES:
        raise NotSupported(f"'logit_bias' is not supported by bankml serve --native: more than {MAX_BIAS_ENTRIES} "
                           f"entries ({len(pairs)})")
    out: list[tuple[int | str, float]] = []
    for tok, b in pairs:
        bias = bias_of(b)
        if bias is None or isinstance(tok, bool) or not isinstance(tok, int | str):
            continue
        if isinstance(tok, str) and len(tok) > MAX_BIAS_KEY_CHARS:
            raise NotSupported(f"'logit_bias' is not supported by bankml serve --native: a token string of more "
                               f"than {MAX_BIAS_KEY_CHARS} characters ({len(tok)})")
        out.append((tok, bias))
    return tuple(out)


def _key_token(key: str) -> int | str:
    try:
        return int(key)  # an object's key: an id when it reads as one (llama-server's std::stoi)
    except ValueError:
        return key


def _resolve_bias(bias, tokenizer, n_vocab: int) -> tuple[tuple[int, float], ...]:
    out: list[tuple[int, float]] = []
    for tok, b in bias:
        ids = tokenizer.encode(tok, False, False) if isinstance(tok, str) else [tok]
        out += [(t, b) for t in ids if 0 <= t < n_vocab]  # out of range: ignored, as llama-server does
    return tuple(out)


# --- compiling, per sequence -----------------------------------------------------------------------

_BUILDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its build thread


def _tokenizer(loaded):
    return loaded.model.tokenizer


def prebuild_tokenizer(loaded) -> None:
    """Start building llguidance's tokenizer for a loaded model (model/constraint.lltokenizer caches it)."""
    tok = _tokenizer(loaded)
    if not hasattr(tok, "attrs"):
        return  # not a GGUF tokenizer (the tests' fake engine): built, and refused, on first use

    def build() -> None:
        try:
            mc.lltokenizer(tok)
        except Exception:  # noqa: BLE001 - the first constrained request builds it again and reports it
            pass

    t = threading.Thread(target=build, name="lltokenizer", daemon=True)
    _BUILDS[tok] = t
    t.start()


_PREPARE = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="constraints")


def _compile(grammar: str, tokenizer, n: int) -> list:
    build = _BUILDS.get(tokenizer)
    if build is not None:
        build.join()  # the load's build: wait for it rather than build a second
    try:
        first = mc.compile_constraint(grammar, tokenizer)
    except mc.GrammarRejected as e:
        raise InvalidRequest(f"Failed to initialize samplers: {e}") from None
    return [first] + [first.copy() for _ in range(n - 1)]


async def attach_constraints(loaded, requests: list, grammar: str | None) -> None:
    """Each request's own Constraint for `grammar` (None: none), and its logit_bias strings tokenized,
    both on the PREPARE_THREADS pool: a client that leaves while its work waits there cancels it
    before it starts (asyncio cancels the pool's future), and what has started is bounded by the
    request's bounds."""
    if grammar is None and not any(r.params.logit_bias for r in requests):
        return  # nothing to compile or resolve: an unconstrained request costs nothing here
    tokenizer = _tokenizer(loaded)
    loop = asyncio.get_running_loop()
    if any(r.params.logit_bias for r in requests):
        biases = await loop.run_in_executor(_PREPARE, _resolve_all, [r.params.logit_bias for r in requests],
                                            tokenizer)
        for r, bias in zip(requests, biases, strict=True):
            r.params = replace(r.params, logit_bias=bias)
    if grammar is None:
        return
    built = await loop.run_in_executor(_PREPARE, _compile, grammar, tokenizer, len(requests))
    for r, c in zip(requests, built, strict=True):
        r.constraint = c


def _resolve_all(biases: list, tokenizer) -> list:
    n_vocab = tokenizer.n_vocab
    return [_resolve_bias(b, tokenizer, n_vocab) for b in biases]
