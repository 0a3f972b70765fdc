"""DRY (model/dry.py, llama.cpp's llama_sampler_dry_apply): hand-checkable histories, then the engine
and the gateway with dry_multiplier set."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from gateway_helpers import FakeServer, tiny_model
from tiny_gguf import write_tiny_gguf

from model.dry import dry_bias, dry_penalties, restart_sequences
from model.engine import Engine
from model.messages import SamplingParams

pytestmark = pytest.mark.timeout(300)

A, B, C, D, X, Y, BR = 1, 2, 3, 4, 5, 7, 9  # BR: a single-token breaker
RESTARTS = {BR: [()]}


def test_a_repeat_penalises_the_token_that_would_extend_it():
    # "c a b c a b": the suffix "c a b" (3) repeats; emitting "c" would extend it
    pen = dry_penalties([C, A, B, C, A, B], 0.8, 1.75, 2, 64, RESTARTS)
    assert pen == pytest.approx({C: 0.8 * 1.75 ** (3 - 2)})
    # "a b c a b": suffix "a b" (2) repeats, c extends it: multiplier * base^0
    pen = dry_penalties([A, B, C, A, B], 0.8, 1.75, 2, 64, RESTARTS)
    assert pen == pytest.approx({C: 0.8})
    row = dry_bias([A, B, C, A, B], 0.8, 1.75, 2, 64, RESTARTS, 16)
    assert row[C] == pytest.approx(-0.8) and np.count_nonzero(row) == 1


def test_below_the_allowed_length_nothing_is_penalised():
    assert dry_penalties([A, B, C, A, B], 0.8, 1.75, 3, 64, RESTARTS) == {}
    assert dry_penalties([A, B, C, D, A, B, C], 0.8, 1.75, 3, 64, RESTARTS) == pytest.approx({D: 0.8})


def test_a_breaker_stops_the_match():
    # "br b c" repeats (3): d would extend it; the breaker limits the repeat to "b c" (2)
    history = [BR, B, C, D, BR, B, C]
    assert dry_penalties(history, 0.8, 1.75, 3, 64, {}) == pytest.approx({D: 0.8})
    assert dry_penalties(history, 0.8, 1.75, 3, 64, RESTARTS) == {}
    assert dry_penalties(history, 0.8, 1.75, 2, 64, RESTARTS) == pytest.approx({D: 0.8})
    # a single-token breaker is never penalised, even when it would extend a repeat
    assert dry_penalties([A, B, BR, D, A, B], 0.8, 1.75, 2, 64, {}) == pytest.approx({BR: 0.8})
    assert dry_penalties([A, B, BR, D, A, B], 0.8, 1.75, 2, 64, RESTARTS) == {}


def test_penalty_last_n_limits_the_window():
    history = [A, B, C, X, X, D, A, B]
    assert dry_penalties(history, 0.8, 1.75, 2, 64, RESTARTS) == pytest.approx({C: 0.8})
    assert dry_penalties(history, 0.8, 1.75, 2, 5, RESTARTS) == {}  # the first "a b c" is out of view
    assert dry_penalties(history, 0.8, 1.75, 2, 0, RESTARTS) == {}  # 0: disabled
    assert dry_penalties(history, 0.8, 1.75, 2, -1, RESTARTS) == pytest.approx({C: 0.8})  # the whole history


def test_the_longest_repeat_and_the_exponent_clamp():
    # c follows "a b" (2) and "x a b" (3): the longest counts
    pen = dry_penalties([X, A, B, C, Y, A, B, C, X, A, B], 1.0, 2.0, 2, 64, RESTARTS)
    assert pen[C] == pytest.approx(2.0 ** (3 - 2)) and Y not in pen
    long = [A] * 300
    assert np.isfinite(dry_penalties(long, 1.0, 1.75, 2, 1000, {})[A])


def test_breakers_become_restart_sequences_as_llama_cpp_builds_them():
    pieces = [b"a", b"b:", b"\n", b"x\"", b"x", b"ab", b"q*"]
    seqs = restart_sequences(["\n", ":", "b*"], pieces, lambda text: {"*": [6]}[text])
    # "b:" holds ":" and "\n" is one: restarts by themselves; "ab" ends with "b", the head of "b*",
    # and its tail "*" is tokenized
    assert seqs == {1: [()], 2: [()], 5: [(6,)]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("dry") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    return Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False)


def _repeating_prompt(engine) -> tuple[list[int], int]:
    """A prompt whose greedy next token g extends a repeat of 3: "p21 p22 p23 g p0 .. p23"."""
    for seed in range(20):
        p = [int(t) for t in np.random.default_rng(seed).choice(np.arange(97, 123), 24, replace=False)]
        g = int(np.argmax(engine.logits(p)[-1]))
        prompt = p[-3:] + [g] + p
        if int(np.argmax(engine.logits(prompt)[-1])) == g:
            return prompt, g
    raise AssertionError("no prompt whose greedy token repeats")


def test_the_engine_applies_dry_to_greedy_decoding(engine):
    prompt, g = _repeating_prompt(engine)
    assert next(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))).token == g
    params = SamplingParams(temperature=0.0, max_tokens=4, dry_multiplier=1000.0, dry_base=1.75,
                            dry_allowed_length=2, dry_penalty_last_n=-1)
    tokens = [o.token for o in engine.generate(prompt, params)]
    restarts = engine.runner._restarts(tuple(params.dry_sequence_breakers))
    seq, want = list(prompt), []
    for _ in range(4):
        bias = dry_bias(seq, 1000.0, 1.75, 2, engine.n_ctx, restarts, engine.config.n_vocab)
        want.append(int(np.argmax(engine.logits(seq)[-1] + bias)))
        seq.append(want[-1])
    assert tokens == want
    assert tokens[0] != g  # g extends the repeat: DRY's 1000 * 1.75^(3-2) pushes it down
    # the compiled samplers are the ones plain requests use
    selects = {k for k in engine.compiled.ready if k[0] == "select"}
    list(engine.generate(prompt[::-1], SamplingParams(temperature=0.0, max_tokens=2)))
    assert {k for k in engine.compiled.ready if k[0] == "select"} == selects


def test_dry_multiplier_is_no_longer_refused(tmp_path):
    server = FakeServer(*tiny_model(tmp_path))
    try:
        r = httpx.post(server.url("/v1/chat/completions"), json={
            "messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.8, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
