"""`bankml serve --native` on the real SmolLM2 against llama-server b11434's recorded completions
(tests/fixtures/completions_smollm2.json, tests/fixtures/record_completions.py): for every recorded
answer on /completion, /v1/completions, /completions, /chat/completions, /v1/chat/completions (n 2,
timings_per_token) and /infill, the same status, the same keys in the same order, and (greedy) the
same text and token ids, event by event when streamed. `slow`: one server on the real model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from gateway_helpers import CliServer, sse_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "completions_smollm2.json").read_text())
VOLATILE = ("created", "id", "system_fingerprint")
OURS_ONLY = ("bankml_receipt",)
# not greedy: only the shape and the settings are compared
SAMPLED = {"settings"}
# llama-server answers any model name with its one model, and so does a bankML serving one model
SKIPPED: dict[str, str] = {}
# which slot served a sequence is the scheduler's business, not the answer's
UNCOMPARED = ("id_slot",)
# our `model` is the file's name (as /v1/models lists it), llama-server's the path it was started with
MODEL_KEY = "model"


@pytest.fixture(scope="module")
def server(bankml_cmd, smollm2_path, smollm2_fork):
    ctx = RECORDED["n_ctx"] // RECORDED["n_parallel"]  # the recording's slot context
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--ctx", str(ctx), "--config", "cpu")
    yield s
    s.stop()


def _ours(e):
    """Our event or object with what only bankML writes left out: receipts (a key, or an event)."""
    if isinstance(e, list):
        return [_ours(x) for x in e]
    if isinstance(e, dict):
        return {k: v for k, v in e.items() if k not in OURS_ONLY and k not in VOLATILE}
    return e


def _same(ours, theirs, greedy: bool) -> None:
    if isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs)
        for o, t in zip(ours, theirs, strict=True):
            _same(o, t, greedy)
        return
    assert [k for k in ours if k not in OURS_ONLY and k not in VOLATILE] == list(theirs)
    for key, value in theirs.items():
        if key == MODEL_KEY or key in UNCOMPARED:
            continue
        if key == "tokens_cached" and theirs.get("tokens_predicted") == 0:
            continue  # an empty prompt: llama-server reports what its slot held from an earlier request
        if key == "timings":
            assert list(ours[key]) == list(value)
            assert all(ours[key][k] == value[k] for k in ("prompt_n", "predicted_n"))
        elif key == "prompt_progress":  # time_ms is a clock
            assert list(ours[key]) == list(value)
            assert {k: v for k, v in ours[key].items() if k != "time_ms"} == \
                {k: v for k, v in value.items() if k != "time_ms"}
        elif key == "generation_settings":
            assert ours[key] == value
        elif key == "choices":
            _same(ours[key], value, greedy)
        elif greedy or key not in ("content", "text", "tokens", "message", "delta", "completion_probabilities",
                                   "logprobs", "tokens_predicted", "stop_type", "usage", "tokens_cached"):
            if key in ("completion_probabilities", "logprobs") and value is not None:
                _same_probs(ours[key], value)
            else:
                assert ours[key] == value, key


def _same_probs(ours, theirs) -> None:
    """Logprob entries: the same ids, tokens and bytes; logprobs within a float32 forward pass's reach."""
    ours = ours["content"] if isinstance(ours, dict) else ours
    theirs = theirs["content"] if isinstance(theirs, dict) else theirs
    assert [(e["id"], e["token"], e["bytes"]) for e in ours] == [(e["id"], e["token"], e["bytes"]) for e in theirs]
    for o, t in zip(ours, theirs, strict=True):
        # llama.cpp's CPU kernels quantize activations to 8 bits for Q4_1 where the engine computes in
        # float32: logprobs agree to about 0.1, and candidates whose logprobs are that close may swap
        assert o["logprob"] == pytest.approx(t["logprob"], abs=0.15)
        assert len(o["top_logprobs"]) == len(t["top_logprobs"])
        assert o["top_logprobs"][0]["id"] == t["top_logprobs"][0]["id"]
        for x in o["top_logprobs"]:
            theirs_x = {y["id"]: y["logprob"] for y in t["top_logprobs"]}
            if x["id"] in theirs_x:
                assert x["logprob"] == pytest.approx(theirs_x[x["id"]], abs=0.15)


def _receipt_event(e) -> bool:
    """A chat stream's receipt chunk (no choices; usage and timings a copy of the last chunk's): bankML's only."""
    return isinstance(e, dict) and "bankml_receipt" in e and e.get("choices") == []


@pytest.mark.parametrize("name", sorted(RECORDED["answers"]))
def test_each_recorded_answer(server, name):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    case = RECORDED["answers"][name]
    r = httpx.post(server.url(case["route"]), json=case["request"], timeout=300)
    assert r.status_code == case["status"], r.text
    greedy = name not in SAMPLED
    if "events" not in case:
        if r.status_code != 200:
            assert r.json() == case["body"]
            return
        _same(_ours(r.json()), case["body"], greedy)
        return
    theirs = [e for e in case["events"] if e is not None]  # b11434's `data: null` before a list's events
    ours = [e for e in (_ours(e) for e in sse_data(r.text) if not _receipt_event(e)) if e not in ({}, {"choices": []}, {"index": 0},
                                                                       {"index": 1}, {"choices": [], "index": 0},
                                                                       {"choices": [], "index": 1})]
    if case["route"].endswith("chat/completions"):
        # bankML's finish chunk also has `usage` (llama-server's only with include_usage)
        drop = ("usage",) if case["request"].get("timings_per_token") else ("usage", "timings")
        ours = [{k: v for k, v in e.items() if k not in drop} if isinstance(e, dict) else e for e in ours]
        theirs = [{k: v for k, v in e.items() if k not in drop} if isinstance(e, dict) else e for e in theirs]
    # several sequences interleave as the engine schedules them: compared sequence by sequence
    ours, theirs = _by_index(ours), _by_index(theirs)
    assert len(ours) == len(theirs)
    for o, t in zip(ours, theirs, strict=True):
        if isinstance(t, str):
            assert o == t
        else:
            _same(o, t, greedy)


def _index(e) -> int:
    if not isinstance(e, dict):
        return 1 << 30  # [DONE] last
    if e.get("choices"):
        return e["choices"][0]["index"]
    return e.get("index", 0)


def _by_index(events: list) -> list:
    return sorted(events, key=_index)  # stable: each sequence's own order kept


def test_echo_with_logprobs_scores_the_prompt_as_generation_scored_it(server):
    """OpenAI's legacy echo through the openai client: the prompt's teacher-forced logprobs (model/score.py)
    are, at the positions a generation produced, that generation's own logprobs."""
    import openai

    c = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    gen = httpx.post(server.url("/v1/completions"), json={"prompt": "The capital of France is", "max_tokens": 6,
                                                          "temperature": 0, "logprobs": 3}, timeout=300).json()
    entries = gen["choices"][0]["logprobs"]["content"]
    prompt_ids = httpx.post(server.url("/tokenize"), json={"content": "The capital of France is",
                                                           "add_special": True}, timeout=60).json()["tokens"]
    ids = prompt_ids + [e["id"] for e in entries]
    echoed = c.completions.create(model="x", prompt=ids, echo=True, logprobs=3, max_tokens=0)
    choice = echoed.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.text == "".join(lp.tokens) and lp.text_offset[-1] == len(choice.text) - len(lp.tokens[-1])
    assert echoed.usage.completion_tokens == 0 and choice.finish_reason == "length"
    for j, e in enumerate(entries):
        at = len(prompt_ids) + j
        # the decode steps sum in another order than one pass over the whole text: measured up to 7e-4
        assert lp.token_logprobs[at] == pytest.approx(e["logprob"], abs=2e-3)
        assert list(lp.top_logprobs[at]) == [t["token"] for t in e["top_logprobs"]]
    assert echoed.model_extra["bankml_receipt"]["response_sha256"]
    # with a completion after the echo: the text is the prompt's, then the answer's
    both = c.completions.create(model="x", prompt="The capital of France is", echo=True, max_tokens=6, temperature=0)
    assert both.choices[0].text == "The capital of France is" + gen["choices"][0]["text"]
