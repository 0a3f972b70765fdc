"""The engine's GPU wiring, checked end to end on a tiny random model: `run() -> dict`.

`bankml gpu-check` calls `run()` in a process with TRITON_INTERPRET=1 (tests/test_wiring.py too). It
writes a tiny gemma3 GGUF (two sliding-window layers; every matrix Q4_0, Q8_0, Q4_1, F16 or BF16, the
types mixed within and across layers; tests/test_wiring.py runs the twins on six layers, the global one
included), loads it twice -- the CPU path (packed, stacked,
`lax.scan`) and the device layout with the Triton kernels forced on (kernels/ops.py; under the
interpreter here, compiled on a GPU) -- and generates a few greedy tokens from each with several
sequences batched as the engine runs them: ragged prompts prefilled in two chunks (the second reads the
first's pages and carries a padding row), then decode steps over the paged pool. Both must give the same
tokens and logits within `TOLERANCE` of each other. A third run splits the device layout over the
devices there are, two at most (model/parallel.py; `bankml gpu-check` simulates two CPU devices), its
Triton kernels under `shard_map`, and must agree as well.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

N_VOCAB = 128
N_LAYER = 6  # the tests' model: five sliding-window layers, then a global one (gemma3's pattern)
CHECK_LAYERS = 2  # run()'s: both sliding-window; each interpreted layer costs seconds here
PAGE = 16
PROMPT_LENGTHS = (21, 7, 16)  # ragged: the second chunk has one real row and two padding rows
N_DECODE = 3
TOLERANCE = 1e-3  # max |logit difference| / max |logit|: the paths differ only in rounding order
# per layer, the types of (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down)
LAYER_TYPES = [("Q4_0", "Q8_0", "Q4_1", "F16", "Q4_0", "Q8_0", "Q4_1"),
               ("Q8_0", "Q4_1", "Q4_0", "Q8_0", "BF16", "Q4_1", "Q4_0")]


def write_model(path: Path, seed: int = 0, n_layer: int = N_LAYER) -> Path:
    """A tiny gemma3 (n_embd 64, 4 heads on 2 KV heads of 16, sliding window 8) with mixed block types."""
    import gguf

    rng = np.random.default_rng(seed)
    d, h, hkv, dh, f = 64, 4, 2, 16, 128
    w = gguf.GGUFWriter(os.fspath(path), "gemma3")
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(hkv)
    w.add_key_length(dh)
    w.add_value_length(dh)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(8)
    w.add_vocab_size(N_VOCAB)

    def matrix(name: str, rows: int, cols: int, type_name: str, scale: float = 0.2) -> None:
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if type_name == "F16":
            w.add_tensor(name, a.astype(np.float16))
        elif type_name == "BF16":
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", N_VOCAB, d, "Q8_0", scale=1.0)
    # an LM head of its own: tied to an embedding this loud, every step would repeat its input token
    matrix("output.weight", N_VOCAB, d, "Q4_1", scale=1.0)
    norm("output_norm.weight", d)
    for il in range(n_layer):
        types = LAYER_TYPES[il % len(LAYER_TYPES)]
        shapes = ((h * dh, d), (hkv * dh, d), (hkv * dh, d), (d, h * dh), (f, d), (f, d), (d, f))
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        for name, (rows, cols), t in zip(names, shapes, types, strict=True):
            matrix(f"blk.{il}.{name}.weight", rows, cols, t)
        for name, n in (("attn_norm", d), ("ffn_norm", d), ("attn_q_norm", dh), ("attn_k_norm", dh),
                        ("post_attention_norm", d), ("post_ffw_norm", d)):
            norm(f"blk.{il}.{name}.weight", n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy(config, weights, prompts: list[list[int]], n_decode: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens of each prompt, batched as the engine batches: prefill in chunks of PAGE tokens (all
    rows at once, a row with nothing left a padding row), then `n_decode` decode steps. Returns the
    tokens and the logits of every step ([B, V] each)."""
    from model.forward import forward
    from model.kvcache import init_pool

    b = len(prompts)
    max_pages = -(-(max(map(len, prompts)) + n_decode) // PAGE)
    table = np.arange(b * max_pages, dtype=np.int32).reshape(b, max_pages)[:, ::-1].copy()  # pages out of order
    pool = init_pool(config, b * max_pages, PAGE, "f16", weights.parallel)
    done = np.zeros(b, np.int32)
    logits_per_step, last = [], np.zeros((b, config.n_vocab), np.float32)
    while (left := np.array([len(p) for p in prompts]) - done).any():
        n_new = np.minimum(left, PAGE).astype(np.int32)
        tokens = np.zeros((b, PAGE), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :n_new[i]] = p[done[i]:done[i] + n_new[i]]
        window = -(-int(done.max()) // PAGE)
        logits, pool = forward(weights, pool, jnp.asarray(tokens), jnp.asarray(table), jnp.asarray(done),
                               jnp.asarray(n_new), config=config, window_pages=window)
        logits = np.asarray(logits)
        last = np.where((n_new > 0)[:, None], logits, last)  # a padding row's logits are thrown away
        logits_per_step.append(logits[n_new > 0])
        done = done + n_new
    out = [[] for _ in prompts]
    for _ in range(n_decode):
        nxt = last.argmax(-1).astype(np.int32)
        for i in range(b):
            out[i].append(int(nxt[i]))
        window = -(-int(done.max()) // PAGE)
        last, pool = forward(weights, pool, jnp.asarray(nxt[:, None]), jnp.asarray(table), jnp.asarray(done),
                             jnp.ones(b, jnp.int32), config=config, window_pages=window)
        last = np.asarray(last)
        logits_per_step.append(last)
        done = done + 1
    return out, logits_per_step


def run(path: str | os.PathLike | None = None) -> dict:
    """Packed CPU path against the device layout with the Triton kernels forced on, on the tiny model (or
    `path`). {"ok", "tokens_equal", "max_logit_abs_diff", "max_logit_rel_diff", "tokens", "kernels" (the
    ops report), "device_bytes", "file_bytes", "seconds"}."""
    import jax

    from kernels import ops
    from model import parallel
    from model.weights import device_bytes, file_tensor_bytes, load_weights, matrix_types

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bankml-wiring-") as tmp:
        path = write_model(Path(tmp) / "wiring.gguf", n_layer=CHECK_LAYERS) if path is None else Path(path)
        config, packed = load_weights(path, verified=True, layout="packed")
        _, device = load_weights(path, verified=True, layout="device")
        file_bytes = file_tensor_bytes(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.n_vocab, n).tolist() for n in PROMPT_LENGTHS]
    want_tokens, want_logits = greedy(config, packed, prompts, N_DECODE)  # never reaches kernels.ops
    n = min(2, len(jax.devices()))
    split = parallel.shard_weights(device, config, parallel.make(config, n))
    with ops.use("triton"):
        got_tokens, got_logits = greedy(config, device, prompts, N_DECODE)
        kernels = ops.report(matrix_types(device))
        split_tokens, split_logits = greedy(config, split, prompts, N_DECODE)
    diff = max(float(np.abs(g - w).max()) for g, w in zip(got_logits, want_logits, strict=True))
    scale = max(float(np.abs(w).max()) for w in want_logits)
    split_diff = max(float(np.abs(g - w).max()) for g, w in zip(split_logits, want_logits, strict=True))
    split_ok = split_tokens == want_tokens and split_diff <= TOLERANCE * scale
    tokens_equal = got_tokens == want_tokens
    triton_everywhere = all(row["impl"] == "triton" for op, row in kernels.items()
                            if op in ops.ATTENTION_OPS) and \
        all(row["impl"] == "triton" for t, row in kernels["qmatmul"].items() if t not in ("F16", "BF16", "F32"))
    return {
        "ok": bool(tokens_equal and diff <= TOLERANCE * scale and triton_everywhere and split_ok),
        "tokens_equal": tokens_equal,
        "max_logit_abs_diff": diff,
        "max_logit_rel_diff": diff / scale,
        "tolerance": TOLERANCE,
        "triton_everywhere": triton_everywhere,
        "tokens": {"packed": want_tokens, "device": got_tokens, "split": split_tokens},
        "split": {"devices": n, "ok": bool(split_ok), "max_logit_rel_diff": split_diff / scale,
                  "bytes_per_device": parallel.per_device_bytes(split)},
        "kernels": kernels,
        "device_bytes": device_bytes(device),
        "file_bytes": file_bytes,
        "seconds": round(time.perf_counter() - t0, 2),
    }
