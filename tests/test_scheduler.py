"""The scheduler (model/scheduler.py), in two layers.

First over a pure-Python runner (no jax, tests/scheduler_fakes.py): it keeps every page's cells as the
tokens written there and samples each next token from what it reads back through the block table, so a
page handed to the wrong sequence, written after it was shared, or lost in a preemption changes the
answer. Then on the tiny random model: the batch does not change a sequence's tokens, greedy or seeded,
nor does a pool so small that the sequences preempt each other. Lookahead: test_scheduler_lookahead.py.
"""

from __future__ import annotations

import pytest
from scheduler_fakes import accounted, add, collect, drain, make, prompt, reference, tokens

from model.messages import FinishReason, GenerateRequest, SamplingParams

# --- admission --------------------------------------------------------------------------------------


def test_admission_is_first_come_first_served_up_to_max_seqs():
    sched, runner = make(max_seqs=2)
    a, b, c = (add(sched, prompt(6, seed=i), max_tokens=3) for i in range(3))
    it = sched.iterate()
    assert [t for t, _ in it.admitted] == [a, b]
    assert len(sched.waiting) == 1 and sched.waiting[0].task == c
    assert sorted(slot for _, slot in runner.started) == [0, 1]
    outs, its = drain(sched, outs=collect(it, {}))
    assert [t for it in its for t, _ in it.admitted] == [c]
    assert {t: tokens(o) for t, o in outs.items()} == {
        t: reference(prompt(6, seed=i), 3) for i, t in enumerate((a, b, c))}
    assert sched.pool.used == 0


def test_the_head_that_does_not_fit_blocks_those_behind_it():
    # 20 pages of 4: a 40-token prompt takes 11 (its tokens and the next one)
    sched, _ = make(n_pages=20, n_ctx=64, max_seqs=3)
    a = add(sched, prompt(40, seed=1), max_tokens=2)
    b = add(sched, prompt(40, seed=2), max_tokens=2)
    c = add(sched, prompt(3, seed=3), max_tokens=2)  # would fit beside a, but waits behind b
    it = sched.iterate()
    assert [t for t, _ in it.admitted] == [a]
    assert [s.task for s in sched.waiting] == [b, c]
    outs, its = drain(sched)
    order = [t for it in its for t, _ in it.admitted]
    assert order == [b, c]
    assert tokens(outs[c]) == reference(prompt(3, seed=3), 2)


def test_a_long_prompt_advances_one_budget_per_iteration_while_others_decode():
    sched, runner = make(budget=8, n_ctx=128, n_pages=64)
    short = add(sched, prompt(4, seed=4), max_tokens=20)
    sched.iterate()  # the short one's prompt and its first token
    long = add(sched, prompt(40, seed=5), max_tokens=2)
    runner.prefills.clear()
    got_first, outs = None, {}
    for i in range(1, 8):
        it = sched.iterate()
        collect(it, outs)
        by_task = dict(it.outputs)
        assert short in by_task, "the running stream decodes on every iteration"
        assert sum(n for _, _, n in runner.prefills) <= 8
        runner.prefills.clear()
        if long in by_task and got_first is None:
            got_first = i
    assert got_first == 5  # 40 tokens in chunks of 8
    outs, _ = drain(sched, outs=outs)
    assert tokens(outs[long]) == reference(prompt(40, seed=5), 2)
    assert tokens(outs[short]) == reference(prompt(4, seed=4), 20)[2:]  # two came in the first iteration


def test_prefill_chunks_go_oldest_first_within_the_budget():
    sched, runner = make(budget=10, n_ctx=64)
    a = add(sched, prompt(12, seed=6), max_tokens=1)
    b = add(sched, prompt(12, seed=7), max_tokens=1)
    sched.iterate()
    assert runner.prefills == [(a, 0, 10)]
    sched.iterate()
    assert runner.prefills == [(a, 0, 10), (a, 10, 2), (b, 0, 8)]


# --- preemption -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_prompt", [True, False])
def test_out_of_pages_preempts_the_newest_and_every_sequence_ends_as_if_alone(cache_prompt):
    # one context's worth of pages (8 of 4 = 32 tokens) for three sequences that each grow to 26
    sched, _ = make(n_pages=8, page_size=4, n_ctx=32, max_seqs=3)
    prompts = [prompt(6, seed=10 + i) for i in range(3)]
    tasks = [add(sched, p, max_tokens=20, cache_prompt=cache_prompt) for p in prompts]
    outs, its = drain(sched)
    assert sched.preemptions > 0
    for task, p in zip(tasks, prompts, strict=True):
        assert tokens(outs[task]) == reference(p, 20)
        assert outs[task][-1].finish_reason is FinishReason.LENGTH
        assert [o.completion_tokens for o in outs[task]] == list(range(1, 21))  # each token once
    assert sched.pool.used == 0 and sched.pool.available() == sched.pool.n_pages
    assert not sched.running and not sched.waiting
    # the first admitted is never the victim: it has a token in every iteration until its end
    first_outputs = [i for i, it in enumerate(its) if any(t == tasks[0] for t, _ in it.outputs)]
    assert first_outputs == list(range(first_outputs[-1] + 1))


def test_a_preempted_sequence_goes_back_to_the_head_of_the_queue():
    sched, _ = make(n_pages=8, page_size=4, n_ctx=32, max_seqs=3)
    a = add(sched, prompt(6, seed=20), max_tokens=20)
    b = add(sched, prompt(6, seed=21), max_tokens=20)
    while not sched.preemptions:
        sched.iterate()
        accounted(sched)
    c = add(sched, prompt(6, seed=22), max_tokens=2)
    assert [s.task for s in sched.running] == [a]
    assert [s.task for s in sched.waiting] == [b, c]  # the victim first, the newcomer behind it
    outs, _ = drain(sched)
    assert tokens(outs[b])[-1] == reference(prompt(6, seed=21), 20)[-1]
    assert tokens(outs[c]) == reference(prompt(6, seed=22), 2)


# --- cancellation -----------------------------------------------------------------------------------


def test_cancel_frees_a_running_sequence_and_a_waiting_one():
    sched, _ = make(max_seqs=1)
    a = add(sched, prompt(10, seed=30), max_tokens=50)
    b = add(sched, prompt(10, seed=31), max_tokens=50)
    for _ in range(3):
        sched.iterate()
    assert sched.pool.used > 0 and [s.task for s in sched.waiting] == [b]
    out = sched.cancel(b)
    assert (out.finish_reason, out.completion_tokens, out.prompt_tokens) == (FinishReason.ABORT, 0, 10)
    assert not sched.waiting
    out = sched.cancel(a)
    # the first iteration samples the prompt's token and decodes it: 2 tokens, then one per iteration
    assert (out.finish_reason, out.completion_tokens) == (FinishReason.ABORT, 4)
    assert sched.pool.used == 0 and not sched.running and not sched.has_work()
    assert sched.cancel(a) is None and sched.cancel(12345) is None
    c = add(sched, prompt(10, seed=32), max_tokens=2)  # the slot is free again
    outs, _ = drain(sched)
    assert tokens(outs[c]) == reference(prompt(10, seed=32), 2)


def test_a_sequence_cancelled_mid_prompt_frees_its_pages_and_leaves_its_full_pages_cached():
    sched, runner = make(budget=8, page_size=4)
    p = prompt(40, seed=33)
    a = add(sched, p, max_tokens=2)
    sched.iterate()
    sched.iterate()  # 16 of its 40 prompt tokens computed: four full pages
    assert sched.running[0].n_computed == 16
    assert sched.cancel(a).finish_reason is FinishReason.ABORT
    assert (sched.pool.used, sched.pool.cached) == (0, 4)
    runner.prefills.clear()
    b = add(sched, p, max_tokens=2)
    outs, _ = drain(sched)
    assert outs[b][-1].cached_tokens == 16 and runner.prefills[0] == (b, 16, 8)
    assert tokens(outs[b]) == reference(p, 2)


# --- the prefix cache -------------------------------------------------------------------------------


def test_a_finished_prompt_is_reused_by_the_next_request_in_whole_pages():
    sched, runner = make(page_size=4)
    p = prompt(10, seed=40)
    a = add(sched, p, max_tokens=3)
    first, _ = drain(sched)
    assert first[a][-1].cached_tokens == 0
    assert sched.pool.cached > 0 and sched.pool.used == 0
    runner.prefills.clear()
    b = add(sched, p, max_tokens=3)
    outs, _ = drain(sched)
    assert tokens(outs[b]) == tokens(first[a]) == reference(p, 3)
    assert [o.cached_tokens for o in outs[b]] == [8, 8, 8]  # two whole pages of 4 of the 10
    assert runner.prefills == [(b, 8, 2)]
    # a longer prompt sharing the first 10 tokens and what was generated reuses every full page of them
    longer = p + reference(p, 3)[:2] + prompt(5, seed=41)
    c = add(sched, longer, max_tokens=2)
    outs, _ = drain(sched)
    assert outs[c][-1].cached_tokens == 12 and tokens(outs[c]) == reference(longer, 2)
    assert sched.stats().prefix_hits_tokens == 8 + 12
    assert sched.stats().prefix_queries_tokens == 10 + 10 + len(longer)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    sched, runner = make(page_size=4)
    p = prompt(8, seed=42)  # exactly two pages
    add(sched, p, max_tokens=2)
    drain(sched)
    runner.prefills.clear()
    b = add(sched, p, max_tokens=2)
    outs, _ = drain(sched)
    assert outs[b][-1].cached_tokens == 4  # the second page is computed again for the last token's logits
    assert runner.prefills == [(b, 4, 4)]
    assert tokens(outs[b]) == reference(p, 2)


def test_running_sequences_share_their_full_pages_whatever_their_slot():
    sched, runner = make(page_size=4, max_seqs=2)
    system = prompt(12, seed=43)
    a = add(sched, system + [1, 2], max_tokens=10)
    sched.iterate()  # a's prompt is done: its three full pages are published
    b = add(sched, system + [3, 4, 5], max_tokens=5)
    sched.iterate()
    [sa, sb] = sched.running
    assert (sa.task, sb.task) == (a, b) and sa.slot != sb.slot
    assert sb.pages[:3] == sa.pages[:3] and sb.completion.n_cached == 12
    assert runner.prefills[-1] == (b, 12, 3)
    outs, _ = drain(sched)
    assert tokens(outs[b])[-1] == reference(system + [3, 4, 5], 5)[-1]
    assert tokens(outs[a])[-1] == reference(system + [1, 2], 10)[-1]


def test_cache_prompt_false_computes_the_whole_prompt():
    sched, runner = make(page_size=4)
    p = prompt(10, seed=44)
    add(sched, p, max_tokens=2)
    drain(sched)
    runner.prefills.clear()
    queries = sched.pool.queries_tokens
    b = add(sched, p, max_tokens=2, cache_prompt=False)
    outs, _ = drain(sched)
    assert outs[b][-1].cached_tokens == 0 and runner.prefills == [(b, 0, 10)]
    assert sched.pool.queries_tokens == queries  # not looked up at all
    assert tokens(outs[b]) == reference(p, 2)


def test_cached_pages_are_evicted_when_the_pool_needs_them():
    sched, _ = make(n_pages=16, page_size=4, n_ctx=64, max_seqs=1)
    first = prompt(40, seed=45)
    add(sched, first, max_tokens=1)
    drain(sched)
    assert sched.pool.cached == 10
    other = prompt(60, seed=46)  # needs 16 pages: every cached one goes
    t = add(sched, other, max_tokens=2)
    outs, _ = drain(sched)
    assert tokens(outs[t]) == reference(other, 2)
    again = add(sched, first, max_tokens=1)
    outs, _ = drain(sched)
    assert outs[again][-1].cached_tokens == 0


# --- seen from outside ------------------------------------------------------------------------------


def test_stats_show_each_slot_and_the_pool():
    sched, _ = make(n_pages=32, page_size=4, max_seqs=2, n_ctx=64, budget=8)
    assert sched.stats().sequences[0].is_processing is False
    a = add(sched, prompt(6, seed=50), max_tokens=5)
    b = add(sched, prompt(20, seed=51), max_tokens=-1)
    c = add(sched, prompt(3, seed=52), max_tokens=1)
    sched.iterate()  # a prefilled (6), its first token and its decode; b's first 2 prompt tokens
    s = sched.stats()
    assert (s.max_seqs, s.running, s.waiting, s.page_size, s.pages_total) == (2, 2, 1, 4, 32)
    assert s.pages_used == 2 + 6 and s.iterations == 1 and s.preemptions == 0
    assert s.kv_usage_ratio == pytest.approx(8 / 32)
    by_task = {q.id_task: q for q in s.sequences}
    assert set(by_task) == {a, b}
    qa, qb = by_task[a], by_task[b]
    assert (qa.id, qa.is_processing, qa.n_ctx, qa.n_prompt, qa.n_decoded, qa.n_remain, qa.prefilling) == \
        (0, True, 64, 6, 2, 3, False)
    assert (qb.id, qb.n_prompt, qb.n_decoded, qb.n_remain, qb.prefilling) == (1, 20, 0, -1, True)
    assert qa.params.max_tokens == 5
    sched.cancel(b)
    sched.cancel(a)
    s = sched.stats()
    assert s.running == 0 and s.waiting == 1 and s.pages_used == 0
    assert [q.is_processing for q in s.sequences] == [False, False]
    assert all(q.id_task == -1 for q in s.sequences)
    drain(sched)
    assert c is not None and sched.stats().waiting == 0


def test_a_pool_smaller_than_one_context_is_refused():
    with pytest.raises(ValueError, match="one sequence of the whole context"):
        make(n_pages=15, page_size=4, n_ctx=64)


# --- on the tiny random model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("sched") / "tiny.gguf", "llama", n_layer=2, scale=0.3)


@pytest.fixture(scope="module")
def engine(tiny_path):
    """A pool just above one context (16 pages of 16 for n_ctx 256): four short requests fit in it at
    once, three long ones must take turns. One engine for every test here: its programs compile once."""
    from model.engine import Engine
    from model.kvcache import page_bytes
    from model.weights import load_weights

    per_page = page_bytes(load_weights(tiny_path, verified=True)[0], 16)
    engine = Engine.load(tiny_path, verified=True, n_ctx=256, max_seqs=4, warmup=False,
                         kv_cache_bytes=16 * per_page + per_page // 2)
    assert engine.stats().pages_total == 16
    return engine


def _run_together(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Every request added at once, iterated to the end; each one's tokens."""
    tasks = [engine.add(GenerateRequest(p, params, f"r{i}")) for i, (p, params) in enumerate(requests)]
    got: dict[int, list[int]] = {t: [] for t in tasks}
    done: set[int] = set()
    for _ in range(10_000):
        if not engine.has_work():
            break
        for task, out in engine.iterate().outputs:
            got[task].append(out.token)
            if out.finish_reason is not None:
                done.add(task)
    assert done == set(tasks)
    return [got[t] for t in tasks]


def _alone(engine, p: list[int], params: SamplingParams) -> list[int]:
    return [o.token for o in engine.generate(p, params)]


def test_greedy_tokens_are_the_same_alone_and_batched(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, cache_prompt=False)
    prompts = [prompt(n, seed=60 + n) for n in (5, 17, 33, 48)]
    alone = [_alone(engine, p, greedy) for p in prompts]
    before = engine.stats().preemptions
    assert _run_together(engine, [(p, greedy) for p in prompts]) == alone
    s = engine.stats()
    assert s.preemptions == before and s.pages_used == 0  # all four fitted at once


def test_a_seeded_request_draws_the_same_tokens_among_others(engine):
    seeded = SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=11, max_tokens=16)
    p = prompt(21, seed=70)
    alone = _alone(engine, p, seeded)
    others = [(prompt(9 + i, seed=71 + i), SamplingParams(temperature=0.9, seed=i, max_tokens=10 + 3 * i))
              for i in range(3)]
    together = _run_together(engine, [others[0], (p, seeded), *others[1:]])
    assert together[1] == alone
    assert _run_together(engine, [(p, seeded)]) == [alone]


def test_a_pool_of_one_context_serves_long_generations_through_preemption(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=70)
    seeded = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, max_tokens=70)
    # each grows to about 100 tokens (7 pages): three need 21 of the 16
    requests = [(prompt(30, seed=80), greedy), (prompt(40, seed=81), seeded), (prompt(25, seed=82), greedy)]
    alone = [_alone(engine, p, params) for p, params in requests]
    before = engine.stats().preemptions
    together = _run_together(engine, requests)
    assert engine.stats().preemptions > before
    assert together == alone
    s = engine.stats()
    assert s.pages_used == 0 and s.running == 0 and s.waiting == 0


def test_a_prompt_waits_for_the_shared_prefix_another_sequence_is_computing():
    # two clients send one long system prompt at once: the second is admitted once the first has
    # computed the shared pages, and takes them from the cache instead of computing them beside it
    sched, runner = make(page_size=4, budget=8)
    system = prompt(24, seed=3)
    first = add(sched, system + prompt(5, seed=4))
    second = add(sched, system + prompt(6, seed=5))
    other = prompt(9, seed=6)
    outs, its = drain(sched)
    assert tokens(outs[first]) == reference(system + prompt(5, seed=4), 8)
    assert tokens(outs[second]) == reference(system + prompt(6, seed=5), 8)
    assert outs[second][-1].cached_tokens == 24
    admitted = [t for it in its for t, _ in it.admitted]
    assert admitted == [first, second]
    second_prefills = [(start, n) for task, start, n in runner.prefills if task == second]
    assert second_prefills[0][0] == 24  # it computed nothing of the system prompt
    assert sched.running == [] and sched.pool.used == 0
    # an unrelated prompt is not held back by a prefix it does not share
    sched, runner = make(page_size=4, budget=8)
    a = add(sched, system)
    b = add(sched, other)
    it = sched.iterate()
    assert [t for t, _ in it.admitted] == [a, b]


def test_a_prompt_does_not_wait_without_cache_prompt():
    sched, runner = make(page_size=4, budget=8)
    system = prompt(24, seed=3)
    a = add(sched, system + [1])
    b = add(sched, system + [2], cache_prompt=False)
    it = sched.iterate()
    assert [t for t, _ in it.admitted] == [a, b]
