"""llama-server's `GET /props`, field by field as b11434's `get_res_props` writes them
(tools/server/server-context.cpp), filled from what this server really does.

- `default_generation_settings`: `params` are the defaults a request starts from (llama.cpp's, under
  the GGUF's general.sampling.* keys), with llama-server's float32 values (0.8 reads
  0.800000011920929); the fields this engine has no knob for carry llama-server's defaults, which
  are what it does (mirostat off, no LoRA, content-only chat parsing, no reasoning extraction).
  `speculative.types` is the server's --spec-type ("none", or "ngram-simple"); a server that drafts also
  shows the draft lengths a request gets by default (`speculative.n_max` / `n_min`: --draft-max /
  --draft-min) and `speculative.p_min`, as llama-server before b11434 showed them. `n_ctx` is a
  sequence's context.
- `total_slots`: the engine's `[engine] max_seqs`; `model_alias`: the name the answers carry (the
  file name); `model_ftype`: llama.cpp's name of the GGUF's general.file_type.
- `chat_template`: the template in force (--chat-template-file's when set, then also
  `chat_template_sha256`; without any, llama-server's ChatML fallback); `chat_template_tool_use` only
  when the GGUF has one and no file replaced the template, as llama-server.
- `endpoint_slots` true (GET /slots is served), `endpoint_metrics` true (GET /metrics is ours,
  Prometheus), `endpoint_props` false (POST /props is refused, as llama-server without --props).

- `chat_template_caps`: found as llama.cpp finds them (gateway/serving/template_caps.py), for the tool-use
  template when there is one (common_chat_templates_get_caps takes the more expressive one);
- `thought_tags` (ours, only for a template that thinks): the tags its model thinks between, whose thought
  the answers cut out (gateway/serving/reasoning.py).

Left out, because we cannot fill it truthfully: `media_marker` (this server takes no media, so no
marker means anything in a prompt). Kept beside llama-server's: `n_ctx` at the top (bankml's /props
always had it), and `cache_type`, what the KV cache's pages hold ([engine] cache_type; llama-server's
--cache-type-k/v, which its /props does not show).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from bankml import __version__
from gateway.http.json_values import f32
from gateway.openai.params_json import speculative_json
from gateway.serving.reasoning import thought_tags
from gateway.serving.template_caps import template_caps
from model.chat_template import CHATML_TEMPLATE
from model.messages import SamplingParams
from model.speculative import Speculation
from model.tokenizer_gguf import gguf_fields

# llama_ftype_name (src/llama-model-loader.cpp), by general.file_type
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 32: "BF16", 40: "Q1_0", 41: "Q2_0", 2: "Q4_0", 3: "Q4_1", 8: "Q5_0", 9: "Q5_1",
    7: "Q8_0", 38: "MXFP4 MoE", 39: "NVFP4", 10: "Q2_K - Medium", 21: "Q2_K - Small", 11: "Q3_K - Small",
    12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small",
    17: "Q5_K - Medium", 18: "Q6_K", 36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary",
    19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw", 28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw",
    22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw", 31: "IQ1_M - 1.75 bpw",
    25: "IQ4_NL - 4.5 bpw", 30: "IQ4_XS - 4.25 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw",
}
_GUESSED = 1024  # LLAMA_FTYPE_GUESSED


def ftype_name(file_type: Any) -> str:
    """llama_ftype_name: the name, "(guessed) " before it when the flag says so."""
    if not isinstance(file_type, int) or isinstance(file_type, bool):
        return "unknown, may not work"
    name = FTYPE_NAMES.get(file_type & ~_GUESSED, "unknown, may not work")
    return "(guessed) " + name if file_type & _GUESSED else name


@lru_cache(maxsize=32)
def _header_fields(path: str, identity: Any) -> tuple[str, str | None]:
    """(model_ftype, the GGUF's tool-use template) of the file at `path` as verified (`identity` keys the
    cache: a file replaced and verified again is read again)."""
    kv = gguf_fields(path, ("general.file_type", "tokenizer.chat_template.tool_use"))
    tool_use = kv.get("tokenizer.chat_template.tool_use")
    return ftype_name(kv.get("general.file_type")), tool_use if isinstance(tool_use, str) and tool_use else None


def default_params(d: SamplingParams, speculation: Speculation | None = None) -> dict[str, Any]:
    """task_params::to_json(only_metrics=true) for a request that sets nothing (server-task.cpp), on an
    engine that speculates as `speculation` says (params_json.py's `speculative_json`)."""
    return {
        "seed": d.seed & 0xFFFFFFFF,  # a uint32: -1 (random) reads 4294967295
        "temperature": f32(d.temperature),
        "dynatemp_range": f32(d.dynatemp_range),
        "dynatemp_exponent": f32(d.dynatemp_exponent),
        "top_k": d.top_k,
        "top_p": f32(d.top_p),
        "min_p": f32(d.min_p),
        "top_n_sigma": f32(d.top_n_sigma),
        "xtc_probability": f32(d.xtc_probability),
        "xtc_threshold": f32(d.xtc_threshold),
        "typical_p": f32(d.typical_p),
        "repeat_last_n": d.repeat_last_n,
        "repeat_penalty": f32(d.repeat_penalty),
        "presence_penalty": f32(d.presence_penalty),
        "frequency_penalty": f32(d.frequency_penalty),
        "dry_multiplier": f32(d.dry_multiplier),
        "dry_base": f32(d.dry_base),
        "dry_allowed_length": d.dry_allowed_length,
        "dry_penalty_last_n": d.dry_penalty_last_n,
        "mirostat": d.mirostat,
        "mirostat_tau": 5.0,  # read only by mirostat, which is off (and refused unless 0)
        "mirostat_eta": f32(0.1),
        "adaptive_target": -1.0,  # the adaptive-p sampler is off (a request that sets it is refused)
        "adaptive_decay": f32(0.9),
        "max_tokens": d.max_tokens,
        "n_predict": d.max_tokens,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": False,
        "stream": False,
        "n_probs": d.n_probs,
        "min_keep": d.min_keep,
        "chat_format": "Content-only",  # the answer is the model's text: no tool-call or reasoning parsing
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(d.samplers),
        **speculative_json(d, speculation),
        "timings_per_token": False,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }


def _mesh(client) -> dict[str, Any]:
    """bankml's own "mesh": the devices the model is split over (model/parallel.py), when the engine says."""
    report = client.weights_report() if hasattr(client, "weights_report") else None
    return {"mesh": report["mesh"]} if report and "mesh" in report else {}


def props_json(loaded: Any) -> dict[str, Any]:
    """/props for the resident model `loaded` (gateway.serving.residency.Loaded). Reads the GGUF header once
    per file: call it off the event loop."""
    m = loaded.model
    tok = m.tokenizer
    ftype, tool_use = _header_fields(loaded.path, loaded.identity)
    template = m.chat_template or CHATML_TEMPLATE
    out: dict[str, Any] = {
        "default_generation_settings": {"params": default_params(m.defaults, loaded.client.speculation),
                                        "n_ctx": m.n_ctx},
        "total_slots": loaded.client.max_seqs,
        "model_alias": loaded.file_name,
        "model_ftype": ftype,
        "model_path": loaded.path,
        "n_ctx": m.n_ctx,
        "cache_type": loaded.client.cache_type,
        **_mesh(loaded.client),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": template,
    }
    if m.chat_template_sha256 is not None:
        out["chat_template_sha256"] = m.chat_template_sha256
    out.update({
        "chat_template_caps": template_caps(tool_use if tool_use is not None and m.chat_template_sha256 is None
                                            else template),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "build_info": f"bankML {__version__} native",
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    })
    if tool_use is not None and m.chat_template_sha256 is None:
        out["chat_template_tool_use"] = tool_use
    tags = thought_tags(m.chat_template)
    if tags is not None:  # ours: the template thinks, between these tags (gateway/serving/reasoning.py)
        out["thought_tags"] = list(tags)
    return out
