"""Run by tests/test_parallel.py in a process of its own, with N simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N must be set before JAX starts): splits a model N
ways and prints, as one JSON line, what the tests check.

    python3 tests/parallel_probe.py MODEL.gguf N LAYOUT
    python3 tests/parallel_probe.py tiny DIR       # tiny models (tests/tiny_gguf.py) split 2 ways

- "bytes": the weights' bytes per device, split and whole (on one device);
- "argmax_same", "max_rel_diff": the logits of a prompt, split against one device, with an f16 KV pool
  and with a q8_0 one when the heads allow it ("q8_0_argmax_same");
- "all_reduces", "all_gathers": the collectives in the compiled decode step's HLO, and "n_layer";
- "shard_columns_ok": every row-parallel matrix's shard, expanded on its device, is the whole matrix's
  columns for that device (packed layout: nibble pairs packed again per shard);
- "slot_roundtrip": the model's KV heads to the pool's layout and back, unchanged.

"tiny": per case (architecture, KV heads, biases, tied or untied output, a vocabulary of 261 that two
devices do not divide, packed, dense and device layouts), the same logits split and whole, and the
embeddings' forward (model/embed.py) too.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np


def main() -> None:
    if sys.argv[1] == "tiny":
        return tiny(sys.argv[2])
    path, n, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from model import parallel
    from model.forward import forward
    from model.kvcache import init_pool
    from model.packed import Packed, expand
    from model.weights import load_weights

    config, whole = load_weights(path, verified=True, layout=layout)
    plan = parallel.make(config, n)
    split = parallel.shard_weights(whole, config, plan)
    out: dict = {"n_layer": config.n_layer, "kv_split": plan.kv_split, "vocab_split": plan.vocab_split,
                 "bytes": {"split": parallel.per_device_bytes(split), "whole": parallel.per_device_bytes(whole)}}

    prompt = [1, 504, 3458, 282, 4649, 314, 216, 30, 2]
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :len(prompt)] = prompt
    table = np.arange(2, dtype=np.int32)[None]

    def logits(weights, par, cache_type="f16"):
        pool = init_pool(config, 2, 16, cache_type, par)
        got, _ = forward(weights, pool, tokens, table, np.zeros(1, np.int32), np.array([len(prompt)], np.int32),
                         config=config, window_pages=0, all_logits=True)
        return np.asarray(got)[0, :len(prompt)]

    a, b = logits(whole, None), logits(split, plan)
    out["argmax_same"] = bool((a.argmax(-1) == b.argmax(-1)).all())
    out["max_rel_diff"] = float(np.abs(a - b).max() / np.abs(a).max())
    if config.head_dim % 32 == 0:
        a8, b8 = logits(whole, None, "q8_0"), logits(split, plan, "q8_0")
        out["q8_0_argmax_same"] = bool((a8.argmax(-1) == b8.argmax(-1)).all())

    pool = init_pool(config, 4, 16, "f16", plan)
    vec = np.zeros(2, np.int32)
    hlo = forward.lower(split, pool, np.zeros((2, 1), np.int32), np.zeros((2, 2), np.int32), vec, vec,
                        config=config, window_pages=1).compile().as_text()
    out["all_reduces"] = len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))
    out["all_gathers"] = len(re.findall(r"= \S+ all-gather(?:-start)?\(", hlo))

    if layout == "packed":
        ok = True
        for name in parallel.ROW:
            full = np.asarray(expand(getattr(whole.layers, name)))  # [L, out, in]
            shards = getattr(split.layers, name)
            width = full.shape[-1] // n
            for i in range(n):
                local = jax.tree.map(lambda x, i=i: np.asarray(x.addressable_shards[i].data), shards)
                assert isinstance(local, Packed)
                ok &= bool(np.array_equal(np.asarray(expand(local)), full[..., i * width:(i + 1) * width]))
        out["shard_columns_ok"] = ok

    rng = np.random.default_rng(0)
    heads = config.n_head_kv * config.head_dim
    cells = rng.standard_normal((config.n_layer, 16, heads)).astype(np.float16)
    pool_cells = plan.model_to_pool_heads(cells, config)
    out["slot_roundtrip"] = bool(np.array_equal(plan.pool_to_model_heads(pool_cells, config), cells))
    print(json.dumps(out))


def tiny(directory: str) -> None:
    from pathlib import Path

    import gguf

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import write_tiny_gguf

    from model import parallel
    from model.embed import embed_forward
    from model.forward import forward
    from model.kvcache import init_pool
    from model.weights import load_weights

    q8 = gguf.GGMLQuantizationType.Q8_0
    cases = {
        "llama_kv_split_q8_0_packed": (dict(arch="llama", n_head_kv=2, matrix_type=q8), "packed"),
        "llama_kv_per_device_q8_0_device": (dict(arch="llama", n_head_kv=1, matrix_type=q8), "device"),
        "qwen2_biases_kv_split_dense": (dict(arch="qwen2", n_head_kv=2), "dense"),
        "qwen2_biases_kv_per_device_untied_packed": (dict(arch="qwen2", n_head_kv=1, tied=False, matrix_type=q8),
                                                     "packed"),
        "gemma3_kv_per_device_untied_device": (dict(arch="gemma3", n_head_kv=1, tied=False, matrix_type=q8),
                                               "device"),
    }
    prompt = np.array([[5, 70, 101, 33, 258, 12, 7, 200]], np.int32)
    out = {}
    for name, (kw, layout) in cases.items():
        path = write_tiny_gguf(Path(directory) / f"{name}.gguf", n_ff=128, **kw)
        config, whole = load_weights(path, verified=True, layout=layout)
        plan = parallel.make(config, 2)
        split = parallel.shard_weights(whole, config, plan)

        def run(weights, par, config=config):
            pool = init_pool(config, 2, 16, "f16", par)
            got, _ = forward(weights, pool, prompt, np.arange(2, dtype=np.int32)[None], np.zeros(1, np.int32),
                             np.array([8], np.int32), config=config, window_pages=0, all_logits=True)
            emb = embed_forward(weights, prompt, np.array([8], np.int32), config=config, pooling=1, cache_type="f16")
            return np.asarray(got)[0], np.asarray(emb)

        (a, ea), (b, eb) = run(whole, None), run(split, plan)
        out[name] = {"layout": layout, "kv_split": plan.kv_split, "vocab_split": plan.vocab_split,
                     "argmax_same": bool((a.argmax(-1) == b.argmax(-1)).all()),
                     "max_rel_diff": float(np.abs(a - b).max() / np.abs(a).max()),
                     "embed_max_rel_diff": float(np.abs(ea - eb).max() / np.abs(ea).max())}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
