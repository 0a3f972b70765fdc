"""The `bankml` command line: --help everywhere, bad usage is exit 1 with the usage, old spellings work.

Run through the installed console script, as a user runs it. `BANKML_MODELS` points at an empty
directory, so a command that wrongly went on to fetch the default model would show it there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import run_cli
from tiny_gguf import write_tiny_gguf

from bankml import __version__
from bankml.pin import fork_record

pytestmark = pytest.mark.timeout(120)

COMMANDS = ["version", "help", "guard", "sha256", "pin", "verify", "fork", "serve"]


@pytest.fixture
def env(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    return {"BANKML_MODELS": str(models)}


@pytest.fixture
def model(tmp_path):
    m = write_tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "m.gguf.FORK.json").write_text(json.dumps(fork_record(m)))
    return m


def fork_of(model):
    return str(model) + ".FORK.json"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_of_the_command_lists_every_command(bankml_cmd, flag, env):
    r = run_cli(bankml_cmd, flag, env=env)
    assert r.returncode == 0 and r.stdout.startswith("usage: bankml")
    for line in ("bankml guard FILE", "bankml verify [FILE --fork F]", "bankml serve [FILE --fork F] --native",
                 "exit codes: 0 ok, 1 unreadable or bad usage, 2 refused, 3 truncated"):
        assert line in r.stdout
    assert run_cli(bankml_cmd, "help", env=env).stdout == r.stdout


@pytest.mark.parametrize("command", COMMANDS[2:])
def test_help_of_each_command(bankml_cmd, command, env):
    for flag in ("--help", "-h"):
        r = run_cli(bankml_cmd, command, flag, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"usage: bankml {command} ") and r.stderr == ""


def test_serve_help_neither_fetches_nor_loads_anything(env):
    code = ("import sys; from bankml.cli import main; rc = main(['serve', '--help']);"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'sanic', 'numpy', 'gateway'));"
            "assert not heavy, heavy; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    for flag in ("--native", "--listen H:P", "--upstream H:P", "--spawn BIN", "--threads N", "--ctx N",
                 "--spec-ngram", "--slot-dir DIR", "--config NAME|PATH", "--keep-alive DUR", "--fork F"):
        assert flag in r.stdout
    assert not os.listdir(env["BANKML_MODELS"])  # nothing fetched


def test_the_version_in_its_three_spellings(bankml_cmd):
    for spelling in ("version", "--version", "-V"):
        r = run_cli(bankml_cmd, spelling)
        assert (r.returncode, r.stdout) == (0, f"bankml {__version__}\n")


@pytest.mark.parametrize("argv", [
    [],
    ["nonsense"],
    ["verify", "--bogus"],
    ["serve", "--native", "--bogus"],
    ["guard"],  # FILE is required
    ["serve", "--ctx"],  # a flag missing its value
    ["serve", "--native", "--listen"],
    ["pin", "x", "--fork"],
    ["serve", "--threads", "x"],  # once "the default", silently: now refused
    ["serve", "--ctx", "-4"],
    ["serve", "--native", "--listen", "nowhere"],
    ["serve", "--native", "--keep-alive", "5 minutes"],
    ["verify", "--engine", "prism"],  # once judged as mainline, silently
    ["guard", "x", "--rule-set", "typo"],
])
def test_bad_usage_is_exit_1_with_the_usage_on_stderr(bankml_cmd, argv, env):
    r = run_cli(bankml_cmd, *argv, env=env)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith("usage: bankml") and r.stdout == ""
    if len(argv) > 1:
        assert r.stderr.startswith(f"usage: bankml {argv[0]} ")  # that command's usage, not the top one
    assert "Traceback" not in r.stderr


def test_refusals_say_why(bankml_cmd, env):
    r = run_cli(bankml_cmd, "verify", "--engine", "prism", env=env)
    assert "'prism' is not supported: the only rule set is mainline" in r.stderr
    r = run_cli(bankml_cmd, "serve", "--threads", "x", env=env)
    assert "argument --threads: 'x' is not a positive integer" in r.stderr
    r = run_cli(bankml_cmd, "serve", "--native", "--bogus", "--ctx", "8", env=env)
    assert "unrecognized arguments: --bogus" in r.stderr


def test_what_serve_cannot_honour_is_refused_at_start_before_any_fetch(bankml_cmd, env, tmp_path):
    (tmp_path / "f").write_text("a file, not a directory")
    for argv, why in [
        (["--native", "--slot-dir", str(tmp_path / "f")], f"--slot-dir {tmp_path / 'f'}: File exists"),
        (["--native", "--spawn", "/bin/true"], "--spawn: llama-server's flags (P0)"),
        (["--native", "--registry", str(tmp_path / "none")], f"--registry {tmp_path / 'none'}: not a directory"),
        (["--native", "--registry"], f"--registry {tmp_path / 'forks'}: not a directory"),  # $BANKML_FORKS
        (["--registry", str(tmp_path)], "--registry / [registry] dir: serving every pinned model is --native's"),
        (["--native", "--config", "nope"], "no config preset or file 'nope'"),
    ]:
        r = run_cli(bankml_cmd, "serve", *argv, env={**env, "BANKML_FORKS": str(tmp_path / "forks")})
        assert r.returncode == 2 and r.stderr == f"bankml serve: refuse: {r.stderr.split('refuse: ', 1)[1]}"
        assert why in r.stderr, r.stderr
    assert not os.listdir(env["BANKML_MODELS"])


def test_old_spellings_still_work(bankml_cmd, model, tmp_path):
    fork = fork_of(model)
    r = run_cli(bankml_cmd, "guard", str(model), "--engine", "mainline", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["engine"] == "mainline"
    r = run_cli(bankml_cmd, "verify", str(model), "--fork", fork, "--engine", "mainline", "--json")
    assert r.returncode == 0 and '"engine": "mainline"' in r.stdout
    assert run_cli(bankml_cmd, "verify", str(model), "--rule-set", "mainline", "--fork", fork).returncode == 0
    assert run_cli(bankml_cmd, "verify", "--fork", fork, str(model)).returncode == 0  # FILE anywhere
    out = tmp_path / "o.json"
    for flag in ("-o", "--output"):
        r = run_cli(bankml_cmd, "fork", str(model), flag, str(out))
        sha = json.loads(out.read_text())["files"][0]["sha256"]
        assert r.returncode == 0 and r.stdout == f"{sha}  {model}\npinned in {out}\n"  # which file was hashed
        out.unlink()
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", fork)
    assert r.returncode == 0 and r.stdout.startswith("pinned ")
    r = run_cli(bankml_cmd, "pin", str(model))
    assert r.returncode == 1 and "--fork F is required" in r.stderr


def test_serve_of_an_unpinned_file_is_refused_with_exit_2(bankml_cmd, model, tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"files": []}')
    r = run_cli(bankml_cmd, "serve", str(model), "--fork", str(other), "--native", "--listen", "127.0.0.1:1",
                "--upstream", "127.0.0.1:2")
    assert r.returncode == 2
    assert r.stderr == "bankml serve: refuse: m.gguf has no sha256 record in FORK.json: unpinned, refused\n"
    r = run_cli(bankml_cmd, "serve", str(model), "--native", "--fork", str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "cannot read FORK.json" in r.stderr
