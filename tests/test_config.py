"""configs/: defaults, presets, unknown keys refused, CLI flags over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bankml.config import ConfigError, load_config, parse_host_port
from bankml.serve import Refusal, parse_serve_options


def test_defaults_are_the_originals():
    c = load_config()
    assert c["serve"]["listen"] == "127.0.0.1:18093" and c["serve"]["upstream"] == "127.0.0.1:18092"
    assert (c["serve"]["threads"], c["serve"]["ctx"], c["serve"]["keep_alive"]) == (3, 4096, "5m")
    lim = c["limits"]
    assert (lim["max_connections"], lim["max_body_bytes"], lim["max_line_bytes"], lim["max_header_lines"]) == (
        32, 16 << 20, 16384, 100)
    assert (lim["read_timeout_s"], lim["write_timeout_s"]) == (30, 120)


def test_presets_overlay_and_unknown_keys_refuse(tmp_path: Path):
    assert load_config("h200")["engine"]["n_slots"] == 8
    assert load_config("cpu")["serve"]["listen"] == "127.0.0.1:18093"
    bad = tmp_path / "bad.toml"
    bad.write_text('[serve]\nlisten = "127.0.0.1:1"\nlisen = "x"\n')
    with pytest.raises(ConfigError, match="unknown key 'serve.lisen'"):
        load_config(str(bad))
    bad.write_text("[serve]\nctx = \"big\"\n")
    with pytest.raises(ConfigError, match="'serve.ctx' must be int, not str"):
        load_config(str(bad))
    bad.write_text("[nonsense]\n")
    with pytest.raises(ConfigError, match="unknown key 'nonsense'"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="no config preset or file 'nope'"):
        load_config("nope")


def test_flags_override_config(tmp_path: Path):
    conf = tmp_path / "mine.toml"
    conf.write_text('[serve]\nlisten = "127.0.0.1:19000"\nctx = 2048\n')
    o = parse_serve_options(["bankml", "serve", "--config", str(conf)])
    assert o.listen == ("127.0.0.1", 19000) and o.ctx == 2048
    o = parse_serve_options(["bankml", "serve", "--config", str(conf), "--listen", "localhost:19001", "--ctx", "512"])
    assert o.listen == ("localhost", 19001) and o.ctx == 512
    assert parse_serve_options(["bankml", "serve", "--threads", "x"]).threads == 3  # unparsable: the default
    with pytest.raises(Refusal, match="--ctx"):
        parse_serve_options(["bankml", "serve", "--ctx", "-4"])


def test_host_port():
    assert parse_host_port("http://127.0.0.1:8080/", "--upstream") == ("127.0.0.1", 8080)
    assert parse_host_port("[::1]:9", "--listen") == ("::1", 9)
    for bad in ("127.0.0.1", "host:port", ":80", "h:70000"):
        with pytest.raises(ConfigError):
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
