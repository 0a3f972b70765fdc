"""The decode loop that stays on the device (model/runner.py, model/steps.py, model/scheduler.py), on the
tiny random llama: DRY's bias only for the rows that use DRY, each step's input token read on the
device, and lookahead (the next step dispatched before this one's tokens are read) changing nothing a
client sees, in a pool so small that long answers preempt each other."""

from __future__ import annotations

import numpy as np
import pytest
from test_dry import _repeating_prompt
from tiny_gguf import write_tiny_gguf

import model.runner
from model.engine import Engine
from model.messages import GenerateRequest, SamplingParams

DRY = dict(dry_multiplier=1000.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Two sequences over a pool of one context (16 pages of 16 for n_ctx 256), lookahead off."""
    from model.kvcache import page_bytes
    from model.weights import load_weights

    path = write_tiny_gguf(tmp_path_factory.mktemp("loop") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    per_page = page_bytes(load_weights(path, verified=True)[0], 16)
    engine = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False, lookahead=False,
                         kv_cache_bytes=16 * per_page)
    assert engine.stats().pages_total == 16 and not engine.scheduler.lookahead
    return engine


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _outputs(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Every request added at once, iterated to the end: each one's StepOutputs, in the order added."""
    tasks = [engine.add(GenerateRequest(p, params, f"r{i}")) for i, (p, params) in enumerate(requests)]
    got: dict[int, list] = {t: [] for t in tasks}
    while engine.has_work():
        for task, out in engine.iterate().outputs:
            got[task].append(out)
    assert engine.stats().pages_used == 0
    return [got[t] for t in tasks]


def _together(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    return [[o.token for o in outs] for outs in _outputs(engine, requests)]


def _alone(engine: Engine, p: list[int], params: SamplingParams) -> list[int]:
    return [o.token for o in engine.generate(p, params)]


def test_only_the_rows_that_use_dry_send_a_bias(engine, monkeypatch):
    """A batch of a DRY row and a plain one: the host sends one [1, V] row and its index (the select
    compiled for one DRY row), and each request gets the tokens it gets alone; a plain batch sends none."""
    repeat, _ = _repeating_prompt(engine)  # its greedy next token extends a repeat: DRY moves it
    dry = SamplingParams(temperature=0.0, max_tokens=8, **DRY)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    assert _alone(engine, repeat, dry) != _alone(engine, repeat, plain)  # DRY acts on this prompt
    sent: list[tuple[int, tuple | None]] = []
    bias = model.runner.host_bias

    def spy(seqs, rows, *rest):
        out = bias(seqs, rows, *rest)  # (pre, post, at) or None (model/host_bias.py)
        sent.append((rows, None if out is None else (out[1].shape, tuple(out[2].tolist()))))
        return out

    monkeypatch.setattr(model.runner, "host_bias", spy)
    alone = [_alone(engine, repeat, dry), _alone(engine, _prompt(11, seed=2), plain)]
    assert set(sent) == {(1, ((1, engine.config.n_vocab), (0,))), (1, None)}
    sent.clear()
    assert _together(engine, [(repeat, dry), (_prompt(11, seed=2), plain)]) == alone
    assert (2, ((1, engine.config.n_vocab), (0,))) in sent  # the batch of both: row 0's bias alone
    assert all(shape[0] == 1 for _, (shape, _) in [s for s in sent if s[1] is not None])
    sent.clear()
    _together(engine, [(_prompt(7, seed=3), plain), (_prompt(9, seed=4), plain)])
    assert sent and all(out is None for _, out in sent)
    assert {k for k in engine.compiled.ready if k[0] == "select"} == {("select", 1, 0), ("select", 1, 1),
                                                                    ("select", 2, 0), ("select", 2, 1)}


def test_a_dry_row_after_padding_rows_gets_its_own_bias(engine):
    """The DRY row second in the batch: its bias lands on row 1, not row 0."""
    repeat, _ = _repeating_prompt(engine)
    dry = SamplingParams(temperature=0.0, max_tokens=6, **DRY)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    want = [_alone(engine, repeat, plain), _alone(engine, repeat, dry)]
    assert want[0] != want[1]
    assert _together(engine, [(repeat, plain), (repeat, dry)]) == want


def test_the_decode_input_is_the_devices_token_not_the_hosts(engine):
    """The host's copy of each sequence's last token is made wrong before every iteration: the answers do
    not change, because a decode step reads its token where the last select wrote it, on the device."""
    params = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.9, seed=4, max_tokens=12)]
    prompts = [_prompt(20, seed=6), _prompt(35, seed=7)]
    want = [_alone(engine, p, s) for p, s in zip(prompts, params, strict=True)]
    tasks = [engine.add(GenerateRequest(p, s, f"r{i}")) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
    got: dict[int, list[int]] = {t: [] for t in tasks}
    lied = 0
    while engine.has_work():
        for seq in engine.scheduler.running:
            if seq.next_token is not None:
                seq.next_token = (seq.next_token + 1) % engine.config.n_vocab
                lied += 1
        for task, out in engine.iterate().outputs:
            got[task].append(out.token)
    assert lied > 10 and [got[t] for t in tasks] == want


def _both_ways(engine: Engine, requests) -> tuple[list, list, int]:
    """The outputs without and with lookahead, each from an empty prefix cache, and how many steps ran
    ahead."""
    engine.scheduler.pool.clear()
    plain = _outputs(engine, requests)
    before = engine.scheduler.lookahead_steps
    engine.scheduler.lookahead = True
    engine.scheduler.pool.clear()
    try:
        ahead = _outputs(engine, requests)
    finally:
        engine.scheduler.lookahead = False
    return plain, ahead, engine.scheduler.lookahead_steps - before


def test_lookahead_changes_no_output(engine):
    """Requests of different lengths on two sequences, ending by max_tokens, a stop string, the context's
    end; greedy, seeded, penalised, with logprobs, one with DRY (no step ahead while it runs): every
    output the same with lookahead -- tokens, text, logprobs, finish reasons, usage."""
    probe = [o.text for o in _outputs(engine, [(_prompt(14, seed=20), SamplingParams(temperature=0.0,
                                                                                       max_tokens=8))])[0]]
    stop = next(t for t in probe[2:] if t.isascii() and t.strip())
    requests = [
        (_prompt(14, seed=20), SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))),
        (_prompt(30, seed=21), SamplingParams(temperature=0.9, seed=7, max_tokens=17, n_probs=3)),
        (_prompt(9, seed=22), SamplingParams(temperature=0.0, max_tokens=5, presence_penalty=0.5, n_probs=1)),
        (_prompt(240, seed=23), SamplingParams(temperature=1.1, seed=8, top_k=0, top_p=0.8, max_tokens=-1)),
        (_prompt(12, seed=24), SamplingParams(temperature=0.7, seed=9, max_tokens=9, **DRY)),
        (_prompt(20, seed=25), SamplingParams(temperature=0.0, max_tokens=21, min_p=0.1, n_probs=2)),
    ]
    plain, ahead, n_ahead = _both_ways(engine, requests)
    assert ahead == plain
    assert plain[0][-1].finish_reason.value == "stop" and plain[1][-1].finish_reason.value == "length"
    assert plain[3][-1].completion_tokens <= 16 and plain[1][0].logprobs is not None  # 240 + 16: the context
    assert n_ahead > 10


def test_lookahead_changes_no_output_when_sequences_preempt_each_other(engine):
    """Two answers that outgrow the pool together: they preempt each other, with or without lookahead,
    and end with the same outputs."""
    requests = [(_prompt(40, seed=30), SamplingParams(temperature=0.0, max_tokens=110)),
                (_prompt(35, seed=31), SamplingParams(temperature=1.0, seed=3, max_tokens=120, n_probs=2))]
    before = engine.stats().preemptions
    eog, engine.eog_ids = engine.eog_ids, frozenset()  # no early end: they must outgrow the pool
    try:
        plain, ahead, n_ahead = _both_ways(engine, requests)
    finally:
        engine.eog_ids = eog
    assert ahead == plain and n_ahead > 50
    assert [len(o) for o in plain] == [110, 120]
    preempted = engine.stats().preemptions - before
    assert preempted >= 2 and preempted % 2 == 0  # as many times each way


def test_the_gpu_configuration_runs_here_and_changes_no_output(engine):
    """A GPU's engine -- the sampler without branches, lookahead on -- on this CPU: the outputs of the
    CPU's configuration, for a batch that takes most of the sampler's branches."""
    requests = [(_prompt(18, seed=40), SamplingParams(temperature=0.0, max_tokens=10, n_probs=2)),
                (_prompt(26, seed=41), SamplingParams(temperature=0.8, seed=2, max_tokens=12, top_k=0, typical_p=0.9)),
                (_prompt(7, seed=42), SamplingParams(temperature=1.0, seed=3, max_tokens=8, top_n_sigma=1.5,
                                                     repeat_penalty=1.2))]
    engine.scheduler.pool.clear()
    plain = _outputs(engine, requests)
    selects = [k for k in engine.compiled.ready if k[0] == "select"]
    engine.compiled.branchless, engine.scheduler.lookahead = True, True
    before = engine.scheduler.lookahead_steps
    for key in selects:  # the samplers compile again, without branches
        del engine.compiled.ready[key]
    try:
        engine.scheduler.pool.clear()
        gpu = _outputs(engine, requests)
    finally:
        engine.compiled.branchless, engine.scheduler.lookahead = False, False
        for key in selects:
            engine.compiled.ready.pop(key, None)
    assert gpu == plain
    assert engine.scheduler.lookahead_steps > before + 3, (engine.scheduler.lookahead_steps, before)
