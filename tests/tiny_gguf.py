"""Tiny random GGUFs for engine tests, one per architecture, written with gguf-py's GGUFWriter.

The tokenizer is a byte-level GPT-2 vocabulary (256 byte tokens, two merges) plus three control
tokens, so every text round-trips and the engine's end-of-generation handling has real ids.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

MERGES = ["h e", "Ġ t"]  # two BPE merges, so the vocabulary is a real (if tiny) BPE one
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
N_NORMAL = 256 + len(MERGES)
EOS_ID = N_NORMAL + SPECIALS.index("<|endoftext|>")
N_VOCAB = N_NORMAL + len(SPECIALS)


def _byte_tokens() -> list[str]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, arch: str = "llama", *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                    n_head_kv: int = 2, head_dim: int | None = None, n_ff: int = 96, seed: int = 0,
                    tied: bool = True, llama3_rope: bool = False, linear_rope_factor: float = 0.0,
                    rope_scaling_type: str | None = None, sliding_window: int = 8, n_rot: int | None = None,
                    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    raw_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
                    scale: float = 0.2) -> Path:
    """Write a random model of `arch` to `path` and return it.

    raw_tensors: matrices to write as these raw bytes and type instead (e.g. an unsupported type).
    """
    rng = np.random.default_rng(seed)
    head_dim = head_dim or n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    w.add_rope_freq_base(1e6 if arch in ("gemma3", "qwen3") else 10000.0)
    if head_dim != n_embd // n_head or arch in ("gemma3", "qwen3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if n_rot is not None:
        w.add_rope_dimension_count(n_rot)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    if rope_scaling_type is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling_type))
    if linear_rope_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope_factor)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS)
    w.add_token_types([gguf.TokenType.NORMAL] * N_NORMAL + [gguf.TokenType.CONTROL] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(EOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)

    def rand(*shape, s=scale):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm(n):  # around 1, like trained norms (gemma's +1 already folded in)
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add_matrix(name, array):
        if name in (raw_tensors or {}):
            raw, qtype = raw_tensors[name]
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif matrix_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, array)
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)

    q, kv = n_head * head_dim, n_head_kv * head_dim
    add_matrix("token_embd.weight", rand(N_VOCAB, n_embd, s=1.0))
    w.add_tensor("output_norm.weight", norm(n_embd))
    if not tied:
        add_matrix("output.weight", rand(N_VOCAB, n_embd))
    if llama3_rope:
        w.add_tensor("rope_freqs.weight", (1.0 + 4.0 * rng.random((n_rot or head_dim) // 2)).astype(np.float32))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(n_embd))
        add_matrix(p + "attn_q.weight", rand(q, n_embd))
        add_matrix(p + "attn_k.weight", rand(kv, n_embd))
        add_matrix(p + "attn_v.weight", rand(kv, n_embd))
        add_matrix(p + "attn_output.weight", rand(n_embd, q))
        w.add_tensor(p + "ffn_norm.weight", norm(n_embd))
        add_matrix(p + "ffn_gate.weight", rand(n_ff, n_embd))
        add_matrix(p + "ffn_up.weight", rand(n_ff, n_embd))
        add_matrix(p + "ffn_down.weight", rand(n_embd, n_ff))
        if arch == "qwen2":
            for t, n in (("q", q), ("k", kv), ("v", kv)):
                w.add_tensor(p + f"attn_{t}.bias", rand(n))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm(n_embd))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
