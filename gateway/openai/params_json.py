"""llama-server's task params as it writes them (tools/server/server-task.cpp, `task_params::to_json`):
/completion's `generation_settings` and each busy slot's `params` in `GET /slots`.

The values are the request's, read by gateway/serving/request_fields.py; a field this engine only takes at
its neutral value (it refuses any other: mirostat, lora, n_keep...)
is written at that value, since that is what the answer was generated with.
"""

from __future__ import annotations

from typing import Any

from gateway.http.json_values import f32
from model.messages import SamplingParams
from model.speculative import Speculation

# llama.cpp's defaults for what this engine does not vary (common/common.h)
MIROSTAT_TAU = 5.0
MIROSTAT_ETA = 0.1
ADAPTIVE_TARGET = -1.0  # the adaptive-p sampler: off
ADAPTIVE_DECAY = 0.9


def logit_bias_json(p: SamplingParams, tokenizer: Any = None) -> list[dict[str, Any]]:
    """llama-server's `logit_bias` as it applied it (`format_logit_bias`): the request's entries, a string's
    tokens each with its bias (needs the model's `tokenizer`; without one, entries by id only), then under
    `ignore_eos` every end-of-generation token at -inf, which its JSON writes as null."""
    out: list[dict[str, Any]] = []
    for tok, bias in p.logit_bias:
        ids = [tok] if isinstance(tok, int) else tokenizer.encode(tok, False, False) if tokenizer is not None else []
        out += [{"bias": f32(bias), "token": t} for t in ids]
    if p.ignore_eos and tokenizer is not None:
        out += [{"bias": None, "token": t} for t in sorted(tokenizer.eog_ids)]
    return out


def speculative_json(p: SamplingParams, speculation: Speculation | None) -> dict[str, Any]:
    """The server's speculative decoding, as the task params show it: `speculative.types` (b11434's key:
    "none", or --spec-type's "ngram-simple"); when it drafts, also the request's draft lengths as this
    engine applies them (-1, a request that set none, read as --draft-max / --draft-min; clamped to
    --draft-max, which sized the verify programs) and its p_min, under the keys llama-server wrote before
    b11434 (`speculative.n_max`, `n_min`, `p_min`). A server that drafts nothing writes b11434's one key."""
    if speculation is None or not speculation.on:
        return {"speculative.types": "none"}
    n_max, n_min = speculation.limits(p.spec_n_max, p.spec_n_min)
    return {"speculative.types": speculation.spec_type, "speculative.n_max": n_max, "speculative.n_min": n_min,
            "speculative.p_min": f32(p.spec_p_min)}


def params_json(p: SamplingParams, *, stream: bool = False, timings_per_token: bool = False,
                tokenizer: Any = None, speculation: Speculation | None = None) -> dict[str, Any]:
    """b11434's keys in its order (recorded in tests/fixtures/completions_smollm2.json); a float is
    written as the float llama-server holds (0.95 reads 0.949999988079071). `tokenizer`: the model's, for
    the biases a string or `ignore_eos` stands for; `speculation`: the engine's (`speculative_json`)."""
    return {
        "seed": p.seed & 0xFFFFFFFF,  # llama-server's seed is a uint32: -1 (random) reads 4294967295
        "temperature": f32(p.temperature),
        "dynatemp_range": f32(p.dynatemp_range),
        "dynatemp_exponent": f32(p.dynatemp_exponent),
        "top_k": p.top_k,
        "top_p": f32(p.top_p),
        "min_p": f32(p.min_p),
        "top_n_sigma": f32(p.top_n_sigma),
        "xtc_probability": f32(p.xtc_probability),
        "xtc_threshold": f32(p.xtc_threshold),
        "typical_p": f32(p.typical_p),
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": f32(p.repeat_penalty),
        "presence_penalty": f32(p.presence_penalty),
        "frequency_penalty": f32(p.frequency_penalty),
        "dry_multiplier": f32(p.dry_multiplier),
        "dry_base": f32(p.dry_base),
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
        "mirostat": p.mirostat,
        "mirostat_tau": f32(MIROSTAT_TAU),
        "mirostat_eta": f32(MIROSTAT_ETA),
        "adaptive_target": f32(ADAPTIVE_TARGET),
        "adaptive_decay": f32(ADAPTIVE_DECAY),
        "stop": list(p.stop),
        "max_tokens": p.max_tokens,
        "n_predict": p.max_tokens,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": p.ignore_eos,
        "stream": stream,
        "logit_bias": logit_bias_json(p, tokenizer),
        "n_probs": p.n_probs,
        "min_keep": p.min_keep,
        "grammar": "",
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only",
        "reasoning_format": "deepseek",  # llama-server's default (--reasoning-format auto)
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(p.samplers),
        **speculative_json(p, speculation),
        "timings_per_token": timings_per_token,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }
