"""Speculative decoding as `bankml serve` offers it: llama-server's flags (--spec-type, --spec-ngram-size-n/-m,
--draft-max/--draft-min) and [engine] keys, refused where this engine has no such drafts, and what a client
sees: `timings.draft_n` / `draft_n_accepted` once something was drafted, /props' and the task params'
`speculative.*`, /slots' `speculative`, the `bankml_spec_decode_*` counters. The engine itself is
tests/test_speculative*.py's; here a fake engine reports drafts (tests/fake_engine.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from bankml.cli import build_parser, serve_options_of
from bankml.config import Config, load_config, serve_options
from bankml.errors import ConfigInvalid
from gateway.monitor.answer_metrics import answer_record
from gateway.monitor.prometheus import PromMetrics
from gateway.openai.chat_writer import timings
from gateway.openai.params_json import params_json
from gateway.p0.spawn import llama_server_argv
from model.messages import EngineStats, FinishReason, SamplingParams, StepOutput
from model.speculative import Speculation

pytestmark = pytest.mark.timeout(120)

TIMINGS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]


def options(*argv: str):
    return serve_options_of(build_parser().parse_args(["serve", *argv]))


# --- flags and config --------------------------------------------------------------------------------------


def test_the_flags_reach_the_engine_config_and_its_speculation():
    default = options("--native").config.engine
    assert default.speculation == Speculation() == Speculation("none", 12, 48, 16, 0)  # llama-server's defaults
    o = options("--native", "--spec-type", "ngram-simple", "--spec-ngram-size-n", "4", "--spec-ngram-size-m", "32",
                "--draft-max", "8", "--draft-min", "2")
    e = o.config.engine
    assert (e.spec_type, e.spec_ngram_size_n, e.spec_ngram_size_m, e.draft_max, e.draft_min) == (
        "ngram-simple", 4, 32, 8, 2)
    assert e.speculation == Speculation("ngram-simple", 4, 32, 8, 2) and e.speculation.on
    for alias in ("--draft", "--draft-n"):  # llama-server's other spellings of --draft-max
        assert options("--native", alias, "5").config.engine.draft_max == 5


def test_the_engine_keys_of_a_config_file_and_flags_over_them(tmp_path: Path):
    conf = tmp_path / "spec.toml"
    conf.write_text('[engine]\nspec_type = "ngram-simple"\nspec_ngram_size_n = 3\ndraft_max = 6\ndraft_min = 1\n')
    assert load_config(str(conf)).engine.speculation == Speculation("ngram-simple", 3, 48, 6, 1)
    o = options("--native", "--config", str(conf), "--draft-max", "9", "--spec-type", "none")
    assert o.config.engine.speculation == Speculation("none", 3, 48, 9, 1)
    for table, why in [('spec_type = "ngram-cache"', "'engine.spec_type': --spec-type ngram-cache: not in this "
                                                     "engine"),
                       ('spec_type = "eagle"', "one of none, ngram-simple"),
                       ("spec_type = 1", "must be str"),
                       ("draft_max = 0", "'engine.draft_max' must be positive"),
                       ("draft_max = 64", "'engine.draft_max' must be at most 63"),
                       ("spec_ngram_size_m = 0", "must be positive"),
                       ("draft_min = -1", "'engine.draft_min' must not be negative")]:
        conf.write_text(f"[engine]\n{table}\n")
        with pytest.raises(ConfigInvalid, match=why):
            load_config(str(conf))


@pytest.mark.parametrize("spec_type, why", [
    ("ngram-cache", "--spec-type ngram-cache: not in this engine (its n-gram statistics files)"),
    ("ngram-map-k", "--spec-type ngram-map-k: not in this engine"),
    ("ngram-map-k4v", "--spec-type ngram-map-k4v: not in this engine"),
    ("ngram-mod", "--spec-type ngram-mod: not in this engine"),
    ("eagle3", "--spec-type 'eagle3': one of none, ngram-simple"),
])
def test_a_spec_type_this_engine_lacks_is_bad_usage_with_the_reason(spec_type, why, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--native", "--spec-type", spec_type])
    assert e.value.code == 1  # bad usage, as any malformed flag
    err = capsys.readouterr().err
    assert err.startswith("usage: bankml serve ") and why in err
    with pytest.raises(ConfigInvalid, match=why.replace("(", r"\(").replace(")", r"\)")):
        serve_options(Config(), native=True, spec_type=spec_type)  # the same refusal, called directly


def test_bad_sizes_are_bad_usage(capsys):
    for argv in (["--draft-max", "0"], ["--draft-min", "-1"], ["--spec-ngram-size-n", "0"], ["--draft", "x"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--native", *argv])
        assert e.value.code == 1, argv
    with pytest.raises(ConfigInvalid, match="--draft-max must be positive"):
        serve_options(Config(), native=True, draft_max=0)
    with pytest.raises(ConfigInvalid, match="--draft-max must be at most 63"):  # it sizes the verify programs
        serve_options(Config(), native=True, draft_max=64)
    assert serve_options(Config(), native=True, draft_max=63).config.engine.draft_max == 63


def test_draft_models_and_native_spec_ngram_are_refused_by_name():
    for argv in (["--model-draft", "d.gguf"], ["-md", "d.gguf"], ["--fork-draft", "d.FORK.json"]):
        for native in ([], ["--native"]):
            with pytest.raises(ConfigInvalid, match=f"{argv[0] if argv[0] != '-md' else '--model-draft'}: a draft "
                                                    "model is not in bankML yet .*--spec-type ngram-simple"):
                options(*native, *argv)
    with pytest.raises(ConfigInvalid, match="--spec-ngram: llama-server's flags .*--spec-type ngram-simple"):
        options("--native", "--spec-ngram")


def test_p0_hands_the_spec_type_and_sizes_to_a_spawned_llama_server():
    def argv(o):
        return llama_server_argv("llama-server", "m.gguf", "127.0.0.1", 1, 2, 3, o.spec_ngram, None, o.spec_sizes)

    plain = argv(options())
    assert "--spec-type" not in plain
    assert argv(options("--spec-ngram"))[len(plain):] == ["--spec-type", "ngram-simple"]  # as before
    assert argv(options("--spec-type", "ngram-simple"))[len(plain):] == ["--spec-type", "ngram-simple"]
    # only what differs from llama-server's defaults (which are ours)
    assert argv(options("--spec-type", "ngram-simple", "--draft", "8", "--spec-ngram-size-m", "48"))[len(plain):] == [
        "--spec-type", "ngram-simple", "--draft-max", "8"]
    assert argv(options("--draft", "8")) == plain  # sizes without drafting: nothing to pass


def test_the_native_loader_gives_the_engine_its_speculation(monkeypatch):
    from types import SimpleNamespace

    from gateway.app import native_loader
    from model.engine import Engine

    seen = {}

    def load(path, **kw):
        seen.update(kw)
        return SimpleNamespace()

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    engine = options("--native", "--spec-type", "ngram-simple", "--draft-max", "4").config.engine
    native_loader(256, engine)("m.gguf")  # the startup model's and the registry's loader alike
    assert seen["speculation"] == Speculation("ngram-simple", draft_max=4)


# --- what a client reads -------------------------------------------------------------------------------------


def test_timings_name_the_drafts_only_once_something_was_drafted():
    out = StepOutput(token=1, finish_reason=FinishReason.STOP, prompt_tokens=10, completion_tokens=20)
    assert list(timings(out)) == TIMINGS  # b11434's keys: no draft_n while nothing was drafted
    drafted = StepOutput(token=1, finish_reason=FinishReason.STOP, prompt_tokens=10, completion_tokens=20,
                         draft_n=12, draft_n_accepted=9)
    t = timings(drafted)
    assert list(t) == [*TIMINGS, "draft_n", "draft_n_accepted"] and (t["draft_n"], t["draft_n_accepted"]) == (12, 9)
    assert "draft_n" not in answer_record("m", out)
    record = answer_record("m", drafted)  # /bankml/metrics: the same two, last
    assert list(record)[-2:] == ["draft_n", "draft_n_accepted"] and record["draft_n_accepted"] == 9


def test_the_task_params_show_the_spec_type_and_the_resolved_draft_lengths():
    p = SamplingParams()
    plain = params_json(p)
    assert plain["speculative.types"] == "none" and "speculative.n_max" not in plain  # b11434's, as recorded
    assert params_json(p, speculation=Speculation()) == plain
    spec = Speculation("ngram-simple", draft_max=8, draft_min=2)
    shown = params_json(p, speculation=spec)
    keys = list(shown)
    at = keys.index("speculative.types")
    assert keys[at - 1] == "samplers" and keys[at + 1:at + 5] == [
        "speculative.n_max", "speculative.n_min", "speculative.p_min", "timings_per_token"]
    assert {k: shown[k] for k in keys[at:at + 4]} == {"speculative.types": "ngram-simple", "speculative.n_max": 8,
                                                      "speculative.n_min": 2, "speculative.p_min": 0.75}
    # a request's own lengths, clamped to --draft-max (which sized the programs); n_min never above n_max
    mine = params_json(SamplingParams(spec_n_max=32, spec_n_min=0, spec_p_min=0.5), speculation=spec)
    assert (mine["speculative.n_max"], mine["speculative.n_min"], mine["speculative.p_min"]) == (8, 0, 0.5)
    mine = params_json(SamplingParams(spec_n_max=1, spec_n_min=-1), speculation=spec)
    assert (mine["speculative.n_max"], mine["speculative.n_min"]) == (1, 1)


def _prometheus(stats: EngineStats) -> dict[str, float]:
    prom = PromMetrics(lambda: (0, 0), lambda: {}, engine=lambda: stats)
    body, _ = prom.exposition({}, None)
    return {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_prometheus_counts_verify_steps_drafts_and_tokens_and_the_acceptance_ratio():
    m = _prometheus(EngineStats(spec_steps=5, spec_drafts=7, spec_draft_tokens=40, spec_accepted_tokens=30))
    assert (m["bankml_spec_decode_num_verify_steps_total"], m["bankml_spec_decode_num_drafts_total"],
            m["bankml_spec_decode_num_draft_tokens_total"], m["bankml_spec_decode_num_accepted_tokens_total"]) == (
        5, 7, 40, 30)
    assert m["bankml_spec_decode_acceptance_ratio"] == 0.75
    m = _prometheus(EngineStats())
    assert m["bankml_spec_decode_num_draft_tokens_total"] == 0
    assert "bankml_spec_decode_acceptance_ratio" not in m  # nothing drafted: no ratio, not a false 0


# --- a server that speculates ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("spec")),
                   flags=["--spec-type", "ngram-simple", "--draft-max", "8", "--draft-min", "2"])
    yield s
    s.stop()


def test_props_slots_and_bankml_say_the_server_speculates(server):
    params = httpx.get(server.url("/props")).json()["default_generation_settings"]["params"]
    assert (params["speculative.types"], params["speculative.n_max"], params["speculative.n_min"],
            params["speculative.p_min"]) == ("ngram-simple", 8, 2, 0.75)
    [slot] = httpx.get(server.url("/slots", upstream=True)).json()
    assert slot["speculative"] is True
    assert httpx.get(server.url("/bankml")).json()["speculation"] == {
        "spec_type": "ngram-simple", "spec_ngram_size_n": 12, "spec_ngram_size_m": 48, "draft_max": 8, "draft_min": 2}


def test_answers_carry_their_drafts_and_the_counters_move(server):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30)
    t = r.json()["timings"]
    assert r.status_code == 200 and t["predicted_n"] == 5
    assert (t["draft_n"], t["draft_n_accepted"]) == (8, 4)  # the fake drafts 2 a step after the first, keeps 1
    done = httpx.post(server.url("/completion"), json={"prompt": "hi", "n_predict": 2,
                                                       "speculative.n_max": 4}, timeout=30).json()
    settings = done["generation_settings"]
    assert (settings["speculative.types"], settings["speculative.n_max"], settings["speculative.n_min"]) == (
        "ngram-simple", 4, 2)
    assert (done["timings"]["draft_n"], done["timings"]["draft_n_accepted"]) == (2, 1)
    m = {s.name: s.value for f in text_string_to_metric_families(httpx.get(server.url("/metrics")).text)
         for s in f.samples}
    assert m["bankml_spec_decode_num_draft_tokens_total"] >= 10
    assert m["bankml_spec_decode_acceptance_ratio"] == 0.5
    records = httpx.get(server.url("/bankml/metrics")).json()["records"]
    assert [(r["completion_tokens"], r["draft_n"], r["draft_n_accepted"]) for r in records[-2:]] == [
        (5, 8, 4), (2, 2, 1)]
