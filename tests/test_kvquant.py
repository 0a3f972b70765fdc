"""The q8_0 KV cache (`[engine] cache_type = "q8_0"`): its quantization against numpy ports of ggml's, the
pool's layout and bytes, an engine that generates through it, and the refusals.

ggml has two q8_0 quantizers: `quantize_row_q8_0` (ggml/src/ggml-cpu/arch/x86/quants.c, its AVX2 path:
what llama-server writes into its KV cache on this x86 machine, and what its flash attention rounds Q
with) and the portable `quantize_row_q8_0_ref` (ggml-quants.c; gguf-py's Q8_0 quantizer is the same).
They differ at exact ties (ties to even against roundf's away from zero) and by id = 127 / amax against
1 / d; ours is the first, bit for bit. Before a quantized cache llama.cpp Hadamard-rotates Q, K and V
(where head_dim % 64 == 0) and rotates the attention output back: so do we.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from bankml.config import CACHE_TYPES as CONFIG_CACHE_TYPES
from bankml.config import load_config
from bankml.errors import ConfigInvalid
from kernels.kvquant import hadamard
from model.engine import Engine, EngineError, kv_pool_pages
from model.kvcache import (
    CACHE_TYPES,
    as_cached,
    dequantize_q8_0,
    init_pool,
    page_bytes,
    quantize_q8_0,
    read_cells,
    rotate,
    rotation,
    write_cells,
)
from model.messages import SamplingParams
from model.weights import load_weights


def quantize_row_q8_0_x86(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml-cpu/arch/x86/quants.c quantize_row_q8_0 (AVX2): d = amax / 127.f as f16, id = 127.f / amax
    (0 if amax is 0), q = _mm256_round_ps(x * id, _MM_ROUND_NEAREST), all in f32."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float16)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint(blocks * inv[:, None]).astype(np.int8)  # np.rint: ties to even
    return qs.reshape(x.shape), d.reshape(*x.shape[:-1], -1)


def quantize_row_q8_0_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml-quants.c quantize_row_q8_0_ref: d = amax / 127, id = d ? 1/d : 0, q = roundf(x * id)."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    x0 = (blocks * inv[:, None]).astype(np.float64)  # exact: roundf's halfway test on the f32 product
    qs = (np.sign(x0) * np.floor(np.abs(x0) + 0.5)).astype(np.int8)
    return qs.reshape(x.shape), d.astype(np.float16).reshape(*x.shape[:-1], -1)


def _random(seed: int, shape=(6, 3, 128)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 0.3, 5.0, 200.0], shape[:-1] + (1,))
    if len(shape) < 3:
        return x
    x[0, 0, :64] = 0.0  # two whole blocks of zeros
    x[1, 1, 32:64] = -0.0
    x[2, 2, 5] = 1e-30  # a block of one tiny value (its d is 0 in f16: every quant still 127)
    x[2, 2, :5] = x[2, 2, 6:32] = 0.0
    return x


def _ties() -> np.ndarray:
    """A block with amax 127 (id = 1): every value a tie at x.5, a few exact integers."""
    x = np.array([127.0, -0.5, 0.5, 1.5, 2.5, -2.5, 126.5, -126.5, 3.0, -4.0] + [0.5 * (2 * i + 1) for i in range(22)],
                 np.float32)
    return x.reshape(1, 32)


@pytest.mark.parametrize("x", [_random(0), _random(1, (2, 64)), _ties()], ids=["random", "small", "ties"])
def test_quantize_is_ggml_x86_quantize_row_q8_0_bit_for_bit(x):
    qs, d = quantize_q8_0(jnp.asarray(x))
    want_qs, want_d = quantize_row_q8_0_x86(x)
    assert qs.dtype == jnp.int8 and d.dtype == jnp.float16
    assert qs.shape == x.shape and d.shape == (*x.shape[:-1], x.shape[-1] // 32)
    np.testing.assert_array_equal(np.asarray(qs), want_qs)
    np.testing.assert_array_equal(np.asarray(d).view(np.uint16), want_d.view(np.uint16))


def test_ties_go_to_even_where_the_reference_rounds_away():
    x = _ties()
    ours = np.asarray(quantize_q8_0(jnp.asarray(x))[0])[0]
    ref = quantize_row_q8_0_ref(x)[0][0]
    assert list(ours[:8]) == [127, 0, 0, 2, 2, -2, 126, -126]
    assert list(ref[:8]) == [127, -1, 1, 2, 3, -3, 127, -127]
    assert np.abs(ours.astype(int) - ref).max() == 1


def test_off_ties_the_reference_and_gguf_py_agree_within_one_step():
    x = _random(2)
    ours_qs, ours_d = (np.asarray(a) for a in quantize_q8_0(jnp.asarray(x)))
    ref_qs, ref_d = quantize_row_q8_0_ref(x)
    np.testing.assert_array_equal(ours_d, ref_d)
    assert np.abs(ours_qs.astype(int) - ref_qs).max() <= 1
    assert np.mean(ours_qs == ref_qs) > 0.999
    # gguf-py's Q8_0 (the reference's rules) in GGUF's block layout: our dequantization reads it
    raw = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    g_d, g_qs = raw[:, :2].copy().view(np.float16)[:, 0], raw[:, 2:].copy().view(np.int8)
    np.testing.assert_array_equal(g_qs.reshape(x.shape), ref_qs)
    np.testing.assert_array_equal(g_d.reshape(ref_d.shape), ref_d)
    want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
    got = dequantize_q8_0(jnp.asarray(g_qs.reshape(x.shape)), jnp.asarray(g_d.reshape(ref_d.shape)))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_dequantize_is_d_times_q_and_the_round_trip_is_stable():
    x = _random(3)
    qs, d = quantize_q8_0(jnp.asarray(x))
    deq = np.asarray(dequantize_q8_0(qs, d))
    assert deq.dtype == np.float32
    want = np.asarray(qs).reshape(-1, 32).astype(np.float32) * np.asarray(d).reshape(-1, 1).astype(np.float32)
    np.testing.assert_array_equal(deq, want.reshape(x.shape))
    assert not deq[0, 0, :64].any()  # zeros stay zeros (d 0, id 0)
    once = as_cached(jnp.asarray(x), "q8_0")
    np.testing.assert_array_equal(np.asarray(once), deq)
    np.testing.assert_array_equal(np.asarray(as_cached(once, "q8_0")), deq)  # quantizing it again changes nothing
    # the error is at most half a step of its block (plus d's own f16 rounding)
    step = np.repeat(np.abs(x).reshape(-1, 32).max(1) / 127, 32).reshape(x.shape)
    assert np.all(np.abs(deq - x) <= 0.51 * step + 1e-3 * np.abs(x) + 1e-30)


def test_the_rotation_is_llama_cpps_hadamard_in_its_blocks():
    # llama_kv_cache::build_input_k_rot / v_rot: K the largest power of two >= 64 dividing head_dim, V 64;
    # none unless quantized and head_dim % 64 == 0
    assert [rotation(d, "q8_0") for d in (64, 128, 192, 256, 32, 96)] == [(64, 64), (128, 64), (64, 64),
                                                                          (256, 64), None, None]
    assert rotation(64, "f16") is None
    h = hadamard(64)
    assert h.dtype == np.float32 and set(np.abs(h).ravel()) == {np.float32(0.125)}
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)
    assert h[0].min() > 0 and h[1, :2].tolist() == [0.125, -0.125]  # Sylvester's order: row 1 alternates
    assert np.float32(1 / np.sqrt(np.float32(128))) == hadamard(128)[0, 0]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 128)), jnp.float32)
    np.testing.assert_allclose(np.asarray(rotate(rotate(x, 64), 64)), np.asarray(x), atol=1e-5)
    blocks = np.asarray(x).reshape(3, 2, 2, 64) @ h  # each head's two blocks of 64 alone
    np.testing.assert_allclose(np.asarray(rotate(x, 64)), blocks.reshape(3, 2, 128), rtol=1e-6, atol=1e-6)


# --- the pool ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    """A tiny llama with head_dim 64 (two q8_0 blocks, and llama.cpp's rotation on) and 2 kv heads."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("q8") / "tiny.gguf", "llama", n_layer=2, n_embd=128, n_head=2,
                           n_head_kv=2, scale=0.3)
    return path, load_weights(path, verified=True)[0]


def test_a_q8_0_page_takes_34_bytes_per_32_values(q8_model):
    _, config = q8_model
    assert config.head_dim == 64
    f16, q8 = page_bytes(config, 16, "f16"), page_bytes(config, 16, "q8_0")
    values = 2 * config.n_layer * config.n_head_kv * 16 * config.head_dim
    assert (f16, q8) == (2 * values, values // 32 * 34)
    pool = init_pool(config, 5, 16, "q8_0")
    assert pool.cache_type == "q8_0" and init_pool(config, 5, 16).cache_type == "f16"
    assert pool.k.dtype == jnp.int8 and pool.k.shape == (2, 5, 2, 16, 64)
    assert pool.k_scale.dtype == jnp.float16 and pool.k_scale.shape == (2, 5, 2, 16, 2)
    assert pool.nbytes == 5 * q8
    # the same byte budget holds 64/34 as many pages
    budget = 40 * f16
    n16 = kv_pool_pages(config, n_ctx=64, max_seqs=1, page_size=16, kv_cache_bytes=budget)
    n8 = kv_pool_pages(config, n_ctx=64, max_seqs=1, page_size=16, kv_cache_bytes=budget, cache_type="q8_0")
    assert (n16, n8) == (40, 75)


def test_cells_written_to_a_q8_0_pool_read_back_as_their_round_trip(q8_model):
    _, config = q8_model
    pool = init_pool(config, 4, 16, "q8_0")
    k = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 64)), jnp.float32)  # 3 cells [Hkv, Dh]
    pages, cells = jnp.array([2, 0, 4]), jnp.array([5, 15, 1])  # page 4 is past the pool: dropped
    pool = write_cells(pool, (1, pages, slice(None), cells), k, -k)
    got_k, got_v = read_cells(pool, (1, pages[:2], slice(None), cells[:2]))
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(as_cached(k[:2], "q8_0")))
    np.testing.assert_array_equal(np.asarray(got_v), -np.asarray(got_k))
    assert int(jnp.count_nonzero(pool.k)) == int(jnp.count_nonzero(as_cached(k[:2], "q8_0")))


# --- the engine --------------------------------------------------------------------------------------


def test_an_engine_with_a_q8_0_cache_generates_as_its_full_forward_does(q8_model):
    path, _ = q8_model
    engine = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False, cache_type="q8_0",
                         kv_cache_bytes=0)
    assert engine.pool.cache_type == "q8_0" and engine.cache_type == "q8_0"
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6)))
    seq = list(prompt)
    for _ in range(6):  # the same tokens, each from one full forward over a scratch q8_0 pool
        seq.append(int(np.argmax(engine.logits(seq)[-1])))
    assert [o.token for o in outs] == seq[len(prompt):]
    pool = engine.pool
    assert pool.nbytes == sum(a.nbytes for a in (pool.k, pool.v, pool.k_scale, pool.v_scale))
    assert engine.memory_bytes() == engine.weights_report()["device_bytes"] + pool.nbytes
    f16 = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False)
    # the cache's rounding shows in the logits, but rarely in the top token (this random model is chaotic:
    # f16 against f32 already moves its logits, of up to ~50, by 0.2; q8_0 by a few)
    ours, f16_logits = engine.logits(prompt), f16.logits(prompt)
    assert np.abs(ours - f16_logits).max() > 0
    assert np.mean(ours.argmax(-1) == f16_logits.argmax(-1)) >= 0.9
    # the same kv_cache_bytes hold about twice the pages
    budget = 64 * page_bytes(f16.config, 16)
    n16 = kv_pool_pages(f16.config, n_ctx=256, max_seqs=2, page_size=16, kv_cache_bytes=budget)
    n8 = kv_pool_pages(f16.config, n_ctx=256, max_seqs=2, page_size=16, kv_cache_bytes=budget, cache_type="q8_0")
    assert n8 / n16 == pytest.approx(64 / 34, rel=0.02)


def test_the_q8_0_cache_holds_rotated_k_and_the_answer_does_not_depend_on_it(q8_model, monkeypatch):
    """With an exact (f32) cache the rotation changes nothing but rounding; a q8_0 pool holds rotated K."""
    import model.forward as fwd

    path, config = q8_model
    engine = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, cache_type="q8_0")
    tokens = np.array([[5, 9, 200, 31, 7, 7, 100, 3]], np.int32)
    table, starts, n_new = np.arange(1, dtype=np.int32)[None], np.zeros(1, np.int32), np.array([8], np.int32)

    def run(cache_type, rotated):
        monkeypatch.setattr(fwd, "rotation", (lambda dh, ct: rotation(dh, "q8_0")) if rotated else (lambda dh, ct: None))
        jax.clear_caches()  # forward's programs hold the rotation they were traced with
        logits, pool = fwd.forward(engine.weights, init_pool(config, 1, 16, cache_type), tokens, table, starts,
                                   n_new, config=config, window_pages=0, all_logits=True)
        monkeypatch.undo()
        jax.clear_caches()
        return np.asarray(logits), pool

    exact, pool_plain = run("f32", False)
    exact_rotated, pool_rotated = run("f32", True)
    np.testing.assert_allclose(exact_rotated, exact, atol=1e-4)  # an orthonormal rotation: the same answer
    np.testing.assert_allclose(np.asarray(rotate(pool_plain.k, 64)), np.asarray(pool_rotated.k), atol=1e-4)
    q8, pool_q8 = run("q8_0", True)
    # layer 0's K (what later layers write depends on the rounding before them)
    k_q8 = np.asarray(dequantize_q8_0(pool_q8.k, pool_q8.k_scale))[0]
    np.testing.assert_allclose(k_q8, np.asarray(as_cached(pool_rotated.k, "q8_0"))[0], atol=1e-5)
    assert np.abs(k_q8 - np.asarray(as_cached(pool_plain.k, "q8_0"))[0]).max() > 1e-2  # not the unrotated K


def test_a_head_dim_q8_0_cannot_block_is_refused_at_open(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)  # head_dim 16
    with pytest.raises(EngineError, match="q8_0 needs a head_dim divisible by 32.*this model's is 16"):
        Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, cache_type="q8_0")
    with pytest.raises(EngineError, match="'q4_0' is not a KV cache type"):
        Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, cache_type="q4_0")


def test_cache_type_from_the_config_and_the_environment(tmp_path, monkeypatch):
    assert CONFIG_CACHE_TYPES == CACHE_TYPES  # config.py keeps its own copy (it never imports jax)
    monkeypatch.delenv("BANKML_CACHE_TYPE", raising=False)
    assert load_config().engine.cache_type == "f16"
    conf = tmp_path / "q8.toml"
    conf.write_text('[engine]\ncache_type = "q8_0"\n')
    assert load_config(str(conf)).engine.cache_type == "q8_0"
    bad = tmp_path / "bad.toml"
    bad.write_text('[engine]\ncache_type = "q4_0"\n')
    with pytest.raises(ConfigInvalid, match="'engine.cache_type' 'q4_0' is not a KV cache type"):
        load_config(str(bad))
    monkeypatch.setenv("BANKML_CACHE_TYPE", "f16")  # the environment over the file
    assert load_config(str(conf)).engine.cache_type == "f16"
    monkeypatch.setenv("BANKML_CACHE_TYPE", "q8_0")
    assert load_config().engine.cache_type == "q8_0"
    monkeypatch.setenv("BANKML_CACHE_TYPE", "Q8_0")
    with pytest.raises(ConfigInvalid, match="BANKML_CACHE_TYPE 'Q8_0' is not a KV cache type"):
        load_config()


def test_the_device_layout_and_its_kernels_read_a_q8_0_pool_as_the_cpu_path_does(q8_model):
    """The device layout writes each layer's K/V into the q8_0 pool and attends through kernels.ops: the jnp
    twins, then the Triton kernels under the interpreter; the tokens and logprobs are the packed CPU path's."""
    from kernels import ops

    path, _ = q8_model
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, 21)]  # prefill, then decode past a page
    params = SamplingParams(temperature=0.0, max_tokens=4, n_probs=3)
    cpu = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, cache_type="q8_0")
    want = list(cpu.generate(prompt, params))
    for mode in ("jnp", "triton"):
        with ops.use(mode):
            device = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, cache_type="q8_0",
                                 layout="device")
            got = list(device.generate(prompt, params))
        assert [o.token for o in got] == [o.token for o in want], mode
        np.testing.assert_allclose([o.logprob for o in got], [o.logprob for o in want], atol=1e-4, err_msg=mode)


def test_the_gateway_loads_and_budgets_the_configured_cache_type(q8_model):
    from bankml.config import EngineConfig
    from gateway.app import native_estimate, native_loader
    from model.loading import whole_contexts_bytes

    path, config = q8_model
    engine_cfg = EngineConfig(max_seqs=2, cache_type="q8_0", compile_cache_dir="")
    engine, _ = native_loader(64, engine_cfg, whole_contexts=True)(str(path))
    assert engine.cache_type == "q8_0" and engine.pool.k.dtype == jnp.int8
    pool = whole_contexts_bytes(str(path), n_ctx=64, max_seqs=2, cache_type="q8_0")
    assert pool == 2 * 4 * page_bytes(config, 16, "q8_0") == engine.pool.nbytes
    assert native_estimate(64, engine_cfg)(str(path)) == path.stat().st_size + pool
