"""Grammars, logit_bias and ignore_eos on the batched engine (model/host_bias.py, model/constraint.py),
on a tiny random llama whose byte-level vocabulary can spell any text."""

from __future__ import annotations

import json
import math

import pytest
from tiny_gguf import write_tiny_gguf

from model import constraint as mc
from model.engine import Engine
from model.messages import FinishReason, GenerateRequest, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("constraints") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    return Engine.load(path, verified=True, n_ctx=512, max_seqs=4, warmup=False)


def _constraint(engine, grammar: str) -> mc.Constraint:
    return mc.compile_constraint(grammar, engine.tokenizer, engine.config.n_vocab)


def _run(engine, requests: list[GenerateRequest]) -> list[list]:
    """Every request to its end, all in one batch; each one's outputs."""
    tasks = [engine.add(r) for r in requests]
    outs: dict[int, list] = {t: [] for t in tasks}
    while any(not o or o[-1].finish_reason is None for o in outs.values()):
        for t, out in engine.iterate().outputs:
            if out.token is not None or out.finish_reason is not None:
                outs[t].append(out)
    return [outs[t] for t in tasks]


def _text(engine, outs) -> str:
    return engine.tokenizer.decode([o.token for o in outs if o.token is not None and o.token not in engine.eog_ids])


def test_a_schema_constrained_sequence_emits_only_allowed_tokens_and_ends_when_complete(engine):
    grammar = mc.json_schema_grammar(json.dumps(SCHEMA))
    for seed in range(3):  # sampled, not greedy: the mask alone keeps a random model inside the schema
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=200)
        [outs] = _run(engine, [GenerateRequest([1, 2, 3], params, constraint=_constraint(engine, grammar))])
        last = outs[-1]
        assert last.finish_reason is FinishReason.STOP and last.stop_type == "eos"
        doc = json.loads(_text(engine, outs))
        assert set(doc) == {"name", "n", "ok"} and 0 <= doc["n"] <= 99 and len(doc["name"]) <= 6
        check = _constraint(engine, grammar)  # a fresh matcher takes every emitted token, in order
        assert all(check.consume(o.token) for o in outs if o.token not in engine.eog_ids)
        assert last.grammar_ms > 0.0


def test_an_unconstrained_sequence_gets_the_same_tokens_beside_a_constrained_one(engine):
    free = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    [alone] = _run(engine, [GenerateRequest([5, 6, 7], free)])
    grammar = mc.regex_grammar(r"[a-z]{3,40}")
    both = _run(engine, [GenerateRequest([5, 6, 7], free),
                         GenerateRequest([9, 9], SamplingParams(temperature=1.0, seed=3, max_tokens=30),
                                         constraint=_constraint(engine, grammar))])
    assert [o.token for o in both[0]] == [o.token for o in alone]
    assert all(o.grammar_ms == 0.0 for o in both[0])
    text = _text(engine, both[1])
    assert text.isalpha() and text.islower() and 3 <= len(text) <= 40


def test_a_regex_of_two_words_ends_on_one_of_them(engine):
    grammar = mc.regex_grammar("(yes|no)")
    texts = set()
    for seed in range(4):
        [outs] = _run(engine, [GenerateRequest([4], SamplingParams(temperature=2.0, seed=seed, max_tokens=10),
                                               constraint=_constraint(engine, grammar))])
        assert outs[-1].finish_reason is FinishReason.STOP
        texts.add(_text(engine, outs))
    assert texts <= {"yes", "no"}


def test_logit_bias_moves_greedy_tokens(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    [plain] = _run(engine, [GenerateRequest([10, 11], greedy)])
    first = plain[0].token
    [banned] = _run(engine, [GenerateRequest([10, 11], SamplingParams(
        temperature=0.0, max_tokens=4, logit_bias=((first, -math.inf),)))])
    assert banned[0].token != first
    [pushed] = _run(engine, [GenerateRequest([10, 11], SamplingParams(
        temperature=0.0, max_tokens=4, logit_bias=((ord("Q"), 1000.0),)))])
    assert all(o.token == ord("Q") for o in pushed)


def test_ignore_eos_never_ends_on_an_end_of_generation_token(engine):
    eos = engine.tokenizer.eos_id
    ends = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((eos, 1000.0),))
    [ended] = _run(engine, [GenerateRequest([3], ends)])
    assert ended[0].token == eos and ended[0].finish_reason is FinishReason.STOP
    ignoring = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((eos, 1000.0),), ignore_eos=True)
    [kept] = _run(engine, [GenerateRequest([3], ignoring)])
    assert len(kept) == 6 and kept[-1].finish_reason is FinishReason.LENGTH
    assert not any(o.token in engine.eog_ids for o in kept)


def test_a_grammar_wins_over_biases_that_would_leave_nothing(engine):
    """Every letter but 'y' and 'n' banned, and the grammar allows only 'yes' or 'no': the biases give
    way where they would leave no token, and the answer still parses."""
    ban = tuple((t, -math.inf) for t in range(engine.config.n_vocab))
    [outs] = _run(engine, [GenerateRequest([4], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=ban),
                                           constraint=_constraint(engine, mc.regex_grammar("(yes|no)")))])
    assert _text(engine, outs) in {"yes", "no"} and outs[-1].finish_reason is FinishReason.STOP


def test_fifty_top_logprobs_are_the_raw_logits_best_fifty(engine):
    import numpy as np

    prompt = [7, 8, 9]
    [outs] = _run(engine, [GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=1, n_probs=50))])
    top = outs[0].top_logprobs
    assert len(top) == 50
    logits = np.asarray(engine.logits(prompt), np.float64)[-1]  # [n, V]: after the prompt's last token
    lp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    best = np.argsort(-lp, kind="stable")[:50]
    assert sorted(t.token for t in top) == sorted(int(t) for t in best)
    assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:], strict=False))
    assert all(abs(t.logprob - lp[t.token]) < 1e-3 for t in top)
