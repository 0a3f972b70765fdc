"""configs/: defaults, presets, unknown keys and bad values refused, CLI flags over them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bankml.cli import build_parser, serve_options_of
from bankml.config import (
    Config,
    EngineConfig,
    LimitsConfig,
    ServeConfig,
    load_config,
    parse_host_port,
    parse_keep_alive,
    serve_options,
)
from bankml.errors import ConfigInvalid


def options(*argv: str):
    return serve_options_of(build_parser().parse_args(["serve", *argv]))


def test_defaults_are_the_originals():
    c = load_config()
    assert c == load_config("default") == Config()
    assert c.serve.listen == "127.0.0.1:18093" and c.serve.upstream == "127.0.0.1:18092"
    assert (c.serve.threads, c.serve.ctx, c.serve.keep_alive, c.serve.rule_set) == (3, 4096, "5m", "mainline")
    lim = c.limits
    assert (lim.max_connections, lim.max_body_bytes, lim.max_line_bytes, lim.max_header_lines) == (
        32, 16 << 20, 16384, 100)
    assert (lim.read_timeout_s, lim.write_timeout_s, lim.max_upstream_body_bytes) == (30, 120, 64 << 20)
    eng = c.engine
    assert (eng.max_seqs, eng.max_waiting, eng.memory_fraction, eng.max_prefill_bucket) == (4, 256, 0.75, 512)
    assert (eng.kv_cache_bytes, eng.page_size) == (0, 16)


def test_presets_overlay_and_unknown_keys_refuse(tmp_path: Path):
    h200 = load_config("h200")
    assert (h200.engine.max_seqs, h200.serve.ctx, h200.engine.max_prefill_bucket) == (16, 8192, 2048)
    assert h200.limits == LimitsConfig() and isinstance(h200.engine, EngineConfig)
    cpu = load_config("cpu")
    assert cpu.serve == ServeConfig() and cpu.engine.max_seqs == 4  # the default: cpu.toml does not set it
    bad = tmp_path / "bad.toml"
    for text, why in [
        ('[serve]\nlisten = "127.0.0.1:1"\nlisen = "x"\n', "unknown key 'serve.lisen'"),
        ('[serve]\nctx = "big"\n', "'serve.ctx' must be int, not str"),
        ("[serve]\nctx = true\n", "'serve.ctx' must be int, not bool"),
        ("[serve]\nctx = 0\n", "'serve.ctx' must be positive, not 0"),
        ("[nonsense]\n", "unknown key 'nonsense'"),
        ("serve = 3\n", "'serve' must be a table"),
        ('[serve]\nengine = "mainline"\n', "unknown key 'serve.engine'"),  # renamed rule_set
        ('[serve]\nrule_set = "prism"\n', "'serve.rule_set' 'prism' is not supported"),
        ('[serve]\nlisten = "nowhere"\n', "'serve.listen' 'nowhere' is not HOST:PORT"),
        ('[serve]\nkeep_alive = "5 minutes"\n', "'serve.keep_alive' '5 minutes' is not a duration"),
        ("[engine]\nmemory_fraction = 1.5\n", "'engine.memory_fraction' must be in (0, 1]"),
        ("[registry]\nmax_loaded = 0\n", "'registry.max_loaded' must be positive, not 0"),
        ("[registry]\ndir = 3\n", "'registry.dir' must be str, not int"),
        ("[registry]\nmax_resident = 2\n", "unknown key 'registry.max_resident'"),
        ("[engine]\nn_slots = 4\n", "'engine.n_slots' is now 'engine.max_seqs'"),  # renamed: said, not ignored
        ("[engine]\nmax_seqs = 0\n", "'engine.max_seqs' must be positive, not 0"),
        ("[engine]\nmax_waiting = -1\n", "'engine.max_waiting' must be positive, not -1"),
        ("[engine]\npage_size = 24\n", "'engine.page_size' must be a power of two up to 1024, not 24"),
        ("[engine]\npage_size = 0\n", "'engine.page_size' must be a power of two"),
        ("[engine]\npage_size = 2048\n", "'engine.page_size' must be a power of two up to 1024"),
        ("[engine]\nkv_cache_bytes = -1\n", "'engine.kv_cache_bytes' must not be negative"),
    ]:
        bad.write_text(text)
        with pytest.raises(ConfigInvalid) as e:
            load_config(str(bad))
        assert str(e.value).startswith(f"{bad}: ") and why in str(e.value), (text, str(e.value))
    with pytest.raises(ConfigInvalid, match="no config preset or file 'nope'"):
        load_config("nope")
    bad.write_text("[engine]\nmax_seqs = 1\npage_size = 32\nmax_waiting = 3\nkv_cache_bytes = 1048576\n")
    eng = load_config(str(bad)).engine
    assert (eng.max_seqs, eng.page_size, eng.max_waiting, eng.kv_cache_bytes) == (1, 32, 3, 1 << 20)
    bad.write_text("[limits]\nread_timeout_s = 5\n")  # an int where a float is wanted is the same number
    assert load_config(str(bad)).limits.read_timeout_s == 5.0


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        load_config().serve.ctx = 1  # type: ignore[misc]


def test_flags_override_config(tmp_path: Path):
    conf = tmp_path / "mine.toml"
    conf.write_text('[serve]\nlisten = "127.0.0.1:19000"\nctx = 2048\nspec_ngram = true\n')
    o = options("--config", str(conf))
    assert o.listen == ("127.0.0.1", 19000) and o.ctx == 2048 and o.spec_ngram and o.threads == 3
    o = options("--config", str(conf), "--listen", "localhost:19001", "--ctx", "512", "--threads", "2")
    assert o.listen == ("localhost", 19001) and o.ctx == 512 and o.threads == 2
    assert o.upstream == o.compat_listen == ("127.0.0.1", 18092) and o.rule_set == "mainline"


def test_the_registry_comes_from_its_table_or_the_flag(tmp_path: Path, monkeypatch):
    o = options("--native")
    assert (o.registry_dir, o.max_loaded) == (None, 3)  # the startup model only, three resident at most
    conf = tmp_path / "reg.toml"
    conf.write_text(f'[registry]\ndir = "{tmp_path}"\nmax_loaded = 2\n')
    o = options("--native", "--config", str(conf))
    assert (o.registry_dir, o.max_loaded) == (str(tmp_path), 2)
    forks = tmp_path / "forks"
    forks.mkdir()
    assert options("--native", "--config", str(conf), "--registry", str(forks)).registry_dir == str(forks)
    monkeypatch.setenv("BANKML_FORKS", str(forks))
    assert options("--native", "--registry").registry_dir == str(forks)  # a bare flag
    monkeypatch.delenv("BANKML_FORKS")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".local/share/bankml/forks").mkdir(parents=True)
    assert options("--native", "--registry").registry_dir == str(tmp_path / ".local/share/bankml/forks")
    with pytest.raises(ConfigInvalid, match="is --native's"):
        options("--registry", str(forks))


def test_keep_alive_is_ollamas_duration():
    assert options().keep_alive_s == 300.0
    assert options("--keep-alive", "1h30m").keep_alive_s == 5400.0
    assert options("--keep-alive", "90").keep_alive_s == 90.0
    assert options("--keep-alive", "0").keep_alive_s == 0.0  # unload at once
    assert options("--keep-alive", "-1").keep_alive_s == math.inf  # negative: forever
    assert parse_keep_alive("-5m", "x") == math.inf and parse_keep_alive("1.5s", "x") == 1.5
    for bad in ("5x", "m", "", "1h 5m", "nan", "inf"):
        with pytest.raises(ConfigInvalid):
            parse_keep_alive(bad, "--keep-alive")


def test_what_native_cannot_honour_is_refused_by_name(tmp_path: Path):
    # the slot directory is made at start (as llama-server's --slot-save-path), in both modes
    assert options("--native", "--slot-dir", str(tmp_path / "a" / "b")).slot_dir == str(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    conf = tmp_path / "slots.toml"
    conf.write_text(f'[serve]\nslot_dir = "{tmp_path / "c"}"\n')
    assert options("--native", "--config", str(conf)).slot_dir == str(tmp_path / "c")
    assert options("--config", str(conf)).slot_dir == str(tmp_path / "c")  # P0 hands it to llama-server
    with pytest.raises(ConfigInvalid, match="--slot-dir .*slots.toml: File exists"):
        options("--native", "--slot-dir", str(conf))
    for flag in (["--spawn", "/bin/llama-server"], ["--threads", "4"], ["--spec-ngram"]):
        with pytest.raises(ConfigInvalid, match=f"{flag[0]}: llama-server's flags"):
            options("--native", *flag)
    with pytest.raises(ConfigInvalid, match="only rule set is mainline"):
        serve_options(Config(), rule_set="prism")


def test_host_port():
    assert parse_host_port("http://127.0.0.1:8080/", "--upstream") == ("127.0.0.1", 8080)
    assert parse_host_port("[::1]:9", "--listen") == ("::1", 9)
    for bad in ("127.0.0.1", "host:port", ":80", "h:70000"):
        with pytest.raises(ConfigInvalid):
            parse_host_port(bad, "--listen")


def test_wide_vectors_are_preferred_only_on_avx512_and_never_over_an_operator(monkeypatch):
    from model.cpu_tuning import prefer_wide_vectors

    avx512 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert prefer_wide_vectors(env, avx512)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_cpu_prefer_vector_width=512"
    assert not prefer_wide_vectors(env, avx512)  # once only
    own = {"XLA_FLAGS": "--xla_cpu_prefer_vector_width=256"}
    assert not prefer_wide_vectors(own, avx512) and own["XLA_FLAGS"] == "--xla_cpu_prefer_vector_width=256"
    plain = {}
    assert not prefer_wide_vectors(plain, "flags\t\t: fpu sse avx2\n") and "XLA_FLAGS" not in plain


def test_the_cache_follows_bankml_cache_dir_then_xdg(monkeypatch, tmp_path):
    """Models and compiled programs live under one cache directory: $BANKML_CACHE_DIR, else
    $XDG_CACHE_HOME/bankml (absolute only), else ~/.cache/bankml; $BANKML_MODELS still moves the models."""
    from bankml.default_model import cache_dir, models_dir
    from gateway.app import compile_cache_path

    for name in ("BANKML_CACHE_DIR", "XDG_CACHE_HOME", "BANKML_MODELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = load_config(None).engine.compile_cache_dir
    assert compile_cache_path(default) == str(tmp_path / "home" / ".cache" / "bankml" / "xla")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_dir() == tmp_path / "home" / ".cache" / "bankml"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_path(default) == str(tmp_path / "xdg" / "bankml" / "xla")
    monkeypatch.setenv("BANKML_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_path(default) == str(tmp_path / "mine" / "xla")
    assert models_dir() == tmp_path / "mine" / "models"
    monkeypatch.setenv("BANKML_MODELS", str(tmp_path / "models"))
    assert models_dir() == tmp_path / "models"
    assert compile_cache_path("") is None  # off
    assert compile_cache_path("~/x") == str(tmp_path / "home" / "x")
