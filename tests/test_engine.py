"""The generation API on a tiny random llama (tokenizer included) and, marked slow, on the real SmolLM2."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from model.engine import Engine, EngineError
from model.messages import FinishReason, GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("engine") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    return Engine.load(path, verified=True, n_ctx=1024, max_seqs=2, warmup=False)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _tokens(outs) -> list[int]:
    return [o.token for o in outs]


def _greedy_by_full_forward(engine: Engine, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(engine.logits(seq)[-1])))
    return seq[len(prompt):]


def test_greedy_generation_matches_full_forward(engine):
    prompt = _prompt(40)
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8)))
    assert _tokens(outs) == _greedy_by_full_forward(engine, prompt, 8)
    assert [o.finish_reason for o in outs] == [None] * 7 + [FinishReason.LENGTH]
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens) == (40, 8)
    # the streamed pieces are the tokens' text (byte-level vocabulary: every token is one byte)
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(_tokens(outs))


def test_prompt_longer_than_a_prefill_chunk(engine):
    """700 tokens: a 512 chunk, then a chunk that attends to the cached first one."""
    prompt = _prompt(700, seed=1)
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3)))
    assert _tokens(outs) == _greedy_by_full_forward(engine, prompt, 3)


def test_context_full_and_prompt_limits(engine):
    outs = list(engine.generate(_prompt(1020, seed=2), GREEDY))  # n_ctx 1024: room for 4 tokens
    assert len(outs) == 4 and outs[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(EngineError, match="1024 tokens, the context only 1024"):
        list(engine.generate(_prompt(1024), GREEDY))
    with pytest.raises(EngineError, match="empty"):
        list(engine.generate([], GREEDY))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        list(engine.generate([1, 10_000], GREEDY))
    # max_tokens 0 returns one token, as llama-server does
    assert len(list(engine.generate(_prompt(5), SamplingParams(temperature=0.0, max_tokens=0)))) == 1


def test_end_of_generation_token_stops(engine):
    prompt = _prompt(12, seed=3)
    first = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1)))[0].token
    engine.eog_ids = frozenset({first})
    try:
        outs = list(engine.generate(prompt, GREEDY))
    finally:
        engine.eog_ids = frozenset(engine.tokenizer.eog_ids)
    assert len(outs) == 1
    assert (outs[0].token, outs[0].finish_reason, outs[0].completion_tokens) == (first, FinishReason.STOP, 1)


def test_seeded_sampling_is_deterministic(engine):
    prompt = _prompt(10, seed=4)

    def run(seed, **kw):
        params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=12, **kw)
        return _tokens(engine.generate(prompt, params))

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7, n_probs=2) == run(7)  # asking for logprobs does not move the draw


def test_logprobs_are_the_raw_log_softmax(engine):
    prompt = _prompt(9, seed=5)
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, n_probs=5)))
    logits = engine.logits(prompt + _tokens(outs)[:-1])[len(prompt) - 1:]
    for row, out in zip(logits, outs, strict=True):
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(row)))
        top = np.argsort(-lp)[:5]
        assert [t.token for t in out.top_logprobs] == top.tolist()
        np.testing.assert_allclose([t.logprob for t in out.top_logprobs], lp[top], atol=1e-4)
        assert out.logprob == pytest.approx(lp[out.token], abs=1e-4)


def test_two_requests_share_the_batch(engine):
    """Requests decoded side by side in two sequences give the tokens each gives alone; a third waits
    for a free sequence instead of being refused."""
    a, b = _prompt(20, seed=6), _prompt(33, seed=7)
    pa, pb = SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=0.9, seed=3, max_tokens=9)
    alone_a, alone_b = _tokens(engine.generate(a, pa)), _tokens(engine.generate(b, pb))
    alone_c = _tokens(engine.generate(a, SamplingParams(temperature=0.0, max_tokens=3)))
    tasks = {engine.add(GenerateRequest(a, pa, "a")): "a", engine.add(GenerateRequest(b, pb, "b")): "b",
             engine.add(GenerateRequest(a, SamplingParams(temperature=0.0, max_tokens=3), "c")): "c"}
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    admitted = []
    while engine.has_work():
        it = engine.iterate()
        admitted.append([tasks[t] for t, _ in it.admitted])
        if admitted[-1] == ["a", "b"]:
            assert engine.stats().running == 2 and engine.stats().waiting == 1
        for task, out in it.outputs:
            got[tasks[task]].append(out.token)
    assert admitted[0] == ["a", "b"] and ["c"] in admitted
    assert got == {"a": alone_a, "b": alone_b, "c": alone_c}
    assert engine.free_slots() == 2 and engine.stats().pages_used == 0


def test_stop_string_ends_the_generation(engine):
    """Stops are the host side's (model/completion.py): the engine feeds it every token."""
    prompt = _prompt(15, seed=8)
    first = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6)))
    at = next(i for i, o in enumerate(first) if i > 0 and o.text.isascii() and o.text)  # a plain-text token
    before = "".join(o.text for o in first[:at])
    assert first[at].text not in before
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop=(first[at].text,))))
    assert outs[-1].finish_reason is FinishReason.STOP and len(outs) == at + 1
    assert "".join(o.text for o in outs) == before


def test_unsupported_sampling_is_refused(engine):
    with pytest.raises(EngineError, match="mirostat"):
        list(engine.generate(_prompt(4), SamplingParams(mirostat=2, dry_multiplier=0.5)))
    assert engine.free_slots() == 2


def test_penalties_see_the_prompt_and_the_answer(engine):
    """A presence penalty larger than any logit gap: greedy never picks a token already in the row."""
    prompt = _prompt(12, seed=9)
    plain = _tokens(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16)))
    params = SamplingParams(temperature=0.0, max_tokens=16, repeat_last_n=4096, presence_penalty=1e4)
    outs = _tokens(engine.generate(prompt, params))
    assert outs != plain
    seen = list(prompt)
    for t in outs:
        assert t not in seen
        seen.append(t)
    # a window of 0 turns the penalties off
    assert _tokens(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, repeat_last_n=0,
                                                          presence_penalty=1e4))) == plain


def test_the_chain_samples_on_the_device_for_every_parameter(engine):
    prompt = _prompt(10, seed=10)
    for kw in (dict(typical_p=0.8), dict(top_n_sigma=1.5), dict(xtc_probability=0.5, xtc_threshold=0.1),
               dict(dynatemp_range=0.5), dict(min_keep=3, top_p=0.1), dict(frequency_penalty=0.5)):
        a = _tokens(engine.generate(prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=6, **kw)))
        assert a == _tokens(engine.generate(prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=6, **kw)))


def test_a_prompt_that_shares_a_prefix_reuses_the_cached_pages(engine):
    """The same answer with or without reuse; the reused prefix is reported as cached tokens, in whole
    pages of 16, from whichever sequence computed them."""
    prompt = _prompt(50, seed=11)
    first = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5)))
    assert first[-1].cached_tokens == 0
    again = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5)))
    assert _tokens(again) == _tokens(first) and again[-1].cached_tokens == 48  # 3 full pages of the 50
    # the prompt and what was generated (all but the last token, never decoded): 54 tokens, 3 full pages
    longer = prompt + _tokens(first)[:-1] + _prompt(20, seed=12)
    reused = list(engine.generate(longer, SamplingParams(temperature=0.0, max_tokens=4)))
    assert reused[-1].cached_tokens == 48
    cold = list(engine.generate(longer, SamplingParams(temperature=0.0, max_tokens=4, cache_prompt=False)))
    assert cold[-1].cached_tokens == 0 and _tokens(cold) == _tokens(reused)
    assert _tokens(reused) == _greedy_by_full_forward(engine, longer, 4)
    # a prompt of whole pages, all cached, still computes its last page for the next token's logits
    whole = longer[:64]
    list(engine.generate(whole, SamplingParams(temperature=0.0, max_tokens=1)))
    outs = list(engine.generate(whole, SamplingParams(temperature=0.0, max_tokens=2)))
    assert outs[-1].cached_tokens == 48 and _tokens(outs) == _greedy_by_full_forward(engine, whole, 2)


def test_the_prefix_is_shared_while_its_first_request_still_runs(engine):
    """A shared system prompt: the second request reuses the first one's pages while the first decodes
    in the other sequence."""
    system = _prompt(40, seed=13)
    a, b = system + _prompt(5, seed=14), system + _prompt(7, seed=15)
    alone_b = _tokens(engine.generate(b, SamplingParams(temperature=0.0, max_tokens=4, cache_prompt=False)))
    ta = engine.add(GenerateRequest(a, SamplingParams(temperature=0.0, max_tokens=20), "a"))
    engine.iterate()  # a's prompt is in: its two full pages are cached
    tb = engine.add(GenerateRequest(b, SamplingParams(temperature=0.0, max_tokens=4), "b"))
    outs = {ta: [], tb: []}
    while engine.has_work():
        for task, out in engine.iterate().outputs:
            outs[task].append(out)
        running = {s.task: s for s in engine.scheduler.running}
        if ta in running and tb in running:
            assert running[tb].pages[:2] == running[ta].pages[:2] and running[ta].slot != running[tb].slot
    assert outs[tb][-1].cached_tokens == 32 and _tokens(outs[tb]) == alone_b


def test_cancel_frees_the_sequence(engine):
    task = engine.add(GenerateRequest(_prompt(8), GREEDY, "x"))
    outs = engine.iterate().outputs
    assert outs and all(t == task and out.finish_reason is None for t, out in outs)
    assert engine.stats().running == 1
    assert engine.stats().pages_used > 0
    final = engine.cancel(task)
    assert final.finish_reason is FinishReason.ABORT and engine.free_slots() == 2
    assert engine.stats().pages_used == 0 and not engine.has_work()
    assert engine.cancel(task) is None
    waiting = engine.add(GenerateRequest(_prompt(8), GREEDY, "y"))  # cancelled before it ever ran
    assert engine.cancel(waiting).finish_reason is FinishReason.ABORT and not engine.has_work()


def test_no_recompiles_after_warmup(tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    engine = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False)
    assert engine.warmup() > 0
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            jax.jit(lambda x: x * 3)(jnp.ones(3))  # proves the capture sees a compilation
            assert any("Compiling" in r.getMessage() for r in caplog.records)
            caplog.clear()
            for i, params in enumerate([GREEDY, SamplingParams(temperature=0.7, seed=1, n_probs=3),
                                        SamplingParams(temperature=1.3, top_k=0, top_p=0.5, seed=2),
                                        SamplingParams(temperature=0.2, top_k=5, min_p=0.2, max_tokens=4),
                                        SamplingParams(temperature=0.8, repeat_penalty=1.3, typical_p=0.9,
                                                       xtc_probability=0.5, max_tokens=3)]):
                list(engine.generate(_prompt(3 + 40 * i, seed=i), params))
            prompt = _prompt(30, seed=9)  # then the same prompt grown: the rest runs after the reused cells
            first = _tokens(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3)))
            list(engine.generate(prompt + first[:-1] + _prompt(100, seed=10), GREEDY))
            # and two sequences at once: the batched decode step at batch size 2
            tasks = [engine.add(GenerateRequest(_prompt(20 + 30 * i, seed=20 + i), SamplingParams(
                temperature=0.5, seed=i, max_tokens=5), f"b{i}")) for i in range(2)]
            while engine.has_work():
                engine.iterate()
            assert len(tasks) == 2
            compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    finally:
        jax.config.update("jax_log_compiles", False)
    assert compiles == []


def test_the_largest_prefill_bucket_is_a_setting(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    engine = Engine.load(path, verified=True, n_ctx=512, warmup=False, prefill_chunk=64)
    assert engine.programs.prefill_buckets() == [16, 32, 64]
    prompt = _prompt(150, seed=11)  # three chunks of 64
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    assert _tokens(outs) == _greedy_by_full_forward(engine, prompt, 2)
    # every chunk's K/V went into the pages: a second time, all 9 full pages of the 150 are reused
    again = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    assert again[-1].cached_tokens == 144 and _tokens(again) == _tokens(outs)
    for bad in (100, 8):
        with pytest.raises(EngineError, match="must be a power of two of at least 16"):
            Engine.load(path, verified=True, n_ctx=512, warmup=False, prefill_chunk=bad)


_WARM_IN_A_FRESH_PROCESS = """
import sys
from model.engine import Engine
Engine.load(sys.argv[1], verified=True, n_ctx=256, max_seqs=1, prefill_chunk=16, compile_cache_dir=sys.argv[2])
"""


def test_a_restart_reuses_the_persistent_compile_cache(tmp_path):
    """The second process finds every program in the cache and writes nothing new."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    cache = tmp_path / "xla"
    run = [sys.executable, "-c", _WARM_IN_A_FRESH_PROCESS, str(path), str(cache)]
    subprocess.run(run, check=True, cwd=Path(__file__).parent.parent, capture_output=True)
    first = sorted(p.name for p in cache.iterdir())
    # one sequence, one prefill bucket: 6 programs of every kind, enough to show the reuse
    n_programs = len(Engine.load(path, verified=True, n_ctx=256, max_seqs=1, prefill_chunk=16,
                                 warmup=False).programs.keys())
    assert len([n for n in first if n.startswith(("jit_run-", "jit_decode-", "jit_select-", "jit_put_row-"))]) == n_programs
    subprocess.run(run, check=True, cwd=Path(__file__).parent.parent, capture_output=True)
    assert sorted(p.name for p in cache.iterdir()) == first


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(smollm2_path):
    from gguf import GGUFReader

    from model.chat_template import render_chat

    # tests/test_parity_engine.py's shapes: in one pytest process JAX compiles their programs once for both
    engine = Engine.load(smollm2_path, verified=True, n_ctx=512, max_seqs=8, warmup=False)
    tok = engine.tokenizer
    template = GGUFReader(str(smollm2_path)).fields["tokenizer.chat_template"].contents()
    text = render_chat(template, [{"role": "user", "content": "What is the capital of France?"}],
                       bos_token=tok.bos_token, eos_token=tok.eos_token, add_bos=tok.add_bos)
    prompt = tok.encode(text, add_special=True, parse_special=True)
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24)))
    answer = "".join(o.text for o in outs)
    assert "Paris" in answer
    assert outs[-1].finish_reason is FinishReason.STOP
