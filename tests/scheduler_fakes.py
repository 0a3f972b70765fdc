"""The scheduler's test double (tests/test_scheduler.py, test_scheduler_lookahead.py, test_speculative.py,
test_wedge_and_shutdown.py): a pure-Python runner (no jax) that keeps every page's cells as the tokens
written there and samples each next token from what it reads back through the block table, so a page
handed to the wrong sequence, written after it was shared, or lost in a preemption changes the answer;
and the helpers that drive a Scheduler over it."""

from __future__ import annotations

import numpy as np

from model.completion import Completion
from model.messages import GenerateRequest, SamplingParams
from model.pages import PagePool
from model.scheduler import Scheduler

VOCAB = 97


class Vocab:
    def token_to_piece(self, token: int, special: bool) -> bytes:
        return b"t"

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [0] * len(text)


class FakeRunner:
    """The device side as a dict: cells[page][cell] is the token whose K/V that cell holds, and each
    slot's token history as the device's, where a decode step finds its input token (a step ahead
    reads the token its predecessor sampled before the host has seen it)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.cells: dict[int, list[int | None]] = {}
        self.history: dict[int, list[int]] = {}  # slot -> its tokens, as the device holds them
        self.prefills: list[tuple[int, int, int]] = []  # (task, from, n)
        self.decodes: list[list[int]] = []  # the tasks of each decode step
        self.aheads: list[list[int]] = []  # the tasks of each step dispatched ahead
        self.started: list[tuple[int, int]] = []  # (task, slot)
        self.dry: set[int] = set()  # tasks that need their tokens on the host

    def start_sequence(self, seq) -> None:
        self.started.append((seq.task, seq.slot))
        self.history[seq.slot] = list(seq.tokens)

    def _write(self, seq, pos: int, token: int) -> None:
        page = seq.pages[pos // self.pool.page_size]
        assert self.pool._key[page] is None, f"page {page} is shared (keyed) and must never be written again"
        self.cells.setdefault(page, [None] * self.pool.page_size)[pos % self.pool.page_size] = token

    def _read(self, seq, n: int) -> tuple[int, ...]:
        """The tokens of cells 0..n-1 as the block table finds them."""
        p = self.pool.page_size
        return tuple(self.cells[seq.pages[i // p]][i % p] for i in range(n))

    def prefill(self, seq, n: int):
        self.prefills.append((seq.task, seq.n_computed, n))
        for pos in range(seq.n_computed, seq.n_computed + n):
            self._write(seq, pos, seq.tokens[pos])
        return [self._read(seq, seq.n_computed + n)]

    def decode(self, seqs):
        self.decodes.append([s.task for s in seqs])
        for s in seqs:
            self._write(s, s.n_computed, self.history[s.slot][s.n_computed])
        return [self._read(s, s.n_computed + 1) for s in seqs]

    def sample_async(self, seqs, logits, ahead: int = 0):
        if ahead:
            self.aheads.append([s.task for s in seqs])
        out = []
        for seq, seen in zip(seqs, logits, strict=True):
            known = seq.tokens + self.history[seq.slot][len(seq.tokens):len(seq.tokens) + ahead]
            assert list(seen) == known[:len(seen)], "the KV read through the block table is not the sequence's"
            token = next_token(seen)
            row = self.history[seq.slot]
            del row[len(seq.tokens) + ahead:]
            row.append(token)
            out.append((token, None, []))
        return out

    def read(self, seqs, sampled):
        return sampled

    def sample(self, seqs, logits):
        return self.read(seqs, self.sample_async(seqs, logits))

    def needs_host(self, seqs) -> bool:
        return any(s.task in self.dry for s in seqs)


def next_token(seen) -> int:
    """A deterministic 'model': the next token from every token before it."""
    return (sum((i + 1) * t for i, t in enumerate(seen)) * 31 + len(seen)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def make(*, n_pages: int = 64, page_size: int = 4, max_seqs: int = 4, n_ctx: int = 64, budget: int = 64,
         lookahead: bool = False):
    pool = PagePool(n_pages, page_size)
    runner = FakeRunner(pool)
    return Scheduler(runner, pool, max_seqs=max_seqs, n_ctx=n_ctx, prefill_budget=budget,
                     lookahead=lookahead), runner


def add(sched: Scheduler, prompt: list[int], max_tokens: int = 8, eog_ids=(), **kw) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    completion = Completion(Vocab(), params, n_prompt=len(prompt), n_ctx=sched.n_ctx, eog_ids=eog_ids)
    return sched.add(GenerateRequest(list(prompt), params, f"r{len(prompt)}"), 0, completion)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


def accounted(sched: Scheduler) -> None:
    pool = sched.pool
    assert pool.used + pool.available() == pool.n_pages
    held = [p for s in sched.running for p in s.pages]
    assert pool.used == len(set(held))
    assert sorted(s.slot for s in sched.running) == sorted(set(s.slot for s in sched.running))
    assert all(0 <= s.slot < sched.max_seqs for s in sched.running)
    assert all(not s.pages for s in sched.waiting)


def drain(sched: Scheduler, limit: int = 1000, outs: dict[int, list] | None = None) -> tuple[dict[int, list], list]:
    """Iterate until nothing is left; every output by task (added to `outs`), and each iteration."""
    outs = {} if outs is None else outs
    its = []
    for _ in range(limit):
        if not sched.has_work():
            return outs, its
        it = sched.iterate()
        its.append(it)
        collect(it, outs)
        accounted(sched)
    raise AssertionError(f"still working after {limit} iterations: a deadlock")


def collect(it, outs: dict[int, list]) -> dict[int, list]:
    for task, out in it.outputs:
        outs.setdefault(task, []).append(out)
    return outs


def tokens(outs) -> list[int]:
    return [o.token for o in outs]
