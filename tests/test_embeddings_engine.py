"""The engine's embeddings (model/embed.py) on tiny random models: what llama.cpp pools is the output norm's
hidden state, so the LM head over our unpooled vectors gives the engine's own logits; a request's
inputs batched and padded together give what each gives alone; nothing touches the KV cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from model.embed import MAX_BATCH_TOKENS, Embedder
from model.engine import Engine
from model.forward import _linear
from model.pooling import (
    POOLING_CLS,
    POOLING_LAST,
    POOLING_MEAN,
    POOLING_NONE,
    POOLING_RANK,
    EmbedError,
    pooling_of,
    resolve_pooling,
)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tmp_path_factory):
    # gemma3's sliding window is 8 here: the 40-token inputs below cross it
    path = write_tiny_gguf(tmp_path_factory.mktemp("embed") / f"{request.param}.gguf", request.param, n_layer=2,
                           scale=0.3)
    return Engine.load(path, verified=True, n_ctx=256, max_seqs=1, warmup=False)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _head(engine: Engine, states: np.ndarray) -> np.ndarray:
    w = engine.weights
    logits = np.asarray(_linear(jnp.asarray(states), w.token_embd if w.output is None else w.output))
    cap = engine.config.final_logit_softcap
    return np.tanh(logits / cap) * cap if cap > 0 else logits


def test_unpooled_states_are_the_output_norms_result(engine):
    tokens = _tokens(40, 1)
    (states,) = engine.embed([tokens], POOLING_NONE)
    assert states.shape == (40, engine.config.n_embd)
    np.testing.assert_allclose(_head(engine, states), engine.logits(tokens), rtol=2e-4, atol=2e-4)


def test_poolings_read_the_real_tokens(engine):
    tokens = _tokens(29, 2)
    (states,) = engine.embed([tokens], POOLING_NONE)
    (mean,) = engine.embed([tokens], POOLING_MEAN)
    (cls,) = engine.embed([tokens], POOLING_CLS)
    (last,) = engine.embed([tokens], POOLING_LAST)
    np.testing.assert_allclose(mean, states.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cls, states[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(last, states[-1], rtol=1e-6, atol=1e-6)


def test_a_batch_gives_what_each_input_gives_alone(engine):
    inputs = [_tokens(5, 3), _tokens(20, 4), _tokens(17, 5), _tokens(1, 6), _tokens(32, 7)]
    together = engine.embed(inputs, POOLING_MEAN)
    for tokens, v in zip(inputs, together, strict=True):
        (alone,) = engine.embed([tokens], POOLING_MEAN)
        # other shapes, other f32 sums: an f16-rounded K or V may land one f16 step apart (about 1e-4 here)
        np.testing.assert_allclose(v, alone, rtol=1e-3, atol=1e-4)


def test_the_kv_cache_is_untouched(engine):
    k, v = np.asarray(engine.pool.k).copy(), np.asarray(engine.pool.v).copy()
    engine.embed([_tokens(30, 8)], POOLING_MEAN)
    assert np.array_equal(np.asarray(engine.pool.k), k) and np.array_equal(np.asarray(engine.pool.v), v)


def test_refusals(engine):
    with pytest.raises(EmbedError, match="Input content cannot be empty"):
        engine.embed([[]], POOLING_MEAN)
    with pytest.raises(EmbedError, match="outside the vocabulary"):
        engine.embed([[1, engine.config.n_vocab]], POOLING_MEAN)
    with pytest.raises(EmbedError, match="rank"):
        engine.embed([[1, 2]], POOLING_RANK)


def test_buckets_are_powers_of_two_and_a_large_batch_is_split():
    plan = Embedder.plan(None, [3, 16, 17, 200, 5, *([1000] * 9)])  # plan reads no state
    by_length = {}
    for b, t, members in plan:
        assert b & (b - 1) == 0 and t & (t - 1) == 0 and b * t <= max(MAX_BATCH_TOKENS, t)
        assert len(members) <= b
        by_length.setdefault(t, []).extend(members)
    assert by_length == {16: [0, 1, 4], 32: [2], 256: [3], 1024: list(range(5, 14))}
    assert [len(m) for b, t, m in plan if t == 1024] == [4, 4, 1]


def test_the_ggufs_pooling_type():
    assert pooling_of({"bert.pooling_type": 2}, "bert") == POOLING_CLS
    assert pooling_of({"llama.context_length": 8}, "llama") is None
    assert resolve_pooling(None) == POOLING_MEAN and resolve_pooling(POOLING_LAST) == POOLING_LAST


def test_embedding_programs_compile_on_first_use(tmp_path):
    path = write_tiny_gguf(tmp_path / "lazy.gguf", "llama", n_layer=1)
    engine = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False)
    assert engine._embedder is None  # loading made no embedding program
    engine.embed([[1, 2, 3]])
    assert list(engine._embedder._compiled) == [(1, 16, POOLING_MEAN)]


def test_the_device_layout_gives_the_same_states(tmp_path):
    """The unrolled layers (the GPU's layout, here through the kernels' jnp twins) against the stacked ones."""
    path = write_tiny_gguf(tmp_path / "gemma3.gguf", "gemma3", n_layer=2, scale=0.3)
    stacked = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False)
    device = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, layout="device")
    tokens = _tokens(20, 9)  # past gemma3's sliding window of 8
    np.testing.assert_allclose(device.embed([tokens], POOLING_NONE)[0], stacked.embed([tokens], POOLING_NONE)[0],
                               rtol=1e-5, atol=1e-5)
