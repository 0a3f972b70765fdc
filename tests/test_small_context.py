"""A context smaller than the smallest attention window (llama-server's tests start it with `-c 256 -np 2`,
`-c 64`): the program table still names only programs within the context, the essential ones included,
and an engine with it starts and answers up to its context."""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_gguf

from model.engine import Engine
from model.messages import FinishReason, SamplingParams
from model.programs import MIN_WINDOW, ProgramTable


@pytest.mark.parametrize("n_ctx", [16, 64, 100, 128, MIN_WINDOW - 1, MIN_WINDOW, 300])
def test_every_program_of_a_small_context_fits_it(n_ctx):
    table = ProgramTable(n_ctx=n_ctx, prefill_chunk=512, page_size=16, max_seqs=2)
    pages = -(-n_ctx // 16)
    essential = table.essential_keys()
    assert essential and set(essential) <= set(table.keys())
    assert all(window <= pages for kind, _, window in table.keys() if kind in ("prefill", "decode"))


def test_a_window_past_the_context_is_an_error_with_a_reason():
    table = ProgramTable(n_ctx=64, prefill_chunk=512, page_size=16, max_seqs=2)
    with pytest.raises(ValueError, match="65 cells exceed the largest window"):
        table.window_pages(65, table.decode_windows)


def test_an_engine_with_a_64_token_context_starts_and_answers_to_its_end(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=2, scale=0.3)
    engine = Engine.load(path, verified=True, n_ctx=64, max_seqs=2, warmup=False)
    engine.warmup(essential=True)
    outs = list(engine.generate(list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=200)))
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert outs[-1].prompt_tokens + outs[-1].completion_tokens == 64
