"""`POST /completion` (and its alias `/completions`), `/v1/completions`, `/infill`: the body read as
llama-server reads it (b11434), before any model work, and the prompt's tokens once the model is held.

`parse_completion`, in llama-server's order: the JSON (gateway/http/body.parse_body); `prompt` required
(nlohmann's `at()` errors); on the OpenAI routes `oai_layer`; llama-server's field table
(request_fields.read_fields), `n` bounded only once the model is held (`check_n`, against `[engine]
max_seqs`, llama-server's n_parallel); then ours, as for a chat (chat_request.refuse_unsupported), less
`timings_per_token` and `return_progress`, which are honoured. `prompt_tokens` is llama-server's
`tokenize_input_prompts` (gateway/serving/prompt_input.py), every id then checked against the vocabulary
as `server_tokens::validate` does when the task starts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from bankml.errors import ContextExceeded, InvalidRequest, NotSupported
from gateway.http.json_values import get_int, has_value, json_value, type_name
from gateway.openai.chat_request import refuse_unsupported
from gateway.serving.constraints import fields_grammar, read_logit_bias
from gateway.serving.prompt_input import prompt_count, tokenize_input_prompts
from gateway.serving.request_fields import I32_MAX, read_fields
from model.messages import SamplingParams
from model.tokenizer_bpe import TokenLimitExceeded

N_UNBOUNDED = I32_MAX
_SAMPLING = {f.name for f in fields(SamplingParams)}


@dataclass(frozen=True)
class CompletionRequest:
    prompt: Any  # the request's `prompt`, tokenized once the model is held (`prompt_tokens`)
    stream: bool
    params: SamplingParams
    n: int  # sequences per prompt (llama-server's n_cmpl)
    return_tokens: bool
    timings_per_token: bool
    include_usage: bool
    response_fields: list | None
    raw: dict  # the request after the OpenAI layer, for /infill's own fields
    return_progress: bool = False  # prompt progress events (streamed only, as llama-server)
    grammar: str | None = None  # llguidance grammar text from json_schema / grammar (gateway/serving/constraints.py)
    id_slot: int = -1  # llama-server's: the sequence slot to run in (-1: any)
    echo: bool = False  # /v1/completions: the prompt before the completion, with its logprobs (gateway/openai/echo.py)


def oai_layer(body: Any) -> dict:
    """oaicompat_completion_params_parse (b11434): `stop` as a string or an array, then every other key
    passed through (`n_predict` over `max_tokens`). b11434 takes `echo`, `suffix` and `best_of` and
    ignores them (recorded); each would change the answer a client expects, so ours honours `echo`
    (gateway/openai/echo.py) and refuses the others (`_refuse_oai`), after llama-server's own checks."""
    params: dict[str, Any] = {}
    stop = body.get("stop")
    params["stop"] = [stop] if isinstance(stop, str) else json_value(body, "stop", [])
    for key, value in body.items():
        if key not in params or key == "n_predict":
            params[key] = value
    return params


def _refuse_oai(doc: dict) -> None:
    if has_value(doc, "suffix"):  # OpenAI's insertion: text after the completion (llama-server drops it)
        raise NotSupported("'suffix' is not supported by bankml serve --native")
    if has_value(doc, "best_of") and doc["best_of"] != 1:  # n candidates, the best returned
        raise NotSupported("'best_of' is not supported by bankml serve --native")


def parse_completion(doc: Any, defaults: SamplingParams, *, oai: bool) -> CompletionRequest:
    """The request checked as llama-server checks it, then against what this engine does."""
    if not isinstance(doc, dict):  # data.at("prompt") on an array or a scalar: nlohmann's type_error
        raise InvalidRequest(f"[json.exception.type_error.304] cannot use at() with {type_name(doc)}")
    if "prompt" not in doc:  # data.at("prompt") on a body without one: nlohmann's out_of_range
        raise InvalidRequest("[json.exception.out_of_range.403] key 'prompt' not found")
    original = doc
    if oai:
        doc = oai_layer(doc)
    p = read_fields(doc, defaults, n_max=N_UNBOUNDED)
    echo = oai and p.get("echo") is True
    if echo:
        if p["stream"]:
            raise NotSupported("'echo' with 'stream' is not supported by bankml serve --native yet")
        p["echo"] = False  # honoured (gateway/openai/echo.py)
    timings_per_token = bool(p.get("timings_per_token"))
    return_progress = bool(p.get("return_progress"))
    # honoured here: every output carries the engine thread's timeline, the engine reports each
    # prefill chunk (refuse_unsupported refuses both for what does not)
    p["timings_per_token"] = p["return_progress"] = False
    refuse_unsupported(p, doc, [])
    if oai:
        _refuse_oai(original)
    grammar = fields_grammar(p)
    p["logit_bias"] = read_logit_bias(p.get("logit_bias"))
    p["ignore_eos"] = bool(p.get("ignore_eos"))
    sp = SamplingParams(**{k: v for k, v in p.items() if k in _SAMPLING})
    fields_ = p.get("response_fields")
    return CompletionRequest(doc["prompt"], bool(p["stream"]), sp, int(p["n"]), bool(p.get("return_tokens")),
                             timings_per_token, bool(p["include_usage"]),
                             fields_ if isinstance(fields_, list) and fields_ else None, doc, return_progress, grammar,
                             json_value(doc, "id_slot", -1, get_int), echo)


def check_sequences(prompt: Any, n: int, max_sequences: int) -> None:
    """Ours (llama-server has no bound): one request's prompts x `n` sequences at most what the engine can
    take at once, its sequences plus its queue's room ([engine] max_seqs + max_waiting; engine_thread's
    submit_all). Checked before the model is held or any prompt tokenized: a list of thousands of
    prompts would otherwise cost their tokenization and then a 503 that no retry can cure."""
    count = prompt_count(prompt)  # prompt_input's split, nothing tokenized
    if count * n > max_sequences:
        raise InvalidRequest(f"'prompt': {count} prompts x n {n} = {count * n} sequences, more than one request may "
                             f"hand the engine (at most {max_sequences}: [engine] max_seqs + max_waiting)")


def check_n(n: int, n_parallel: int) -> None:
    """llama-server's hard limit on n_cmpl, 1..n_parallel (server-schema.cpp), against this engine's sequences."""
    if not 1 <= n <= n_parallel:
        raise InvalidRequest(f"Field 'n': Value must be between 1 <= value <= {n_parallel}, but got {n}")


# --- the prompt's tokens ---------------------------------------------------------------------------


def prompt_tokens(model, prompt: Any) -> list[list[int]]:
    """tokenize_input_prompts (gateway/serving/prompt_input.py) as b11434 answers it on /completion (recorded):
    one prompt, or a list of them; an empty one is answered empty (`[[]]`, or "" for a model that adds
    no BOS), every id checked against the vocabulary. A string is tokenized only until it is sure not
    to fit (NativeModel.count_limit: the count exact up to about twice the context, "at least" beyond)."""
    try:
        prompts = tokenize_input_prompts(model, prompt, "prompt", getattr(model, "count_limit", None))
    except TokenLimitExceeded as e:
        raise ContextExceeded(f"request (at least {e.at_least} tokens) exceeds the available context size "
                              f"({model.n_ctx} tokens), try increasing it",
                              n_prompt_tokens=e.at_least, n_ctx=model.n_ctx) from None
    n_vocab = vocab_size(model)
    for ids in prompts:
        if n_vocab is not None and any(not 0 <= t < n_vocab for t in ids):
            raise InvalidRequest("Prompt contains invalid tokens")
    return prompts


def vocab_size(model) -> int | None:
    n = getattr(model.tokenizer, "n_vocab", None)
    return int(n) if n is not None else None
