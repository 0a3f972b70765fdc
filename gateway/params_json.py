"""llama-server's task params as it writes them (tools/server/server-task.cpp, `task_params::to_json`):
/completion's `generation_settings` and each busy slot's `params` in `GET /slots`.

The values are the request's, read by gateway/request_fields.py; a field this engine only takes at
its neutral value (it refuses any other: mirostat, grammars, logit_bias, ignore_eos, lora, n_keep...)
is written at that value, since that is what the answer was generated with.
"""

from __future__ import annotations

from typing import Any

from model.messages import SamplingParams

# llama.cpp's defaults for what this engine does not vary (common/common.h)
MIROSTAT_TAU = 5.0
MIROSTAT_ETA = 0.1


def params_json(p: SamplingParams, *, stream: bool = False, timings_per_token: bool = False) -> dict[str, Any]:
    return {
        "seed": p.seed & 0xFFFFFFFF,  # llama-server's seed is a uint32: -1 (random) reads 4294967295
        "temperature": p.temperature,
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
        "mirostat": p.mirostat,
        "mirostat_tau": MIROSTAT_TAU,
        "mirostat_eta": MIROSTAT_ETA,
        "stop": list(p.stop),
        "max_tokens": p.max_tokens,
        "n_predict": p.max_tokens,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": False,
        "stream": stream,
        "logit_bias": [],
        "n_probs": p.n_probs,
        "min_keep": p.min_keep,
        "grammar": "",
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "thinking_forced_open": False,
        "samplers": list(p.samplers),
        "timings_per_token": timings_per_token,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }
