"""Config, weights and the forward pass on tiny random GGUFs of every supported architecture.

The oracle is `_reference_logits`: a plain float64 numpy transcription of llama.cpp's graphs (one head,
one rotation pair at a time), sharing nothing with model/forward.py but the parsed config.
"""

from __future__ import annotations

import math

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFReader
from tiny_gguf import write_tiny_gguf

from kernels.dequant import UnsupportedTensorType
from model.config import Config, UnsupportedModel
from model.forward import forward
from model.kvcache import init_pool
from model.weights import load_weights

ARCHS = {
    "llama": dict(arch="llama"),
    "llama3_rope": dict(arch="llama", llama3_rope=True, tied=False),
    "llama_linear_rope_partial": dict(arch="llama", linear_rope_factor=4.0, n_rot=8),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=24),  # head_dim != n_embd / n_head, as in real Qwen3
    "gemma3": dict(arch="gemma3", n_layer=7, head_dim=32, n_head_kv=1, sliding_window=6),
    "llama_q8_0": dict(arch="llama", matrix_type=gguf.GGMLQuantizationType.Q8_0),
}


# The cache, chunking and batching tests exercise code that is the same for every architecture; they
# run on the variants whose attention differs (plain, head_dim != n_embd/n_head, sliding window).
CACHE_ARCHS = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, kwargs in ARCHS.items():
        path = write_tiny_gguf(tmp_path_factory.mktemp("tiny") / f"{name}.gguf", **kwargs)
        out[name] = (name, path, *load_weights(path, verified=True))
    return out


@pytest.fixture(params=list(ARCHS))
def tiny(request, models):
    return models[request.param]


@pytest.fixture(params=CACHE_ARCHS)
def tiny_cache(request, models):
    return models[request.param]


def _tokens(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


def _full_logits(config, weights, tokens, cache_type="f32") -> np.ndarray:
    n_pages = -(-len(tokens) // 16)
    pool = init_pool(config, n_pages, 16, cache_type)
    logits, _ = forward(weights, pool, jnp.asarray(tokens)[None], np.arange(n_pages, dtype=np.int32)[None],
                        jnp.zeros(1, jnp.int32), jnp.array([len(tokens)], jnp.int32), config=config,
                        window_pages=0, all_logits=True)
    return np.asarray(logits[0])


def _reference_logits(path, config: Config, tokens, kv_f16: bool = False) -> np.ndarray:
    reader = GGUFReader(str(path))
    t = {x.name: gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float64).reshape(tuple(reversed(
        [int(n) for n in x.shape]))) for x in reader.tensors}
    c = config
    dh, g = c.head_dim, c.n_head // c.n_head_kv

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps) * w

    def rope(vec, pos, base, scale):  # vec [Dh] of one head
        out = vec.copy()
        factors = t.get("rope_freqs.weight", np.ones(c.n_rot // 2))
        for i in range(c.n_rot // 2):
            theta = pos * scale * base ** (-2.0 * i / c.n_rot) / factors[i]
            a, b = (i, i + c.n_rot // 2) if c.rope_neox else (2 * i, 2 * i + 1)
            out[a] = vec[a] * math.cos(theta) - vec[b] * math.sin(theta)
            out[b] = vec[a] * math.sin(theta) + vec[b] * math.cos(theta)
        return out

    n = len(tokens)
    x = t["token_embd.weight"][tokens] * c.embd_scale
    for il in range(c.n_layer):
        p = f"blk.{il}."
        swa = c.swa_layers[il]
        base, scale = (c.rope_base_swa, c.rope_freq_scale_swa) if swa else (c.rope_base, c.rope_freq_scale)
        h = rms(x, t[p + "attn_norm.weight"])
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ t[p + f"attn_{name}.weight"].T + t.get(p + f"attn_{name}.bias", 0.0)
            proj[name] = y.reshape(n, -1, dh)
        if c.qk_norm:
            proj["q"] = rms(proj["q"], t[p + "attn_q_norm.weight"])
            proj["k"] = rms(proj["k"], t[p + "attn_k_norm.weight"])
        q = np.array([[rope(proj["q"][i, hh], i, base, scale) for hh in range(c.n_head)] for i in range(n)])
        k = np.array([[rope(proj["k"][i, hh], i, base, scale) for hh in range(c.n_head_kv)] for i in range(n)])
        v = proj["v"]
        if kv_f16:  # llama.cpp's default cache holds K and V in f16; its flash attention converts Q to f16
            q, k, v = (a.astype(np.float16).astype(np.float64) for a in (q, k, v))
        attn = np.zeros((n, c.n_head, dh))
        for hh in range(c.n_head):
            for i in range(n):
                visible = [j for j in range(i + 1) if not (swa and i - j >= c.n_swa)]
                s = np.array([q[i, hh] @ k[j, hh // g] for j in visible]) * c.attn_scale
                w = np.exp(s - s.max())
                attn[i, hh] = (w / w.sum()) @ v[visible, hh // g]
        out = attn.reshape(n, -1) @ t[p + "attn_output.weight"].T
        if c.post_norms:
            out = rms(out, t[p + "post_attention_norm.weight"])
        x = x + out
        h = rms(x, t[p + "ffn_norm.weight"])
        gate = h @ t[p + "ffn_gate.weight"].T
        if c.ffn_gelu:
            act = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1 + np.exp(-gate))
        out = (act * (h @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
        if c.post_norms:
            out = rms(out, t[p + "post_ffw_norm.weight"])
        x = x + out
    head = t.get("output.weight", t["token_embd.weight"])
    return rms(x, t["output_norm.weight"]) @ head.T


def _close(a, b, rtol=1e-5):
    scale = np.abs(b).max()
    np.testing.assert_allclose(a, b, atol=rtol * scale, rtol=0)


def test_forward_matches_reference(tiny):
    _, path, config, weights = tiny
    tokens = _tokens(12)
    _close(_full_logits(config, weights, tokens), _reference_logits(path, config, tokens), rtol=2e-5)


def test_the_f16_cache_attends_as_llama_cpp_does(tiny):
    """With the default f16 cache, Q, K and V pass through f16 before attention, as in llama.cpp.

    An f32 value and the float64 reference can round to neighbouring f16 values, so the bound is a
    few f16 ulps; attention without the rounding lands further off than that on some architectures.
    """
    _, path, config, weights = tiny
    tokens = _tokens(12)
    assert init_pool(config, 1, 4).k.dtype == jnp.float16
    ours = _full_logits(config, weights, tokens, "f16")
    _close(ours, _reference_logits(path, config, tokens, kv_f16=True), rtol=4e-4)
    assert not np.array_equal(ours, _full_logits(config, weights, tokens))


def _run(weights, pool, config, tokens, tables, starts, n_new, window_pages, all_logits=False):
    """One forward step over rows of `tokens` (a list of lists, padded to one length)."""
    t = max(len(r) for r in tokens)
    padded = np.zeros((len(tokens), t), np.int32)
    for i, r in enumerate(tokens):
        padded[i, :len(r)] = r
    return forward(weights, pool, padded, np.asarray(tables, np.int32), np.asarray(starts, np.int32),
                   np.asarray(n_new, np.int32), config=config, window_pages=window_pages, all_logits=all_logits)


def test_cache_decode_matches_full_forward(tiny_cache):
    """Prefill 5 tokens, then decode 11 one at a time through pages of 4 scattered over the pool, beside
    a padding row: the same logits as one pass, and nothing written outside the row's pages."""
    _, _, config, weights = tiny_cache
    tokens = _tokens(16, seed=2)
    full = _full_logits(config, weights, tokens)
    pool = init_pool(config, 8, 4, "f32")
    table = [5, 2, 7, 0]  # positions 0-3 in page 5, 4-7 in page 2, ...
    logits, pool = _run(weights, pool, config, [tokens[:5]], [table], [0], [5], 0)
    got = [np.asarray(logits[0])]
    for i in range(5, 16):
        # row 0 pads (nothing real: its writes are dropped), row 1 decodes
        logits, pool = _run(weights, pool, config, [[0], [tokens[i]]], [[0] * 4, table], [0, i], [0, 1], 4)
        got.append(np.asarray(logits[1]))
    _close(np.stack(got), full[4:])
    k = np.asarray(pool.k)
    assert not k[:, [1, 3, 4, 6]].any()  # the pages no table lists
    assert k[:, table].reshape(k.shape[0], 4, k.shape[2], 4, -1).any(axis=(0, 2, 4)).all()  # every cell written


def test_stale_cells_past_a_rows_start_never_reach_its_answer(tiny_cache):
    """Pages that held another sequence's overflowed f16 values (inf, NaN) before this one: the masked
    cells past its start change nothing (0 * inf would make the whole row NaN)."""
    _, _, config, weights = tiny_cache
    tokens = _tokens(7, seed=4)
    full = _full_logits(config, weights, tokens)
    clean = init_pool(config, 4, 4, "f32")
    poisoned = init_pool(config, 4, 4, "f32")
    poisoned = type(poisoned)(poisoned.k.at[:, :, :, 1::2].set(jnp.nan).at[:, :, :, ::2].set(jnp.inf),
                              poisoned.v.at[:, :, :, 1::2].set(jnp.nan).at[:, :, :, ::2].set(jnp.inf))
    for pool in (clean, poisoned):
        logits, pool = _run(weights, pool, config, [tokens[:5]], [[2, 0, 3, 1]], [0], [5], 0)
        for i in range(5, 7):  # decode reads pages 2 and 0: cells 6.. of page 0 are still stale
            logits, pool = _run(weights, pool, config, [[tokens[i]]], [[2, 0, 3, 1]], [i], [1], 2)
        _close(np.asarray(logits[0]), full[6])


def test_chunked_prefill_matches_full_forward(tiny_cache):
    """A prompt split into a padded first chunk and a second chunk that reads the cached pages."""
    _, _, config, weights = tiny_cache
    tokens = _tokens(20, seed=3)
    full = _full_logits(config, weights, tokens)
    pool = init_pool(config, 8, 4, "f32")
    table = [6, 0, 3, 5, 1, 2, 4, 7]
    first = np.zeros(16, np.int32)
    first[:9] = tokens[:9]
    _, pool = _run(weights, pool, config, [first], [table], [0], [9], 0)
    assert not np.asarray(pool.k)[:, table[3]].any()  # the first chunk's padding wrote nothing
    second = np.zeros(16, np.int32)
    second[:11] = tokens[9:]
    logits, pool = _run(weights, pool, config, [second], [table], [9], [11], 3, all_logits=True)
    _close(np.asarray(logits[0, :11]), full[9:])
    k = np.asarray(pool.k)
    assert k[:, table[4]].any() and not k[:, table[5:]].any()  # 20 tokens: 5 pages, the padding dropped


def test_a_shared_prefix_page_is_read_by_another_sequence(models):
    """The prefix cache's layout: a second sequence whose table starts with the first one's full pages
    computes only the rest, and gets the logits of its whole prompt in one pass. On gemma3, whose
    sliding window also reads the shared cells (the layout is the same for every architecture)."""
    _, _, config, weights = models["gemma3"]
    a, b = _tokens(10, seed=7), _tokens(14, seed=7)
    b[8:] = _tokens(6, seed=8)  # the same first 8 tokens (two pages of 4)
    pool = init_pool(config, 8, 4, "f32")
    _, pool = _run(weights, pool, config, [a], [[1, 4, 6, 0]], [0], [10], 0)
    shared = np.asarray(pool.k)[:, [1, 4]].copy()
    logits, pool = _run(weights, pool, config, [b[8:]], [[1, 4, 2, 5]], [8], [6], 2, all_logits=True)
    _close(np.asarray(logits[0]), _full_logits(config, weights, b)[8:])
    np.testing.assert_array_equal(np.asarray(pool.k)[:, [1, 4]], shared)  # read, never written


def test_batch_rows_are_independent(tiny_cache):
    """Two sequences of different lengths decoded in one batch give each one's logits alone."""
    _, _, config, weights = tiny_cache
    seqs = [_tokens(7, seed=4), _tokens(13, seed=5)]
    alone = [_full_logits(config, weights, s) for s in seqs]
    pool = init_pool(config, 8, 4, "f32")
    tables = [[3, 0, 0, 0], [1, 7, 2, 5]]
    for table, s in zip(tables, seqs, strict=True):  # prefill all but the last 3 tokens of each
        padded = np.zeros(16, np.int32)
        padded[:len(s) - 3] = s[:-3]
        _, pool = _run(weights, pool, config, [padded], [table], [0], [len(s) - 3], 0)
    tables[0][1] = 6  # the short one's next page
    for back in (3, 2, 1):
        starts = [len(s) - back for s in seqs]
        logits, pool = _run(weights, pool, config, [[seqs[0][-back]], [seqs[1][-back]]], tables, starts, [1, 1], 4)
        for row in (0, 1):
            _close(np.asarray(logits[row]), alone[row][-back])


def test_config_per_architecture(tiny):
    name, _, config, weights = tiny
    assert config.rope_neox == (config.arch != "llama")
    if name == "gemma3":
        # llama.cpp's set_swa_pattern(6): every 6th layer is global, with the GGUF's rope base.
        assert config.swa_layers == (True, True, True, True, True, False, True)
        assert (config.rope_base_swa, config.rope_base) == (10000.0, 1e6)
        assert config.embd_scale == pytest.approx(math.sqrt(64))
        assert config.attn_scale == pytest.approx(1 / math.sqrt(32))
        assert config.n_swa == 6 and config.ffn_gelu and config.post_norms and config.qk_norm
    if name == "llama3_rope":
        assert weights.rope_freqs is not None and weights.output is not None
    if name == "llama":
        assert weights.output is None  # tied: logits through token_embd
    if name == "llama_linear_rope_partial":
        assert (config.rope_freq_scale, config.n_rot) == (0.25, 8)
    if name == "qwen2":
        assert weights.layers.attn_q_bias.shape == (2, 64)
    if name == "qwen3":
        assert config.head_dim == 24 and config.attn_scale == pytest.approx(1 / math.sqrt(24))


def test_sliding_window_changes_local_layers(tmp_path):
    """Past the window, gemma3's local layers must stop seeing old tokens (the mask is live)."""
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", n_layer=2, head_dim=32, n_head_kv=1, sliding_window=4)
    config, weights = load_weights(path, verified=True)
    a, b = _tokens(10, seed=6), _tokens(10, seed=6)
    b[0] = (b[0] + 1) % 256  # differs only at position 0, outside the window of position 9
    la, lb = _full_logits(config, weights, a), _full_logits(config, weights, b)
    assert np.abs(la[9] - lb[9]).max() < 1e-5
    assert np.abs(la[3] - lb[3]).max() > 1e-3


def _fields(**overrides):
    fields = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
              "llama.attention.head_count": 4, "llama.feed_forward_length": 96, "llama.context_length": 128,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 100}
    fields.update(overrides)
    return fields


def test_config_refusals():
    with pytest.raises(UnsupportedModel, match="unsupported architecture 'phi3'"):
        Config.from_gguf(_fields(**{"general.architecture": "phi3"}))
    with pytest.raises(UnsupportedModel, match="rope scaling type 'yarn'"):
        Config.from_gguf(_fields(**{"llama.rope.scaling.type": "yarn"}))
    with pytest.raises(UnsupportedModel, match="value head width"):
        Config.from_gguf(_fields(**{"llama.attention.key_length": 16, "llama.attention.value_length": 32}))
    with pytest.raises(UnsupportedModel, match="'llama.block_count' is missing"):
        Config.from_gguf({k: v for k, v in _fields().items() if k != "llama.block_count"})
    config = Config.from_gguf(_fields(**{"llama.attention.head_count_kv": 2}))
    assert (config.n_group, config.head_dim, config.n_vocab) == (2, 16, 100)


def test_unsupported_tensor_type_refused(tmp_path):
    iq4_nl = np.zeros((64, 36), np.uint8)  # 64x64 weights as IQ4_NL blocks (18 bytes per 32)
    path = write_tiny_gguf(tmp_path / "iq.gguf", "llama",
                           raw_tensors={"blk.0.attn_q.weight": (iq4_nl, gguf.GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(UnsupportedTensorType, match="blk.0.attn_q.weight.*IQ4_NL"):
        load_weights(path, verified=True)


def test_unexpected_tensor_and_unverified_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", "llama",
                           extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(UnsupportedModel, match="unexpected tensors for llama: blk.0.attn_q_norm.weight"):
        load_weights(path, verified=True)
    with pytest.raises(PermissionError, match="not verified"):
        load_weights(path, verified=False)
