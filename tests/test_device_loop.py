"""The decode loop that stays on the device (model/engine.py, model/steps.py), on the tiny random llama:
DRY's bias only for the rows that use DRY, and each step's input token read on the device."""

from __future__ import annotations

import numpy as np
import pytest
from test_dry import _repeating_prompt
from tiny_gguf import write_tiny_gguf

from model.engine import Engine
from model.messages import GenerateRequest, SamplingParams

DRY = dict(dry_multiplier=1000.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("loop") / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    return Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _together(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    tasks = [engine.add(GenerateRequest(p, params, f"r{i}")) for i, (p, params) in enumerate(requests)]
    got: dict[int, list[int]] = {t: [] for t in tasks}
    while engine.has_work():
        for task, out in engine.iterate().outputs:
            got[task].append(out.token)
    return [got[t] for t in tasks]


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
    bias = engine._dry_bias

    def spy(seqs, rows):
        out = bias(seqs, rows)
        sent.append((rows, None if out is None else (out[0].shape, tuple(out[1].tolist()))))
        return out

    monkeypatch.setattr(engine, "_dry_bias", spy)
    alone = [_alone(engine, repeat, dry), _alone(engine, _prompt(11, seed=2), plain)]
    assert set(sent) == {(1, ((1, engine.config.n_vocab), (0,))), (1, None)}
    sent.clear()
    assert _together(engine, [(repeat, dry), (_prompt(11, seed=2), plain)]) == alone
    assert (2, ((1, engine.config.n_vocab), (0,))) in sent  # the batch of both: row 0's bias alone
    assert all(shape[0] == 1 for _, (shape, _) in [s for s in sent if s[1] is not None])
    sent.clear()
    _together(engine, [(_prompt(7, seed=3), plain), (_prompt(9, seed=4), plain)])
    assert sent and all(out is None for _, out in sent)
    assert {k for k in engine._compiled if k[0] == "select"} == {("select", 1, 0), ("select", 1, 1),
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
