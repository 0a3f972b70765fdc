"""The real engine on SmolLM2 against llama-server's recordings (tests/fixtures/parity_smollm2.json):
greedy tokens, a stop split across two tokens, logprobs, and the prompt cache's cached_tokens.

Short on purpose: the bytes of every answer shape are compared in tests/test_parity.py over replayed
tokens; here the forward pass and the slot produce them. Logprobs agree to 0.15 nats (llama.cpp
rounds activations to 8 bits before its quantized matmuls; tests/test_golden.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.engine import Engine
from model.messages import FinishReason, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity_smollm2.json").read_text())
TRACES = FIXTURE["traces"]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine.load(smollm2_path, verified=True, n_ctx=512, warmup=False)


def test_greedy_tokens_and_logprobs_are_llama_servers(engine):
    trace = TRACES["hi"]
    outs = list(engine.generate(trace["prompt_tokens"], SamplingParams(temperature=0.0, max_tokens=4, n_probs=3,
                                                                       cache_prompt=False)))
    assert [o.token for o in outs] == trace["tokens"][:4]
    for i, out in enumerate(outs):
        theirs = trace["probs"][str(i)]
        assert out.logprobs.logprob == pytest.approx(theirs["logprob"], abs=0.15)
        assert [t.token for t in out.logprobs.top][:1] == [theirs["top"][0][0]]


def test_a_stop_split_across_tokens_ends_where_llama_server_ends(engine):
    case = FIXTURE["answers"]["stop_split_across_tokens"]
    outs = list(engine.generate(TRACES["hi"]["prompt_tokens"], SamplingParams(temperature=0.0, max_tokens=8,
                                                                               stop=("lo th",))))
    body = case["body"]
    assert "".join(o.text for o in outs) + outs[-1].held_text == body["choices"][0]["message"]["content"]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].completion_tokens == body["usage"]["completion_tokens"]


def test_cached_tokens_follow_llama_servers_slot(engine):
    """The recorded sequence after its first request (llama-server also has a RAM prompt cache across
    slots, which the first request of the recording hit)."""
    seq = FIXTURE["cache"]
    list(engine.generate(TRACES[seq[1]["trace"]]["prompt_tokens"], SamplingParams(temperature=0.0, max_tokens=4)))
    for step in seq[2:]:
        params = SamplingParams(temperature=0.0, max_tokens=4, cache_prompt=step["request"].get("cache_prompt", True))
        outs = list(engine.generate(TRACES[step["trace"]]["prompt_tokens"], params))
        assert outs[-1].cached_tokens == step["usage"]["prompt_tokens_details"]["cached_tokens"], step
        assert outs[-1].prompt_tokens - outs[-1].cached_tokens == step["timings"]["prompt_n"]
