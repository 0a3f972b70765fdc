"""The model's shape and numeric rules, read once from GGUF keys into a frozen dataclass.

`Config.from_gguf` is the only place that interprets header keys. It mirrors llama.cpp's
`llama_model::load_hparams` (src/llama-model.cpp) for the four architectures we run, and refuses
everything else with the reason, so a model we cannot honour never reaches the forward pass.
The config is static under `jax.jit`: everything here is hashable, never an array.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# llama.cpp's rope_type per architecture (llama_model_rope_type in src/llama-model.cpp): llama rotates
# adjacent pairs (NORM; the HF->GGUF converter permutes Q/K rows so this matches HF's rotate_half),
# the others rotate (i, i + n_rot/2) (NEOX).
_NEOX_ARCHS = ("qwen2", "qwen3", "gemma3")

# gemma3: llama.cpp hard-codes `hparams.set_swa_pattern(6)`: layers with il % 6 < 5 use the
# sliding window and the local rope base 10000; every 6th layer is global.
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_BASE_SWA = 10000.0


class UnsupportedModel(ValueError):
    """The GGUF asks for something this engine does not implement. The message is the reason."""


@dataclass(frozen=True)
class Config:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length (== value_length), else n_embd / n_head
    n_ff: int
    n_rot: int  # rope.dimension_count: the leading dims of each head that rotate
    norm_eps: float
    rope_neox: bool
    rope_base: float  # global layers
    rope_freq_scale: float  # 1 / rope.scaling.factor for linear scaling, else 1
    rope_base_swa: float  # sliding-window layers (gemma3: 10000)
    rope_freq_scale_swa: float
    attn_scale: float  # multiplies Q.K
    n_swa: int  # sliding window in tokens; 0: none
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    embd_scale: float  # gemma: sqrt(n_embd) on the token embeddings
    final_logit_softcap: float  # 0: none
    ffn_gelu: bool  # gemma3: GELU(tanh) gate; otherwise SiLU (SwiGLU)
    qk_norm: bool  # per-head RMS norms on Q and K (qwen3, gemma3)
    post_norms: bool  # gemma3: post_attention_norm and post_ffw_norm

    @property
    def n_group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> Config:
        """Build the config from GGUF key/values.

        `fields` is `GGUFReader.fields` (values are `ReaderField`s) or a plain dict of decoded values.
        Raises `UnsupportedModel` naming the reason for any architecture or option we do not honour.
        """
        kv = _Fields(fields)
        arch = kv.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModel(
                f"unsupported architecture {arch!r}: this engine runs {', '.join(SUPPORTED_ARCHS)}")

        def key(name: str, default: Any = _REQUIRED) -> Any:
            return kv.get(f"{arch}.{name}", default)

        n_embd = int(key("embedding_length"))
        n_layer = int(key("block_count"))
        n_head = _per_layer_scalar(key("attention.head_count"), "attention.head_count")
        n_head_kv = _per_layer_scalar(key("attention.head_count_kv", n_head), "attention.head_count_kv")
        n_ff = _per_layer_scalar(key("feed_forward_length"), "feed_forward_length")
        head_dim = int(key("attention.key_length", n_embd // n_head))
        head_dim_v = int(key("attention.value_length", head_dim))
        if head_dim_v != head_dim:
            raise UnsupportedModel(f"value head width {head_dim_v} differs from key head width {head_dim}")
        if n_head % n_head_kv:
            raise UnsupportedModel(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        n_rot = int(key("rope.dimension_count", head_dim))
        if n_rot > head_dim or n_rot % 2:
            raise UnsupportedModel(f"rope.dimension_count {n_rot} does not fit head width {head_dim}")
        n_vocab = kv.length("tokenizer.ggml.tokens")
        if n_vocab is None:
            n_vocab = int(key("vocab_size"))

        rope_base = float(key("rope.freq_base", 10000.0))
        rope_freq_scale = _rope_freq_scale(kv, arch)

        n_swa = 0
        swa_layers = (False,) * n_layer
        rope_base_swa, rope_freq_scale_swa = rope_base, rope_freq_scale
        embd_scale = 1.0
        softcap = 0.0
        attn_scale = float(key("attention.scale", 0.0)) or 1.0 / math.sqrt(head_dim)
        if arch == "gemma3":
            n_swa = int(key("attention.sliding_window", 0))
            if n_swa > 0:
                swa_layers = tuple(il % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for il in range(n_layer))
                rope_base_swa, rope_freq_scale_swa = GEMMA3_ROPE_BASE_SWA, 1.0
            embd_scale = math.sqrt(n_embd)
            softcap = float(key("final_logit_softcapping", 0.0))
            # llama.cpp (llama_load_hparams gemma3): the 27B (62 layers) scales by n_embd / n_head.
            attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)

        return cls(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length")),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=n_ff,
            n_rot=n_rot,
            norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_neox=arch in _NEOX_ARCHS,
            rope_base=rope_base,
            rope_freq_scale=rope_freq_scale,
            rope_base_swa=rope_base_swa,
            rope_freq_scale_swa=rope_freq_scale_swa,
            attn_scale=attn_scale,
            n_swa=n_swa,
            swa_layers=swa_layers,
            embd_scale=embd_scale,
            final_logit_softcap=softcap,
            ffn_gelu=arch == "gemma3",
            qk_norm=arch in ("qwen3", "gemma3"),
            post_norms=arch == "gemma3",
        )


def _rope_freq_scale(kv: _Fields, arch: str) -> float:
    """Linear rope scaling as llama.cpp reads it; YaRN and LongRoPE are refused.

    llama.cpp defaults the scaling type to "linear" and takes 1/rope.scaling.factor (or
    1/rope.scale_linear). Llama 3.x's own scaling is not a type here: the converter bakes it into the
    `rope_freqs.weight` tensor, which the weights loader carries.
    """
    kind = kv.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise UnsupportedModel(f"rope scaling type {kind!r} is not supported (only none and linear)")
    factor = float(kv.get(f"{arch}.rope.scaling.factor", 0.0)) or float(kv.get(f"{arch}.rope.scale_linear", 0.0))
    return 1.0 / factor if factor else 1.0


def _per_layer_scalar(value: Any, name: str) -> int:
    # Some converters write per-layer arrays (e.g. OpenELM); we only run uniform layers.
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise UnsupportedModel(f"{name} varies per layer, which is not supported")
        value = value[0]
    return int(value)


_REQUIRED = object()


class _Fields:
    """Read GGUF values from either `GGUFReader.fields` or a plain dict, decoding only what is asked."""

    def __init__(self, fields: Mapping[str, Any]):
        self._fields = fields

    def get(self, name: str, default: Any = _REQUIRED) -> Any:
        if name not in self._fields:
            if default is _REQUIRED:
                raise UnsupportedModel(f"GGUF key {name!r} is missing")
            return default
        value = self._fields[name]
        contents = getattr(value, "contents", None)
        return contents() if callable(contents) else value

    def length(self, name: str) -> int | None:
        """The element count of an array value, without decoding its elements."""
        if name not in self._fields:
            return None
        value = self._fields[name]
        count = getattr(value, "count", None)  # an array the guard's parse skipped (bankml.guard.GGUFArray)
        if isinstance(count, int):
            return count
        data = getattr(value, "data", None)  # ReaderField: one index per element
        return len(data) if data is not None and hasattr(value, "contents") else len(value)
