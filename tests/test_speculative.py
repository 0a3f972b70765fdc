"""Speculative decoding (model/speculative.py, model/scheduler.py's verify steps), in three layers.

First the drafts themselves (the n-gram index, the limits). Then the scheduler over a pure-Python
runner whose "model" falls into cycles, so n-gram drafts are often right and sometimes wrong: every
request ends with the tokens it gets without speculation, the K/V read through the block table is
always the sequence's own (a rejected draft's cells are written over), pages are accounted, stops
and limits cut a kept draft. Then the device programs on the tiny random llama: greedy and seeded
tokens identical with and without speculation over many prompts, batched and alone, logprobs the
target's, a grammar row beside drafting rows, and the sampled distribution at a verified position
against the target's own probabilities (a chi-square test).
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
from scheduler_fakes import VOCAB, Vocab, accounted, drain, tokens
from tiny_gguf import write_tiny_gguf

from model import constraint as mc
from model.completion import Completion
from model.engine import Engine
from model.messages import FinishReason, GenerateRequest, SamplingParams
from model.pages import PagePool
from model.scheduler import Scheduler
from model.speculative import (
    DraftCosts,
    NgramIndex,
    Speculation,
    acceptance,
    expected_kept,
    spec_type_refusal,
)

# --- drafts -----------------------------------------------------------------------------------------


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_last_n_tokens():
    index = NgramIndex(2)
    seq = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    assert index.draft(seq, 3) == [5, 6, 1]  # [1, 2] last seen before the end at 4..5: then 5, 6, 1
    assert index.draft(seq + [7], 3) == []  # [2, 7] never seen before
    assert index.draft(seq + [7, 1, 2], 8) == [7, 1, 2]  # the latest occurrence wins, cut at the end
    assert NgramIndex(3).draft([1, 2], 4) == []  # shorter than the key
    assert NgramIndex(1).draft([5, 5, 5], 0) == []


def test_the_index_grows_with_the_sequence_and_never_matches_itself():
    index = NgramIndex(3)
    seq: list[int] = []
    rng = np.random.default_rng(0)
    for _ in range(200):
        seq.append(int(rng.integers(0, 5)))
        got = index.draft(seq, 4)
        key = seq[-3:]
        ends = [e for e in range(3, len(seq)) if seq[e - 3:e] == key] if len(seq) >= 3 else []
        assert got == (seq[ends[-1]:ends[-1] + 4] if ends else [])


def test_limits_and_buckets():
    spec = Speculation("ngram-simple", draft_max=16, draft_min=2)
    assert spec.verify_buckets() == [4, 8, 17]  # 1 + draft_max: a draft as long as allowed fits exactly
    assert Speculation("ngram-simple", draft_max=3).verify_buckets() == [4]
    assert Speculation("ngram-simple", draft_max=7).verify_buckets() == [4, 8]
    assert Speculation("ngram-simple", draft_max=1).verify_buckets() == [2]
    assert Speculation().verify_buckets() == [] and not Speculation().on
    assert spec.limits(-1, -1) == (16, 2)  # the server's
    assert spec.limits(40, 1) == (16, 1)  # never past --draft-max: it sizes the programs
    assert spec.limits(3, 9) == (3, 3)  # n_min <= n_max
    assert spec.limits(0, -1) == (0, 0)  # off for this request
    assert Speculation("ngram-simple", draft_max=63).verify_buckets()[-1] == 64
    with pytest.raises(ValueError, match="at most 63"):
        Speculation("ngram-simple", draft_max=64)


def test_a_draft_is_cut_to_the_room_and_the_limits_and_dropped_below_n_min():
    spec = Speculation("ngram-simple", ngram_n=2, ngram_m=5, draft_max=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # [1, 2] was followed by 3..8

    def draft(room, n_max=-1, n_min=-1):
        return spec.draft(NgramIndex(2), tokens, room, n_max, n_min)

    assert draft(10) == [3, 4, 5, 6]  # --draft-max
    assert draft(2) == [3, 4]  # the room left
    assert draft(10, n_max=3) == [3, 4, 5] and draft(0) == [] and draft(10, n_max=0) == []
    assert draft(2, n_min=3) == [] and draft(3, n_min=3) == [3, 4, 5]  # shorter than n_min: none
    assert Speculation("ngram-simple", ngram_n=2, ngram_m=2).draft(NgramIndex(2), tokens, 10, -1, -1) == [3, 4]


def test_a_verify_step_is_chosen_when_it_yields_more_tokens_per_decode_steps_cost():
    assert expected_kept(0.5, 3) == 0.5 + 0.25 + 0.125 and expected_kept(1.0, 5) == 5
    assert acceptance(0, 0) == 0.5 and acceptance(9, 1) == 10 / 12
    costs, buckets = DraftCosts(), [4, 8, 17]
    sixteen = [[7] * 16]
    assert costs.choose(sixteen, [0.5], buckets) == 17  # nothing measured yet: tried as if it cost a decode step
    costs.record_decode(1, 0.030)
    for t, seconds in ((4, 0.048), (8, 0.070), (17, 0.124)):  # SmolLM2 on 2 vCPUs (bench/speculative.py)
        costs.record_verify(t, 1, seconds)
    assert costs.choose(sixteen, [0.5], buckets) == 4  # 1.875 tokens for 1.6 steps beats 2 for 4.1
    assert costs.choose(sixteen, [0.3], buckets) is None  # 1.4 tokens for 1.6 steps: decoding yields more
    assert costs.choose(sixteen, [0.97], buckets) == 17  # a draft kept through: the long step pays
    assert costs.choose([[7, 7]], [0.97], buckets) == 4  # no bucket larger than the drafts need
    costs.record_verify(4, 1, 0.078)  # measurements move the estimate (EMA 0.2): 0.048 -> 0.054
    assert abs(costs.verify_s[(4, 1)] - 0.054) < 1e-9
    # four rows, one drafting: the whole batch pays for its verify step
    costs.record_decode(4, 0.054)
    costs.record_verify(4, 4, 0.111)
    assert costs.choose([[7] * 3, [], [], []], [0.9, 0.5, 0.5, 0.5], [4]) is None
    assert costs.choose([[7] * 3] * 4, [0.9] * 4, [4]) == 4
    assert DraftCosts(fixed_ratio=1.0).choose([[1]], [0.01], buckets) == 4


def test_other_spec_types_are_refused_by_name():
    assert spec_type_refusal("ngram-simple") is None and spec_type_refusal("none") is None
    assert "ngram-map-k" in spec_type_refusal("ngram-map-k") and "ngram-simple" in spec_type_refusal("ngram-mod")
    assert "one of" in spec_type_refusal("eagle")
    with pytest.raises(ValueError, match="ngram-cache"):
        Speculation("ngram-cache")


# --- the scheduler over a pure-Python runner -----------------------------------------------------------


def model(seen) -> int:
    """A deterministic 'model' that falls into cycles (Fibonacci mod 11), broken now and then, so an
    n-gram draft is often right and sometimes wrong."""
    if len(seen) < 2:
        return 1
    if len(seen) % 23 == 0:
        return (seen[-1] + 13) % VOCAB
    return (seen[-1] + seen[-2]) % 11


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(model(seq))
    return seq[len(prompt):]


class SpecRunner:
    """cells[page][cell]: the token whose K/V that cell holds; each position's next token is the
    model's over the cells read back through the block table, so a wrong page, a rejected draft's
    cell read as if kept, or a lost cell changes the answer."""

    batches = [1, 2, 4, 8]

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.cells: dict[int, list[int | None]] = {}
        self.history: dict[int, list[int]] = {}
        self.verifies: list[list[int]] = []  # each verify step's draft lengths

    def start_sequence(self, seq) -> None:
        self.history[seq.slot] = list(seq.tokens)

    def _write(self, seq, pos: int, token: int) -> None:
        page = seq.pages[pos // self.pool.page_size]
        assert self.pool._key[page] is None, f"page {page} is shared (keyed) and must never be written again"
        self.cells.setdefault(page, [None] * self.pool.page_size)[pos % self.pool.page_size] = token

    def _read(self, seq, n: int) -> list[int]:
        p = self.pool.page_size
        return [self.cells[seq.pages[i // p]][i % p] for i in range(n)]

    def prefill(self, seq, n: int):
        for pos in range(seq.n_computed, seq.n_computed + n):
            self._write(seq, pos, seq.tokens[pos])
        return [self._read(seq, seq.n_computed + n)]

    def decode(self, seqs):
        for s in seqs:
            self._write(s, s.n_computed, s.next_token)
        return [self._read(s, s.n_computed + 1) for s in seqs]

    def sample_async(self, seqs, logits, ahead: int = 0):
        assert not ahead
        out = []
        for seq, seen in zip(seqs, logits, strict=True):
            assert seen == seq.tokens[:len(seen)], "the KV read through the block table is not the sequence's"
            out.append((model(seen), None, []))
        return out

    def read(self, seqs, sampled):
        return sampled

    def sample(self, seqs, logits):
        return self.sample_async(seqs, logits)

    def needs_host(self, seqs) -> bool:
        return False

    def can_verify(self, rows, n_tokens, seqs) -> bool:
        return True

    def verify(self, seqs, drafts, n_tokens):
        self.verifies.append([len(d) for d in drafts])
        out = []
        for seq, draft in zip(seqs, drafts, strict=True):
            assert len(draft) + 1 <= n_tokens
            base = seq.n_computed
            for j, token in enumerate([seq.next_token, *draft]):
                self._write(seq, base + j, token)
            row = []
            for j in range(1 + len(draft)):
                seen = self._read(seq, base + j + 1)
                assert seen[:len(seq.tokens)] == seq.tokens[:len(seen)]
                row.append((model(seen), None, []))
            out.append(row)
        return out

    def read_verify(self, seqs, sampled, drafts):
        return sampled


def make(*, n_pages: int = 64, page_size: int = 4, max_seqs: int = 4, n_ctx: int = 128,
         spec: Speculation | None = None):
    pool = PagePool(n_pages, page_size)
    runner = SpecRunner(pool)
    spec = spec or Speculation("ngram-simple", ngram_n=2, draft_max=6)
    sched = Scheduler(runner, pool, max_seqs=max_seqs, n_ctx=n_ctx, prefill_budget=64, speculation=spec)
    sched.draft_costs = DraftCosts(fixed_ratio=1.0)  # every draft worth a verify: the steps below are the drafts'
    return sched, runner


def add(sched: Scheduler, prompt: list[int], max_tokens: int = 40, eog_ids=(), **kw) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    completion = Completion(Vocab(), params, n_prompt=len(prompt), n_ctx=sched.n_ctx, eog_ids=eog_ids)
    return sched.add(GenerateRequest(list(prompt), params, f"r{len(prompt)}"), 0, completion)


def test_every_sequence_gets_the_tokens_it_gets_without_speculation():
    sched, runner = make()
    prompts = [[3, 5], [1, 2, 3, 4, 5], [7, 7, 7, 7, 2], [9]]
    tasks = [add(sched, p, max_tokens=60) for p in prompts]
    outs, _ = drain(sched)
    for task, p in zip(tasks, prompts, strict=True):
        assert tokens(outs[task]) == reference(p, 60)
        assert [o.completion_tokens for o in outs[task]] == list(range(1, 61))  # each token once, in order
    s = sched.stats()
    assert runner.verifies and s.spec_draft_tokens > s.spec_accepted_tokens > 0  # kept and rejected drafts
    assert s.spec_steps == len(runner.verifies)
    assert sum(outs[t][-1].draft_n for t in tasks) == s.spec_draft_tokens
    assert sum(outs[t][-1].draft_n_accepted for t in tasks) == s.spec_accepted_tokens
    assert sched.pool.used == 0 and not sched.running


def test_a_verify_step_hands_out_several_tokens_per_sequence():
    sched, _ = make(max_seqs=1)
    task = add(sched, [1, 1], max_tokens=80)
    outs, its = drain(sched)
    per_iteration = [sum(1 for t, o in it.outputs if t == task and o.token is not None) for it in its]
    assert max(per_iteration) > 2 and len(its) < 60
    assert tokens(outs[task]) == reference([1, 1], 80)


def test_a_kept_draft_is_cut_by_max_tokens_and_by_an_end_of_generation_token():
    ref = reference([2, 3], 200)
    for max_tokens in (5, 17, 31, 44):
        sched, _ = make()
        task = add(sched, [2, 3], max_tokens=max_tokens)
        outs, _ = drain(sched)
        assert tokens(outs[task]) == ref[:max_tokens]
        assert outs[task][-1].finish_reason is FinishReason.LENGTH
    eog = ref[30]  # a token the cycle repeats: it ends the sequence the first time it comes
    first = ref.index(eog)
    sched, _ = make()
    task = add(sched, [2, 3], max_tokens=200, eog_ids=(eog,))
    outs, _ = drain(sched)
    assert tokens(outs[task]) == ref[:first + 1] and outs[task][-1].finish_reason is FinishReason.STOP
    assert sched.pool.used == 0


def test_drafts_respect_the_request_limits_and_the_free_pages():
    sched, runner = make()
    add(sched, [1, 1], max_tokens=60, spec_n_max=2)
    drain(sched)
    assert runner.verifies and max(max(v) for v in runner.verifies) <= 2
    sched, runner = make()
    add(sched, [1, 1], max_tokens=60, spec_n_max=0)  # off for this request
    drain(sched)
    assert not runner.verifies
    sched, runner = make()
    add(sched, [1, 1], max_tokens=60, spec_n_min=6)  # shorter drafts dropped
    drain(sched)
    assert all(n == 0 or n >= 6 for v in runner.verifies for n in v)
    # a pool of one context: drafts take only free pages, never a preemption, and the answers hold
    sched, runner = make(n_pages=8, page_size=4, n_ctx=32, max_seqs=3)
    tasks = [add(sched, p, max_tokens=20) for p in ([1, 2], [3, 4], [5, 6])]
    outs, _ = drain(sched)
    for task, p in zip(tasks, ([1, 2], [3, 4], [5, 6]), strict=True):
        assert tokens(outs[task]) == reference(p, 20)
    accounted(sched)


def test_kept_pages_reach_the_prefix_cache_and_rejected_cells_never_do():
    sched, _ = make(page_size=4)
    p = [4, 7, 2]
    a = add(sched, p, max_tokens=40)
    first, _ = drain(sched)
    # a second request over the first's prompt and answer reuses its full pages, which must hold
    # exactly those tokens (SpecRunner asserts the cells read through the block table)
    longer = p + tokens(first[a])
    b = add(sched, longer, max_tokens=10)
    outs, _ = drain(sched)
    assert outs[b][-1].cached_tokens >= 4 * ((len(p) + 38) // 4) - 4
    assert tokens(outs[b]) == reference(longer, 10)


def test_drafts_that_do_not_pay_are_not_verified_and_long_ones_are_cut_to_what_pays():
    costs = DraftCosts()
    costs.record_decode(1, 1.0)
    costs.record_verify(4, 1, 1.5)
    costs.record_verify(9, 1, 6.0)  # buckets 4 and 9 (draft_max 8): only a 3-token draft can pay
    spec = Speculation("ngram-simple", ngram_n=2, draft_max=8)
    sched, runner = make(spec=spec)
    sched.draft_costs = costs
    sched.iterate = _untimed(sched)
    task = add(sched, [1, 2, 3, 1, 2], max_tokens=40)
    outs, _ = drain(sched)
    assert tokens(outs[task]) == reference([1, 2, 3, 1, 2], 40)
    assert runner.verifies and max(max(v) for v in runner.verifies) <= 3
    costs.verify_s[(4, 1)] = 1e9  # no bucket pays
    sched, runner = make(spec=spec)
    sched.draft_costs = costs
    sched.iterate = _untimed(sched)
    task = add(sched, [1, 2, 3, 1, 2], max_tokens=40)
    outs, _ = drain(sched)
    assert tokens(outs[task]) == reference([1, 2, 3, 1, 2], 40) and not runner.verifies


def _untimed(sched):
    """The scheduler's iterate without its own step timings (a pure-Python step's time says nothing)."""
    costs, iterate = sched.draft_costs, sched.iterate

    def run():
        saved = dict(costs.decode_s), dict(costs.verify_s)
        try:
            return iterate()
        finally:
            costs.decode_s, costs.verify_s = saved
    return run


def test_without_speculation_no_verify_step_runs():
    pool = PagePool(64, 4)
    runner = SpecRunner(pool)
    sched = Scheduler(runner, pool, max_seqs=2, n_ctx=128, prefill_budget=64, speculation=Speculation())
    task = add(sched, [1, 1], max_tokens=40)
    outs, _ = drain(sched)
    assert tokens(outs[task]) == reference([1, 1], 40) and not runner.verifies


# --- the device programs on the tiny random llama --------------------------------------------------------

SPEC = Speculation("ngram-simple", ngram_n=2, draft_max=3)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    plain = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False)
    spec = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False, speculation=SPEC)
    spec.warmup()  # the verify programs: a step verifies only with its program compiled
    spec.scheduler.draft_costs = DraftCosts(fixed_ratio=1.0)  # every draft verified, whatever the steps cost
    return plain, spec


def test_verify_programs_past_the_smallest_window_compile_when_a_step_first_wants_them(tmp_path):
    """Not at start (they would keep a small CPU busy for minutes), and never on the request path: the
    step that wants one runs as a plain decode while it compiles on its own thread."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    engine = Engine.load(path, verified=True, n_ctx=1024, max_seqs=2, warmup=False, speculation=SPEC)
    table, runner = engine.programs, engine.runner
    on_demand = [k for k in table.keys() if table.on_demand(k)]
    assert on_demand and {k[0][:6] for k in on_demand} == {"verify"}
    assert {k[2] for k in on_demand} == {table.verify_window(w) for w in (512, 1024)}
    background = table.background_order({})
    assert not set(on_demand) & set(background)
    assert {k for k in table.keys() if k[0].startswith("vselect")} <= set(background)  # small: all at start
    seq = SimpleNamespace(n_computed=300, request=SimpleNamespace(params=SamplingParams(), constraint=None))
    wanted = ("verify4", 1, table.verify_window(300))
    assert table.on_demand(wanted) and wanted not in engine.compiled.ready
    assert not runner.can_verify(1, 4, [seq])  # not compiled: a plain step, and it is queued
    deadline = time.monotonic() + 600
    while not runner.can_verify(1, 4, [seq]):
        assert time.monotonic() < deadline, "the queued verify program never compiled"
        time.sleep(0.2)
    assert wanted in engine.compiled.ready and ("vselect4", 1, 0) in engine.compiled.ready
    assert ("verify4", 2, table.verify_window(300)) not in engine.compiled.ready  # only what was wanted


def _prompt(i: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(100 + i).integers(0, 256, 8)]


def _run(engine, requests: list[GenerateRequest]) -> list[list]:
    tasks = [engine.add(r) for r in requests]
    outs: dict[int, list] = {t: [] for t in tasks}
    while engine.has_work():
        for t, out in engine.iterate().outputs:
            if out.token is not None or out.finish_reason is not None:
                outs[t].append(out)
    return [outs[t] for t in tasks]


class OracleDrafts:
    """Drafts that know the answer: the continuation the engine without speculation gave, wrong at
    every seventh position, installed in place of the n-gram index (a random model seldom repeats
    itself, so n-gram drafts alone would mostly test rejection). Long kept drafts, rejections at every
    offset, and the cells after them written over."""

    answers: dict[tuple[int, ...], list[int]] = {}

    def __init__(self, n: int):
        self.n = n

    def draft(self, seq_tokens: list[int], m: int) -> list[int]:
        for prompt, answer in self.answers.items():
            if tuple(seq_tokens[:len(prompt)]) == prompt:
                done = len(seq_tokens) - len(prompt)
                return [t if (done + i) % 7 != 3 else (t + 1) % 256 for i, t in enumerate(answer[done:done + m])]
        return []


@pytest.fixture
def oracle(monkeypatch):
    import model.spec_steps

    OracleDrafts.answers = {}
    monkeypatch.setattr(model.spec_steps, "NgramIndex", OracleDrafts)
    return OracleDrafts.answers


def test_greedy_and_seeded_tokens_are_identical_with_and_without_speculation(engines, oracle):
    plain, spec = engines
    before = spec.stats()
    for i in range(8):
        for params in (SamplingParams(temperature=0.0, max_tokens=60),
                       SamplingParams(temperature=0.7, seed=i, max_tokens=60, n_probs=2)):
            a = list(plain.generate(_prompt(i), params))
            oracle.clear()
            oracle[tuple(_prompt(i))] = [o.token for o in a]
            b = list(spec.generate(_prompt(i), params))
            assert [o.token for o in b] == [o.token for o in a]
            assert [o.finish_reason for o in b] == [o.finish_reason for o in a]
            if params.n_probs:  # the target's logprobs, computed over several positions at once: as a prefill
                # computes them (which differs from one-token steps by about 1e-3 on this model), not equal
                assert all(math.isclose(x.logprob, y.logprob, abs_tol=5e-3) for x, y in zip(a, b, strict=True))
                assert all([t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
                           for x, y in zip(a, b, strict=True))
            assert b[-1].draft_n > b[-1].draft_n_accepted > 0
    s = spec.stats()
    kept, drafted = s.spec_accepted_tokens - before.spec_accepted_tokens, s.spec_draft_tokens - before.spec_draft_tokens
    assert drafted > kept > drafted // 2  # mostly kept, with rejections
    assert s.spec_steps - before.spec_steps < 16 * 60 // 2  # fewer steps than tokens


def test_n_gram_drafts_on_the_real_programs_change_no_token(engines):
    plain, spec = engines
    before = spec.stats()
    for i in range(6):
        prompt = _prompt(i) * 3  # the prompt repeats itself: its ending has earlier occurrences
        for params in (SamplingParams(temperature=0.0, max_tokens=40),
                       SamplingParams(temperature=0.8, seed=i, max_tokens=40)):
            assert [o.token for o in spec.generate(prompt, params)] == [o.token for o in plain.generate(prompt, params)]
    assert spec.stats().spec_drafts > before.spec_drafts


def test_batched_rows_stops_and_a_grammar_row_beside_drafting_rows(engines, oracle):
    plain, spec = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=90)
    seeded = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3, max_tokens=90)
    requests = lambda: [GenerateRequest(_prompt(1), greedy), GenerateRequest(_prompt(2), seeded)]  # noqa: E731
    want = _run(plain, requests())
    oracle.update({tuple(_prompt(1)): [o.token for o in want[0]], tuple(_prompt(2)): [o.token for o in want[1]],
                   tuple(_prompt(3)): [o.token for o in plain.generate(_prompt(3), greedy)]})
    before = spec.stats().spec_accepted_tokens
    got = _run(spec, requests())
    assert spec.stats().spec_accepted_tokens > before
    assert [[o.token for o in r] for r in got] == [[o.token for o in r] for r in want]
    # a stop string taken from inside the answer cuts a kept draft where it begins
    text = plain.tokenizer.decode([o.token for o in want[0]])
    stop = text[40:43]
    params = SamplingParams(temperature=0.0, max_tokens=90, stop=(stop,))
    a, b = list(plain.generate(_prompt(1), params)), list(spec.generate(_prompt(1), params))
    assert [o.token for o in b] == [o.token for o in a] and b[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in b) + b[-1].held_text == "".join(o.text for o in a) + a[-1].held_text
    # a grammar row does not draft; beside a drafting row it gets the tokens it gets alone
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    grammar = mc.json_schema_grammar(json.dumps(schema))

    def constrained():
        c = mc.compile_constraint(grammar, spec.tokenizer, spec.config.n_vocab)
        return GenerateRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40), constraint=c)

    want = _run(plain, [constrained(), GenerateRequest(_prompt(3), greedy)])
    got = _run(spec, [constrained(), GenerateRequest(_prompt(3), greedy)])
    assert [[o.token for o in r] for r in got] == [[o.token for o in r] for r in want]
    json.loads(spec.tokenizer.decode([o.token for o in got[0] if o.token not in spec.eog_ids]))


def _chain_probs(engine, tokens: list[int]) -> dict[int, float]:
    """The chain's distribution at temperature 1, top-k 4 (nothing else on): the softmax of the four
    best logits."""
    logits = np.asarray(engine.logits(tokens)[-1], np.float64)
    top = np.argsort(-logits)[:4]
    p = np.exp(logits[top] - logits[top].max())
    return dict(zip(top.tolist(), (p / p.sum()).tolist(), strict=True))


def _chi2_quantile_999(dof: int) -> float:
    """The 0.999 quantile of chi-square (Wilson-Hilferty)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


class LikelyDrafts:
    """After the first answer token a, the draft is the target's likeliest next token: often kept."""

    prompt: list[int] = []
    after: dict[int, int] = {}

    def __init__(self, n: int):
        pass

    def draft(self, seq_tokens: list[int], m: int) -> list[int]:
        a = seq_tokens[-1]
        return [self.after[a]] if len(seq_tokens) == len(self.prompt) + 1 and a in self.after else []


def test_the_sampled_distribution_with_drafts_is_the_targets(engines, monkeypatch):
    """After the first token a, the draft is the target's likeliest token after it, so the next two
    tokens come from a verify step (the second at a draft position when the first is the draft). The
    joint frequencies of those two, given a, match the target's own probabilities at temperature 1,
    top-k 4 (a chi-square test at the 0.999 level)."""
    import model.spec_steps

    _, spec = engines
    prompt = _prompt(9)
    firsts = _chain_probs(spec, prompt)
    LikelyDrafts.prompt = prompt
    LikelyDrafts.after = {a: max(_chain_probs(spec, prompt + [a]).items(), key=lambda kv: kv[1])[0] for a in firsts}
    monkeypatch.setattr(model.spec_steps, "NgramIndex", LikelyDrafts)
    n = 480
    params = [SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0, seed=s, max_tokens=3) for s in range(n)]
    before = spec.stats()
    runs = _run(spec, [GenerateRequest(prompt, p) for p in params])
    after = spec.stats()
    assert after.spec_drafts - before.spec_drafts == n  # every request verified its draft
    assert after.spec_accepted_tokens - before.spec_accepted_tokens > n // 4
    groups: dict[int, dict[tuple[int, int], int]] = {}
    for outs in runs:
        a, x1, x2 = (o.token for o in outs)
        groups.setdefault(a, {})
        groups[a][(x1, x2)] = groups[a].get((x1, x2), 0) + 1
    chi2, dof = 0.0, 0
    for a, counts in groups.items():
        n_a = sum(counts.values())
        assert abs(n_a - n * firsts[a]) < 5 * math.sqrt(n * firsts[a]) + 5
        expected = {(x1, x2): n_a * p1 * p2 for x1, p1 in _chain_probs(spec, prompt + [a]).items()
                    for x2, p2 in _chain_probs(spec, prompt + [a, x1]).items()}
        assert set(counts) <= set(expected)  # nothing outside the chain's candidates
        big = [k for k, e in expected.items() if e >= 5]
        rest_e = sum(e for k, e in expected.items() if k not in big)
        rest_o = sum(c for k, c in counts.items() if k not in big)
        cells = [(counts.get(k, 0), expected[k]) for k in big] + ([(rest_o, rest_e)] if rest_e >= 5 else [])
        if len(cells) < 2:
            continue
        chi2 += sum((o - e) ** 2 / e for o, e in cells)
        dof += len(cells) - 1
    assert dof >= 3
    assert chi2 < _chi2_quantile_999(dof), (chi2, dof)
