"""Teacher-forced scoring (model/score.py) on a tiny random llama: the logprobs it gives a text are the
ones generating that text gave, token for token, across prefill chunks, and the full forward's."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from model.engine import Engine
from model.messages import SamplingParams


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("score") / "tiny.gguf", "llama", n_layer=2, scale=0.3)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.mark.parametrize("prefill_chunk", [512, 16])  # one chunk; chunks that attend to the ones before
def test_scoring_gives_the_generation_paths_logprobs(path, prefill_chunk):
    engine = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False, prefill_chunk=prefill_chunk)
    prompt = _prompt(37)
    # sampled, not greedy: the tokens are not each position's top one
    outs = list(engine.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=12, n_probs=5)))
    answer = [o.token for o in outs]
    scored = engine.prompt_logprobs(prompt + answer, n_probs=5)
    assert len(scored) == len(prompt) + len(answer) - 1
    for j, out in enumerate(outs):
        s = scored[len(prompt) - 1 + j]  # position len(prompt) + j, after everything before it
        assert s.logprob == pytest.approx(out.logprob, abs=1e-4)
        assert [t for t, _ in s.top] == [t.token for t in out.top_logprobs]
        np.testing.assert_allclose([lp for _, lp in s.top], [t.logprob for t in out.top_logprobs], atol=1e-4)


def test_scoring_is_the_full_forwards_log_softmax(path):
    engine = Engine.load(path, verified=True, n_ctx=256, max_seqs=1, warmup=False, prefill_chunk=32)
    tokens = _prompt(100, seed=1)
    logits = engine.logits(tokens)  # one pass, every position
    want = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    scored = engine.prompt_logprobs(tokens)
    # another bucket, another order of float sums: equal to a few parts in 10^4 of these large logits
    np.testing.assert_allclose([s.logprob for s in scored], want[np.arange(99), tokens[1:]], rtol=5e-4, atol=1e-4)
    assert all(s.top == [] for s in scored)
    rows = engine.prompt_log_softmax(tokens)  # the whole distributions (bench/fidelity.py's KLD)
    assert rows.shape == (99, engine.config.n_vocab)
    np.testing.assert_allclose(rows[np.arange(99), tokens[1:]], [s.logprob for s in scored], atol=1e-5)
    np.testing.assert_allclose(np.exp(rows).sum(-1), 1.0, atol=1e-4)
    assert engine.prompt_logprobs(tokens[:1]) == []
    with pytest.raises(ValueError, match="context only 256"):
        engine.prompt_logprobs(_prompt(257))
