"""The /infill prompt (gateway/openai/infill.py) against llama-server b11434's recorded answers
(tests/fixtures/llama_small_smollm2.json, by tests/fixtures/record_llama_small.py).

SmolLM2 has no FIM tokens: llama-server refuses /infill on it (501). The prompts were recorded on
copies of SmolLM2 whose header names three of its control tokens FIM prefix/suffix/middle (and, in
one copy, FIM_SEP); here the same keys go over SmolLM2's own tokenizer fields, so each recorded token
list (llama-server's --log-prompts-dir) is compared with what infill_prompt builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import FakeTokenizer

from bankml.errors import InvalidRequest, NotServed
from gateway.http.errors import Api, error_body, status_of
from gateway.openai.infill import check_infill_body, infill_prompt, require_fim
from gateway.serving.native_model import NativeModel
from model.messages import SamplingParams
from model.tokenizer import Tokenizer, gguf_fields

DATA = json.loads((Path(__file__).parent / "fixtures" / "llama_small_smollm2.json").read_text())
N_BATCH = 2048  # llama-server's default --batch-size, the `fim_sep` recording's
N_PREDICT = -1  # llama-server's default --n-predict (not the request's n_predict)


def fim_model(smollm2_path: Path, keys: dict) -> NativeModel:
    tok = Tokenizer.from_gguf({**gguf_fields(smollm2_path, ("tokenizer.", "general.")), **keys})
    return NativeModel(tok, 2048, None, SamplingParams())


@pytest.fixture(scope="module")
def fim_sep(smollm2_path) -> NativeModel:
    assert DATA["model"] == smollm2_path.name
    return fim_model(smollm2_path, {**DATA["fim_keys"], **DATA["fim_sep_key"]})


@pytest.fixture(scope="module")
def fim_nosep(smollm2_path) -> NativeModel:
    return fim_model(smollm2_path, DATA["fim_keys"])


def _answered(section: str) -> list[str]:
    return [n for n, r in DATA[section].items() if r["status"] == 200]


def _refused(section: str) -> list[str]:
    return [n for n, r in DATA[section].items() if r["status"] == 400 and r["logged_prompt"] is None]


@pytest.mark.parametrize("name", _answered("infill_fim_sep"))
def test_prompt_with_fim_sep_is_llama_servers(fim_sep, name):
    rec = DATA["infill_fim_sep"][name]
    check_infill_body(rec["request"])
    tokens = infill_prompt(fim_sep, rec["request"], n_ctx=2048, n_batch=N_BATCH, n_predict=N_PREDICT)
    assert tokens == rec["logged_prompt"]
    assert len(tokens) == rec["body"]["tokens_evaluated"]
    assert fim_sep.tokenizer.decode(tokens, special=True) == rec["body"]["prompt"]


@pytest.mark.parametrize("name", _answered("infill_fim_nosep"))
def test_prompt_without_fim_sep_is_llama_servers(fim_nosep, name):
    """-b 256: the extra context keeps its last n_ctx - n_batch + 2 tokens, the prefix 192, the suffix
    64 - 2 - the prompt's; each chunk gets the "--- snippet ---" separator."""
    rec = DATA["infill_fim_nosep"][name]
    check_infill_body(rec["request"])
    tokens = infill_prompt(fim_nosep, rec["request"], n_ctx=2048, n_batch=DATA["nosep_batch"], n_predict=N_PREDICT)
    assert tokens == rec["logged_prompt"]


def test_the_cuts_were_recorded():
    """The recorded cases do cut: a prefix to 3/4 of a batch, a suffix to a quarter, the extra context."""
    sep, nosep = DATA["infill_fim_sep"], DATA["infill_fim_nosep"]
    assert sep["long_prefix"]["body"]["tokens_evaluated"] < 3 * N_BATCH // 4 + 40
    assert sep["long_suffix"]["body"]["tokens_evaluated"] < N_BATCH // 4 + 40
    assert len(nosep["long_extra"]["logged_prompt"]) > 1800 and "--- snippet ---" not in nosep["long_extra"]["body"]["prompt"][:20]


@pytest.mark.parametrize("name", _refused("infill_fim_sep"))
def test_body_refusals_are_llama_servers(name):
    rec = DATA["infill_fim_sep"][name]
    with pytest.raises(InvalidRequest) as e:
        check_infill_body(rec["request"])
    assert json.loads(error_body(e.value, Api.LLAMA)) == rec["body"]
    assert status_of(e.value, Api.LLAMA) == 400


def test_an_unknown_token_that_survives_the_cut_is_refused(fim_sep):
    rec = DATA["infill_fim_sep"]["prefix_bad_id"]
    check_infill_body(rec["request"])
    with pytest.raises(InvalidRequest) as e:
        infill_prompt(fim_sep, rec["request"], n_ctx=2048, n_batch=N_BATCH, n_predict=N_PREDICT)
    assert json.loads(error_body(e.value, Api.LLAMA)) == rec["body"]


@pytest.mark.parametrize("name", list(DATA["infill_refused"]))
def test_a_model_without_fim_tokens_is_refused_as_llama_server_refuses_it(smollm2_path, name):
    rec = DATA["infill_refused"][name]
    model = NativeModel(Tokenizer.from_gguf(gguf_fields(smollm2_path)), 2048, None, SamplingParams())
    with pytest.raises(NotServed) as e:
        require_fim(model)
    assert (status_of(e.value, Api.LLAMA), json.loads(error_body(e.value, Api.LLAMA))) == (rec["status"], rec["body"])
    with pytest.raises(NotServed):  # infill_prompt refuses it too, whatever the body
        infill_prompt(model, {"input_prefix": "a", "input_suffix": "b"}, n_ctx=2048, n_batch=2048, n_predict=-1)


def test_the_fake_engines_tokenizer_has_no_fim_tokens():
    with pytest.raises(NotServed, match="prefix token is missing. suffix token is missing. middle token is missing. $"):
        require_fim(NativeModel(FakeTokenizer(), 4096, None, SamplingParams()))
