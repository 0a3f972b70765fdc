"""Lookahead in the scheduler (model/scheduler.py): the next decode step dispatched before this one's
tokens are read, over the pure-Python runner of tests/scheduler_fakes.py. Every request gets what it
gets without lookahead, whatever its ending, with preemption, cancels and arrivals; a step ahead of a
sequence that ended is never cached; none runs for a sequence that needs its tokens on the host."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_fakes import accounted, add, collect, drain, make, prompt, reference, tokens

from model.messages import FinishReason

# --- lookahead: the next step dispatched before this one's tokens are read ------------------------------


def _mixed_requests(n: int, seed: int) -> list[tuple[list[int], dict]]:
    """Prompts of different lengths ending in different ways: max_tokens, an end-of-generation token
    some steps in, a stop string (every piece is "t"), the context's end."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = prompt(int(rng.integers(1, 14)), seed=1000 * seed + i)
        kind = i % 4
        if kind == 0:
            out.append((p, dict(max_tokens=int(rng.integers(1, 12)))))
        elif kind == 1:
            out.append((p, dict(max_tokens=16, eog_ids={reference(p, 12)[int(rng.integers(0, 10))]})))
        elif kind == 2:
            out.append((p, dict(max_tokens=20, stop=("t" * int(rng.integers(1, 6)),))))
        else:
            out.append((p, dict(max_tokens=-1)))  # the context's end
    return out


def _serve(requests, *, lookahead: bool, arrivals: dict[int, list] | None = None, cancels: dict[int, int] | None = None,
           **kw):
    """Every request added at once (then `arrivals[i]` added and request `cancels[i]` cancelled before
    iteration i), iterated to the end: each one's outputs in the order added, the scheduler, the runner."""
    sched, runner = make(lookahead=lookahead, **kw)
    tasks = [add(sched, p, **r) for p, r in requests]
    outs: dict[int, list] = {}
    for i in range(2000):
        for p, r in (arrivals or {}).get(i, []):
            tasks.append(add(sched, p, **r))
        if i in (cancels or {}):
            final = sched.cancel(tasks[cancels[i]])
            if final is not None:
                outs.setdefault(tasks[cancels[i]], []).append(final)
        if not sched.has_work() and i > max(arrivals or [0]):
            break
        collect(sched.iterate(), outs)
        accounted(sched)
    assert not sched.has_work() and sched.pool.used == 0
    return [outs[t] for t in tasks], sched, runner


@pytest.mark.parametrize(("n_pages", "seed"), [(64, 66), (14, 17)])
def test_lookahead_gives_every_request_what_it_gets_without(n_pages, seed):
    """Twelve requests on four sequences, each ending its own way, in a roomy pool and in one so small
    that they preempt each other: the same outputs (tokens, text, finish reasons, usage) with and
    without lookahead, though steps ran ahead, most used and some thrown away for a sequence that ended."""
    for other in range(seed + 1, seed + 6):  # more mixes, the outputs only
        requests = _mixed_requests(12, seed=other)
        assert (_serve(requests, lookahead=True, n_pages=n_pages, n_ctx=40)[0]
                == _serve(requests, lookahead=False, n_pages=n_pages, n_ctx=40)[0])
    requests = _mixed_requests(12, seed=seed)
    plain, sched, _ = _serve(requests, lookahead=False, n_pages=n_pages, n_ctx=40)
    ahead, sched_ahead, runner = _serve(requests, lookahead=True, n_pages=n_pages, n_ctx=40)
    assert ahead == plain
    assert {o[-1].finish_reason for o in plain} == {FinishReason.LENGTH, FinishReason.STOP}
    assert sched.lookahead_steps == 0 and len(runner.aheads) == sched_ahead.lookahead_steps
    assert sched_ahead.lookahead_steps > 10 and 0 < sched_ahead.lookahead_dropped < sched_ahead.lookahead_steps
    if n_pages == 14:
        assert sched.preemptions > 0 and sched_ahead.preemptions == sched.preemptions


def test_a_step_ahead_of_a_finished_sequence_is_never_cached():
    """A sequence ends at an end-of-generation token while its step ahead computes that token's cell,
    the last of a page: the page is not offered to the prefix cache. A later prompt holding that very
    token there reuses only the pages before it, as without lookahead."""
    p = prompt(6, seed=40)
    ref = reference(p, 20)
    at = next(i for i in range(1, 20) if (len(p) + i) % 4 == 3 and ref[i] not in ref[:i])  # token i: cell 4k+3
    first = [(p, dict(max_tokens=20, eog_ids={ref[at]}))]
    again = {3 + at: [(p + ref[:at + 1] + [1, 2], dict(max_tokens=2))]}
    plain, _, _ = _serve(first, lookahead=False, arrivals=again, n_ctx=64)
    ahead, sched, _ = _serve(first, lookahead=True, arrivals=again, n_ctx=64)
    assert ahead == plain and sched.lookahead_dropped >= 1
    assert plain[0][-1].finish_reason is FinishReason.STOP and len(plain[0]) == at + 1
    assert ahead[1][-1].cached_tokens == (len(p) + at) // 4 * 4  # not the page the end token completes


def test_lookahead_survives_cancels_and_arrivals():
    """A running request cancelled while its step ahead is in flight, then requests that arrive while
    steps run ahead: every request's outputs are what they are without lookahead (the step in flight is
    read first, its cancelled row's token dropped; the arrivals share no prefix with anything)."""
    requests = [(prompt(5, seed=60), dict(max_tokens=-1)), (prompt(9, seed=61), dict(max_tokens=30)),
                (prompt(3, seed=62), dict(max_tokens=25, stop=("tttttttttt",)))]
    arrivals = {9: _mixed_requests(3, seed=5), 14: _mixed_requests(2, seed=6)}
    plain, _, _ = _serve(requests, lookahead=False, arrivals=arrivals, cancels={6: 0}, n_ctx=40)
    ahead, sched, _ = _serve(requests, lookahead=True, arrivals=arrivals, cancels={6: 0}, n_ctx=40)
    assert ahead == plain and sched.lookahead_steps > 10
    # the first iteration samples two tokens (the prompt's and a decode step's), then one each: 7, the abort
    assert plain[0][-1].finish_reason is FinishReason.ABORT and len(plain[0]) == 8
    assert {o[-1].finish_reason for o in plain[1:]} <= {FinishReason.LENGTH, FinishReason.STOP}


def test_a_cancel_while_a_step_is_ahead_frees_everything_at_once():
    sched, runner = make(lookahead=True)
    a, b = add(sched, prompt(5, seed=63), max_tokens=20), add(sched, prompt(6, seed=64), max_tokens=20)
    while sched._ahead is None:
        sched.iterate()
    assert sched.cancel(a).finish_reason is FinishReason.ABORT
    accounted(sched)
    outs, _ = drain(sched)
    assert a not in outs and tokens(outs[b])[-1] == reference(prompt(6, seed=64), 20)[-1]
    assert sched.pool.used == 0


def test_no_step_ahead_for_a_sequence_that_needs_its_tokens_on_the_host():
    sched, runner = make(lookahead=True)
    a = add(sched, prompt(5, seed=50), max_tokens=10)
    runner.dry.add(a)
    outs, _ = drain(sched)
    assert tokens(outs[a]) == reference(prompt(5, seed=50), 10) and runner.aheads == []
